"""Chaos harness: runs a stage again and again, injects random combined faults at
random moments, reruns the same command as a user would until the stage ends, and checks that it
ends exactly as a clean run does (docs/benchmarks.md, "Chaos"; docs/failure-modes.md).

    python -m benchmarks.harness.chaos --stage build|regenerate|train|all (or a list: build,regenerate) --rounds N --seed S

Each round draws from `random.Random(f"{seed}:{stage}:{round}")` which variant it runs (stage 1 to
a local disk or to s3://, regeneration at T = 0 or T = 1), which faults it injects and when: after
a drawn number of published units (shards, parts, checkpoints) plus a drawn delay. `--only-round`
replays one round. Faults:

    kill_actor    SIGKILL a stage-1 or regeneration actor of the harness's own cluster
    kill_driver   SIGKILL the command (its whole process group: the driver or the trainer)
    kill_raylet   SIGKILL the second raylet of the harness's 2-raylet cluster (restarted after)
    stop_store    SIGSTOP the harness's S3 server for longer than ALRIRA_STORE_TIMEOUT_S
    disk_full     fill the small tmpfs the harness mounted for --out (freed before the rerun)
    flip_bit      flip one bit of a published chunk or part file (on disk or on the store)
    kill_loader   SIGKILL a DataLoader worker of the trainer
    truncate_ckpt cut the newest checkpoint's state.pt in half

Every round then checks: stage 1: `alrira-cache verify` passes and the shards' checksums equal the
clean build's; regeneration: every part byte-identical to the clean run's; training: the final
weights bit-identical, metrics.jsonl with every step once. Always: no traceback in what any run
printed, no process of a run left, nothing written outside --out and the declared temp dirs.

The harness signals only processes it started (by pid, or by the session ids of the `ray start`
sessions it made), serves and connects only on 127.0.0.1, bounds every loop in rounds and time,
and removes its work directory, cluster, server and mount at the end. Exit 0 only when every round
passed; the last line is the summary. The world it runs in (cluster, store, disk, the stages'
commands and clean references) is chaos_world.py; the faults are chaos_faults.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.chaos_faults import BETWEEN, DURING, FAULTS
from benchmarks.harness.chaos_world import (
    ACTOR_TITLES, RUN_CAP_S, STAGES, VARIANTS, World, close_world, cmdline, command, kill_session, make_references, make_world,
    mount_disk, progress, read_out, remove_out, session_pids, start_cluster, start_second_raylet, start_store, store_fs,
    total_units,
)  # fmt: skip

MAX_ATTEMPTS = 6  # the first run and five reruns
# The drawn delay after the drawn unit: about one unit's time on an idle machine (a shard or part
# takes 1-3 s, a training step ~0.15 s), so a process fault lands while the run still runs. A
# training delay of 1.5 s mostly lands after the run has ended, so training draws a shorter one.
MAX_DELAY_S = {"build": 1.5, "regenerate": 1.5, "train": 0.25}


class RoundFailed(Exception):
    """A round that did not end as a clean run does (its message says how)."""


# --------------------------------------------------------------------------------------------
# A round: draw, run with faults, rerun until the stage ends, check.


@dataclass
class Round:
    stage: str
    index: int
    variant: str = ""
    faults: dict[str, str] = field(default_factory=dict)  # fault -> what it hit
    attempts: int = 0
    seconds: float = 0.0
    recovery_s: float = 0.0  # from the end of the faulted run to the rerun that finished the stage
    error: str = ""
    first_error: str = ""  # the faulted run's `Error: ` line, if it printed one


def draw(world: World, stage: str, index: int, seed: int, only: list[str] | None = None) -> tuple[random.Random, str, list[str], int, float]:
    """The round's variant, faults (one to three, or those of `only` the variant can take), and
    moment (after `units` published, plus a delay)."""
    rng = random.Random(f"{seed}:{stage}:{index}")
    variant = rng.choice([v for v in VARIANTS[stage] if not only or set(only) & set(FAULTS[v])] or VARIANTS[stage])
    pool = [f for f in FAULTS[variant] if f != "disk_full" or world.disk is not None]
    faults = rng.sample(pool, min(rng.choice([1, 1, 2, 2, 3]), len(pool)))
    if only:
        faults = [f for f in only if f in pool]
    units = rng.randrange(max(1, total_units(world, variant)))
    return rng, variant, faults, units, rng.uniform(0.0, MAX_DELAY_S[stage])


def out_for(world: World, variant: str, name: str) -> str:
    if variant == "build-s3":
        return f"s3://chaos/{name}"
    return str((world.disk or world.root / "outs") / name)


def _wait_exit(proc: subprocess.Popen, what: str) -> None:
    try:
        proc.wait(timeout=RUN_CAP_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise RoundFailed(f"{what} hung: still running after {RUN_CAP_S:.0f} s") from None


def faulted_run(world: World, variant: str, argv: list[str], out: str, plan: tuple, log_path: Path, result: Round) -> tuple[int, str, int]:
    """The first run: started, the faults injected at the drawn moment, waited on. Returns its exit
    status, what it printed and its process group id."""
    rng, _, faults, units, delay = plan
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(argv, env=world.env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
        world.live.add(proc.pid)
        started = time.monotonic()
        while proc.poll() is None and progress(world, variant, out) < units and time.monotonic() - started < RUN_CAP_S:
            time.sleep(0.05)
        if proc.poll() is None:
            time.sleep(delay)
        for fault in faults:
            if fault in DURING and proc.poll() is not None:  # the run ended before the moment: no fault
                result.faults[fault] = "missed (run ended)"
            elif fault in DURING:
                hit = DURING[fault](world, proc, rng)
                # No target yet (actors still starting, DataLoader workers between epochs): the
                # moment is the first one after the drawn one where there is.
                while hit.startswith("missed (no") and proc.poll() is None and time.monotonic() - started < RUN_CAP_S:
                    time.sleep(0.05)
                    hit = DURING[fault](world, proc, rng)
                result.faults[fault] = hit
        _wait_exit(proc, "the faulted run")
        world.live.discard(proc.pid)
        log.seek(0)
        return proc.returncode, log.read(), proc.pid


def repair(world: World, faults: list[str]) -> None:
    """What the operator does before the rerun: free the disk, restart the lost node, and (the
    store) nothing: it answers again by itself once the pause ends."""
    if "disk_full" in faults and world.disk is not None:
        (world.disk / "filler").unlink(missing_ok=True)
    raylet_alive = any("/raylet/raylet " in cmdline(p) + " " for p in session_pids([world.sessions.get("node", -1)]))
    if "kill_raylet" in faults or not raylet_alive:
        kill_session(world, "node")
        start_second_raylet(world)
    if "stop_store" in faults:
        time.sleep(max(0.0, world.store_paused_until - time.monotonic()))
        world.store.send_signal(signal.SIGCONT)


def check_printed(printed: str, returncode: int, attempt: int, killed: bool) -> None:
    if "Traceback" in printed:
        tail = printed[printed.index("Traceback"):][:1500]
        raise RoundFailed(f"run {attempt} showed a traceback: {tail}")
    # Ray forwards its workers' and raylets' log lines to the driver's terminal, sometimes after
    # the error: the error is the one `Error: ` line, wherever it lands.
    errors = [line for line in printed.splitlines() if line.startswith("Error: ")]
    if returncode not in (0, -9) and not killed and len(errors) != 1:
        raise RoundFailed(f"run {attempt} exited {returncode} without one error line: {printed.splitlines()[-5:]}")


def play_round(world: World, stage: str, index: int, seed: int, only: list[str] | None = None) -> Round:
    result = Round(stage=stage, index=index, attempts=1)
    plan = draw(world, stage, index, seed, only)
    rng, result.variant, faults, units, delay = plan
    out = out_for(world, result.variant, f"{stage}-{index}")
    argv = command(world, result.variant, out)
    before, pgids = snapshot(world, out), []
    started = time.monotonic()
    try:
        rc, printed, pgid = faulted_run(world, result.variant, argv, out, plan, world.root / "logs" / f"{stage}-{index}-1.log", result)
        pgids.append(pgid)
        ended = time.monotonic()
        check_printed(printed, rc, 1, killed="kill_driver" in faults)
        result.first_error = next((line for line in printed.splitlines() if line.startswith("Error: ")), "")
        repair(world, faults)
        for fault in faults:
            if fault in BETWEEN:
                result.faults[fault] = BETWEEN[fault](world, result.variant, out, rng)
        result.faults.update({f: "" for f in faults if f not in result.faults})
        check_flip_found(world, result, out)
        damaged = any(result.faults[f] and not result.faults[f].startswith("missed") for f in BETWEEN if f in result.faults)
        while (rc != 0 or damaged) and result.attempts < MAX_ATTEMPTS:  # the user's reruns
            damaged = False
            result.attempts += 1
            rc, printed, pgid = rerun(world, argv)
            pgids.append(pgid)
            check_printed(printed, rc, result.attempts, killed=False)
            if rc == 0:
                break
        if rc != 0:
            raise RoundFailed(f"the stage did not end after {result.attempts} runs: {printed.strip().splitlines()[-1:]}")
        result.recovery_s = time.monotonic() - ended
        check_outputs(world, result.variant, out)
        check_leftovers(world, pgids)
        check_outside(world, before, snapshot(world, out))
    except RoundFailed as failure:
        result.error = str(failure)
        repair(world, faults)  # the next round starts from a whole cluster, store and disk
    finally:
        result.seconds = time.monotonic() - started
        remove_out(world, out)
    return result


def rerun(world: World, argv: list[str]) -> tuple[int, str, int]:
    proc = subprocess.Popen(argv, env=world.env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    world.live.add(proc.pid)
    try:
        printed, _ = proc.communicate(timeout=RUN_CAP_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RoundFailed(f"a rerun hung: still running after {RUN_CAP_S:.0f} s") from None
    world.live.discard(proc.pid)
    return proc.returncode, printed, proc.pid


# --------------------------------------------------------------------------------------------
# Checks.


def check_flip_found(world: World, result: Round, out: str) -> None:
    """A bit flipped in a published shard is found by `alrira-cache verify`, naming the shard,
    before the rerun rebuilds it (the trainer's per-chunk CRC check is tests/test_object_store.py's)."""
    hit = result.faults.get("flip_bit", "")
    if not result.variant.startswith("build") or not hit.startswith("shards/"):
        return
    shard = hit.split("/")[1]
    verify = subprocess.run([sys.executable, "-m", "ray_jobs", "verify", out], env=world.env, capture_output=True, text=True, timeout=RUN_CAP_S)
    if verify.returncode == 0 or shard not in verify.stdout + verify.stderr:
        raise RoundFailed(f"verify did not report the flipped bit in {shard}: exit {verify.returncode}, {verify.stdout[-500:]} {verify.stderr[-500:]}")


def check_outputs(world: World, variant: str, out: str) -> None:
    if variant.startswith("build"):
        verify = subprocess.run([sys.executable, "-m", "ray_jobs", "verify", out], env=world.env, capture_output=True, text=True, timeout=RUN_CAP_S)
        if verify.returncode != 0:
            raise RoundFailed(f"alrira-cache verify failed: {verify.stdout[-800:]} {verify.stderr[-800:]}")
        got, want = json.loads(read_out(world, out, "manifest.json")), json.loads(read_out(world, str(world.references["build"]), "manifest.json"))
        pairs = [[(s["name"], s["checksum"]) for s in m["shards"]] for m in (got, want)]
        if pairs[0] != pairs[1]:
            raise RoundFailed(f"the shards differ from the clean build's: {sorted(set(pairs[0]) ^ set(pairs[1]))[:4]}")
    elif variant.startswith("regenerate"):
        reference = str(world.references[variant])
        names = sorted(p["name"] for p in json.loads(read_out(world, reference, "manifest.json"))["parts"])
        got = sorted(p["name"] for p in json.loads(read_out(world, out, "manifest.json"))["parts"])
        differ = [n for n in names if read_out(world, out, n) != read_out(world, reference, n)]
        if got != names or differ:
            raise RoundFailed(f"the parts differ from the clean run's: listed {got}, differing {differ}")
    else:
        check_training(Path(world.references["train"]), Path(out))


def check_training(reference: Path, out: Path) -> None:
    want = sorted(p.relative_to(reference) for p in (reference / "drafter").rglob("*.safetensors"))
    differ = [str(p) for p in want if not (out / p).is_file() or (out / p).read_bytes() != (reference / p).read_bytes()]
    if not want or differ:
        raise RoundFailed(f"the final weights differ from the clean run's: {differ or 'no weights in the reference'}")
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    clean = [json.loads(line)["step"] for line in (reference / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if steps != clean:
        raise RoundFailed(f"metrics.jsonl steps {steps} (the clean run's {clean})")


def check_leftovers(world: World, pgids: list[int]) -> None:
    """No process of any run left (its own session), no stage actor left on the cluster (Ray reaps
    a killed driver's actors asynchronously: waited for, within a bound)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        left = session_pids(pgids)
        actors = [p for p in session_pids(world.sessions.values()) if cmdline(p).startswith(ACTOR_TITLES)]
        if not left and not actors:
            return
        time.sleep(0.5)
    raise RoundFailed(f"processes left running: {[(p, cmdline(p)[:60]) for p in left + actors]}")


def snapshot(world: World, out: str) -> dict[str, tuple[int, int]]:
    """Every file under the work dir outside --out and the declared temp dirs (TMPDIR, the
    XDG cache, Ray's temp dirs, the logs), and every object of the bucket outside --out."""
    declared = {"tmp", "xdg", "ray-head", "ray-node", "logs", "disk", "outs"}
    files = {}
    for path in world.root.rglob("*"):
        relative = path.relative_to(world.root)
        if relative.parts[0] in declared or not path.is_file():
            continue
        stat = path.stat()
        files[str(relative)] = (stat.st_size, stat.st_mtime_ns)
    if world.store is not None:
        fs = store_fs(world)
        for name, info in fs.find("chaos", detail=True).items():
            if not f"s3://{name}".startswith(out + "/"):
                files[f"s3://{name}"] = (info["size"], 0)
    if world.disk is not None:
        files.update({f"disk/{p.name}": (0, 0) for p in world.disk.iterdir() if str(p) != out})
    return files


def check_outside(world: World, before: dict, after: dict) -> None:
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        raise RoundFailed(f"written outside --out and the declared temp dirs: {changed[:6]}")


# --------------------------------------------------------------------------------------------
# Main.


def summary(seed: int, rounds: list[Round], stages: list[str]) -> str:
    parts = []
    for stage in stages:
        mine = [r for r in rounds if r.stage == stage]
        counts: dict[str, int] = {}
        for r in mine:
            for fault in r.faults:
                counts[fault] = counts.get(fault, 0) + 1
        faults = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
        parts.append(f"{stage} {sum(not r.error for r in mine)}/{len(mine)} rounds passed (faults: {faults})")
    return f"chaos: seed {seed}: " + "; ".join(parts)


def table(rows: list[dict]) -> str:
    """docs/benchmarks.md's table of rounds (the --jsonl lines of one or more runs): per stage, the
    distinct rounds (a round replayed later counts once, its last result), faults hit / missed,
    round and recovery seconds, runs per round."""
    import statistics

    latest = {(r["seed"], r["stage"], r["index"]): r for r in rows}
    lines = ["| stage | rounds passed | faults injected (hit / missed) | round s: median (min-max) | recovery s: median (max) | runs per round: 1 / 2 / 3+ |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for stage in STAGES:
        mine = [r for key, r in sorted(latest.items()) if key[1] == stage]
        if not mine:
            continue
        variants = {}
        faults: dict[str, list[int]] = {}
        for r in mine:
            variants[r["variant"]] = variants.get(r["variant"], 0) + 1
            for fault, hit in r["faults"].items():
                faults.setdefault(fault, [0, 0])[bool(hit.startswith("missed"))] += 1
        seconds, recovery = [r["seconds"] for r in mine], [r["recovery_s"] for r in mine]
        runs = [sum(r["attempts"] == n for r in mine) for n in (1, 2)] + [sum(r["attempts"] >= 3 for r in mine)]
        lines.append(
            f"| {stage} ({', '.join(f'{v} {n}' for v, n in sorted(variants.items()))}) | {sum(not r['error'] for r in mine)}/{len(mine)} "
            f"| {', '.join(f'{f} {h}/{m}' for f, (h, m) in sorted(faults.items()))} "
            f"| {statistics.median(seconds):.0f} ({min(seconds):.0f}-{max(seconds):.0f}) | {statistics.median(recovery):.0f} ({max(recovery):.0f}) "
            f"| {' / '.join(map(str, runs))} |"
        )
    return "\n".join(lines)


def _stages(text: str) -> list[str]:
    """--stage: `all` or a comma-separated subset of STAGES, in STAGES' order."""
    names = list(STAGES) if text == "all" else text.split(",")
    unknown = [n for n in names if n not in STAGES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text}: expected all or one or more of {', '.join(STAGES)}")
    return [s for s in STAGES if s in names]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=_stages, default="all", help=f"all, or one or more of {', '.join(STAGES)}, comma-separated")
    parser.add_argument("--rounds", type=int, default=10, help="rounds per stage")
    parser.add_argument("--seed", type=int, default=None, help="seed of every draw (default: a fresh one, printed)")
    parser.add_argument("--only-round", type=int, default=None, help="replay only this round (with --seed)")
    parser.add_argument("--first-round", type=int, default=0,
                        help="start at this round index (rounds are independent draws: a later run with the same seed continues where one stopped)")
    parser.add_argument("--time-budget-s", type=float, default=None, help="start no round after this many seconds")
    parser.add_argument("--work-root", default=None, help="where the work directory goes (default: $TMPDIR)")
    parser.add_argument("--jsonl", default=None, help="append one JSON line per round here")
    parser.add_argument("--faults", default=None, help="comma-separated: inject only these (regression runs)")
    parser.add_argument("--table", nargs="+", default=None, metavar="JSONL",
                        help="print docs/benchmarks.md's table of the rounds in these --jsonl files and exit (runs nothing)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table:
        print(table([json.loads(line) for name in args.table for line in Path(name).read_text().splitlines() if line.strip()]))
        return 0
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    stages = args.stage
    print(f"chaos: seed {seed} (replay: --seed {seed}), stages {','.join(stages)}, {args.rounds} round(s) each", flush=True)
    root = Path(tempfile.mkdtemp(prefix="chaos-", dir=args.work_root))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleanup runs on a plain kill too
    world, rounds, started = None, [], time.monotonic()
    try:
        (root / "logs").mkdir()
        world = make_world(root, log=lambda m: print(m, flush=True))
        start_store(world)
        start_cluster(world)
        mount_disk(world)
        make_references(world, stages)
        indices = [args.only_round] if args.only_round is not None else range(args.first_round, args.first_round + args.rounds)
        for index in indices:
            for stage in stages:
                if args.time_budget_s is not None and time.monotonic() - started > args.time_budget_s:
                    break
                result = play_round(world, stage, index, seed, args.faults.split(",") if args.faults else None)
                rounds.append(result)
                print(report_line(result, seed), flush=True)
                if args.jsonl:
                    with open(args.jsonl, "a") as f:
                        f.write(json.dumps({"seed": seed, **result.__dict__}) + "\n")
    finally:
        if world is not None:
            close_world(world)
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(summary(seed, rounds, stages), flush=True)
    return 0 if rounds and not any(r.error for r in rounds) else 1


def report_line(r: Round, seed: int) -> str:
    faults = ", ".join(f"{k}{f' ({v})' if v else ''}" for k, v in r.faults.items())
    head = f"{r.stage} round {r.index} [{r.variant}]: {faults}; {r.attempts} run(s), {r.seconds:.1f}s, recovery {r.recovery_s:.1f}s"
    if r.error:
        return f"{head}: FAILED: {r.error} (replay: --stage {r.stage} --seed {seed} --only-round {r.index})"
    return f"{head}: ok"


if __name__ == "__main__":
    sys.exit(main())
