"""Feature codecs on real activations (docs/benchmarks.md, "Feature codecs on real activations").

    .venv/bin/python benchmarks/speed/feature_codecs.py --cache /tmp/real-codec/caches/full --out /tmp/feature-codecs

--cache is a lossless (bf16) cache of a real target (benchmarks/speed/real_cache.py builds one of
SmolLM2-135M-Instruct with five taps). Three parts, in one run:

(a) every candidate codec on that cache's corpus features (and rollout features): stored bytes per
    element through the writer's compressor (Blosc zstd 1, byte shuffle, one block per 256 KiB chunk,
    scales and side arrays included), relative reconstruction error per tapped layer (L2 over the
    layer's values, and channel-normalized: each channel's error over its own norm, averaged, which
    a massive channel cannot hide), and one-thread MB/s (of the bf16 bits) of encode, compress,
    decompress and decode;
(b) those bytes projected to Qwen3-4B shapes (F = 5 x 2560, ~700 tokens and 128 anchors a sequence,
    K = 15, top-k 8) for cache settings: per corpus token, by array group, labels as the real cache
    stores them;
(c) the same settings written for real at those shapes (storage's Zarr writer, one shard of
    sequences whose features are the real cache's, each tap's 2560 channels the 576 of five of its
    tokens), the bytes measured beside `--estimate`'s projection and upper bound for the same counts.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from numcodecs import Blosc

from pipeline.cache_build.estimate import format_overhead_bound, projected_bytes, raw_group_bytes
from storage.codecs import decode_features, encode_features
from storage.format import ALL_GROUPS, FEATURE_DTYPES, ira_parent_rows, record_array_names
from storage.manifest import CacheSettings, Manifest, save_manifest
from storage.reader import cache_group_bytes, open_cache
from storage.shards import write_shard

KIB = 1024
CHUNK_BYTES = 256 << 10  # the writer's feature chunks and Blosc blocks (storage/formats/zarr/write.py)
# Qwen3-4B shapes (docs/benchmarks.md, "Real shapes"): 5 taps of 2560, T uniform in [650, 750), A = 128.
QWEN = {"taps": 5, "hidden": 2560, "tokens": (650, 750), "anchors": 128, "slots": 15, "top_k": 8, "vocab": 151936}


def blosc_bytes(array: np.ndarray) -> tuple[int, float, float]:
    """(stored bytes, compress s, decompress s) of `array` in 256 KiB chunks, the writer's Blosc settings, one thread."""
    codec = Blosc(cname="zstd", clevel=1, shuffle=Blosc.SHUFFLE, blocksize=CHUNK_BYTES, typesize=array.itemsize)
    flat = np.ascontiguousarray(array).reshape(-1)
    step = CHUNK_BYTES // array.itemsize
    pieces = [flat[i : i + step] for i in range(0, flat.size, step)]
    start = time.process_time()
    frames = [codec.encode(p) for p in pieces]
    compress = time.process_time() - start
    start = time.process_time()
    for frame in frames:
        codec.decode(frame)
    return sum(len(f) for f in frames), compress, time.process_time() - start


# ----------------------------------------------------------------------------------------------
# Candidate codecs: encode(x [N, F] float32, context) -> stored arrays; decode(arrays, context) -> [N, F]


@dataclass(frozen=True)
class Context:
    """What a codec may fit on: the cache's own statistics and the tap layout."""

    num_taps: int
    channel_amax: torch.Tensor  # [F] max |x| of each channel over the whole cache
    outlier_order: torch.Tensor  # [F] channels by channel_amax, largest first (massive activations lead)


def _fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def _unfp8(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float8_e4m3fn).float() * scale


