"""Console scripts: `alrira-cache`, `alrira-train`, `alrira-eval`.

Options are generated from the typed config dataclasses, whose field help is the CLI help, so
each flag is documented in one place. The CLI is the only place that imports `ray_jobs`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from pathlib import Path

import click

from pipeline.cache_build import CacheBuildConfig
from pipeline.evaluate import EvalConfig
from pipeline.train import TrainConfig

# Field names whose flag differs from the field name.
FLAG_NAMES = {"storage_format": "format"}


def _parse_int_list(value):
    if value is None or isinstance(value, list):
        return value
    try:
        return [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


def config_options(cls):
    """Decorator: one click option per dataclass field (type, default and help from the field)."""
    hints = typing.get_type_hints(cls)

    def decorate(func):
        for f in reversed(dataclasses.fields(cls)):
            flag = "--" + FLAG_NAMES.get(f.name, f.name).replace("_", "-")
            kind = hints[f.name]
            args = typing.get_args(kind)
            optional = isinstance(kind, types.UnionType) and type(None) in args
            base = next((a for a in args if a is not type(None)), kind) if optional else kind
            help_text = f.metadata.get("help", "")
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            default = None if required else f.default
            if base is bool:
                opt = click.option(f"{flag}/--no-{flag[2:]}", f.name, default=default, show_default=True, help=help_text)
            elif typing.get_origin(base) is list:
                opt = click.option(flag, f.name, default=None, callback=lambda c, p, v: _parse_int_list(v), help=help_text)
            else:
                opt = click.option(
                    flag, f.name, type=base, required=required, default=default, show_default=not required, help=help_text
                )
            func = opt(func)
        return func

    return decorate


def _config_from_kwargs(cls, kwargs):
    try:
        return cls(**kwargs)
    except ValueError as error:
        raise click.UsageError(str(error)) from None


# ----------------------------------------------------------------------------------------------
# alrira-cache


@click.group(help="Stage 1: build and inspect the target cache.")
def cache_cli():
    pass


@cache_cli.command("build")
@config_options(CacheBuildConfig)
@click.option("--progress/--no-progress", default=True, help="Show progress bars.")
def cache_build(progress: bool, **kwargs):
    """Run the target over a corpus on a Ray cluster and write the cache (resumable)."""
    from ray_jobs.build import build_cache

    config = _config_from_kwargs(CacheBuildConfig, kwargs)
    try:
        build_cache(config, progress=progress, log=lambda m: click.echo(m, err=True))
    except ValueError as error:
        raise click.ClickException(str(error)) from None


@cache_cli.command("info")
@click.argument("cache", type=click.Path(exists=True, file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def cache_info(cache: str, as_json: bool):
    """Sequences, tokens, anchors, bytes per token, compression, and which objectives the cache serves."""
    from pipeline.labels import METHODS, required_arrays
    from storage.reader import available_arrays, cache_stats, open_cache

    try:
        reader = open_cache(cache)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    manifest = reader.manifest
    stats = cache_stats(reader)
    arrays = available_arrays(reader)
    trainable = [m for m in METHODS if required_arrays(m) <= arrays]
    settings = manifest.settings
    info = {
        "cache": str(Path(cache).resolve()),
        "format": f"{manifest.format} v{manifest.format_version} ({settings.storage_format}, {settings.feature_codec} features)",
        "target": manifest.target_path,
        "layer_ids": settings.layer_ids,
        "num_slots": settings.num_slots,
        "top_k": settings.top_k,
        "contents": ["features", *settings.contents],
        "shards": f"{len(manifest.shards)}/{manifest.num_shards_planned} complete",
        **{k: stats[k] for k in ("sequences", "tokens", "anchors", "bytes_on_disk", "bytes_per_token")},
        "compression_ratio_vs_raw_bf16": stats["compression_ratio_vs_raw_bf16"],
        "corpus": manifest.corpus_stats,
        "trainable_methods": trainable,
    }
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    width = max(len(k) for k in info)
    for key, value in info.items():
        if isinstance(value, float):
            value = f"{value:,.3f}"
        elif isinstance(value, int):
            value = f"{value:,}"
        click.echo(f"{key.ljust(width)}  {value}")


@cache_cli.command("verify")
@click.argument("cache", type=click.Path(exists=True, file_okay=False))
def cache_verify(cache: str):
    """Check every shard's checksum, shapes and probability sums; non-zero exit names bad shards."""
    from storage.verify import verify_cache

    try:
        problems = verify_cache(cache)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    for problem in problems:
        click.echo(problem, err=True)
    if problems:
        sys.exit(1)
    click.echo(f"{cache}: OK")


# ----------------------------------------------------------------------------------------------
# alrira-train / alrira-eval


@click.command(help="Stage 2: train a DFlash drafter from a cache (also under torchrun).")
@config_options(TrainConfig)
def train_cli(**kwargs):
    from pipeline.train import format_summary, train

    config = _config_from_kwargs(TrainConfig, kwargs)
    try:
        summary = train(config)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    if "final_loss" in summary:
        click.echo(format_summary(summary), err=True)


@click.group(help="Evaluate drafters by real speculative decoding.")
def eval_cli():
    pass


@eval_cli.command("run")
@config_options(EvalConfig)
def eval_run(**kwargs):
    """Speculative decoding with the HF target: tau, speedup over AR, accepted-length histogram."""
    from pipeline.evaluate import run_eval, score_table

    config = _config_from_kwargs(EvalConfig, kwargs)
    try:
        summary = run_eval(config)
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    click.echo(score_table(Path(config.out) / "results.csv"))
    if summary.get("lossless_mismatches"):
        raise click.ClickException(
            f"{summary['lossless_mismatches']} prompt(s) decoded differently from the target's greedy output"
        )


@eval_cli.command("score")
@click.argument("csv_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--group", default="benchmark", show_default=True, help="CSV column to group prompts by.")
def eval_score(csv_path: str, group: str):
    """Print the tau / speedup table of a results.csv written by `alrira-eval run`."""
    from pipeline.evaluate import score_table

    try:
        click.echo(score_table(csv_path, group=group))
    except (KeyError, ValueError) as error:
        raise click.ClickException(f"{csv_path}: {error}") from None


# ----------------------------------------------------------------------------------------------
# docs/cli.md is generated from the commands themselves (tests/test_cli.py keeps it in sync).


def cli_reference_markdown() -> str:
    """Every command's --help as one markdown page."""
    commands = [
        ("alrira-cache build", cache_build),
        ("alrira-cache info", cache_info),
        ("alrira-cache verify", cache_verify),
        ("alrira-train", train_cli),
        ("alrira-eval run", eval_run),
        ("alrira-eval score", eval_score),
    ]
    parts = [
        "# Command reference\n",
        "Generated from the commands' own help (`python -m pipeline.cli > docs/cli.md`); "
        "`torchrun ... -m pipeline.train` takes the same flags as `alrira-train`.\n",
    ]
    for name, command in commands:
        with click.Context(command, info_name=name, terminal_width=100, max_content_width=100) as ctx:
            parts.append(f"## `{name}`\n\n```\n{command.get_help(ctx)}\n```\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(cli_reference_markdown(), end="")
