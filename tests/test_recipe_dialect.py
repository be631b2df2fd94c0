"""Recipes as data from outside (pipeline/recipes.py; docs/recipes.md): a recipe is read within
bounds (a regular file, its size, its values with aliases expanded, its nesting) and every refusal is
one line naming the file that never prints an expanded value; and `--dump-config` speaks the
loader's dialect, so what it prints reads back to the same config for every command, whatever the
strings look like."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import yaml

from pipeline.config import from_flags
from pipeline.recipes import RECIPE_MAX_BYTES, RECIPE_MAX_NODES, recipe_flags, recipe_loader
from tests.test_recipes import COMMANDS, invoke

def one_error_line(result, recipe: str | None = None) -> str:
    """The refusal's one line (exit 2, no traceback), which names the recipe when given."""
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.output
    if recipe is not None:
        assert errors[0].startswith(f"Error: --config {recipe}: "), errors[0]
    return errors[0]


# ----------------------------------------------------------------------------------------------
# Bounds: size, aliases, nesting, keys, what the path is, the encoding


def _alias_bomb(levels: int) -> str:
    """A few hundred bytes whose last alias stands for 10**levels values."""
    lines = ["cache: /c", "out: /o", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text, message",
    [
        (_alias_bomb(8), f"more than {RECIPE_MAX_NODES:,} values once its aliases are expanded"),  # 10^8 values in ~700 bytes
        ("cache: /c\nout: /o\nlayers: &l [1, *l]\n", "an alias refers to a value that holds it"),
        ("cache: /c\nout: /o\nx: " + "[" * 40 + "]" * 40 + "\n", "nested deeper than 16 levels"),
        ("cache: /c\nout: /o\nx: " + "[" * 5000 + "]" * 5000 + "\n", "nested"),  # deeper than Python's own recursion
        ("cache: /c\nout: /o\n? [1, 2]\n: x\n", "a key must be a flag name, got a list"),
        ("cache: /c\nout: /o\n{a: 1}: x\n", "a key must be a flag name, got a mapping"),
        ("cache: /c\nout: /o\nx: !!python/object/apply:os.system [echo hi]\n", "not valid YAML (line 3): could not determine a constructor"),
        ("cache: /c\nout: /o\nx: \x01\n", "not valid YAML: unacceptable character #x0001"),
        ("cache: /c\nout: /o\n? " + "k" * 5000 + "\n: 1\n", "unknown key 'kkkkk"),  # an explicit key: no length limit
    ],
    ids=["alias-bomb", "recursive-alias", "deep", "very-deep", "list-key", "mapping-key", "python-tag", "control-char", "long-key"],
)
def test_a_recipe_out_of_bounds_is_one_short_line(tmp_path, text, message):
    """A bomb of aliases (10^8 values in a few hundred bytes), a value that holds itself, deep
    nesting, a list or mapping as a key, a code tag: refused in one line that shows no expanded
    value (today's MemoryError, TypeError and RecursionError tracebacks)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    line = one_error_line(invoke("train", "--config", str(recipe), "--dump-config"), str(recipe))
    assert message in line and len(line) < 400, line


def test_a_bomb_as_a_value_is_refused_before_it_is_built(tmp_path):
    """The bomb given as a setting's value: the node count refuses it before its value could be
    built or printed; a value under the bound but of the wrong type is shown by its size only."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(_alias_bomb(5) + "layers: *a5\n")
    assert "once its aliases are expanded" in one_error_line(invoke("build", "--config", str(recipe), "--dump-config"))
    recipe.write_text("cache: /c\nout: /o\nmethod: &m [" + ", ".join(["x"] * 500) + "]\n")
    line = one_error_line(invoke("train", "--config", str(recipe), "--dump-config"), str(recipe))
    assert line.endswith("'method' must be a string (quote it), got a list of 500 item(s)"), line


