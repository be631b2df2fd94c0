"""Typed, nested config dataclasses and their flat command-line form.

Each component keeps its own config dataclass next to it (`CorpusConfig` beside the corpus reader,
`ObjectiveConfig` beside the labels, ...); a command's config nests them. On the command line (and
in `from_flags`) the nesting is flattened: every leaf field is one flag named after the field (or
its `flag=`), so leaf names are unique within a command. Help text lives once, in `opt(help=...)`.
A recipe (`--config FILE.yaml`, docs/recipes.md) is that flat form in YAML (pipeline/recipes.py).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from typing import Any


def opt(help: str, *, flag: str | None = None, **kwargs) -> Any:
    """A dataclass field with its CLI help (and a flag name when it differs from the field name)."""
    metadata = {"help": help}
    if flag is not None:
        metadata["flag"] = flag
    return dataclasses.field(metadata=metadata, **kwargs)


def group(cls: type) -> Any:
    """A nested config field: its leaf fields become flags of the enclosing command. It defaults to
    `cls()` (a group with a required leaf must be given)."""
    return dataclasses.field(default_factory=cls, metadata={"group": cls})


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag", field.name)


def leaf_fields(cls: type) -> Iterator[tuple[dataclasses.Field, Any]]:
    """(field, resolved type) of every leaf of `cls`, nested groups flattened in declaration order."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        nested = field.metadata.get("group")
        if nested is not None:
            yield from leaf_fields(nested)
        elif field.metadata.get("cli", True):  # cli=False: set by the program, never a flag
            yield field, hints[field.name]


def is_required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def from_flags(cls: type, **flags: Any):
    """Build the nested config `cls` from flat {leaf name: value}, a leaf named by its flag (with
    underscores) or its field name; leaves not given keep their defaults. An unknown name is a
    ValueError naming it."""
    remaining = dict(flags)

    def build(kind: type):
        kwargs = {}
        for field in dataclasses.fields(kind):
            nested = field.metadata.get("group")
            if nested is not None:
                kwargs[field.name] = build(nested)
            elif field.metadata.get("cli", True):
                for key in {flag_name(field), field.name} & set(remaining):  # flag name or field name
                    kwargs[field.name] = remaining.pop(key)
        return kind(**kwargs)

    config = build(cls)
    if remaining:
        raise ValueError(f"unknown setting(s) for {cls.__name__}: {', '.join(sorted(remaining))}")
    return config


def to_flags(config: Any) -> dict[str, Any]:
    """The flat {leaf flag name: value} form of a nested config (inverse of from_flags)."""
    flat = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.metadata.get("group") is not None:
            flat.update(to_flags(value))
        elif field.metadata.get("cli", True):
            flat[flag_name(field)] = list(value) if isinstance(value, tuple) else value
    return flat
