"""Drafter families behind one interface (docs/design.md, "Drafter families"): nothing outside
drafter/ (and the demo) names a family, and a family registered in this test alone trains,
evaluates and exports end to end through the same commands as DFlash and DSpark."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from drafter.checkpoint import load_drafter
from drafter.config import ARCHITECTURE as DFLASH_ARCHITECTURE
from drafter.config import DFlashConfig
from drafter.dflash import DFLASH
from drafter.families import DEFAULT_FAMILY, FAMILIES, family_of, get_family, register
from drafter.family import BlockLayout, DrafterFamily
from drafter.model import DFlashDrafter

ROOT = Path(__file__).resolve().parents[1]
# The default family's name is also a method's (dflash) and its block is the cache's layout, so
# only its family object and module count as naming it.
MAX_FAMILY_LINES = 10


def _family_words() -> re.Pattern:
    """The default family's object and module (case-sensitive), every other family's name, title and
    architecture (any case)."""
    words = {r"\bDFLASH\b", r"drafter\.dflash\b"}
    for family in FAMILIES.values():
        if family.name != DEFAULT_FAMILY:
            words |= {f"(?i:{re.escape(word)})" for word in (family.name, family.title, family.architecture)}
    return re.compile("|".join(sorted(words)))


def test_outside_drafter_and_the_demo_at_most_ten_lines_name_a_family():
    pattern = _family_words()
    found = []
    for package in ("pipeline", "storage", "ray_jobs"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.is_relative_to(ROOT / "pipeline" / "demo"):
                continue
            for number, line in enumerate(path.read_text().splitlines(), start=1):
                if pattern.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert len(found) <= MAX_FAMILY_LINES, "lines outside drafter/ that name a drafter family:\n" + "\n".join(found)


def test_lookups_find_each_family_and_refuse_what_is_not_one():
    for family in FAMILIES.values():
        assert get_family(family.name) is family
    with pytest.raises(ValueError, match=r"--arch must be one of dflash, dspark.*got 'eagle'"):
        get_family("eagle")
    with pytest.raises(ValueError, match="its name is family 'dflash'"):
        register(dataclasses.replace(DFLASH, architecture="Other", model_class=type("Other", (DFlashDrafter,), {})))
    with pytest.raises(ValueError, match="no registered drafter family's model"):
        family_of(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------------------------
# A toy family, registered here only: DFlash's block and loss with a steeper slot envelope, its own
# config.json architecture and model class.

TOY_ARCHITECTURE = "ToyBlockDraftModel"
TOY_GAMMA = 0.5


@dataclasses.dataclass(kw_only=True)
class ToyConfig(DFlashConfig):
    def to_hf_dict(self) -> dict:
        return super().to_hf_dict() | {"architectures": [TOY_ARCHITECTURE]}

    @classmethod
    def from_hf_dict(cls, d: dict) -> ToyConfig:
        backbone = DFlashConfig.from_hf_dict(d | {"architectures": [DFLASH_ARCHITECTURE]})
        return cls(**{f.name: getattr(backbone, f.name) for f in dataclasses.fields(DFlashConfig)})


class ToyDrafter(DFlashDrafter):
    pass


def _toy_family() -> DrafterFamily:
    return DrafterFamily(
        name="toy", title="Toy", architecture=TOY_ARCHITECTURE, config_class=ToyConfig, model_class=ToyDrafter,
        draft=DFLASH.draft, head_loss=DFLASH.head_loss,
        layout=lambda options, *, num_slots: BlockLayout(block_size=num_slots + 1, num_labelled=num_slots, envelope_gamma=TOY_GAMMA),
        new_config=lambda backbone, options: ToyConfig(**{f.name: getattr(backbone, f.name) for f in dataclasses.fields(DFlashConfig)}),
        init_from=(DEFAULT_FAMILY,), own_envelope=True, tree_verification=True,
    )  # fmt: skip


@pytest.fixture
def toy_family():
    family = register(_toy_family())
    yield family
    del FAMILIES[family.name]


def test_a_train_config_with_every_familys_options_pickles():
    """A config crosses to a process pool (benchmarks/speed/paper.py trains arms in lanes): the
    family options' group, a class made from the registry, must pickle by its name."""
    import pickle

    from pipeline.train.config import TrainConfig

    for arch in FAMILIES:
        config = TrainConfig.from_flags(cache="/c", out="/o", method="alr_ira", arch=arch)
        assert pickle.loads(pickle.dumps(config)) == config


