"""`kvatlas observe`: the files kvatlas ships for watching it (observing.shipped): print one,
print where it is, list them, or write them all to a folder."""

from __future__ import annotations

import os
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
    if args.write:
        if os.path.exists(args.write) and not os.path.isdir(args.write):
            raise ConfigError("--write", f"{args.write!r} is a file", "give a folder (it is made if missing)")
        for p in shipped.write_all(args.write):
            print(p)
        return 0
    if args.list or not args.name:
        width = max(map(len, shipped.names()))
        for n in shipped.names():
            print(f"{n:<{width}}  {shipped.path(n)}")
        return 0
    if args.path:
        print(shipped.path(args.name))
    else:
        sys.stdout.write(shipped.read(args.name))
    return 0
