"""alrira's training step against SpecForge 0.2's and speculators 0.9's DFlash steps, side by side on
this machine at identical shapes, weights and inputs (docs/benchmarks.md, "Training step against
the peers").

Each trainer runs in its own process (speed/peers/<trainer>_step.py), the peers under their own
virtualenvs, built once with --make-peer-venvs DIR: `python -m venv`, a .pth file that puts this
interpreter's site-packages (torch, transformers) behind them, then `pip install --no-deps` of
specforge==0.2.0, and of speculators==0.9.0 with hs-connectors==0.9.0. A trainer whose interpreter
is missing is left out of the table ("not installed"), so the script runs anywhere.

    .venv/bin/python -m benchmarks.speed.peer_step --make-peer-venvs /tmp/peer-venvs     # once
    .venv/bin/python -m benchmarks.speed.peer_step --peer-venvs /tmp/peer-venvs [--quick] [--out DIR]

Every process makes the same weights and inputs from one generator (speed/peers/case.py) and
runs one warm-up step (its loss is the first step's: alrira's and SpecForge's, on the same anchors
and objective, must agree) and then timed steps. Trainers take turns round by round, so load from
other jobs spreads over all of them; a row's time is the median of all its timed steps. Memory is
the peak resident set over the steps, sampled every 2 ms (inputs, weights, optimizer state and the
step's transients; not what setup held once, such as float32 weights converted to bf16).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import sysconfig
from dataclasses import replace
from pathlib import Path

from benchmarks.common import ROOT
from benchmarks.common.cli import bench_parser, int_list
from benchmarks.speed.peers.case import StepShape, shape_json

TRAINERS = ("alrira", "specforge", "speculators")
PEER_PACKAGES = {"specforge": ["specforge==0.2.0"], "speculators": ["speculators==0.9.0", "hs-connectors==0.9.0"]}
FULL_SHAPES = [StepShape(seq=seq, layers=layers) for seq in (1024, 2048) for layers in (1, 2)]
QUICK_SHAPES = [StepShape(seq=256, layers=1, hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, anchors=8, vocab=1000)]


def make_peer_venvs(root: Path) -> None:
    """One virtualenv per peer under `root`, sharing this interpreter's packages, with the peer
    installed without its dependencies (they would replace torch with a CUDA build)."""
    site_packages = sysconfig.get_paths()["purelib"]
    for name, packages in PEER_PACKAGES.items():
        venv = root / name
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "ensurepip", "--upgrade"], check=True, capture_output=True)
        peer_site = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        (Path(peer_site) / "alrira-shared.pth").write_text(site_packages + "\n")
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", *packages], check=True)
        print(f"{name}: {venv / 'bin' / 'python'}")


def interpreters(venvs: Path | None) -> dict[str, Path | None]:
    """The python each trainer runs under: this one for alrira, the peer's venv (when it exists)."""
    found: dict[str, Path | None] = {"alrira": Path(sys.executable)}
    for name in PEER_PACKAGES:
        python = venvs / name / "bin" / "python" if venvs else None
        found[name] = python if python is not None and python.exists() else None
    return found


