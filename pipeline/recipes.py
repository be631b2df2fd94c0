"""Recipes: a command's flat flags kept in a YAML file (`--config FILE`, `--dump-config`;
docs/recipes.md). One YAML dialect on both sides: PyYAML's YAML 1.1 with two changes (a key given
twice is an error; `1e-3` is a float, as in YAML 1.2), and the dumper quotes every string the
loader would read as another type, so what `--dump-config` prints loads back to the same values.

A recipe is data from outside, read within bounds: a regular file (a FIFO or a device is refused
before it is read, and never opened blocking), at most RECIPE_MAX_BYTES of UTF-8, at most
RECIPE_MAX_NODES values once its aliases are expanded (a few hundred bytes of aliases can stand for
millions of values), nested at most RECIPE_MAX_DEPTH deep. Every error is one line naming the file
and never prints a value longer than a short excerpt.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import stat
import types
import typing
from collections.abc import Collection, Hashable
from typing import Any

from pipeline.config import flag_name, leaf_fields, to_flags

RECIPE_MAX_BYTES = 256 << 10  # a recipe of every flag with long paths is a few KiB
RECIPE_MAX_NODES = 10_000  # values once aliases are expanded: ~60 keys, a list of a few hundred layer ids
RECIPE_MAX_DEPTH = 16  # a recipe is a mapping of scalars and flat lists: depth 2
SHOWN_CHARS = 60  # the most of a value an error line shows

# YAML 1.2's float without a dot (`1e-3`, `2E5`), which YAML 1.1 reads as a string: read by the
# loader as a float, so quoted by the dumper when it is a string.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
_LINE_BREAKS = "\x85\u2028\u2029"


def recipe_keys(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """{key: (field, resolved type)} a recipe of `cls` may set: each leaf's flag name with
    underscores, the form `to_flags` and `--dump-config` write."""
    return {flag_name(field): (field, kind) for field, kind in leaf_fields(cls)}


def shown(value: Any) -> str:
    """A value as an error line shows it: its repr cut to SHOWN_CHARS, a list or mapping by its size
    (an alias-expanded value is never printed)."""
    if isinstance(value, (list, tuple, set, dict)):
        kind = "mapping" if isinstance(value, dict) else "list"
        return f"a {kind} of {len(value)} item(s)"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[: SHOWN_CHARS - 5]}...{text[-2:]}"


def _short(text: str) -> str:
    """One line of at most a few excerpts' length: a YAML library message quotes the file."""
    line = " ".join(str(text).split())
    return line if len(line) <= 4 * SHOWN_CHARS else line[: 4 * SHOWN_CHARS - 3] + "..."


def recipe_text(path: str) -> str:
    """The text of the recipe at `path`: a regular file of at most RECIPE_MAX_BYTES, UTF-8.
    Checked before it is read (stat), opened without blocking and checked again (fstat), so a
    FIFO, a terminal or a device is refused at once rather than waited on or read forever."""
    try:
        kind = _file_kind(os.stat(path).st_mode)
        if kind is None:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
            with os.fdopen(fd, "rb") as f:
                kind = _file_kind(os.fstat(f.fileno()).st_mode)  # replaced between the stat and the open
                data = f.read(RECIPE_MAX_BYTES + 1) if kind is None else b""
    except OSError as error:
        raise ValueError(f"{path}: cannot read it ({error.strerror})") from None
    if kind is not None:
        raise ValueError(f"{path}: a {kind}, not a regular file; a recipe is a YAML file")
    if len(data) > RECIPE_MAX_BYTES:
        raise ValueError(f"{path}: larger than {RECIPE_MAX_BYTES >> 10} KiB; a recipe is a short mapping of flags to values")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}); a recipe is a UTF-8 YAML file") from None


def _file_kind(mode: int) -> str | None:
    """None for a regular file, else what the path is."""
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISDIR: "directory", stat.S_ISFIFO: "FIFO", stat.S_ISCHR: "character device", stat.S_ISBLK: "block device",
             stat.S_ISSOCK: "socket"}  # fmt: skip
    return next((name for test, name in kinds.items() if test(mode)), "special file")


