"""`alrira-cache build` without Ray: hash the inputs, tokenize the corpus once, export the target
head, plan shards, keep the manifest. The shards themselves are computed by a `run_shards`
function: `ray_jobs.build` passes one that runs a pool of Ray actors, `run_shards_here` computes
them in this process (tests, debugging).

Resume rule: a shard counts as done only if the manifest lists it complete AND its checksum still
verifies; everything else (missing, corrupt, leftover temp directories) is redone. Shard content
depends only on the settings and the shard's sequences, so a resumed cache is byte-identical to an
uninterrupted one (docs/design.md, "A cache build").

`--out` is a directory or an object-store URL (storage.location); on a store the same rules hold
with the manifest as the only publish step (docs/design.md, "Caches on object stores").
"""

from __future__ import annotations

import collections
import contextlib
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

import pipeline
from drafter.config import default_target_layer_ids
from pipeline.cache_build.config import CacheBuildConfig, vision_cache_settings
from pipeline.cache_build.corpus import (
    CORPUS_FILES,
    IMAGES_FILE,
    corpus_vision_inputs,
    ingest_corpus,
    load_tokenized_corpus,
    save_tokenized_corpus,
)
from pipeline.cache_build.shard_builder import BuildTimes, ShardBuilder
from pipeline.chat import iter_corpus_rows, row_locator
from pipeline.corpus_source import file_sha256, local_corpus
from pipeline.config import to_flags
from pipeline.outputs import check_cache_out, claim_cache, output_lock
from pipeline.provenance import append_provenance
from pipeline.target import (
    load_tokenizer,
    read_generation_config,
    read_target_config,
    read_target_head,
    resolve_mask_token_id,
    stop_token_ids,
    target_hash,
)
from pipeline.vision import changed_images
from storage.errors import DISK_FULL_ERRNOS
from storage.format import BUILD_PROVENANCE_FILE, CORPUS_DIR, MANIFEST_FILE, SHARD_COMPLETE, SHARD_DIR
from storage.location import Location, is_url, resolve
from storage.manifest import (
    CacheSettings,
    Manifest,
    ShardRecord,
    describe_compute,
    load_manifest,
    save_manifest,
    save_target_head,
    target_head_hash,
    settings_diff,
)
from storage.ownership import (
    CacheOwnershipLost,
    check_owner,
    foreign_files,
    is_cache_dir,
    remove_cache_files,
    remove_write_leftovers,
)
from storage.checksums import checksum_scheme, shard_checksum, shard_object_tags
from storage.shards import clean_partial_shards


@dataclass(kw_only=True)
class ShardSpec:
    """One shard's work: all that crosses a process boundary on the way out."""

    index: int
    start: int  # sequence range [start, stop) of the tokenized corpus
    stop: int
    owner: str  # the build's claim on the cache directory (storage.ownership.claim_cache)


# run_shards(config, pending specs, publish, progress=...): compute every pending shard, call
# publish(spec, record) as each one is written, and return the workers' BuildTimes (or None).
RunShards = Callable[..., BuildTimes | None]


