"""`--arch dflash2` end to end (docs/dflash2.md): every method trains a DFlash2 drafter from the K = 7
cache (fp32 and bf16, D-PACE), a run resumes exactly and under torchrun equals one process,
`--drafter-init` takes a DFlash2 checkpoint as it is or a DFlash backbone with identity
convolutions and a fresh selector, `alrira-eval run/replay/hard` decode with it losslessly, and its
flags are refused with another --arch."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from drafter.checkpoint import load_drafter
from drafter.dflash2_model import DFlash2Drafter
from drafter.model import DFlashDrafter
from pipeline.train.methods import METHODS
from tests.test_dspark import _eval, _losses, prompts_file  # noqa: F401 (a fixture: the same prompts and evaluation settings)
from tests.test_dspark import _train_config as _dspark_train_config
from tests.test_dspark import trained_from_the_k7_cache
from tests.waits import HANG_CAP_S


def _train_config(cache: Path, out: Path, **overrides):
    """tests/test_dspark.py's small run (2 epochs, batch 2, fp32 export, lr 3e-3) with --arch dflash2."""
    return _dspark_train_config(cache, out, **{"arch": "dflash2", **overrides})


def _strict_json(path: Path) -> dict:
    """JSON as other tools read it: Infinity or NaN refused."""
    return json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"{path} holds {name}"))


# ----------------------------------------------------------------------------------------------
# Training


@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_a_dflash2_drafter_from_the_dflash_cache(k7_cache, tmp_path, method):
    run = tmp_path / method
    record = trained_from_the_k7_cache(k7_cache, run, arch="dflash2", method=method)
    assert len(record["slot_acc"]) == 7  # DFlash's block of K + 1: the cache's 7 labelled slots
    settings = _strict_json(run / "train_config.json")
    assert settings["arch"] == "dflash2" and settings["kl_alpha"] == 1.0 and settings["dflash2_weighting"] == "exp-decay"
    exported = _strict_json(run / "drafter" / "config.json")
    assert exported["architectures"] == ["DFlash2DraftModel"] and exported["auto_map"]["AutoModel"] == "modeling_dflash2.DFlash2DraftModel"
    # The toy target's hidden 64 and vocabulary cap the selector: llama.cpp's K * (K + 1) <= H, a quarter of V.
    assert exported["dflash_config"] | {"target_layer_ids": None} == {
        "mask_token_id": exported["dflash_config"]["mask_token_id"], "target_layer_ids": None, "block_size": 8,
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": min(256, exported["vocab_size"] // 4), "selector_top_k": 7,
    }  # fmt: skip
    # train_config.json records the shape the export has (the top-K unset: its default is capped by H).
    assert (settings["conv_kernel_size"], settings["selector_rank"], settings["selector_top_k"]) == (2, exported["dflash_config"]["selector_rank"], None)
    drafter = load_drafter(run / "drafter")
    assert isinstance(drafter, DFlash2Drafter) and drafter.config.num_drafts == 7
    # The convolutions and the selector trained: no longer the identity / their init.
    assert torch.count_nonzero(drafter.layers[0].attention_conv.kernel_projection.weight) > 0


def test_the_envelope_is_speculators_for_every_method_and_dpace_replaces_it(k7_cache, tmp_path):
    from pipeline.train.loop import train
    from pipeline.train.plan import open_run, plan_training
    from pipeline.train.setup import setup

    def ratios(config) -> torch.Tensor:
        weights = next(setup(plan_training(config, open_run(config))).batches).slot_weights  # [B, N, K]
        both = (weights[..., 0] > 0) & (weights[..., 1] > 0)
        return weights[..., 1][both] / weights[..., 0][both]

    # kd's other factors are 1 on in-sequence slots: slot 2's weight is slot 1's times exp(-1 / 4).
    decay = ratios(_train_config(k7_cache, tmp_path / "decay", method="kd"))
    assert decay.numel() and torch.allclose(decay, torch.full_like(decay, torch.e ** (-1 / 4)), rtol=1e-5)
    config = _train_config(k7_cache, tmp_path / "dpace", method="kd", dflash2_weighting="dpace", tv_alpha=0.5, epochs=3)
    flat = ratios(config)
    assert flat.numel() and torch.equal(flat, torch.ones_like(flat))  # D-PACE weighs the slots itself
    train(config)
    losses = _losses(tmp_path / "dpace")
    assert losses[-1] < losses[0]
    assert _strict_json(tmp_path / "dpace" / "train_config.json")["dflash2_weighting"] == "dpace"


