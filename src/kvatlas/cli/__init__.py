"""The `kvatlas` command. Each subcommand lives in its own module, imported only when run,
so `kvatlas plan` never pays for torch or matplotlib.

Exit statuses: 0 done; 2 bad input (arguments, config files, traces: one line naming the field
and the fix, never a traceback); 1 a bug in kvatlas (one line saying where to report it; the
traceback only with --debug); 130 interrupted; 141 the reader of stdout went away (a pipe into
`head`), quietly, as a program killed by SIGPIPE would. Output that cannot be written (stdout
closed, or a full disk such as /dev/full) is a bad place to write, not a bug: status 2, one line.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..errors import KvatlasError

# name → (module, one-line help)
COMMANDS = {
    "models": ("kvatlas.cli.models", "list the bundled model presets"),
    "plan": ("kvatlas.cli.plan", "size every KV pool for a model and a memory budget"),
    "compare": ("kvatlas.cli.compare", "what SGLang and vLLM would allocate for the same deployment, beside kvatlas"),
    "alloc": ("kvatlas.cli.alloc", "allocate a plan for real and print its ledger"),
    "serve": ("kvatlas.cli.serve", "drive a real cache with a workload live, serving /metrics, /state and /healthz"),
    "simulate": ("kvatlas.cli.simulate", "run a workload offline through a real cache; plot memory over time"),
    "tune": ("kvatlas.cli.tune", "the flags to start SGLang, vLLM and kvatlas with for a workload, and what they hold"),
    "audit": ("kvatlas.cli.audit", "SGLang's own DeepSeek-V4 pools built offline (--sglang): every buffer mapped"),
    "route": ("kvatlas.cli.route", "an OpenAI-compatible router in front of vLLM replicas, by exact DeepSeek-V4 prefix hits"),
    "observe": ("kvatlas.cli.observe", "the Grafana dashboard, Prometheus rules and alerts, and JSON Schemas kvatlas ships"),
}

# Where an unexpected error asks to be reported (one place, so a fork changes one line).
BUG_REPORT = "the kvatlas issue tracker"
EXIT_BAD_INPUT, EXIT_BUG, EXIT_INTERRUPTED, EXIT_PIPE = 2, 1, 130, 141


class UsageError(Exception):
    """An argument argparse refused; carries argparse's own one-line message."""


class Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing a usage block and exiting, so every refusal,
    argparse's or kvatlas's, is one line of the same shape."""

    def error(self, message):
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvatlas", description="The DeepSeek-V4 KV cache, planned and accounted to the byte.")
    parser.add_argument("--version", action="version", version=f"kvatlas {_version()}")
    parser.add_argument("--debug", action="store_true", help="on an unexpected error, print the traceback")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        mod.add_parser(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def command_parser(name: str):
    """(module, parser) of one subcommand: what `kvatlas NAME` parses with and `--help` prints
    (the CLI reference in docs/ is made from it too)."""
    parser = Parser(prog=f"kvatlas {name}", description=COMMANDS[name][1])
    mod = importlib.import_module(COMMANDS[name][0])
    mod.add_parser(parser)
    parser.add_argument("--debug", action="store_true", help="on an unexpected error, print the traceback")
    return mod, parser


def _version() -> str:
    from .. import __version__
    return __version__


def _parse(argv: list[str]):
    """(module, args) for the command line; only the needed subcommand's parser is built."""
    if argv and argv[0] in COMMANDS:
        mod, parser = command_parser(argv[0])
        args = parser.parse_args(argv[1:])
        args.argv = list(argv)   # (simulate --ranks starts itself again, once per rank)
        return mod, args
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return None, args
    return importlib.import_module(COMMANDS[args.command][0]), args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    name = f"kvatlas {argv[0]}" if argv and argv[0] in COMMANDS else "kvatlas"
    debug = "--debug" in argv
    if sys.stdout is None:   # started with stdout closed (`>&-`): every print would vanish
        _say(f"{name}: error: stdout: is closed; run with stdout open (a terminal, a file or a pipe)")
        return EXIT_BAD_INPUT
    real, sys.stdout = sys.stdout, _Stdout(sys.stdout)
    try:
        return _run(name, argv, debug)
    finally:
        sys.stdout = real


def _run(name: str, argv: list[str], debug: bool) -> int:
    try:
        mod, args = _parse(argv)
        code = 0 if mod is None else (mod.run(args) or 0)
        sys.stdout.flush()   # a closed pipe shows here, not at interpreter exit
        return code
    except SystemExit as exc:   # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    except UsageError as exc:
        _say(f"{name}: error: {_one_line(str(exc))}; see {name} --help")
        return EXIT_BAD_INPUT
    except KvatlasError as exc:
        from .common import cli_terms
        _say(f"{name}: error: {cli_terms(_one_line(str(exc)))}")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        _say("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_PIPE
    except _OutputError as exc:
        _quiet_stdout()
        _say(f"{name}: error: stdout: cannot be written ({exc}); write it where there is room (a file on a "
             "disk with space, a pipe or the terminal)")
        return EXIT_BAD_INPUT
    except Exception as exc:   # noqa: BLE001: the last line of defence, reported as a bug
        return _bug(name, exc, debug)


def _bug(name: str, exc: BaseException, debug: bool) -> int:
    """An error no check anticipated: one line naming where, and where to report it."""
    if debug:
        import traceback
        traceback.print_exception(exc)
    where = _where(exc)
    _say(f"{name}: internal error: {type(exc).__name__}: {_one_line(str(exc))[:300]}{where}; this is a bug "
         f"in kvatlas: please report it to {BUG_REPORT} with the command line"
         + ("" if debug else " and the output of the same command with --debug"))
    return EXIT_BUG


class _OutputError(Exception):
    """stdout refused a write (a full disk, an I/O error); a closed pipe stays a BrokenPipeError."""


class _Stdout:
    """sys.stdout while a command runs: the same stream, except that a write or flush the OS
    refuses raises _OutputError, so it is told apart from an OSError elsewhere (a bug)."""

    def __init__(self, real) -> None:
        self._real = real

    def write(self, text):
        try:
            return self._real.write(text)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _OutputError(exc.strerror or str(exc)) from None

    def flush(self):
        try:
            return self._real.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise _OutputError(exc.strerror or str(exc)) from None

    def __getattr__(self, attr):
        return getattr(self._real, attr)


def _one_line(text: str) -> str:
    return " ".join(text.split())


# The package's own folder, resolved: a checkout is itself often named kvatlas (`git clone`
# makes one), so a path merely containing /kvatlas/ may be a test or a user's script.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def _where(exc: BaseException) -> str:
    """The innermost kvatlas frame the error passed through: names the bug without a traceback."""
    tb, hit, root = exc.__traceback__, None, _PACKAGE_DIR + os.sep
    while tb is not None:
        path = os.path.realpath(tb.tb_frame.f_code.co_filename)
        if path.startswith(root):
            hit = f" (at kvatlas/{path[len(root):].replace(os.sep, '/')}:{tb.tb_lineno})"
        tb = tb.tb_next
    return hit or ""


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (BrokenPipeError, ValueError):   # stderr gone too: nothing left to tell
        pass


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not complain again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):   # no real fd (captured in tests): nothing to flush
        pass
    try:   # what the failed write left buffered goes there too
        sys.stdout.flush()
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
