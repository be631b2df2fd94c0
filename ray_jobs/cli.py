"""`alrira-cache`: build (on Ray), inspect and verify a stage-1 cache, regenerate a corpus with the
target (on Ray); and docs/cli.md, generated from every command's own help."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from pipeline.cache_build.config import CacheBuildConfig
from pipeline.regenerate.config import RegenerateConfig
from storage.errors import first_line
from storage.location import is_url, refuse_userinfo
from pipeline.cli import config_from_flags, config_options, eval_compare, eval_run, eval_score, train_cli

# ----------------------------------------------------------------------------------------------
# alrira-cache


@click.group(help="Stage 1: build and inspect the target cache.")
def cache_cli():
    pass


@cache_cli.command("build")
@config_options(CacheBuildConfig)
@click.option("--progress/--no-progress", default=True, help="Show progress bars.")
@click.option(
    "--estimate", is_flag=True,
    help="Print the bytes the build would write (per corpus token, per sequence, in all, by array group) and exit: "
    "tokenizes and sizes the anchor pools, no target forward, nothing written.",
)  # fmt: skip
def cache_build(progress: bool, estimate: bool, **kwargs):
    """Run the target over a corpus on a Ray cluster and write the cache (resumable)."""
    config = config_from_flags(CacheBuildConfig, kwargs)
    if estimate:
        from pipeline.cache_build.estimate import estimate_build, estimate_lines

        try:
            lines = estimate_lines(estimate_build(config, progress=progress, log=lambda m: click.echo(m, err=True)))
        except (ValueError, OSError) as error:
            raise click.ClickException(first_line(error)) from None
        click.echo("\n".join(lines))
        return
    from ray_jobs.build import build_cache  # Ray is imported only by the command that needs it

    try:
        build_cache(config, progress=progress, log=lambda m: click.echo(m, err=True))
    except (ValueError, OSError) as error:  # bad input or a failing filesystem / cluster: one line, no traceback
        raise click.ClickException(first_line(error)) from None


@cache_cli.command("regenerate")
@config_options(RegenerateConfig)
@click.option("--progress/--no-progress", default=True, help="Show a progress bar.")
def cache_regenerate(progress: bool, **kwargs):
    """Rewrite every assistant turn of a corpus with the target, turn by turn, on a Ray cluster (resumable); the output is a corpus `build` reads as is."""
    from pipeline.regenerate.driver import summary_line
    from ray_jobs.regenerate import regenerate_corpus

    config = config_from_flags(RegenerateConfig, kwargs)
    try:
        manifest = regenerate_corpus(config, progress=progress, log=lambda m: click.echo(m, err=True))
    except (ValueError, OSError) as error:
        raise click.ClickException(first_line(error)) from None
    click.echo(summary_line(manifest))


# A cache is a directory or an object-store URL (s3://bucket/prefix; docs/design.md, "Caches on
# object stores"): only a local path is checked by click.
def _cache_argument(ctx, param, value: str) -> str:
    if not is_url(value):
        return click.Path(exists=True, file_okay=False).convert(value, param, ctx)
    try:
        refuse_userinfo(value)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None
    return value


@cache_cli.command("info")
@click.argument("cache", callback=_cache_argument)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def cache_info(cache: str, as_json: bool):
    """Sequences, tokens, anchors, bytes per token, compression, and which objectives the cache serves."""
    from storage.eval_split import SplitFit, eval_split_problems
    from storage.location import resolve
    from storage.verify import identity_note, identity_problems, size_problems

    try:  # a corrupt tar header, a crafted manifest, an endpoint down: one line, no traceback
        info, reader = _cache_info(cache)
        problems = size_problems(cache, reader.manifest)
        problems = problems or identity_problems(reader)  # opens each shard: only when all are there
        # The split's record against its tensors' header and the taps (no data read: `verify` reads it all).
        split_problems = eval_split_problems(resolve(cache), SplitFit.of(reader.manifest), full=False)
        if split_problems:
            info["eval_split"] = "damaged (see below)"
        problems += split_problems
        note = identity_note(reader)
    except (ValueError, OSError) as error:
        raise click.ClickException(first_line(error)) from None
    if as_json:
        click.echo(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for key, value in info.items():
            if isinstance(value, float):
                value = f"{value:,.3f}"
            elif isinstance(value, int):
                value = f"{value:,}"
            click.echo(f"{key.ljust(width)}  {value}")
    if note is not None:
        click.echo(note, err=True)
    for problem in problems:
        click.echo(problem, err=True)
    if problems:
        raise click.ClickException(f"{cache}: {len(problems)} problem(s) found; run `alrira-cache verify {cache}`")


def _cache_info(cache: str):
    """What `info` prints, and the opened cache's reader."""
    from pipeline.train.methods import METHODS, required_arrays
    from storage.manifest import describe_compute
    from storage.reader import available_arrays, cache_group_bytes, cache_stats, open_cache

    reader = open_cache(cache)
    manifest = reader.manifest
    stats = cache_stats(reader)
    arrays = available_arrays(reader)
    settings = manifest.settings
    codecs = settings.codecs
    by_group = cache_group_bytes(reader)
    layout = f"{codecs['features']} features"
    if "rollout_features" in settings.contents:
        layout += f", {codecs['rollout_features']} rollout features"
        if settings.ira_parents is not None:
            layout += f" for {settings.ira_parents} anchors per sequence (--ira-parents)"
    return {
        "cache": cache if is_url(cache) else str(Path(cache).resolve()),
        "format": f"{manifest.format} v{manifest.format_version} ({settings.storage_format}, {layout})",
        "compute": describe_compute(manifest.compute),  # the target's dtype and device, `auto` resolved
        "profile": settings.profile or "-",
        "target": manifest.target_path,
        "layer_ids": settings.layer_ids,
        "num_slots": settings.num_slots,
        "top_k": settings.top_k,
        "contents": ["features", *settings.contents],
        "shards": f"{len(manifest.shards)}/{manifest.num_shards_planned} complete",
        **{k: stats[k] for k in ("sequences", "tokens", "anchors", "bytes_on_disk", "bytes_per_token")},
        "compression_ratio_vs_raw_bf16": stats["compression_ratio_vs_raw_bf16"],
        "bytes_per_token_by_group": {
            group: round(size / stats["tokens"], 1) if stats["tokens"] else 0.0 for group, size in by_group.items()
        },
        "corpus": manifest.corpus_stats,
        "trainable_methods": [m for m in METHODS if required_arrays(m) <= arrays],
        "eval_split": _eval_split_line(cache),  # alrira-train --eval-every's held-out prompts
        **_ira_parents_note(settings),
    }, reader