class BuildProgress:
    """The build's progress bar over every worker: sequences as each batch reaches its shard's
    writer (workers report batches, docs/design.md "A cache build"), tokens/s and an ETA, shards
    published; and the workers' BuildTimes, summed as their shards come back."""

    def __init__(self, pending: list[ShardSpec], *, enabled: bool):
        self.num_shards, self.started = len(pending), time.monotonic()
        self.sequences = collections.Counter()  # shard index -> sequences counted so far
        self.tokens = collections.Counter()  # shard index -> tokens counted so far
        self.published: set[int] = set()
        self.times = BuildTimes()
        total = sum(s.stop - s.start for s in pending)
        self.bar = tqdm(total=total, unit="seq", desc="cache build", disable=not enabled, dynamic_ncols=True)

    @property
    def done(self) -> int:
        return sum(self.sequences.values())

    def batch(self, shard_index: int, sequences: int, tokens: int) -> None:
        """A batch of `sequences` (`tokens`) of shard `shard_index` reached its writer."""
        if shard_index not in self.published:  # a late report of a shard already counted whole
            self._count(shard_index, self.sequences[shard_index] + sequences, self.tokens[shard_index] + tokens)

    def shard_published(self, record: ShardRecord, times: BuildTimes | None = None) -> None:
        self.published.add(record.index)
        if times is not None:
            self.times += times
        self._count(record.index, record.sequences, record.tokens)

    def shard_lost(self, shard_index: int) -> None:
        """The shard's worker died: what its batches counted is to be computed again."""
        self._count(shard_index, 0, 0)

    def _count(self, shard_index: int, sequences: int, tokens: int) -> None:
        before = self.done
        self.sequences[shard_index], self.tokens[shard_index] = sequences, tokens
        elapsed = max(time.monotonic() - self.started, 1e-9)
        self.bar.set_postfix(
            tok_s=f"{sum(self.tokens.values()) / elapsed:.0f}", shards=f"{len(self.published)}/{self.num_shards}",
            refresh=False,
        )  # fmt: skip
        self.bar.update(self.done - before)  # tqdm's rate and ETA follow the sequences

    def close(self) -> None:
        self.bar.close()


def resolve_layer_ids(config: CacheBuildConfig, *, num_target_layers: int) -> list[int]:
    """Tapped layers: --layers, else the taps of --drafter-init, else the rule of docs/design.md
    ("The drafter") for --draft-layers (default 1 draft layer when nothing is given)."""
    taps = config.taps
    if taps.layers is not None:
        layer_ids = list(taps.layers)
    elif taps.drafter_init is not None:
        layer_ids = _drafter_init_dflash_config(taps.drafter_init).get("target_layer_ids")
        if layer_ids is None:
            raise ValueError(f"{Path(taps.drafter_init) / 'config.json'}: no dflash_config.target_layer_ids")
    else:
        layer_ids = default_target_layer_ids(num_target_layers=num_target_layers, num_draft_layers=taps.draft_layers or 1)
    bad = [i for i in layer_ids if not 0 <= i < num_target_layers - 1]
    if bad:
        # The last layer's output in HF hidden_states is after the final norm, not a residual tap.
        raise ValueError(f"--layers: ids {bad} out of range for a {num_target_layers}-layer target (0..{num_target_layers - 2})")
    return [int(i) for i in layer_ids]


def _drafter_init_dflash_config(drafter_init: str) -> dict:
    path = Path(drafter_init) / "config.json"
    if not path.is_file():
        raise ValueError(f"--drafter-init {drafter_init}: no config.json")
    return json.loads(path.read_text()).get("dflash_config") or {}


def resolve_build_mask_token_id(config: CacheBuildConfig, tokenizer, *, vocab_size: int, stop_ids: list[int]) -> int:
    """The cache's mask token (pipeline.target.resolve_mask_token_id). A --drafter-init head was
    trained with its own mask token, which the drafter keeps: it is the default, and another
    --mask-token is refused (docs/design.md, "The target")."""
    init_mask = None
    if config.taps.drafter_init is not None:
        init_mask = _drafter_init_dflash_config(config.taps.drafter_init).get("mask_token_id")
    mask_token = config.mask_token if config.mask_token is not None or init_mask is None else str(init_mask)
    mask_token_id = resolve_mask_token_id(
        tokenizer, vocab_size=vocab_size, mask_token=mask_token, stop_ids=stop_ids, target=config.target
    )
    if init_mask is not None and mask_token_id != init_mask:
        raise ValueError(
            f"--mask-token {config.mask_token} (id {mask_token_id}) is not the mask token of --drafter-init "
            f"{config.taps.drafter_init} (dflash_config.mask_token_id {init_mask}); leave --mask-token out to use it"
        )
    return mask_token_id


