"""What each cache setting costs at the Qwen3-4B shapes of speed/real_shapes.py, side by side
in one run (docs/benchmarks.md, "Cache settings"):

(g) bytes per corpus token, by array group, of one Zarr shard of the same synthetic sequences
    written under every setting (--feature-codec, --rollout-feature-codec, --ira-parents,
    --no-rollout-features, --compact), and the stage-1 writer's CPU seconds per sequence (one
    writer thread: Blosc, CRC, checksum), each setting in turn;
(h) the codec profile: what the compressor settings (zstd level, byte shuffle, bit shuffle, no
    shuffle, lz4) make of one sequence's bf16 and fp8 feature bits, and at what speed;
(i) the alr_ira loader (getitem + collate, one core) on the full cache and on the compact one, in
    turn, and the 8-GPU node projection from it; plus alr for reference.

    .venv/bin/python -m benchmarks.speed.cache_settings [--quick] [--out DIR] [--sequences 4]

Features are random bf16 (common/real_shape_cache.py's): real activations compressed 1.41x bf16 in a
SmolLM2-135M cache against 1.35x here, so the bf16 rows are close; fp8 of real activations (outlier
channels, a per-token scale) may compress differently. Token and top-k ids are random too, so the
small arrays do not compress as real ones would (they are <1% of the bytes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from numcodecs import Blosc

from benchmarks.common.cli import bench_parser, work_directory
from benchmarks.common.loader import loader_pass, one_core, rank_batches
from benchmarks.common.real_shape_cache import FULL, QUICK, Shapes, objective, save_real_shape_manifest, synthetic_record
from benchmarks.common.report import RunClock, finish_run, print_table
from pipeline.train.batching import CacheTrainDataset
from storage.codecs import decode_features, encode_features
from storage.format import ALL_GROUPS, ira_parent_rows
from storage.reader import BYTE_GROUPS, cache_group_bytes, open_cache
from storage.shards import write_shard

KIB = 1024
PEER_KIB = (30, 15)  # the goal (a peer's plain bf16 DFlash cache) and stretch (a peer's fp8 cache)


@dataclass(frozen=True, kw_only=True)
class Setting:
    name: str
    feature_codec: str = "bf16"
    rollout_feature_codec: str | None = None
    ira_parents: int | None = None  # at A = 128; scaled with the pool for --quick
    rollout_features: bool = True
    profile: str | None = None

    def parents(self, num_anchors: int) -> int | None:
        return None if self.ira_parents is None else max(1, self.ira_parents * num_anchors // 128)


SETTINGS = (
    Setting(name="full, bf16 (today's default)"),
    Setting(name="--rollout-feature-codec fp8", rollout_feature_codec="fp8"),
    Setting(name="--feature-codec fp8 (every feature array)", feature_codec="fp8"),
    Setting(name="--ira-parents 64", ira_parents=64),
    Setting(name="--ira-parents 32", ira_parents=32),
    Setting(name="--compact (= rollout fp8, --ira-parents 64)", rollout_feature_codec="fp8", ira_parents=64, profile="compact"),
    Setting(name="rollout fp8, --ira-parents 32", rollout_feature_codec="fp8", ira_parents=32),
    Setting(name="fp8, --ira-parents 64", feature_codec="fp8", ira_parents=64),
    Setting(name="fp8, --ira-parents 16", feature_codec="fp8", ira_parents=16),
    Setting(name="--no-rollout-features, bf16", rollout_features=False),
    Setting(name="--no-rollout-features, fp8", feature_codec="fp8", rollout_features=False),
)  # fmt: skip


def encode_for(records: list[dict], setting: Setting) -> list[dict]:
    """The bf16 records as `setting` stores them: fp8 where its codecs say, the parents' rollout
    features only, no rollout features at all."""
    out = []
    for record in records:
        r = {k: v for k, v in record.items() if k != "rollout_features"}
        codecs = {"features": setting.feature_codec, "rollout_features": setting.rollout_feature_codec or setting.feature_codec}
        if codecs["features"] == "fp8":
            r["features"], r["feature_scales"] = encode_features(torch.from_numpy(decode_features(record["features"], None, codec="bf16")), codec="fp8")
        if setting.rollout_features:
            rows = record["rollout_features"][ira_parent_rows(len(record["anchor_pos"]), setting.parents(len(record["anchor_pos"])))]
            if codecs["rollout_features"] == "fp8":
                rows, r["rollout_feature_scales"] = encode_features(torch.from_numpy(decode_features(rows, None, codec="bf16")), codec="fp8")
            r["rollout_features"] = rows
        out.append(r)
    return out


def write_setting(root: Path, records: list[dict], setting: Setting, shapes: Shapes) -> tuple[Path, float]:
    """A one-shard cache of `records` under `setting`, and the writer's CPU seconds (one thread)."""
    contents = list(ALL_GROUPS) if setting.rollout_features else [g for g in ALL_GROUPS if g != "rollout_features"]
    ira_parents = setting.parents(shapes.num_anchors) if setting.rollout_features else None
    rollout_codec = setting.rollout_feature_codec if setting.rollout_features else None
    cpu = time.process_time()
    shard = write_shard(
        root, shard_index=0, records=records, storage_format="zarr", feature_codec=setting.feature_codec,
        contents=contents, rollout_feature_codec=rollout_codec, ira_parents=ira_parents,
    )  # fmt: skip
    cpu = time.process_time() - cpu
    save_real_shape_manifest(
        root, [shard], shapes, num_records=len(records), created_with="benchmarks/speed/cache_settings.py",
        feature_codec=setting.feature_codec, contents=contents, rollout_feature_codec=rollout_codec, ira_parents=ira_parents,
        profile=setting.profile,
    )  # fmt: skip
    return root, cpu


