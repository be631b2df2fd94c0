"""`alrira-cache build` without Ray: run a BuildPlan (pipeline/cache_build/plan.py). Claim --out,
tokenize the corpus once, export the target head, plan shards, write the manifest (started_build),
then publish each shard as it comes back (ShardBook). Who computes the shards is the caller's:
`build_cache` here iterates `run_shards_here` (this process: tests, debugging), `ray_jobs.build`
a pool of Ray actors; both only yield shard records, and this module publishes them.

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
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

import pipeline
from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.corpus import (
    CORPUS_FILES,
    check_corpus_lacks_mask_token,
    load_tokenized_corpus,
    save_tokenized_corpus,
    tokenize_corpus,
)
from pipeline.cache_build.plan import BuildPlan, plan_build
from pipeline.cache_build.shard_builder import BuildTimes, ShardBuilder
from pipeline.corpus_source import file_sha256
from pipeline.config import to_flags
from pipeline.outputs import check_cache_out, claim_cache, os_error_line, output_lock
from pipeline.provenance import append_provenance
from pipeline.target import read_target_head
from storage.format import BUILD_PROVENANCE_FILE, CORPUS_DIR, SHARD_COMPLETE, SHARD_DIR
from storage.location import is_url
from storage.manifest import (
    Manifest,
    ShardRecord,
    describe_compute,
    save_manifest,
    save_target_head,
    target_head_hash,
)
from storage.ownership import CacheOwnershipLost, check_owner, owned, remove_cache_files, remove_write_leftovers
from storage.checksums import verified_shards
from storage.shards import clean_partial_shards


@dataclass(kw_only=True)
class ShardSpec:
    """One shard's work: all that crosses a process boundary on the way out."""

    index: int
    start: int  # sequence range [start, stop) of the tokenized corpus
    stop: int
    owner: str  # the build's claim on the cache directory (storage.ownership.claim_cache)


# run_shards(plan, pending specs, progress=...): compute every pending shard, yielding (its record,
# the worker's BuildTimes or None) as each one is written; the caller publishes it.
RunShards = Callable[..., Iterator[tuple["ShardRecord", BuildTimes | None]]]


class BuildProgress:
    """The build's progress bar over every worker: sequences as each batch reaches its shard's
    writer (workers report batches, docs/design.md "A cache build"), tokens/s and an ETA, shards
    published."""

    def __init__(self, pending: list[ShardSpec], *, enabled: bool):
        self.num_shards, self.started = len(pending), time.monotonic()
        self.sequences = collections.Counter()  # shard index -> sequences counted so far
        self.tokens = collections.Counter()  # shard index -> tokens counted so far
        self.published: set[int] = set()
        total = sum(s.stop - s.start for s in pending)
        self.bar = tqdm(total=total, unit="seq", desc="cache build", disable=not enabled, dynamic_ncols=True)

    @property
    def done(self) -> int:
        return sum(self.sequences.values())

    def batch(self, shard_index: int, sequences: int, tokens: int) -> None:
        """A batch of `sequences` (`tokens`) of shard `shard_index` reached its writer."""
        if shard_index not in self.published:  # a late report of a shard already counted whole
            self._count(shard_index, self.sequences[shard_index] + sequences, self.tokens[shard_index] + tokens)

    def shard_published(self, record: ShardRecord) -> None:
        self.published.add(record.index)
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


def build_cache(config: CacheBuildConfig, *, run_shards: RunShards | None = None, progress: bool = True, log=print) -> Manifest:
    """Build or resume the cache described by `config` in this process (`run_shards`: what computes
    the shards, default run_shards_here); returns the final manifest. ray_jobs.build runs the same
    steps with a pool of Ray actors.

    A build deletes only files a build writes (storage.ownership): a non-empty --out that is not a
    cache is refused, and a build that fails before it published a shard into a directory that held
    no cache removes what it wrote. A failing filesystem (read-only, full, ...) is a one-line
    ValueError naming the path; published shards and the manifest stay consistent."""
    with build_lock(config):
        plan = plan_build(config, log=log)
        with started_build(plan, progress=progress, log=log) as book:
            if book.pending:  # closed when the block ends: a failed publish stops the workers first
                shards = (run_shards or run_shards_here)(plan, book.pending, progress=progress)
                with contextlib.closing(shards):
                    for record, times in shards:
                        book.publish(record, times=times)
            return book.finish()


@contextlib.contextmanager
def build_lock(config: CacheBuildConfig):
    """Refuse a --out that cannot hold a cache (check_cache_out: before the lock is written into
    it), then hold the local --out's lock (pid and host, pipeline/outputs.py) for the build, so a
    second build of the same --out refuses in one line instead of taking the directory over (and
    the Ray job's stopping the first one's workers). A lock whose process is gone (a killed build)
    is taken over. On an object store the claim alone decides (storage/ownership.py). A failing
    filesystem inside leaves as one line (pipeline.outputs.os_error_line)."""
    check_cache_out(config.out)
    with contextlib.nullcontext() if is_url(config.out) else output_lock(config.out, command="alrira-cache build"):
        try:
            yield
        except OSError as error:
            raise ValueError(os_error_line(error, config.out)) from None