def test_bf16_training_stays_close_to_fp32(k7_cache, tmp_path):
    from pipeline.train.loop import train

    runs = {}
    for precision in ("fp32", "bf16"):
        train(_train_config(k7_cache, tmp_path / precision, method="alr_ira", max_steps=4, precision=precision))
        runs[precision] = _losses(tmp_path / precision)
    assert runs["bf16"] == pytest.approx(runs["fp32"], rel=2e-2)
    assert runs["bf16"] != runs["fp32"]  # bf16 really ran


def test_resume_continues_exactly(k7_cache, tmp_path):
    from pipeline.train.loop import train

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(_train_config(k7_cache, straight, method="alr_ira", dflash2_weighting="dpace"))
    per_epoch = len(_losses(straight)) // 2
    train(_train_config(k7_cache, resumed, method="alr_ira", dflash2_weighting="dpace", max_steps=per_epoch))
    train(_train_config(k7_cache, resumed, method="alr_ira", dflash2_weighting="dpace", resume=True))
    assert _losses(resumed) == _losses(straight)
    a, b = load_drafter(straight / "drafter").state_dict(), load_drafter(resumed / "drafter").state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match=r"--selector-alpha was 1.0, now 0.5"):  # the loss is part of what a resume must match
        train(_train_config(k7_cache, resumed, method="alr_ira", dflash2_weighting="dpace", selector_alpha=0.5, resume=True, epochs=3))


def test_two_rank_ddp_equals_single_process(k7_cache, tmp_path):
    from pipeline.train.loop import train

    single = tmp_path / "single"
    train(_train_config(k7_cache, single, method="alr_ira", epochs=1, batch_size=4))
    ddp = tmp_path / "ddp"
    args = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29537",
        "-m", "pipeline.train", "--cache", str(k7_cache), "--out", str(ddp), "--arch", "dflash2", "--method", "alr_ira",
        "--epochs", "1", "--batch-size", "4", "--num-workers", "0", "--no-progress", "--save-dtype", "float32",
        "--log-every", "1", "--lr", "3e-3",
    ]  # fmt: skip
    result = subprocess.run(args, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=HANG_CAP_S)
    assert result.returncode == 0, result.stderr[-3000:]
    for x, y in zip(_losses(single), _losses(ddp), strict=True):
        assert abs(x - y) <= 1e-5 * abs(x)
    a, b = load_drafter(single / "drafter").state_dict(), load_drafter(ddp / "drafter").state_dict()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-4)


def test_its_shape_flags_are_refused_with_another_arch(k7_cache, tmp_path):
    """Its shape flags name a drafter another --arch cannot have: refused (pipeline/train/config.py);
    its loss weights are recorded and never read there, as DSpark's are. Out of bounds for the
    cache or the target, a shape flag is refused in one line naming it."""
    from click.testing import CliRunner

    from pipeline.cli import train_cli
    from pipeline.train.loop import train

    with pytest.raises(ValueError, match=r"--selector-rank: settings of --arch dflash2, not of --arch dflash"):
        _train_config(k7_cache, tmp_path / "x", arch="dflash", selector_rank=8)
    with pytest.raises(ValueError, match=r"--conv-kernel-size and --conv-group-size: settings of --arch dflash2, not of --arch dspark"):
        _train_config(k7_cache, tmp_path / "x", arch="dspark", conv_kernel_size=3, conv_group_size=8)
    result = CliRunner().invoke(train_cli, ["--cache", str(k7_cache), "--out", str(tmp_path / "y"), "--selector-top-k", "4"])
    assert result.exit_code != 0 and "--selector-top-k" in result.output and "--arch dflash2" in result.output
    other = _train_config(k7_cache, tmp_path / "z", arch="dflash", tv_alpha=0.5)
    assert other.families.dflash2.tv_alpha == 0.5 and other.family_options() is None  # recorded, not DFlash's

    with pytest.raises(ValueError, match=r"--selector-top-k 100000 is larger than the vocabulary"):
        train(_train_config(k7_cache, tmp_path / "big", selector_top_k=100_000))
    with pytest.raises(ValueError, match=r"--conv-group-size 24 must divide the hidden size 64"):
        train(_train_config(k7_cache, tmp_path / "group", conv_group_size=24))


# ----------------------------------------------------------------------------------------------
# --drafter-init


