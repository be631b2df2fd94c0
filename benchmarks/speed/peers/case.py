"""One training step's inputs and weights, made the same in every interpreter (docs/benchmarks.md,
"Training step against the peers").

The peer trainers run in their own virtualenvs, which share this machine's torch: each worker calls
`make_case(shape)` and gets bit-identical tensors from the same generator, so no file carries
weights between processes. Only torch and benchmarks/common/process.py are imported here (a peer's
venv has nothing of alrira installed; the worker finds benchmarks/ on PYTHONPATH, the checkout).

The step: one sequence of `seq` tokens (the first PROMPT_TOKENS unsupervised), `anchors` blocks of
`block` slots at the same sorted anchor positions for every trainer, the drafter's weights under the
z-lab names that alrira, SpecForge and speculators all use, the target's frozen embed_tokens and
lm_head, and the target's tapped features (random, at the scale of a real model's hidden states).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass

import torch

from benchmarks.common.process import PeakSampler, rss_bytes

PROMPT_TOKENS = 64
INIT_STD = 0.02  # HF Qwen3's initializer_range


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """The shapes of one side-by-side step (the issue's: hidden 1024, 5 taps, block 16, 128 anchors)."""

    seq: int = 2048
    layers: int = 1  # drafter layers
    hidden: int = 1024
    intermediate: int = 3072
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    taps: int = 5
    block: int = 16
    anchors: int = 128
    vocab: int = 151936  # Qwen3's
    gamma: float = 7.0  # DFlash's slot decay
    rope_theta: float = 1e6
    eps: float = 1e-6
    lr: float = 6e-4
    grad_clip: float = 1.0

    @property
    def mask_token_id(self) -> int:
        return self.vocab - 1


@dataclass(frozen=True, kw_only=True)
class StepCase:
    input_ids: torch.Tensor  # [1, S] long
    loss_mask: torch.Tensor  # [1, S] float (0 on the prompt)
    features: torch.Tensor  # [1, S, taps * hidden] float32
    last_hidden: torch.Tensor  # [1, S, hidden] float32: the target's last hidden state (speculators' KD targets)
    anchors: torch.Tensor  # [N] long, sorted: every block's anchor position
    embed_tokens: torch.Tensor  # [V, H] float32
    lm_head: torch.Tensor  # [V, H] float32
    drafter: dict[str, torch.Tensor]  # z-lab names -> float32


def qwen3_fields(shape: StepShape) -> dict:
    """The drafter's Qwen3 fields, as every trainer's config (alrira's DFlashConfig, HF's
    Qwen3Config) takes them."""
    return dict(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        rms_norm_eps=shape.eps, rope_theta=shape.rope_theta, max_position_embeddings=max(40960, shape.seq),
        vocab_size=shape.vocab,
    )  # fmt: skip


def hf_qwen3_config(shape: StepShape):
    """HF's Qwen3Config of the drafter, SDPA attention: what both peers build their drafter from
    (their flex paths have no backward on CPU)."""
    from transformers import Qwen3Config

    config = Qwen3Config(**qwen3_fields(shape), attention_bias=False, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return config


def drafter_weights(shape: StepShape, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The drafter's weights, z-lab names, HF Qwen3 init (linears N(0, 0.02), norms 1)."""
    h, q, kv, d = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.head_dim

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=generator) * INIT_STD

    weights = {"fc.weight": linear(h, shape.taps * h), "hidden_norm.weight": torch.ones(h), "norm.weight": torch.ones(h)}
    for i in range(shape.layers):
        p = f"layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": linear(q, h), p + "self_attn.k_proj.weight": linear(kv, h),
            p + "self_attn.v_proj.weight": linear(kv, h), p + "self_attn.o_proj.weight": linear(h, q),
            p + "self_attn.q_norm.weight": torch.ones(d), p + "self_attn.k_norm.weight": torch.ones(d),
            p + "mlp.gate_proj.weight": linear(shape.intermediate, h), p + "mlp.up_proj.weight": linear(shape.intermediate, h),
            p + "mlp.down_proj.weight": linear(h, shape.intermediate),
        }  # fmt: skip
    return weights


def make_case(shape: StepShape, seed: int = 0) -> StepCase:
    generator = torch.Generator().manual_seed(seed)
    s = shape.seq
    input_ids = torch.randint(0, shape.vocab - 1, (1, s), generator=generator)
    loss_mask = torch.ones(1, s)
    loss_mask[:, :PROMPT_TOKENS] = 0
    # Anchors whose token and next token are supervised, and whose whole block fits (speculators
    # excludes the last block_size positions), drawn without replacement and sorted.
    candidates = torch.arange(PROMPT_TOKENS, s - shape.block)
    anchors = candidates[torch.randperm(len(candidates), generator=generator)[: shape.anchors]].sort().values
    return StepCase(
        input_ids=input_ids,
        loss_mask=loss_mask,
        features=torch.randn(1, s, shape.taps * shape.hidden, generator=generator),
        last_hidden=torch.randn(1, s, shape.hidden, generator=generator),
        anchors=anchors,
        embed_tokens=torch.randn(shape.vocab, shape.hidden, generator=generator) * INIT_STD,
        lm_head=torch.randn(shape.vocab, shape.hidden, generator=generator) * INIT_STD,
        drafter=drafter_weights(shape, generator),
    )


def slot_weights(shape: StepShape, case: StepCase) -> torch.Tensor:
    """[N, block]: DFlash's weight of each slot of each block: 0 at the anchor slot, exp(-(k - 1) /
    gamma) at slot k, times the loss mask of the token it predicts (0 past the sequence)."""
    k = torch.arange(shape.block)
    positions = case.anchors[:, None] + k  # [N, block]
    inside = positions < shape.seq
    mask = case.loss_mask[0, positions.clamp(max=shape.seq - 1)] * inside
    decay = torch.exp(-(k - 1).clamp(min=0).float() / shape.gamma) * (k > 0)
    return decay * mask


def worker_case() -> tuple[StepShape, str, int, StepCase]:
    """A worker's command line, SHAPE_JSON PRECISION STEPS, and the case of that shape; sets torch's
    threads to $PEER_STEP_THREADS (2), the same for every trainer, and silences warnings (the peers'
    deprecation warnings would fill what a failed worker shows)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(int(os.environ.get("PEER_STEP_THREADS", "2")))
    shape_json, precision, steps = sys.argv[1:4]
    if precision not in ("fp32", "bf16"):
        raise SystemExit(f"precision must be fp32 or bf16, got {precision!r}")
    shape = StepShape(**json.loads(shape_json))
    return shape, precision, int(steps), make_case(shape)


def run_steps(step, *, steps: int, name: str, precision: str) -> None:
    """Run `step()` (returns the loss as a float) once as warm-up, then `steps` timed times, and
    print one JSON line: the first step's loss, each timed step's seconds, the resident set before
    the first step (inputs, weights: what the trainer keeps) and its peak over the steps."""
    gc.collect()
    live = rss_bytes()
    with PeakSampler(rss_bytes, every_s=0.002) as peak:  # the step's peak, apart from what setup once held
        first_loss = step()
        seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
    record = {"trainer": name, "precision": precision, "first_loss": first_loss, "step_s": seconds,
              "live_rss_gib": live / 2**30, "step_peak_rss_gib": peak.peak / 2**30}  # fmt: skip
    print(json.dumps(record))


def shape_json(shape: StepShape) -> str:
    return json.dumps(asdict(shape))