@contextlib.contextmanager
def started_build(plan: BuildPlan, *, progress: bool, log) -> Iterator[ShardBook]:
    """Claim --out for the build of `plan`, remove what an interrupted build left (or, replacing,
    the old cache's files), tokenize the corpus, export the head, plan the shards and write the
    manifest; the block publishes the shards into the ShardBook given. A failure before the first
    shard was published into a directory that held no cache removes what the build wrote."""
    out = plan.out
    try:
        owner = claim_cache(out)  # from here on, writers of any earlier build stop before publishing
    except OSError as error:
        raise ValueError(f"--out {out}: cannot write there ({error.strerror or error})") from None
    book = None
    try:
        if plan.replaced is not None:
            old_shards = [s.name for s in plan.replaced.shards]
            removed = remove_cache_files(out, corpus_files=CORPUS_FILES, shard_names=old_shards)
            log(f"--overwrite: removed {len(removed)} file(s) of the old cache")
        else:
            remove_write_leftovers(out)
        book = _first_manifest(plan, owner=owner, progress=progress, log=log)
        yield book
    except Exception as error:
        # A build that published no shard into a directory that held no cache removes what it
        # wrote (the claim, corpus, head, manifest), unless another build has claimed the directory.
        if not plan.had_cache and (book is None or book.num_published == 0) and not isinstance(error, CacheOwnershipLost):
            with contextlib.suppress(CacheOwnershipLost):
                check_owner(out, owner)
                remove_cache_files(out, corpus_files=CORPUS_FILES, claim=True)
                if plan.created:
                    out.remove_dir_if_empty()
        raise


def _first_manifest(plan: BuildPlan, *, owner: str, progress: bool, log) -> ShardBook:
    """The build once `owner` has claimed --out: corpus, head, shard plan, the shards that pass the
    resume rule, the manifest written; a ShardBook with the shards still to compute."""
    config, out, settings = plan.config, plan.out, plan.settings
    corpus = _tokenized_corpus(plan, progress=progress)
    if len(corpus) == 0:
        raise ValueError(f"{config.corpus.path}: no sequences left after filtering ({corpus.stats['dropped']})")
    check_corpus_lacks_mask_token(corpus, mask_token_id=plan.mask_token_id, tokenizer=plan.tokenizer, corpus_path=plan.corpus_copy)
    if target_head_hash(out) != settings.target_hash:  # missing, or written for another target
        embed_tokens, lm_head = read_target_head(config.target)
        save_target_head(out, embed_tokens=embed_tokens, lm_head=lm_head, target_hash=settings.target_hash)

    shard_size = config.storage.shard_size
    specs = [
        ShardSpec(index=i, start=start, stop=min(start + shard_size, len(corpus)), owner=owner)
        for i, start in enumerate(range(0, len(corpus), shard_size))
    ]
    previous, target_config = plan.previous, plan.target_config
    listed = [s.name for s in previous.shards if s.status == SHARD_COMPLETE] if previous else []
    removed = clean_partial_shards(out, published=listed)
    if removed:
        log(f"removed {len(removed)} partial shard(s) left by an interrupted build")
    done, stale = verified_shards(out, previous.shards if previous else [])
    for name in stale:
        log(f"{name}: missing or checksum mismatch, rebuilding")
    manifest = Manifest(
        settings=settings,
        target_path=str(Path(config.target).resolve()),
        target_config=target_config,
        num_target_layers=int(target_config["num_hidden_layers"]),
        hidden_size=int(target_config["hidden_size"]),
        vocab_size=plan.vocab_size,
        stop_token_ids=plan.stop_ids,
        mask_token_id=plan.mask_token_id,
        corpus_path=config.corpus.path if is_url(config.corpus.path) else str(Path(config.corpus.path).resolve()),
        corpus_stats=corpus.stats,
        shards=sorted(done.values(), key=lambda s: s.index),
        num_shards_planned=len(specs),
        created_with=f"alrira {pipeline.__version__}",
        # An older cache resumed: its shards' compute is unknown, so the manifest vouches for none.
        compute=None if previous is not None and previous.compute is None and done else plan.compute,
    )
    with owned(out, owner):  # a build that lost the directory must not write its manifest
        save_manifest(out, manifest)
    pending = [s for s in specs if s.index not in done]
    if done:
        log(f"resuming: {len(done)} of {len(specs)} shards verified, {len(pending)} to build")
    return ShardBook(plan=plan, manifest=manifest, owner=owner, pending=pending, log=log)


