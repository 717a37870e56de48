"""`whiflash` command line: generate, serve, bench, train, info.

Each subcommand lives in its own module and registers itself through `add_parser(subparsers)`;
modules are imported lazily so `whiflash --help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand name -> module that provides add_parser(subparsers) and run(args)
SUBCOMMANDS = {
    "generate": "whiflash_core.generate_cli",
    "serve": "app.serve_cli",
    "bench": "whiflash_core.bench.cli",
    "train": "whiflash_core.training.cli",
    "info": "whiflash_core.info_cli",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="whiflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, module in SUBCOMMANDS.items():
        if wanted is not None and name != wanted:
            sub.add_parser(name)
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name and module.startswith(exc.name):
                sub.add_parser(name, help="(not available in this build)")
                continue
            raise
        mod.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
