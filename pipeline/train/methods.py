"""The objectives as recipes: one row per method, read by the label builder (pipeline/train/labels.py)
and by the trainer's check that a cache can serve a method (docs/design.md, "The method").

A recipe says where a block's labels come from (the corpus pass or the greedy rollouts), which gate
weights its slots, whether IRA moves blocks into rollouts (or only caps slots like it, the
slot-matched control), which slot envelope it uses, and so which cache arrays it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from storage.format import ANCHOR_ARRAYS, TOKEN_ARRAYS

LABEL_SOURCES = ("corpus", "rollout")
CORPUS_GATES = (None, "soft", "hard")  # erase: p_T(x[a+j]); erase_hard: x[a+j] == argmax
IRA_MODES = (None, "secondaries", "caps")  # alr_ira moves blocks; slot_control only caps slots


@dataclass(frozen=True, kw_only=True)
class MethodRecipe:
    name: str
    label_source: str  # "corpus" or "rollout"
    one_hot_labels: bool = False  # dflash: the corpus token itself, not the target's top-k
    corpus_gate: str | None = None
    rollout_gate: bool = False  # alr_gate: prod of the rollout's own top-1 probabilities
    ira: str | None = None
    dflash_envelope: bool = False  # the DFlash baseline's own (slower) slot decay

    def __post_init__(self):
        if self.label_source not in LABEL_SOURCES:
            raise ValueError(f"{self.name}: label_source must be one of {LABEL_SOURCES}")
        if self.corpus_gate not in CORPUS_GATES or self.ira not in IRA_MODES:
            raise ValueError(f"{self.name}: corpus_gate must be one of {CORPUS_GATES}, ira one of {IRA_MODES}")
        if self.label_source == "rollout" and self.corpus_gate is not None:
            # A corpus gate scores the corpus continuation, which rollout labels do not follow.
            raise ValueError(f"{self.name}: a corpus gate cannot weight rollout labels")

    @property
    def arrays(self) -> frozenset[str]:
        """Cache arrays (storage/format.py names) training with this recipe reads; fp8 scale arrays
        follow their feature arrays."""
        arrays = {"input_ids", "loss_mask", "features", "anchor_pos"}
        if self.label_source == "corpus" and not self.one_hot_labels:
            arrays |= {"corpus_topk_ids", "corpus_topk_probs"}
        if self.corpus_gate == "soft":
            arrays.add("corpus_next_prob")
        if self.label_source == "rollout":
            arrays |= {"rollout_tokens", "rollout_topk_ids", "rollout_topk_probs"}
        if self.ira == "secondaries":
            arrays.add("rollout_features")  # a secondary block sees its parent's y*[1..j-1]
        return frozenset(arrays)


RECIPES: dict[str, MethodRecipe] = {
    recipe.name: recipe
    for recipe in (
        MethodRecipe(name="dflash", label_source="corpus", one_hot_labels=True, dflash_envelope=True),
        MethodRecipe(name="kd", label_source="corpus"),
        MethodRecipe(name="erase", label_source="corpus", corpus_gate="soft"),
        MethodRecipe(name="erase_hard", label_source="corpus", corpus_gate="hard"),
        MethodRecipe(name="alr", label_source="rollout"),
        MethodRecipe(name="alr_gate", label_source="rollout", rollout_gate=True),
        MethodRecipe(name="alr_ira", label_source="rollout", ira="secondaries"),
        MethodRecipe(name="slot_control", label_source="rollout", ira="caps"),
    )
}
METHODS = tuple(RECIPES)
CORPUS_METHODS = tuple(m for m, r in RECIPES.items() if r.label_source == "corpus")
ROLLOUT_METHODS = tuple(m for m, r in RECIPES.items() if r.label_source == "rollout")


def recipe(method: str) -> MethodRecipe:
    if method not in RECIPES:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    return RECIPES[method]


def required_arrays(method: str, *, distributions: bool = False) -> set[str]:
    """Cache arrays training with `method` reads. A drafter family whose blocks take the target's
    distribution beside every label (`BlockLayout.distributions`) makes one-hot dflash read the
    corpus pass's top-k too."""
    arrays = set(recipe(method).arrays)
    if distributions and recipe(method).one_hot_labels:
        arrays |= {"corpus_topk_ids", "corpus_topk_probs"}
    return arrays


def check_cache_serves(method: str, arrays: set[str], cache: str, *, arch: str, distributions: bool = False) -> None:
    """One line naming the arrays a cache lacks for `method` with the `arch` family (a --no-rollouts cache, say)."""
    missing = sorted(required_arrays(method, distributions=distributions) - set(arrays))
    if missing:
        raise ValueError(f"{cache}: --method {method} needs cache arrays that are missing: {', '.join(missing)} (with --arch {arch})")


def check_ira_parents_serve(objective, *, ira_parents: int | None, anchors_per_sequence: int) -> None:
    """One line refusing alr_ira on a cache that keeps rollout features for fewer anchors per
    sequence than a step draws parents (floor(m/2) of m anchors; docs/design.md, "The cache contract")."""
    if ira_parents is None or recipe(objective.method).ira != "secondaries":
        return
    per_step = min(objective.anchors_per_step or anchors_per_sequence, anchors_per_sequence)
    if ira_parents < per_step // 2:
        raise ValueError(
            f"--method {objective.method} draws {per_step // 2} IRA parents per sequence ({per_step} anchors per step) "
            f"but the cache keeps rollout features for {ira_parents} anchors per sequence (built with --ira-parents "
            f"{ira_parents}): train with --anchors-per-step <= {2 * ira_parents + 1}, or rebuild with more --ira-parents"
        )


# Every name above must be an array of the cache format (storage/format.py is their one home).
_unknown = set().union(*(r.arrays for r in RECIPES.values())) - set(TOKEN_ARRAYS + ANCHOR_ARRAYS)
assert not _unknown, f"method recipes name arrays the cache format does not define: {sorted(_unknown)}"
