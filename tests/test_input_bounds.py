"""Sizes and counts from the user are checked against a documented bound before any work: session
turns (per session and in all), trace files and pipes (a regular file or a pipe, a size and a
line bound); and a session's memory is linear in its turns (bench/sim_turns.py measures it)."""

import os
import threading

import numpy as np
import pytest

from kvatlas.cli import main
from kvatlas.driving import sessions as sessions_mod
from kvatlas.driving import traces
from kvatlas.driving.sessions import MAX_SESSION_REQUESTS, MAX_TURNS_PER_SESSION, sessions
from kvatlas.errors import ConfigError

TINY = ["tiny-v4", "--memory", "64MiB", "--max-running-requests", "4", "--backend", "none"]


@pytest.fixture
def nothing_generated(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a session was generated before the bound was checked")
    monkeypatch.setattr(sessions_mod, "_one_session", refuse)


@pytest.mark.parametrize("turns,rate,problem", [
    (str(MAX_TURNS_PER_SESSION + 1), 1, "allows sessions of more than 100,000 turns"),
    ("uniform:1:200000", 1, "allows sessions of more than 100,000 turns"),
    ("1e6", 1, "allows sessions of more than 100,000 turns"),
    ("exp:300000", 4, "a session drew"),                     # a long tail: checked on the draws
    ("100000", 100, r"turns in all \(each one a request\)"),   # ~100 sessions × 100,000 turns
    ("lognormal:50000:4", 16, "a session drew"),
])
def test_turns_beyond_the_bound_are_refused_before_generating(nothing_generated, turns, rate, problem):
    with pytest.raises(ConfigError, match=problem) as exc:
        sessions(rate_per_s=rate, duration_s=1, turns=turns, seed=1)
    assert exc.value.field == "turns"


def test_the_cli_names_the_flag_and_the_bound(nothing_generated, capsys, tmp_path):
    assert main(["simulate", *TINY, "--duration", "1", "--turns", "1000000", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--turns: 1000000 allows sessions of more than 100,000 turns" in err
    assert main(["serve", *TINY, "--rate", "100", "--turns", "100000"]) == 2
    assert f"ask for at most {MAX_SESSION_REQUESTS:,}" in capsys.readouterr().err


def test_a_session_shares_one_content_array_across_its_turns():
    reqs = sessions(rate_per_s=2, duration_s=1, turns="300", followup_len="700", output="600", seed=3)
    first = [r for r in reqs if r.after is None]
    for s in first:
        mine = [r for r in reqs if r.id.startswith(s.id.split("t")[0] + "t")]
        data = {id(np.asarray(r.blocks).base) for r in mine} | {id(np.asarray(r.block_lens).base) for r in mine}
        assert len(data) == 2 and len(mine) == 300        # two arrays per session, not one copy per turn
        last = mine[-1]
        assert len(last.blocks) == len(mine[0].blocks) + 299 * 4 and np.asarray(last.blocks).base is np.asarray(s.blocks).base
        assert last.prompt_tokens == sum(last.block_lens[:-2])      # all earlier turns + its follow-up


# ------------------------------------------------------------------ traces: kind, size and lines
def _reqs(path, **kw):
    return traces.read_trace(str(path), **kw)[0]


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null", "/dev/urandom"])
def test_a_device_is_not_a_trace(device):
    with pytest.raises(ConfigError, match="is a character device, not a regular file or a pipe"):
        _reqs(device)


def test_a_pipe_is_read_and_a_pipe_without_end_is_stopped(tmp_path, monkeypatch):
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    line = b'{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5}\n'

    def feed(n):
        try:
            with open(fifo, "wb") as f:
                for _ in range(n):
                    f.write(line)
        except BrokenPipeError:   # the reader stopped at its bound
            pass
    t = threading.Thread(target=feed, args=(3,))
    t.start()
    assert len(_reqs(fifo)) == 3
    t.join(timeout=10)
    monkeypatch.setattr(traces, "MAX_TRACE_LINES", 50)
    t = threading.Thread(target=feed, args=(10_000,))
    t.start()
    with pytest.raises(ConfigError, match="goes on past .* or 50 lines"):
        _reqs(fifo)
    t.join(timeout=10)


def test_a_file_past_the_size_bound_is_refused_unread(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5}\n' * 100)
    monkeypatch.setattr(traces, "MAX_TRACE_BYTES", 1000)
    with pytest.raises(ConfigError, match=r"is 5,700 bytes, more than the 1,000-byte bound"):
        _reqs(path)


def test_a_line_that_never_ends_stops_at_the_size_bound(tmp_path, monkeypatch):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 5}\n' + b"x" * 5000)
    monkeypatch.setattr(traces, "MAX_TRACE_BYTES", 4000)
    monkeypatch.setattr(traces, "_check_kind", lambda fh, path: None)   # as a pipe would: no size up front
    with pytest.raises(ConfigError, match="line 2 never ends"):
        _reqs(path, max_line_bytes=1000)
