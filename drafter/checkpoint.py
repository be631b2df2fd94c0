"""Drafter checkpoints of every family: config.json + model.safetensors (docs/design.md, "The drafter").

The family (drafter/families.py) decides the contract: its config's `to_hf_dict` / `from_hf_dict`,
found by the `architectures` a config.json names. Tensor names carry no `model.` prefix and there is
no embedding or lm_head; a DFlash directory loads in the public DFlash code, SGLang and vLLM, and a
public release loads here. Like the public releases, an export ships its family's modeling code
(for DFlash `modeling_dflash.py` + the drafter's own model and config files) with an `auto_map`, so
`AutoModel.from_pretrained(dir, trust_remote_code=True)` returns the drafter (drafter/hf_modeling.py).
Every file is written atomically (storage/atomic.py), so a reader never sees a half-written one.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from drafter.calibration import CALIBRATION_FILE, calibration_file
from drafter.config import DFlashConfig
from drafter.families import families, family_of, family_of_hf_config
from storage.atomic import atomic_write  # the one storage module drafter/ uses (tests/test_boundaries.py)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"

# Releases (and an export for readers that use the drafter's own, `save_drafter(head=...)`) may ship
# the target's embedding / head next to the drafter; the drafter uses the target's own copies, so
# these are skipped rather than refused.
IGNORED_TENSORS = frozenset({"embed_tokens.weight", "lm_head.weight"})



def exported_file_names() -> set[str]:
    """Every modeling file name an export of a registered family ships (what a run's drafter/ may hold)."""
    return {shipped for family in families() for _, shipped in family.modeling_files}

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype}")


def _save_weights(tensors: dict[str, torch.Tensor], tmp: str, *, shown: Path) -> None:
    """safetensors' save_file, whose failed write (a full disk, a quota) is a SafetensorError holding
    the OS error's code ("... No space left on device (os error 28)"): raised as that OSError, naming the file,
    so a command says it in one line (found by benchmarks/harness/chaos.py; docs/failure-modes.md)."""
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
    except Exception as error:
        code = re.search(r"(?:os error |Os \{ code: )(\d+)", str(error))
        if isinstance(error, OSError) or code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(shown)) from None


