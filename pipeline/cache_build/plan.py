"""What a cache build resolves before it writes anything, resolved once into one frozen `BuildPlan`
(docs/design.md, "A cache build"): the corpus's one local copy and its hash, the target's config
and hash, the tapped layers, the evaluation split's prompts (checked, budgeted), the settings the manifest records, the compute `auto` resolves to,
the tokenizer, stop and mask tokens, the vision inputs, and what a resume must match (the
previous manifest, whether --overwrite replaces it, whether the tokenized corpus is reused).

`plan_build` reads --out but writes nothing there: a refused setting, a missing corpus or a bad
mask token leaves --out as it was. The driver (pipeline.cache_build.driver) runs the plan.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drafter.config import default_target_layer_ids
from pipeline.cache_build.config import CacheBuildConfig, vision_cache_settings
from pipeline.cache_build.corpus import CORPUS_FILES, changed_corpus_images, corpus_vision_inputs
from pipeline.chat import iter_corpus_rows
from pipeline.corpus_source import file_sha256, local_corpus
from pipeline.eval.split import SplitPlan, plan_eval_split
from pipeline.target import (
    load_tokenizer,
    read_generation_config,
    read_target_config,
    resolve_mask_token_id,
    stop_token_ids,
    target_hash,
)
from pipeline.vision import VisionInputs
from storage.format import CORPUS_DIR
from storage.location import Location, resolve
from storage.manifest import CacheSettings, Manifest, previous_manifest
from storage.ownership import foreign_files, is_cache_dir


@dataclass(frozen=True, kw_only=True)
class BuildPlan:
    """Everything a build resolved before it claims --out; the driver and the workers read it."""

    config: CacheBuildConfig  # the taps resolved (config.run.layer_ids)
    out: Location
    started: float  # time.time() when planning began: the summary's elapsed time counts from here
    corpus_copy: Path  # the build's one local copy of --corpus: settings.corpus_hash is its hash
    target_config: dict[str, Any]
    settings: CacheSettings  # what the manifest records: target and corpus hash, layer ids, ...
    compute: dict[str, str]  # device and dtype every worker must compute in (`auto` resolved here)
    tokenizer: Any
    stop_ids: list[int]
    mask_token_id: int
    vision: VisionInputs | None  # None for a text target
    previous: Manifest | None  # the manifest to resume from
    replaced: Manifest | None  # the manifest of the cache --overwrite replaces: its files are removed first
    reuse_corpus: bool  # the tokenized corpus of the previous build is kept
    had_cache: bool  # --out held a cache (or a build's claim) before this build
    created: bool  # --out did not exist before this build
    eval_split: SplitPlan | None = None  # --eval-prompts read, checked and budgeted (pipeline/eval/split.py)

    @property
    def vocab_size(self) -> int:
        return int(self.target_config["vocab_size"])


def plan_build(config: CacheBuildConfig, *, log=print) -> BuildPlan:
    """Resolve the build of `config`, refusing (one line) a missing corpus, bad taps or mask token,
    a changed setting without --overwrite, or a corpus folder holding foreign files. The corpus
    and its vision inputs are resolved first, then the target, then what --out holds."""
    started = time.time()
    # One local copy of the corpus per build (a store corpus: this node's copy, fetched once): its
    # hash identifies the cache and its rows are tokenized, so both come from the same bytes.
    corpus_copy = local_corpus(config.corpus.path)
    iter_corpus_rows(corpus_copy)  # a missing or unreadable corpus stops here, before --out is touched
    corpus_hash = file_sha256(corpus_copy)
    vision = corpus_vision_inputs(config.target, config.corpus)  # None for a text target
    vision_settings = vision_cache_settings(config, vision=vision)
    compute = config.compute.planned_compute()
    init = drafter_init_config(config.taps.drafter_init)  # read once: its taps and its mask token
    content = content_settings(config)
    mask_token = requested_mask_token(config, init=init)
    target_config = read_target_config(config.target)
    tokenizer = load_tokenizer(config.target)
    stop_ids = stop_token_ids(tokenizer, read_generation_config(config.target))
    mask_token_id = resolve_mask_token_id(
        tokenizer, vocab_size=int(target_config["vocab_size"]), mask_token=mask_token, stop_ids=stop_ids, target=config.target
    )
    settings_target_hash = target_hash(config.target)
    check_init_mask_token(config, mask_token_id, init=init)
    layer_ids = resolve_layer_ids(config, num_target_layers=int(target_config["num_hidden_layers"]), init=init)
    config = config.with_taps(layer_ids)
    split = config.eval_split
    eval_split = None if split.eval_prompts is None else plan_eval_split(
        split.eval_prompts, target=config.target, tokenizer=tokenizer, max_new_tokens=split.eval_max_new_tokens,
        max_prompts=split.eval_max_prompts, corpus=corpus_copy, log=log,
    )  # fmt: skip
    settings = CacheSettings(
        target_hash=settings_target_hash, layer_ids=layer_ids, corpus_hash=corpus_hash, **content, **vision_settings
    )
    # What --out holds, read before anything is decided about it.
    out = resolve(config.out)
    had_cache, created, corpus_dir = is_cache_dir(out), not out.exists(), out.child(CORPUS_DIR)
    has_corpus, foreign = corpus_dir.is_dir(), foreign_files(corpus_dir, CORPUS_FILES)
    previous, replaced = previous_manifest(
        out, settings, mask_token_id=mask_token_id, compute=compute, overwrite=config.overwrite,
        target_dtype=config.compute.target_dtype,
    )  # fmt: skip
    if previous is not None and config.overwrite and (changed := changed_corpus_images(corpus_dir, vision=vision)):
        # What the stage-1 worker's error tells the user to rerun with --overwrite for (docs/vision.md).
        log(f"--overwrite: {len(changed)} image(s) changed since the corpus was tokenized ({changed[0]}, ...); replacing the cache")
        previous, replaced = None, previous  # the tokenized corpus and its shards are stale: start over
    reuse_corpus = previous is not None and has_corpus
    if foreign and not reuse_corpus:
        raise ValueError(
            f"{corpus_dir}: holds files a cache build did not write ({', '.join(foreign[:3])}); move them or use another --out"
        )
    return BuildPlan(
        config=config, out=out, started=started, corpus_copy=corpus_copy, target_config=target_config, settings=settings,
        compute=compute, tokenizer=tokenizer, stop_ids=stop_ids, mask_token_id=mask_token_id, vision=vision,
        previous=previous, replaced=replaced, reuse_corpus=reuse_corpus, had_cache=had_cache, created=created,
        eval_split=eval_split,
    )  # fmt: skip


def drafter_init_config(drafter_init: str | None) -> dict:
    """The dflash_config of --drafter-init's config.json ({} without --drafter-init): its taps and
    mask token are the build's defaults."""
    if drafter_init is None:
        return {}
    path = Path(drafter_init) / "config.json"
    if not path.is_file():
        raise ValueError(f"--drafter-init {drafter_init}: no config.json")
    return json.loads(path.read_text()).get("dflash_config") or {}


