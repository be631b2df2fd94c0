"""What the per-chunk checksums cost the trainer's reads (docs/benchmarks.md, "Read checksums").

Writes the same synthetic records (random bf16 features, real shapes of storage/format.py) as
Zarr and WebDataset shards with and without checksums (CRC32C per Zarr chunk, CRC32 per tar
member), then times `CacheReader.read` over every sequence, both alternating, median of repeats:

    .venv/bin/python benchmarks/read_checksums.py [--quick] [--threads 1]

It also flips one byte of a stored rollout_topk_probs and checks that the checksummed reader
refuses it while the unchecked one returns a silently different value.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from _common import print_table

from storage.format import SHARD_DIR
from storage.manifest import CacheSettings, Manifest, save_manifest
from storage.reader import open_cache
from storage.shards import write_shard


@dataclass(frozen=True)
class Sizes:
    num_sequences: int
    seq_len: int  # T
    feature_dim: int  # F
    num_anchors: int  # A
    num_slots: int = 15  # K
    top_k: int = 8
    repeats: int = 3


FULL = Sizes(num_sequences=16, seq_len=512, feature_dim=2048, num_anchors=64)
QUICK = Sizes(num_sequences=4, seq_len=64, feature_dim=64, num_anchors=8, repeats=1)


def _bf16_bits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    values = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(torch.bfloat16)
    return values.view(torch.int16).numpy().view(np.uint16)


def _probs(rng: np.random.Generator, shape: tuple[int, ...], top_k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    probs = -np.sort(-rng.dirichlet(np.ones(top_k + 1), size=shape)[..., :top_k], axis=-1).astype(np.float32)
    tail = np.maximum(0.0, 1.0 - probs.sum(-1)).astype(np.float32)
    return rng.integers(0, 150_000, size=(*shape, top_k)).astype(np.int32), probs, tail


def make_record(rng: np.random.Generator, sizes: Sizes, source_row: int) -> dict[str, np.ndarray]:
    t, a, k, top_k = sizes.seq_len, sizes.num_anchors, sizes.num_slots, sizes.top_k
    input_ids = rng.integers(0, 150_000, size=t).astype(np.int32)
    anchor_pos = np.sort(rng.choice(t - 1, size=a, replace=False)).astype(np.int32)
    corpus_ids, corpus_probs, corpus_tail = _probs(rng, (t,), top_k)
    rollout_ids, rollout_probs, rollout_tail = _probs(rng, (a, k), top_k)
    rollout_tokens = rng.integers(0, 150_000, size=(a, k + 1)).astype(np.int32)
    rollout_tokens[:, 0] = input_ids[anchor_pos]
    return {
        "source_row": np.asarray(source_row, dtype=np.int64),
        "input_ids": input_ids,
        "loss_mask": np.ones(t, dtype=np.uint8),
        "features": _bf16_bits(rng, (t, sizes.feature_dim)),
        "corpus_topk_ids": corpus_ids,
        "corpus_topk_probs": corpus_probs,
        "corpus_tail": corpus_tail,
        "corpus_next_prob": rng.random(t, dtype=np.float32),
        "anchor_pos": anchor_pos,
        "rollout_tokens": rollout_tokens,
        "rollout_topk_ids": rollout_ids,
        "rollout_topk_probs": rollout_probs,
        "rollout_tail": rollout_tail,
        "rollout_features": _bf16_bits(rng, (a, k - 2, sizes.feature_dim)),
    }


def write_cache(root: Path, records: list[dict], sizes: Sizes, *, storage_format: str, checksums: bool) -> Path:
    shard = write_shard(
        root, shard_index=0, records=records, storage_format=storage_format, feature_codec="bf16",
        chunk_checksums=checksums,
    )  # fmt: skip
    settings = CacheSettings(
        target_hash="sha256:bench", layer_ids=[0], num_slots=sizes.num_slots, top_k=sizes.top_k,
        anchors_per_sequence=sizes.num_anchors, seed=0, max_length=sizes.seq_len, min_supervised_tokens=0,
        feature_codec="bf16", storage_format=storage_format, shard_size=len(records), corpus_hash="sha256:bench",
        skip_bad_rows=False,
    )  # fmt: skip
    save_manifest(root, Manifest(
        settings=settings, target_path="-", target_config={}, num_target_layers=2, hidden_size=sizes.feature_dim,
        vocab_size=150_000, stop_token_ids=[1], mask_token_id=2, corpus_path="-", corpus_stats={},
        shards=[shard], num_shards_planned=1, created_with="benchmarks/read_checksums.py",
    ))  # fmt: skip
    return root


def read_all_seconds(cache: Path) -> float:
    reader = open_cache(cache)
    start = time.perf_counter()
    for index in range(len(reader)):
        reader.read(index, decode_features=False)
    seconds = time.perf_counter() - start
    reader.close()
    return seconds


def corrupt_reads(cache: Path, storage_format: str) -> str:
    """Flip one byte of the stored rollout_topk_probs; 'refused' or 'silently different'."""
    def every_value(reader) -> np.ndarray:
        return np.concatenate([reader.read(i, decode_features=False)["rollout_topk_probs"].ravel() for i in range(len(reader))])

    reader = open_cache(cache)
    before = every_value(reader)
    reader.close()
    if storage_format == "zarr":
        path = sorted((cache / SHARD_DIR / "shard-00000.zarr" / "rollout_topk_probs").rglob("c/*/*/*"))[0]
        position = len(path.read_bytes()) // 2
    else:
        from storage.formats.wds import WdsShard

        path = cache / SHARD_DIR / "shard-00000.tar"
        shard = WdsShard(path)
        offset, size, _ = shard.samples[0][1]["rollout_topk_probs"]
        shard.close()
        position = offset + size - 5
    data = bytearray(path.read_bytes())
    data[position] ^= 0x01
    path.write_bytes(bytes(data))
    reader = open_cache(cache)
    try:
        after = every_value(reader)
    except ValueError:
        return "refused"
    return "silently different" if not np.array_equal(before, after) else "unchanged"


def records_from_command_line(doc: str) -> tuple[Sizes, list[dict[str, np.ndarray]], float]:
    """(sizes, records, their MB) for a script taking --quick and --threads (this one and
    object_store.py), the sizes printed."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Tiny sizes (a smoke run for CI).")
    parser.add_argument("--threads", type=int, default=1, help="torch threads.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else FULL
    rng = np.random.default_rng(0)
    records = [make_record(rng, sizes, source_row=i) for i in range(sizes.num_sequences)]
    raw_mb = sum(v.nbytes for r in records for v in r.values()) / 1e6
    print(f"{sizes.num_sequences} sequences, T={sizes.seq_len}, F={sizes.feature_dim}, A={sizes.num_anchors}, "
          f"K={sizes.num_slots}, top-k {sizes.top_k}: {raw_mb:.1f} MB of records; median of {sizes.repeats}")  # fmt: skip
    return sizes, records, raw_mb


def main() -> None:
    sizes, records, raw_mb = records_from_command_line(__doc__)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for storage_format in ("zarr", "wds"):
            caches = {
                checks: write_cache(Path(tmp) / f"{storage_format}-{checks}", records, sizes, storage_format=storage_format, checksums=checks)
                for checks in (False, True)
            }  # fmt: skip
            times = {False: [], True: []}
            read_all_seconds(caches[False]), read_all_seconds(caches[True])  # warm the page cache
            for _ in range(sizes.repeats):
                for checks in (False, True):
                    times[checks].append(read_all_seconds(caches[checks]))
            plain, checked = statistics.median(times[False]), statistics.median(times[True])
            rows.append([
                storage_format, f"{raw_mb / plain:.0f}", f"{raw_mb / checked:.0f}", f"{checked / plain:.2f}x",
                corrupt_reads(caches[False], storage_format), corrupt_reads(caches[True], storage_format),
            ])  # fmt: skip
    print_table(
        "reading every record (decode_features=False, one process)",
        ["format", "MB/s unchecked", "MB/s checked", "time ratio", "flipped byte, unchecked", "flipped byte, checked"],
        rows,
    )


if __name__ == "__main__":
    main()
