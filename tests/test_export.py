"""An exported drafter loads like a public DFlash release: `AutoModel.from_pretrained(dir,
trust_remote_code=True)` gives the drafter with no missing or unexpected keys and the same
outputs, under the project's transformers and under 4.57 (the public DFlash code's pin)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from drafter.checkpoint import save_drafter
from drafter.config import DFlashConfig
from drafter.masks import visibility_mask
from drafter.model import DFlashDrafter
from tests.waits import HANG_CAP_S, run_to_end

ROOT = Path(__file__).resolve().parents[1]
TRANSFORMERS_457 = ROOT / ".venv" / "transformers-4.57"  # installed by .ci/install

# Runs in a fresh interpreter so the transformers on its path is the one under test.
CHECK = r"""
import json, sys, torch, transformers
from transformers import AutoModel
path, inputs_path = sys.argv[1], sys.argv[2]
kwargs = {"dtype": torch.float32} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": torch.float32}
model, info = AutoModel.from_pretrained(path, trust_remote_code=True, output_loading_info=True, **kwargs)
inputs = torch.load(inputs_path)
with torch.no_grad():
    hidden = model(**inputs)
torch.save(hidden, inputs_path + ".out")
print(json.dumps({"version": transformers.__version__, "class": type(model).__name__,
                  "missing": sorted(info["missing_keys"]), "unexpected": sorted(info["unexpected_keys"]),
                  "keys": sorted(model.state_dict())}))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    config = DFlashConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=300, max_position_embeddings=512, num_target_layers=4, target_layer_ids=[0, 2],
        mask_token_id=299, block_size=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = DFlashDrafter(config).eval()
    out = tmp_path_factory.mktemp("export") / "drafter"
    save_drafter(model, out, dtype=torch.float32)
    num_context, block = 6, config.block_size
    inputs = dict(
        context_features=torch.randn(1, num_context, 2 * 64),
        context_positions=torch.arange(num_context)[None],
        block_embeds=torch.randn(1, block, 64),
        block_positions=torch.arange(num_context, num_context + block)[None],
        attention_mask=visibility_mask(
            context_positions=torch.arange(num_context)[None], context_owner=torch.full((1, num_context), -1),
            context_valid=torch.ones(1, num_context, dtype=torch.bool), block_corpus_limit=torch.tensor([[num_context]]),
            block_valid=torch.ones(1, 1, dtype=torch.bool), block_size=block,
        ),
    )  # fmt: skip
    torch.save(inputs, out.parent / "inputs.pt")
    with torch.no_grad():
        expected = model(**inputs)
    return out, out.parent / "inputs.pt", expected, set(model.state_dict())


def _load_with_automodel(path: Path, inputs: Path, *, extra_path: Path | None = None) -> tuple[dict, torch.Tensor]:
    # Outside the repository and without it on the path: the export must carry all its code.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    result = run_to_end([sys.executable, "-c", CHECK, str(path), str(inputs)], cap_s=HANG_CAP_S, env=env, cwd=path.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), torch.load(str(inputs) + ".out")


def test_export_ships_auto_map_and_its_modeling_code(exported):
    out, _, _, _ = exported
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert {p.name for p in out.iterdir()} >= {"modeling_dflash.py", "dflash_model.py", "dflash_config.py"}
    for name in ("modeling_dflash.py", "dflash_model.py", "dflash_config.py"):
        assert "drafter" not in "".join(l for l in (out / name).read_text().splitlines() if l.startswith(("from ", "import ")))


def test_automodel_loads_the_drafter_with_the_projects_transformers(exported):
    out, inputs, expected, keys = exported
    info, hidden = _load_with_automodel(out, inputs)
    assert info["class"] == "DFlashDraftModel" and info["version"].startswith("5.")
    assert info["missing"] == [] and info["unexpected"] == [] and set(info["keys"]) == keys
    torch.testing.assert_close(hidden, expected, rtol=0, atol=1e-6)


@pytest.mark.skipif(not TRANSFORMERS_457.is_dir(), reason=f"transformers 4.57 not installed at {TRANSFORMERS_457} (.ci/install puts it there)")
def test_automodel_loads_the_drafter_with_transformers_4_57(exported):
    out, inputs, expected, keys = exported
    info, hidden = _load_with_automodel(out, inputs, extra_path=TRANSFORMERS_457)
    assert info["class"] == "DFlashDraftModel" and info["version"].startswith("4.57")
    assert info["missing"] == [] and info["unexpected"] == [] and set(info["keys"]) == keys
    torch.testing.assert_close(hidden, expected, rtol=0, atol=1e-6)
