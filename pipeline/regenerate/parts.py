"""The resumable output of `alrira-cache regenerate`: input rows in fixed ranges, one JSONL part per
range (`part-00003.jsonl`), each written whole by one worker and published atomically
(storage/atomic.py; one object on a store), and a record of it for the manifest (docs/design.md,
"Regeneration"). A part's bytes depend only on its rows and the settings: the rows of a range are
batched the same way on every run, so a rerun at T = 0 writes the same bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass

from pipeline.cache_build.corpus import CorpusConfig, corpus_vision_inputs
from pipeline.chat import CorpusError, iter_corpus_rows, row_locator
from pipeline.chat import regenerated_part_name as part_name
from pipeline.corpus_source import pinned_local_corpus
from pipeline.regenerate.backends import load_generator
from pipeline.regenerate.config import RegenerateConfig
from pipeline.regenerate.rows import RowRegeneration, apply_turn, next_request, output_row, prepare_row
from pipeline.target import context_limit
from pipeline.vision import effective_system_prompt
from storage.atomic import atomic_write_bytes
from storage.location import resolve


@dataclass(kw_only=True, frozen=True)
class PartSpec:
    """Input rows [start, stop) (0-based, counting the corpus's rows in order) -> part `index`."""

    index: int
    start: int
    stop: int
    seek: tuple[int, int] | None = None  # JSONL: (byte offset, line index) of row `start` (jsonl_row_seeks)


def corpus_rows(path: str, *, start: int, stop: int, seek: tuple[int, int] | None = None):
    """(row index in the file, row or CorpusError) of the corpus's rows start .. stop - 1. With
    `seek` (row `start`'s place in a JSONL file) the file is read from there, not from row 0, so
    writing every part reads the corpus once, not once per part up to it."""
    rows = iter_corpus_rows(path) if seek is None else iter_corpus_rows(path, seek=seek)
    for ordinal, (row_index, row) in enumerate(rows, start=0 if seek is None else start):
        if ordinal >= stop:
            return
        if ordinal >= start:
            yield row_index, row


class PartWriter:
    """Loads the target (one backend) once; `write(spec)` regenerates a part's rows turn by turn and
    publishes the part. Runs in a Ray actor (ray_jobs/regenerate.py) or in-process."""

    def __init__(self, config: RegenerateConfig):
        self.config = config
        self.corpus = pinned_local_corpus(config.corpus)  # a store corpus: this node's copy (pipeline/corpus_source.py)
        self.generator = load_generator(config)
        self.tokenizer = self.generator.tokenizer
        corpus = CorpusConfig(path=config.corpus, vision_input=config.vision_input, skip_bad_rows=config.skip_bad_rows)
        self.vision = corpus_vision_inputs(config.target, corpus)
        self.system_prompt = effective_system_prompt(config.vision_input.system_prompt, vision=self.vision)
        # Each turn generates at most what the target's context leaves after its prompt (rows.next_request).
        self.max_context = context_limit(config.target, self.tokenizer).positions or 1 << 30

    def write(self, spec: PartSpec) -> dict:
        """Regenerate and publish part `spec`; its manifest record."""
        rows, skipped, failed, failed_rows = self._prepare(spec)
        sampling = self.config.sampling
        pending = list(rows)
        while pending:  # round t writes turn t of every row that has one: rows never wait on each other's turns
            requests, asked = [], []
            for row in pending:
                try:
                    requests.append(next_request(
                        row, tokenizer=self.tokenizer, vision=self.vision, seed=sampling.seed,
                        max_new_tokens=sampling.max_new_tokens, max_context=self.max_context,
                    ))  # fmt: skip
                    asked.append(row)
                except CorpusError as error:
                    failed[error.reason] += 1
                    failed_rows.append(row.source_row)
            for row, output in zip(asked, self.generator.generate(requests)):
                apply_turn(row, output, tokenizer=self.tokenizer, length_control=sampling.length_control)
            pending = [row for row in asked if not row.done]
        finished = [row for row in rows if row.done]
        lines = [json.dumps(output_row(row, vision=self.vision), ensure_ascii=False) + "\n" for row in finished]
        data = "".join(lines).encode("utf-8")
        name = part_name(spec.index)
        atomic_write_bytes(resolve(self.config.out).join(name), data)
        turns = [turn for row in finished for turn in row.written]
        return {
            "index": spec.index, "name": name, "rows": [spec.start, spec.stop], "lines": len(lines),
            "written": len(lines), "failed": dict(sorted(failed.items())), "skipped": dict(sorted(skipped.items())),
            "failed_rows": sorted(failed_rows), "turns": len(turns), "turns_cut": sum(not t.stopped for t in turns),
            "generated_tokens": sum(len(t.token_ids) for t in turns), "bytes": len(data),
            "sha256": "sha256:" + hashlib.sha256(data).hexdigest(),
        }  # fmt: skip

    def _prepare(self, spec: PartSpec) -> tuple[list[RowRegeneration], Counter, Counter, list[int]]:
        """The part's rows ready for their first turn, and the bad ones counted (skipped, with
        --skip-bad-rows; else the first one stops the run with its one-line error)."""
        locate = row_locator(self.corpus)
        rows, skipped, failed, failed_rows = [], Counter(), Counter(), []
        for row_index, raw in corpus_rows(self.corpus, start=spec.start, stop=spec.stop, seek=spec.seek):
            try:
                if isinstance(raw, CorpusError):
                    raise raw
                rows.append(prepare_row(
                    raw, source_row=row_index, where=locate(row_index), tokenizer=self.tokenizer, vision=self.vision,
                    system_prompt=self.system_prompt,
                ))  # fmt: skip
            except CorpusError as error:
                if not self.config.skip_bad_rows:
                    raise
                skipped[error.reason] += 1
        return rows, skipped, failed, failed_rows

    def close(self) -> None:
        self.generator.close()
