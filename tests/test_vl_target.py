"""Vision-language targets in stage 1 (docs/vision.md): a tiny real Qwen3-VL loads (text-config
dims, language-model head, tied or not, PIL processor fallback); the corpus pass with pixels and
M-RoPE equals a plain HF forward with the image at every position; batched rollouts equal HF
`generate()` from x[<=a] with the image; image tokens are never supervised; the manifest's vision
settings; the vLLM backend refuses VL targets."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

from pipeline.cache_build.config import CacheBuildConfig, vision_cache_settings
from pipeline.cache_build.corpus import CorpusConfig, corpus_vision_inputs, ingest_corpus
from pipeline.cache_build.rollouts import TargetRunConfig, reference_rollout, run_target_batch
from pipeline.cache_build.vllm_runner import VllmTargetRunner
from pipeline.target import load_target, load_tokenizer, read_target_config, read_target_head, tapped_features, target_hash
from pipeline.vision import DEFAULT_VL_SYSTEM_PROMPT, load_image_processor, mm_token_type_ids
from storage.manifest import CacheSettings
from tests.vl_fixtures import make_toy_vl_target

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = TargetRunConfig(num_slots=7, top_k=4, anchors_per_sequence=5, layer_ids=[0, 2])
SEQUENCES = (0, 1, 3)  # image a.png, a text-only row, image c.png (another grid shape)


@pytest.fixture(scope="module")
def model(vl_target):
    return load_target(vl_target)


@pytest.fixture(scope="module")
def stage1(model, vl_target, vl_corpus, vl_vision):
    corpus = ingest_corpus(CorpusConfig(path=str(vl_corpus)), load_tokenizer(vl_target), progress=False, vision=vl_vision)
    sequences = [corpus.target_sequence(i, vision=vl_vision) for i in SEQUENCES]
    return sequences, run_target_batch(model, sequences, RUN)  # one right-padded batch


def plain_inputs(model, sequence, length: int | None = None) -> dict:
    """What an HF user passes for x[:length] with the sequence's image (HF computes the positions)."""
    ids = torch.as_tensor(np.asarray(sequence.input_ids[:length]), dtype=torch.long)[None]
    inputs = {"input_ids": ids}
    if sequence.image is not None:
        pixel_values, grid = sequence.image.pixel_inputs()
        inputs |= {"pixel_values": pixel_values, "image_grid_thw": grid,
                   "mm_token_type_ids": mm_token_type_ids(ids, image_token_id=model.config.image_token_id)}  # fmt: skip
    model.model.rope_deltas = None  # HF caches it across calls
    return inputs


def test_a_vl_target_loads_with_text_config_dims_and_language_model_head(model, vl_target, tmp_path):
    assert type(model).__name__ == "Qwen3VLForConditionalGeneration"
    config = read_target_config(vl_target)
    assert (config["num_hidden_layers"], config["hidden_size"]) == (4, 64) and "layer_types" not in config
    embed, lm_head = read_target_head(vl_target)
    assert torch.equal(embed, model.model.language_model.embed_tokens.weight)
    assert torch.equal(lm_head, model.lm_head.weight) and not torch.equal(embed, lm_head)
    tied_dir = make_toy_vl_target(tmp_path / "tied", seed=1, tie_word_embeddings=True)
    tied_embed, tied_head = read_target_head(tied_dir)
    assert torch.equal(tied_embed, tied_head) and torch.equal(tied_head, load_target(tied_dir).lm_head.weight)
    processor, processor_class = load_image_processor(vl_target)
    if importlib.util.find_spec("torchvision") is None:  # AutoProcessor needs it: the PIL fallback (docs/vision.md)
        assert processor_class == type(processor).__name__ == "Qwen2VLImageProcessorPil"
    # The image processor's settings are part of what the target is.
    before = target_hash(vl_target)
    path = vl_target / "preprocessor_config.json"
    original = path.read_text()
    try:
        path.write_text(original.replace('"merge_size": 2', '"merge_size": 2 '))
        assert target_hash(vl_target) != before
    finally:
        path.write_text(original)


def test_corpus_pass_equals_a_plain_forward_with_the_image_at_every_position(model, stage1):
    sequences, outputs = stage1
    for sequence, out in zip(sequences, outputs):
        with torch.inference_mode():
            plain = model(**plain_inputs(model, sequence), output_hidden_states=True)
        features = tapped_features(plain.hidden_states, RUN.layer_ids)[0]  # [T, F], image positions included
        torch.testing.assert_close(out.features, features, atol=2e-5, rtol=1e-4)
        probs = torch.softmax(plain.logits[0].float(), dim=-1)
        torch.testing.assert_close(out.corpus_topk_probs, probs.gather(-1, out.corpus_topk_ids.long()), atol=2e-5, rtol=1e-4)
        next_ids = torch.as_tensor(np.asarray(sequence.input_ids[1:]), dtype=torch.long)
        torch.testing.assert_close(out.corpus_next_prob[:-1], probs[:-1].gather(-1, next_ids[:, None])[:, 0], atol=2e-5, rtol=1e-4)
    assert sequences[0].image is not None and sequences[1].image is None


