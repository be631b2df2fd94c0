"""The drafter package: config rules, checkpoint layout, the visibility rule, forward math."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from safetensors.torch import load_file, save_file

from drafter.config import AUTO_MAP
from drafter import (
    DFlashConfig,
    DFlashDrafter,
    check_compatible,
    default_target_layer_ids,
    flex_block_mask,
    load_drafter,
    reference_forward,
    save_drafter,
    visibility_mask,
    visibility_mask_mod,
)

HIDDEN = 64
BLOCK = 4


def tiny_config(**overrides) -> DFlashConfig:
    kwargs = dict(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        vocab_size=1000,
        block_size=BLOCK,
        num_target_layers=8,
        target_layer_ids=[1, 4, 6],
        mask_token_id=999,
        dtype="float32",
    )
    kwargs.update(overrides)
    return DFlashConfig(**kwargs)


def tiny_model(seed: int = 0, **overrides) -> DFlashDrafter:
    """A drafter with O(1) activations and non-trivial norm weights (so a skipped norm shows)."""
    torch.manual_seed(seed)
    model = DFlashDrafter(tiny_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    return model


def spec_tensor_names(num_layers: int) -> set[str]:
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        names |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
        names |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        names |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    return names


# ----------------------------------------------------------------------------------------- config


def test_default_target_layer_ids():
    assert default_target_layer_ids(num_target_layers=36, num_draft_layers=5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(num_target_layers=36, num_draft_layers=1) == [18]
    assert default_target_layer_ids(num_target_layers=28, num_draft_layers=3) == [1, 13, 25]


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_config(num_key_value_heads=3)
    with pytest.raises(ValueError, match="target_layer_ids"):
        tiny_config(target_layer_ids=[1, 8])
    with pytest.raises(ValueError, match="mask_token_id"):
        tiny_config(mask_token_id=1000)
    with pytest.raises(ValueError, match="block_size"):
        tiny_config(block_size=1)


def test_hf_dict_has_every_required_key_and_round_trips():
    config = tiny_config()
    d = config.to_hf_dict()
    expected = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": BLOCK,
        "num_target_layers": 8,
        "dflash_config": {"mask_token_id": 999, "target_layer_ids": [1, 4, 6]},
        "eagle_aux_hidden_state_layer_ids": [2, 5, 7],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 512,
        "layer_types": ["full_attention", "full_attention"],
        "sliding_window": None,
        "use_sliding_window": False,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": 1000,
        "dtype": "float32",
    }
    assert d == expected
    assert DFlashConfig.from_hf_dict(json.loads(json.dumps(d))) == config


def public_release_config() -> dict:
    """Shaped like z-lab's Qwen3-4B-DFlash-b16 config.json (transformers 4 style), scaled down."""
    return {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": 16,
        "bos_token_id": 151643,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "layer_types": ["full_attention"] * 5,
        "max_position_embeddings": 40960,
        "max_window_layers": 5,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 5,
        "num_key_value_heads": 2,
        "num_target_layers": 36,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.3",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


def test_from_hf_dict_reads_a_public_release_config():
    config = DFlashConfig.from_hf_dict(public_release_config())
    assert config.target_layer_ids == [1, 9, 17, 25, 33]
    assert config.mask_token_id == 151669
    assert (config.block_size, config.num_target_layers, config.num_hidden_layers) == (16, 36, 5)
    assert (config.rope_theta, config.rope_scaling, config.dtype) == (1e6, None, "bfloat16")


def test_from_hf_dict_reads_transformers5_style_keys():
    d = public_release_config()
    del d["rope_theta"], d["rope_scaling"], d["block_size"], d["dtype"]
    d["rope_parameters"] = {"rope_theta": 5e5, "rope_type": "default"}
    d["dflash_config"]["block_size"] = 8
    config = DFlashConfig.from_hf_dict(d)
    assert (config.rope_theta, config.block_size, config.dtype) == (5e5, 8, "bfloat16")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"some_new_knob": 1}, "some_new_knob"),
        ({"layer_types": ["sliding_attention"] * 5, "use_sliding_window": True}, "layer_types"),
        ({"attention_bias": True}, "attention_bias"),
        ({"architectures": ["DFlash2DraftModel"]}, "architectures"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 9, 17, 25, 33]}, "eagle_aux_hidden_state_layer_ids"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ],
)
def test_from_hf_dict_refuses_what_it_cannot_run(change, message):
    d = public_release_config() | change
    with pytest.raises(ValueError, match=message):
        DFlashConfig.from_hf_dict(d)