def test_a_dflash_backbone_starts_a_dflash2_run_and_a_dflash2_checkpoint_trains_as_it_is(k7_cache, tmp_path):
    from pipeline.train.loop import train
    from tests.conftest import train_alr_drafter
    from tests.test_dflash2 import _inputs

    dflash = train_alr_drafter(k7_cache, tmp_path / "dflash", epochs=1)
    train(_train_config(k7_cache, tmp_path / "dflash2", drafter_init=str(dflash), max_steps=1, lr=1e-9))
    before, started = load_drafter(dflash, dtype=torch.float32), load_drafter(tmp_path / "dflash2" / "drafter", dtype=torch.float32)
    assert type(before) is DFlashDrafter and type(started) is DFlash2Drafter
    # At init the convolutions are the identity: after one step at lr 1e-9 the DFlash2 drafter still
    # computes the DFlash drafter's hidden states.
    inputs = _inputs(started.config, num_context=9, anchors=[3, 7])
    with torch.no_grad():
        torch.testing.assert_close(started(**inputs), before(**inputs), atol=1e-4, rtol=0)
    assert "candidate_selector.successor_codebook" in started.state_dict()

    # The DFlash2 checkpoint trains on as it is; a shape flag that is not its own is refused.
    train(_train_config(k7_cache, tmp_path / "again", drafter_init=str(tmp_path / "dflash2" / "drafter"), max_steps=1))
    assert load_drafter(tmp_path / "again" / "drafter").config == started.config
    with pytest.raises(ValueError, match=r"is a DFlash2 drafter whose shape is its own: --selector-rank 3 \(the init has \d+\); drop the flag"):
        train(_train_config(k7_cache, tmp_path / "other", drafter_init=str(tmp_path / "dflash2" / "drafter"), selector_rank=3))
    with pytest.raises(ValueError, match="is a DFlash2 drafter: train it with --arch dflash2"):
        train(_train_config(k7_cache, tmp_path / "back", arch="dflash", drafter_init=str(tmp_path / "dflash2" / "drafter")))


# ----------------------------------------------------------------------------------------------
# Evaluation: real speculative decoding, replay and the hard-offset analysis


@pytest.fixture(scope="module")
def dflash2_drafter(k7_cache, tmp_path_factory) -> Path:
    from pipeline.train.loop import train

    run = tmp_path_factory.mktemp("dflash2-run") / "alr"
    train(_train_config(k7_cache, run, method="alr", epochs=3))
    return run / "drafter"


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_dflash2_decoding_is_lossless_and_replay_equals_it(toy_target, dflash2_drafter, prompts_file, tmp_path):
    from pipeline.eval.replay import run_replay

    greedy = _eval(toy_target, dflash2_drafter, prompts_file, tmp_path / "t0")
    assert greedy["arch"] == "dflash2" and greedy["num_drafts"] == 7 and greedy["block_size"] == 8
    assert greedy["lossless_mismatches"] == 0 and greedy["lossless_exact"]
    assert greedy["tau_pooled"] > 1.0  # the trained drafter gets some drafts accepted
    replayed = run_replay(target=str(toy_target), drafters={"d": str(dflash2_drafter)}, prompts=str(prompts_file),
                          out=str(tmp_path / "replay"), max_new_tokens=24)["d"]  # fmt: skip
    assert replayed["tau_pooled"] == pytest.approx(greedy["tau_pooled"], abs=1e-12)
    assert _rows(tmp_path / "replay" / "d" / "rounds.csv") == _rows(tmp_path / "t0" / "rounds.csv")
    sampled = _eval(toy_target, dflash2_drafter, prompts_file, tmp_path / "t1", temperature=1.0)
    assert sampled["lossless_mismatches"] is None and sampled["rounds"] > 0
    with pytest.raises(ValueError, match="is a DFlash2 drafter, whose slots are not drafted independently"):
        _eval(toy_target, dflash2_drafter, prompts_file, tmp_path / "tree", tree_budget=8)


def test_hard_offsets_take_a_dflash2_drafter(toy_target, dflash2_drafter, k7_cache, prompts_file, tmp_path):
    from pipeline.eval.analysis import hard_offsets
    from tests.conftest import train_alr_drafter

    dflash = train_alr_drafter(k7_cache, tmp_path / "dflash", epochs=1)
    raw = hard_offsets(target_dir=str(toy_target), prompts=str(prompts_file), max_new_tokens=24, max_prompts=None,
                       drafters={"independent": str(dflash), "drafter": str(dflash2_drafter), "baseline": str(dflash)})  # fmt: skip
    assert raw and all(0 <= row["drafter"] <= 7 for row in raw)
    assert any(row["drafter"] > 0 for row in raw)

