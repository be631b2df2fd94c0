"""Console scripts `alrira-train` and `alrira-eval`, and the option builder every command uses
(`alrira-cache` lives in ray_jobs/cli.py, since it runs on Ray).

Options are generated from the typed config dataclasses, nested configs flattened
(pipeline/config.py), whose field help is the CLI help, so each flag is documented in one place.
"""

from __future__ import annotations

import functools
import math
import re
import types
import typing
from pathlib import Path

import click
from click.core import ParameterSource

from pipeline.config import flag_name, from_flags, is_required, leaf_fields
from pipeline.recipes import dump_recipe, recipe_flags, recipe_keys
from pipeline.eval.evaluate import EvalConfig
from pipeline.train.config import TrainConfig
from storage.errors import first_line, redact_userinfo
from storage.local_cache import check_local_cache_root
from storage.location import is_url, refuse_userinfo

# torch's DataLoader: a worker that died without a Python error (SIGKILL, the OOM killer) ...
_WORKER_DIED = re.compile(r"DataLoader worker \(pid(?:\(s\))? ([\d, ]+)\) (?:exited unexpectedly|is killed by signal)")
# ... and one whose code raised, re-raised in the main process with the worker's traceback.
_WORKER_RAISED = re.compile(r"^Caught \w+ in DataLoader worker process (\d+)\.")


class FiniteFloat(click.ParamType):
    """A float flag: `inf` and `nan`, which click's FLOAT takes, are refused in one line."""

    name = "float"

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


def _parse_int_list(value):
    if value is None or isinstance(value, list):
        return value
    try:
        return [int(v) for v in str(value).split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}") from None


def config_options(cls):
    """Decorator: one click option per leaf field of a (nested) config dataclass (type, default and
    help from the field); the command receives them flat, keyed by flag name with underscores.
    Also --config FILE (a recipe: those flags in YAML, overridden by the flags typed) and
    --dump-config (print the resolved settings as a recipe and exit); docs/recipes.md."""

    def decorate(func):
        command = _with_recipe(cls, func)
        for f, kind in reversed(list(leaf_fields(cls))):
            name = flag_name(f)
            flag = "--" + name.replace("_", "-")
            args = typing.get_args(kind)
            optional = isinstance(kind, types.UnionType) and type(None) in args
            base = next((a for a in args if a is not type(None)), kind) if optional else kind
            help_text = f.metadata.get("help", "")
            required = is_required(f)
            default = None if required else f.default
            if base is bool:
                opt = click.option(f"{flag}/--no-{flag[2:]}", name, default=default, show_default=True, help=help_text)
            elif typing.get_origin(base) is list:
                opt = click.option(flag, name, default=None, callback=lambda c, p, v: _parse_int_list(v), help=help_text)
            else:
                kind = FiniteFloat() if base is float else base
                # A required option is given no default at all: click >= 8.3 takes an explicit
                # default=None as a value, so a missing required flag would not be reported.
                given = {"required": True} if required else {"default": default, "show_default": True}
                opt = click.option(flag, name, type=kind, help=help_text, **given)
            command = opt(command)
        command = click.option(
            "--dump-config", "dump_config", is_flag=True,
            help="Print the resolved settings (every key, as a recipe --config reads) and exit without running anything.",
        )(command)  # fmt: skip
        return click.option(
            "--config", "recipe_file", type=click.Path(exists=True, dir_okay=False), is_eager=True, multiple=True,
            callback=lambda ctx, param, paths: _read_recipe(cls, ctx, paths),
            help="A recipe: YAML {flag name: value} of this command's settings (docs/recipes.md); one per command. Flags "
            "typed on the command line override it; it overrides the defaults.",
        )(command)  # fmt: skip

    return decorate


_RECIPE = "alrira.recipe"  # ctx.meta key: the checked flags of --config's file
# Where a value came from that a recipe's value replaces: only flags the user typed override the file.
_NOT_TYPED = (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)