def cache_settings(config: CacheBuildConfig, *, layer_ids: list[int], corpus_hash: str | None = None) -> CacheSettings:
    """What the manifest records of the settings: everything that changes the cache's content
    (`corpus_hash`: of the build's one local copy of the corpus; default: hashed here)."""
    run, storage, corpus = config.run, config.storage, config.corpus
    return CacheSettings(
        target_hash=target_hash(config.target),
        layer_ids=layer_ids,
        num_slots=run.num_slots,
        top_k=run.top_k,
        anchors_per_sequence=run.anchors_per_sequence,
        seed=run.seed,
        max_length=corpus.max_length,
        min_supervised_tokens=corpus.min_supervised_tokens,
        storage_format=storage.storage_format,
        shard_size=storage.shard_size,
        corpus_hash=corpus_hash or file_sha256(corpus.path),
        skip_bad_rows=corpus.skip_bad_rows,
        contents=config.contents,
        backend=config.compute.backend,
        **{k: v for k, v in config.layout.items()},  # codecs, --ira-parents, --compact (format version 2 when set)
        **vision_cache_settings(config),  # system prompt and vision settings, when set (docs/vision.md)
    )


def build_cache(config: CacheBuildConfig, *, run_shards: RunShards, progress: bool = True, log=print) -> Manifest:
    """Build or resume the cache described by `config`; returns the final manifest.

    A build deletes only files a build writes (storage.ownership): a non-empty --out that is not a
    cache is refused, and a build that fails before it published a shard into a directory that held
    no cache removes what it wrote. A failing filesystem (read-only, full, ...) is a one-line
    ValueError naming the path; published shards and the manifest stay consistent."""
    with build_lock(config):
        return build_unlocked(config, run_shards=run_shards, progress=progress, log=log)


@contextlib.contextmanager
def build_lock(config: CacheBuildConfig):
    """Hold the local --out's lock (pid and host, pipeline/outputs.py) for the build, so a second
    build of the same --out refuses in one line instead of taking the directory over (and the Ray
    job's stopping the first one's workers). A lock whose process is gone (a killed build) is taken
    over. A non-cache --out is refused before the lock is written into it. On an object store the
    claim alone decides (storage/ownership.py)."""
    if is_url(config.out):
        yield
        return
    check_cache_out(config.out)
    with output_lock(config.out, command="alrira-cache build"):
        yield


def build_unlocked(config: CacheBuildConfig, *, run_shards: RunShards, progress: bool = True, log=print) -> Manifest:
    """`build_cache` for a caller that holds the lock already (ray_jobs/build.py)."""
    out = resolve(config.out)
    try:
        return _build_cache(config, run_shards=run_shards, progress=progress, log=log)
    except OSError as error:
        raise ValueError(_os_error_line(error, out)) from None


def _os_error_line(error: OSError, out: Location, *, kind: str = "cache", kept: str = "shards published") -> str:
    """One line for a failing filesystem: the path, the reason, and for a full disk what to do
    (regeneration's driver says it of its parts)."""
    line = f"{error.filename or out}: {error.strerror or error}"
    if error.errno in DISK_FULL_ERRNOS:
        line += f" ({kind} {out})" if error.filename else ""
        line += f"; the {kept} so far are kept: free space and rerun the same command to resume"
    return line