def save_drafter(model, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16, head: dict | None = None,
                 calibration: dict | None = None) -> None:  # fmt: skip
    """Write config.json, model.safetensors (weights cast to dtype, the family's `float32_tensors`
    kept in float32) and the family's modeling code into out_dir, in the family's contract (DFlash:
    the public releases'; DSpark: DeepSpec's Qwen3DSparkModel). `head`: the target's
    `embed_tokens.weight` / `lm_head.weight`, written too for readers that use the drafter's own
    (loading skips them, IGNORED_TENSORS). `calibration`: the confidence prediction's per-slot
    temperatures fitted on a split (drafter/calibration.py), written into config.json
    (`sts_temperatures`, a field of every config that predicts acceptance) and as CALIBRATION_FILE."""
    family = family_of(model)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype_name = _dtype_name(dtype)
    tensors = {
        name: t.detach().to(device="cpu", dtype=_stored_dtype(name, dtype, family=family)).contiguous()
        for name, t in model.state_dict().items()
    }
    for name in sorted(head or {}):
        if name not in IGNORED_TENSORS:
            raise ValueError(f"save_drafter: head tensor {name!r} is none of {sorted(IGNORED_TENSORS)}")
        tensors[name] = head[name].detach().to(device="cpu", dtype=dtype).contiguous()
    config = model.config
    if calibration is not None:
        config = dataclasses.replace(config, sts_temperatures=list(calibration["temperatures"]))
    hf = config.to_hf_dict()
    hf["dtype"] = dtype_name
    hf["torch_dtype"] = dtype_name  # what transformers 4.x (the public DFlash code's pin) reads
    if family.auto_map is not None:
        hf["auto_map"] = dict(family.auto_map)  # the export ships its modeling code, as public releases do
    code = {name: _exported_code(source, files=family.modeling_files) for source, name in family.modeling_files}
    # Weights and code first, config last: a directory whose config.json is new has new weights.
    atomic_write(out_dir / WEIGHTS_FILE, lambda tmp: _save_weights(tensors, tmp, shown=out_dir / WEIGHTS_FILE))
    for name, text in code.items():
        atomic_write(out_dir / name, lambda tmp, text=text: Path(tmp).write_text(text))
    if calibration is not None:
        payload = json.dumps(calibration_file(calibration), indent=2) + "\n"
        atomic_write(out_dir / CALIBRATION_FILE, lambda tmp: Path(tmp).write_text(payload))

    def write_config(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(hf, f, indent=2, sort_keys=True)
            f.write("\n")

    atomic_write(out_dir / CONFIG_FILE, write_config)


def _stored_dtype(name: str, dtype: torch.dtype, *, family) -> torch.dtype:
    """A weight's dtype in the export and once loaded: float32 for the family's `float32_tensors`."""
    return torch.float32 if family.float32_tensors and name.startswith(family.float32_tensors) else dtype


def as_exported(model, dtype: torch.dtype):
    """`model` as its export at `dtype` (`save_drafter`) loads back in float32: every weight rounded
    to its stored dtype and back (the model itself when `dtype` is float32: that changes nothing)."""
    if dtype == torch.float32:
        return model
    exported, family = copy.deepcopy(model), family_of(model)
    for name, tensor in exported.state_dict().items():
        tensor.copy_(tensor.to(_stored_dtype(name, dtype, family=family)).float())
    return exported


def _exported_code(source: str, *, files: tuple[tuple[str, str], ...]) -> str:
    """A drafter module as the checkpoint ships it: imports of its shipped siblings (absolute or
    relative) made relative to the checkpoint's own file names."""
    code = (Path(__file__).parent / source).read_text()
    for sibling, shipped in files:
        module, renamed = sibling.removesuffix(".py"), shipped.removesuffix(".py")
        for form in (f"from drafter.{module} import", f"from .{module} import"):
            code = code.replace(form, f"from .{renamed} import")
    return code


def _weight_files(path: Path) -> list[Path]:
    single = path / WEIGHTS_FILE
    if single.exists():
        return [single]
    index = path / WEIGHTS_INDEX_FILE
    if index.exists():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
        # The index is a downloaded file: its names must stay files of this directory.
        bad = [n for n in names if not isinstance(n, str) or n != Path(n).name or n in ("", ".", "..")]
        if bad:
            raise ValueError(f"{index}: weight file {bad[0]!r} is not a file name in {path}")
        return [path / name for name in names]
    raise ValueError(f"{path} has neither {WEIGHTS_FILE} nor {WEIGHTS_INDEX_FILE}")


def _read_weights(file: Path, *, expected: dict, state: dict, device, dtype: torch.dtype, family) -> None:
    """Add the tensors of one safetensors file to `state`, checked against the model's names and
    shapes, each in `dtype` (the family's `float32_tensors` in float32)."""
    with safe_open(file, framework="pt", device="cpu") as f:
        for raw_name in f.keys():
            name = raw_name.removeprefix("model.")
            if name in IGNORED_TENSORS:
                continue
            if name not in expected:
                raise ValueError(f"{file}: unexpected tensor {raw_name!r}")
            if name in state:
                raise ValueError(f"{file}: tensor {name!r} appears twice")
            tensor = f.get_tensor(raw_name)
            if tuple(tensor.shape) != expected[name]:
                raise ValueError(f"{file}: tensor {raw_name!r} has shape {tuple(tensor.shape)}, expected {expected[name]}")
            state[name] = tensor.to(device=device, dtype=_stored_dtype(name, dtype, family=family))


def drafter_hash(path: str | os.PathLike) -> str:
    """"sha256:<hex>" of a drafter directory's config and weights files (names and bytes): what an
    evaluation records to say which drafter produced its numbers (pipeline/outputs.py)."""
    path = Path(path)
    digest = hashlib.sha256()
    for file in [path / CONFIG_FILE, *_weight_files(path)]:
        digest.update(file.name.encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def read_drafter_config(path: str | os.PathLike):
    """(family, checked config) of a drafter directory's config.json, its `architectures` deciding
    the family; no weights are read."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.exists():
        raise ValueError(f"{config_path} does not exist")
    with open(config_path) as f:
        hf = json.load(f)
    family = family_of_hf_config(hf)
    return family, family.config_class.from_hf_dict(hf)


def load_drafter(path: str | os.PathLike, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
    """Load a drafter directory (ours, a public DFlash release, or another family's checkpoint: its
    config's architectures decide); dtype None = the config's."""
    path = Path(path)
    family, config = read_drafter_config(path)
    if dtype is None:
        dtype = _DTYPES[config.dtype]

    with torch.device("meta"):
        model = family.model_class(config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}

    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        try:
            _read_weights(file, expected=expected, state=state, device=device, dtype=dtype, family=family)
        except (SafetensorError, OSError) as error:  # truncated or overwritten: one line, not a traceback
            raise ValueError(f"{file}: damaged weights file ({(str(error).strip().splitlines() or [type(error).__name__])[0]}); copy or export the drafter again") from None
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{path}: missing tensors {missing}")
    model.load_state_dict(state, assign=True)
    model.config.dtype = _dtype_name(dtype)
    return model


def check_compatible(
    config: DFlashConfig,
    *,
    target_layer_ids: list[int],
    hidden_size: int,
    vocab_size: int,
    block_size: int,
) -> None:
    """ValueError (one line) if a drafter cannot consume features from a cache with these settings."""
    if list(config.target_layer_ids) != list(target_layer_ids):
        raise ValueError(
            f"drafter target_layer_ids {config.target_layer_ids} differ from the cache's "
            f"{list(target_layer_ids)}"
        )
    if config.hidden_size != hidden_size:
        raise ValueError(f"drafter hidden_size {config.hidden_size} differs from the target's {hidden_size}")
    if config.vocab_size != vocab_size:
        raise ValueError(f"drafter vocab_size {config.vocab_size} differs from the target's {vocab_size}")
    if config.block_size != block_size:
        raise ValueError(f"drafter block_size {config.block_size} differs from the cache's {block_size}")
