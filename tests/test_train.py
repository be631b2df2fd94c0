"""Stage 2 on a real cache: every method trains, determinism, resume, DDP equivalence, golden trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from drafter.checkpoint import load_drafter
from pipeline.train.batching import steps_per_epoch
from pipeline.cache_build.config import CacheBuildConfig
from pipeline.train.methods import METHODS
from pipeline.train.config import TrainConfig
from pipeline.train.loop import train
from pipeline.train.step import lr_at
from storage.reader import open_cache
from tests.waits import HANG_CAP_S

GOLDEN = Path(__file__).parent / "golden" / "loss_trace.json"


@pytest.fixture(scope="module")
def cache(ray_address, toy_target, toy_corpus, tmp_path_factory) -> Path:
    from ray_jobs.build import build_cache

    out = tmp_path_factory.mktemp("train-cache") / "cache"
    build_cache(
        CacheBuildConfig.from_flags(
            target=str(toy_target), corpus=str(toy_corpus), out=str(out), layers=[0, 2], anchors=8, top_k=4,
            max_length=128, shard_size=4, workers=2,
        ),  # fmt: skip
        progress=False,
        log=lambda m: None,
    )
    return out


def _config(cache: Path, out: Path, **overrides) -> TrainConfig:
    base = dict(cache=str(cache), out=str(out), method="alr_ira", epochs=1, batch_size=4, num_workers=0, progress=False, log_every=1)
    return TrainConfig.from_flags(**{**base, **overrides})


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_drafter(run / "drafter", dtype=torch.float32).state_dict()


@pytest.mark.parametrize("method", METHODS)
def test_every_method_trains_from_the_same_cache(cache, tmp_path, method):
    run = tmp_path / method
    summary = train(_config(cache, run, method=method, epochs=3, save_dtype="float32"))
    losses = _losses(run)
    assert summary["steps"] == len(losses) >= 3
    # Real learning: the mean loss of the last third is below the first third.
    third = len(losses) // 3
    assert sum(losses[-third:]) / third < sum(losses[:third]) / third
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(record["slot_acc"]) == 15 and record["supervised_slots"] > 0 and record["tokens_per_s"] > 0
    # The exported drafter is a DFlash checkpoint carrying the cache's taps.
    config = json.loads((run / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == [0, 2]
    assert set(_weights(run)) >= {"fc.weight", "hidden_norm.weight", "norm.weight"}


def test_same_seed_same_losses_bit_for_bit_with_any_worker_count(cache, tmp_path):
    a = _losses_of(train, _config(cache, tmp_path / "a", epochs=2, num_workers=0), tmp_path / "a")
    b = _losses_of(train, _config(cache, tmp_path / "b", epochs=2, num_workers=2), tmp_path / "b")
    c = _losses_of(train, _config(cache, tmp_path / "c", epochs=2, num_workers=0, seed=1), tmp_path / "c")
    assert a == b
    assert a != c


def _losses_of(fn, config, run):
    fn(config)
    return _losses(run)


def test_resume_continues_exactly(cache, tmp_path):
    straight = tmp_path / "straight"
    train(_config(cache, straight, epochs=2, save_dtype="float32"))
    resumed = tmp_path / "resumed"
    per_epoch = len(_losses(straight)) // 2
    train(_config(cache, resumed, epochs=2, max_steps=per_epoch, save_dtype="float32"))  # "killed" after epoch 1
    assert (resumed / "checkpoints" / "latest").read_text().strip() == f"step-{per_epoch:08d}"
    train(_config(cache, resumed, epochs=2, resume=True, save_dtype="float32"))
    assert _losses(resumed) == _losses(straight)
    a, b = _weights(straight), _weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_two_rank_ddp_equals_single_process(cache, tmp_path):
    single = tmp_path / "single"
    train(_config(cache, single, epochs=1, save_dtype="float32"))
    ddp = tmp_path / "ddp"
    args = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533",
        "-m", "pipeline.train", "--cache", str(cache), "--out", str(ddp), "--method", "alr_ira", "--epochs", "1",
        "--batch-size", "4", "--num-workers", "0", "--no-progress", "--save-dtype", "float32", "--log-every", "1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=HANG_CAP_S)
    assert result.returncode == 0, result.stderr[-3000:]
    for x, y in zip(_losses(single), _losses(ddp), strict=True):
        assert abs(x - y) <= 1e-5 * abs(x)
    a, b = _weights(single), _weights(ddp)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-4)


def test_activation_checkpointing_trains_the_same(cache, tmp_path):
    """--activation-checkpointing changes memory, not the math: the same losses step by step."""
    plain = _losses_of(train, _config(cache, tmp_path / "plain", epochs=2), tmp_path / "plain")
    recomputed = _losses_of(train, _config(cache, tmp_path / "ckpt", epochs=2, activation_checkpointing=True), tmp_path / "ckpt")
    assert len(plain) == 4
    assert recomputed == pytest.approx(plain, rel=1e-5)


def test_refuses_bad_settings_before_training(cache, tmp_path):
    with pytest.raises(ValueError, match="multiple of"):
        train(_config(cache, tmp_path / "x", batch_size=3, grad_accum=2))
    with pytest.raises(ValueError, match="anchor_source"):
        train(_config(cache, tmp_path / "y", method="alr", anchor_source="all"))
    assert not (tmp_path / "x" / "metrics.jsonl").exists()


def test_lr_schedule_warmup_then_cosine_to_zero():
    total = 100
    lrs = [lr_at(s, total_steps=total, peak_lr=1.0, warmup_frac=0.04) for s in range(total)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert lrs[-1] < 1e-3
    assert steps_per_epoch(10, batch_size=4) == 2


def test_golden_loss_trace(cache, tmp_path):
    """The per-step losses of a tiny seeded run of each objective family, checked in.

    A diff here means an objective (labels, weights, loss) or the data order changed. Regenerate
    on purpose with: ALRIRA_UPDATE_GOLDEN=1 pytest tests/test_train.py -k golden
    """
    trace = {}
    for method in ("dflash", "erase", "alr", "alr_ira"):
        run = tmp_path / method
        train(_config(cache, run, method=method, epochs=2))
        trace[method] = [round(x, 5) for x in _losses(run)]
    if os.environ.get("ALRIRA_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(trace, indent=1) + "\n")
    expected = json.loads(GOLDEN.read_text())
    for method, losses in trace.items():
        assert losses == pytest.approx(expected[method], rel=2e-4), method


# ----------------------------------------------------------------------------------------------
# Faults: corrupt data, a foreign head, a changed resume, a truncated checkpoint (docs/failure-modes.md)


def _copy_of(cache: Path, tmp_path: Path) -> Path:
    import shutil

    copy = tmp_path / "cache-copy"
    shutil.copytree(cache, copy)
    return copy


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_flipped_byte_in_the_cache_stops_training_with_one_line(cache, tmp_path, num_workers):
    broken = _copy_of(cache, tmp_path)
    chunk = sorted((broken / "shards" / "shard-00001.zarr" / "rollout_topk_probs").rglob("c/*/*/*"))[0]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01
    chunk.write_bytes(bytes(data))
    with pytest.raises(ValueError) as error:
        train(_config(broken, tmp_path / "run", method="alr", epochs=1, num_workers=num_workers))
    message = str(error.value)
    assert "\n" not in message and "shard-00001.zarr" in message and "rollout_topk_probs" in message
    assert not (tmp_path / "run" / "drafter").exists()


def test_training_refuses_a_head_written_for_another_target(cache, tmp_path):
    from storage.manifest import load_target_head, save_target_head

    broken = _copy_of(cache, tmp_path)
    head = load_target_head(broken)
    save_target_head(broken, embed_tokens=head["embed_tokens.weight"], lm_head=head["lm_head.weight"], target_hash="sha256:other")
    with pytest.raises(ValueError, match="written for target sha256:other"):
        train(_config(broken, tmp_path / "run", epochs=1))


def test_resume_refuses_a_changed_objective_but_takes_more_epochs(cache, tmp_path):
    run = tmp_path / "run"
    train(_config(cache, run, method="alr_ira", epochs=1))
    with pytest.raises(ValueError, match="--method was 'alr_ira', now 'alr'") as error:
        train(_config(cache, run, method="alr", epochs=1, resume=True))
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="--gamma"):
        train(_config(cache, run, method="alr_ira", gamma=3.0, epochs=1, resume=True))
    steps = len(_losses(run))
    train(_config(cache, run, method="alr_ira", epochs=2, resume=True))  # more epochs: allowed
    assert len(_losses(run)) == 2 * steps


def test_resume_from_a_truncated_checkpoint_falls_back_to_the_previous_one(cache, tmp_path, capsys):
    straight = tmp_path / "straight"
    train(_config(cache, straight, epochs=2, save_dtype="float32"))
    per_epoch = len(_losses(straight)) // 2
    run = tmp_path / "run"
    train(_config(cache, run, epochs=2, save_every=1, max_steps=per_epoch + 1, save_dtype="float32"))
    newest = run / "checkpoints" / f"step-{per_epoch + 1:08d}" / "state.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # a crash mid-write, outside atomic_write
    train(_config(cache, run, epochs=2, resume=True, save_dtype="float32"))
    assert f"step-{per_epoch:08d} instead" in capsys.readouterr().out
    a, b = _weights(straight), _weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for step in range(1, per_epoch + 1):  # and with nothing readable left: step 0, the same run
        (run / "checkpoints" / f"step-{step:08d}" / "state.pt").write_bytes(b"")
    for step in range(per_epoch + 1, 2 * per_epoch + 1):
        (run / "checkpoints" / f"step-{step:08d}" / "state.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match="--method was 'alr_ira', now 'alr'"):  # settings still checked (train_config.json)
        train(_config(cache, run, method="alr", epochs=2, resume=True, save_dtype="float32"))
    train(_config(cache, run, epochs=2, resume=True, save_dtype="float32"))
    assert "no readable checkpoint to resume from" in capsys.readouterr().out  # said in one line, then step 0
    b = _weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == list(range(1, 2 * per_epoch + 1))


def test_resume_never_quietly_becomes_another_run(cache, tmp_path):
    """Every checkpoint damaged and no readable train_config.json: refused (the flags given could be
    another run's), and --overwrite starts it again; --max-steps below the latest checkpoint:
    refused, so the summary never names one step while the weights are another's."""
    run = tmp_path / "run"
    train(_config(cache, run, epochs=1, save_every=1))
    steps = len(_losses(run))
    for state in run.glob("checkpoints/step-*/state.pt"):
        state.write_bytes(b"")
    for damage in (lambda p: p.unlink(), lambda p: p.write_text("{not json")):
        if (run / "train_config.json").exists():
            damage(run / "train_config.json")
        with pytest.raises(ValueError, match="train_config.json is missing or unreadable, so this run's settings cannot be checked"):
            train(_config(cache, run, method="alr", epochs=1, resume=True))
    train(_config(cache, run, epochs=1, overwrite=True, save_every=1))
    with pytest.raises(ValueError, match=rf"--max-steps 1 is below the latest checkpoint's step {steps}"):
        train(_config(cache, run, epochs=1, resume=True, max_steps=1))
    summary = train(_config(cache, run, epochs=1, resume=True, max_steps=steps))
    assert summary["steps"] == steps


def test_every_run_records_what_produced_it(cache, tmp_path):
    """RUN/provenance.json: per invocation the command, the versions, the source revision and the
    resolved config with what `auto` resolved to; a resume adds its own entry."""
    run = tmp_path / "run"
    train(_config(cache, run, epochs=1, save_every=1))
    train(_config(cache, run, epochs=2, resume=True))
    invocations = json.loads((run / "provenance.json").read_text())["invocations"]
    assert len(invocations) == 2 and invocations[1]["config"]["start_step"] > 0 == invocations[0]["config"]["start_step"]
    for entry in invocations:
        assert set(entry["versions"]) == {"torch", "transformers", "zarr", "ray", "vllm"} and entry["versions"]["torch"] == torch.__version__
        assert entry["config"]["compute_dtype"] == "float32" and entry["config"]["attention_kernel"] == "sdpa"
        assert entry["config"]["num_workers"] == 0 and isinstance(entry["command"], list)


def test_resume_ignores_settings_the_method_never_reads_and_checks_the_resolved_dtype(cache, tmp_path, monkeypatch):
    from pipeline.train import plan as plan_module

    run = tmp_path / "run"
    train(_config(cache, run, method="alr", epochs=1))
    recorded = json.loads((run / "train_config.json").read_text())
    assert recorded["compute_dtype"] == "float32" and recorded["device_kind"] == "cpu"  # ALRIRA_CPU_BF16=0 in tests
    # alr never reads --dflash-gamma (the dflash method's envelope) nor the DSpark loss weights.
    train(_config(cache, run, method="alr", epochs=2, resume=True, dflash_gamma=5.0, l1_alpha=0.5))
    with pytest.raises(ValueError, match="--gamma was 2.0, now 3.0"):  # one it reads
        train(_config(cache, run, method="alr", epochs=2, resume=True, gamma=3.0))
    # A machine where auto resolves to bf16: refused naming both dtypes, and the flag that continues.
    monkeypatch.setattr(plan_module, "auto_bf16", lambda device_type, stage: True)
    with pytest.raises(ValueError, match=r"this run computed in float32 \(on cpu\); here --precision auto resolves to bfloat16 on cpu: "
                                         r"resume with --precision fp32"):
        train(_config(cache, run, method="alr", epochs=3, resume=True))
    train(_config(cache, run, method="alr", epochs=3, resume=True, precision="fp32"))  # continues in float32


# ----------------------------------------------------------------------------------------------
# Real scale: the attention kernel, bf16 on the lm_head, pinned batches, collectives on the device


def _setup(config):
    """The run's plan and the state built from it (pipeline/train/plan.py, setup.py), as the loop holds them."""
    from pipeline.train.plan import open_run, plan_training
    from pipeline.train.setup import setup

    plan = plan_training(config, open_run(config))
    return plan, setup(plan)


def _stats_on(plan, s, batch, **overrides):
    from pipeline.train.step import forward_loss

    kwargs = dict(embed_tokens=s.embed_tokens, lm_head=s.lm_head, block_size=plan.num_slots + 1, loss_chunk=4096,
                  autocast=s.autocast, attention=plan.attention)  # fmt: skip
    return forward_loss(s.model, batch, **(kwargs | overrides))


def test_attention_flag_resolves_per_device_and_refuses_flex_without_cuda(cache, tmp_path):
    from pipeline.train.plan import open_run, plan_training

    auto, sdpa = _config(cache, tmp_path / "auto"), _config(cache, tmp_path / "sdpa", attention="sdpa")
    assert plan_training(auto, open_run(auto)).attention == ("flex" if torch.cuda.is_available() else "sdpa")
    assert plan_training(sdpa, open_run(sdpa)).attention == "sdpa"
    with pytest.raises(ValueError, match="--attention must be auto, flex or sdpa"):
        _config(cache, tmp_path / "x", attention="dense")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--attention flex needs a CUDA device"):
            train(_config(cache, tmp_path / "flex", attention="flex"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention's backward needs CUDA")
def test_flex_and_sdpa_train_the_same_on_cuda(cache, tmp_path):
    runs = {}
    for attention in ("sdpa", "flex"):
        train(_config(cache, tmp_path / attention, epochs=2, attention=attention, precision="fp32"))
        runs[attention] = _losses(tmp_path / attention)
    assert len(runs["flex"]) == 4
    assert runs["flex"] == pytest.approx(runs["sdpa"], rel=1e-4)


def test_bf16_runs_the_lm_head_gemms_in_bf16_once_each_and_the_loss_in_fp32(cache, tmp_path):
    """--precision bf16 (the GPU default; on CPU by request): the frozen head is held in bf16, each
    chunk's [slots, V] logits come from one bf16 GEMM (none recomputed in backward), the softmax is
    fp32, and the hidden states' gradient is one bf16 GEMM of the [slots, V] logit gradient."""
    from torch.utils._python_dispatch import TorchDispatchMode

    plan, s = _setup(_config(cache, tmp_path / "run", precision="bf16"))
    assert s.lm_head.dtype == s.embed_tokens.dtype == torch.bfloat16
    vocab = s.lm_head.shape[0]
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if isinstance(out, torch.Tensor) and out.dim() and out.shape[-1] == vocab and name in ("mm", "addmm", "exp_", "_log_softmax"):
                seen.append((name, "logits", out.dtype))
            elif name == "mm" and args[0].shape[-1] == vocab:
                seen.append((name, "grad", out.dtype))
            return out

    batch = next(s.batches)
    with Record():
        stats = _stats_on(plan, s, batch, loss_chunk=7)
        stats.loss_sum.backward()
    assert stats.loss_sum.dtype == torch.float32
    chunks = -(-len(batch.supervised_index) // 7)
    assert seen.count(("mm", "logits", torch.bfloat16)) == chunks, seen  # forward only: no recompute
    assert seen.count(("mm", "grad", torch.bfloat16)) == chunks, seen
    assert ("exp_", "logits", torch.float32) in seen and not [x for x in seen if x[0] == "addmm"], seen


def test_bf16_training_loss_stays_within_half_a_percent_of_fp32(cache, tmp_path):
    runs = {}
    for precision in ("fp32", "bf16"):
        train(_config(cache, tmp_path / precision, epochs=2, precision=precision))
        runs[precision] = _losses(tmp_path / precision)
    assert len(runs["bf16"]) == 4
    assert runs["bf16"] == pytest.approx(runs["fp32"], rel=5e-3)  # measured: at most 1.5e-3
    assert runs["bf16"] != runs["fp32"]  # bf16 really ran


def test_train_batch_pin_memory_pins_every_tensor(cache, tmp_path, monkeypatch):
    """The DataLoader's pin_memory=True hands each batch to `_utils.pin_memory.pin_memory`, which
    pins only tensors and objects with a pin_memory() method. Pinning needs an accelerator: with
    CUDA the pages are checked; without it Tensor.pin_memory is replaced by a recording clone, so
    what is checked is that every tensor field goes through it and the values come back intact."""
    from torch.utils.data._utils.pin_memory import pin_memory

    from pipeline.train.batching import TrainBatch
    batch = next(_setup(_config(cache, tmp_path / "run"))[1].batches)
    tensor_fields = [name for name, value in vars(batch).items() if isinstance(value, torch.Tensor)]
    pinned_ids = []
    if not torch.cuda.is_available():
        def fake_pin(t):
            pinned_ids.append(id(t))
            return t.clone()

        monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    pinned = pin_memory(batch)
    assert isinstance(pinned, TrainBatch) and pinned is not batch
    for name, value in vars(batch).items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(getattr(pinned, name), value), name
            assert getattr(pinned, name).is_pinned() if torch.cuda.is_available() else True
        else:
            assert getattr(pinned, name) == value, name
    if not torch.cuda.is_available():
        assert sorted(pinned_ids) == sorted(id(getattr(batch, name)) for name in tensor_fields)
    assert len(tensor_fields) == 13  # with prev_tokens (a DSpark Markov head's input; dist_* only when set)


def test_a_collective_refuses_a_tensor_off_the_training_device():
    from pipeline.train.step import all_reduce_on

    with pytest.raises(RuntimeError, match="collective on a meta tensor while training on cpu"):
        all_reduce_on(torch.zeros(3, device="meta"), device=torch.device("cpu"), world_size=1)
    t = torch.ones(3)
    assert all_reduce_on(t, device=torch.device("cpu"), world_size=1) is t


def test_every_collective_of_a_real_run_gets_a_tensor_on_the_training_device(cache, tmp_path, monkeypatch):
    """Every collective in pipeline/train goes through `all_reduce_on` (checked in the source), and
    a real one-process run calls it for each of them (weight total, statistics, token count) with
    tensors on the device the model trains on. On a CPU-only machine every tensor is on cpu, so this
    cannot catch a tensor created without device=; the check inside all_reduce_on does, on one GPU,
    since it runs with world size 1 too."""
    import ast

    import pipeline.train.loop as loop
    import pipeline.train.step as step

    collectives = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                   "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
                   "isend", "irecv"}  # fmt: skip
    for path in Path(loop.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Attribute) and node.attr in collectives and getattr(node.value, "id", "") == "dist":
                    assert (path.name, function.name) == ("step.py", "all_reduce_on"), (path.name, function.name)

    calls, original = [], step.all_reduce_on

    def recording(t, *, device, world_size):
        calls.append((t.device, torch.device(device)))
        return original(t, device=device, world_size=world_size)

    monkeypatch.setattr(step, "all_reduce_on", recording)  # the step's calls (weight total, statistics, token count)
    trained_on = []
    real_setup = loop.setup
    monkeypatch.setattr(loop, "setup", lambda plan: trained_on.append(s := real_setup(plan)) or s)
    summary = train(_config(cache, tmp_path / "run", epochs=1))
    model_device = next(trained_on[0].drafter.parameters()).device
    assert len(calls) == 3 * summary["steps"] > 0
    assert all(tensor_device == device == model_device for tensor_device, device in calls), calls


def test_bf16_features_travel_as_bits_and_decode_exactly(cache):
    """The loader hands the training device bf16 bits (uint16, half the bytes of float32); they
    decode to exactly the reader's float32 features."""
    from pipeline.train.batching import CacheTrainDataset, collate
    from pipeline.train.labels import ObjectiveConfig
    from pipeline.train.step import decode_feature_bits
    from storage.reader import open_cache

    reader = open_cache(cache)
    manifest = reader.manifest
    objective = ObjectiveConfig(method="alr_ira", rollout_depth=14).for_cache(
        num_slots=manifest.settings.num_slots, mask_token_id=manifest.mask_token_id, stop_token_ids=manifest.stop_token_ids
    )
    example = CacheTrainDataset(reader, objective=objective, seed=0)[(0, 0)]
    batch = collate([example])
    assert example.context_features.dtype == batch.context_features.dtype == torch.uint16
    decoded = decode_feature_bits(batch.context_features)[0]
    corpus = torch.from_numpy(reader.read(0)["features"])  # float32, decoded by the reader
    assert decoded.dtype == torch.float32 and torch.equal(decoded[: corpus.shape[0]], corpus)


@pytest.mark.parametrize("storage_format", ["zarr", "wds"])
def test_fp8_features_travel_as_bits_and_scales_and_decode_exactly(tmp_path, storage_format):
    """fp8 caches: the loader hands the device uint8 bits and one float32 scale per context row
    (the IRA parents' rollout rows included); decoded there, they equal the float32 context the
    same example gets from the reader's decoded record."""
    from pipeline.train.batching import CacheTrainDataset, collate, example_from_record
    from pipeline.train.labels import ObjectiveConfig
    from pipeline.train.step import decode_feature_bits
    from storage.reader import open_cache
    from test_storage import K, build_cache

    build_cache(tmp_path / "cache", storage_format=storage_format, codec="fp8", sizes=(4, 3))
    reader = open_cache(tmp_path / "cache")
    manifest = reader.manifest
    objective = ObjectiveConfig(method="alr_ira", rollout_depth=K - 1).for_cache(
        num_slots=manifest.settings.num_slots, mask_token_id=manifest.mask_token_id, stop_token_ids=manifest.stop_token_ids
    )
    dataset = CacheTrainDataset(reader, objective=objective, seed=0)
    secondaries = 0
    for index in range(len(reader)):
        example = dataset[(0, index)]
        batch = collate([example])
        assert batch.context_features.dtype == torch.uint8 and batch.context_feature_scales.dtype == torch.float32
        floats = reader.read(index)  # features decoded to float32 by the reader
        want = example_from_record(
            floats, epoch=0, index=index, objective=objective, seed=0,
            parent_rollout_features=lambda rows, floats=floats: (floats["rollout_features"][rows], None),
        )  # fmt: skip
        decoded = decode_feature_bits(batch.context_features, batch.context_feature_scales)[0]
        length = want.context_features.shape[0]  # then the batch's padding to a multiple of 128: zeros
        assert decoded.dtype == torch.float32 and torch.equal(decoded[:length], want.context_features)
        assert not decoded[length:].any() and decoded.shape[0] % 128 == 0
        secondaries += int(example.context_features.shape[0] > example.num_tokens)
    assert secondaries > 0  # some IRA parents' rollout rows were decoded too


# ----------------------------------------------------------------------------------------------
# No host sync per micro-batch, one compiled graph (docs/design.md, "A training step")

# The ops that make the host wait on a CUDA device: a value read (.item(), float(), if t:) or an
# output whose shape depends on the data (nonzero, boolean-mask indexing and its backward).
_SYNCING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "item"}


def _syncing_ops(fn) -> list[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            bool_index = name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) or ()
            )
            if name in _SYNCING_OPS or bool_index:
                seen.append(name)
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return seen


def _masked_loss(plan, s, batch):
    """forward_loss as it was: the context cut to its longest sequence, the supervised slots picked
    by boolean masks (one host sync each), everything else the same (the loss's own chunking aside)."""
    import torch.nn.functional as F

    from drafter.masks import visibility_mask
    from drafter.losses import topk_tail_loss

    c = int(batch.context_valid.sum(1).max())
    mask = visibility_mask(
        context_positions=batch.context_positions[:, :c], context_owner=batch.context_owner[:, :c],
        context_valid=batch.context_valid[:, :c], block_corpus_limit=batch.block_corpus_limit,
        block_valid=batch.block_valid, block_size=plan.num_slots + 1,
    )  # fmt: skip
    hidden = s.model(
        context_features=(batch.context_features[:, :c].to(torch.int32) << 16).view(torch.float32),
        context_positions=batch.context_positions[:, :c], block_embeds=F.embedding(batch.block_tokens, s.embed_tokens),
        block_positions=batch.block_positions, attention_mask=mask,
    )  # fmt: skip
    num_batch, num_blocks, _ = batch.slot_weights.shape
    hidden = hidden.view(num_batch, num_blocks, plan.num_slots + 1, -1)[:, :, 1:]
    supervised = batch.slot_weights > 0
    logits = F.linear(hidden[supervised], s.lm_head)
    loss_sum, weight_sum = topk_tail_loss(
        draft_logits=logits, label_ids=batch.label_ids[supervised], label_probs=batch.label_probs[supervised],
        weights=batch.slot_weights[supervised],
    )  # fmt: skip
    return loss_sum, weight_sum


def test_a_micro_batch_needs_no_host_sync_and_keeps_its_loss_and_gradients(cache, tmp_path):
    """The loss of a padded batch with the collate's indices equals the unpadded, boolean-masked one
    (values and gradients, fp32 rounding), and its forward, backward and clip run none of the ops
    that wait on the device, which the boolean-masked loss runs (so the detector detects)."""
    plan, s = _setup(_config(cache, tmp_path / "run", method="alr_ira", attention="sdpa", precision="fp32"))
    batch = next(s.batches).to(plan.ranks.device)
    assert batch.context_features.shape[1] % 128 == 0 and not batch.context_valid[:, -1].any()
    assert torch.equal(batch.supervised_index, torch.nonzero(batch.slot_weights.flatten() > 0).flatten())

    def gradients(loss_fn):
        s.model.zero_grad(set_to_none=True)
        loss_sum, weight_sum = loss_fn()
        loss_sum.backward()
        torch.nn.utils.clip_grad_norm_(s.drafter.parameters(), 1e9)
        return loss_sum.detach(), weight_sum.detach(), {n: p.grad.clone() for n, p in s.drafter.named_parameters()}

    def fast():
        stats = _stats_on(plan, s, batch, loss_chunk=7)  # several chunks
        return stats.loss_sum, stats.weight_sum

    results = {}
    assert _syncing_ops(lambda: results.update(fast=gradients(fast))) == []
    assert "index" in _syncing_ops(lambda: results.update(masked=gradients(lambda: _masked_loss(plan, s, batch))))
    (fast_loss, fast_weight, fast_grads), (loss, weight, grads) = results["fast"], results["masked"]
    assert fast_weight == weight > 0
    torch.testing.assert_close(fast_loss, loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(fast_grads[name], grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item(), msg=name)


def test_metrics_are_read_every_log_every_steps_and_at_the_last(cache, tmp_path):
    run = tmp_path / "run"
    summary = train(_config(cache, run, epochs=3, log_every=4))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 6 and [r["step"] for r in records] == [4, 6]
    every = tmp_path / "every"
    train(_config(cache, every, epochs=3))
    assert [r["loss"] for r in records] == [_losses(every)[3], _losses(every)[5]]
    with pytest.raises(ValueError, match="--log-every must be >= 1"):
        _config(cache, run, log_every=0)


def test_flex_equals_sdpa_on_real_batches_of_ten_lengths_with_at_most_two_compiled_shapes(cache, tmp_path):
    """Real examples (IRA private context, padded blocks) whose corpus context is cut to ten lengths:
    the loop's forward_loss with the compiled flex path (block mask + flex attention) equals SDPA on
    each, and, the context padded to a multiple of 128, the compiled functions (CPU: one graph per
    shape) see at most two shapes. Forward only on CPU, where PyTorch has no flex backward; the
    training comparison below needs CUDA."""
    from torch._dynamo.utils import counters

    from pipeline.train.batching import CacheTrainDataset, collate
    config = _config(cache, tmp_path / "run", method="alr_ira", attention="sdpa", precision="fp32")
    (plan, s), reader = _setup(config), open_cache(cache)
    m = reader.manifest
    objective = config.objective.for_cache(num_slots=plan.num_slots, mask_token_id=m.mask_token_id, stop_token_ids=m.stop_token_ids)
    dataset = CacheTrainDataset(reader, objective=objective, seed=0)
    examples = [dataset[(0, i)] for i in range(2)]
    shortest = min(e.num_tokens for e in examples)
    lengths = [shortest - 6 * i for i in range(10)]
    assert lengths[-1] > 0

    def cut(example, length):  # the corpus context's first `length` tokens and all the private ones
        keep = (torch.arange(len(example.context_owner)) < length) | (example.context_owner >= 0)
        return replace(example, num_tokens=length, context_features=example.context_features[keep],
                       context_positions=example.context_positions[keep], context_owner=example.context_owner[keep])  # fmt: skip

    before = counters["stats"]["unique_graphs"]
    for length in lengths:
        batch = collate([cut(examples[0], length), examples[1]]).to(plan.ranks.device)
        with torch.no_grad():
            sdpa, flex = _stats_on(plan, s, batch, attention="sdpa"), _stats_on(plan, s, batch, attention="flex")
        assert batch.context_owner.max() >= 0 and not batch.context_valid.all()  # private and padded context
        assert flex.weight_sum == sdpa.weight_sum > 0
        assert abs(flex.loss_sum - sdpa.loss_sum) <= 1e-5 * abs(sdpa.loss_sum), (length, flex.loss_sum, sdpa.loss_sum)
    graphs = counters["stats"]["unique_graphs"] - before
    assert graphs <= 2 * 2, graphs  # (block mask, attention) x at most two padded shapes; unpadded: x 10


def test_num_workers_defaults_to_the_cores_each_rank_of_the_node_may_use(monkeypatch):
    from pipeline.train.config import LoaderConfig, default_num_workers

    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert default_num_workers() == cores - 1 == LoaderConfig().num_workers
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
    assert default_num_workers() == 0  # one core per rank: it reads in the training process
    assert LoaderConfig(num_workers=3).num_workers == 3


def test_out_holding_another_run_is_refused_unless_resume_or_overwrite(cache, tmp_path):
    """docs/failure-modes.md, "Outputs": an earlier run is never replaced without a word, a resume
    must come from the same cache, a second process on one --out refuses, a user's file is kept."""
    from pipeline.outputs import RECORD_FILE, output_lock

    run = tmp_path / "run"
    train(_config(cache, run, method="alr", max_steps=2))
    assert json.loads((run / "train_config.json").read_text())["cache"] == str(cache.resolve())  # read from anywhere
    weights = (run / "drafter" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"holds an earlier training run \(method 'alr', --cache .*\); pass --resume"):
        train(_config(cache, run, method="kd", max_steps=2))
    assert (run / "drafter" / "model.safetensors").read_bytes() == weights
    record = json.loads((run / RECORD_FILE).read_text())
    (run / RECORD_FILE).write_text(json.dumps({**record, "inputs": {**record["inputs"], "target_hash": "sha256:other"}}))
    with pytest.raises(ValueError, match=r"--resume of a run trained from another cache \(target_hash: 'sha256:other' -> "):
        train(_config(cache, run, method="alr", max_steps=2, resume=True))
    with output_lock(run, command="another alrira-train"), pytest.raises(ValueError, match=r"in use by another alrira-train \(pid"):
        train(_config(cache, run, method="kd", max_steps=2, overwrite=True))
    train(_config(cache, run, method="kd", max_steps=2, overwrite=True))
    assert json.loads((run / "train_config.json").read_text())["method"] == "kd"
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"holds files alrira-train did not write \(notes.txt\)"):
        train(_config(cache, run, method="kd", max_steps=2, overwrite=True))
    assert (run / "notes.txt").read_text() == "mine"