def resolve_layer_ids(config: CacheBuildConfig, *, num_target_layers: int, init: dict | None = None) -> list[int]:
    """Tapped layers: --layers, else the taps of --drafter-init (`init`: drafter_init_config, read
    here when not given), else the rule of docs/design.md ("The drafter") for --draft-layers
    (default 1 draft layer when nothing is given)."""
    taps = config.taps
    if taps.layers is not None:
        layer_ids = list(taps.layers)
    elif taps.drafter_init is not None:
        layer_ids = (drafter_init_config(taps.drafter_init) if init is None else init).get("target_layer_ids")
        if layer_ids is None:
            raise ValueError(f"{Path(taps.drafter_init) / 'config.json'}: no dflash_config.target_layer_ids")
    else:
        layer_ids = default_target_layer_ids(num_target_layers=num_target_layers, num_draft_layers=taps.draft_layers or 1)
    bad = [i for i in layer_ids if not 0 <= i < num_target_layers - 1]
    if bad:
        # The last layer's output in HF hidden_states is after the final norm, not a residual tap.
        raise ValueError(f"--layers: ids {bad} out of range for a {num_target_layers}-layer target (0..{num_target_layers - 2})")
    return [int(i) for i in layer_ids]


def resolve_build_mask_token_id(
    config: CacheBuildConfig, tokenizer, *, vocab_size: int, stop_ids: list[int], init: dict | None = None
) -> int:
    """The cache's mask token (pipeline.target.resolve_mask_token_id). A --drafter-init head was
    trained with its own mask token, which the drafter keeps: it is the default, and another
    --mask-token is refused (docs/design.md, "The target"). `init`: drafter_init_config, read here
    when not given."""
    init = drafter_init_config(config.taps.drafter_init) if init is None else init
    mask_token_id = resolve_mask_token_id(
        tokenizer, vocab_size=vocab_size, mask_token=requested_mask_token(config, init=init), stop_ids=stop_ids,
        target=config.target,
    )  # fmt: skip
    check_init_mask_token(config, mask_token_id, init=init)
    return mask_token_id


def requested_mask_token(config: CacheBuildConfig, *, init: dict) -> str | None:
    """--mask-token, else the mask token id of --drafter-init (`init`: drafter_init_config), else
    None (pipeline.target.resolve_mask_token_id's default)."""
    init_mask = init.get("mask_token_id")
    return config.mask_token if config.mask_token is not None or init_mask is None else str(init_mask)


def check_init_mask_token(config: CacheBuildConfig, mask_token_id: int, *, init: dict) -> None:
    """Refuse a --mask-token that resolves to another id than --drafter-init's (`init`)."""
    init_mask = init.get("mask_token_id")
    if init_mask is not None and mask_token_id != init_mask:
        raise ValueError(
            f"--mask-token {config.mask_token} (id {mask_token_id}) is not the mask token of --drafter-init "
            f"{config.taps.drafter_init} (dflash_config.mask_token_id {init_mask}); leave --mask-token out to use it"
        )


def content_settings(config: CacheBuildConfig) -> dict[str, Any]:
    """The CacheSettings fields `config` gives as it is: every flag that changes the cache's
    content. The inputs' hashes, the taps and the vision settings are resolved by plan_build."""
    run, storage, corpus = config.run, config.storage, config.corpus
    return {
        **{name: getattr(run, name) for name in ("num_slots", "top_k", "anchors_per_sequence", "seed")},
        **{name: getattr(corpus, name) for name in ("max_length", "min_supervised_tokens", "skip_bad_rows")},
        **{name: getattr(storage, name) for name in ("storage_format", "shard_size")},
        "contents": config.contents,
        "backend": config.compute.backend,
        **config.layout,  # codecs, --ira-parents, --compact (format version 2 when set)
    }