def bench_bytes(work: Path, records: list[dict], shapes: Shapes) -> list[dict]:
    """(g) every setting's bytes by group and writer CPU, the same records each time."""
    rows = []
    num_tokens = sum(len(r["input_ids"]) for r in records)
    torch.set_num_threads(1)
    for i, setting in enumerate(SETTINGS):
        encoded = encode_for(records, setting)
        cache, cpu = write_setting(work / f"setting-{i}", encoded, setting, shapes)
        reader = open_cache(cache)
        groups = cache_group_bytes(reader)
        reader.close()
        total = sum(groups.values())
        rows.append({"setting": setting.name, "bytes": total, "tokens": num_tokens, "sequences": len(records),
                     "per_token": {g: b / num_tokens for g, b in groups.items()}, "bytes_per_token": total / num_tokens,
                     "writer_cpu_s_per_sequence": cpu / len(records), "cache": str(cache)})  # fmt: skip
        print(f"  {setting.name}: {total / num_tokens / KIB:.2f} KiB/token, writer {cpu / len(records):.2f} CPU s/seq", flush=True)
    groups = [*BYTE_GROUPS, "index"]
    print_table(
        f"(g) bytes per corpus token by array group (KiB), Zarr, {len(records)} sequences, {num_tokens} tokens, "
        f"A={shapes.num_anchors}, F={shapes.feature_dim}; writer CPU s per sequence on one thread",
        ["setting", *groups, "total KiB/token", "vs 30 KiB", "MB/seq", "writer CPU s/seq"],
        [[r["setting"], *(f"{r['per_token'][g] / KIB:.2f}" for g in groups), f"{r['bytes_per_token'] / KIB:.2f}",
          f"{r['bytes_per_token'] / KIB / PEER_KIB[0]:.2f}x", f"{r['bytes'] / r['sequences'] / 1e6:.1f}",
          f"{r['writer_cpu_s_per_sequence']:.2f}"] for r in rows],
    )  # fmt: skip
    return rows


BLOCK = 256 << 10  # storage.formats.zarr.write.ZARR_BLOSC_BLOCK_BYTES: one Blosc block per 256 KiB chunk
CODEC_VARIANTS = (
    ("zstd 3, byte shuffle, auto blocks (Zarr before)", dict(cname="zstd", clevel=3, shuffle=Blosc.SHUFFLE)),
    ("zstd 3, byte shuffle, 256 KiB blocks (now)", dict(cname="zstd", clevel=3, shuffle=Blosc.SHUFFLE, blocksize=BLOCK)),
    ("zstd 1, byte shuffle, 256 KiB", dict(cname="zstd", clevel=1, shuffle=Blosc.SHUFFLE, blocksize=BLOCK)),
    ("zstd 5, byte shuffle, 256 KiB", dict(cname="zstd", clevel=5, shuffle=Blosc.SHUFFLE, blocksize=BLOCK)),
    ("zstd 9, byte shuffle, 256 KiB", dict(cname="zstd", clevel=9, shuffle=Blosc.SHUFFLE, blocksize=BLOCK)),
    ("zstd 3, bit shuffle, 256 KiB", dict(cname="zstd", clevel=3, shuffle=Blosc.BITSHUFFLE, blocksize=BLOCK)),
    ("zstd 3, no shuffle, 256 KiB", dict(cname="zstd", clevel=3, shuffle=Blosc.NOSHUFFLE, blocksize=BLOCK)),
    ("lz4 5, byte shuffle, 256 KiB", dict(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE, blocksize=BLOCK)),
)


