"""Stages 2 and 3 on a vision-language cache (docs/vision.md): every method trains from a Qwen3-VL
cache with no setting of its own, never supervising an image token and placing the drafter at the
sequence index; `alrira-eval` decodes image prompts losslessly against the target's greedy
`generate()`, prefill (vision encoder included) outside the timing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

import pipeline.cache_build.driver as driver
from drafter.checkpoint import load_drafter
from pipeline.cache_build.corpus import load_tokenized_corpus
from pipeline.eval.evaluate import EvalConfig, eval_prompts, run_eval
from pipeline.eval.speculative import autoregressive_decode, speculative_decode
from pipeline.eval.tree import tree_speculative_decode
from pipeline.eval.speculative import cached_draft_logits_fn
from pipeline.target import load_target, load_tokenizer, stop_token_ids
from pipeline.train import TrainConfig, train
from pipeline.train.batching import example_from_record
from pipeline.train.labels import ObjectiveConfig
from pipeline.train.methods import METHODS
from pipeline.vision import mm_token_type_ids
from storage.reader import open_cache
from storage.verify import verify_cache
from tests.conftest import write_jsonl
from tests.vl_fixtures import build_vl_cache, llava_row

pytestmark = pytest.mark.usefixtures("one_thread")

K = 15  # alr_ira needs rollouts of depth K - 1 with the trainer's default K
BUILD_FLAGS = {"layers": [0, 2], "anchors": 16, "top_k": 4, "max_length": 512, "shard_size": 4}


@pytest.fixture(scope="module")
def vl_cache(vl_target, vl_corpus, tmp_path_factory):
    return build_vl_cache(vl_target, vl_corpus, tmp_path_factory.mktemp("vl-cache") / "cache", **BUILD_FLAGS)


@pytest.fixture(scope="module")
def alr_ira_run(vl_cache, tmp_path_factory):
    run = tmp_path_factory.mktemp("vl-train") / "alr_ira"
    summary = train(TrainConfig.from_flags(
        cache=str(vl_cache), out=str(run), method="alr_ira", epochs=4, batch_size=2, num_workers=0, lr=3e-3, progress=False, save_dtype="float32",
        log_every=1,
    ))  # fmt: skip
    return run, summary


def test_the_vl_cache_verifies_and_records_its_vision_settings(vl_cache, vl_target):
    assert verify_cache(vl_cache) == []
    reader = open_cache(vl_cache)
    settings = reader.manifest.settings
    assert settings.modality == "image-text" and settings.system_prompt == "You are a helpful assistant."
    corpus = load_tokenized_corpus(vl_cache / "corpus")
    image_token = settings.vision["image_token_id"]
    for i in range(len(reader)):
        record = reader.read(i)  # shards hold their sequences longest first
        image = corpus.images[int(np.flatnonzero(corpus.source_rows == record["source_row"])[0])]
        is_image = record["input_ids"] == image_token
        assert int(is_image.sum()) == (0 if image is None else image["num_tokens"])
        assert not record["loss_mask"][is_image].any() and record["features"].shape == (len(is_image), 2 * 64)
    assert reader.manifest.num_target_layers == 4 and reader.manifest.hidden_size == 64


@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_from_a_vl_cache_at_sequence_index_positions(method, vl_cache, tmp_path):
    reader = open_cache(vl_cache)
    manifest = reader.manifest
    objective = ObjectiveConfig(method=method).for_cache(
        num_slots=K, mask_token_id=manifest.mask_token_id, stop_token_ids=manifest.stop_token_ids
    )
    image_token = manifest.settings.vision["image_token_id"]
    num_supervised = 0
    for i in range(len(reader)):
        record = reader.read(i)
        example = example_from_record(
            record, epoch=0, index=i, objective=objective, seed=0,
            parent_rollout_features=lambda rows, i=i: (reader.read_rollout_features(i, rows), None),
        )  # fmt: skip
        targets, num_tokens = example.targets, len(record["input_ids"])
        # Drafter positions are the sequence index (docs/vision.md, "Serving"): context i at i, slot k at anchor + k.
        assert torch.equal(example.context_positions[:num_tokens], torch.arange(num_tokens))
        block, slot = torch.nonzero(targets.slot_weights > 0, as_tuple=True)
        labelled = targets.block_anchor_pos[block] + slot + 1  # slot index k - 1 labels position anchor + k
        assert not np.isin(record["input_ids"][labelled.numpy()], [image_token]).any()
        num_supervised += len(block)
    assert num_supervised > 0
    summary = train(TrainConfig.from_flags(
        cache=str(vl_cache), out=str(tmp_path / method), method=method, max_steps=1, batch_size=2, num_workers=0,
        progress=False,
    ))  # fmt: skip
    assert summary["steps"] == 1 and (tmp_path / method / "drafter" / "config.json").is_file()


def test_alr_ira_learns_from_a_vl_cache(alr_ira_run):
    run, summary = alr_ira_run
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == len(losses) == 12 and summary["mean_loss_last_10pct"] < losses[0]


@pytest.fixture(scope="module")
def prompts_file(vl_corpus, tmp_path_factory):
    """Image prompts in every row form (relative to the corpus folder's images), grouped by benchmark."""
    folder = vl_corpus.parent
    rows = [
        {"benchmark": "llava", **llava_row("images/a.png", seed=21)},
        {"benchmark": "llava", "prompt": "<image>\ntell me about the light .", "image": "images/c.png"},
        {"benchmark": "openai", "messages": [{"role": "user", "content": [
            {"type": "image", "image": "images/b.png"}, {"type": "text", "text": "what is the name of the river ?"}]}]},
        {"benchmark": "text", "prompt": "write about the house and the door ."},
    ]  # fmt: skip
    return write_jsonl(folder / "prompts.jsonl", rows)


def _greedy_generate(target, prompt, *, max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt.input_ids])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if prompt.image is not None:
        pixel_values, grid = prompt.image.pixel_inputs()
        inputs |= {"pixel_values": pixel_values, "image_grid_thw": grid,
                   "mm_token_type_ids": mm_token_type_ids(ids, image_token_id=target.config.image_token_id)}  # fmt: skip
    target.model.rope_deltas = None
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=target.generation_config.eos_token_id)
    with torch.inference_mode():
        return target.generate(**inputs, generation_config=config)[0, len(prompt.input_ids) :].tolist()