def _read_recipe(cls, ctx: click.Context, paths: tuple[str, ...]) -> str | None:
    """--config's callback, run before the other options (eager): read and check the recipe, keep it
    for the command (ctx.meta) and give its required settings to click as defaults (ctx.default_map)
    so that a required flag the file sets is not reported missing. A second --config is refused:
    which file wins, or how two would merge, is not something a reader of the command can tell."""
    if not paths:
        return None
    if len(paths) > 1:
        raise click.UsageError(f"--config is given {len(paths)} times ({', '.join(paths)}); a command reads one recipe: merge them into one file")
    path = paths[0]
    keys = recipe_keys(cls)
    command_only = {p.name for p in ctx.command.params if p.name not in keys} - {"recipe_file", "dump_config", "help"}
    try:
        flags = recipe_flags(cls, path, command_only=command_only)
    except ImportError:  # pyyaml: a dependency of transformers and ray, so nearly always there
        raise click.UsageError("--config needs PyYAML: pip install pyyaml") from None
    except ValueError as error:  # a key or value may hold a URL with credentials: never echoed
        raise click.UsageError(redact_userinfo(f"--config {error}")) from None
    ctx.meta[_RECIPE] = flags
    required = {name: value for name, value in flags.items() if is_required(keys[name][0]) and value is not None}
    ctx.default_map = {**(ctx.default_map or {}), **required}
    return path


def _with_recipe(cls, func):
    """`func` behind --config / --dump-config: the recipe's values replace every setting not typed on
    the command line; with --dump-config the resolved config is printed and `func` never runs."""

    @functools.wraps(func)
    def command(*args, recipe_file: str | None = None, dump_config: bool = False, **kwargs):
        ctx = click.get_current_context()
        for name, value in ctx.meta.get(_RECIPE, {}).items():
            if ctx.get_parameter_source(name) in _NOT_TYPED:
                kwargs[name] = value
        if dump_config:
            config = config_from_flags(cls, {name: kwargs[name] for name in recipe_keys(cls)})
            click.echo(dump_recipe(config), nl=False)
            ctx.exit(0)
        return func(*args, **kwargs)

    return command


def config_from_flags(cls, kwargs):
    """The config of a command's flags; a URL with credentials in any flag is refused, redacted
    (docs/failure-modes.md), before the config (and train_config.json, logs) could hold it.
    --config and --dump-config, which config_options adds, are not settings: left out."""
    kwargs = {name: value for name, value in kwargs.items() if name not in ("recipe_file", "dump_config")}
    try:
        for name, value in kwargs.items():
            refuse_userinfo(value, flag="--" + name.replace("_", "-"))
        return from_flags(cls, **kwargs)
    except ValueError as error:
        raise click.UsageError(str(error)) from None


def training_error_line(error: BaseException) -> str | None:
    """The one line alrira-train prints for `error`: a DataLoader worker's death anywhere in its
    chain, bad input, a failing store or disk; None for anything else (a bug: its traceback shows).
    torch's SIGCHLD handler raises a worker's death wherever the main thread is, so it can arrive
    inside torch.save, whose own cleanup then raises another error "during handling" of it
    (docs/failure-modes.md)."""
    cause, seen = error, set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if _WORKER_DIED.search(str(cause)) or _WORKER_RAISED.match(str(cause)):
            return one_line_error(cause)
        cause = cause.__cause__ or cause.__context__
    if isinstance(error, (ValueError, OSError)):
        return one_line_error(error)
    return None


