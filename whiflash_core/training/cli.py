"""`whiflash train ...`: drafter (and router) training commands.

Each sub-subcommand lives in its own module exposing `add_parser(subparsers)`, which registers
the command and sets `func`. Modules are imported only when `whiflash train` is used, and one
that does not exist yet (a trainer still being written) is simply not offered.
"""
from __future__ import annotations

import argparse
import importlib

# train subcommand -> module providing add_parser(subparsers)
TRAIN_COMMANDS = {
    "distill": "whiflash_core.training.distill",
    "derive": "whiflash_core.training.derive",
    "eagle3": "whiflash_core.training.eagle3",
    "dflash": "whiflash_core.training.dflash",
    "router": "whiflash_core.training.router",
    "copy-prior": "whiflash_core.training.copy_prior",
    "ship": "whiflash_core.training.ship",
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train", help="make distillation data and train drafters",
                                   description=__doc__)
    sub = parser.add_subparsers(dest="train_command", required=True, metavar="COMMAND")
    for name, module in TRAIN_COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            # only a missing command module is tolerated; a missing dependency of one is a bug
            if exc.name == module:
                continue
            raise
        mod.add_parser(sub)
    return parser
