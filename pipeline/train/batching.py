"""From cache records to drafter inputs: the dataset, the deterministic sampler, and collation.

Every random choice of a training example (anchor draw, IRA split, offsets) is made by a torch
generator seeded from (seed, epoch, sequence index), inside whichever DataLoader worker reads the
sequence. So the data of a step never depends on the number of workers, ranks or on a resume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from drafter.masks import SHARED_OWNER
from pipeline.train.labels import BlockTargets, ObjectiveConfig, build_block_targets
from storage.codecs import FP8_E4M3FN_TABLE
from storage.format import ANCHOR_ARRAYS, TOKEN_ARRAYS, ira_parent_rows

# Record arrays the label builder reads (features are handled separately, below).
_LABEL_ARRAYS = tuple(name for name in TOKEN_ARRAYS + ANCHOR_ARRAYS if name not in ("features", "rollout_features"))

# The context axis of a batch is padded to a multiple of this (flex attention's tile size): the
# compiled attention then sees a handful of shapes instead of one per batch (docs/design.md, "A
# training step"). Pad rows are invalid, so the visibility mask hides them from every query.
CONTEXT_MULTIPLE = 128


def _derived_seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def example_seed(*, seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for one (epoch, sequence) example, independent of order and sharding."""
    return _derived_seed(seed, epoch, 0, index)


@dataclass(kw_only=True)
class SequenceExample:
    """One sequence ready to collate: its context tokens and its blocks' targets."""

    index: int
    num_tokens: int
    context_features: Tensor  # [C, F] corpus features, then private (IRA) rollout features (bf16/fp8 bits or float32)
    context_positions: Tensor  # [C] long
    context_owner: Tensor  # [C] long: -1 shared corpus token, else the block index that owns it
    targets: BlockTargets
    context_feature_scales: Tensor | None = None  # [C] float32: fp8 bits' per-row scales


@dataclass(kw_only=True)
class ReadFailure:
    """A record that could not be read (a corrupt chunk, say): carried to the training process, which
    stops with this one line instead of a DataLoader worker's traceback."""

    message: str


class CacheTrainDataset(torch.utils.data.Dataset):
    """Indexed by (epoch, sequence index); builds the objective's blocks for that sequence."""

    def __init__(self, reader, *, objective: ObjectiveConfig, seed: int):
        self.reader = reader
        self.objective = objective
        self.seed = seed
        # Only what the method needs is read; an IRA secondary's parent rollout features are read
        # afterwards for the drawn parents alone (docs/design.md, "A training step").
        self.arrays = objective.cache_arrays - {"rollout_features"}
        # Features travel as their stored bits (bf16: uint16, half of float32; fp8: uint8 plus a
        # float32 scale per row) and are decoded on the training device (pipeline/train/step.py, decode_feature_bits).
        self.fp8 = reader.rollout_feature_codec == "fp8"  # the parents' rows come with scales
        self.ira_parents = reader.ira_parents  # the trainer's plan checked they serve the method (check_ira_parents_serve)

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, key: tuple[int, int]) -> SequenceExample | ReadFailure:
        epoch, index = key
        try:
            record = self.reader.read(index, decode_features=False, arrays=self.arrays)
        except ValueError as error:
            return ReadFailure(message=str(error))

        def parent_rows(parents: np.ndarray):
            bits = self.reader.read_rollout_features(index, parents, decode_features=False)
            return bits, (self.reader.read_rollout_feature_scales(index, parents) if self.fp8 else None)

        return example_from_record(
            record, epoch=epoch, index=index, objective=self.objective, seed=self.seed, parent_rollout_features=parent_rows,
            ira_parents=self.ira_parents,
        )  # fmt: skip


