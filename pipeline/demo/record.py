"""The demo's figures in docs/, regenerated from runs of the current code: `bash .ci/demo --record`.

It runs the quick demo and then the default demo, each into an empty temporary folder with the
command a newcomer runs (`python -m pipeline.demo [--quick]`, what `bash .ci/demo` executes),
copies their results.json to docs/demo/quick-seed0.json and docs/demo/seed0.json, and rewrites the
tables that docs/results.md ("The demo") shows under those names. The default run's copy carries
the digest of the quick run's figures (`quick_figures_sha256`): the two were made by the same code.

How CI holds the docs to the code (docs/results.md, "The demo"): tests/test_demo.py runs the quick
demo and compares its `figures` with docs/demo/quick-seed0.json exactly; tests/test_docs_demo.py
checks that docs/demo/seed0.json is the default settings' run, recorded beside that quick file, and
that each table is its file rendered by `format_table`. A change that moves any demo number fails
there until this command has run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from pipeline.demo.run import RESULTS_FILE, format_table
from storage.atomic import atomic_write_text

ROOT = Path(__file__).resolve().parents[2]
DOCS_PAGE = "docs/results.md"
QUICK_FILE = "docs/demo/quick-seed0.json"
DEFAULT_FILE = "docs/demo/seed0.json"
RECORD_COMMAND = "bash .ci/demo --record"
QUICK_DIGEST_KEY = "quick_figures_sha256"
# A table of the page's demo section: the backquoted file it comes from, then its fenced text.
NAMED_TABLE = re.compile(r"`(docs/demo/[\w.-]+\.json)`[^`]*```\n(.*?)\n```", re.S)


def figures(report: dict) -> dict:
    """What the code, the seeds and the settings fix in a demo's results.json at its torch threads
    and CPU kind: every tau (pooled and per group), final loss, per-slot accuracy, world statistic
    and lossless count as exact floats, and the sha256 of each trained drafter's weights. Left out:
    what the machine and its load set (training and build seconds, speedups, wall time, the
    environment)."""
    methods = {}
    for method, result in report["methods"].items():
        decoded = {k: {n: v for n, v in r.items() if n != "speedup"} for k, r in result.items() if k.startswith("T")}
        trained = {k: result[k] for k in ("final_loss", "slot_acc", "drafter_sha256")}
        methods[method] = {**trained, **decoded}
    return {
        "seed": report["seed"],
        "quick": report["quick"],
        "temperatures": report["temperatures"],
        "sizes": report["sizes"],
        "world": {k: v for k, v in report["world"].items() if k != "build_s"},
        "methods": methods,
    }


def figures_digest(report: dict) -> str:
    return hashlib.sha256(json.dumps(figures(report), sort_keys=True).encode()).hexdigest()


def demo_section(page: str) -> tuple[int, int]:
    """Where docs/results.md's "The demo" section starts and ends."""
    start = page.index("\n## The demo\n")
    end = page.find("\n## ", start + 1)
    return start, len(page) if end < 0 else end


def named_tables(page: str) -> list[tuple[str, str]]:
    """(file, table text) for each table of the demo section that names the run it shows."""
    start, end = demo_section(page)
    return NAMED_TABLE.findall(page[start:end])


def check_named(page: str, names) -> None:
    """A ValueError naming each of `names` that no table of the demo section names."""
    missing = sorted(set(names) - {name for name, _ in named_tables(page)})
    if missing:
        raise ValueError(f"{DOCS_PAGE}, The demo: no table names {', '.join(missing)}")


def render_tables(page: str, reports: dict[str, dict]) -> str:
    """The page with each demo-section table named after a file in `reports` ({file: results.json
    content}) rendered again from it; other tables are left as they are."""
    check_named(page, reports)
    start, end = demo_section(page)

    def table(match: re.Match) -> str:
        report = reports.get(match.group(1))
        if report is None:
            return match.group(0)
        rendered = format_table(report["methods"], temperatures=report["temperatures"])
        return match.group(0)[: match.start(2) - match.start(0)] + rendered + "\n```"

    return page[:start] + NAMED_TABLE.sub(table, page[start:end]) + page[end:]


def _run_demo(out: Path, *flags: str) -> dict:
    """`python -m pipeline.demo --out OUT FLAGS` as `bash .ci/demo` runs it; its results.json."""
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([sys.executable, "-m", "pipeline.demo", "--out", str(out), *flags], check=True, env=env, cwd=ROOT)
    return json.loads((out / RESULTS_FILE).read_text())


@click.command(help=f"Regenerate {QUICK_FILE}, {DEFAULT_FILE} and their tables in {DOCS_PAGE} from fresh demo runs.")
@click.option(
    "--work", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="A new or empty folder for the two runs, kept afterwards. Default: a temporary folder, removed at the end.",
)  # fmt: skip
def main(work: Path | None):
    started = time.time()
    try:
        check_named((ROOT / DOCS_PAGE).read_text(), (QUICK_FILE, DEFAULT_FILE))
    except ValueError as error:
        raise click.ClickException(str(error)) from None
    # Fresh runs only: the demo resumes from what a folder holds, which may be another code's.
    if work is not None and work.exists() and any(work.iterdir()):
        raise click.ClickException(f"--work {work}: not empty; the runs must start from nothing")
    folder = work or Path(tempfile.mkdtemp(prefix="alrira-demo-record-"))
    try:
        quick = _run_demo(folder / "quick", "--quick")
        default = _run_demo(folder / "default")
    except subprocess.CalledProcessError as error:
        raise click.ClickException(f"the demo failed (exit {error.returncode}, runs in {folder}); docs/ is as it was") from None
    default[QUICK_DIGEST_KEY] = figures_digest(quick)
    reports = {QUICK_FILE: quick, DEFAULT_FILE: default}
    for name, report in reports.items():
        atomic_write_text(ROOT / name, json.dumps(report, indent=2) + "\n")
    atomic_write_text(ROOT / DOCS_PAGE, render_tables((ROOT / DOCS_PAGE).read_text(), reports))
    if work is None:
        shutil.rmtree(folder)
    print(f"recorded {QUICK_FILE}, {DEFAULT_FILE} and their tables in {DOCS_PAGE} ({time.time() - started:.0f} s)")
