"""Stage-1 target backends on the same work: HF `run_target_batch` vs `VllmTargetRunner.run`.

Both backends get the same sequences, anchor pools and batches (ShardBuilder's `plan_batches`), in
fp32 on a tiny random Qwen3. For each: the corpus pass alone (--no-rollouts), and corpus pass +
rollouts; anchors/s counts every pool anchor (rollout depth K - 1) per second of the whole batch
computation, and "rollouts only" divides by the difference of the two times. The vLLM/HF ratio is
printed, and the script checks that both backends gave the same rollout tokens.

    .venv-vllm/bin/python -m benchmarks.speed.rollout_backends [--quick] [--repeats N] [--tensor-parallel-size N]

Timings are wall-clock, the fastest of --repeats alternating runs after one warm-up (the machine
is shared), torch and vLLM on 2 threads; the vLLM engine start is timed separately. See docs/vllm.md for results.
"""

from __future__ import annotations

import os

# Before torch is imported: the vLLM CPU worker otherwise drops to 1 thread; HF gets the same 2.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks.common.cli import bench_parser, work_directory
from benchmarks.common.toy import make_bench_target, wide_target
from pipeline.cache_build.rollouts import TargetRunConfig, TargetSequence, run_target_batch
from pipeline.cache_build.shard_builder import plan_batches
from pipeline.demo.toy import ToyShape
from pipeline.target import load_target

NUM_THREADS = 2


@dataclass(kw_only=True)
class BenchSizes:
    """Model and work of one benchmark run."""

    target: ToyShape  # the random Qwen3 measured on (common/toy.py make_bench_target)
    num_sequences: int
    lengths: tuple[int, int]  # sequence lengths drawn uniformly from [lo, hi]
    layer_ids: list[int]
    num_slots: int  # K
    top_k: int
    anchors: int  # anchor pool per sequence
    batch_tokens: int


FULL = BenchSizes(
    target=wide_target(num_hidden_layers=4),
    num_sequences=16,
    lengths=(256, 512),
    layer_ids=[0, 1, 2],
    num_slots=15,
    top_k=8,
    anchors=64,
    batch_tokens=4096,
)

QUICK = BenchSizes(
    target=ToyShape(),  # the toy defaults: hidden 64, 4 layers
    num_sequences=4,
    lengths=(160, 300),
    layer_ids=[0, 2],
    num_slots=15,
    top_k=8,
    anchors=16,
    batch_tokens=1024,
)


def make_sequences(sizes: BenchSizes, *, vocab: int, seed: int = 0) -> list[TargetSequence]:
    """Random token ids; the loss mask covers everything after a 'prompt' of 10-30% of the tokens."""
    rng = np.random.default_rng(seed)
    sequences = []
    for row in range(sizes.num_sequences):
        length = int(rng.integers(sizes.lengths[0], sizes.lengths[1] + 1))
        loss_mask = np.zeros(length, np.uint8)
        loss_mask[int(length * rng.uniform(0.1, 0.3)) :] = 1
        sequences.append(TargetSequence(source_row=row, input_ids=rng.integers(0, vocab, length), loss_mask=loss_mask))
    return sequences


def run_batches(run, sequences: list[TargetSequence], batches: list[list[int]]) -> list:
    outputs = []
    for batch in batches:
        outputs.extend(run([sequences[i] for i in batch]))
    return outputs


def bench(backends: dict, sequences, batches, config: TargetRunConfig, *, repeats: int) -> dict:
    """backends: name -> run_with(config), which gives a function of a batch of sequences. Times the
    corpus-only and the full run of every backend, alternating backends within each repeat so all
    of them see the same load from other jobs, and keeps the fastest of `repeats` of each."""
    corpus_config = dataclasses.replace(config, rollouts=False)
    for run_with in backends.values():
        run_batches(run_with(config), sequences, batches[:1])  # warm-up
    times = {name: {"corpus_s": [], "full_s": []} for name in backends}
    outputs = {}
    for _ in range(repeats):
        for name, run_with in backends.items():
            start = time.perf_counter()
            run_batches(run_with(corpus_config), sequences, batches)
            times[name]["corpus_s"].append(time.perf_counter() - start)
            start = time.perf_counter()
            outputs[name] = run_batches(run_with(config), sequences, batches)
            times[name]["full_s"].append(time.perf_counter() - start)
    return {
        name: {"corpus_s": min(t["corpus_s"]), "full_s": min(t["full_s"]), "outputs": outputs[name]}
        for name, t in times.items()
    }