def _parents_like(rows: np.ndarray, scales: np.ndarray | None, *, like: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Parent rollout-feature rows in the corpus features' representation, so one context tensor
    holds both: the same codec passes; fp8 rollout rows next to bf16 corpus bits become bf16 bits
    (x * scale rounded to bf16, an error below fp8's own), next to float32 features float32."""
    if rows.dtype == like.dtype:
        return rows, scales
    if rows.dtype == np.uint8 and like.dtype == np.uint16:
        # One 256-entry table of bf16(value x scale) per row, then a byte lookup: the same bits as
        # rounding each float32 product, 3.7x faster (the alr_ira loader's part of a compact cache).
        tables = torch.from_numpy(FP8_E4M3FN_TABLE[None, :] * scales.reshape(-1, 1)).to(torch.bfloat16)
        tables = tables.view(torch.uint16).numpy()  # [rows, 256]
        out = np.empty(rows.shape, dtype=np.uint16)
        flat_rows, flat_out = rows.reshape(-1, rows.shape[-1]), out.reshape(-1, rows.shape[-1])
        for r in range(len(flat_rows)):
            np.take(tables[r], flat_rows[r], out=flat_out[r])
        return out, None
    if rows.dtype == np.uint8:
        values = np.take(FP8_E4M3FN_TABLE, rows)  # (np.take: 1.2x a fancy index here)
        values *= scales[..., None]
    else:
        values = (rows.astype(np.uint32) << 16).view(np.float32)
    if like.dtype == np.float32:
        return values, None
    if like.dtype == np.uint16:
        return torch.from_numpy(values).to(torch.bfloat16).view(torch.uint16).numpy(), None
    raise ValueError(f"rollout features ({rows.dtype}) cannot join fp8 corpus features; the cache build refuses that codec pair")


def _get(scales: dict, parent: int, length: int) -> np.ndarray | None:
    return scales[parent][:length] if parent in scales else None


def example_from_record(
    record: dict[str, np.ndarray], *, epoch: int, index: int, objective: ObjectiveConfig, seed: int,
    parent_rollout_features, ira_parents: int | None = None,
) -> SequenceExample | ReadFailure:
    """The example of sequence `index` in `epoch` from its record (the method's arrays; features as
    bf16 bits, fp8 bits with their `feature_scales`, or float32). `parent_rollout_features(rows)`
    returns (the rollout features of those stored rows [len, K-2, F], their fp8 scales [len, K-2]
    or None): the map loader reads just them, the stream has the whole array. `ira_parents`: the
    cache's setting (None: every pool anchor keeps its rollout features). Both loaders build their
    examples here, so they differ only in which sequences a step sees."""
    tensors = {name: torch.from_numpy(np.asarray(record[name])) for name in _LABEL_ARRAYS if name in record}
    num_pool = len(record["anchor_pos"])
    stored = ira_parent_rows(num_pool, ira_parents)  # [P] pool index of each stored rollout-feature row
    if len(stored) < num_pool:  # only some anchors may parent a secondary (docs/design.md, "The cache contract")
        tensors["ira_parent_rows"] = torch.from_numpy(stored)
    generator = torch.Generator().manual_seed(example_seed(seed=seed, epoch=epoch, index=index))
    targets = build_block_targets(tensors, config=objective, generator=generator)

    corpus_features = torch.from_numpy(np.ascontiguousarray(record["features"]))  # [T, F] uint16 bits or float32
    num_tokens = corpus_features.shape[0]
    features, positions, owners = [corpus_features], [torch.arange(num_tokens)], [torch.full((num_tokens,), SHARED_OWNER)]
    fp8 = "feature_scales" in record and record["features"].dtype == np.uint8  # fp8 bits travel with their scales
    scales = [torch.from_numpy(np.ascontiguousarray(record["feature_scales"]))] if fp8 else []  # [T]
    # IRA secondaries also see the parent's rollout features of y*[1..j-1] at positions a+1..a+j-1.
    secondary = [b for b in torch.nonzero(targets.private_parent >= 0).flatten().tolist() if targets.private_len[b] > 0]
    if secondary:
        parents = sorted({int(targets.private_parent[b]) for b in secondary})
        try:
            rows, scale_rows = parent_rollout_features(np.searchsorted(stored, np.asarray(parents)))
        except ValueError as error:
            return ReadFailure(message=str(error))
        parent_features = dict(zip(parents, rows))
        parent_scales = dict(zip(parents, scale_rows)) if scale_rows is not None else {}
        anchor_pos = tensors["anchor_pos"].long()
        for block in secondary:
            parent, length = int(targets.private_parent[block]), int(targets.private_len[block])
            # (a codec other than the corpus's is converted here: only the j-1 rows the block sees)
            rows, _ = _parents_like(parent_features[parent][:length], _get(parent_scales, parent, length), like=record["features"])
            features.append(torch.from_numpy(np.ascontiguousarray(rows)))  # [j-1, F]
            if fp8:
                scales.append(torch.from_numpy(np.ascontiguousarray(parent_scales[parent][:length])))  # [j-1]
            positions.append(anchor_pos[parent] + 1 + torch.arange(length))
            owners.append(torch.full((length,), block))
    return SequenceExample(
        index=index,
        num_tokens=num_tokens,
        context_features=torch.cat(features) if len(features) > 1 else features[0],  # (a cat would copy [T, F])
        context_positions=torch.cat(positions).long(),
        context_owner=torch.cat(owners).long(),
        targets=targets,
        context_feature_scales=torch.cat(scales).float() if fp8 else None,
    )


@dataclass(kw_only=True)
class TrainBatch:
    """A padded micro-batch of B sequences, N blocks each (after padding), C context tokens."""

    context_features: Tensor  # [B, C, F] float32, or bf16 (uint16) / fp8 (uint8) bits: step.py's decode_feature_bits, on the device
    context_positions: Tensor  # [B, C]
    context_owner: Tensor  # [B, C]
    context_valid: Tensor  # [B, C] bool
    block_tokens: Tensor  # [B, N * block_size] long
    block_positions: Tensor  # [B, N * block_size] long
    block_corpus_limit: Tensor  # [B, N]
    block_valid: Tensor  # [B, N] bool
    label_ids: Tensor  # [B, N, K, k]
    label_probs: Tensor  # [B, N, K, k]
    slot_weights: Tensor  # [B, N, K]
    supervised_index: Tensor  # [M] long: flat indices into [B * N * K] of the slots with weight > 0, ascending
    prev_tokens: Tensor  # [B, N, K] long: the token before each label on its own track (drafter/family.py)
    num_tokens: int  # corpus tokens in the batch (for throughput)
    num_sequences: int
    indices: tuple[int, ...] = ()  # the cache's sequence index of each row (which data a step saw)
    context_feature_scales: Tensor | None = None  # [B, C] float32: fp8 bits' per-row scales
    # The target distribution of each prediction when it is not the labels (one-hot labels, `BlockLayout.distributions`): [B, N, K, k]
    dist_ids: Tensor | None = None
    dist_probs: Tensor | None = None

    def to(self, device) -> TrainBatch:
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> TrainBatch:
        """Every tensor in page-locked memory. The DataLoader (pin_memory=True) calls this on each
        batch; it pins only tensors and objects with this method, so without it nothing is pinned
        and `to(..., non_blocking=True)` copies synchronously."""
        return self._map(lambda t: t.pin_memory())

    def _map(self, fn) -> TrainBatch:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return TrainBatch(**{k: fn(v) if isinstance(v, Tensor) else v for k, v in values.items()})


def padded_length(length: int, multiple: int = CONTEXT_MULTIPLE) -> int:
    """`length` rounded up to a multiple of `multiple`."""
    return -(-length // multiple) * multiple


def _batch_buffer(shape: tuple[int, ...], *, dtype: torch.dtype) -> Tensor:
    """An uninitialized tensor for a batch's features. In a DataLoader worker it is made in shared
    memory, where the batch has to go: sending a tensor to the training process copies it there
    otherwise, a second fault-in and copy of the batch's largest array (59 MB at real shapes, 3
    sequences; torch's default_collate does the same)."""
    if torch.utils.data.get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty((0,), dtype=dtype).set_(storage, 0, shape)


def collate(examples: list[SequenceExample | ReadFailure]) -> TrainBatch | ReadFailure:
    """Pad the examples into one batch. Runs in the DataLoader worker, so what depends on the data
    (the supervised slots' indices) is computed here on the CPU and the step needs no host sync."""
    failure = next((e for e in examples if isinstance(e, ReadFailure)), None)
    if failure is not None:
        return failure
    batch = len(examples)
    num_context = padded_length(max(e.context_features.shape[0] for e in examples))
    num_blocks = max(max(e.targets.block_tokens.shape[0] for e in examples), 1)
    block_size = examples[0].targets.block_tokens.shape[1]
    feature_dim = examples[0].context_features.shape[1]
    num_slots, top_k = examples[0].targets.label_ids.shape[1:]

    # [B, C, F] is most of a batch's bytes: only its pad rows are zeroed (each real row is copied once).
    context_features = _batch_buffer((batch, num_context, feature_dim), dtype=examples[0].context_features.dtype)
    fp8 = examples[0].context_feature_scales is not None
    context_feature_scales = torch.zeros((batch, num_context)) if fp8 else None
    context_positions = torch.zeros((batch, num_context), dtype=torch.long)
    context_owner = torch.full((batch, num_context), SHARED_OWNER, dtype=torch.long)
    context_valid = torch.zeros((batch, num_context), dtype=torch.bool)
    block_tokens = torch.zeros((batch, num_blocks, block_size), dtype=torch.long)
    block_positions = torch.zeros((batch, num_blocks, block_size), dtype=torch.long)
    block_corpus_limit = torch.zeros((batch, num_blocks), dtype=torch.long)
    block_valid = torch.zeros((batch, num_blocks), dtype=torch.bool)
    label_ids = torch.zeros((batch, num_blocks, num_slots, top_k), dtype=torch.long)
    label_probs = torch.zeros((batch, num_blocks, num_slots, top_k))
    slot_weights = torch.zeros((batch, num_blocks, num_slots))
    prev_tokens = torch.zeros((batch, num_blocks, num_slots), dtype=torch.long)
    # Distributions apart from the labels travel only where they differ from them (one-hot labels).
    separate_dist = examples[0].targets.dist_ids is not None and examples[0].targets.dist_ids is not examples[0].targets.label_ids
    if separate_dist:
        dist_k = examples[0].targets.dist_ids.shape[-1]
        dist_ids = torch.zeros((batch, num_blocks, num_slots, dist_k), dtype=torch.long)
        dist_probs = torch.zeros((batch, num_blocks, num_slots, dist_k))
    for b, e in enumerate(examples):
        c, t = e.context_features.shape[0], e.targets
        n = t.block_tokens.shape[0]
        context_features[b, :c] = e.context_features
        context_features[b, c:] = 0
        if fp8:
            context_feature_scales[b, :c] = e.context_feature_scales
        context_positions[b, :c] = e.context_positions
        context_owner[b, :c] = e.context_owner
        context_valid[b, :c] = True
        block_tokens[b, :n] = t.block_tokens
        block_positions[b, :n] = t.block_anchor_pos[:, None] + torch.arange(block_size)
        block_corpus_limit[b, :n] = t.block_corpus_limit
        block_valid[b, :n] = True
        label_ids[b, :n] = t.label_ids
        label_probs[b, :n] = t.label_probs
        slot_weights[b, :n] = t.slot_weights
        prev_tokens[b, :n] = t.prev_tokens
        if separate_dist:
            dist_ids[b, :n] = t.dist_ids
            dist_probs[b, :n] = t.dist_probs
    return TrainBatch(
        context_features=context_features,
        context_positions=context_positions,
        context_owner=context_owner,
        context_valid=context_valid,
        block_tokens=block_tokens.view(batch, -1),
        block_positions=block_positions.view(batch, -1),
        block_corpus_limit=block_corpus_limit,
        block_valid=block_valid,
        label_ids=label_ids,
        label_probs=label_probs,
        slot_weights=slot_weights,
        supervised_index=torch.nonzero(slot_weights.view(-1) > 0).flatten(),
        prev_tokens=prev_tokens,
        num_tokens=sum(e.num_tokens for e in examples),
        num_sequences=batch,
        indices=tuple(e.index for e in examples),
        context_feature_scales=context_feature_scales,
        dist_ids=dist_ids if separate_dist else None,
        dist_probs=dist_probs if separate_dist else None,
    )


def steps_per_epoch(num_sequences: int, *, batch_size: int) -> int:
    """Full global batches per epoch (the last partial batch is dropped)."""
    return num_sequences // batch_size


def epoch_order(num_sequences: int, *, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(_derived_seed(seed, epoch, 1))
    return torch.randperm(num_sequences, generator=generator).tolist()


class StepSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches of (epoch, index) keys, step by step, from a start step.

    A step's global batch is `batch_size` consecutive sequences of the epoch's permutation; rank r
    takes every world_size-th of them, split into `grad_accum` micro-batches. The trainer requires
    batch_size to be a multiple of world_size * grad_accum and drops an epoch's last partial batch,
    so every rank runs the same number of equally sized micro-batches (DDP needs that).
    """

    def __init__(self, num_sequences: int, *, batch_size: int, grad_accum: int, epochs: int, seed: int,
                 rank: int, world_size: int, start_step: int = 0):  # fmt: skip
        self.num_sequences, self.batch_size, self.grad_accum = num_sequences, batch_size, grad_accum
        self.epochs, self.seed, self.rank, self.world_size, self.start_step = epochs, seed, rank, world_size, start_step

    def steps(self):
        """(global step, epoch, this rank's micro-batches) from start_step to the end of training."""
        per_epoch = steps_per_epoch(self.num_sequences, batch_size=self.batch_size)
        for step in range(self.start_step, per_epoch * self.epochs):
            epoch, within = divmod(step, per_epoch)
            order = epoch_order(self.num_sequences, seed=self.seed, epoch=epoch)
            global_batch = order[within * self.batch_size : (within + 1) * self.batch_size]
            mine = global_batch[self.rank :: self.world_size]
            micro = [mine[i :: self.grad_accum] for i in range(self.grad_accum)]
            yield step, epoch, [[(epoch, index) for index in m] for m in micro]

    def __iter__(self):
        for _, _, micro_batches in self.steps():
            yield from micro_batches

    def __len__(self) -> int:
        per_epoch = steps_per_epoch(self.num_sequences, batch_size=self.batch_size)
        return (per_epoch * self.epochs - self.start_step) * self.grad_accum