def one_line_error(error: BaseException) -> str:
    """What a user reads of an error raised in training: its first line (userinfo redacted); for an
    error of a DataLoader worker, which worker and the worker's own error, not torch's wrapping."""
    text = str(error)
    died = _WORKER_DIED.search(text)
    if died:
        return (
            f"DataLoader worker (pid {died.group(1)}) died (killed, or out of memory); the checkpoints in --out "
            "are kept: rerun the same command with --resume to continue from the last one"
        )
    raised = _WORKER_RAISED.match(text)
    if raised:
        lines = [line for line in text.strip().splitlines() if line.strip()]
        return f"DataLoader worker {raised.group(1)}: {first_line(ValueError(lines[-1].split(': ', 1)[-1]))}"
    return first_line(error)


# ----------------------------------------------------------------------------------------------
# alrira-train / alrira-eval


def threads_option(func):
    """--threads: torch's intra-op threads in this process (as the demo's --threads)."""
    return click.option(
        "--threads", type=click.IntRange(min=1), default=None, callback=_set_threads,
        help="Torch threads of this process (default: torch's, one per core). On a small or shared machine 1 thread "
        "can be several times faster for small matmuls (docs/results.md).",
    )(func)  # fmt: skip


def _set_threads(ctx, param, threads: int | None) -> int | None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    return threads