def _build_cache(config: CacheBuildConfig, *, run_shards: RunShards, progress: bool, log) -> Manifest:
    started = time.time()
    out = resolve(config.out)
    check_cache_out(out)
    # One local copy of the corpus per build (a store corpus: this node's copy, fetched once): its
    # hash identifies the cache and its rows are tokenized, so both come from the same bytes.
    corpus_copy = local_corpus(config.corpus.path)
    iter_corpus_rows(corpus_copy)  # a missing or unreadable corpus stops here, before --out is touched
    target_config = read_target_config(config.target)
    num_layers = int(target_config["num_hidden_layers"])
    layer_ids = resolve_layer_ids(config, num_target_layers=num_layers)
    config = config.with_taps(layer_ids)
    settings = cache_settings(config, layer_ids=layer_ids, corpus_hash=file_sha256(corpus_copy))
    compute = config.compute.planned_compute()
    tokenizer = load_tokenizer(config.target)
    stop_ids = stop_token_ids(tokenizer, read_generation_config(config.target))
    mask_token_id = resolve_build_mask_token_id(
        config, tokenizer, vocab_size=int(target_config["vocab_size"]), stop_ids=stop_ids
    )

    previous, replacing = _previous_manifest(
        out, settings, mask_token_id=mask_token_id, compute=compute, target_dtype=config.compute.target_dtype, overwrite=config.overwrite
    )  # fmt: skip
    if previous is not None and config.overwrite and _images_changed(out, config, log=log):
        previous, replacing = None, True  # the tokenized corpus and its shards are stale: start over
    reuse_corpus = previous is not None and out.is_dir(CORPUS_DIR)
    foreign = [] if reuse_corpus else foreign_files(out.child(CORPUS_DIR), CORPUS_FILES)
    if foreign:
        raise ValueError(
            f"{out.join(CORPUS_DIR)}: holds files a cache build did not write ({', '.join(foreign[:3])}); "
            "move them or use another --out"
        )
    had_cache, created = is_cache_dir(out), not out.exists()
    try:
        owner = claim_cache(out)  # from here on, writers of any earlier build stop before publishing
    except OSError as error:
        raise ValueError(f"--out {out}: cannot write there ({error.strerror or error})") from None
    num_published, times = [0], BuildTimes()
    try:
        if replacing:
            old_shards = [s.name for s in load_manifest(out).shards]
            removed = remove_cache_files(out, corpus_files=CORPUS_FILES, shard_names=old_shards)
            log(f"--overwrite: removed {len(removed)} file(s) of the old cache")
        else:
            remove_write_leftovers(out)
        manifest = _build_claimed(
            config, out=out, owner=owner, settings=settings, target_config=target_config, previous=previous,
            tokenizer=tokenizer, stop_ids=stop_ids, mask_token_id=mask_token_id, reuse_corpus=reuse_corpus,
            run_shards=run_shards, num_published=num_published, progress=progress, log=log, times=times,
            corpus_copy=corpus_copy, compute=compute,
        )  # fmt: skip
    except Exception as error:
        if not had_cache and num_published[0] == 0 and not isinstance(error, CacheOwnershipLost):
            _remove_failed_build(out, owner=owner, created=created)
        raise
    # What produced the cache: one entry per build invocation (a resume adds one; pipeline/provenance.py).
    append_provenance(out, BUILD_PROVENANCE_FILE, {**to_flags(config), "compute": compute, "mask_token_id": mask_token_id})
    log(_summary(manifest, elapsed=time.time() - started, times=times))
    return manifest


