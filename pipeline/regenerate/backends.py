"""Generation backends of `alrira-cache regenerate`: the target writes one assistant turn per request.

- hf: transformers `generate()`. Greedy text requests run in batches (left padding, one token
  budget per batch); a sampled request (T > 0) runs alone after seeding torch with its own seed, so
  its text depends on its row and --seed only, not on which rows shared its batch; with
  --batched-sampling sampled text requests run in batches too, each row drawing its tokens from its
  own generator seeded with its seed (`RowSampler`); a request with an image (vision-language
  targets) runs alone with its pixels (docs/vision.md).
- vllm: one `vllm.LLM` engine per worker, every request of a round submitted at once, each with
  its seed (docs/vllm.md: in-process engine core, a bounded CPU KV cache, eager mode on CPU).

Both decode with the same rule: stop at the target's stop ids (pipeline/target.py
`stop_token_ids`: eos, end-of-turn, the generation config's eos) or after the request's
`max_new_tokens`, greedy or plain temperature / top-p sampling (no top-k, no repetition penalty: the
generation config's sampling defaults are not applied, so both backends sample the same law).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessor

from pipeline.regenerate.config import SamplingConfig
from pipeline.target import load_target, load_tokenizer, read_generation_config, stop_token_ids


@dataclass(kw_only=True)
class TurnRequest:
    """One assistant turn to write: the prompt ending in the generation prompt."""

    prompt_ids: list[int]
    max_new_tokens: int
    seed: int  # used when sampling (T > 0)
    image: tuple[torch.Tensor, torch.Tensor] | None = None  # (pixel_values [P, D], image_grid_thw [1, 3])


@dataclass(kw_only=True)
class TurnOutput:
    token_ids: list[int]  # the turn's content: generated tokens before the first stop id
    stopped: bool  # ended at a stop id (False: cut at max_new_tokens)


def finish_turn(generated: list[int], *, stop_ids: set[int]) -> TurnOutput:
    """Generated ids -> the turn's content ids, cut at (and without) the first stop id."""
    for position, token in enumerate(generated):
        if token in stop_ids:
            return TurnOutput(token_ids=list(generated[:position]), stopped=True)
    return TurnOutput(token_ids=list(generated), stopped=False)


class HfGenerator:
    """The target in transformers; `generate(requests)` answers them in order."""

    name = "hf"

    def __init__(self, target_dir: str, *, sampling: SamplingConfig, device: str, dtype: torch.dtype, batch_tokens: int):
        self.model = load_target(target_dir, device=device, dtype=dtype)
        self.tokenizer = load_tokenizer(target_dir)
        self.stop_ids = stop_token_ids(self.tokenizer, read_generation_config(target_dir))
        self.sampling, self.batch_tokens = sampling, batch_tokens
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stop_ids[0]
        # generate() fills every setting it is not given from model.generation_config: a fresh one,
        # so the target's generation_config.json (repetition_penalty, no_repeat_ngram_size,
        # min_new_tokens, ...) changes nothing and only our settings decide the tokens.
        self.model.generation_config = GenerationConfig(eos_token_id=self.stop_ids, pad_token_id=self.pad_id)

    def generate(self, requests: list[TurnRequest]) -> list[TurnOutput]:
        outputs: list[TurnOutput | None] = [None] * len(requests)
        in_batches = self.sampling.temperature == 0 or self.sampling.batched_sampling
        batched = [i for i, r in enumerate(requests) if r.image is None and in_batches]
        for i in sorted(set(range(len(requests))) - set(batched)):
            outputs[i] = self.generate_one(requests[i])
        for batch in self._batches(batched, requests):
            for i, output in zip(batch, self._generate_batch([requests[i] for i in batch])):
                outputs[i] = output
        return outputs

    def _batches(self, indices: list[int], requests: list[TurnRequest]) -> list[list[int]]:
        """Consecutive requests whose padded size (rows x longest prompt + max_new_tokens) fits
        --batch-tokens (one request per batch at least)."""
        batches, current, widest = [], [], 0
        for i in indices:
            width = len(requests[i].prompt_ids) + requests[i].max_new_tokens
            if current and max(widest, width) * (len(current) + 1) > self.batch_tokens:
                batches.append(current)
                current, widest = [], 0
            current.append(i)
            widest = max(widest, width)
        return batches + ([current] if current else [])

    def _decode_kwargs(self, max_new_tokens: int) -> dict:
        sampled = self.sampling.temperature > 0
        return dict(
            max_new_tokens=max_new_tokens, do_sample=sampled, eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
            temperature=self.sampling.temperature if sampled else None, top_p=self.sampling.top_p if sampled else None,
            top_k=0 if sampled else None,
        )  # fmt: skip

    @torch.inference_mode()
    def _generate_batch(self, requests: list[TurnRequest]) -> list[TurnOutput]:
        device = next(self.model.parameters()).device
        width = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)  # [B, W], left padded
        attention_mask = torch.zeros((len(requests), width), dtype=torch.long)  # [B, W]
        for b, request in enumerate(requests):
            input_ids[b, width - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
            attention_mask[b, width - len(request.prompt_ids) :] = 1
        max_new_tokens = max(r.max_new_tokens for r in requests)
        decode, extra = self._decode_kwargs(max_new_tokens), {}
        if self.sampling.temperature > 0:  # --batched-sampling: each row samples from its own generator
            decode = dict(decode, do_sample=False, temperature=None, top_p=None, top_k=None)
            sampler = RowSampler([r.seed for r in requests], temperature=self.sampling.temperature, top_p=self.sampling.top_p)
            extra = {"logits_processor": [sampler]}
        out = self.model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **decode, **extra
        )  # [B, W + new]
        stop_ids = set(self.stop_ids)
        return [
            finish_turn(out[b, width : width + r.max_new_tokens].tolist(), stop_ids=stop_ids) for b, r in enumerate(requests)
        ]

    @torch.inference_mode()
    def generate_one(self, request: TurnRequest) -> TurnOutput:
        """One request alone (`generate()` per row): a sampled one seeded with its own seed, an
        image one with its pixels and the M-RoPE token types transformers needs."""
        from pipeline.vision import mm_token_type_ids

        device = next(self.model.parameters()).device
        input_ids = torch.tensor([request.prompt_ids], dtype=torch.long, device=device)  # [1, n]
        extra = {}
        if request.image is not None:
            pixel_values, grid = request.image
            extra = dict(
                pixel_values=pixel_values.to(device, self.model.dtype), image_grid_thw=grid.to(device),
                mm_token_type_ids=mm_token_type_ids(input_ids, image_token_id=self.model.config.image_token_id),
            )  # fmt: skip
        # The request's own seed, in a forked RNG: the caller's random state is left as it was.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(request.seed)
            out = self.model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **extra, **self._decode_kwargs(request.max_new_tokens)
            )  # [1, n + new]
        return finish_turn(out[0, len(request.prompt_ids) :].tolist(), stop_ids=set(self.stop_ids))

    def close(self) -> None:
        self.model = None