def test_from_target_config():
    target = {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
    }
    config = DFlashConfig.from_target_config(target, num_draft_layers=5, mask_token_id=151669)
    assert config.target_layer_ids == [1, 9, 17, 25, 33]
    assert (config.hidden_size, config.num_hidden_layers, config.num_target_layers) == (2560, 5, 36)
    assert (config.head_dim, config.num_key_value_heads, config.rope_theta) == (128, 8, 1e6)
    vl = DFlashConfig.from_target_config(
        {"text_config": target}, num_draft_layers=1, mask_token_id=7, target_layer_ids=[3]
    )
    assert vl.target_layer_ids == [3] and vl.intermediate_size == 9728


def test_check_compatible():
    config = tiny_config()
    ok = dict(target_layer_ids=[1, 4, 6], hidden_size=64, vocab_size=1000, block_size=BLOCK)
    check_compatible(config, **ok)
    with pytest.raises(ValueError, match="target_layer_ids"):
        check_compatible(config, **(ok | {"target_layer_ids": [1, 4, 7]}))
    with pytest.raises(ValueError, match="hidden_size"):
        check_compatible(config, **(ok | {"hidden_size": 32}))
    with pytest.raises(ValueError, match="block_size"):
        check_compatible(config, **(ok | {"block_size": 16}))


# ------------------------------------------------------------------------------------- checkpoint


def test_save_load_round_trip(tmp_path):
    model = tiny_model()
    assert set(model.state_dict()) == spec_tensor_names(2)
    save_drafter(model, tmp_path, dtype=torch.float32)
    stored = load_file(tmp_path / "model.safetensors")
    assert set(stored) == spec_tensor_names(2)
    assert stored["fc.weight"].shape == (HIDDEN, 3 * HIDDEN)
    with open(tmp_path / "config.json") as f:  # the config, plus what AutoModel and transformers 4.x read
        assert json.load(f) == {**model.config.to_hf_dict(), "torch_dtype": "float32", "auto_map": AUTO_MAP}
    loaded = load_drafter(tmp_path)
    assert loaded.config == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


def test_save_bf16_default(tmp_path):
    model = tiny_model()
    save_drafter(model, tmp_path)
    with open(tmp_path / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
    loaded = load_drafter(tmp_path)
    assert loaded.fc.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.fc.weight, model.fc.weight.to(torch.bfloat16))
    assert load_drafter(tmp_path, dtype=torch.float32).norm.weight.dtype == torch.float32


def test_load_accepts_model_prefix_and_ignores_embedding_and_head(tmp_path):
    model = tiny_model()
    save_drafter(model, tmp_path, dtype=torch.float32)
    stored = load_file(tmp_path / "model.safetensors")
    renamed = {f"model.{k}": v for k, v in stored.items()}
    renamed["embed_tokens.weight"] = torch.zeros(1000, HIDDEN)
    renamed["lm_head.weight"] = torch.zeros(1000, HIDDEN)
    save_file(renamed, tmp_path / "model.safetensors")
    loaded = load_drafter(tmp_path)
    assert torch.equal(loaded.layers[1].self_attn.k_norm.weight, model.layers[1].self_attn.k_norm.weight)
    assert set(loaded.state_dict()) == spec_tensor_names(2)


