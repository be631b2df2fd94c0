"""`alrira-cache build` orchestration: plan shards, resume, run a pool of target actors on Ray.

The driver does the cheap, serial parts (hash the inputs, tokenize the corpus once, plan
shards, keep the manifest); actors do the target work and write whole shards themselves.
Only shard specs go out and `ShardRecord` metadata comes back through Ray.

Resume rule: a shard counts as done only if the manifest lists it complete AND its checksum
still verifies; everything else (missing, corrupt, leftover temp directories) is redone. Shard
content depends only on the settings and the shard's sequences, so a resumed cache is
byte-identical to an uninterrupted one.

Ownership: each build claims the directory (storage.shards.claim_cache) before it touches it, and
its actors publish a shard only while that claim holds. An actor that outlives its killed driver
(Ray reaps orphans asynchronously) or a second build started on the same directory therefore
cannot overwrite the shards of the build that claimed it last; temp directories such writers
leave behind are removed when the build starts and again when it ends.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from tqdm.auto import tqdm

import pipeline
from pipeline.cache_build import CORPUS_DIR, CacheBuildConfig, ShardBuilder, resolve_layer_ids
from pipeline.corpus import CorpusConfig, file_sha256, ingest_corpus, load_tokenized_corpus, save_tokenized_corpus
from pipeline.target_runner import read_target_config, stop_token_ids, target_hash
from storage.format import MANIFEST_FILE, SHARD_DIR, TARGET_HEAD_FILE, shard_name
from storage.manifest import CacheSettings, Manifest, ShardRecord, load_manifest, save_manifest, settings_diff
from storage.shards import CacheOwnershipLost, check_owner, claim_cache, clean_partial_shards, shard_checksum

MAX_SHARD_ATTEMPTS = 3  # a shard whose worker died this many times stops the build


@dataclass(kw_only=True)
class ShardSpec:
    index: int
    start: int  # sequence range [start, stop) of the tokenized corpus
    stop: int
    owner: str  # the build's claim on the cache directory (claim_cache)


@ray.remote
class CacheWorker:
    """A Ray actor around ShardBuilder: loads the target once, builds shards on request."""

    def __init__(self, config: CacheBuildConfig, layer_ids: list[int]):
        self.builder = ShardBuilder(config, layer_ids=layer_ids)

    def build(self, spec: ShardSpec) -> ShardRecord:
        return self.builder.build(shard_index=spec.index, start=spec.start, stop=spec.stop, owner=spec.owner)

    def pid(self) -> int:
        return self.builder.pid()


def build_cache(config: CacheBuildConfig, *, progress: bool = True, log=print) -> Manifest:
    """Build or resume the cache described by `config`; returns the final manifest."""
    started = time.time()
    out = Path(config.out)
    target_config = read_target_config(config.target)
    num_layers = int(target_config["num_hidden_layers"])
    layer_ids = resolve_layer_ids(config, num_target_layers=num_layers)
    settings = CacheSettings(
        target_hash=target_hash(config.target),
        layer_ids=layer_ids,
        num_slots=config.num_slots,
        top_k=config.top_k,
        anchors_per_sequence=config.anchors,
        seed=config.seed,
        max_length=config.max_length,
        min_supervised_tokens=config.min_supervised_tokens,
        feature_codec=config.feature_codec,
        storage_format=config.storage_format,
        shard_size=config.shard_size,
        corpus_hash=file_sha256(config.corpus),
        skip_bad_rows=config.skip_bad_rows,
        contents=config.contents,
        backend=config.backend,
    )

    previous, replace = _previous_manifest(out, settings, overwrite=config.overwrite)
    owner = claim_cache(out)  # from here on, writers of any earlier build stop before publishing
    if replace:
        _clear_cache(out)
    tokenizer = _load_tokenizer(config.target)
    corpus = _tokenized_corpus(config, tokenizer, reuse=previous is not None, progress=progress)
    if len(corpus) == 0:
        raise ValueError(f"{config.corpus}: no sequences left after filtering ({corpus.stats['dropped']})")
    vocab_size = int(target_config["vocab_size"])
    mask_token_id = len(tokenizer)
    if mask_token_id >= vocab_size:
        raise ValueError(
            f"{config.target}: the tokenizer fills the whole embedding ({vocab_size} rows), no unused row for the mask token"
        )
    _write_target_head(config.target, out)

    specs = [
        ShardSpec(index=i, start=start, stop=min(start + config.shard_size, len(corpus)), owner=owner)
        for i, start in enumerate(range(0, len(corpus), config.shard_size))
    ]
    removed = clean_partial_shards(out)
    if removed:
        log(f"removed {len(removed)} partial shard(s) left by an interrupted build")
    done = _verified_shards(out, previous, log=log)
    manifest = Manifest(
        settings=settings,
        target_path=str(Path(config.target).resolve()),
        target_config=target_config,
        num_target_layers=num_layers,
        hidden_size=int(target_config["hidden_size"]),
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids(tokenizer, _generation_config(config.target)),
        mask_token_id=mask_token_id,
        corpus_path=str(Path(config.corpus).resolve()),
        corpus_stats=corpus.stats,
        shards=sorted(done.values(), key=lambda s: s.index),
        num_shards_planned=len(specs),
        created_with=f"alrira {pipeline.__version__}",
    )
    save_manifest(out, manifest)

    pending = [s for s in specs if s.index not in done]
    if done:
        log(f"resuming: {len(done)} of {len(specs)} shards verified, {len(pending)} to build")
    if pending:
        _run_workers(config, layer_ids, pending, manifest, progress=progress)
    # Every writer of this build has finished; a temp directory now is an orphaned writer's.
    removed = clean_partial_shards(out)
    if removed:
        log(f"removed {len(removed)} partial shard(s) left by writers of an earlier build")
    log(_summary(manifest, elapsed=time.time() - started))
    return manifest


def _previous_manifest(out: Path, settings: CacheSettings, *, overwrite: bool) -> tuple[Manifest | None, bool]:
    """(the manifest to resume from or None, whether the existing cache is to be replaced);
    refuses a changed setting without --overwrite."""
    if not (out / MANIFEST_FILE).exists():
        return None, False
    previous = load_manifest(out)
    changed = settings_diff(previous.settings, settings)
    if not changed:
        return previous, False
    if not overwrite:
        raise ValueError(
            f"{out}: existing cache was built with different settings ({'; '.join(changed)}); "
            "use a new --out or pass --overwrite to replace it"
        )
    return None, True


def _clear_cache(out: Path) -> None:
    """Remove an old cache's shards, tokenized corpus, manifest and head (for --overwrite)."""
    for name in (SHARD_DIR, CORPUS_DIR):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in (MANIFEST_FILE, TARGET_HEAD_FILE):
        (out / name).unlink(missing_ok=True)


