"""The vLLM backend of stage 1: the same `TargetOutputs` as `run_target_batch`, computed by vLLM.

Where each output comes from (docs/vllm.md has the full account):
- features: the tapped layers' hidden states of the prompt tokens, saved by vLLM's
  `extract_hidden_states` method through `SyncHiddenStatesConnector` (pipeline/cache_build/vllm_connector.py).
  vLLM layer id L is HF `hidden_states[L]`, so tap `id` asks vLLM for `id + 1`.
- corpus_topk_* / corpus_next_prob: one request per sequence with `prompt_logprobs = top_k`.
  vLLM's prompt_logprobs[t] is the distribution predicting token t, so it is shifted by one; the
  last position's distribution is the logprobs of the request's single generated token.
- anchor_pos: `anchor_pool`, the same seeded function the HF backend uses.
- rollouts: one request per anchor, all submitted together so the engine batches them and automatic
  prefix caching shares each sequence's corpus prefix. As in the HF backend, y*[1] and pi[a, 1] come
  from the corpus pass, so the prompt is x[<=a] + y*[1] and the request generates y*[2..K] greedily
  (temperature 0, eos ignored) with their top-k logprobs pi[a, 2..K]; the saved states of
  y*[1..K-2] are the rollout features.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.cache_build.rollouts import TargetOutputs, TargetRunConfig, TargetSequence, anchor_pool
from pipeline.vision import is_vision_target

_FLUSH_TIMEOUT_S = 600.0  # how long to wait for hidden-state files before giving up
CPU_KV_CACHE_BYTES = 2 << 30  # KV cache of a CPU engine unless VLLM_CPU_KVCACHE_SPACE or engine_args say otherwise
_ENGINE_KEYS = {
    "model", "dtype", "tensor_parallel_size", "enable_prefix_caching", "max_logprobs", "speculative_config",
    "kv_transfer_config",
}  # fmt: skip


def _topk_from_flat(flat, *, first: int, top_k: int):
    """Positions [first, len) of a vLLM FlatLogprobs -> (topk ids [N, k] int32, topk logprobs
    [N, k] f64, actual-token logprobs [N] f64). Each position holds [actual token, top-1..top-k]."""
    starts = np.asarray(flat.start_indices[first:], dtype=np.int64)
    ends = np.asarray(flat.end_indices[first:], dtype=np.int64)
    num = len(starts)
    assert np.all(ends - starts == top_k + 1), "every position must hold the actual token plus the top-k"
    if num == 0:
        return np.zeros((0, top_k), np.int32), np.zeros((0, top_k)), np.zeros(0)
    lo, hi = int(starts[0]), int(ends[-1])
    ids = np.asarray(flat.token_ids[lo:hi], dtype=np.int64).reshape(num, top_k + 1)
    logprobs = np.asarray(flat.logprobs[lo:hi], dtype=np.float64).reshape(num, top_k + 1)
    return ids[:, 1:].astype(np.int32), logprobs[:, 1:], logprobs[:, 0]


def _lowest_id_first(ids: np.ndarray, logprobs: np.ndarray) -> np.ndarray:
    """Column 0 = the lowest id among the entries tied with the maximum (the HF backend's argmax
    rule, ties -> lowest id), whatever order torch.topk put exact ties in."""
    tied = logprobs == logprobs[:, :1]  # [N, k]
    lowest = np.where(tied, ids, np.iinfo(np.int32).max).min(axis=1)  # [N]
    rows = np.flatnonzero(lowest != ids[:, 0])
    if len(rows):
        ids = ids.copy()
        cols = np.argmax(ids[rows] == lowest[rows, None], axis=1)
        ids[rows, cols] = ids[rows, 0]
        ids[rows, 0] = lowest[rows]
    return ids


def _distributions(ids: np.ndarray, logprobs: np.ndarray):
    """top-k ids / logprobs -> (ids [N, k] int32, probs [N, k] f32, tail [N] f32), as topk_with_tail."""
    probs = torch.from_numpy(np.exp(logprobs)).float()
    tail = (1.0 - probs.sum(dim=-1)).clamp_min(0.0)
    return torch.from_numpy(_lowest_id_first(ids, logprobs)).int(), probs, tail


def check_vllm_target(target_dir: str | Path) -> None:
    """The vLLM backend computes text targets only: the corpus pass of a vision-language target
    needs its pixel inputs and M-RoPE positions, which this backend does not send (docs/vision.md)."""
    if is_vision_target(target_dir):
        raise ValueError(
            f"--backend vllm: {target_dir} is a vision-language target, which the vLLM backend does not "
            "compute; use --backend hf (docs/vision.md)"
        )


class VllmTargetRunner:
    """Loads the target once into a vLLM engine; `run` maps a batch of sequences to the same
    `TargetOutputs` that `run_target_batch` returns.

    `engine_args` go to `vllm.LLM` unchanged (e.g. max_model_len, gpu_memory_utilization,
    enforce_eager); they must not repeat what this class sets. `workdir` holds the hidden-state
    files while a batch runs (one private subfolder per runner, emptied as files are read).
    """

    def __init__(
        self,
        target_dir: str | Path,
        *,
        run_config: TargetRunConfig,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        workdir: str | Path | None = None,
        engine_args: dict | None = None,
    ):
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        check_vllm_target(target_dir)
        # In-process engine core: no engine subprocess inside a Ray actor, and the hidden-state files
        # are flushed by stepping the engine here (see _wait_for_files).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        from pipeline.cache_build.vllm_connector import CONNECTOR_NAME, MODULE_PATH

        engine_args = dict(engine_args or {})
        clash = sorted(set(engine_args) & _ENGINE_KEYS)
        if clash:
            raise ValueError(f"engine_args: {clash} are set by VllmTargetRunner")
        if _on_cpu() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            # A CPU build otherwise reserves gpu_memory_utilization (0.92) of the RAM, or refuses to start.
            engine_args.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)

        self.run_config = run_config
        self.layer_ids = list(run_config.layer_ids)  # fixed by the engine; run() checks it
        if workdir is not None:
            Path(workdir).mkdir(parents=True, exist_ok=True)
        self.workdir = Path(tempfile.mkdtemp(prefix="alrira-vllm-", dir=workdir))
        try:
            self.llm = LLM(
                model=str(target_dir),
                dtype=dtype,
                tensor_parallel_size=tensor_parallel_size,
                enable_prefix_caching=True,
                max_logprobs=max(20, run_config.top_k),
                speculative_config={
                    "method": "extract_hidden_states",
                    "num_speculative_tokens": 1,
                    "draft_model_config": {
                        "hf_config": {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.layer_ids]}
                    },
                },
                kv_transfer_config={
                    "kv_connector": CONNECTOR_NAME,
                    "kv_connector_module_path": MODULE_PATH,
                    "kv_role": "kv_producer",
                    "kv_connector_extra_config": {
                        "shared_storage_path": str(self.workdir),
                        "use_synchronization_lock": False,  # files appear atomically (os.replace)
                    },
                },
                **engine_args,
            )
        except BaseException:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------------------------------

    def run(self, sequences: list[TargetSequence]) -> list[TargetOutputs]:
        """Corpus pass, then (unless run_config.rollouts is False) every anchor's rollout."""
        from vllm import SamplingParams, TokensPrompt

        config = self.run_config
        if list(config.layer_ids) != self.layer_ids:
            raise ValueError(f"run_config.layer_ids {config.layer_ids} differ from the engine's taps {self.layer_ids}")
        if config.top_k > self.llm.llm_engine.model_config.max_logprobs:
            raise ValueError(f"run_config.top_k {config.top_k} exceeds the engine's max_logprobs")
        num_slots, top_k = config.num_slots, config.top_k
        input_ids = [np.asarray(s.input_ids, dtype=np.int64) for s in sequences]

        # Corpus pass: one request per sequence, prompt logprobs at every position, one generated
        # token whose logprobs are the distribution at the last position.
        corpus_params = SamplingParams(
            temperature=0.0,
            max_tokens=1,
            ignore_eos=True,
            logprobs=top_k,
            prompt_logprobs=top_k,
            flat_logprobs=True,
            detokenize=False,
        )
        corpus_out = self._generate([TokensPrompt(prompt_token_ids=ids.tolist()) for ids in input_ids], corpus_params)
        corpus_states = self._load_states(
            [o.kv_transfer_params["hidden_states_path"] for o in corpus_out], expected=input_ids
        )

        results = []
        for seq, ids, out, states in zip(sequences, input_ids, corpus_out, corpus_states):
            length = len(ids)
            top_ids, top_logprobs, next_logprobs = _topk_from_flat(out.prompt_logprobs, first=1, top_k=top_k)
            last_ids, last_logprobs, _ = _topk_from_flat(out.outputs[0].logprobs, first=0, top_k=top_k)
            c_ids, c_probs, c_tail = _distributions(
                np.concatenate([top_ids, last_ids]), np.concatenate([top_logprobs, last_logprobs])
            )
            # p_T(x[t+1] | x[<=t]) is prompt_logprobs[t + 1]'s actual-token entry; 0 at the last position.
            c_next = torch.zeros(length, dtype=torch.float32)
            c_next[:-1] = torch.from_numpy(np.exp(next_logprobs)).float()
            results.append(
                TargetOutputs(
                    source_row=int(seq.source_row),
                    input_ids=torch.from_numpy(ids).int(),
                    loss_mask=torch.tensor(np.asarray(seq.loss_mask), dtype=torch.uint8),
                    features=states.reshape(length, -1),  # [T, n_layers * H], taps in layer_ids order
                    corpus_topk_ids=c_ids,
                    corpus_topk_probs=c_probs,
                    corpus_tail=c_tail,
                    corpus_next_prob=c_next,
                    anchor_pos=torch.as_tensor(
                        anchor_pool(
                            seq.loss_mask,
                            num_anchors=config.anchors_per_sequence,
                            seed=config.seed,
                            source_row=seq.source_row,
                        ),
                        dtype=torch.int32,
                    ),
                )
            )
        if config.rollouts:
            self._rollouts(results, num_slots=num_slots, top_k=top_k)
        return results

    def _rollouts(self, results: list[TargetOutputs], *, num_slots: int, top_k: int) -> None:
        """Fill the rollout_* fields of every result in place."""
        from vllm import SamplingParams, TokensPrompt

        prompts, params, owners = [], [], []
        for b, res in enumerate(results):
            ids = res.input_ids.long().numpy()
            for a in res.anchor_pos.tolist():
                first = int(res.corpus_topk_ids[a, 0])  # y*[1]: the corpus argmax at the anchor
                prompts.append(TokensPrompt(prompt_token_ids=ids[: a + 1].tolist() + [first]))
                params.append(
                    SamplingParams(
                        temperature=0.0,
                        max_tokens=num_slots - 1,  # y*[2..K]
                        ignore_eos=True,  # rollouts run through stop tokens; the trainer masks after them
                        logprobs=top_k,
                        flat_logprobs=True,
                        detokenize=False,
                        # Save the states of y*[1..K-1] only (every generated token but the last).
                        extra_args={"kv_transfer_params": {"include_output_tokens": True, "save_from": a + 1}},
                    )
                )
                owners.append(b)
        outs = self._generate(prompts, params)
        for out in outs:
            assert len(out.outputs[0].token_ids) == num_slots - 1
        states = self._load_states(
            [o.kv_transfer_params["hidden_states_path"] for o in outs],
            expected=[
                np.asarray([p["prompt_token_ids"][-1], *o.outputs[0].token_ids[:-1]]) for p, o in zip(prompts, outs)
            ],
        )

        owners = np.asarray(owners)
        for b, res in enumerate(results):
            rows = np.flatnonzero(owners == b)
            pos = res.anchor_pos.long()
            num_anchors = len(pos)
            tokens = torch.zeros((num_anchors, num_slots + 1), dtype=torch.int32)  # [A, K+1]
            tokens[:, 0] = res.input_ids[pos]
            tokens[:, 1] = res.corpus_topk_ids[pos, 0]
            roll_ids = torch.zeros((num_anchors, num_slots, top_k), dtype=torch.int32)  # [A, K, k]
            roll_probs = torch.zeros((num_anchors, num_slots, top_k), dtype=torch.float32)
            roll_tail = torch.zeros((num_anchors, num_slots), dtype=torch.float32)  # [A, K]
            # Slot 1 is the corpus distribution at the anchor itself.
            roll_ids[:, 0], roll_probs[:, 0], roll_tail[:, 0] = (
                res.corpus_topk_ids[pos], res.corpus_topk_probs[pos], res.corpus_tail[pos]
            )
            features = res.features.new_zeros((num_anchors, num_slots - 2, res.features.shape[-1]))
            for j, row in enumerate(rows):
                gen = outs[row].outputs[0]
                tokens[j, 2:] = torch.as_tensor(gen.token_ids, dtype=torch.int32)
                ids, logprobs, _ = _topk_from_flat(gen.logprobs, first=0, top_k=top_k)
                roll_ids[j, 1:], roll_probs[j, 1:], roll_tail[j, 1:] = _distributions(ids, logprobs)
                features[j] = states[row][: num_slots - 2].reshape(num_slots - 2, -1)  # y*[1..K-2]
            res.rollout_tokens = tokens
            res.rollout_topk_ids = roll_ids
            res.rollout_topk_probs = roll_probs
            res.rollout_tail = roll_tail
            res.rollout_features = features
            # Prompt tokens each rollout took from the prefix cache (the corpus pass left them there).
            res.extras["rollout_cached_tokens"] = torch.as_tensor([outs[row].num_cached_tokens or 0 for row in rows])

    # ------------------------------------------------------------------------------------------

    def _generate(self, prompts, params):
        if not prompts:
            return []
        return self.llm.generate(prompts, params, use_tqdm=False)

    def _load_states(self, paths: list[str], *, expected: list[np.ndarray]) -> list[torch.Tensor]:
        """Read (and delete) each request's hidden-state file -> [n, num_layers, H] per request."""
        from safetensors.torch import load_file

        self._wait_for_files(paths)
        states = []
        for path, tokens in zip(paths, expected):
            data = load_file(path)
            os.remove(path)
            assert np.array_equal(data["token_ids"].numpy(), tokens), f"{path}: saved states are of other tokens"
            states.append(data["hidden_states"])
        return states

    def _wait_for_files(self, paths: list[str]) -> None:
        """A finished request's states are written on a later engine step (the connector runs in
        the worker's next forward). An in-process engine is stepped here; an engine core in its own
        process steps itself, so then this only waits."""
        in_process = not _env_flag("VLLM_ENABLE_V1_MULTIPROCESSING", default=True)
        deadline = time.monotonic() + _FLUSH_TIMEOUT_S
        missing = [p for p in paths if not os.path.exists(p)]
        while missing:
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not write {len(missing)} hidden-state files, e.g. {missing[0]}")
            if in_process:
                self.llm.llm_engine.step()
            else:
                time.sleep(0.01)
            missing = [p for p in missing if not os.path.exists(p)]

    def close(self) -> None:
        """Shut the engine down (TP workers included) and remove the hidden-state folder."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        shutil.rmtree(self.workdir, ignore_errors=True)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _env_flag(name: str, *, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else bool(int(value))
