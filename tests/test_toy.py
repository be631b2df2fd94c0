"""The toy target factory: tokenizer, chat template, model directory, chat rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.demo.toy import DEFAULT_WORDS, make_toy_target, make_toy_tokenizer, toy_chat_rows


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return make_toy_target(tmp_path_factory.mktemp("toy") / "target", seed=0)


def test_model_and_tokenizer_round_trip_from_disk(toy_dir):
    tokenizer = AutoTokenizer.from_pretrained(toy_dir)
    model = AutoModelForCausalLM.from_pretrained(toy_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (64, 4, 32)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (2, 1, 128)
    assert config.max_position_embeddings >= 4096
    assert config.rope_parameters["rope_theta"] == 1_000_000.0
    assert not config.tie_word_embeddings
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert (toy_dir / "model.safetensors").is_file()

    assert len(tokenizer) == len(make_toy_tokenizer())
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.unk_token is not None
    text = "the house , by the river. <|im_start|>"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == "the house , by the river . <|im_start|>"

    # The reloaded weights are the saved ones, and the model runs on its own vocabulary.
    saved = load_file(toy_dir / "model.safetensors")
    assert np.array_equal(saved["lm_head.weight"], model.lm_head.weight.detach().numpy())
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config.vocab_size)


def test_offsets_map_tokens_back_to_their_text():
    tokenizer = make_toy_tokenizer()
    text = "<|im_start|>user\nhello, world!<|im_end|>\n<think>\n\n</think>\n\n"
    encoding = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    pieces = [text[a:b] for a, b in encoding["offset_mapping"]]
    assert pieces == ["<|im_start|>", "user", "hello", ",", "world", "!", "<|im_end|>", "<think>", "</think>"]
    assert tokenizer.convert_ids_to_tokens(encoding["input_ids"])[2] == "<unk>"  # "hello" is not a default word


def test_chat_template_two_turns_without_thinking():
    tokenizer = make_toy_tokenizer()
    messages = [
        {"role": "system", "content": "be kind."},
        {"role": "user", "content": "what is water?"},
        {"role": "assistant", "content": "water is life."},
        {"role": "user", "content": "and light?"},
        {"role": "assistant", "content": "light is good."},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, enable_thinking=False)
    assert rendered == (
        "<|im_start|>system\nbe kind.<|im_end|>\n"
        "<|im_start|>user\nwhat is water?<|im_end|>\n"
        "<|im_start|>assistant\nwater is life.<|im_end|>\n"
        "<|im_start|>user\nand light?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nlight is good.<|im_end|>\n"
    )
    history = rendered[: rendered.rindex("<|im_start|>assistant")]
    kwargs = dict(tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.apply_chat_template(messages[:4], enable_thinking=False, **kwargs)
    assert prompt == history + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    thinking = tokenizer.apply_chat_template(messages[:4], enable_thinking=True, **kwargs)
    assert thinking.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_vocab_has_an_unused_mask_row(toy_dir):
    tokenizer = AutoTokenizer.from_pretrained(toy_dir)
    vocab_size = AutoModelForCausalLM.from_pretrained(toy_dir).config.vocab_size
    assert vocab_size > len(tokenizer) and vocab_size % 16 == 0
    assert max(tokenizer.get_vocab().values()) == len(tokenizer) - 1
    # A tokenizer whose size is already a multiple of 16 still gets a spare row.
    words = next(w for n in range(1, 17) if len(make_toy_tokenizer(w := [f"w{i}" for i in range(n)])) % 16 == 0)
    path = make_toy_target(toy_dir.parent / "exact", words=words, num_hidden_layers=1)
    assert AutoModelForCausalLM.from_pretrained(path).config.vocab_size == len(make_toy_tokenizer(words)) + 16


def test_same_seed_same_weights_different_seed_different(tmp_path):
    state = torch.get_rng_state()
    a = load_file(make_toy_target(tmp_path / "a", seed=3, num_hidden_layers=2) / "model.safetensors")
    b = load_file(make_toy_target(tmp_path / "b", seed=3, num_hidden_layers=2) / "model.safetensors")
    c = load_file(make_toy_target(tmp_path / "c", seed=4, num_hidden_layers=2) / "model.safetensors")
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG is left alone
    assert a.keys() == b.keys() == c.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["lm_head.weight"], c["lm_head.weight"])
    assert not np.array_equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])


def test_peaked_target_is_confident(tmp_path):
    tokenizer = make_toy_tokenizer()
    row = toy_chat_rows(1, seed=0, form="openai")[0]
    ids = tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]
    top1 = {}
    for peaked in (False, True):
        model = AutoModelForCausalLM.from_pretrained(make_toy_target(tmp_path / str(peaked), seed=0, peaked=peaked))
        with torch.no_grad():
            top1[peaked] = model(torch.tensor([ids])).logits.softmax(-1).max(-1).values.mean().item()
    assert top1[False] < 0.05 < 0.3 < top1[True]


def test_toy_chat_rows_are_deterministic_and_in_vocabulary():
    rows = toy_chat_rows(6, seed=5, min_turns=2, max_turns=3, response_words=(40, 50))
    assert rows == toy_chat_rows(6, seed=5, min_turns=2, max_turns=3, response_words=(40, 50))
    assert rows != toy_chat_rows(6, seed=6, min_turns=2, max_turns=3, response_words=(40, 50))
    tokenizer = make_toy_tokenizer()
    for row in rows:
        turns = row["conversations"]
        roles = [t["from"] for t in turns if t["from"] != "system"]
        assert roles == ["human", "gpt"] * (len(roles) // 2) and 2 <= len(roles) // 2 <= 3
        for turn in turns:
            assert tokenizer.unk_token_id not in tokenizer(turn["value"], add_special_tokens=False)["input_ids"]
            if turn["from"] == "gpt":
                assert 40 <= len(turn["value"].split()) <= 50
    openai = toy_chat_rows(6, seed=5, form="openai", min_turns=2, max_turns=3, response_words=(40, 50))
    names = {"system": "system", "human": "user", "gpt": "assistant"}
    assert [[(names[t["from"]], t["value"]) for t in r["conversations"]] for r in rows] == [
        [(m["role"], m["content"]) for m in r["messages"]] for r in openai
    ]
    with pytest.raises(ValueError, match="form"):
        toy_chat_rows(1, seed=0, form="alpaca")


def test_default_words_are_distinct_and_about_two_hundred():
    assert len(DEFAULT_WORDS) == len(set(DEFAULT_WORDS)) and 150 <= len(DEFAULT_WORDS) <= 250
    with pytest.raises(ValueError, match="head_dim"):
        make_toy_target("/nonexistent", head_dim=16)
