"""Progress bars: on a terminal only (stderr a TTY), never with --json or when piped."""

import io
import sys

from kvatlas.cli import main
from kvatlas.observing.progress import Bar, wanted


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_no_bar_when_piped(capsys):
    assert not wanted()   # pytest's captured stderr is no terminal
    assert main(["compare", "tiny-v4", "--memory", "256MiB", "--max-running-requests", "4", "--max-model-len", "2048"]) == 0
    assert capsys.readouterr().err == ""


def test_bar_on_a_terminal_shows_time_left(monkeypatch):
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    assert wanted() and not wanted(quiet=True)
    with Bar(10, "simulate", True, unit="requests") as bar:
        bar.update(5, force=True)
    text = tty.getvalue()
    assert "simulate" in text and "time left" in text and "5/10" in text


def test_compare_draws_on_a_terminal_but_not_with_json(monkeypatch, capsys):
    args = ["compare", "tiny-v4", "--memory", "256MiB", "--max-running-requests", "4", "--max-model-len", "2048"]
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(args + ["--json"]) == 0
    assert tty.getvalue() == ""
    assert main(args) == 0
    assert "compare" in tty.getvalue()
