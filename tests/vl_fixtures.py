"""A tiny real Qwen3-VL target built in code (docs/vision.md): a random Qwen3VLForConditionalGeneration
with tiny vision and text towers, the PIL image processor, a word-level tokenizer with Qwen's
vision special tokens and a Qwen3-VL-style chat template; plus small PNGs and LLaVA-style rows.

Everything is deterministic in its seed and loads back offline with AutoModelForImageTextToText /
AutoImageProcessor / AutoTokenizer, like a real Qwen3-VL directory.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken

from pipeline.demo.toy import ENDOFTEXT_TOKEN, IM_END_TOKEN, PEAKED_LM_HEAD_STD, make_toy_tokenizer, toy_vocab_size

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PATCH_SIZE = 16  # as Qwen3-VL: 16-pixel patches, 2x2 of them merged into one LLM token
MERGE_SIZE = 2

# Qwen3-VL-Instruct's template reduced to what a chat corpus uses: string or list content, an
# image part rendered as <|vision_start|><|image_pad|><|vision_end|>, no think blocks.
TOY_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' or 'image' in part %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'video' or 'video' in part %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part %}{{- part.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def make_toy_vl_tokenizer():
    tokenizer = make_toy_tokenizer()
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=True) for t in VISION_TOKENS], special_tokens=True)
    tokenizer.chat_template = TOY_VL_CHAT_TEMPLATE
    return tokenizer


def make_toy_vl_target(out_dir: str | Path, *, seed: int = 0, tie_word_embeddings: bool = False, peaked: bool = True) -> Path:
    """A random fp32 Qwen3-VL (vision: 2 blocks, deepstack after block 0; text: 4 layers, hidden 64,
    head_dim 32, interleaved M-RoPE) saved with its PIL image processor and tokenizer."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    out_dir = Path(out_dir)
    tokenizer = make_toy_vl_tokenizer()
    token_id = tokenizer.convert_tokens_to_ids
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": toy_vocab_size(len(tokenizer)), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "dtype": "float32",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True},
            "bos_token_id": token_id(ENDOFTEXT_TOKEN), "eos_token_id": token_id(IM_END_TOKEN),
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE, "temporal_patch_size": 2, "out_hidden_size": 64,
            "num_position_embeddings": 64, "deepstack_visual_indexes": [0],
        },
        image_token_id=token_id("<|image_pad|>"), video_token_id=token_id("<|video_pad|>"),
        vision_start_token_id=token_id("<|vision_start|>"), vision_end_token_id=token_id("<|vision_end|>"),
        tie_word_embeddings=tie_word_embeddings, eos_token_id=token_id(IM_END_TOKEN), dtype="float32",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        if peaked:  # peaked next-token distributions, as pipeline.demo.toy's `peaked`
            model.lm_head.weight.mul_(PEAKED_LM_HEAD_STD / config.text_config.initializer_range)
        # A trained Qwen3-VL never emits a vision token; logit 0 keeps this one from doing so
        # (the top logit over ~200 random rows is positive), so greedy text stays text.
        model.lm_head.weight[[token_id(t) for t in VISION_TOKENS]] = 0.0
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    Qwen2VLImageProcessorPil(patch_size=PATCH_SIZE, merge_size=MERGE_SIZE, temporal_patch_size=2).save_pretrained(out_dir)
    return out_dir