def compare(hf_outputs, vllm_outputs) -> dict:
    """Rollout-token agreement and the largest absolute differences between the backends."""
    num_anchors = sum(len(o.anchor_pos) for o in hf_outputs)
    same_tokens = sum(
        int((h.rollout_tokens == v.rollout_tokens).all(dim=1).sum()) for h, v in zip(hf_outputs, vllm_outputs)
    )
    diffs, scale = {}, {}
    for name in ("corpus_topk_probs", "rollout_topk_probs", "features", "rollout_features"):
        diffs[name] = max(
            float((getattr(h, name) - getattr(v, name)).abs().max()) for h, v in zip(hf_outputs, vllm_outputs)
        )
        scale[name] = max(float(getattr(h, name).abs().max()) for h in hf_outputs)
    return {"num_anchors": num_anchors, "same_tokens": same_tokens, "max_abs_diff": diffs, "max_abs": scale}


def main():
    parser = bench_parser(__doc__, quick_help="tiny model and corpus (a smoke run)", out_help="work folder (default: a temp folder)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=None, help="vLLM max_num_seqs (default: vLLM's)")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL

    torch.set_num_threads(NUM_THREADS)
    work = work_directory(args.out, temp_prefix="bench-rollout-backends-")
    target = make_bench_target(work / "target", sizes.target)
    model = load_target(target, dtype=torch.float32)
    sequences = make_sequences(sizes, vocab=model.config.vocab_size - 16)
    batches = plan_batches([len(s.input_ids) for s in sequences], batch_tokens=sizes.batch_tokens)
    config = TargetRunConfig(
        layer_ids=sizes.layer_ids, num_slots=sizes.num_slots, top_k=sizes.top_k, anchors_per_sequence=sizes.anchors
    )

    from pipeline.cache_build.vllm_runner import VllmTargetRunner

    start = time.perf_counter()
    runner = VllmTargetRunner(
        target,
        run_config=config,
        tensor_parallel_size=args.tensor_parallel_size,
        dtype="float32",
        workdir=work / "vllm",
        engine_args={} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs},
    )
    engine_s = time.perf_counter() - start
    max_num_seqs = runner.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    torch.set_num_threads(NUM_THREADS)

    def vllm_run_with(c):
        def run(seqs):
            runner.run_config = c
            return runner.run(seqs)

        return run

    results = bench(
        {
            "HF run_target_batch": lambda c: (lambda seqs: run_target_batch(model, seqs, c)),
            "vLLM VllmTargetRunner": vllm_run_with,
        },
        sequences,
        batches,
        config,
        repeats=args.repeats,
    )
    hf, vl = results["HF run_target_batch"], results["vLLM VllmTargetRunner"]
    cached = sum(int(o.extras["rollout_cached_tokens"].sum()) for o in vl["outputs"])
    prompt_tokens = sum(int((o.anchor_pos.long() + 2).sum()) for o in vl["outputs"])
    runner.close()

    check = compare(hf["outputs"], vl["outputs"])
    num_anchors = check["num_anchors"]
    num_tokens = sum(len(s.input_ids) for s in sequences)
    print(
        f"work: {len(sequences)} sequences, {num_tokens} tokens, {len(batches)} batches (batch_tokens "
        f"{sizes.batch_tokens}), {num_anchors} anchors, K={config.num_slots}, top_k={config.top_k}, "
        f"taps {config.layer_ids}; model hidden {sizes.target.hidden_size} x {sizes.target.num_hidden_layers} layers, fp32, "
        f"{NUM_THREADS} threads; fastest of {args.repeats}"
    )
    print(
        f"vLLM engine start: {engine_s:.1f} s (not in the times below); TP={args.tensor_parallel_size}, "
        f"max_num_seqs={max_num_seqs}; "
        f"torch threads during the runs: {torch.get_num_threads()}"
    )
    print(
        f"vLLM rollout prompt tokens served from the prefix cache: {cached}/{prompt_tokens} "
        f"({cached / prompt_tokens:.0%})"
    )
    print()
    print("| backend | corpus pass s | corpus + rollouts s | anchors/s (whole) | anchors/s (rollouts only) |")
    print("|---|---|---|---|---|")
    rates = {}
    for name, res in results.items():
        whole = num_anchors / res["full_s"]
        rollouts = num_anchors / max(res["full_s"] - res["corpus_s"], 1e-9)
        rates[name] = (whole, rollouts)
        print(f"| {name} | {res['corpus_s']:.3f} | {res['full_s']:.3f} | {whole:.1f} | {rollouts:.1f} |")
    (hf_whole, hf_roll), (vl_whole, vl_roll) = rates.values()
    print()
    print(f"ratio vLLM / HF: whole {vl_whole / hf_whole:.2f}x, rollouts only {vl_roll / hf_roll:.2f}x")
    print(
        f"agreement: rollout tokens identical for {check['same_tokens']}/{num_anchors} anchors; max abs diff "
        + ", ".join(f"{k} {v:.2g} (of max |x| {check['max_abs'][k]:.3g})" for k, v in check["max_abs_diff"].items())
    )
    if check["same_tokens"] != num_anchors:
        raise SystemExit("error: the backends disagree on rollout tokens")


if __name__ == "__main__":
    main()
