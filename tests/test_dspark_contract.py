"""The DSpark export's contract for every reader (docs/dspark.md, "Which reader reads what"): the
layout flags written and read back, a speculators-layout config refused; the Markov head types of
DeepSpec (gated, rnn) against a plain reference of its math; what no engine could serve refused in
one line; the taps' rules; the confidence head in float32 whatever --save-dtype; the target's
embedding and head in the export on request; and the confidence head's Sequential Temperature
Scaling fitted on the cache's evaluation split at the end of a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from drafter.calibration import CALIBRATION_FILE, expected_calibration_error, fit_sts, survival
from drafter.checkpoint import load_drafter, read_drafter_config, save_drafter
from drafter.config import check_taps
from drafter.dspark import DSparkOptions, resolve_dspark_options
from drafter.dspark_model import DSparkConfig, DSparkDrafter, dspark_draft
from tests.conftest import write_jsonl
from tests.test_dspark import _config


def _hf(**overrides) -> dict:
    return {**_config().to_hf_dict(), **overrides}


# ----------------------------------------------------------------------------------------------
# The layout, the taps, what no engine serves


def test_the_export_names_the_layout_as_every_reader_does_and_a_speculators_layout_is_refused(tmp_path):
    save_drafter(DSparkDrafter(_config()), tmp_path / "d", dtype=torch.float32)
    hf = json.loads((tmp_path / "d" / "config.json").read_text())
    assert hf["sample_from_anchor"] is True and hf["dspark_bonus_anchor"] is False  # vLLM, llama.cpp; vLLM's converter's name
    assert "sts_temperatures" not in hf  # uncalibrated
    assert read_drafter_config(tmp_path / "d")[1] == _config(dtype="float32")
    for key, value in (("sample_from_anchor", False), ("dspark_bonus_anchor", True), ("speculators_model_type", "dspark")):
        with pytest.raises(ValueError, match=rf"^config.json has {key} .*: the speculators layout \(slot k predicts x\[p \+ k\]"):
            DSparkConfig.from_hf_dict(_hf(**{key: value}))
    bare = {k: v for k, v in _hf().items() if k not in ("sample_from_anchor", "dspark_bonus_anchor")}
    assert DSparkConfig.from_hf_dict(bare) == _config()  # DeepSpec's checkpoints name no layout: theirs is DSpark's


def test_taps_must_increase_and_leave_the_last_layer_alone_at_build_and_export():
    check_taps([0, 2], num_target_layers=4, what="--layers")
    with pytest.raises(ValueError, match=r"^--layers \[2, 0\] must be strictly increasing$"):
        check_taps([2, 0], num_target_layers=4, what="--layers")
    with pytest.raises(ValueError, match=r"^target_layer_ids \[0, 3\] include the target's last layer 3"):
        _config(target_layer_ids=[0, 3])
    with pytest.raises(ValueError, match=r"strictly increasing"):
        _config(target_layer_ids=[2, 0])


def test_the_cache_build_refuses_taps_out_of_order(toy_target, toy_corpus, tmp_path):
    from pipeline.cache_build.config import CacheBuildConfig
    from pipeline.cache_build.plan import resolve_layer_ids

    config = CacheBuildConfig.from_flags(target=str(toy_target), corpus=str(toy_corpus), out=str(tmp_path / "c"), layers=[2, 0])
    with pytest.raises(ValueError, match=r"^--layers \[2, 0\] must be strictly increasing$"):
        resolve_layer_ids(config, num_target_layers=4)
    assert resolve_layer_ids(CacheBuildConfig.from_flags(target=str(toy_target), corpus=str(toy_corpus), out=str(tmp_path / "c"),
                                                         layers=[0, 2]), num_target_layers=4) == [0, 2]  # fmt: skip


def test_what_no_engine_serves_as_dspark_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^--markov-rank 0: a DSpark drafter without a Markov head cannot be served as DSpark"):
        DSparkOptions(markov_rank=0)
    with pytest.raises(ValueError, match=r"^--markov-head-type must be one of vanilla, gated, rnn"):
        DSparkOptions(markov_head_type="lstm")
    no_markov = _config(markov_rank=0, enable_confidence_head=False, confidence_head_with_markov=False)
    with pytest.raises(ValueError, match=r"^--drafter-init I has no Markov head \(markov_rank 0\): no engine serves it"):
        resolve_dspark_options(DSparkOptions(), num_slots=7, vocab_size=50, init=("I", no_markov))
    narrow = _config(confidence_head_with_markov=False)
    with pytest.raises(ValueError, match=r"^--drafter-init I has a confidence head without the Markov input .* llama.cpp cannot load"):
        resolve_dspark_options(DSparkOptions(), num_slots=7, vocab_size=50, init=("I", narrow))
    gated = _config(markov_head_type="gated")
    resolved = resolve_dspark_options(DSparkOptions(), num_slots=7, vocab_size=50, init=("I", gated))
    assert resolved.markov_head_type == "gated" and resolved.export_head is False
    with pytest.raises(ValueError, match=r"--markov-head-type rnn \(the init has gated\); drop the flag"):
        resolve_dspark_options(DSparkOptions(markov_head_type="rnn"), num_slots=7, vocab_size=50, init=("I", gated))


# ----------------------------------------------------------------------------------------------
# DeepSpec's gated and rnn Markov heads


def _reference_biases(drafter: DSparkDrafter, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """DeepSpec's `markov_head.py` math in plain torch, slot by slot: biases [N, B, V]."""
    head, kind = drafter.markov_head, drafter.config.markov_head_type
    state = torch.zeros(prev.shape[0], drafter.config.markov_rank)
    biases = []
    for k in range(prev.shape[1]):
        e = head.markov_w1.weight[prev[:, k]]
        if kind == "gated":
            gate = torch.sigmoid(torch.cat([hidden[:, k], e], -1) @ head.gate_proj.weight.T + head.gate_proj.bias)
            z = gate * e
        else:
            g, c, o = (torch.cat([state, e, hidden[:, k]], -1) @ head.joint_proj.weight.T + head.joint_proj.bias).chunk(3, -1)
            state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
            z = torch.tanh(o)
        biases.append(z @ head.markov_w2.weight.T)
    return torch.stack(biases, 1)


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_gated_and_rnn_heads_draft_train_and_round_trip_as_deepspec_computes_them(kind, tmp_path):
    torch.manual_seed(0)
    drafter = DSparkDrafter(_config(markov_head_type=kind)).eval()
    with torch.no_grad():
        for p in drafter.markov_head.parameters():
            p.normal_(0, 0.5)  # heads far from their init, so every term counts
    hidden, base, anchors = torch.randn(3, 4, 64), torch.randn(3, 4, 50), torch.tensor([1, 2, 3])
    tokens, logits, _, _ = dspark_draft(drafter, base_logits=base, hidden=hidden, anchor_tokens=anchors)
    prev = torch.cat([anchors[:, None], tokens[:, :-1]], 1)  # each slot's input: the anchor, then the drafter's own token
    with torch.no_grad():
        reference = _reference_biases(drafter, prev, hidden)
        torch.testing.assert_close(logits - base, reference, rtol=1e-5, atol=1e-5)
        # Training reads the same latents teacher-forced, whole blocks at once.
        trained = drafter.markov_head.markov_w2(drafter.block_markov_latents(prev, hidden))
        torch.testing.assert_close(trained, reference, rtol=1e-5, atol=1e-5)
    names = {"gated": {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"},
             "rnn": {"markov_head.joint_proj.weight", "markov_head.joint_proj.bias"}}[kind]  # fmt: skip
    save_drafter(drafter, tmp_path / kind, dtype=torch.float32)
    assert json.loads((tmp_path / kind / "config.json").read_text())["markov_head_type"] == kind
    loaded = load_drafter(tmp_path / kind)
    assert names <= set(loaded.state_dict()) and loaded.config.markov_head_type == kind
    assert torch.equal(dspark_draft(loaded, base_logits=base, hidden=hidden, anchor_tokens=anchors)[0], tokens)


# ----------------------------------------------------------------------------------------------
# The export's dtypes and the target's head


def test_the_confidence_head_stays_float32_in_a_bf16_export_and_the_head_is_written_on_request(tmp_path):
    torch.manual_seed(0)
    drafter = DSparkDrafter(_config())
    head = {"embed_tokens.weight": torch.randn(50, 64), "lm_head.weight": torch.randn(50, 64)}
    save_drafter(drafter, tmp_path / "d", dtype=torch.bfloat16, head=head)
    with safe_open(tmp_path / "d" / "model.safetensors", framework="pt") as f:
        dtypes = {name: f.get_tensor(name).dtype for name in f.keys()}
        assert torch.equal(f.get_tensor("lm_head.weight"), head["lm_head.weight"].bfloat16())
    assert {n for n, d in dtypes.items() if d == torch.float32} == {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    assert set(dtypes) == set(drafter.state_dict()) | set(head)
    loaded = load_drafter(tmp_path / "d")  # the head is skipped, the confidence head loads in float32
    assert loaded.confidence_head.proj.weight.dtype == torch.float32 and loaded.fc.weight.dtype == torch.bfloat16
    torch.testing.assert_close(loaded.confidence_head.proj.weight, drafter.confidence_head.proj.weight, rtol=0, atol=0)
    hidden = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    _, _, confidence, _ = dspark_draft(loaded, base_logits=torch.randn(2, 4, 50), hidden=hidden, anchor_tokens=torch.tensor([1, 2]))
    assert confidence.dtype == torch.float32 and confidence.shape == (2, 4)
    with pytest.raises(ValueError, match=r"^save_drafter: head tensor 'model.norm.weight' is none of"):
        save_drafter(drafter, tmp_path / "e", head={"model.norm.weight": torch.ones(64)})


# ----------------------------------------------------------------------------------------------
# Sequential Temperature Scaling


def test_ece_and_the_sts_fit_on_hand_made_rounds():
    # Two bins' worth: predictions 0.9 (observed 1 of 2) and 0.1 (observed 0 of 2): ECE = 0.5 * 0.4 + 0.5 * 0.1.
    assert expected_calibration_error(torch.tensor([0.9, 0.9, 0.1, 0.1]), torch.tensor([1.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)
    # An overconfident head: logits 3 (sigmoid 0.95) where slot k is accepted with chance 0.7 given the
    # slots before it were; the fit cools every slot and its survival's ECE falls.
    generator = torch.Generator().manual_seed(0)
    num_rounds, num_slots = 4000, 4
    accepted_each = torch.rand(num_rounds, num_slots, generator=generator) < 0.7
    prefix = accepted_each.long().cumprod(dim=1).double()  # [R, D] slots 0..k all accepted
    logits = 3.0 + 0.3 * torch.randn(num_rounds, num_slots, generator=generator)
    fit = fit_sts(logits, prefix)
    assert all(t > 1 for t in fit["temperatures"]) and len(fit["temperatures"]) == num_slots
    assert all(after < before / 3 for before, after in zip(fit["ece_before"], fit["ece_after"]))
    calibrated = survival(logits, fit["temperatures"]).mean(dim=0)
    torch.testing.assert_close(calibrated, prefix.mean(dim=0), atol=0.03, rtol=0)
    with pytest.raises(ValueError, match=r"one \[N >= 1, D\] shape"):
        fit_sts(logits[:0], prefix[:0])


# ----------------------------------------------------------------------------------------------
# End to end: a run on a cache with an evaluation split

PROMPTS = [
    {"benchmark": "alpha", "prompt": "tell me a story about the river ."},
    {"benchmark": "alpha", "prompt": "what is the name of the city ?"},
    {"benchmark": "beta", "prompt": "write about the house , the door and the light ."},
    {"benchmark": "beta", "prompt": "say something about the light and the river ."},
]


@pytest.fixture(scope="module")
def split_cache(ray_address, toy_target, toy_corpus, tmp_path_factory) -> Path:
    from pipeline.cache_build.config import CacheBuildConfig
    from ray_jobs.build import build_cache

    root = tmp_path_factory.mktemp("dspark-split")
    cache = root / "cache"
    build_cache(CacheBuildConfig.from_flags(
        target=str(toy_target), corpus=str(toy_corpus), out=str(cache), layers=[0, 2], anchors=16, top_k=4, max_length=128,
        shard_size=10, num_slots=7, eval_prompts=str(write_jsonl(root / "held_out.jsonl", PROMPTS)), eval_max_new_tokens=48,
    ), progress=False, log=lambda m: None)  # fmt: skip
    return cache


def _train(cache: Path, out: Path, **overrides) -> dict:
    from pipeline.train.config import TrainConfig
    from pipeline.train.loop import train

    flags = dict(cache=str(cache), out=str(out), arch="dspark", method="alr", epochs=1, batch_size=2, num_workers=0, progress=False,
                 log_every=100, lr=3e-3, save_dtype="bfloat16", dspark_block=5)  # fmt: skip
    return train(TrainConfig.from_flags(**{**flags, **overrides}))


def test_an_rnn_run_exports_the_head_a_float32_confidence_head_and_its_calibration(split_cache, tmp_path, capsys):
    summary = _train(split_cache, tmp_path / "rnn", markov_head_type="rnn", export_head=True)
    warning = "warning: markov_head_type rnn: vLLM (qwen3_dspark.py) and llama.cpp (conversion/qwen.py) serve only vanilla"
    assert warning in capsys.readouterr().out
    drafter = tmp_path / "rnn" / "drafter"
    hf = json.loads((drafter / "config.json").read_text())
    assert hf["markov_head_type"] == "rnn" and hf["sample_from_anchor"] is True
    target_head = split_cache / "target_head.safetensors"
    with safe_open(drafter / "model.safetensors", framework="pt") as f, safe_open(target_head, framework="pt") as t:
        assert torch.equal(f.get_tensor("embed_tokens.weight"), t.get_tensor("embed_tokens.weight").bfloat16())
        assert torch.equal(f.get_tensor("lm_head.weight"), t.get_tensor("lm_head.weight").bfloat16())
        assert f.get_tensor("confidence_head.proj.weight").dtype == torch.float32 and f.get_tensor("fc.weight").dtype == torch.bfloat16
    # The calibration: fitted on the split's rounds, in config.json and in TensorRT-LLM's / SGLang's file, in summary.json.
    calibration = summary["calibration"]
    assert calibration["num_samples"] > 10 and len(calibration["temperatures"]) == 5
    assert calibration["ece_after_mean"] <= calibration["ece_before_mean"]
    assert hf["sts_temperatures"] == calibration["temperatures"]
    payload = json.loads((drafter / CALIBRATION_FILE).read_text())
    assert payload["sts_temperatures"] == payload["temperatures"] == calibration["temperatures"]
    assert payload["ece_before"] == calibration["ece_before"] and payload["num_samples"] == calibration["num_samples"]
    assert json.loads((tmp_path / "rnn" / "summary.json").read_text())["calibration"] == calibration
    loaded = load_drafter(drafter)
    assert loaded.config.sts_temperatures == calibration["temperatures"] and loaded.config.markov_head_type == "rnn"
    # A DSpark init keeps its head type; a run from it with another is refused naming both.
    with pytest.raises(ValueError, match=r"--markov-head-type gated \(the init has rnn\); drop the flag"):
        _train(split_cache, tmp_path / "again", drafter_init=str(drafter), markov_head_type="gated")
    assert not (tmp_path / "again" / "train_config.json").exists()


def test_a_gated_run_trains_reloads_and_shares_the_targets_head_by_default(split_cache, tmp_path):
    summary = _train(split_cache, tmp_path / "gated", markov_head_type="gated", max_steps=4)
    loaded = load_drafter(tmp_path / "gated" / "drafter")
    assert loaded.config.markov_head_type == "gated" and "markov_head.gate_proj.weight" in loaded.state_dict()
    assert summary["steps"] == 4
    with safe_open(tmp_path / "gated" / "drafter" / "model.safetensors", framework="pt") as f:
        assert "embed_tokens.weight" not in f.keys() and "lm_head.weight" not in f.keys()  # shared from the target by default
