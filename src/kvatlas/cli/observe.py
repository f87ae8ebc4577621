"""`kvatlas observe`: the files kvatlas ships for watching it (observing.shipped): print one,
print where it is, list them, or write them all to a folder."""

from __future__ import annotations

import sys

from ..errors import ConfigError
from ..observing import shipped


def add_parser(p) -> None:
    p.add_argument("name", nargs="?", help="dashboard, rules, rules-test, or a document's schema "
                   "(kvatlas.plan, kvatlas.state, …): print the file")
    p.add_argument("--path", action="store_true", help="print the file's path instead of its contents")
    p.add_argument("--list", action="store_true", help="every shipped file and its path")
    p.add_argument("--write", metavar="DIR", help="copy every shipped file into DIR (grafana/, prometheus/, schemas/)")


def run(args) -> int:
    if args.write is not None:
        beside = [f for f, on in (("NAME", args.name is not None), ("--list", args.list), ("--path", args.path)) if on]
        if beside:
            raise ConfigError("--write", f"writes every file, and {beside[0]} picks one",
                              f"drop {beside[0]}, or drop --write")
        for p in shipped.write_all(args.write, "--write"):
            print(p)
        return 0
    if args.list and (args.name is not None or args.path):
        raise ConfigError("--list", "lists every file, and " + ("NAME" if args.name is not None else "--path")
                          + " asks for one", "drop one of them")
    if args.path and args.name is None:
        raise ConfigError("--path", "needs the NAME of a file", "give e.g. kvatlas observe --path rules")
    if args.list or args.name is None:
        width = max(map(len, shipped.names()))
        for n in shipped.names():
            print(f"{n:<{width}}  {shipped.path(n)}")
        return 0
    if args.path:
        print(shipped.path(args.name))
    else:
        sys.stdout.write(shipped.read(args.name))
    return 0
