"""Llama-architecture targets (Llama 3 and SmolLM2 styles, pipeline/demo/toy.py): a tokenizer that
fills the embedding, tied embeddings, GQA, their chat formats and end ids, through build -> train
-> eval with `--mask-token` (docs/design.md, "The target")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.corpus import render_sequence
from pipeline.cache_build.driver import build_cache, run_shards_here
from pipeline.cache_build.plan import resolve_build_mask_token_id
from pipeline.cache_build.rollouts import TargetRunConfig, TargetSequence, reference_rollout, run_target_batch
from pipeline.demo.toy import make_toy_llama_target
from pipeline.eval.evaluate import EvalConfig, render_prompt, run_eval
from pipeline.target import load_target, load_tokenizer, read_generation_config, stop_token_ids
from pipeline.train import TrainConfig, train
from ray_jobs.cli import cache_cli
from storage.manifest import load_manifest, load_target_head
from storage.reader import open_cache
from storage.verify import verify_cache
from tests.conftest import LLAMA_MASK_TOKEN, train_alr_drafter, write_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

CONVERSATION = [
    {"role": "system", "content": "be good ."},
    {"role": "user", "content": "tell me about the river ."},
    {"role": "assistant", "content": " the river is long and the water is cold . "},  # Llama 3 trims content
    {"role": "user", "content": "and the city ?"},
    {"role": "assistant", "content": "the city has no name , but it has a river ."},
]
PROMPTS = [{"prompt": "tell me a story about the river ."}, {"messages": CONVERSATION[:2]}]
END_OF_TURN = {"llama3": "<|eot_id|>", "smollm2": "<|im_end|>"}


@pytest.fixture(scope="module")
def smollm2_target(tmp_path_factory) -> Path:
    return make_toy_llama_target(tmp_path_factory.mktemp("smollm2") / "toy-smollm2", chat_style="smollm2", peaked=True)


@pytest.mark.parametrize("style", ["llama3", "smollm2"])
def test_chat_format_stop_ids_and_loss_mask(style, llama_target, smollm2_target):
    target = llama_target if style == "llama3" else smollm2_target
    tokenizer = load_tokenizer(target)
    ids = tokenizer.convert_tokens_to_ids
    stops = stop_token_ids(tokenizer, read_generation_config(target))
    expected = ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"] if style == "llama3" else ["<|endoftext|>", "<|im_end|>"]
    assert stops == sorted(ids(expected))
    assert json.loads((target / "config.json").read_text())["vocab_size"] == len(tokenizer)  # no free row

    # The loss mask is each assistant turn's content (as the template writes it) and its end of turn.
    input_ids, loss_mask = render_sequence(tokenizer, CONVERSATION, max_length=4096)
    supervised = [t for t, m in zip(input_ids, loss_mask) if m]
    contents = [m["content"].strip() for m in CONVERSATION if m["role"] == "assistant"]
    assert supervised == [t for c in contents for t in (*tokenizer(c, add_special_tokens=False)["input_ids"], ids(END_OF_TURN[style]))]
    if style == "llama3":
        assert input_ids[0] == ids("<|begin_of_text|>") and input_ids.count(ids("<|begin_of_text|>")) == 1
    else:  # SmolLM2's template adds its default system turn to a row without one
        assert tokenizer.convert_ids_to_tokens(render_prompt(tokenizer, CONVERSATION[1:2]))[:2] == ["<|im_start|>", "system"]

    # Evaluation prompts end in the assistant header; the Qwen3 `enable_thinking` flag changes nothing here.
    prompt = render_prompt(tokenizer, CONVERSATION[:2])
    header = ["<|start_header_id|>", "assistant", "<|end_header_id|>"] if style == "llama3" else ["<|im_start|>", "assistant"]
    assert tokenizer.convert_ids_to_tokens(prompt)[-len(header) :] == header
    plain = tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == tokenizer(plain, add_special_tokens=False)["input_ids"]


def test_batched_rollouts_of_a_llama_target_equal_plain_forwards(llama_target):
    """The shared-KV rollouts with their 4-D branch mask (a config without layer_types takes the
    tensor itself) against step-by-step full forwards, on padded sequences of a tied GQA target."""
    model = load_target(llama_target, dtype=torch.float32)
    rng = np.random.default_rng(0)
    sequences = [
        TargetSequence(source_row=row, input_ids=rng.integers(0, 200, n), loss_mask=(np.arange(n) >= 8).astype(np.uint8))
        for row, n in enumerate([40, 27])
    ]
    config = TargetRunConfig(layer_ids=[0, 2], anchors_per_sequence=3, top_k=4, num_slots=7, seed=3)
    for seq, out in zip(sequences, run_target_batch(model, sequences, config)):
        for j, anchor in enumerate(out.anchor_pos.tolist()):
            ref = reference_rollout(model, seq.input_ids, anchor=anchor, config=config)
            assert torch.equal(ref["rollout_tokens"], out.rollout_tokens[j])
            torch.testing.assert_close(out.rollout_topk_probs[j], ref["rollout_topk_probs"], atol=2e-6, rtol=1e-5)
            torch.testing.assert_close(out.rollout_features[j], ref["rollout_features"], atol=1e-4, rtol=1e-4)


def test_a_full_embedding_without_mask_token_is_one_line_naming_the_flag(ray_address, smollm2_target, toy_corpus, tmp_path):
    out = tmp_path / "cache"
    args = ["build", "--target", str(smollm2_target), "--corpus", str(toy_corpus), "--out", str(out), "--ray-address", ray_address,
            "--layers", "0,2", "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(cache_cli, args)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1] == (
        f"Error: --mask-token: the tokenizer of {smollm2_target} fills the whole embedding (226 rows), so no unused row "
        "can be the mask token; pick an existing token the corpus never contains, e.g. --mask-token '<repo_name>'"
    )
    assert not out.exists()


def _eval(target: Path, drafter: Path, tmp_path: Path) -> dict:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    config = EvalConfig(target=str(target), drafter=str(drafter), prompts=str(prompts), out=str(tmp_path / "eval"),
                        max_new_tokens=24, device="cpu", progress=False)  # fmt: skip
    return run_eval(config)


def test_llama3_target_builds_trains_and_evaluates(llama_target, llama_cache, llama_drafter, tmp_path):
    tokenizer = load_tokenizer(llama_target)
    manifest = load_manifest(llama_cache)
    mask = tokenizer.convert_tokens_to_ids(LLAMA_MASK_TOKEN)
    assert (manifest.mask_token_id, manifest.vocab_size) == (mask, len(tokenizer))
    assert manifest.stop_token_ids == stop_token_ids(tokenizer, read_generation_config(llama_target))
    assert verify_cache(llama_cache) == []
    reader = open_cache(llama_cache)
    assert all(mask not in reader.read(i)["input_ids"] for i in range(len(reader)))
    head = load_target_head(llama_cache, target_hash=manifest.settings.target_hash)
    assert torch.equal(head["embed_tokens.weight"], head["lm_head.weight"])  # tied: the embedding twice

    # The export serves with the cache's mask token and the drafter's own plain RoPE.
    exported = json.loads((llama_drafter / "config.json").read_text())
    assert exported["dflash_config"]["mask_token_id"] == mask and exported["rope_scaling"] is None
    summary = _eval(llama_target, llama_drafter, tmp_path)
    assert summary["lossless_mismatches"] == 0 and summary["rounds"] > 0


def test_smollm2_target_builds_trains_and_evaluates(smollm2_target, toy_corpus, tmp_path):
    corpus = write_jsonl(tmp_path / "chat.jsonl", toy_corpus.read_text().splitlines()[:4])
    cache = tmp_path / "cache"
    config = CacheBuildConfig.from_flags(
        target=str(smollm2_target), corpus=str(corpus), out=str(cache), mask_token="<repo_name>", layers=[0, 2],
        anchors=8, top_k=4, max_length=128, shard_size=4, num_slots=7,
    )  # fmt: skip
    manifest = build_cache(config, run_shards=run_shards_here, progress=False, log=lambda m: None)
    assert manifest.mask_token_id == load_tokenizer(smollm2_target).convert_tokens_to_ids("<repo_name>")
    drafter = train_alr_drafter(cache, tmp_path / "run", epochs=1)
    assert json.loads((drafter / "config.json").read_text())["dflash_config"]["mask_token_id"] == manifest.mask_token_id
    assert _eval(smollm2_target, drafter, tmp_path)["lossless_mismatches"] == 0


def test_a_drafter_init_keeps_its_mask_token(llama_target, llama_cache, llama_drafter, toy_corpus, tmp_path):
    """A head trained with another mask token: the build takes its token by default and refuses
    another --mask-token; the trainer refuses a cache built with another one."""
    other = tmp_path / "other-mask-head"
    shutil.copytree(llama_drafter, other)
    config = json.loads((other / "config.json").read_text())
    other_mask = load_tokenizer(llama_target).convert_tokens_to_ids("<|reserved_special_token_1|>")
    config["dflash_config"]["mask_token_id"] = other_mask
    (other / "config.json").write_text(json.dumps(config))

    tokenizer, stops = load_tokenizer(llama_target), load_manifest(llama_cache).stop_token_ids
    build = dict(target=str(llama_target), corpus=str(toy_corpus), out=str(tmp_path / "c"), drafter_init=str(other))
    resolve = lambda config: resolve_build_mask_token_id(config, tokenizer, vocab_size=len(tokenizer), stop_ids=stops)  # noqa: E731
    assert resolve(CacheBuildConfig.from_flags(**build)) == other_mask
    with pytest.raises(ValueError, match=rf"^--mask-token {LLAMA_MASK_TOKEN.replace('|', '.')} \(id \d+\) is not the mask token of --drafter-init"):
        resolve(CacheBuildConfig.from_flags(**build, mask_token=LLAMA_MASK_TOKEN))

    with pytest.raises(ValueError, match=rf"its mask token {other_mask} is not the cache's \d+; build the cache with --mask-token {other_mask}$"):
        train(TrainConfig.from_flags(cache=str(llama_cache), out=str(tmp_path / "run"), method="alr", drafter_init=str(other),
                                     epochs=1, batch_size=2, num_workers=0, rollout_depth=6, progress=False))  # fmt: skip