def test_load_sharded(tmp_path):
    model = tiny_model()
    save_drafter(model, tmp_path, dtype=torch.float32)
    stored = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(stored)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: stored[k] for k in keys}, tmp_path / file)
        weight_map |= {k: file for k in keys}
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    loaded = load_drafter(tmp_path)
    assert torch.equal(loaded.layers[0].mlp.down_proj.weight, model.layers[0].mlp.down_proj.weight)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.pop("layers.1.self_attn.q_norm.weight"), "layers.1.self_attn.q_norm.weight"),
        (lambda s: s.update({"fc.weight": torch.zeros(HIDDEN, 2 * HIDDEN)}), "fc.weight"),
        (lambda s: s.update({"layers.0.extra.weight": torch.zeros(3)}), "layers.0.extra.weight"),
    ],
)
def test_load_refuses_missing_misshapen_or_unexpected_tensors(tmp_path, edit, message):
    save_drafter(tiny_model(), tmp_path, dtype=torch.float32)
    stored = load_file(tmp_path / "model.safetensors")
    edit(stored)
    save_file(stored, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        load_drafter(tmp_path)


# ------------------------------------------------------------------------------------------ masks


def hand_example(*, block_valid=(True, True, False)) -> dict:
    """6 context tokens, 3 blocks of 4.

    c0..c2: corpus tokens at positions 0, 1, 2; c3, c4: private rollout features of block 1 at
    positions 3, 4; c5: corpus token at position 5 that is padding (invalid).
    Block 0: ordinary block anchored at 2 (sees corpus < 2). Block 1: IRA secondary at offset 3
    of a parent anchored at 2 (corpus <= 2, i.e. limit 3, plus c3, c4; its anchor is at 5).
    Block 2: padding.
    """
    return dict(
        context_positions=torch.tensor([[0, 1, 2, 3, 4, 5]]),
        context_owner=torch.tensor([[-1, -1, -1, 1, 1, -1]]),
        context_valid=torch.tensor([[True, True, True, True, True, False]]),
        block_corpus_limit=torch.tensor([[2, 3, 6]]),
        block_valid=torch.tensor([list(block_valid)]),
        block_size=4,
    )


def expand_rows(context_rows: list[str]) -> torch.Tensor:
    """Per-block context visibility strings -> the full [12, 18] token-level matrix."""
    rows = []
    for b, ctx in enumerate(context_rows):
        block_part = "".join("1111" if j == b else "0000" for j in range(3))
        rows += [[c == "1" for c in ctx + block_part]] * 4
    return torch.tensor(rows)


def test_visibility_mask_hand_example():
    mask = visibility_mask(**hand_example())
    assert mask.shape == (1, 1, 12, 18) and mask.dtype == torch.bool
    expected = expand_rows(["110000", "111110", "000000"])
    assert torch.equal(mask[0, 0], expected)
    # A valid block with a high limit still skips padding and another block's private tokens.
    mask = visibility_mask(**hand_example(block_valid=(True, True, True)))
    assert torch.equal(mask[0, 0], expand_rows(["110000", "111110", "111000"]))


def random_mask_inputs(seed: int, *, batch=2, num_context=11, num_blocks=5, block_size=4) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(
        context_positions=torch.randint(0, 20, (batch, num_context), generator=g),
        context_owner=torch.randint(-1, num_blocks, (batch, num_context), generator=g),
        context_valid=torch.rand(batch, num_context, generator=g) < 0.8,
        block_corpus_limit=torch.randint(0, 20, (batch, num_blocks), generator=g),
        block_valid=torch.rand(batch, num_blocks, generator=g) < 0.8,
        block_size=block_size,
    )


@pytest.mark.parametrize("num_context", [11, 0])
def test_flex_mask_mod_equals_dense_mask(num_context):
    inputs = random_mask_inputs(1, num_context=num_context)
    dense = visibility_mask(**inputs)[:, 0]  # [B, Q, C + Q]
    batch, num_queries, num_keys = dense.shape
    mask_mod = visibility_mask_mod(**inputs)
    b = torch.arange(batch)[:, None, None]
    q = torch.arange(num_queries)[None, :, None]
    kv = torch.arange(num_keys)[None, None, :]
    assert torch.equal(mask_mod(b, torch.zeros_like(b), q, kv).expand_as(dense), dense)
    block_mask = flex_block_mask(**inputs)
    assert block_mask.seq_lengths == (num_queries, num_keys)


# ---------------------------------------------------------------------------------------- forward


def forward_visibility() -> dict:
    """Two sequences, 10 context slots and 3 blocks each, with private tokens and padding.

    Sequence 0: corpus at positions 0..7; blocks at anchors 3 and 6; block 2 is an IRA
    secondary of the block at 3 with offset 3 (limit 4, private features at 4, 5; anchor 6).
    Sequence 1: corpus at 0..5, 4 padded context slots, blocks at 2 and 5, third block padding.
    """
    return dict(
        context_positions=torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 4, 5], [0, 1, 2, 3, 4, 5, 0, 0, 0, 0]]),
        context_owner=torch.tensor([[-1] * 8 + [2, 2], [-1] * 10]),
        context_valid=torch.tensor([[True] * 10, [True] * 6 + [False] * 4]),
        block_corpus_limit=torch.tensor([[3, 6, 4], [2, 5, 0]]),
        block_valid=torch.tensor([[True, True, True], [True, True, False]]),
        block_size=BLOCK,
    )


