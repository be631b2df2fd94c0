"""The demo world: deterministic sources, an off-policy corpus the ingester accepts, a target that learns."""

import math

import numpy as np
import pytest
import torch

from pipeline.cache_build.corpus import CorpusConfig, ingest_corpus
from pipeline.demo.world import (
    PROMPT_GROUPS,
    WorldConfig,
    corpus_rows,
    make_conversation,
    make_sources,
    mix_chains,
    prompt_rows,
    random_chain,
    target_loss,
    tokenize_conversations,
    train_target,
    write_jsonl,
)
from pipeline.demo.toy import make_toy_tokenizer

SMALL = dict(num_words=32, num_corpus_rows=24, prompts_per_group=3, response_words=(32, 48))  # >= 2 * 16 supervised


def test_world_text_is_deterministic_in_the_seed():
    config = WorldConfig(seed=3, **SMALL)
    (a1, b1), (a2, b2) = make_sources(config), make_sources(config)
    for x, y in ((a1, a2), (b1, b2)):
        assert np.array_equal(x.successors, y.successors) and np.array_equal(x.probs, y.probs)
    assert corpus_rows(config, b1) == corpus_rows(config, b2)
    assert prompt_rows(config, a1) == prompt_rows(config, a2)
    other = WorldConfig(seed=4, **SMALL)
    assert corpus_rows(other, make_sources(other)[1]) != corpus_rows(config, b1)


def test_chain_modes_form_one_cycle_and_rows_are_distributions():
    chain = random_chain(20, num_successors=4, top_prob_range=(0.6, 0.7), rng=np.random.default_rng(0))
    assert np.allclose(chain.probs.sum(-1), 1.0)
    assert np.all((chain.probs[:, 0] >= 0.6) & (chain.probs[:, 0] <= 0.7))
    # Greedy text visits every word once before it repeats.
    mode, word, seen = chain.mode(), 0, []
    for _ in range(20):
        word = int(mode[word])
        seen.append(word)
    assert sorted(seen) == list(range(20)) and seen[-1] == 0


def test_mix_is_the_weighted_sum_of_the_dense_tables():
    rng = np.random.default_rng(1)
    a, c = (random_chain(12, num_successors=3, top_prob_range=(0.5, 0.9), rng=rng) for _ in range(2))
    mixed = mix_chains(a, c, weight=0.3)
    assert np.allclose(mixed.dense(), 0.3 * a.dense() + 0.7 * c.dense())


def test_source_b_differs_from_source_a():
    config = WorldConfig(seed=0, **SMALL)
    source_a, source_b = make_sources(config)
    shared_modes = (source_a.mode() == source_b.mode()).mean()
    assert 0.2 < shared_modes < 0.8  # related but different writers
    assert np.abs(source_a.dense() - source_b.dense()).sum(-1).min() > 0.3  # every row differs
    rng = np.random.default_rng(5)
    ll_a = np.mean([source_a.log_likelihood(source_a.sample(start=s, num_words=50, rng=rng), start=s) for s in range(32)])
    ll_b = np.mean([source_a.log_likelihood(source_b.sample(start=s, num_words=50, rng=rng), start=s) for s in range(32)])
    assert math.isfinite(ll_a) and ll_a > -1.2  # source A is predictable
    assert ll_b < ll_a - 1.0 or ll_b == -math.inf  # B's text is unlikely under A


def test_corpus_and_prompts_are_valid_inputs(tmp_path):
    config = WorldConfig(seed=1, two_turn_frac=0.5, **SMALL)
    source_a, source_b = make_sources(config)
    tokenizer = make_toy_tokenizer(config.words)
    path = tmp_path / "corpus.jsonl"
    write_jsonl(path, corpus_rows(config, source_b))
    corpus = ingest_corpus(CorpusConfig(path=str(path)), tokenizer, progress=False)
    assert corpus.stats["dropped"] == {} and len(corpus) == config.num_corpus_rows
    assert corpus.stats["truncated"] == 0
    unk = tokenizer.convert_tokens_to_ids("<unk>")
    assert not np.any(corpus.input_ids == unk)  # every word is in the vocabulary

    from pipeline.eval.evaluate import load_prompts

    prompts_path = tmp_path / "prompts.jsonl"
    write_jsonl(prompts_path, prompt_rows(config, source_a))
    prompts = load_prompts(prompts_path, tokenizer)
    assert [p.benchmark for p in prompts] == [g for g in PROMPT_GROUPS for _ in range(config.prompts_per_group)]
    # Every prompt ends in the generation prompt, after a user turn.
    assert all(tokenizer.convert_ids_to_tokens(p.input_ids[-3:]) == ["assistant", "<think>", "</think>"] for p in prompts)


def test_a_few_target_steps_lower_the_loss_on_source_a(tmp_path):
    from transformers import AutoModelForCausalLM

    from pipeline.demo.toy import make_toy_target

    config = WorldConfig(seed=0, num_words=24, response_words=(20, 30), target_batch_size=8, target_lr=1e-2, target_threads=1)
    source_a, _ = make_sources(config)
    make_toy_target(tmp_path / "t", words=config.words, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, intermediate_size=128, seed=0)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "t", dtype=torch.float32)
    tokenizer = make_toy_tokenizer(config.words)
    rng = np.random.default_rng(99)
    held_out = tokenize_conversations(
        tokenizer, [make_conversation(source_a, config.words, rng, num_turns=1, response_words=(20, 30)) for _ in range(16)]
    )
    with torch.no_grad():
        before = float(target_loss(model.eval(), held_out))
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a second thread slows these small matmuls down on a busy 2-core machine
    try:
        losses = train_target(model, tokenizer, source_a, config, steps=40)
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        after = float(target_loss(model, held_out))
    assert before > math.log(config.num_words)  # an untrained target knows nothing
    assert after < 0.6 * before, (before, after)
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
