"""`alrira-cache build ... --estimate`: the bytes a build would write, before it spends them
(docs/cache-format.md, "Size").

Tokenizes the corpus and sizes every sequence's anchor pool exactly as the build does (no target
forward, nothing written), so tokens, anchors and IRA parents are the build's own; the raw bytes
of every array group follow from them and the settings. What compression will make of them is
not known before the target runs: each group's raw bytes are divided by the ratio measured for
it (benchmarks/speed/cache_settings.py at Qwen3-4B shapes, and the toy target's caches in
tests/test_cache_compact.py): bf16 features compress 1.27-1.41x (toy target, random and
SmolLM2-135M activations), fp8 features 1.0-1.2x. The projection is within 10% of what the toy
build writes (tested); a real target's activations may compress differently, which is the
estimate's one unknown: `alrira-cache info` prints the measured bytes by group once shards exist.
So `--estimate` states its band: the projection, and as the upper bound the exact uncompressed
bytes of every array plus the index (what a build writes when nothing compresses; tested against
the arrays a build writes).
"""

from __future__ import annotations

import numpy as np

from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.corpus import corpus_vision_inputs, ingest_corpus
from pipeline.cache_build.rollouts import anchor_pool_size
from storage.eval_split import split_file_bytes
from storage.format import FEATURE_DTYPES, num_parents, record_array_names
from storage.reader import BYTE_GROUPS

# Assumed compressed / raw ratio divisors per encoded kind (docs/benchmarks.md, "Cache settings";
# the e8m codecs: "Feature codecs", the lowest of SmolLM2-135M's and the toy target's activations).
COMPRESSION = {"bf16": 1.33, "fp8": 1.1, "labels": 1.2, "tokens": 1.0,
               "e8m2": 2.3, "e8m3": 2.0, "e8m4": 1.8, "e8m5": 1.6, "e8m6": 1.45}  # fmt: skip
# Zarr metadata and offsets per shard (measured: ~3 KiB a toy shard); a tar's end blocks.
INDEX_BYTES_PER_SHARD = {"zarr": 3 << 10, "wds": 1 << 10}
EVAL_SPLIT_RECORD_BYTES = 2 << 10  # eval_split.json: its key, sha256 and counts
# A tar member's header and padding (storage/formats/wds.py: one member per array per sequence).
TAR_MEMBER_BYTES = 512 + 256


def raw_group_bytes(
    *, lengths: np.ndarray, pools: np.ndarray, parents: np.ndarray, feature_dim: int, top_k: int, num_slots: int,
    contents, codecs: dict[str, str],
) -> dict[str, int]:  # fmt: skip
    """Uncompressed bytes by BYTE_GROUPS group of sequences with these token, pool and parent counts."""
    T, A, P = int(lengths.sum()), int(pools.sum()), int(parents.sum())
    F, k, K = feature_dim, top_k, num_slots
    width = {codec: np.dtype(dtype).itemsize for codec, dtype in FEATURE_DTYPES.items()}  # bytes a stored value
    scale = {codec: 4 if codec == "fp8" else 0 for codec in FEATURE_DTYPES}  # a float32 scale per row
    out = dict.fromkeys([*BYTE_GROUPS, "index"], 0)
    out["corpus_features"] = T * (F * width[codecs["features"]] + scale[codecs["features"]])
    out["corpus_tokens"] = T * (4 + 1) + A * 4 + len(lengths) * 8
    if "corpus_topk" in contents:
        out["corpus_topk"] = T * (8 * k + 8)
    if "rollouts" in contents:
        out["rollouts"] = A * (4 * (K + 1) + 8 * K * k + 4 * K)
    if "rollout_features" in contents:
        codec = codecs["rollout_features"]
        out["rollout_features"] = P * (K - 2) * (F * width[codec] + scale[codec])
    return out


# What a format adds at most beyond the arrays' raw bytes, for the upper bound (when nothing
# compresses, Blosc stores a chunk as is behind its 16-byte header): a Zarr array's metadata
# document and its shard index per shard file, and per chunk (>= ~4 KiB, storage/formats/zarr/write.py) the
# Blosc header, its CRC32C and its index entry; a tar member's header, npy header, Blosc header and
# CRC, and padding to 512 bytes; the tar's end blocks, padded to tarfile's 10 KiB record.
ZARR_ARRAY_BOUND, ZARR_CHUNK_OVERHEAD, ZARR_MIN_CHUNK = 4 << 10, 16 + 4 + 16, 4 << 10
TAR_MEMBER_BOUND, TAR_END_BOUND = 512 + 256 + 32 + 511, 10 << 10