def _build_claimed(
    config: CacheBuildConfig, *, out: Location, owner: str, settings: CacheSettings, target_config: dict,
    previous: Manifest | None, tokenizer, stop_ids: list[int], mask_token_id: int, reuse_corpus: bool,
    run_shards: RunShards, num_published: list[int], progress: bool, log, times: BuildTimes, corpus_copy: Path,
    compute: dict[str, str],
) -> Manifest:  # fmt: skip
    """The build once `owner` has claimed `out`: corpus, head, shard plan, manifest, shards (the
    workers' BuildTimes are added to `times`)."""
    corpus = _tokenized_corpus(
        config, tokenizer, reuse=reuse_corpus, progress=progress, corpus_copy=corpus_copy, corpus_hash=settings.corpus_hash
    )  # fmt: skip
    if len(corpus) == 0:
        raise ValueError(f"{config.corpus.path}: no sequences left after filtering ({corpus.stats['dropped']})")
    check_corpus_lacks_mask_token(corpus, mask_token_id=mask_token_id, tokenizer=tokenizer, corpus_path=corpus_copy)
    vocab_size = int(target_config["vocab_size"])
    if target_head_hash(out) != settings.target_hash:  # missing, or written for another target
        embed_tokens, lm_head = read_target_head(config.target)
        save_target_head(out, embed_tokens=embed_tokens, lm_head=lm_head, target_hash=settings.target_hash)

    shard_size = config.storage.shard_size
    specs = [
        ShardSpec(index=i, start=start, stop=min(start + shard_size, len(corpus)), owner=owner)
        for i, start in enumerate(range(0, len(corpus), shard_size))
    ]
    listed = [s.name for s in previous.shards if s.status == SHARD_COMPLETE] if previous else []
    removed = clean_partial_shards(out, published=listed)
    if removed:
        log(f"removed {len(removed)} partial shard(s) left by an interrupted build")
    done = _verified_shards(out, previous, log=log)
    manifest = Manifest(
        settings=settings,
        target_path=str(Path(config.target).resolve()),
        target_config=target_config,
        num_target_layers=int(target_config["num_hidden_layers"]),
        hidden_size=int(target_config["hidden_size"]),
        vocab_size=vocab_size,
        stop_token_ids=stop_ids,
        mask_token_id=mask_token_id,
        corpus_path=config.corpus.path if is_url(config.corpus.path) else str(Path(config.corpus.path).resolve()),
        corpus_stats=corpus.stats,
        shards=sorted(done.values(), key=lambda s: s.index),
        num_shards_planned=len(specs),
        created_with=f"alrira {pipeline.__version__}",
        # An older cache resumed: its shards' compute is unknown, so the manifest vouches for none.
        compute=None if previous is not None and previous.compute is None and done else compute,
    )
    check_owner(out, owner)
    save_manifest(out, manifest)

    def publish(spec: ShardSpec, record: ShardRecord) -> None:
        if record.compute != compute:  # a worker whose machine resolved `auto` (or found CUDA) otherwise
            raise ValueError(
                f"{out.join(SHARD_DIR)}/{record.name}: computed in {describe_compute(record.compute)}"
                f"{f' on node {record.node}' if record.node else ''}, the cache in {describe_compute(compute)} "
                f"(--target-dtype {config.compute.target_dtype}); give every worker the same machine kind or pass "
                f"--target-dtype {compute['dtype']}"
            )
        manifest.shards = sorted([*manifest.shards, record], key=lambda s: s.index)
        check_owner(out, spec.owner)  # a build that lost the directory must not write its manifest
        save_manifest(out, manifest)
        num_published[0] += 1

    pending = [s for s in specs if s.index not in done]
    if done:
        log(f"resuming: {len(done)} of {len(specs)} shards verified, {len(pending)} to build")
    if pending:
        times += run_shards(config, pending, publish, progress=progress) or BuildTimes()
    # Every writer of this build has finished; a temp directory now is an orphaned writer's (on a
    # store: a shard prefix the manifest does not list complete).
    removed = clean_partial_shards(out, published=[s.name for s in manifest.shards])
    if removed:
        log(f"removed {len(removed)} partial shard(s) left by writers of an earlier build")
    split = config.eval_split
    if split.eval_prompts is not None:  # kept when one of the same inputs is there (a resumed or repeated build)
        import torch

        from pipeline.eval.split import build_eval_split

        check_owner(out, owner)
        build_eval_split(
            out, target=config.target, prompts=split.eval_prompts, max_new_tokens=split.eval_max_new_tokens,
            max_prompts=split.eval_max_prompts, layer_ids=settings.layer_ids, device="cuda" if torch.cuda.is_available() else "cpu",
            log=log,
        )  # fmt: skip
    return manifest


