"""Property: whatever arguments a subcommand is given, it never ends in a traceback or an
internal error. Random command lines mix the subcommand's real flags with random values and
random text; each runs in-process (`kvatlas.cli.main`), in a scratch directory, with allocation
cut short: a command line good enough to reach allocation has passed every check there is before
it, which is what this property is about (what happens after is the other tests' business)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvatlas.cli import COMMANDS, Parser, main
from kvatlas.errors import KvatlasError

_FLAGS = {}


def flags(cmd: str) -> list[str]:
    """Every option string the subcommand's parser knows."""
    if cmd not in _FLAGS:
        import importlib
        p = Parser(prog=cmd)
        importlib.import_module(COMMANDS[cmd][0]).add_parser(p)
        _FLAGS[cmd] = sorted(s for a in p._actions for s in a.option_strings if s not in ("-h", "--help"))
    return _FLAGS[cmd]


VALUES = st.one_of(
    st.sampled_from(["0", "-1", "1", "4", "64MiB", "1GiB", "nan", "inf", "-inf", "1e30", "1.5", "", " ", "tiny-v4",
                     "deepseek-v4-flash", "x", "uniform:1:5", "exp:0", "lognormal:5:99", "all", "cpu", "plain",
                     "0.0.0.0", "::1", "-0", "1_000", "0x10", "9" * 50, "on", "off", "fp8", "bf16", "v4", "a.png",
                     "no/dir/a.png", "sglang,vllm", ",", "kvatlas:x", "-", "--", "1e-300", "64mib"]),
    st.text(max_size=12),
    st.integers(-2**70, 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


@st.composite
def command_lines(draw):
    cmd = draw(st.sampled_from(sorted(COMMANDS)))
    argv = [cmd]
    if cmd != "models" and draw(st.booleans()):
        argv.append(draw(st.sampled_from(["tiny-v4", "deepseek-v4-pro", "nope", ""])))
    for _ in range(draw(st.integers(0, 6))):
        argv.append(draw(st.sampled_from(flags(cmd))))
        if draw(st.integers(0, 4)):
            argv.append(draw(VALUES))
    if cmd != "models" and draw(st.booleans()):
        argv += ["--memory", "64MiB", "--max-running-requests", "4"]
    return argv


class Allocated(KvatlasError):
    """Stops a command that got as far as allocating (exit 2 like any refusal)."""


@pytest.fixture
def sandbox(monkeypatch, tmp_path):
    from kvatlas.cache import arena

    def stop(*a, **k):
        raise Allocated("allocation reached: every check before it passed")
    monkeypatch.setattr(arena.Arena, "__init__", stop)
    monkeypatch.chdir(tmp_path)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(argv=command_lines())
def test_random_command_lines_never_end_in_a_traceback(sandbox, capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err, (argv, err)
    assert rc in (0, 2), (argv, rc, err)
    if rc == 2:   # one line saying what is wrong (a serve --host 0.0.0.0 warning may precede it)
        lines = err.strip().splitlines()
        assert len(lines) <= 2 and lines[-1].startswith("kvatlas") and ": error: " in lines[-1], (argv, err)