def forward_inputs(model: DFlashDrafter, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    visibility = forward_visibility()
    block_anchor = torch.tensor([[3, 6, 6], [2, 5, 0]])
    return dict(
        context_features=torch.randn(2, 10, model.config.num_taps * HIDDEN, generator=g),
        context_positions=visibility["context_positions"],
        block_embeds=torch.randn(2, 3 * BLOCK, HIDDEN, generator=g),
        block_positions=(block_anchor[:, :, None] + torch.arange(BLOCK)).reshape(2, -1),  # [B, Q]
        attention_mask=visibility_mask(**visibility),
    )


def test_sdpa_forward_matches_reference_values_and_gradients():
    model = tiny_model()
    inputs = forward_inputs(model)
    inputs["context_features"].requires_grad_(True)
    inputs["block_embeds"].requires_grad_(True)
    weights = torch.randn(2, 3 * BLOCK, HIDDEN)

    def run(fn):
        model.zero_grad()
        for name in ("context_features", "block_embeds"):
            inputs[name].grad = None
        out = fn(**inputs)
        (out * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        grads |= {n: inputs[n].grad.clone() for n in ("context_features", "block_embeds")}
        return out.detach(), grads

    fast_out, fast_grads = run(model)
    ref_out, ref_grads = run(lambda **kw: reference_forward(model, **kw))
    assert fast_out.abs().mean() > 0.1  # O(1) activations, so the tolerance below means something
    torch.testing.assert_close(fast_out, ref_out, atol=1e-5, rtol=1e-5)
    assert set(fast_grads) == set(ref_grads)
    for name in fast_grads:
        # fp32 sums over many terms: the tolerance scales with the gradient's own size.
        scale = max(1.0, ref_grads[name].abs().max().item())
        torch.testing.assert_close(fast_grads[name], ref_grads[name], atol=1e-5 * scale, rtol=1e-5, msg=name)
    assert fast_grads["context_features"].abs().sum() > 0


def saved_activation_bytes(fn) -> tuple[int, object]:
    """Bytes of the tensors autograd keeps for backward while fn() runs (parameters excluded), and fn()."""
    total = 0

    def pack(t):
        nonlocal total
        if not isinstance(t, nn.Parameter):
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out


def test_activation_checkpointing_same_gradients_fewer_saved_activations():
    model = tiny_model(seed=5, num_hidden_layers=3)
    inputs = forward_inputs(model)
    weights = torch.randn(2, 3 * BLOCK, HIDDEN, generator=torch.Generator().manual_seed(6))

    def run(checkpointing: bool):
        model.activation_checkpointing = checkpointing
        model.zero_grad()
        saved, out = saved_activation_bytes(lambda: model(**inputs))
        (out * weights).sum().backward()
        return saved, out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain_saved, plain_out, plain_grads = run(False)
    ckpt_saved, ckpt_out, ckpt_grads = run(True)
    torch.testing.assert_close(ckpt_out, plain_out, atol=0, rtol=0)
    for name in plain_grads:
        torch.testing.assert_close(ckpt_grads[name], plain_grads[name], atol=1e-6, rtol=1e-6, msg=name)
    # Only the layer inputs are kept, not the attention and MLP intermediates of every layer.
    assert ckpt_saved < plain_saved / 2, (ckpt_saved, plain_saved)
    # Off in eval / no-grad: decoding never pays the recompute.
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs), plain_out)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_matches_sdpa():
    model = tiny_model()
    inputs = forward_inputs(model)
    with torch.no_grad():  # flex attention has no CPU backward; gradients are checked on CUDA
        sdpa = model(**inputs)
        flex = model(**(inputs | {"attention_mask": flex_block_mask(**forward_visibility())}))
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-5)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_flex_attention_matches_sdpa_values_and_gradients(device):
    """The training path: compiled create_block_mask and compiled flex_attention, against SDPA with
    the dense mask. PyTorch 2.13 has no flex-attention backward on CPU (it raises for inputs that
    require grad, and inductor lowers the backward to Triton only), so on CPU the values are
    compared and the gradients only where CUDA is present; the check that CPU still refuses makes
    this test fail once PyTorch gains a CPU backward, so that the comparison can move here."""
    model = tiny_model().to(device)
    inputs = {k: v.to(device) for k, v in forward_inputs(model).items()}
    visibility = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in forward_visibility().items()}
    weights = torch.randn(2, 3 * BLOCK, HIDDEN, generator=torch.Generator().manual_seed(7)).to(device)
    block_mask = flex_block_mask(**visibility, compile=True)
    tolerance = 1e-5 if device == "cpu" else 1e-4  # CUDA: different summation order in the kernel

    with torch.no_grad():
        sdpa_values, flex_values = model(**inputs), model(**(inputs | {"attention_mask": block_mask}))
    assert sdpa_values.abs().mean() > 0.1
    torch.testing.assert_close(flex_values, sdpa_values, atol=tolerance, rtol=tolerance)

    def run(mask):
        model.zero_grad()
        out = model(**(inputs | {"attention_mask": mask}))
        (out * weights).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    if device == "cpu":
        with pytest.raises(NotImplementedError, match="backward on CPU"):
            run(block_mask)
        return
    sdpa_out, sdpa_grads = run(inputs["attention_mask"])
    flex_out, flex_grads = run(block_mask)
    torch.testing.assert_close(flex_out, sdpa_out, atol=1e-4, rtol=1e-4)
    for name in sdpa_grads:
        scale = max(1.0, sdpa_grads[name].abs().max().item())
        torch.testing.assert_close(flex_grads[name], sdpa_grads[name], atol=1e-4 * scale, rtol=1e-4, msg=name)


