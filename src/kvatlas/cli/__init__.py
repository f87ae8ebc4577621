"""The `kvatlas` command. Each subcommand lives in its own module, imported only when run,
so `kvatlas plan` never pays for torch or matplotlib."""

from __future__ import annotations

import argparse
import importlib
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvatlas", description="The DeepSeek-V4 KV cache, planned and accounted to the byte.")
    parser.add_argument("--version", action="version", version=f"kvatlas {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        mod.add_parser(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def _version() -> str:
    from .. import __version__
    return __version__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:  # build only the parser that is needed
        parser = argparse.ArgumentParser(prog=f"kvatlas {argv[0]}", description=COMMANDS[argv[0]][1])
        mod = importlib.import_module(COMMANDS[argv[0]][0])
        mod.add_parser(parser)
        args = parser.parse_args(argv[1:])
    else:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not args.command:
            parser.print_help()
            return 0
        mod = importlib.import_module(COMMANDS[args.command][0])
    try:
        return mod.run(args) or 0
    except KvatlasError as exc:
        print(f"kvatlas {argv[0]}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
