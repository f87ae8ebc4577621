"""The `kvatlas` command. Each subcommand lives in its own module, imported only when run,
so `kvatlas plan` never pays for torch or matplotlib.

Exit statuses: 0 done; 2 bad input (arguments, config files, traces: one line naming the field
and the fix, never a traceback); 1 a bug in kvatlas (one line saying where to report it; the
traceback only with --debug); 130 interrupted; 141 the reader of stdout went away (a pipe into
`head`), quietly, as a program killed by SIGPIPE would.
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
    "audit": ("kvatlas.cli.audit", "SGLang's own DeepSeek-V4 pools built offline (--sglang): every buffer mapped"),
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


def _version() -> str:
    from .. import __version__
    return __version__


def _parse(argv: list[str]):
    """(module, args) for the command line; only the needed subcommand's parser is built."""
    if argv and argv[0] in COMMANDS:
        parser = Parser(prog=f"kvatlas {argv[0]}", description=COMMANDS[argv[0]][1])
        mod = importlib.import_module(COMMANDS[argv[0]][0])
        mod.add_parser(parser)
        parser.add_argument("--debug", action="store_true", help="on an unexpected error, print the traceback")
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
        _say(f"{name}: error: {_one_line(str(exc))}")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        _say("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_PIPE
    except Exception as exc:   # noqa: BLE001: the last line of defence, reported as a bug
        if debug:
            import traceback
            traceback.print_exc()
        where = _where(exc)
        _say(f"{name}: internal error: {type(exc).__name__}: {_one_line(str(exc))[:300]}{where}; this is a bug "
             f"in kvatlas: please report it to {BUG_REPORT} with the command line"
             + ("" if debug else " and the output of the same command with --debug"))
        return EXIT_BUG


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _where(exc: BaseException) -> str:
    """The innermost kvatlas frame the error passed through: names the bug without a traceback."""
    tb, hit = exc.__traceback__, None
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if f"{os.sep}kvatlas{os.sep}" in path:
            hit = f" (at kvatlas/{path.rsplit(os.sep + 'kvatlas' + os.sep, 1)[1]}:{tb.tb_lineno})"
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


if __name__ == "__main__":
    sys.exit(main())