def format_overhead_bound(raw: dict[str, int], *, storage_format: str, num_shards: int, num_sequences: int,
                          num_arrays: int) -> int:  # fmt: skip
    """The most bytes `storage_format` adds to `raw` (nothing compressed): with the raw bytes, the
    band's upper bound. `num_arrays`: arrays per record (storage.format.record_array_names)."""
    if storage_format == "wds":
        return num_sequences * num_arrays * TAR_MEMBER_BOUND + num_shards * TAR_END_BOUND
    index_arrays = 4  # seq/anchor/parent offsets, source_rows
    per_shard = (num_arrays + index_arrays) * ZARR_ARRAY_BOUND
    return num_shards * per_shard + -(-sum(raw.values()) // ZARR_MIN_CHUNK) * ZARR_CHUNK_OVERHEAD


def projected_bytes(raw: dict[str, int], *, codecs: dict[str, str], storage_format: str, num_shards: int,
                    num_sequences: int) -> dict[str, int]:  # fmt: skip
    """`raw` divided by each group's expected compression, plus the per-shard index bytes."""
    ratio = {
        "corpus_features": COMPRESSION[codecs["features"]],
        "rollout_features": COMPRESSION[codecs["rollout_features"]],
        "corpus_topk": COMPRESSION["labels"],
        "rollouts": COMPRESSION["labels"],
        "corpus_tokens": COMPRESSION["tokens"],
        "index": 1.0,
    }
    out = {group: int(size / ratio[group]) for group, size in raw.items()}
    out["index"] = num_shards * INDEX_BYTES_PER_SHARD[storage_format]
    if storage_format == "wds":
        members = sum(1 for group in raw if raw[group]) + 2  # roughly: one member per array, scales and source_row
        out["index"] += num_sequences * members * TAR_MEMBER_BYTES
    return out


def eval_split_estimate(config: CacheBuildConfig, *, tokenizer, feature_dim: int, log=print) -> dict | None:
    """The evaluation split's prompts, most tokens and exact most bytes (None without --eval-prompts);
    its prompts are read and checked as the build reads them (pipeline/eval/split.py)."""
    split = config.eval_split
    if split.eval_prompts is None:
        return None
    from pipeline.corpus_source import local_corpus
    from pipeline.eval.split import plan_eval_split

    plan = plan_eval_split(
        split.eval_prompts, target=config.target, tokenizer=tokenizer, max_new_tokens=split.eval_max_new_tokens,
        max_prompts=split.eval_max_prompts, corpus=local_corpus(config.corpus.path), log=log,
    )  # fmt: skip
    num_tokens = plan.max_tokens
    return {
        "prompts": len(plan.prompts), "max_tokens": num_tokens,
        "bytes": split_file_bytes(num_tokens=num_tokens, num_prompts=len(plan.prompts), feature_width=feature_dim),
    }  # fmt: skip


def estimate_cache(config: CacheBuildConfig, *, feature_dim: int, progress: bool = False, log=print) -> dict:
    """Tokens, anchors, parents and projected bytes (total and by group) of the build `config`
    describes (taps resolved: `feature_dim` = taps x hidden size); nothing is written."""
    from pipeline.target import load_tokenizer

    tokenizer = load_tokenizer(config.target)
    vision = corpus_vision_inputs(config.target, config.corpus)
    corpus = ingest_corpus(config.corpus, tokenizer, progress=progress, vision=vision)
    if len(corpus) == 0:
        raise ValueError(f"{config.corpus.path}: no sequences left after filtering ({corpus.stats['dropped']})")
    lengths = np.diff(corpus.offsets)
    pools = np.array([
        anchor_pool_size(corpus.loss_mask[corpus.offsets[i] : corpus.offsets[i + 1]], num_anchors=config.run.anchors_per_sequence)
        for i in range(len(corpus))
    ])  # fmt: skip
    layout = config.layout
    # Rows of rollout features: none without them (--no-rollout-features, --no-rollouts).
    parents = np.array([num_parents(a, layout["ira_parents"]) for a in pools]) if "rollout_features" in config.contents else np.zeros_like(pools)
    codecs = {"features": layout["feature_codec"], "rollout_features": layout["rollout_feature_codec"] or layout["feature_codec"]}
    raw = raw_group_bytes(
        lengths=lengths, pools=pools, parents=parents, feature_dim=feature_dim, top_k=config.run.top_k,
        num_slots=config.run.num_slots, contents=config.contents, codecs=codecs,
    )  # fmt: skip
    num_shards = -(-len(corpus) // config.storage.shard_size)
    projected = projected_bytes(
        raw, codecs=codecs, storage_format=config.storage.storage_format, num_shards=num_shards, num_sequences=len(corpus)
    )  # fmt: skip
    num_arrays = len(record_array_names(layout["feature_codec"], config.contents, layout["rollout_feature_codec"]))
    overhead = format_overhead_bound(
        raw, storage_format=config.storage.storage_format, num_shards=num_shards, num_sequences=len(corpus), num_arrays=num_arrays
    )  # fmt: skip
    # The evaluation split (--eval-prompts) is written as it is (float32 features, no compression):
    # its bound is every prompt with its whole budget, its projection the same (a response stops
    # early only where the target emits a stop token, which is not known before it runs).
    split = eval_split_estimate(config, tokenizer=tokenizer, feature_dim=feature_dim, log=log)
    if split is not None:
        raw["eval_split"] = projected["eval_split"] = split["bytes"]
        overhead += EVAL_SPLIT_RECORD_BYTES
    total, tokens = sum(projected.values()), int(lengths.sum())
    return {
        "eval_split": split,
        "sequences": len(corpus), "tokens": tokens, "anchors": int(pools.sum()), "ira_parents": int(parents.sum()),
        "shards": num_shards, "feature_dim": feature_dim, "codecs": codecs, "profile": layout["profile"],
        "contents": list(config.contents),
        # The band: every array's exact uncompressed bytes plus the most the format adds is what a
        # build writes at most (Blosc stores a chunk it cannot shrink as is); `bytes` assumes COMPRESSION's ratios.
        "raw_bytes": sum(raw.values()), "raw_bytes_by_group": raw, "upper_bytes": sum(raw.values()) + overhead,
        "bytes": total, "bytes_per_token": total / tokens,
        "bytes_per_sequence": total / len(corpus), "bytes_by_group": projected,
        "bytes_per_token_by_group": {g: b / tokens for g, b in projected.items()},
    }  # fmt: skip


def estimate_build(config: CacheBuildConfig, *, progress: bool = False, log=print) -> dict:
    """estimate_cache with the taps resolved as the build resolves them."""
    from pipeline.cache_build.plan import resolve_layer_ids
    from pipeline.target import read_target_config

    target_config = read_target_config(config.target)
    layer_ids = resolve_layer_ids(config, num_target_layers=int(target_config["num_hidden_layers"]))
    return estimate_cache(config, feature_dim=len(layer_ids) * int(target_config["hidden_size"]), progress=progress, log=log)


def estimate_lines(estimate: dict) -> list[str]:
    """What `--estimate` prints: the totals, then one line per array group."""
    e, mib = estimate, 1 << 20
    if "rollout_features" in e["contents"]:
        rollout = f"{e['ira_parents']:,} with rollout features; features {e['codecs']['features']}, rollout features {e['codecs']['rollout_features']}"
    else:
        without = "no rollouts" if "rollouts" not in e["contents"] else "no rollout features"
        rollout = f"{without}; features {e['codecs']['features']}"
    lines = [
        f"estimate: {e['sequences']:,} sequences, {e['tokens']:,} tokens, {e['anchors']:,} pool anchors, "
        f"{rollout}{', --profile ' + e['profile'] if e['profile'] else ''}",
        f"projected: {e['bytes'] / mib:,.1f} MiB in {e['shards']} shard(s), at most {e['upper_bytes'] / mib:,.1f} MiB "
        f"({e['raw_bytes']:,} bytes of arrays uncompressed, exact, plus the format's most); {e['bytes_per_token'] / 1024:,.2f} KiB "
        f"per corpus token, {e['bytes_per_sequence'] / mib:,.2f} MiB per sequence (no target forward: the projection "
        "assumes each group's compression, docs/cache-format.md 'Size'; the bound assumes none)",
    ]
    if e["eval_split"] is not None:
        split = e["eval_split"]
        lines.append(
            f"eval split: {split['prompts']:,} prompts, at most {split['max_tokens']:,} tokens (prompt + --eval-max-new-tokens each), "
            f"{split['bytes'] / mib:,.2f} MiB at most (float32 features: {e['feature_dim'] * 4:,} bytes per token, uncompressed)"
        )
    for group, size in e["bytes_by_group"].items():
        lines.append(f"  {group:<17} {e['bytes_per_token_by_group'][group] / 1024:>10,.2f} KiB/token  {size / mib:>12,.2f} MiB")
    return lines