def run_trainer(python: Path, trainer: str, shape: StepShape, precision: str, steps: int, threads: int) -> dict:
    command = [str(python), "-m", f"benchmarks.speed.peers.{trainer}_step", shape_json(shape), precision, str(steps)]
    env = {**os.environ, "PEER_STEP_THREADS": str(threads), "PYTHONPATH": str(ROOT)}  # the checkout: a peer's venv has no alrira
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{trainer} {precision} seq {shape.seq}: exit {done.returncode}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(shapes, precisions, pythons, *, rounds: int, steps: int, threads: int) -> list[dict]:
    rows = []
    for shape in shapes:
        for precision in precisions:
            runs: dict[str, list[dict]] = {name: [] for name, python in pythons.items() if python is not None}
            for _ in range(rounds):
                for name in runs:
                    runs[name].append(run_trainer(pythons[name], name, shape, precision, steps, threads))
            row = {"seq": shape.seq, "layers": shape.layers, "precision": precision, "trainers": {}}
            for name, results in runs.items():
                row["trainers"][name] = {
                    "step_s": statistics.median(s for r in results for s in r["step_s"]),
                    "live_rss_gib": max(r["live_rss_gib"] for r in results),
                    "step_peak_rss_gib": max(r["step_peak_rss_gib"] for r in results),
                    "first_loss": results[0]["first_loss"],
                }
            rows.append(row)
            print(table([row]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| seq | drafter layers | precision | alrira s/step | SpecForge s/step | speculators s/step | alrira vs fastest peer | step peak RSS GiB (alrira / SpecForge / speculators) | first-step loss alrira / SpecForge |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        t = row["trainers"]

        def cell(name, key, fmt):
            return format(t[name][key], fmt) if name in t else "not installed"

        peers = [t[name]["step_s"] for name in ("specforge", "speculators") if name in t]
        ratio = f"{min(peers) / t['alrira']['step_s']:.2f}x faster" if peers else "-"
        rss = " / ".join(cell(name, "step_peak_rss_gib", ".2f") for name in TRAINERS)
        losses = f"{cell('alrira', 'first_loss', '.6f')} / {cell('specforge', 'first_loss', '.6f')}"
        lines.append(
            f"| {row['seq']} | {row['layers']} | {row['precision']} | {cell('alrira', 'step_s', '.2f')} | {cell('specforge', 'step_s', '.2f')} "
            f"| {cell('speculators', 'step_s', '.2f')} | {ratio} | {rss} | {losses} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = bench_parser(__doc__, quick_help="one small shape, one round (a smoke run)", threads=2)
    parser.add_argument("--make-peer-venvs", type=Path, metavar="DIR", help="create the peers' virtualenvs under DIR and exit")
    parser.add_argument("--peer-venvs", type=Path, metavar="DIR", help="where --make-peer-venvs made them")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--trainers", default=",".join(TRAINERS), help="which of alrira,specforge,speculators to run")
    parser.add_argument("--seqs", type=int_list, default=None, help="comma-separated sequence lengths (default 1024,2048)")
    parser.add_argument("--layers", type=int_list, default=None, help="comma-separated drafter layer counts (default 1,2)")
    parser.add_argument("--rounds", type=int, default=2, help="processes per trainer and row, taking turns")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per process, after one warm-up")
    parser.add_argument("--out", type=Path, default=None, help="write results.json and table.md here")
    args = parser.parse_args()
    if args.make_peer_venvs:
        make_peer_venvs(args.make_peer_venvs)
        return
    shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    if args.seqs or args.layers:
        base = shapes[0]
        seqs = args.seqs or sorted({s.seq for s in shapes})
        layers = args.layers or sorted({s.layers for s in shapes})
        shapes = [replace(base, seq=seq, layers=n) for seq in seqs for n in layers]
    precisions = args.precisions.split(",")
    bad = [p for p in precisions if p not in ("fp32", "bf16")]
    if bad:
        raise SystemExit(f"--precisions: {bad[0]!r} is not fp32 or bf16")
    pythons = {name: python for name, python in interpreters(args.peer_venvs).items() if name in args.trainers.split(",")}
    missing = [name for name, python in pythons.items() if python is None]
    if missing:
        print(f"not installed (left out): {', '.join(missing)}; make them with --make-peer-venvs DIR, pass --peer-venvs DIR")
    rounds, steps = (1, 1) if args.quick else (args.rounds, args.steps)
    rows = measure(shapes, precisions, pythons, rounds=rounds, steps=steps, threads=args.threads)
    print(table(rows))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1) + "\n")
        (args.out / "table.md").write_text(table(rows) + "\n")


if __name__ == "__main__":
    main()