def run_shards_here(config: CacheBuildConfig, pending: list[ShardSpec], publish, *, progress: bool = True) -> BuildTimes:
    """Compute the shards one after another in this process (no Ray); the bar moves per batch."""
    builder = ShardBuilder(config)
    bar = BuildProgress(pending, enabled=progress)
    try:
        for spec in pending:

            def on_batch(sequences: int, tokens: int, index: int = spec.index) -> None:
                bar.batch(index, sequences, tokens)

            record = builder.build(shard_index=spec.index, start=spec.start, stop=spec.stop, owner=spec.owner, on_batch=on_batch)
            publish(spec, record)
            bar.shard_published(record, builder.times)
    finally:
        bar.close()
    return bar.times


def _previous_manifest(
    out: Location, settings: CacheSettings, *, mask_token_id: int, compute: dict[str, str], target_dtype: str, overwrite: bool
) -> tuple[Manifest | None, bool]:
    """(the manifest to resume from or None, whether the existing cache is to be replaced);
    refuses a changed setting without --overwrite. The mask token is compared as the id it
    resolves to (the manifest's `mask_token_id`): `--mask-token 128002` and the token it names
    are one setting, and so are the default and the first unused row given by id. The compute
    dtype is compared as resolved (`auto` is bf16 on one machine, fp32 on another); a cache
    without the record (built before it) resumes in whatever this machine resolves."""
    if not out.exists(MANIFEST_FILE):
        return None, False
    previous = load_manifest(out)
    changed = settings_diff(previous.settings, settings)
    if previous.mask_token_id != mask_token_id:
        changed.append(f"mask_token_id (--mask-token): {previous.mask_token_id} -> {mask_token_id}")
    if previous.compute is not None and previous.compute["dtype"] != compute["dtype"] and not overwrite:
        raise ValueError(
            f"{out}: the cache was computed in {describe_compute(previous.compute)}, this build would compute in "
            f"{describe_compute(compute)} (--target-dtype {target_dtype}); pass --target-dtype {previous.compute['dtype']} "
            "to continue it, --overwrite to replace it, or use a new --out"
        )
    if previous.compute is not None and previous.compute["dtype"] != compute["dtype"]:
        changed.append(f"compute dtype: {previous.compute['dtype']} -> {compute['dtype']}")
    if not changed:
        return previous, False
    if not overwrite:
        raise ValueError(
            f"{out}: existing cache was built with different settings ({'; '.join(changed)}); "
            "use a new --out or pass --overwrite to replace it"
        )
    return None, True


def _images_changed(out: Location, config: CacheBuildConfig, *, log) -> bool:
    """--overwrite with unchanged settings: whether an image changed since the corpus was tokenized
    (what the stage-1 worker's error tells the user to rerun with --overwrite for; docs/vision.md)."""
    if not out.is_file(f"{CORPUS_DIR}/{IMAGES_FILE}"):
        return False
    corpus = load_tokenized_corpus(out.child(CORPUS_DIR).local_copy(), mmap=True)
    vision = corpus_vision_inputs(config.target, config.corpus)
    changed = [] if vision is None else changed_images(corpus.images or [], vision=vision)
    if changed:
        log(f"--overwrite: {len(changed)} image(s) changed since the corpus was tokenized ({changed[0]}, ...); replacing the cache")
    return bool(changed)


def _remove_failed_build(out: Location, *, owner: str, created: bool) -> None:
    """After a build that published no shard into a directory that held no cache: remove what it
    wrote (the claim, corpus, head, manifest), unless another build has claimed the directory."""
    try:
        check_owner(out, owner)
    except CacheOwnershipLost:
        return
    remove_cache_files(out, corpus_files=CORPUS_FILES, claim=True)
    if created:
        out.remove_dir_if_empty()