def test_rollouts_equal_generate_from_the_anchor_with_the_image(model, stage1):
    sequences, outputs = stage1
    # No stop token (a rollout runs its full depth); the attention mask is given, so no id is padding.
    greedy = GenerationConfig(
        do_sample=False, max_new_tokens=RUN.num_slots, eos_token_id=None, output_logits=True, return_dict_in_generate=True
    )
    checked = 0
    for sequence, out in zip(sequences, outputs):
        for j in (0, len(out.anchor_pos) - 1):
            anchor = int(out.anchor_pos[j])
            inputs = plain_inputs(model, sequence, anchor + 1)
            with torch.inference_mode():
                generated = model.generate(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]), generation_config=greedy)
            tokens = generated.sequences[0, anchor + 1 :]
            assert out.rollout_tokens[j, 1:].tolist() == tokens.tolist()
            probs = torch.softmax(torch.stack(generated.logits)[:, 0].float(), dim=-1)  # [K, V]: pi[a, 1..K]
            torch.testing.assert_close(out.rollout_topk_probs[j], probs.gather(-1, out.rollout_topk_ids[j].long()), atol=2e-5, rtol=1e-4)
            reference = reference_rollout(model, sequence.input_ids, anchor=anchor, config=RUN, image=sequence.image)
            assert torch.equal(reference["rollout_tokens"], out.rollout_tokens[j])
            torch.testing.assert_close(out.rollout_features[j], reference["rollout_features"], atol=2e-5, rtol=1e-4)
            checked += 1
    assert checked == 2 * len(SEQUENCES)


def test_image_tokens_are_never_supervised_nor_anchors(model, stage1):
    sequences, outputs = stage1
    image_token = model.config.image_token_id
    for sequence, out in zip(sequences, outputs):
        is_image = out.input_ids == image_token
        assert not out.loss_mask[is_image].any()
        anchors = out.anchor_pos.long()
        assert len(anchors) == RUN.anchors_per_sequence
        # Slot k of a block at a is supervised only where m[a + k] = 1: never on an image token.
        assert not is_image[anchors].any() and not is_image[anchors + 1].any()
        assert bool(out.loss_mask[anchors].all())
    assert int((sequences[0].input_ids == image_token).sum()) > 0


def test_the_manifest_records_the_vision_settings(vl_target, vl_corpus, toy_target, toy_corpus, tmp_path):
    config = CacheBuildConfig.from_flags(target=str(vl_target), corpus=str(vl_corpus), out=str(tmp_path / "c"))
    extra = vision_cache_settings(config, vision=corpus_vision_inputs(config.target, config.corpus))
    vision = extra["vision"]
    tokenizer = load_tokenizer(vl_target)
    assert extra["system_prompt"] == DEFAULT_VL_SYSTEM_PROMPT
    assert vision["modality"] == "image-text" and (vision["min_pixels"], vision["max_pixels"]) == (50176, 200704)
    for name, token in (("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
                        ("vision_end_token_id", "<|vision_end|>"), ("video_token_id", "<|video_pad|>")):  # fmt: skip
        assert vision[name] == tokenizer.convert_tokens_to_ids(token)
    assert vision["image_processor"]["patch_size"] == 16 and vision["image_processor"]["merge_size"] == 2
    assert "first 1 decoder layer" in vision["deepstack_note"] and "vLLM" in vision["drafter_positions"]
    assert vision["processor_class"] in ("Qwen3VLProcessor", "Qwen2VLImageProcessorPil")
    base = {"target_hash": "sha256:x", "layer_ids": [1], "num_slots": 15, "top_k": 8, "anchors_per_sequence": 128,
            "seed": 0, "max_length": 4096, "min_supervised_tokens": 32, "feature_codec": "bf16", "storage_format": "zarr",
            "shard_size": 256, "corpus_hash": "sha256:y", "skip_bad_rows": False}  # fmt: skip
    settings = CacheSettings.from_dict(json.loads(json.dumps({**base, **extra})))
    assert CacheSettings.from_dict(settings.to_dict()) == settings and settings.modality == "image-text"
    # A text target adds nothing: its settings (and manifest) keep exactly their old keys.
    text = vision_cache_settings(
        CacheBuildConfig.from_flags(target=str(toy_target), corpus=str(toy_corpus), out=str(tmp_path / "t")), vision=None
    )
    assert text == {} and set(CacheSettings.from_dict(base).to_dict()) == set(base) | {"contents", "backend"}
    assert CacheSettings.from_dict(base).modality == "text"


def test_the_vllm_backend_refuses_a_vl_target_in_one_line(vl_target, vl_corpus, tmp_path):
    config = CacheBuildConfig.from_flags(target=str(vl_target), corpus=str(vl_corpus), out=str(tmp_path / "c"), backend="vllm")
    with pytest.raises(ValueError, match=r"^--backend vllm: .* is a vision-language target") as error:
        vision_cache_settings(config, vision=corpus_vision_inputs(config.target, config.corpus))
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"^--backend vllm: .* use --backend hf"):
        VllmTargetRunner(vl_target, run_config=RUN)
