"""Typed, nested config dataclasses and their flat command-line form.

Each component keeps its own config dataclass next to it (`CorpusConfig` beside the corpus reader,
`ObjectiveConfig` beside the labels, ...); a command's config nests them. On the command line (and
in `from_flags`) the nesting is flattened: every leaf field is one flag named after the field (or
its `flag=`), so leaf names are unique within a command. Help text lives once, in `opt(help=...)`.
A recipe (`--config FILE.yaml`, docs/recipes.md) is that flat form in YAML: `recipe_flags` reads
and type-checks one.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Collection, Iterator
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



# ----------------------------------------------------------------------------------------------
# Recipes: a command's flags kept in a YAML file (`--config FILE`, docs/recipes.md)


def recipe_keys(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """{key: (field, resolved type)} a recipe of `cls` may set: each leaf's flag name with
    underscores, the form `to_flags` and `--dump-config` write."""
    return {flag_name(field): (field, kind) for field, kind in leaf_fields(cls)}


def read_recipe(path: str) -> dict[str, Any]:
    """The top-level mapping of a YAML recipe file; ValueError naming the file (and line) for
    invalid YAML, a key given twice, or a document that is not a mapping."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            document = yaml.load(f, Loader=_recipe_loader())  # noqa: S506 (a SafeLoader subclass)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ValueError(f"{path}: not valid YAML{where}: {error.problem}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {error}") from None
    if document is None:  # an empty file (or only comments): no settings
        return {}
    if not isinstance(document, dict):
        raise ValueError(f"{path}: a recipe is a mapping of flag names to values, got a {type(document).__name__}")
    return document


def recipe_flags(cls: type, path: str, *, command_only: Collection[str] = ()) -> dict[str, Any]:
    """The flat {flag name (underscores): value} of the recipe at `path` for the config `cls`, each
    value checked against its field's type. A key is a flag name with underscores or dashes
    (`batch_size` or `batch-size`). An unknown key, a key given in both forms, or a value of the
    wrong type is a ValueError of one line naming the file and the key; `command_only` names the
    command's flags that are not settings of `cls` (--threads, --progress): typed, never in a file."""
    keys = recipe_keys(cls)
    flags: dict[str, Any] = {}
    for key, value in read_recipe(path).items():
        name = str(key).replace("-", "_")
        if name in command_only:
            raise ValueError(f"{path}: {key!r} is not a recipe key: give --{name.replace('_', '-')} on the command line")
        if name not in keys:
            close = difflib.get_close_matches(name, keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{path}: unknown key {key!r}{hint}; a recipe's keys are the command's flags without '--'")
        if name in flags:
            raise ValueError(f"{path}: key {name!r} is given twice (with underscores and with dashes)")
        flags[name] = _checked_value(value, keys[name][1], path=path, key=name)
    return flags


def _checked_value(value: Any, kind: Any, *, path: str, key: str) -> Any:
    """`value` if it has the type `kind` (a float field takes an integer, returned as a float);
    else a ValueError naming the key."""
    args = typing.get_args(kind)
    if isinstance(kind, types.UnionType) and type(None) in args:
        if value is None:
            return None
        kind = next(a for a in args if a is not type(None))
    if kind is bool:
        ok, expected = isinstance(value, bool), "true or false"
    elif kind is int:
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        expected, value = "a finite number", float(value) if ok else value
    elif kind is str:
        ok, expected = isinstance(value, str), "a string (quote it)"
    elif typing.get_origin(kind) is list and typing.get_args(kind) == (int,):
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        expected = "a list of integers, e.g. [1, 9, 17]"
    else:  # a field type this mapping does not know: a bug here, not the user's
        raise TypeError(f"recipe key {key!r}: no check for the type {kind}")
    if not ok:
        raise ValueError(f"{path}: {key!r} must be {expected}, got {value!r}")
    return value


def _recipe_loader():
    """PyYAML's SafeLoader with two changes for recipes: a key given twice is an error (PyYAML
    keeps the last silently), and `1e-3` is a float (YAML 1.2; PyYAML's YAML 1.1 reads it as a
    string, so `lr: 1e-3` would be refused as the wrong type)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice", key_node.start_mark
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )
    return Loader