def test_image_prompts_decode_losslessly_against_generate(vl_target, alr_ira_run, prompts_file, tmp_path):
    drafter_dir = alr_ira_run[0] / "drafter"
    config = EvalConfig(target=str(vl_target), drafter=str(drafter_dir), prompts=str(prompts_file), out=str(tmp_path / "eval"),
                        max_new_tokens=20, device="cpu", progress=False)  # fmt: skip
    target, tokenizer, drafter = load_target(vl_target), load_tokenizer(vl_target), load_drafter(drafter_dir).eval()
    prompts = eval_prompts(config, tokenizer)
    assert [p.image is not None for p in prompts] == [True, True, True, False]
    stops = stop_token_ids(tokenizer, {"eos_token_id": target.generation_config.eos_token_id})
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    draft_config = drafter.config
    for prompt in prompts:
        expected = _greedy_generate(target, prompt, max_new_tokens=20)
        image = None if prompt.image is None else prompt.image.pixel_inputs()
        common = {"prompt_ids": prompt.input_ids, "max_new_tokens": 20, "stop_token_ids": stops, "image": image}
        ar = autoregressive_decode(target, temperature=0.0, generator=None, **common)
        spec = speculative_decode(target, drafter, embed_tokens=embed_tokens, lm_head=lm_head, temperature=0.0,
                                  generator=None, mask_token_id=draft_config.mask_token_id, **common)  # fmt: skip
        tree = tree_speculative_decode(
            target, draft_logits_fn=cached_draft_logits_fn(drafter, embed_tokens=embed_tokens, lm_head=lm_head,
                                                           mask_token_id=draft_config.mask_token_id),
            layer_ids=list(draft_config.target_layer_ids), num_draft=K, budget=12, branch=3, **common,
        )  # fmt: skip
        assert ar.tokens == spec.tokens == tree.tokens == expected
        assert spec.rounds >= 1 and sum(a + 1 for a in spec.accepted_lengths) == len(spec.tokens) - 1
    summary = run_eval(config)
    assert summary["lossless_mismatches"] == 0 and summary["lossless_exact"]
    assert list(summary["groups"]) == ["llava", "openai", "text"] and summary["groups"]["llava"]["prompts"] == 2


def test_the_build_driver_writes_the_same_vl_cache(vl_target, vl_corpus, vl_cache, tmp_path):
    from pipeline.cache_build.config import CacheBuildConfig

    out = tmp_path / "cache"
    config = CacheBuildConfig.from_flags(target=str(vl_target), corpus=str(vl_corpus), out=str(out), **BUILD_FLAGS)
    manifest = driver.build_cache(config, run_shards=driver.run_shards_here, progress=False, log=lambda m: None)
    assert manifest.settings == open_cache(vl_cache).manifest.settings
    assert [s.checksum for s in manifest.shards] == [s.checksum for s in open_cache(vl_cache).manifest.shards]