def bench_codecs(record: dict) -> list[dict]:
    """(h) one sequence's corpus features as bf16 bits and as fp8 bits through each Blosc variant
    (256 KiB chunks, as the writer's; one thread): compression ratio against the bits and MB/s."""
    import numcodecs.blosc

    numcodecs.blosc.use_threads = False
    bf16 = record["features"]  # [T, F] uint16
    fp8, _ = encode_features(torch.from_numpy(decode_features(bf16, None, codec="bf16")), codec="fp8")
    rows = []
    for label, bits in (("bf16", bf16), ("fp8", fp8)):
        flat = np.ascontiguousarray(bits).reshape(-1)
        chunk = (256 << 10) // bits.itemsize
        pieces = [flat[i : i + chunk] for i in range(0, len(flat), chunk)]
        for name, config in CODEC_VARIANTS:
            codec = Blosc(**config, typesize=bits.itemsize)
            start = time.process_time()
            size = sum(len(codec.encode(p)) for p in pieces)
            seconds = time.process_time() - start
            rows.append({"bits": label, "codec": name, "ratio": bits.nbytes / size, "mb_per_s": bits.nbytes / 1e6 / seconds,
                         "bytes_per_element": size / bits.size})  # fmt: skip
    print_table(
        f"(h) corpus features of one sequence ({bf16.shape[0]} x {bf16.shape[1]}), each Blosc variant, one thread",
        ["bits", "compressor", "ratio vs the bits", "bytes/element", "compress MB/s"],
        [[r["bits"], r["codec"], f"{r['ratio']:.3f}", f"{r['bytes_per_element']:.3f}", f"{r['mb_per_s']:.0f}"] for r in rows],
    )  # fmt: skip
    return rows


# An 8-GPU node consumes 80-240 sequences/s (global batch 24 at a 0.3-0.1 s step; speed/real_shapes_reads.py).
NODE_SEQ_PER_S = (80, 240)


def loader_rate(cache: Path, *, method: str, shapes: Shapes, rounds: int = 3) -> float:
    """getitem + collate of rank batches on one core, best of `rounds` passes (sequences/s)."""
    reader = open_cache(cache)
    dataset = CacheTrainDataset(reader, objective=objective(method, reader), seed=0)
    batches = rank_batches(len(reader), shapes.rank_batch)
    try:
        with one_core():
            return max(loader_pass(dataset, batches, pass_index=p) for p in range(rounds))
    finally:
        reader.close()


def bench_loader(byte_rows: list[dict], shapes: Shapes, *, rounds: int) -> list[dict]:
    """(i) full vs compact: the loader's sequences/s per core, measured in turn (round by round)."""
    caches = {r["setting"]: Path(r["cache"]) for r in byte_rows}
    pairs = [(SETTINGS[0].name, m) for m in ("alr", "alr_ira")] + [(SETTINGS[5].name, m) for m in ("alr", "alr_ira")]
    best: dict[tuple[str, str], float] = {}
    for _ in range(rounds):  # in turn, so a burst of load lands on every row
        for setting, method in pairs:
            rate = loader_rate(caches[setting], method=method, shapes=shapes, rounds=1)
            best[(setting, method)] = max(best.get((setting, method), 0.0), rate)
    per_token = {r["setting"]: r["bytes"] / r["sequences"] for r in byte_rows}
    rows = [{"setting": s, "method": m, "seq_per_s_per_core": best[(s, m)], "mb_per_sequence": per_token[s] / 1e6,
             "node_cores": [n / best[(s, m)] for n in NODE_SEQ_PER_S]} for s, m in pairs]  # fmt: skip
    print_table(
        f"(i) loader on one core (getitem + collate, rank batches of {shapes.rank_batch}, best of {rounds}, in turn) "
        f"and the 8-GPU node's loader cores at {NODE_SEQ_PER_S[0]}-{NODE_SEQ_PER_S[1]} sequences/s",
        ["cache", "method", "seq/s/core", "cache MB/seq", "loader cores per node"],
        [[r["setting"], r["method"], f"{r['seq_per_s_per_core']:.2f}", f"{r['mb_per_sequence']:.1f}",
          f"{r['node_cores'][0]:.0f}-{r['node_cores'][1]:.0f}"] for r in rows],
    )  # fmt: skip
    return rows


def main() -> None:
    parser = bench_parser(__doc__, quick_help="tiny shapes (a smoke run)", out_help="empty work directory (default: a new temp dir)")
    parser.add_argument("--sequences", type=int, default=None, help="synthetic sequences (default 6 full, 4 quick)")
    args = parser.parse_args()
    shapes = QUICK if args.quick else FULL
    work = work_directory(args.out, temp_prefix="alrira-cache-settings-")
    clock = RunClock()
    rng = np.random.default_rng(0)
    num = args.sequences or (4 if args.quick else 6)
    records = [synthetic_record(rng, shapes, source_row=i) for i in range(num)]
    byte_rows = bench_bytes(work, records, shapes)
    codec_rows = bench_codecs(records[0])
    loader_rows = bench_loader(byte_rows, shapes, rounds=1 if args.quick else 3)
    shapes_json = {"F": shapes.feature_dim, "A": shapes.num_anchors, "K": shapes.num_slots, "top_k": shapes.top_k}
    finish_run(work, {"shapes": shapes_json, "bytes": byte_rows, "codecs": codec_rows, "loader": loader_rows}, clock)


if __name__ == "__main__":
    main()
