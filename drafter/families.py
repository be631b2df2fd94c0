"""The drafter families alrira knows, by name (docs/design.md, "Drafter families").

A new family is its module (drafter/<name>.py, building a `DrafterFamily`) and one line in
`FAMILIES` below; nothing else in the project names it. `register` adds one at run time (a test's
toy family). Lookups: by `--arch` (`get_family`), by a checkpoint's config.json (`family_of_hf_config`),
by a model in memory (`family_of`, its exact class).
"""

from __future__ import annotations

from drafter.dflash import DFLASH
from drafter.dflash2 import DFLASH2
from drafter.dspark import DSPARK
from drafter.family import DrafterFamily

DEFAULT_FAMILY = DFLASH.name  # a run recorded before families existed trained this one

FAMILIES: dict[str, DrafterFamily] = {family.name: family for family in (DFLASH, DSPARK, DFLASH2)}


def register(family: DrafterFamily) -> DrafterFamily:
    """Add a family; its name, architecture and model class must be new (each lookup finds one)."""
    for known in FAMILIES.values():
        for what in ("name", "architecture", "model_class"):
            if getattr(known, what) == getattr(family, what):
                raise ValueError(f"drafter family {family.name!r}: its {what} is family {known.name!r}'s already")
    FAMILIES[family.name] = family
    return family


def get_family(name: str) -> DrafterFamily:
    if name not in FAMILIES:
        raise ValueError(f"--arch must be one of {', '.join(FAMILIES)}, got {name!r}")
    return FAMILIES[name]


def family_of_hf_config(hf: dict) -> DrafterFamily:
    """The family whose architecture a checkpoint's config.json names; DFlash's otherwise (some
    DFlash releases leave `architectures` out; DFlash's config check refuses any other name)."""
    architectures = hf.get("architectures") or []
    for family in FAMILIES.values():
        if family.architecture in architectures:
            return family
    return DFLASH


def family_of(model) -> DrafterFamily:
    """The family of a drafter in memory (through a DDP or torch.compile wrapper): the one whose model class it is."""
    model = getattr(model, "module", model)
    model = getattr(model, "_orig_mod", model)
    for family in FAMILIES.values():
        if type(model) is family.model_class:
            return family
    raise ValueError(f"{type(model).__name__} is no registered drafter family's model")


def families() -> list[DrafterFamily]:
    return list(FAMILIES.values())


def check_init(init: str, *, family: DrafterFamily, init_family: DrafterFamily, init_config, mask_token_id: int) -> None:
    """A --drafter-init the run can start from: the cache's mask token (its export would name the
    wrong one), and either the family's own checkpoint (its settings held against the run's by
    `resolve_options`) or one whose backbone the family starts from (`init_from`)."""
    if init_config.mask_token_id != mask_token_id:
        raise ValueError(
            f"--drafter-init {init}: its mask token {init_config.mask_token_id} is not the cache's {mask_token_id}; build the "
            f"cache with --mask-token {init_config.mask_token_id}"
        )
    if init_family is not family and init_family.name not in family.init_from:
        raise ValueError(f"--drafter-init {init} is a {init_family.title} drafter: train it with --arch {init_family.name}")