class RowSampler(LogitsProcessor):
    """Batched sampling with one generator per row: samples each row's next token (temperature, then
    top-p) from the row's own generator, seeded with its request's seed, and leaves that token the
    only finite score, so greedy decoding picks it. A row's draws do not depend on its batch-mates;
    only the float rounding of batched logits can."""

    def __init__(self, seeds: list[int], *, temperature: float, top_p: float):
        self.seeds, self.temperature, self.top_p = seeds, temperature, top_p
        self.generators: list[torch.Generator] | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.generators is None:
            self.generators = [torch.Generator(device=scores.device).manual_seed(s) for s in self.seeds]
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)  # [B, V]
        if self.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            outside = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= self.top_p  # the mass before it already reaches top_p
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
        picks = torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(self.generators)])  # [B]
        only = torch.full_like(scores, float("-inf"))
        return only.scatter_(-1, picks[:, None], 0.0)


class VllmGenerator:
    """The target in a vLLM engine (text targets only); `generate(requests)` submits them together."""

    name = "vllm"

    def __init__(self, target_dir: str, *, sampling: SamplingConfig, dtype: torch.dtype, tensor_parallel_size: int):
        from pipeline.cache_build.vllm_runner import CPU_KV_CACHE_BYTES, check_vllm_target

        check_vllm_target(target_dir)
        # In-process engine core: no engine subprocess inside a Ray actor (docs/vllm.md).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        from vllm.platforms import current_platform

        engine_args = {}
        if current_platform.is_cpu():
            engine_args["enforce_eager"] = True  # no torch.compile warm-up for a short CPU run
            if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
                engine_args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        self.tokenizer = load_tokenizer(target_dir)
        self.stop_ids = stop_token_ids(self.tokenizer, read_generation_config(target_dir))
        self.sampling = sampling
        self.llm = LLM(
            model=str(target_dir), dtype=str(dtype).removeprefix("torch."), tensor_parallel_size=tensor_parallel_size,
            seed=0, **engine_args,
        )  # fmt: skip

    def generate(self, requests: list[TurnRequest]) -> list[TurnOutput]:
        from vllm import SamplingParams, TokensPrompt

        if any(r.image is not None for r in requests):
            raise ValueError("--backend vllm: image rows need --backend hf (docs/vision.md)")
        if not requests:
            return []
        sampled = self.sampling.temperature > 0
        params = [
            SamplingParams(
                temperature=self.sampling.temperature, top_p=self.sampling.top_p if sampled else 1.0,
                max_tokens=r.max_new_tokens, stop_token_ids=self.stop_ids, seed=r.seed if sampled else None,
                detokenize=False,
            )  # fmt: skip
            for r in requests
        ]
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        stop_ids = set(self.stop_ids)
        return [finish_turn(list(out.outputs[0].token_ids), stop_ids=stop_ids) for out in outs]

    def close(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None


def load_generator(config) -> HfGenerator | VllmGenerator:
    """The backend `config.compute.backend` names, loaded on this worker's device."""
    compute = config.compute
    device, dtype = compute.device_and_dtype()
    if compute.backend == "vllm":
        return VllmGenerator(config.target, sampling=config.sampling, dtype=dtype, tensor_parallel_size=compute.tensor_parallel_size)
    return HfGenerator(config.target, sampling=config.sampling, device=device, dtype=dtype, batch_tokens=compute.batch_tokens)