def _blocks_to_dense(num_blocks: torch.Tensor, indices: torch.Tensor, num_cols: int) -> torch.Tensor:
    """A BlockMask's (num_blocks [B, H, rows], indices [B, H, rows, max]) as bool [B, H, rows, num_cols]."""
    used = torch.arange(indices.shape[-1]) < num_blocks[..., None]  # [B, H, rows, max]
    dense = torch.zeros(*indices.shape[:-1], num_cols + 1, dtype=torch.long)
    dense.scatter_add_(-1, torch.where(used, indices.long(), num_cols), torch.ones_like(dense[..., :-1]))
    return dense[..., :num_cols] > 0


def test_compiled_block_mask_equals_the_dense_mask_block_by_block():
    """Several 128 x 128 mask tiles, some empty, some full, some partial: the compiled BlockMask's
    tiles in both directions (kv tiles per query tile for the forward, query tiles per kv tile for
    the backward) are the dense reference's tiles."""
    g = torch.Generator().manual_seed(3)
    batch, num_context, num_blocks, block_size = 2, 256, 20, 16
    inputs = dict(
        context_positions=torch.arange(num_context).expand(batch, -1),
        context_owner=torch.stack([torch.full((num_context,), -1), torch.randint(-1, num_blocks, (num_context,), generator=g)]),
        context_valid=torch.stack([torch.ones(num_context, dtype=torch.bool), torch.rand(num_context, generator=g) < 0.8]),
        block_corpus_limit=torch.stack([torch.full((num_blocks,), 300), torch.randint(0, num_context, (num_blocks,), generator=g)]),
        block_valid=torch.stack([torch.ones(num_blocks, dtype=torch.bool), torch.rand(num_blocks, generator=g) < 0.8]),
        block_size=block_size,
    )
    compiled = flex_block_mask(**inputs, compile=True)
    dense = visibility_mask(**inputs)  # [B, 1, 320, 576]
    tiles = torch.nn.functional.pad(dense, (0, 640 - 576, 0, 384 - 320)).view(batch, 1, 3, 128, 5, 128)
    full = tiles.all(dim=5).all(dim=3)  # [B, 1, 3, 5]
    partial = tiles.any(dim=5).any(dim=3) & ~full
    assert full.any() and partial.any() and not (full | partial).all()
    assert torch.equal(_blocks_to_dense(compiled.kv_num_blocks, compiled.kv_indices, 5), partial)
    assert torch.equal(_blocks_to_dense(compiled.full_kv_num_blocks, compiled.full_kv_indices, 5), full)
    assert torch.equal(_blocks_to_dense(compiled.q_num_blocks, compiled.q_indices, 3), partial.transpose(2, 3))
    assert torch.equal(_blocks_to_dense(compiled.full_q_num_blocks, compiled.full_q_indices, 3), full.transpose(2, 3))


