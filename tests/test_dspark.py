"""DSpark drafters (docs/dspark.md): the heads and the loss on hand-computed tensors, labels laid out
from a DFlash cache (previous tokens on each track), the checkpoint contract, every method training
from the same cache, and lossless speculative decoding with the Markov head run slot by slot."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from drafter.checkpoint import load_drafter, save_drafter
from drafter.dspark_model import DSparkConfig, DSparkDrafter, default_markov_rank, dspark_draft
from pipeline.train.labels import ObjectiveConfig, build_block_targets
from pipeline.train.methods import METHODS
from drafter.dspark import dspark_slot_losses
from drafter.losses import topk_tail_l1, topk_tail_slot_losses


def _config(**overrides) -> DSparkConfig:
    base = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=50, max_position_embeddings=256, num_target_layers=4, target_layer_ids=[0, 2],
        mask_token_id=49, block_size=4, markov_rank=8,
    )  # fmt: skip
    return DSparkConfig(**{**base, **overrides})


# ----------------------------------------------------------------------------------------------
# The loss, on tensors


def test_topk_tail_l1_is_exact_when_the_topk_covers_the_vocabulary_and_a_lower_bound_otherwise():
    torch.manual_seed(0)
    q = torch.softmax(torch.randn(5, 12), dim=-1)
    p = torch.softmax(torch.randn(5, 12), dim=-1)
    exact = (q - p).abs().sum(-1)
    ids = p.argsort(dim=-1, descending=True)
    full = topk_tail_l1(draft_probs=q, dist_ids=ids, dist_probs=p.gather(-1, ids))
    torch.testing.assert_close(full, exact)
    top3 = topk_tail_l1(draft_probs=q, dist_ids=ids[:, :3], dist_probs=p.gather(-1, ids[:, :3]))
    assert torch.all(top3 <= exact + 1e-6) and torch.any(top3 < exact - 1e-3)
    # Hand-computed: V = 3, p = (0.5, 0.3, 0.2) known as top-1 (0.5) + tail 0.5, q = (0.2, 0.2, 0.6):
    # |0.2 - 0.5| + |0.8 - 0.5| = 0.6, below the true 0.3 + 0.1 + 0.4 = 0.8.
    bound = topk_tail_l1(draft_probs=torch.tensor([[0.2, 0.2, 0.6]]), dist_ids=torch.tensor([[0]]), dist_probs=torch.tensor([[0.5]]))
    torch.testing.assert_close(bound, torch.tensor([0.6]))


def test_dspark_slot_loss_is_deepspec_sum_of_terms():
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0]])
    label_ids = torch.tensor([[0], [2]])
    label_probs = torch.ones(2, 1)
    dist_ids = torch.tensor([[0, 1, 2], [1, 0, 2]])
    dist_probs = torch.tensor([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1]])
    confidence = torch.tensor([0.5, -1.0])
    loss, target = dspark_slot_losses(
        draft_logits=logits, confidence_logits=confidence, label_ids=label_ids, label_probs=label_probs,
        dist_ids=dist_ids, dist_probs=dist_probs, ce_alpha=0.1, l1_alpha=0.9, confidence_alpha=1.0,
    )  # fmt: skip
    q = logits.softmax(-1)
    p = torch.zeros(2, 3).scatter(1, dist_ids, dist_probs)
    ce = -q.log()[torch.arange(2), label_ids[:, 0]]
    l1 = (q - p).abs().sum(-1)
    overlap = torch.minimum(q, p).sum(-1)
    torch.testing.assert_close(target, overlap)
    bce = F.binary_cross_entropy_with_logits(confidence, overlap, reduction="none")
    torch.testing.assert_close(loss, 0.1 * ce + 0.9 * l1 + bce)
    # The T = 0 target: argmax q (0, then 1) against p's top token (0, then 1).
    _, greedy = dspark_slot_losses(
        draft_logits=logits, confidence_logits=None, label_ids=label_ids, label_probs=label_probs, dist_ids=dist_ids,
        dist_probs=dist_probs, ce_alpha=0.1, l1_alpha=0.9, confidence_alpha=1.0, confidence_target="greedy",
    )  # fmt: skip
    torch.testing.assert_close(greedy, torch.tensor([1.0, 1.0]))
    # The CE term is the method's label loss: a distribution label is the top-k + tail loss.
    soft = topk_tail_slot_losses(draft_logits=logits, label_ids=dist_ids, label_probs=dist_probs)
    torch.testing.assert_close(soft, -(p * q.log()).sum(-1))


# ----------------------------------------------------------------------------------------------
# Labels from a DFlash cache's record


def _record(num_slots: int = 5):
    torch.manual_seed(0)
    seq_len, num_pool, top_k = 20, 4, 3
    input_ids = torch.arange(100, 100 + seq_len)
    topk_ids = torch.randint(0, 50, (seq_len, top_k))
    topk_ids[:, 0] = torch.roll(input_ids, -1)  # the corpus pass predicts the corpus token
    anchor_pos = torch.tensor([2, 5, 8, 11])
    rollout_tokens = torch.arange(num_pool * (num_slots + 1)).reshape(num_pool, num_slots + 1) + 1000
    rollout_tokens[:, 0] = input_ids[anchor_pos]  # y*[0] is the anchor token
    return {
        "input_ids": input_ids,
        "loss_mask": torch.ones(seq_len, dtype=torch.int32),
        "anchor_pos": anchor_pos,
        "corpus_topk_ids": topk_ids,
        "corpus_topk_probs": torch.full((seq_len, top_k), 0.3),
        "corpus_next_prob": torch.full((seq_len,), 0.9),
        "rollout_tokens": rollout_tokens,
        "rollout_topk_ids": torch.randint(0, 50, (num_pool, num_slots, top_k)),
        "rollout_topk_probs": torch.full((num_pool, num_slots, top_k), 0.25),
    }


def _objective(method: str, *, dspark_block: int | None, num_slots: int = 5) -> ObjectiveConfig:
    """The objective of a DFlash block (dspark_block None) or of a DSpark block of B slots (the DSpark family's layout)."""
    from drafter.dspark import DSPARK, DSparkOptions

    layout = None if dspark_block is None else DSPARK.layout(DSparkOptions(dspark_block=dspark_block), num_slots=num_slots)
    return ObjectiveConfig(method=method).for_cache(num_slots=num_slots, mask_token_id=7, stop_token_ids=[], layout=layout)


@pytest.mark.parametrize("method", METHODS)
def test_dspark_blocks_are_the_first_b_dflash_slots_with_the_previous_token_of_each_track(method):
    record = _record()
    dflash = build_block_targets(record, config=_objective(method, dspark_block=None), generator=torch.Generator().manual_seed(3))
    dspark = build_block_targets(record, config=_objective(method, dspark_block=4), generator=torch.Generator().manual_seed(3))
    assert dspark.block_tokens.shape == (4, 4) and dflash.block_tokens.shape == (4, 6)
    torch.testing.assert_close(dspark.block_tokens, dflash.block_tokens[:, :4])
    torch.testing.assert_close(dspark.label_ids, dflash.label_ids[:, :4])
    torch.testing.assert_close(dspark.prev_tokens, dflash.prev_tokens[:, :4])
    # Every block's slot 0 follows its anchor token (block_tokens[:, 0]).
    torch.testing.assert_close(dspark.prev_tokens[:, 0], dspark.block_tokens[:, 0])
    anchors = record["anchor_pos"]
    if method in ("dflash", "kd", "erase", "erase_hard"):  # corpus track: x[a + k]
        torch.testing.assert_close(dspark.prev_tokens, record["input_ids"][anchors[:, None] + torch.arange(4)])
    elif method != "alr_ira":  # rollout track: y*[k]
        torch.testing.assert_close(dspark.prev_tokens, record["rollout_tokens"][:, :4])
    else:  # a secondary at offset j follows its parent's y*[j + k]
        for block in torch.nonzero(dspark.is_secondary).flatten().tolist():
            tokens = dspark.prev_tokens[block]
            parent_row, j = (record["rollout_tokens"] == tokens[0]).nonzero()[0].tolist()
            expected = record["rollout_tokens"][parent_row, j : j + 4]
            weights = dspark.slot_weights[block]
            assert torch.equal(tokens[: len(expected)][weights[: len(expected)] > 0], expected[weights[: len(expected)] > 0])
    # The envelope is DSpark's exp(-k / 4) whatever the method's own gamma.
    base = _objective(method, dspark_block=4)
    assert base.layout.envelope_gamma == 4.0
    # One-hot labels compare with the corpus pass's distribution; others with the labels themselves.
    if method == "dflash":
        assert dspark.dist_ids is not dspark.label_ids and dspark.dist_ids.shape[-1] == 3
    else:
        assert dspark.dist_ids is dspark.label_ids


def test_dspark_block_larger_than_the_cache_is_refused_naming_k():
    with pytest.raises(ValueError, match=r"block trains 6 label slots; the cache labels K = 5 \(must be in \[1, 5\]\)"):
        _objective("alr", dspark_block=6)


# ----------------------------------------------------------------------------------------------
# The model, drafting and the checkpoint


def test_dspark_draft_runs_the_markov_head_on_its_own_previous_draft():
    torch.manual_seed(0)
    drafter = DSparkDrafter(_config()).eval()
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.mul_(200)  # a strong bigram so the Markov input matters
    hidden = torch.randn(3, 4, 64)
    base = torch.randn(3, 4, 50)
    anchors = torch.tensor([1, 2, 3])
    tokens, logits, confidence, _ = dspark_draft(drafter, base_logits=base, hidden=hidden, anchor_tokens=anchors)
    prev = anchors
    for k in range(4):  # plain reference: one slot at a time
        step = base[:, k] + drafter.markov_head.markov_w2(drafter.markov_head.markov_w1(prev))
        torch.testing.assert_close(logits[:, k], step)
        assert torch.equal(tokens[:, k], step.argmax(-1))
        features = torch.cat([hidden[:, k], drafter.markov_head.markov_w1(prev)], dim=-1)
        torch.testing.assert_close(confidence[:, k], drafter.confidence_head.proj(features)[:, 0].sigmoid())
        prev = step.argmax(-1)
    assert not torch.equal(tokens, base.argmax(-1))  # the head changed some draft


def test_checkpoint_round_trip_in_the_qwen3_dspark_contract(tmp_path):
    torch.manual_seed(0)
    drafter = DSparkDrafter(_config())
    save_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["auto_map"]["AutoModel"] == "modeling_dspark.Qwen3DSparkModel"
    for key, value in dict(block_size=4, mask_token_id=49, target_layer_ids=[0, 2], markov_rank=8, markov_head_type="vanilla",
                           enable_confidence_head=True, confidence_head_with_markov=True, tie_word_embeddings=False).items():  # fmt: skip
        assert config[key] == value, key
    assert "dflash_config" not in config
    loaded = load_drafter(tmp_path / "d", dtype=torch.float32)
    assert isinstance(loaded, DSparkDrafter)
    state = drafter.state_dict()
    assert set(loaded.state_dict()) == set(state) >= {"markov_head.markov_w1.weight", "confidence_head.proj.bias"}
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert {p.name for p in (tmp_path / "d").iterdir()} >= {"modeling_dspark.py", "dspark_model.py", "dflash_model.py", "dflash_config.py"}


def test_markov_rank_default_is_capped_for_tiny_vocabularies():
    assert default_markov_rank(151936) == 256
    assert default_markov_rank(300) == 75
    with pytest.raises(ValueError, match="markov_rank"):
        _config(markov_rank=51)
    with pytest.raises(ValueError, match="confidence_head_with_markov"):
        _config(markov_rank=0)


# ----------------------------------------------------------------------------------------------
# Training from a real cache, every method


def _train_config(cache: Path, out: Path, **overrides):
    from pipeline.train.config import TrainConfig

    base = dict(cache=str(cache), out=str(out), arch="dspark", method="alr", epochs=2, batch_size=2, num_workers=0,
                progress=False, log_every=1, save_dtype="float32", lr=3e-3)  # fmt: skip
    return TrainConfig.from_flags(**{**base, **overrides})


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def trained_from_the_k7_cache(k7_cache: Path, run: Path, **overrides) -> dict:
    """Train 3 epochs of _train_config(**overrides) into `run`; check it learned (the mean loss of the
    last third below the first third's); its last metrics record."""
    from pipeline.train.loop import train

    train(_train_config(k7_cache, run, epochs=3, **overrides))
    losses = _losses(run)
    third = len(losses) // 3
    assert sum(losses[-third:]) / third < sum(losses[:third]) / third
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_a_dspark_drafter_from_the_dflash_cache(k7_cache, tmp_path, method):
    run = tmp_path / method
    record = trained_from_the_k7_cache(k7_cache, run, method=method)
    assert len(record["slot_acc"]) == 7  # B = K by default: the cache's 7 predicted slots
    settings = json.loads((run / "train_config.json").read_text())
    assert settings["arch"] == "dspark" and settings["dspark_block"] == 7 and settings["markov_rank"] >= 1
    drafter = load_drafter(run / "drafter")
    assert isinstance(drafter, DSparkDrafter) and drafter.config.block_size == 7


def test_train_refuses_a_block_larger_than_the_cache_in_one_line(k7_cache, tmp_path):
    from pipeline.train.loop import train

    with pytest.raises(ValueError, match=r"--dspark-block 8 is larger than this cache supports: it labels K = 7"):
        train(_train_config(k7_cache, tmp_path / "big", dspark_block=8))
    assert not (tmp_path / "big" / "train_config.json").exists()


def test_a_dspark_init_keeps_its_heads_and_records_them(k7_cache, tmp_path):
    """A DSpark --drafter-init trains with its own B, Markov rank and confidence head: a flag that
    differs is refused naming both, before --out is written; the run's records and its export agree
    with the init; a --markov-rank above a quarter of the vocabulary is refused."""
    from pipeline.train.loop import train

    train(_train_config(k7_cache, tmp_path / "first", dspark_block=5, markov_rank=4, confidence_head=False, epochs=1))
    init = str(tmp_path / "first" / "drafter")
    for flags, named in (({"markov_rank": 8}, r"--markov-rank 8 \(the init has 4\)"), ({"confidence_head": True}, r"--confidence-head True \(the init has False\)"),
                         ({"dspark_block": 7}, r"--dspark-block 7 \(the init has 5\)")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"--drafter-init {re.escape(init)} is a DSpark drafter whose heads are its own: {named}"):
            train(_train_config(k7_cache, tmp_path / "refused", drafter_init=init, **flags))
        assert not (tmp_path / "refused").exists()
    train(_train_config(k7_cache, tmp_path / "again", drafter_init=init, max_steps=1))
    settings = json.loads((tmp_path / "again" / "train_config.json").read_text())
    provenance = json.loads((tmp_path / "again" / "provenance.json").read_text())["invocations"][0]["config"]
    exported = json.loads((tmp_path / "again" / "drafter" / "config.json").read_text())
    for record in (settings, provenance):
        assert (record["dspark_block"], record["markov_rank"], record["confidence_head"]) == (5, 4, False)
    assert (exported["block_size"], exported["markov_rank"], exported["enable_confidence_head"]) == (5, 4, False)
    vocab_size = exported["vocab_size"]
    with pytest.raises(ValueError, match=rf"--markov-rank {vocab_size // 4 + 1} is more than a quarter of the vocabulary"):
        train(_train_config(k7_cache, tmp_path / "wide", markov_rank=vocab_size // 4 + 1))


def test_a_dflash_checkpoint_starts_the_backbone_of_a_dspark_run(k7_cache, tmp_path):
    from tests.conftest import train_alr_drafter
    from pipeline.train.loop import train

    dflash = train_alr_drafter(k7_cache, tmp_path / "dflash", epochs=1)
    train(_train_config(k7_cache, tmp_path / "dspark", drafter_init=str(dflash), dspark_block=5, max_steps=1, lr=1e-9))
    before, after = load_drafter(dflash).state_dict(), load_drafter(tmp_path / "dspark" / "drafter").state_dict()
    torch.testing.assert_close(after["fc.weight"], before["fc.weight"], atol=1e-6, rtol=0)
    assert "markov_head.markov_w1.weight" in after and "markov_head.markov_w1.weight" not in before
    with pytest.raises(ValueError, match="is a DSpark drafter: train it with --arch dspark"):
        train(_train_config(k7_cache, tmp_path / "back", arch="dflash", drafter_init=str(tmp_path / "dspark" / "drafter")))


# ----------------------------------------------------------------------------------------------
# Evaluation: real speculative decoding and replay

PROMPTS = [
    {"benchmark": "alpha", "prompt": "tell me a story about the river ."},
    {"benchmark": "alpha", "prompt": "what is the name of the city ?"},
    {"benchmark": "beta", "prompt": "write about the house , the door and the light ."},
]


@pytest.fixture(scope="module")
def dspark_drafter(k7_cache, tmp_path_factory) -> Path:
    from pipeline.train.loop import train

    run = tmp_path_factory.mktemp("dspark-run") / "alr"
    train(_train_config(k7_cache, run, method="alr", epochs=3, dspark_block=5))
    return run / "drafter"


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    from tests.conftest import write_jsonl

    return write_jsonl(tmp_path_factory.mktemp("dspark-prompts") / "prompts.jsonl", PROMPTS)


def _eval(toy_target, drafter, prompts, out, **overrides):
    from pipeline.eval.evaluate import EvalConfig, run_eval

    base = dict(target=str(toy_target), drafter=str(drafter), prompts=str(prompts), out=str(out), max_new_tokens=24, device="cpu",
                progress=False, dtype="float32")  # fmt: skip
    return run_eval(EvalConfig(**{**base, **overrides}))


def test_dspark_decoding_is_lossless_and_reports_slots_and_calibration(toy_target, dspark_drafter, prompts_file, tmp_path):
    greedy = _eval(toy_target, dspark_drafter, prompts_file, tmp_path / "t0")
    assert greedy["arch"] == "dspark" and greedy["num_drafts"] == 5 and greedy["block_size"] == 5
    assert greedy["lossless_mismatches"] == 0 and greedy["lossless_exact"]
    slots = greedy["slot_acceptance"]
    assert [s["slot"] for s in slots] == list(range(5)) and slots[0]["reached"] == greedy["rounds"]
    assert all(s["predicted"] is None or 0 <= s["predicted"] <= 1 for s in slots) and slots[0]["predicted"] is not None
    # Every round drafts all B slots without a threshold; tau counts them.
    assert greedy["mean_proposed"] == 5
    assert greedy["tau_geomean"] > 1.0  # the trained drafter gets some drafts accepted
    # At T = 1 the committed tokens are the target's own samples: every round commits accepted + 1.
    sampled = _eval(toy_target, dspark_drafter, prompts_file, tmp_path / "t1", temperature=1.0)
    assert sampled["lossless_mismatches"] is None and sampled["rounds"] > 0


def test_confidence_threshold_cuts_proposals(toy_target, dspark_drafter, prompts_file, tmp_path):
    always = _eval(toy_target, dspark_drafter, prompts_file, tmp_path / "never", confidence_threshold=1.0)
    assert always["mean_proposed"] == 0 and always["tau_geomean"] == 1.0 and always["lossless_mismatches"] == 0
    some = _eval(toy_target, dspark_drafter, prompts_file, tmp_path / "half", confidence_threshold=0.3)
    assert 0 <= some["mean_proposed"] <= 5 and some["lossless_mismatches"] == 0


def test_dspark_replay_equals_real_decoding(toy_target, dspark_drafter, prompts_file, tmp_path):
    import csv

    from pipeline.eval.replay import run_replay

    real = tmp_path / "real"
    _eval(toy_target, dspark_drafter, prompts_file, real)
    run_replay(target=str(toy_target), drafters={"d": str(dspark_drafter)}, prompts=str(prompts_file), out=str(tmp_path / "replay"),
               max_new_tokens=24)  # fmt: skip

    def rows(path):
        with open(path, newline="") as f:
            return list(csv.DictReader(f))

    assert rows(tmp_path / "replay" / "d" / "rounds.csv") == rows(real / "rounds.csv")


# ----------------------------------------------------------------------------------------------
# The export as the servers and HF users load it


@pytest.mark.parametrize("transformers_457", [False, True], ids=["transformers-5", "transformers-4.57"])
def test_automodel_loads_the_dspark_export(tmp_path, transformers_457):
    from drafter.masks import visibility_mask
    from tests.test_export import TRANSFORMERS_457, _load_with_automodel

    if transformers_457 and not TRANSFORMERS_457.is_dir():
        pytest.skip(f"transformers 4.57 not installed at {TRANSFORMERS_457} (.ci/install puts it there)")
    torch.manual_seed(0)
    model = DSparkDrafter(_config()).eval()
    out = tmp_path / "drafter"
    save_drafter(model, out, dtype=torch.float32)
    for name in ("modeling_dspark.py", "dspark_model.py", "dflash_model.py"):
        imports = "".join(line for line in (out / name).read_text().splitlines() if line.startswith(("from ", "import ")))
        assert "drafter" not in imports, name
    num_context, block = 6, 4
    inputs = dict(
        context_features=torch.randn(1, num_context, 128), context_positions=torch.arange(num_context)[None],
        block_embeds=torch.randn(1, block, 64), block_positions=torch.arange(num_context, num_context + block)[None],
        attention_mask=visibility_mask(
            context_positions=torch.arange(num_context)[None], context_owner=torch.full((1, num_context), -1),
            context_valid=torch.ones(1, num_context, dtype=torch.bool), block_corpus_limit=torch.tensor([[num_context]]),
            block_valid=torch.ones(1, 1, dtype=torch.bool), block_size=block,
        ),
    )  # fmt: skip
    torch.save(inputs, tmp_path / "inputs.pt")
    with torch.no_grad():
        expected = model(**inputs)
    info, hidden = _load_with_automodel(out, tmp_path / "inputs.pt", extra_path=TRANSFORMERS_457 if transformers_457 else None)
    assert info["class"] == "Qwen3DSparkModel"
    assert info["missing"] == [] and info["unexpected"] == [] and set(info["keys"]) == set(model.state_dict())
    torch.testing.assert_close(hidden, expected, rtol=0, atol=1e-6)


def test_dspark_drafter_for_a_llama_target(llama_cache, tmp_path):
    """A Llama-family target (SmolLM2's shape): the drafter is Qwen3-style whatever the target, as
    in DeepSpec's contract; it trains from the Llama cache and exports as Qwen3DSparkModel."""
    from pipeline.train.loop import train

    train(_train_config(llama_cache, tmp_path / "run", method="alr", max_steps=2))
    config = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["model_type"] == "qwen3"
    assert isinstance(load_drafter(tmp_path / "run" / "drafter"), DSparkDrafter)