def write_png(path: str | Path, *, width: int, height: int, seed: int) -> Path:
    """A random RGB PNG."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format="PNG")
    return path


def vl_text(rng: random.Random, num_words: int) -> str:
    from pipeline.demo.toy import DEFAULT_WORDS

    return " ".join(rng.choice(DEFAULT_WORDS) for _ in range(num_words)) + " ."


def llava_row(image: str | None, *, seed: int, answer_words: int = 40, row_id: str | None = None) -> dict:
    """An ALLaVA / ShareGPT4V-style row: `<image>` in the human turn, one gpt answer."""
    rng = random.Random(seed)
    question = vl_text(rng, rng.randint(4, 10))
    row = {
        "id": row_id or f"row-{seed}",
        "conversations": [
            {"from": "human", "value": ("<image>\n" if image is not None else "") + question},
            {"from": "gpt", "value": vl_text(rng, answer_words)},
        ],
    }
    if image is not None:
        row["image"] = image
    return row


IMAGE_SIZES = {"a.png": (80, 60), "b.png": (64, 64), "c.png": (120, 40)}  # (width, height)


def write_images(image_dir: str | Path) -> Path:
    image_dir = Path(image_dir)
    for i, (name, (width, height)) in enumerate(sorted(IMAGE_SIZES.items())):
        write_png(image_dir / name, width=width, height=height, seed=10 + i)
    return image_dir


def mixed_vl_rows() -> list[dict]:
    """Image rows in each accepted form and text-only rows (paths relative to the corpus folder)."""
    rng = random.Random(7)
    openai_image = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": vl_text(rng, 6)}, {"type": "image", "image": "images/b.png"}]},
            {"role": "assistant", "content": vl_text(rng, 45)},
        ]
    }
    trailing_placeholder = llava_row("images/c.png", seed=3, answer_words=50)
    turn = trailing_placeholder["conversations"][0]
    turn["value"] = turn["value"].removeprefix("<image>\n") + "\n<image>"  # LLaVA also puts it last
    openai_text = {"messages": [{"role": "user", "content": vl_text(rng, 8)}, {"role": "assistant", "content": vl_text(rng, 40)}]}
    return [
        llava_row("images/a.png", seed=1, answer_words=45),
        llava_row(None, seed=2, answer_words=40),  # a text-only row in a VL corpus
        openai_image,
        trailing_placeholder,
        openai_text,
        llava_row("images/b.png", seed=4, answer_words=42),
    ]


def build_vl_cache(target: Path, corpus: Path, out: Path, **flags) -> Path:
    """A cache built in this process from the build's parts, as pipeline.cache_build.driver does once it
    passes the vision inputs on (docs/vision.md, "Stage 1"): settings with the corpus's vision inputs,
    the corpus tokenized with the image processor, shards from TokenizedCorpus.target_sequence."""
    from pipeline.cache_build.config import CacheBuildConfig, compute_record, vision_cache_settings
    from pipeline.cache_build.corpus import corpus_vision_inputs, ingest_corpus, load_tokenized_corpus, save_tokenized_corpus
    from pipeline.cache_build.plan import content_settings, resolve_layer_ids
    from pipeline.cache_build.rollouts import run_target_batch
    from pipeline.cache_build.shard_builder import outputs_to_record, plan_batches
    from pipeline.corpus_source import file_sha256
    from pipeline.target import (
        load_target, load_tokenizer, read_generation_config, read_target_config, read_target_head, stop_token_ids, target_hash,
    )  # fmt: skip
    from storage.format import CORPUS_DIR
    from storage.manifest import CacheSettings, Manifest, save_manifest, save_target_head
    from storage.shards import write_shard

    config = CacheBuildConfig.from_flags(target=str(target), corpus=str(corpus), out=str(out), **flags)
    target_config = read_target_config(target)
    layer_ids = resolve_layer_ids(config, num_target_layers=target_config["num_hidden_layers"])
    config = config.with_taps(layer_ids)
    tokenizer, vision = load_tokenizer(target), corpus_vision_inputs(target, config.corpus)
    settings = CacheSettings(
        target_hash=target_hash(target), layer_ids=layer_ids, corpus_hash=file_sha256(config.corpus.path),
        **content_settings(config), **vision_cache_settings(config, vision=vision),
    )  # fmt: skip
    save_tokenized_corpus(ingest_corpus(config.corpus, tokenizer, progress=False, vision=vision), out / CORPUS_DIR)
    corpus = load_tokenized_corpus(out / CORPUS_DIR)
    embed_tokens, lm_head = read_target_head(target)
    save_target_head(out, embed_tokens=embed_tokens, lm_head=lm_head, target_hash=settings.target_hash)
    model = load_target(target)
    shard_size, records = config.storage.shard_size, []
    for index, start in enumerate(range(0, len(corpus), shard_size)):
        sequences = [corpus.target_sequence(i, vision=vision) for i in range(start, min(start + shard_size, len(corpus)))]
        outputs = []
        for batch in plan_batches([len(s.input_ids) for s in sequences], batch_tokens=config.compute.batch_tokens):
            outputs += run_target_batch(model, [sequences[i] for i in batch], config.run)
        encoded = [outputs_to_record(o, feature_codec=config.storage.feature_codec, contents=config.contents) for o in outputs]
        records.append(write_shard(
            out, shard_index=index, records=encoded, storage_format=config.storage.storage_format,
            feature_codec=config.storage.feature_codec, contents=config.contents, compute=compute_record("cpu", model.dtype),
        ))  # fmt: skip
    save_manifest(out, Manifest(
        settings=settings, target_path=str(target.resolve()), target_config=target_config,
        num_target_layers=target_config["num_hidden_layers"], hidden_size=target_config["hidden_size"],
        vocab_size=target_config["vocab_size"], stop_token_ids=stop_token_ids(tokenizer, read_generation_config(target)),
        mask_token_id=len(tokenizer), corpus_path=str(corpus.corpus_path), corpus_stats=corpus.stats, shards=records,
        num_shards_planned=len(records), compute=compute_record("cpu", model.dtype),
    ))  # fmt: skip
    return out