def _safe(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def fp8_groups(group: int | str):
    """fp8 e4m3 with a float32 scale per token and group of channels ("tap": one per tapped layer)."""

    def split(x, ctx):
        size = x.shape[1] // ctx.num_taps if group == "tap" else group
        return x.reshape(x.shape[0], -1, size)

    def encode(x, ctx):
        g = split(x, ctx)
        scale = _safe(g.abs().amax(-1, keepdim=True) / 448.0)  # [N, groups, 1]
        return {"bits": _fp8(g, scale).reshape(x.shape), "scales": scale.squeeze(-1)}

    def decode(s, ctx):
        g = split(s["bits"], ctx)
        return _unfp8(g, s["scales"][..., None]).reshape(s["bits"].shape)

    return encode, decode


def fp8_channel(x_unused=None):
    """fp8 e4m3 with one float32 scale per channel, fitted on the cache (its max |x| / 448)."""

    def encode(x, ctx):
        return {"bits": _fp8(x, _safe(ctx.channel_amax / 448.0))}

    def decode(s, ctx):
        return _unfp8(s["bits"], _safe(ctx.channel_amax / 448.0))

    return encode, decode


def fp8_outliers(count: int):
    """The cache's `count` most massive channels (by max |x| over the cache) kept in bf16, every
    other value fp8 with a per-token scale over them."""

    def encode(x, ctx):
        channels, rest = ctx.outlier_order[:count], x.clone()
        rest[:, channels] = 0
        scale = _safe(rest.abs().amax(-1, keepdim=True) / 448.0)
        outliers = x[:, channels].to(torch.bfloat16).view(torch.uint16)
        return {"bits": _fp8(rest, scale), "scales": scale.squeeze(-1), "outliers": outliers}

    def decode(s, ctx):
        x = _unfp8(s["bits"], s["scales"][:, None])
        x[:, ctx.outlier_order[:count]] = (s["outliers"].to(torch.int32) << 16).view(torch.float32)
        return x

    return encode, decode


def int8_groups(group: int):
    """int8 with a float32 scale per token and `group` channels (max |x| / 127)."""

    def encode(x, ctx):
        g = x.reshape(x.shape[0], -1, group)
        scale = _safe(g.abs().amax(-1, keepdim=True) / 127.0)
        return {"bits": torch.round(g / scale).clamp(-127, 127).to(torch.int8).reshape(x.shape), "scales": scale.squeeze(-1)}

    def decode(s, ctx):
        g = s["bits"].reshape(s["bits"].shape[0], -1, group).float()
        return (g * s["scales"][..., None]).reshape(s["bits"].shape)

    return encode, decode


def storage_codec(name: str):
    """A codec of storage/codecs.py, as the cache build stores it."""

    def encode(x, ctx):
        bits, scales = encode_features(x, codec=name)
        return {"bits": torch.from_numpy(bits)} | ({} if scales is None else {"scales": torch.from_numpy(scales)})

    def decode(s, ctx):
        scales = s.get("scales")
        return torch.from_numpy(decode_features(s["bits"].numpy(), None if scales is None else scales.numpy(), codec=name))

    return encode, decode


def exponent_planes():
    """Lossless: bf16 split into an exponent byte plane (stored channel-major, so each channel's
    exponents sit together) and a sign + mantissa byte plane, each compressed alone."""

    def encode(x, ctx):
        bits = x.to(torch.bfloat16).view(torch.uint16).to(torch.int32)
        exponent = ((bits >> 7) & 0xFF).to(torch.uint8)
        rest = (((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8)
        return {"exponent": exponent.T.contiguous(), "sign_mantissa": rest}

    def decode(s, ctx):
        exponent, rest = s["exponent"].T.to(torch.int32), s["sign_mantissa"].to(torch.int32)
        bits = ((rest & 0x80) << 8) | (exponent << 7) | (rest & 0x7F)
        return (bits << 16).view(torch.float32)

    return encode, decode


CODECS = {
    "bf16 (lossless, today)": storage_codec("bf16"),
    "bf16 exponent planes (lossless)": exponent_planes(),
    "fp8, per-token scale (today's fp8)": storage_codec("fp8"),
    "fp8, per-token-and-tap scale": fp8_groups("tap"),
    "fp8, per-channel scale (cache stats)": fp8_channel(),
    "fp8, 16 outlier channels bf16": fp8_outliers(16),
    "fp8, 64 outlier channels bf16": fp8_outliers(64),
    "fp8, scale per 32 channels": fp8_groups(32),
    "int8, scale per 32 channels": int8_groups(32),
    **{f"{name} (bf16 bits, {name[-1]} mantissa bits)": storage_codec(name) for name in ("e8m2", "e8m3", "e8m4", "e8m5")},
}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# (a) the codec table


def real_features(cache: Path, *, max_tokens: int) -> dict:
    """The cache's corpus features [N, F] and rollout feature rows [M, F] (float32, decoded bf16),
    its taps, and its label bytes (per token and per anchor, for the projection)."""
    reader = open_cache(cache)
    if reader.manifest.settings.feature_codec != "bf16" or reader.rollout_feature_codec != "bf16":
        raise ValueError(f"--cache {cache}: needs a lossless (bf16) cache, got {reader.manifest.settings.codecs}")
    corpus, rollout, lengths = [], [], []
    for index in range(len(reader)):
        record = reader.read(index, arrays={"features", "rollout_features"})
        corpus.append(record["features"])
        rollout.append(record["rollout_features"].reshape(-1, record["features"].shape[1]))
        lengths.append(len(record["features"]))
        if sum(lengths) >= max_tokens:
            break
    groups = cache_group_bytes(reader)
    m = reader.manifest
    out = {
        "corpus": torch.from_numpy(np.concatenate(corpus)), "rollout": torch.from_numpy(np.concatenate(rollout)),
        "lengths": lengths, "layer_ids": m.settings.layer_ids, "hidden": m.hidden_size,
        "corpus_topk_per_token": groups["corpus_topk"] / m.num_tokens, "rollouts_per_anchor": groups["rollouts"] / m.num_anchors,
        "tokens_per_token": groups["corpus_tokens"] / m.num_tokens,
    }  # fmt: skip
    reader.close()
    return out


def layer_errors(x: torch.Tensor, xhat: torch.Tensor, *, num_taps: int) -> list[dict]:
    """Per tapped layer: L2 relative error, and the channel-normalized one (sqrt of the mean over
    channels of |error_c|^2 / |x_c|^2)."""
    out = []
    for x_l, e_l in zip(x.chunk(num_taps, dim=1), (xhat - x).chunk(num_taps, dim=1), strict=True):
        x_l, e_l = x_l.double(), e_l.double()
        per_channel = e_l.pow(2).sum(0) / x_l.pow(2).sum(0).clamp_min(1e-300)
        out.append({"l2": float(e_l.norm() / x_l.norm()), "channel": float(per_channel.mean().sqrt())})
    return out


def measure_codec(name: str, x: torch.Tensor, ctx: Context, *, timing_rows: int) -> dict:
    encode, decode = CODECS[name]
    stored = encode(x, ctx)
    nbytes = compress_s = decompress_s = 0.0
    for array in stored.values():
        size, c, d = blosc_bytes(array.numpy())
        nbytes, compress_s, decompress_s = nbytes + size, compress_s + c, decompress_s + d
    xhat = decode(stored, ctx)
    sample = x[:timing_rows]  # encode and decode timed on one thread over the first rows
    start = time.process_time()
    small = encode(sample, ctx)
    encode_s = time.process_time() - start
    start = time.process_time()
    decode(small, ctx)
    decode_s = time.process_time() - start
    mb_all, mb_sample = x.numel() * 2 / 1e6, sample.numel() * 2 / 1e6  # MB of the bf16 bits
    return {
        "codec": name, "bytes_per_element": nbytes / x.numel(), "errors": layer_errors(x, xhat, num_taps=ctx.num_taps),
        "encode_mb_s": mb_sample / encode_s, "decode_mb_s": mb_sample / decode_s,
        "compress_mb_s": mb_all / compress_s, "decompress_mb_s": mb_all / decompress_s,
    }  # fmt: skip


def context_of(x: torch.Tensor, *, num_taps: int) -> Context:
    amax = x.abs().amax(0)
    return Context(num_taps=num_taps, channel_amax=amax, outlier_order=amax.argsort(descending=True))


def codec_table(data: dict, *, timing_rows: int) -> list[dict]:
    num_taps = len(data["layer_ids"])
    ctx = context_of(data["corpus"], num_taps=num_taps)
    rows = []
    for name in CODECS:
        row = measure_codec(name, data["corpus"], ctx, timing_rows=timing_rows)
        row["rollout_bytes_per_element"] = measure_codec(name, data["rollout"], ctx, timing_rows=1)["bytes_per_element"]
        rows.append(row)
        errors = " | ".join(f"{e['l2']:.4f} / {e['channel']:.4f}" for e in row["errors"])
        print(f"{name:40s} {row['bytes_per_element']:.3f} B/elem (rollout {row['rollout_bytes_per_element']:.3f}) "
              f"enc {row['encode_mb_s']:.0f} comp {row['compress_mb_s']:.0f} decomp {row['decompress_mb_s']:.0f} "
              f"dec {row['decode_mb_s']:.0f} MB/s | {errors}", flush=True)  # fmt: skip
    return rows


def activation_stats(x: torch.Tensor, *, num_taps: int) -> list[dict]:
    """Per tapped layer: the largest |x|, its channel, the median |x| and the share of rows whose
    largest value is over 100x their median (massive activations)."""
    out = []
    for x_l in x.abs().chunk(num_taps, dim=1):
        row_max, row_median = x_l.amax(1), x_l.median(1).values
        out.append({"max": float(x_l.max()), "channel": int(x_l.amax(0).argmax()), "median": float(x_l.median()),
                    "rows_over_100x": float((row_max > 100 * row_median).float().mean())})  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------
# (b) projection and (c) real-shape shards of cache settings


@dataclass(frozen=True)
class Setting:
    name: str
    corpus: str  # storage codec of the corpus features
    rollout: str | None  # of the rollout features (None: no rollout features)
    parents: int  # IRA parents per sequence at A = 128
    profile: str | None = None


SETTINGS = (
    Setting("full, bf16 (default)", "bf16", "bf16", 128),
    Setting("--compact (rollout fp8, 64 parents)", "bf16", "fp8", 64, "compact"),
    Setting("--compact --ira-parents 16 equivalent (bf16, rollout fp8, 16 parents)", "bf16", "fp8", 16),
    Setting("--feature-codec fp8 --ira-parents 16", "fp8", "fp8", 16),
    Setting("--profile small (e8m3, 16 parents)", "e8m3", "e8m3", 16, "small"),
    Setting("e8m3, 32 parents", "e8m3", "e8m3", 32),
    Setting("e8m4, 16 parents", "e8m4", "e8m4", 16),
    Setting("e8m4 corpus, e8m3 rollouts, 16 parents", "e8m4", "e8m3", 16),
    Setting("e8m2, 16 parents", "e8m2", "e8m2", 16),
    Setting("e8m5, 16 parents", "e8m5", "e8m5", 16),
    Setting("bf16, --no-rollout-features", "bf16", None, 0),
    Setting("e8m3, --no-rollout-features", "e8m3", None, 0),
)  # fmt: skip
STORAGE_ROWS = {"bf16": "bf16 (lossless, today)", "fp8": "fp8, per-token scale (today's fp8)"} | {
    c: f"{c} (bf16 bits, {c[-1]} mantissa bits)" for c in ("e8m2", "e8m3", "e8m4", "e8m5")
}


def project(rows: list[dict], data: dict) -> list[dict]:
    """(b) KiB per corpus token at Qwen3-4B shapes: each group's bytes per element (or per token and
    anchor, labels) as measured on the real cache, times Qwen3-4B's counts."""
    by_codec = {r["codec"]: r for r in rows}
    F, T = QWEN["taps"] * QWEN["hidden"], sum(QWEN["tokens"]) / 2
    per_parent = (QWEN["slots"] - 2) * F / T  # rollout-feature elements per corpus token per parent
    out = []
    for s in SETTINGS:
        groups = {
            "corpus_features": F * by_codec[STORAGE_ROWS[s.corpus]]["bytes_per_element"],
            "rollout_features": 0.0 if s.rollout is None else s.parents * per_parent * by_codec[STORAGE_ROWS[s.rollout]]["rollout_bytes_per_element"],
            "labels": data["corpus_topk_per_token"] + data["rollouts_per_anchor"] * QWEN["anchors"] / T,
            "tokens": data["tokens_per_token"],
        }  # fmt: skip
        out.append({"setting": s.name, "kib_per_token": {g: b / KIB for g, b in groups.items()}, "total_kib": sum(groups.values()) / KIB})
    return out


def widen(x: torch.Tensor, rows: torch.Tensor, *, num_taps: int) -> torch.Tensor:
    """Qwen3-4B-wide rows [len(rows), 5 * 2560] of the real features x [N, num_taps * h]: Qwen tap t
    is real tap t mod num_taps, its 2560 channels the h channels at `rows`, then at rows further on,
    and so on (real values of distinct tokens side by side: no value repeats within a row, which a
    compressor would find, and every channel keeps its statistics)."""
    small = x.shape[1] // num_taps
    copies = -(-QWEN["hidden"] // small)
    rounds = -(-QWEN["taps"] // num_taps)  # a target with fewer taps lends each one several times
    stride = len(x) // (copies * rounds)
    taps = []
    for tap in range(QWEN["taps"]):
        source, first = tap % num_taps, (tap // num_taps) * copies
        pieces = [x[(rows + (first + c) * stride) % len(x), source * small : (source + 1) * small] for c in range(copies)]
        taps.append(torch.cat(pieces, dim=1)[:, : QWEN["hidden"]])
    return torch.cat(taps, dim=1)


def labels(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-k ids, probabilities sorted descending and the tail of distributions `shape`."""
    dist = rng.dirichlet(np.ones(QWEN["top_k"] + 4) * 0.3, size=shape)
    probs = -np.sort(-dist[..., : QWEN["top_k"]], axis=-1).astype(np.float32)
    tail = np.maximum(0.0, 1.0 - probs.sum(-1, dtype=np.float64)).astype(np.float32)
    return rng.integers(0, QWEN["vocab"], size=(*shape, QWEN["top_k"])).astype(np.int32), probs, tail


def shaped_sequence(rng: np.random.Generator, data: dict, *, source_row: int, start: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(the record's other arrays, corpus features [T, F], rollout features [A, K-2, F]) of one
    Qwen3-4B-shaped sequence: T consecutive tokens of the real corpus features from `start` and
    128 x 13 real rollout rows, widened (`widen`); ids and labels random."""
    T, A, K = int(rng.integers(*QWEN["tokens"])), QWEN["anchors"], QWEN["slots"]
    num_taps = len(data["layer_ids"])
    corpus = widen(data["corpus"], torch.arange(start, start + T), num_taps=num_taps)
    rows = torch.from_numpy(rng.integers(0, len(data["rollout"]) // (K - 2), size=A)) * (K - 2)
    rollout = widen(data["rollout"], (rows[:, None] + torch.arange(K - 2)).reshape(-1), num_taps=num_taps).reshape(A, K - 2, -1)
    input_ids = rng.integers(0, QWEN["vocab"], size=T).astype(np.int32)
    anchor_pos = np.sort(rng.choice(np.arange(T // 8, T - K - 1), size=A, replace=False)).astype(np.int32)
    corpus_ids, corpus_probs, corpus_tail = labels(rng, (T,))
    rollout_ids, rollout_probs, rollout_tail = labels(rng, (A, K))
    rollout_tokens = rng.integers(0, QWEN["vocab"], size=(A, K + 1)).astype(np.int32)
    rollout_tokens[:, 0] = input_ids[anchor_pos]
    loss_mask = np.zeros(T, dtype=np.uint8)
    loss_mask[T // 8 :] = 1
    next_prob = rng.random(T, dtype=np.float32)
    next_prob[-1] = 0
    record = {
        "source_row": np.asarray(source_row, dtype=np.int64), "input_ids": input_ids, "loss_mask": loss_mask,
        "corpus_topk_ids": corpus_ids, "corpus_topk_probs": corpus_probs, "corpus_tail": corpus_tail,
        "corpus_next_prob": next_prob, "anchor_pos": anchor_pos, "rollout_tokens": rollout_tokens,
        "rollout_topk_ids": rollout_ids, "rollout_topk_probs": rollout_probs, "rollout_tail": rollout_tail,
    }  # fmt: skip
    return record, corpus, rollout


def encode_setting(record: dict, corpus: torch.Tensor, rollout: torch.Tensor, setting: Setting) -> dict:
    out = dict(record)
    out["features"], scales = encode_features(corpus, codec=setting.corpus)
    if scales is not None:
        out["feature_scales"] = scales
    if setting.rollout is not None:
        parents = ira_parent_rows(QWEN["anchors"], setting.parents)
        out["rollout_features"], scales = encode_features(rollout[torch.from_numpy(parents)], codec=setting.rollout)
        if scales is not None:
            out["rollout_feature_scales"] = scales
    return out


def write_setting(root: Path, records: list[dict], setting: Setting) -> Path:
    """One-shard Zarr cache of `records` under `setting`, with its manifest."""
    contents = list(ALL_GROUPS) if setting.rollout else [g for g in ALL_GROUPS if g != "rollout_features"]
    rollout_codec = setting.rollout if setting.rollout not in (None, setting.corpus) else None
    ira_parents = setting.parents if setting.rollout and setting.parents < QWEN["anchors"] else None
    shard = write_shard(root, shard_index=0, records=records, storage_format="zarr", feature_codec=setting.corpus,
                        contents=contents, rollout_feature_codec=rollout_codec, ira_parents=ira_parents)  # fmt: skip
    settings = CacheSettings(
        target_hash="sha256:qwen3-4b-shapes", layer_ids=list(range(1, 1 + QWEN["taps"])), num_slots=QWEN["slots"],
        top_k=QWEN["top_k"], anchors_per_sequence=QWEN["anchors"], seed=0, max_length=QWEN["tokens"][1],
        min_supervised_tokens=0, feature_codec=setting.corpus, storage_format="zarr", shard_size=len(records),
        corpus_hash="sha256:qwen3-4b-shapes", skip_bad_rows=False, contents=contents, rollout_feature_codec=rollout_codec,
        ira_parents=ira_parents, profile=setting.profile,
    )  # fmt: skip
    save_manifest(root, Manifest(
        settings=settings, target_path="-", target_config={}, num_target_layers=36, hidden_size=QWEN["hidden"],
        vocab_size=QWEN["vocab"], stop_token_ids=[0], mask_token_id=1, corpus_path="-", corpus_stats={}, shards=[shard],
        num_shards_planned=1, created_with="benchmarks/speed/feature_codecs.py",
    ))  # fmt: skip
    return root


def estimate_of(records: list[dict], setting: Setting) -> dict:
    """What `--estimate` projects (and bounds) for these sequences' counts under `setting`."""
    contents = list(ALL_GROUPS) if setting.rollout else [g for g in ALL_GROUPS if g != "rollout_features"]
    codecs = {"features": setting.corpus, "rollout_features": setting.rollout or setting.corpus}
    lengths = np.array([len(r["input_ids"]) for r in records])
    pools = np.array([len(r["anchor_pos"]) for r in records])
    parents = np.minimum(pools, setting.parents) if setting.rollout else np.zeros_like(pools)
    raw = raw_group_bytes(lengths=lengths, pools=pools, parents=parents, feature_dim=QWEN["taps"] * QWEN["hidden"],
                          top_k=QWEN["top_k"], num_slots=QWEN["slots"], contents=contents, codecs=codecs)  # fmt: skip
    projected = projected_bytes(raw, codecs=codecs, storage_format="zarr", num_shards=1, num_sequences=len(records))
    rollout_codec = setting.rollout if setting.rollout not in (None, setting.corpus) else None
    num_arrays = len(record_array_names(setting.corpus, contents, rollout_codec))
    upper = sum(raw.values()) + format_overhead_bound(raw, storage_format="zarr", num_shards=1, num_sequences=len(records), num_arrays=num_arrays)
    return {"projected": sum(projected.values()), "upper": upper, "projected_by_group": projected}


def shaped_caches(work: Path, data: dict, *, num_sequences: int) -> list[dict]:
    """(c) every setting written at Qwen3-4B shapes from real features; bytes beside the estimate's."""
    rng = np.random.default_rng(0)
    encoded = {s.name: [] for s in SETTINGS}
    start = 0
    for i in range(num_sequences):
        record, corpus, rollout = shaped_sequence(rng, data, source_row=i, start=start)
        start += len(corpus)
        for s in SETTINGS:
            encoded[s.name].append(encode_setting(record, corpus, rollout, s))
        del corpus, rollout
    rows = []
    num_tokens = sum(len(r["input_ids"]) for r in encoded[SETTINGS[0].name])
    for i, s in enumerate(SETTINGS):
        reader = open_cache(write_setting(work / f"setting-{i}", encoded[s.name], s))
        groups = cache_group_bytes(reader)
        reader.close()
        estimate = estimate_of(encoded[s.name], s)
        written = sum(groups.values())
        rows.append({"setting": s.name, "kib_per_token": written / num_tokens / KIB,
                     "by_group": {g: b / num_tokens / KIB for g, b in groups.items()},
                     "estimate_kib_per_token": estimate["projected"] / num_tokens / KIB,
                     "upper_kib_per_token": estimate["upper"] / num_tokens / KIB, "within_upper": written <= estimate["upper"]})  # fmt: skip
        encoded[s.name] = None
        r = rows[-1]
        print(f"{s.name:60s} {r['kib_per_token']:6.2f} KiB/token; estimate {r['estimate_kib_per_token']:6.2f} "
              f"({100 * (r['estimate_kib_per_token'] / r['kib_per_token'] - 1):+.1f}%), at most {r['upper_kib_per_token']:.2f}", flush=True)  # fmt: skip
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", required=True, help="A lossless (bf16) cache of a real target.")
    parser.add_argument("--out", required=True, help="Work folder (results.json; the Qwen3-4B-shaped shards).")
    parser.add_argument("--max-tokens", type=int, default=20000, help="Corpus tokens of the cache to measure.")
    parser.add_argument("--timing-rows", type=int, default=1024, help="Rows the encode and decode speeds are timed on.")
    parser.add_argument("--sequences", type=int, default=3, help="Qwen3-4B-shaped sequences written per setting (c).")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import numcodecs.blosc

    numcodecs.blosc.use_threads = False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began, load = time.perf_counter(), os.getloadavg()[0]
    data = real_features(Path(args.cache), max_tokens=args.max_tokens)
    num_taps = len(data["layer_ids"])
    print(f"{len(data['corpus'])} corpus tokens, {len(data['rollout'])} rollout rows, F = {data['corpus'].shape[1]} "
          f"({num_taps} taps {data['layer_ids']})", flush=True)  # fmt: skip
    results = {"cache": args.cache, "layer_ids": data["layer_ids"], "tokens": len(data["corpus"]),
               "activations": activation_stats(data["corpus"], num_taps=num_taps)}  # fmt: skip
    results["codecs"] = codec_table(data, timing_rows=args.timing_rows)
    results["projection"] = project(results["codecs"], data)
    for row in results["projection"]:
        print(f"{row['setting']:60s} {row['total_kib']:6.2f} KiB/token projected", flush=True)
    results["shaped"] = shaped_caches(out, data, num_sequences=args.sequences)
    results["wall_s"], results["load_average"] = time.perf_counter() - began, [load, os.getloadavg()[0]]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"wall {results['wall_s']:.0f} s, load {load:.1f} -> {os.getloadavg()[0]:.1f}; {out / 'results.json'}")


if __name__ == "__main__":
    main()