def test_blocks_are_isolated_and_see_only_earlier_context():
    model = tiny_model()
    inputs = forward_inputs(model)
    base = model(**inputs)
    block = lambda out, b: out[0, b * BLOCK : (b + 1) * BLOCK]  # noqa: E731

    # Changing the tokens of block 2 leaves blocks 0 and 1 alone and changes block 2.
    embeds = inputs["block_embeds"].clone()
    embeds[0, 2 * BLOCK : 3 * BLOCK] += 1.0
    out = model(**(inputs | {"block_embeds": embeds}))
    torch.testing.assert_close(block(out, 0), block(base, 0), atol=0, rtol=0)
    torch.testing.assert_close(block(out, 1), block(base, 1), atol=0, rtol=0)
    assert (block(out, 2) - block(base, 2)).abs().max() > 1e-2

    # Block 1 is anchored at 6: the feature at position 6 (its anchor) is invisible to it,
    # the feature at position 5 is visible.
    for position, visible in ((6, False), (7, False), (5, True)):
        features = inputs["context_features"].clone()
        features[0, position] += 1.0
        out = model(**(inputs | {"context_features": features}))
        change = (block(out, 1) - block(base, 1)).abs().max()
        assert (change > 1e-2) if visible else (change == 0), (position, change)

    # Block 2's private features (context slots 8, 9) reach block 2 only.
    features = inputs["context_features"].clone()
    features[0, 8] += 1.0
    out = model(**(inputs | {"context_features": features}))
    assert torch.equal(out[0, : 2 * BLOCK], base[0, : 2 * BLOCK])
    assert (block(out, 2) - block(base, 2)).abs().max() > 1e-2


def test_forward_rejects_wrong_shapes():
    model = tiny_model()
    inputs = forward_inputs(model)
    with pytest.raises(ValueError, match="attention_mask"):
        model(**(inputs | {"attention_mask": inputs["attention_mask"][:, :, :, 1:]}))
    with pytest.raises(ValueError, match="context_features"):
        model(**(inputs | {"context_features": inputs["context_features"][..., :HIDDEN]}))


def test_context_kv_cache_matches_full_forward():
    """Decoding's cached path (context keys/values projected in chunks as tokens are committed, then
    one block on top) equals forward() over the whole context with the all-visible one-block mask."""
    model = tiny_model(seed=3)
    generator = torch.Generator().manual_seed(4)
    num_context = 13
    features = torch.randn(1, num_context, 3 * HIDDEN, generator=generator)
    block_embeds = torch.randn(1, BLOCK, HIDDEN, generator=generator)
    block_positions = torch.arange(num_context, num_context + BLOCK)[None]
    with torch.no_grad():
        cache = None
        for start, stop in [(0, 6), (6, 7), (7, num_context)]:  # prompt, then rounds of 1 and 6 tokens
            cache = model.extend_context_cache(
                cache, context_features=features[:, start:stop], context_positions=torch.arange(start, stop)[None]
            )
        assert cache.length == num_context and len(cache.keys) == model.config.num_hidden_layers
        cached = model.forward_cached(cache=cache, block_embeds=block_embeds, block_positions=block_positions)
        full = model(
            context_features=features,
            context_positions=torch.arange(num_context)[None],
            block_embeds=block_embeds,
            block_positions=block_positions,
            attention_mask=torch.ones((1, 1, BLOCK, num_context + BLOCK), dtype=torch.bool),
        )
        # A cache one position short must not give the same answer (the check can fail).
        short = model.forward_cached(
            cache=model.extend_context_cache(
                None, context_features=features[:, :-1], context_positions=torch.arange(num_context - 1)[None]
            ),
            block_embeds=block_embeds,
            block_positions=block_positions,
        )
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
    assert (short - full).abs().max() > 1e-3