def test_a_family_registered_in_a_test_trains_evaluates_and_exports(toy_family, k7_cache, toy_target, tmp_path):
    from pipeline.eval.evaluate import EvalConfig, run_eval
    from pipeline.eval.replay import run_replay
    from pipeline.train import TrainConfig, train
    from pipeline.train.plan import open_run, plan_training
    from pipeline.train.setup import setup
    from tests.conftest import write_jsonl

    config = TrainConfig.from_flags(
        cache=str(k7_cache), out=str(tmp_path / "toy"), arch="toy", method="alr_ira", epochs=2, batch_size=2, num_workers=0,
        lr=3e-3, progress=False, save_dtype="float32",
    )  # fmt: skip
    # Its layout reaches the labels: every block's envelope is exp(-c / 0.5) (alr_ira's other factors
    # are 0 or 1), not the method's gamma of 2.
    weights = next(setup(plan_training(config, open_run(config))).batches).slot_weights  # [B, N, K]
    both = (weights[..., 0] > 0) & (weights[..., 1] > 0)
    ratios = weights[..., 1][both] / weights[..., 0][both]
    assert ratios.numel() and torch.allclose(ratios, torch.full_like(ratios, torch.e ** (-1 / TOY_GAMMA)), rtol=1e-5)

    summary = train(config)
    assert json.loads((tmp_path / "toy" / "train_config.json").read_text())["arch"] == "toy"
    assert summary["final_loss"] < summary["mean_loss_last_10pct"] * 10  # trained and logged
    exported = tmp_path / "toy" / "drafter"
    assert json.loads((exported / "config.json").read_text())["architectures"] == [TOY_ARCHITECTURE]
    assert "auto_map" not in json.loads((exported / "config.json").read_text())  # it ships no modeling code
    drafter = load_drafter(exported)
    assert type(drafter) is ToyDrafter and family_of(drafter) is toy_family

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"benchmark": "a", "prompt": "tell me a story about the river ."}])
    report = run_eval(EvalConfig(target=str(toy_target), drafter=str(exported), prompts=str(prompts), out=str(tmp_path / "eval"),
                                 max_new_tokens=24, device="cpu", dtype="float32", progress=False))  # fmt: skip
    assert report["arch"] == "toy" and report["lossless_mismatches"] == 0 and report["num_drafts"] == 7
    replayed = run_replay(target=str(toy_target), drafters={"toy": str(exported)}, prompts=str(prompts), out=str(tmp_path / "replay"),
                          max_new_tokens=24)  # fmt: skip
    assert replayed["toy"]["tau_pooled"] == pytest.approx(report["tau_pooled"], abs=1e-9)  # greedy replay equals decoding

    # It starts from a DFlash checkpoint's backbone (its init_from), and a DFlash run refuses its checkpoint.
    train(TrainConfig.from_flags(cache=str(k7_cache), out=str(tmp_path / "dflash"), method="alr", epochs=1, batch_size=2,
                                 num_workers=0, progress=False, save_dtype="float32"))  # fmt: skip
    train(dataclasses.replace(config, out=str(tmp_path / "from-dflash"), drafter=dataclasses.replace(
        config.drafter, drafter_init=str(tmp_path / "dflash" / "drafter")), max_steps=1))  # fmt: skip
    assert type(load_drafter(tmp_path / "from-dflash" / "drafter")) is ToyDrafter
    with pytest.raises(ValueError, match="is a Toy drafter: train it with --arch toy"):
        train(TrainConfig.from_flags(cache=str(k7_cache), out=str(tmp_path / "back"), method="alr", drafter_init=str(exported),
                                     num_workers=0, progress=False, batch_size=2))  # fmt: skip