def read_recipe(path: str) -> dict[str, Any]:
    """The top-level mapping of a YAML recipe file; ValueError of one line naming the file (and
    line) for a file out of bounds, invalid YAML, a key given twice or not a name, or a document
    that is not a mapping."""
    import yaml

    text, loader = recipe_text(path), None
    try:
        loader = recipe_loader()(text)  # its reader refuses non-printable characters here
        node = loader.get_single_node()
        if node is not None:
            _check_size(node, path=path)
        document = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ValueError(f"{path}: not valid YAML{where}: {_short(error.problem)}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML: {_short(str(error).splitlines()[0])}") from None
    except RecursionError:  # the composer recurses per level of nesting
        raise ValueError(f"{path}: nested too deeply; a recipe is a flat mapping of flags to values") from None
    finally:
        if loader is not None:
            loader.dispose()
    if document is None:  # an empty file (or only comments): no settings
        return {}
    if not isinstance(document, dict):
        raise ValueError(f"{path}: a recipe is a mapping of flag names to values, got a {type(document).__name__}")
    return document


def _check_size(root, *, path: str) -> None:
    """Refuse a document of more than RECIPE_MAX_NODES values with its aliases expanded, nested
    deeper than RECIPE_MAX_DEPTH, or holding itself (an alias inside its own anchor). The count
    is memoised per node, so a bomb is measured in the time its distinct nodes take."""
    sizes: dict[int, int] = {}

    def size(node, depth: int, open_nodes: set[int]) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise ValueError(f"{path}: an alias refers to a value that holds it (a recursive document); a recipe is a flat mapping")
        if depth > RECIPE_MAX_DEPTH:
            raise ValueError(f"{path}: nested deeper than {RECIPE_MAX_DEPTH} levels; a recipe is a flat mapping of flags to values")
        children = [] if isinstance(node.value, str) else node.value
        open_nodes.add(key)
        total = 1
        for child in children:
            for item in child if isinstance(child, tuple) else (child,):  # a mapping's (key, value) pairs
                total += size(item, depth + 1, open_nodes)
                if total > RECIPE_MAX_NODES:
                    raise ValueError(
                        f"{path}: more than {RECIPE_MAX_NODES:,} values once its aliases are expanded; a recipe is a flat "
                        "mapping of flags to values"
                    )
        open_nodes.discard(key)
        sizes[key] = total
        return total

    size(root, 0, set())


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
            close = difflib.get_close_matches(name, keys, n=1) if len(name) <= SHOWN_CHARS else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{path}: unknown key {shown(key)}{hint}; a recipe's keys are the command's flags without '--'")
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
        raise ValueError(f"{path}: {key!r} must be {expected}, got {shown(value)}")
    return value


def recipe_loader():
    """PyYAML's SafeLoader in the recipes' dialect: a key given twice, or a key that is a list or a
    mapping, is an error (PyYAML keeps the last of two silently and fails on the other with a
    TypeError), and `1e-3` is a float (YAML 1.2; PyYAML's YAML 1.1 reads it as a string, so
    `lr: 1e-3` would be refused as the wrong type)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, Hashable) or isinstance(key, tuple):  # built empty here, filled later: name its kind
                    kind = "mapping" if isinstance(key, dict) else "list" if isinstance(key, (list, tuple)) else type(key).__name__
                    raise yaml.constructor.ConstructorError(None, None, f"a key must be a flag name, got a {kind}", key_node.start_mark)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {shown(key)} is given twice", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))
    return Loader


def dump_recipe(config) -> str:
    """The YAML recipe of a resolved config: every leaf, flag names with underscores, in the
    command's flag order. Strings the loader would read as another type (`1e3`, `yes`, `~`, `0x10`,
    a date) are quoted: the dumper resolves plain scalars with the loader's rules, so `--config`
    reads the dump back to the same config (tests/test_recipe_dialect.py)."""
    import yaml

    class Dumper(yaml.SafeDumper):  # one key per line; a list on its key's line ([1, 9, 17])
        pass

    Dumper.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))
    # NEL and the Unicode line and paragraph separators are line breaks to the reader: only a
    # double-quoted scalar keeps them (escaped), a plain or single-quoted one folds them to spaces.
    Dumper.add_representer(str, lambda dumper, value: dumper.represent_scalar(
        "tag:yaml.org,2002:str", value, style='"' if any(c in value for c in _LINE_BREAKS) else None))  # fmt: skip
    Dumper.add_representer(list, lambda dumper, value: dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=True))
    return yaml.dump(to_flags(config), Dumper=Dumper, sort_keys=False, allow_unicode=True, width=1000)