# --------------------------------------------------------------------------- parity with HF Qwen3


def hf_qwen3_config(config: DFlashConfig):
    """HF's Qwen3Config read from the drafter's config.json (`to_hf_dict`), as an export is loaded."""
    from transformers import Qwen3Config

    return Qwen3Config.from_dict({**config.to_hf_dict(), "attn_implementation": "eager"})


def test_block_without_context_matches_hf_qwen3_layers():
    """No visible context: the drafter is a bidirectional Qwen3 decoder stack plus a final norm."""
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3DecoderLayer,
        Qwen3RMSNorm,
        Qwen3RotaryEmbedding,
    )

    model = tiny_model()
    hf_config = hf_qwen3_config(model.config)
    hf_layers = [Qwen3DecoderLayer(hf_config, i) for i in range(2)]
    for hf_layer, layer in zip(hf_layers, model.layers):
        hf_layer.load_state_dict(layer.state_dict())
    hf_norm = Qwen3RMSNorm(HIDDEN, eps=hf_config.rms_norm_eps)
    hf_norm.load_state_dict(model.norm.state_dict())

    torch.manual_seed(1)
    num_context = 3
    block_embeds = torch.randn(1, BLOCK, HIDDEN)
    block_positions = torch.arange(100, 100 + BLOCK)[None]
    mask = torch.zeros(1, 1, BLOCK, num_context + BLOCK, dtype=torch.bool)
    mask[..., num_context:] = True  # the block sees itself, never the context
    ours = model(
        context_features=torch.randn(1, num_context, 3 * HIDDEN),
        context_positions=torch.arange(num_context)[None],
        block_embeds=block_embeds,
        block_positions=block_positions,
        attention_mask=mask,
    )

    position_embeddings = Qwen3RotaryEmbedding(hf_config)(block_embeds, block_positions)
    h = block_embeds
    for hf_layer in hf_layers:
        # attention_mask None with eager attention = every query sees every key (bidirectional).
        h = hf_layer(h, attention_mask=None, position_ids=block_positions, position_embeddings=position_embeddings)
    torch.testing.assert_close(ours, hf_norm(h), atol=1e-5, rtol=1e-5)


def test_context_keys_match_hf_attention_over_prepended_tokens():
    """Context K/V go through k_proj, k_norm and RoPE at their own positions, like block keys.

    One drafter attention over [ctx; x] must equal HF Qwen3Attention run on the concatenated
    sequence (all keys visible), read at the block rows.
    """
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3RotaryEmbedding

    from drafter.model import rope_cos_sin

    model = tiny_model()
    attn = model.layers[0].self_attn
    hf_config = hf_qwen3_config(model.config)
    hf_attn = Qwen3Attention(hf_config, 0)
    hf_attn.load_state_dict(attn.state_dict())

    torch.manual_seed(2)
    num_context = 5
    ctx = torch.randn(1, num_context, HIDDEN)
    x = torch.randn(1, BLOCK, HIDDEN)
    context_positions = torch.tensor([[3, 4, 5, 6, 7]])
    block_positions = torch.arange(8, 8 + BLOCK)[None]
    all_positions = torch.cat([context_positions, block_positions], dim=1)
    theta, d = model.config.rope_theta, model.config.head_dim
    ours = attn(
        x,
        ctx,
        rope_q=rope_cos_sin(block_positions, head_dim=d, theta=theta, dtype=x.dtype),
        rope_kv=rope_cos_sin(all_positions, head_dim=d, theta=theta, dtype=x.dtype),
        attention_mask=torch.ones(1, 1, BLOCK, num_context + BLOCK, dtype=torch.bool),
    )
    sequence = torch.cat([ctx, x], dim=1)
    hf_out, _ = hf_attn(
        sequence,
        position_embeddings=Qwen3RotaryEmbedding(hf_config)(sequence, all_positions),
        attention_mask=None,
    )
    torch.testing.assert_close(ours, hf_out[:, num_context:], atol=1e-5, rtol=1e-5)