def stop_watching_loader_workers() -> None:
    """The run is over (done or failed): no DataLoader worker's death concerns this process any more.
    torch's SIGCHLD handler would still raise for one that dies now, wherever the main thread is:
    at exit, in the join of an executor's threads, as a traceback after the run's one line (found by
    benchmarks/harness/chaos.py: a worker killed as a failed run ended). The default handler is restored."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGCHLD"):
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        from torch.utils.data._utils import signal_handling

        signal_handling._SIGCHLD_handler_set = False  # a later DataLoader in this process installs it again


@click.command(help="Stage 2: train a block drafter of any family (--arch) from a cache (also under torchrun).")
@config_options(TrainConfig)
@threads_option
def train_cli(threads: int | None, **kwargs):
    from pipeline.train.loop import train
    from pipeline.train.run_dir import format_summary

    config = config_from_flags(TrainConfig, kwargs)
    loader = config.loader
    try:
        if loader.kind == "stream" and loader.local_cache_gib > 0 and is_url(config.cache):
            check_local_cache_root(loader.local_cache_root, flag="--local-cache-dir")
        summary = train(config)
    except Exception as error:
        line = training_error_line(error)
        if line is None:  # a bug: its traceback is what to report
            raise
        raise click.ClickException(line) from None
    finally:
        stop_watching_loader_workers()
    if "final_loss" in summary:
        click.echo(format_summary(summary), err=True)


@click.group(help="Evaluate drafters by real speculative decoding.")
def eval_cli():
    pass


@eval_cli.command("run")
@config_options(EvalConfig)
@threads_option
def eval_run(threads: int | None, **kwargs):
    """Speculative decoding with the HF target: tau, speedup over AR, accepted-length histogram."""
    from pipeline.eval.evaluate import run_eval
    from pipeline.eval.scores import score_table

    config = config_from_flags(EvalConfig, kwargs)
    try:
        summary = run_eval(config)
    except (ValueError, OSError) as error:
        raise click.ClickException(first_line(error)) from None
    click.echo(score_table(Path(config.out) / "results.csv"))
    mismatches = summary.get("lossless_mismatches")
    if mismatches and summary["lossless_exact"]:
        raise click.ClickException(f"{mismatches} prompt(s) decoded differently from the target's greedy output")
    if mismatches is not None and not summary["lossless_exact"]:
        click.echo(f"{mismatches} prompt(s) differ from greedy AR ({summary['lossless_note']})", err=True)


_OVERWRITE_HELP = "Replace an earlier output in --out computed from other inputs (without it: refused)."
_MIXED_HELP = ("Pool summaries of one method that differ in more than the drafter (target, prompts, temperature, "
               "max new tokens, decode vs replay, dtype); the output records what differed.")


def _output_flags(func, *, mixed: bool = True):
    """--overwrite (and --allow-mixed-replicates) of a command that writes --out (pipeline/outputs.py)."""
    func = click.option("--overwrite", is_flag=True, help=_OVERWRITE_HELP)(func)
    if mixed:
        func = click.option("--allow-mixed-replicates", "allow_mixed", is_flag=True, help=_MIXED_HELP)(func)
    return func


@eval_cli.command("compare")
@click.argument("summaries", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--out", required=True, help="Output directory (compare.csv, compare_gain.png).")
@click.option("--baseline", default=None, help="Method whose tau the gains are measured against (e.g. dflash).")
@click.option("--label", "labels", multiple=True, help="Method name of each summary, in order (default: from the drafter's run).")
@_output_flags
def eval_compare(summaries: tuple[str, ...], out: str, baseline: str | None, labels: tuple[str, ...], allow_mixed: bool, overwrite: bool):
    """Paper-style table over run summaries: tau and speedup per benchmark, geometric means, gain over a baseline, mean +- sd over replicates."""
    from pipeline.eval.compare import run_compare

    try:
        click.echo(run_compare(list(summaries), out=out, baseline=baseline, labels=list(labels) or None, allow_mixed=allow_mixed,
                               overwrite=overwrite))  # fmt: skip
    except ValueError as error:
        raise click.ClickException(str(error)) from None


@eval_cli.command("score")
@click.argument("csv_path", type=click.Path(exists=True, dir_okay=False))
@click.option("--group", default="benchmark", show_default=True, help="CSV column to group prompts by.")
def eval_score(csv_path: str, group: str):
    """Print the tau / speedup table of a results.csv written by `alrira-eval run`."""
    from pipeline.eval.scores import provenance_line, score_table

    try:
        table = score_table(csv_path, group=group)
        if line := provenance_line(csv_path):  # which target, drafter, prompts and settings the numbers come from
            click.echo(line, err=True)
        click.echo(table)
    except (KeyError, ValueError) as error:
        raise click.ClickException(f"{csv_path}: {error}") from None


# ----------------------------------------------------------------------------------------------
# alrira-eval offsets / cost / hard: the paper's analyses (pipeline/eval/analysis.py)


def _summaries_args(func):
    label_help = "Method name of each summary, in order (default: from the drafter's run)."
    func = click.option("--label", "labels", multiple=True, help=label_help)(func)
    func = click.option("--out", required=True, help="Output directory.")(func)
    func = _output_flags(func)
    return click.argument("summaries", nargs=-1, required=True, type=click.Path(exists=True))(func)


@eval_cli.command("offsets")
@_summaries_args
@click.option("--baseline", default=None, help="Method whose MAT each bucket's gain is measured against (e.g. alr).")
def eval_offsets(summaries: tuple[str, ...], out: str, labels: tuple[str, ...], baseline: str | None, allow_mixed: bool, overwrite: bool):
    """Offset profile: MAT by round-start offset bucket (0-15, 16-63, 64-127, 128+) and gain over a baseline (offset_profile.csv/.png)."""
    from pipeline.eval.analysis import format_rows, run_offset_profile

    try:
        click.echo(format_rows(run_offset_profile(list(summaries), out=out, baseline=baseline, labels=list(labels) or None,
                                                  allow_mixed=allow_mixed, overwrite=overwrite)))  # fmt: skip
    except ValueError as error:
        raise click.ClickException(str(error)) from None


@eval_cli.command("cost")
@_summaries_args
@click.option("--reference", required=True, help="Method C the training times are relative to (e.g. the best erase schedule).")
def eval_cost(summaries: tuple[str, ...], out: str, labels: tuple[str, ...], reference: str, allow_mixed: bool, overwrite: bool):
    """Training cost: MAT against training time / C, alone and with the stage-1 time of the arrays each method reads (training_cost.csv/.png)."""
    from pipeline.eval.analysis import format_rows, run_training_cost

    try:
        click.echo(format_rows(run_training_cost(list(summaries), out=out, reference=reference, labels=list(labels) or None,
                                                 allow_mixed=allow_mixed, overwrite=overwrite)))  # fmt: skip
    except ValueError as error:
        raise click.ClickException(str(error)) from None


@eval_cli.command("hard")
@click.option("--target", required=True, type=click.Path(exists=True, file_okay=False), help="Local HF directory of the target model.")
@click.option("--prompts", required=True, type=click.Path(exists=True, dir_okay=False), help="Held-out prompts (JSONL, as for `run`).")
@click.option("--drafter", required=True, type=click.Path(exists=True, file_okay=False), help="Drafter whose gain is measured (e.g. alr_ira).")
@click.option("--baseline", required=True, type=click.Path(exists=True, file_okay=False), help="Drafter it is compared with (e.g. alr).")
@click.option("--independent", required=True, type=click.Path(exists=True, file_okay=False),
              help="Drafter that groups the offsets (trained apart from both, e.g. kd).")  # fmt: skip
@click.option("--control", default=None, type=click.Path(exists=True, file_okay=False),
              help="The baseline's method trained with another seed: its gain should stay near 0.")  # fmt: skip
@click.option("--out", required=True, help="Output directory (hard_offsets.csv/.png, hard_offsets_raw.csv).")
@click.option("--max-new-tokens", default=128, show_default=True, help="Length of each greedy response.")
@click.option("--max-prompts", default=None, type=int, help="Use only N prompts, taken evenly across the groups.")
@threads_option
@_output_flags
def eval_hard(threads: int | None, **kwargs):
    """Where drafting is hard: one drafted block per offset of greedy responses; gains grouped by an independent drafter's acceptance."""
    from pipeline.eval.analysis import format_rows, run_hard_offsets

    try:
        click.echo(format_rows(run_hard_offsets(**kwargs)))
    except ValueError as error:
        raise click.ClickException(str(error)) from None