def _load_tokenizer(target: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)


def _generation_config(target: str) -> dict | None:
    import json

    path = Path(target) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _tokenized_corpus(config: CacheBuildConfig, tokenizer, *, reuse: bool, progress: bool):
    """Tokenize the corpus once per cache; a resumed build reuses the saved copy."""
    corpus_dir = Path(config.out) / CORPUS_DIR
    if reuse and corpus_dir.exists():
        return load_tokenized_corpus(corpus_dir, mmap=True)
    corpus = ingest_corpus(
        CorpusConfig(
            path=config.corpus,
            max_length=config.max_length,
            min_supervised_tokens=config.min_supervised_tokens,
            skip_bad_rows=config.skip_bad_rows,
        ),
        tokenizer,
        progress=progress,
    )
    save_tokenized_corpus(corpus, corpus_dir)
    return load_tokenized_corpus(corpus_dir, mmap=True)


def _write_target_head(target: str, out: Path) -> None:
    """Copy embed_tokens and lm_head out of the target's safetensors without building the model."""
    from safetensors import safe_open

    from storage.manifest import save_target_head

    if (out / TARGET_HEAD_FILE).exists():
        return
    wanted = {"embed": None, "lm_head": None}
    for path in sorted(Path(target).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.endswith("embed_tokens.weight") and "visual" not in key and wanted["embed"] is None:
                    wanted["embed"] = f.get_tensor(key)
                elif key.endswith("lm_head.weight") and wanted["lm_head"] is None:
                    wanted["lm_head"] = f.get_tensor(key)
    if wanted["embed"] is None:
        raise ValueError(f"{target}: no embed_tokens.weight in its *.safetensors files")
    lm_head = wanted["lm_head"] if wanted["lm_head"] is not None else wanted["embed"]  # tied embeddings
    save_target_head(out, embed_tokens=wanted["embed"], lm_head=lm_head)


def _verified_shards(out: Path, previous: Manifest | None, *, log) -> dict[int, ShardRecord]:
    """Shards of the previous run that are listed complete and whose checksum still verifies."""
    done = {}
    for record in previous.shards if previous else []:
        path = out / SHARD_DIR / record.name
        if record.status == "complete" and path.exists() and shard_checksum(path) == record.checksum:
            done[record.index] = record
        else:
            log(f"{record.name}: missing or checksum mismatch, rebuilding")
    return done


def _run_workers(config: CacheBuildConfig, layer_ids, pending: list[ShardSpec], manifest: Manifest, *, progress: bool):
    """Keep every actor busy with one shard; publish each finished shard in the manifest at once."""
    if not ray.is_initialized():
        ray.init(address=config.ray_address, logging_level="WARNING", include_dashboard=False)
    options = dict(num_cpus=config.cpus_per_worker, num_gpus=config.gpus_per_worker)

    def new_worker():
        return CacheWorker.options(**options).remote(config, layer_ids)

    workers = [new_worker() for _ in range(min(config.workers, len(pending)))]
    queue = list(pending)
    attempts = {s.index: 0 for s in pending}
    running = {}  # future -> (worker index, spec)
    bar = tqdm(
        total=sum(s.stop - s.start for s in pending), unit="seq", desc="cache build", disable=not progress, dynamic_ncols=True
    )
    tokens = 0

    def submit(worker_index: int):
        spec = queue.pop(0)
        attempts[spec.index] += 1
        running[workers[worker_index].build.remote(spec)] = (worker_index, spec)

    try:
        for i in range(len(workers)):
            if queue:
                submit(i)
        while running:
            [future], _ = ray.wait(list(running), num_returns=1)
            worker_index, spec = running.pop(future)
            try:
                record = ray.get(future)
            except CacheOwnershipLost:
                # Ray re-raises the actor's error with its traceback; one line is what the user needs.
                raise CacheOwnershipLost(
                    f"{config.out}: another cache build claimed this directory while this one was running; stopped"
                ) from None
            except ray.exceptions.RayActorError:
                # The worker died (OOM, preemption, kill): nothing of its shard was published.
                if attempts[spec.index] >= MAX_SHARD_ATTEMPTS:
                    raise RuntimeError(f"{shard_name(spec.index, config.storage_format)}: worker died {MAX_SHARD_ATTEMPTS} times")
                workers[worker_index] = new_worker()
                queue.insert(0, spec)
                submit(worker_index)
                continue
            manifest.shards = sorted([*manifest.shards, record], key=lambda s: s.index)
            check_owner(config.out, spec.owner)  # a build that lost the directory must not write its manifest
            save_manifest(config.out, manifest)
            tokens += record.tokens
            bar.update(record.sequences)
            bar.set_postfix(tokens=tokens, shards=f"{len(manifest.shards)}/{manifest.num_shards_planned}")
            if queue:
                submit(worker_index)
    finally:
        bar.close()
        for worker in workers:
            ray.kill(worker)


def _summary(manifest: Manifest, *, elapsed: float) -> str:
    stats = manifest.corpus_stats
    dropped = ", ".join(f"{k}={v}" for k, v in sorted(stats.get("dropped", {}).items())) or "none"
    contents = ", ".join(manifest.settings.contents) or "none"
    return (
        f"cache: {len(manifest.shards)}/{manifest.num_shards_planned} shards, {manifest.num_sequences} sequences, "
        f"{manifest.num_tokens} tokens, {manifest.num_anchors} anchors, array groups: {contents}; "
        f"corpus rows {stats.get('rows')}, dropped: {dropped}; {elapsed:.1f}s"
    )