def check_corpus_lacks_mask_token(corpus, *, mask_token_id: int, tokenizer, corpus_path: str) -> None:
    """Refuse, naming the first row, a tokenized corpus that holds the mask token: the drafter
    could not tell that token in its context from a slot to predict (docs/design.md, "The target")."""
    hits = np.flatnonzero(np.asarray(corpus.input_ids) == mask_token_id)
    if len(hits) == 0:
        return
    sequence = int(np.searchsorted(np.asarray(corpus.offsets), hits[0], side="right")) - 1
    where = row_locator(corpus_path)(int(corpus.source_rows[sequence]))
    token = tokenizer.convert_ids_to_tokens(mask_token_id)
    raise ValueError(
        f"{where}: contains the mask token {token!r} (id {mask_token_id}); pick a token the corpus never contains "
        "with --mask-token"
    )


def _tokenized_corpus(config: CacheBuildConfig, tokenizer, *, reuse: bool, progress: bool, corpus_copy: Path, corpus_hash: str):
    """Tokenize the corpus once per cache; a resumed build reuses the saved copy. On a store the
    corpus is saved to a local temp directory and uploaded (one object per file, published with
    the cache by the manifest written after it), and read, as the workers read it, from a
    node-local copy they memory-map (docs/design.md, "Caches on object stores")."""
    corpus_dir = resolve(config.out).child(CORPUS_DIR)
    if reuse and corpus_dir.exists():
        return load_tokenized_corpus(corpus_dir.local_copy(), mmap=True)
    vision = corpus_vision_inputs(config.target, config.corpus)  # None for a text target
    corpus = ingest_corpus(config.corpus, tokenizer, progress=progress, vision=vision, local_path=corpus_copy)
    if (after := file_sha256(corpus_copy)) != corpus_hash:  # rewritten while it was read: rows and hash would differ
        raise ValueError(
            f"{config.corpus.path}: changed while the build read it ({corpus_hash[:19]}... when hashed, {after[:19]}... "
            "after tokenizing); rerun the build once the corpus stays put"
        )
    if corpus_dir.is_local:
        save_tokenized_corpus(corpus, corpus_dir.local_path)
    else:
        with tempfile.TemporaryDirectory(prefix="alrira-corpus-") as staged:
            save_tokenized_corpus(corpus, Path(staged) / CORPUS_DIR)
            corpus_dir.upload_dir(Path(staged) / CORPUS_DIR)
    return load_tokenized_corpus(corpus_dir.local_copy(), mmap=True)


def _verified_shards(out: Location, previous: Manifest | None, *, log) -> dict[int, ShardRecord]:
    """Shards of the previous run that are listed complete and whose checksum still verifies. On a
    store a shard whose record has object tags is kept when one listing gives the same tags (its
    objects are the checksummed ones) instead of downloading it; one without is downloaded once."""
    done = {}
    for record in previous.shards if previous else []:
        path = out.child(f"{SHARD_DIR}/{record.name}")
        if record.status == "complete" and path.exists() and _still_verifies(path, record):
            done[record.index] = record
        else:
            log(f"{record.name}: missing or checksum mismatch, rebuilding")
    return done


def _still_verifies(path: Location, record: ShardRecord) -> bool:
    if not path.is_local and record.object_tags is not None:
        return shard_object_tags(path) == record.object_tags
    return shard_checksum(path, scheme=checksum_scheme(record.checksum)) == record.checksum


def _summary(manifest: Manifest, *, elapsed: float, times: BuildTimes | None = None) -> str:
    stats = manifest.corpus_stats
    dropped = ", ".join(f"{k}={v}" for k, v in sorted(stats.get("dropped", {}).items())) or "none"
    contents = ", ".join(manifest.settings.contents) or "none"
    return (
        f"cache: {len(manifest.shards)}/{manifest.num_shards_planned} shards, {manifest.num_sequences} sequences, "
        f"{manifest.num_tokens} tokens, {manifest.num_anchors} anchors, array groups: {contents}; "
        f"corpus rows {stats.get('rows')}, truncated {stats.get('truncated', 0)}, dropped: {dropped}; {elapsed:.1f}s"
        + (f"; workers: {times.shares()}" if times is not None and times.total_s > 0 else "")
    )