def test_a_recipe_larger_than_the_bound_is_refused_unread(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("cache: /c\nout: /o\n# " + "x" * RECIPE_MAX_BYTES + "\n")
    assert f"larger than {RECIPE_MAX_BYTES >> 10} KiB" in one_error_line(invoke("train", "--config", str(recipe), "--dump-config"))


def test_a_fifo_or_a_device_is_refused_at_once(tmp_path):
    """A FIFO with no writer would block the open (and a reader forever): refused from its stat,
    never opened. The command runs in a thread, so a hang fails the test instead of the suite."""
    fifo = tmp_path / "recipe.yaml"
    os.mkfifo(fifo)
    results = []
    worker = threading.Thread(target=lambda: results.append(invoke("train", "--config", str(fifo), "--dump-config")), daemon=True)
    worker.start()
    worker.join(timeout=60)
    if worker.is_alive():  # unblock the reader before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("--config on a FIFO blocked")
    assert "a FIFO, not a regular file" in one_error_line(results[0], str(fifo))
    for device in ("/dev/null", "/dev/zero"):  # empty forever, endless
        assert "a character device, not a regular file" in one_error_line(invoke("train", "--config", device, "--dump-config"), device)


def test_an_undecodable_recipe_names_its_file(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(b"cache: /c\nout: /o\nsystem_prompt: \xff\xfe\n")
    line = one_error_line(invoke("build", "--config", str(recipe), "--dump-config"), str(recipe))
    assert "not UTF-8 text (byte 0xff at offset 33)" in line
    recipe.write_text("cache: /c\nout: /o\n", encoding="utf-16")
    assert "not UTF-8 text" in one_error_line(invoke("train", "--config", str(recipe), "--dump-config"), str(recipe))


def test_config_given_twice_is_refused_naming_both(tmp_path):
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("cache: /a\nout: /o\n")
    second.write_text("cache: /b\nout: /o\n")
    line = one_error_line(invoke("train", "--config", str(first), "--config", str(second), "--dump-config"))
    assert f"--config is given 2 times ({first}, {second})" in line


def test_a_secret_in_a_recipe_key_is_never_echoed(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("cache: /c\nout: /o\n's3://KEY:p@ss@bucket/x': 1\n")
    line = one_error_line(invoke("train", "--config", str(recipe), "--dump-config"), str(recipe))
    assert "p@ss" not in line and "KEY" not in line and "s3://***@bucket/x" in line


# ----------------------------------------------------------------------------------------------
# --dump-config's round trip: one dialect on both sides

# Strings YAML 1.1, the recipes' YAML 1.2 float rule or the reader would take for something else:
# numbers, booleans, nulls, dates, YAML syntax, line breaks and characters that must be escaped.
ADVERSARIAL = [
    "1e3", "2e5", "1E+3", "-1e-3", "1_0e3", "1.5e3", "0x10", "0o17", "0b11", "012", "0", "-0", "+1", "1_000", "1:20",
    "190:20:30", ".inf", "-.inf", ".NaN", ".5", "-.5", "1.", "0.1", "yes", "No", "on", "OFF", "y", "True", "FALSE", "null",
    "Null", "~", " ", " lead", "trail ", "2001-01-01", "2001-12-14t21:59:43.10-05:00", "=", "<<", "-", "- x", "?", ": x",
    "#x", "a #b", "a: b", "{a: 1}", "[1]", "!tag", "!!str x", "&a", "*a", "|", ">", "%YAML", "@x", "`x", "'", '"',
    "it's", "a\nb", "a\n\nb", "a\n", "\tx", "x\r\ny", "\x00", "\x07", "\x85", "\u2028", "\u2029", "\ufeff", "\udcff", "é",
    "日本", "😀", "s3://bucket/a b", "---", "...", "--- x", "a" * 3000, " ".join(["word"] * 700),
]  # fmt: skip
# A string flag of each command and the required flags around it.
STRING_FLAGS = {
    "build": ("--system-prompt", ["--target", "/m", "--corpus", "c.jsonl", "--out", "/o"]),
    "regenerate": ("--out", ["--target", "/m", "--corpus", "c.jsonl"]),
    "train": ("--out", ["--cache", "/c"]),
    "eval": ("--system-prompt", ["--target", "/m", "--drafter", "/d", "--prompts", "p.jsonl", "--out", "/o"]),
}


def _round_trip(tmp_path: Path, command: str, args: list[str]) -> dict:
    """Dump the config of `args`, read the dump back with --config and dump again: the same text,
    the same config; the values the dump holds (read with the recipes' loader)."""
    first = invoke(command, *args, "--dump-config")
    assert first.exit_code == 0, first.output
    recipe = tmp_path / "dumped.yaml"
    recipe.write_bytes(first.output.encode("utf-8", errors="surrogatepass"))
    second = invoke(command, "--config", str(recipe), "--dump-config")
    assert second.exit_code == 0 and second.output == first.output, second.output[-300:]
    cls = COMMANDS[command][2]
    values = yaml.load(first.output, Loader=recipe_loader())  # noqa: S506 (a SafeLoader subclass)
    assert from_flags(cls, **recipe_flags(cls, str(recipe))) == from_flags(cls, **values)
    return values


@pytest.mark.parametrize("command", sorted(STRING_FLAGS))
def test_dump_config_round_trips_adversarial_strings(tmp_path, command):
    """Every adversarial string, given to a string flag of every command, is dumped so that the
    loader reads it back as that same string (`--out 1e3`, `--system-prompt 2e5` were dumped bare
    and the loader then refused its own output as a number)."""
    flag, required = STRING_FLAGS[command]
    key = flag[2:].replace("-", "_")
    for value in ADVERSARIAL:
        assert _round_trip(tmp_path, command, [*required, flag, value])[key] == value, repr(value)


@pytest.mark.parametrize(
    "command, args, expected",
    [
        ("train", ["--cache", "1e3", "--out", "0x10", "--lr", "1e-300", "--max-steps", "7", "--no-progress"],
         {"cache": "1e3", "out": "0x10", "lr": 1e-300, "max_steps": 7, "progress": False}),
        ("train", ["--cache", "~", "--out", "null", "--lr", "1.7976931348623157e308"],
         {"cache": "~", "out": "null", "lr": 1.7976931348623157e308, "max_steps": None}),
        ("build", ["--target", "yes", "--corpus", "2001-01-01", "--out", "012", "--layers", "0,2", "--mask-token", "123"],
         {"target": "yes", "corpus": "2001-01-01", "out": "012", "layers": [0, 2], "mask_token": "123"}),
        ("regenerate", ["--target", "on", "--corpus", ".NaN", "--out", "1:20", "--temperature", "5e-324", "--top-p", "0.1"],
         {"target": "on", "corpus": ".NaN", "out": "1:20", "temperature": 5e-324, "top_p": 0.1}),
        ("eval", ["--target", "Off", "--drafter", "-.inf", "--prompts", "1_000", "--out", "+1", "--max-prompts", "3",
                  "--confidence-threshold", "1e-3"],
         {"target": "Off", "drafter": "-.inf", "prompts": "1_000", "out": "+1", "max_prompts": 3, "confidence_threshold": 0.001}),
    ],
    ids=["train-numbers", "train-nulls", "build", "regenerate", "eval"],
)
def test_dump_config_round_trips_every_type(tmp_path, command, args, expected):
    """Paths that look like numbers, booleans, nulls and dates beside real numbers (the smallest
    and largest floats), integers, booleans, nulls and lists, for every command."""
    values = _round_trip(tmp_path, command, args)
    assert {key: values[key] for key in expected} == expected
    for key, value in expected.items():
        assert type(values[key]) is type(value), key