@dataclass(kw_only=True)
class ShardBook:
    """The manifest of a claimed build while its shards come back: `pending` are the shards to
    compute, `publish` lists each one in the manifest as it arrives, `finish` ends the build."""

    plan: BuildPlan
    manifest: Manifest
    owner: str  # this build's claim on --out (storage.ownership.claim_cache)
    pending: list[ShardSpec]
    log: Callable[[str], None]
    num_published: int = 0
    times: BuildTimes = field(default_factory=BuildTimes)  # the workers' times, summed over the shards published

    def publish(self, record: ShardRecord, *, times: BuildTimes | None = None) -> None:
        """List `record` (a shard written under this build's claim) in the manifest; refuse one
        computed otherwise than planned."""
        plan, out = self.plan, self.plan.out
        if record.compute != plan.compute:  # a worker whose machine resolved `auto` (or found CUDA) otherwise
            raise ValueError(
                f"{out.join(SHARD_DIR)}/{record.name}: computed in {describe_compute(record.compute)}"
                f"{f' on node {record.node}' if record.node else ''}, the cache in {describe_compute(plan.compute)} "
                f"(--target-dtype {plan.config.compute.target_dtype}); give every worker the same machine kind or pass "
                f"--target-dtype {plan.compute['dtype']}"
            )
        self.manifest.shards = sorted([*self.manifest.shards, record], key=lambda s: s.index)
        with owned(out, self.owner):  # a build that lost the directory must not write its manifest
            save_manifest(out, self.manifest)
        self.num_published += 1
        if times is not None:
            self.times += times

    def finish(self) -> Manifest:
        """Once every shard is published: remove orphaned writers' leftovers, write the evaluation
        split when asked, record the invocation's provenance, log the summary."""
        plan, out, manifest = self.plan, self.plan.out, self.manifest
        # Every writer of this build has finished; a temp directory now is an orphaned writer's (on a
        # store: a shard prefix the manifest does not list complete).
        removed = clean_partial_shards(out, published=[s.name for s in manifest.shards])
        if removed:
            self.log(f"removed {len(removed)} partial shard(s) left by writers of an earlier build")
        if plan.eval_split is not None:  # kept when one of the same inputs is there (a resumed or repeated build)
            import torch

            from pipeline.eval.split import build_eval_split

            check_owner(out, self.owner)
            from storage.eval_split import SplitFit

            fit = SplitFit(target_hash=plan.settings.target_hash, layer_ids=list(plan.settings.layer_ids), vocab_size=plan.vocab_size,
                           feature_width=len(plan.settings.layer_ids) * int(plan.target_config["hidden_size"]))  # fmt: skip
            build_eval_split(out, plan.eval_split, target=plan.config.target, fit=fit,
                             device="cuda" if torch.cuda.is_available() else "cpu", log=self.log)  # fmt: skip
        # What produced the cache: one entry per build invocation (a resume adds one; pipeline/provenance.py).
        append_provenance(
            out, BUILD_PROVENANCE_FILE, {**to_flags(plan.config), "compute": plan.compute, "mask_token_id": plan.mask_token_id}
        )
        self.log(_summary(manifest, elapsed=time.time() - plan.started, times=self.times))
        return manifest


def run_shards_here(plan: BuildPlan, pending: list[ShardSpec], *, progress: bool = True) -> Iterator[tuple[ShardRecord, BuildTimes]]:
    """Compute the shards one after another in this process (no Ray), yielding each one's record
    and times as it is written; the bar moves per batch."""
    builder = ShardBuilder(plan.config)
    bar = BuildProgress(pending, enabled=progress)
    try:
        for spec in pending:

            def on_batch(sequences: int, tokens: int, index: int = spec.index) -> None:
                bar.batch(index, sequences, tokens)

            record = builder.build(shard_index=spec.index, start=spec.start, stop=spec.stop, owner=spec.owner, on_batch=on_batch)
            yield record, builder.times
            bar.shard_published(record)
    finally:
        bar.close()


def _tokenized_corpus(plan: BuildPlan, *, progress: bool):
    """Tokenize the corpus once per cache; a resumed build reuses the saved copy. On a store the
    corpus is saved to a local temp directory and uploaded (one object per file, published with
    the cache by the manifest written after it), and read, as the workers read it, from a
    node-local copy they memory-map (docs/design.md, "Caches on object stores")."""
    config, corpus_copy, corpus_hash = plan.config, plan.corpus_copy, plan.settings.corpus_hash
    corpus_dir = plan.out.child(CORPUS_DIR)
    if plan.reuse_corpus and corpus_dir.exists():
        return load_tokenized_corpus(corpus_dir.local_copy(), mmap=True)
    corpus = tokenize_corpus(
        corpus_copy, config.corpus, plan.tokenizer, system_prompt=plan.settings.system_prompt, vision=plan.vision,
        progress=progress,
    )  # fmt: skip
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