@eval_cli.command("replay")
@click.option("--target", required=True, type=click.Path(exists=True, file_okay=False), help="Local HF directory of the target model.")
@click.option("--prompts", required=True, type=click.Path(exists=True, dir_okay=False), help="Prompts (JSONL, as for `run`).")
@click.option("--drafter", "drafters", required=True, multiple=True, type=click.Path(exists=True, file_okay=False),
              help="A drafter to score (repeat the flag): its results go to OUT/<its run's name>.")  # fmt: skip
@click.option("--out", required=True, help="Output directory: one run-format folder (summary.json, rounds.csv) per drafter.")
@click.option("--max-new-tokens", default=128, show_default=True, help="Length of each greedy response.")
@click.option("--max-prompts", default=None, type=int, help="Use only N prompts, taken evenly across the groups.")
@threads_option
@click.option("--overwrite", is_flag=True, help="Replace a drafter's earlier output computed from other inputs (without it: refused; the same inputs: kept).")
def eval_replay(target: str, prompts: str, drafters: tuple[str, ...], out: str, max_new_tokens: int, max_prompts: int | None,
                threads: int | None, overwrite: bool):  # fmt: skip
    """Greedy (T = 0) MAT of many drafters at one target decode per prompt: the exact rounds of greedy speculative decoding, replayed."""
    from pathlib import Path

    from pipeline.eval.replay import run_replay

    names = {}
    for path in drafters:
        run = Path(path).resolve()
        name = run.parent.name if run.name == "drafter" else run.name
        if name in names:
            raise click.ClickException(f"--drafter {path}: another drafter is also named {name!r} (its folder or run)")
        names[name] = path
    try:
        summaries = run_replay(target=target, drafters=names, prompts=prompts, out=out, max_new_tokens=max_new_tokens,
                               max_prompts=max_prompts, overwrite=overwrite)  # fmt: skip
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    for name, summary in summaries.items():
        click.echo(f"{name}: MAT {summary['tau_geomean']:.3f} over {summary['num_prompts']} prompts ({Path(out) / name})")