def _eval_split_line(cache: str) -> str:
    """The split's prompts and tokens as its record says, and what of it is not held out: prompts
    that repeat another, prompts the corpus also holds (pipeline/eval/split.py)."""
    from storage.eval_split import read_eval_split_record
    from storage.location import resolve

    try:
        record = read_eval_split_record(resolve(cache))
    except ValueError:
        return "damaged (see below)"
    if record is None:
        return "none (build with --eval-prompts FILE for alrira-train --eval-every)"
    line = f"{record['num_prompts']} prompts, {record['num_tokens']} tokens (max new tokens {record['key']['max_new_tokens']})"
    held_out = record.get("held_out")
    if held_out is None:
        return f"{line}; repeats and corpus overlaps not recorded (built before they were)"
    return f"{line}; {held_out['duplicate_prompts']} repeat an earlier prompt, {held_out['corpus_overlaps']} also in the corpus"


def _ira_parents_note(settings) -> dict:
    """What --ira-parents leaves alr_ira (floor(m/2) parents of m anchors per step); {} without it."""
    if settings.ira_parents is None or "rollout_features" not in settings.contents:
        return {}
    most = 2 * settings.ira_parents + 1
    if most >= settings.anchors_per_sequence:
        return {"alr_ira_anchors_per_step": f"any (rollout features for {settings.ira_parents} anchors per sequence)"}
    return {"alr_ira_anchors_per_step": f"<= {most} (rollout features for {settings.ira_parents} anchors per sequence)"}


@cache_cli.command("verify")
@click.argument("cache", callback=_cache_argument)
def cache_verify(cache: str):
    """Check every shard's checksum, shapes and probability sums; non-zero exit names bad shards."""
    from storage.verify import verify_cache

    try:
        problems = verify_cache(cache)
    except (ValueError, OSError) as error:  # no manifest, an endpoint down, refused credentials
        raise click.ClickException(first_line(error)) from None
    for problem in problems:
        click.echo(problem, err=True)
    if problems:
        sys.exit(1)
    click.echo(f"{cache}: OK")


# ----------------------------------------------------------------------------------------------
# docs/cli.md is generated from the commands themselves (tests/test_cli.py keeps it in sync).


def cli_reference_markdown() -> str:
    """Every command's --help as one markdown page."""
    commands = [
        ("alrira-cache build", cache_build),
        ("alrira-cache regenerate", cache_regenerate),
        ("alrira-cache info", cache_info),
        ("alrira-cache verify", cache_verify),
        ("alrira-train", train_cli),
        ("alrira-eval run", eval_run),
        ("alrira-eval compare", eval_compare),
        ("alrira-eval score", eval_score),
    ]
    parts = [
        "# Command reference\n",
        "Generated from the commands' own help (`python -m ray_jobs.cli > docs/cli.md`); "
        "`torchrun ... -m pipeline.train` takes the same flags as `alrira-train`.\n",
    ]
    for name, command in commands:
        with click.Context(command, info_name=name, terminal_width=100, max_content_width=100) as ctx:
            parts.append(f"## `{name}`\n\n```\n{command.get_help(ctx)}\n```\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(cli_reference_markdown(), end="")
