"""Command-line flags generated from settings dataclasses, so each default is written once.

One `--flag` per field: its type from the annotation, its default the field's, its help the
field's `help` metadata. Declare fields with `setting(default, help, ...)`:

    steps: int = setting(2000, "optimizer steps (the schedule's length)")

Metadata understood: help, choices, metavar, flag (the flag's name, e.g. "--no-autocast" for a
field that defaults to True), hidden (no help line), cli=False (no flag at all). A field without a
default is a required flag; a bool defaulting to False is a switch, one defaulting to True gets a
`--no-...` switch that turns it off; a list[...] field takes one or more values.
"""
from __future__ import annotations

import argparse
import shlex
import types
from dataclasses import MISSING, Field, field, fields
from typing import Literal, Any, Union, get_args, get_origin, get_type_hints


def setting(default: Any = MISSING, help: str | None = None, **meta: Any) -> Any:
    """A dataclass field with its CLI help (and other flag metadata) attached. `default=list`
    means an empty list (a fresh one per instance)."""
    if default is list:
        return field(default_factory=list, metadata={"help": help, **meta})
    return field(default=default, metadata={"help": help, **meta})


def _plain(tp: Any) -> Any:
    """`int | None` -> int (argparse converts the value; None stays the default)."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _flag(f: Field) -> str:
    """The flag of field f: its own, else --name (--no-name for a bool that defaults to True)."""
    name = f.name.replace("_", "-")
    return f.metadata.get("flag", f"--no-{name}" if f.default is True else f"--{name}")


def _add(p: argparse.ArgumentParser, f: Field, tp: Any) -> None:
    meta = f.metadata
    kw: dict[str, Any] = {"help": argparse.SUPPRESS if meta.get("hidden") else meta.get("help")}
    kw.update({k: meta[k] for k in ("choices", "metavar") if k in meta})
    required = f.default is MISSING and f.default_factory is MISSING
    if tp is bool:
        p.add_argument(_flag(f), dest=f.name, action="store_false" if f.default else "store_true", **kw)
        return
    if get_origin(tp) is list:
        kw.update(nargs="+", type=get_args(tp)[0])
    elif get_origin(tp) is Literal:   # a closed set of strings: its values are the choices
        kw.update(type=str, choices=get_args(tp))
    else:
        kw["type"] = tp
    if required:
        kw["required"] = True
    else:
        kw["default"] = f.default_factory() if f.default is MISSING else f.default
    p.add_argument(_flag(f), dest=f.name, **kw)


def flag_names(cls: type) -> set[str]:
    """The fields of the dataclass `cls` that have a flag (all but those with cli=False)."""
    return {f.name for f in fields(cls) if f.metadata.get("cli", True)}


def command_flags(cls: type, values: dict[str, Any], skip: tuple[str, ...] = ()) -> str:
    """The flags that set `values` (a `cls` as a dict, e.g. a checkpoint's settings), spelled as
    add_arguments spells them, so the line parses back to the same values: a switch where a bool
    differs from its default, `--name v1 v2` for a list; fields without a flag, those in `skip`
    and None or empty values left out."""
    flagged, out = flag_names(cls), []
    for f in fields(cls):
        v = values.get(f.name)
        if f.name not in flagged or f.name in skip or v is None or v == "" or v == []:
            continue
        if isinstance(v, bool):
            if v != f.default:
                out.append(_flag(f))
            continue
        out.append(_flag(f))
        out += [shlex.quote(str(x)) for x in (v if isinstance(v, list) else [v])]
    return " ".join(out)


def add_arguments(p: argparse.ArgumentParser, cls: type, only: tuple[str, ...] | None = None) -> None:
    """One flag per field of the dataclass `cls` (or per field named in `only`); fields with
    cli=False are left out."""
    hints, flagged = get_type_hints(cls), flag_names(cls)
    for f in fields(cls):
        if f.name in flagged and (only is None or f.name in only):
            _add(p, f, _plain(hints[f.name]))


def from_args(cls: type, args: argparse.Namespace):
    """The dataclass `cls` from parsed flags (fields without a flag keep their default)."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
