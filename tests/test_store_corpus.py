"""Both stages read --corpus from any URL --out takes (pipeline/corpus_source.py): a corpus file or a
regenerated folder on the real S3-protocol server (moto on 127.0.0.1, tests/s3_fixtures.py), through
a node-local copy whose listing, names and part checksums are checked, and whose hash each node
compares with the driver's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.chat import iter_corpus_rows
from pipeline.corpus_source import file_sha256, local_corpus
from pipeline.demo.toy import toy_chat_rows
from storage.location import resolve
from tests.conftest import write_jsonl


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    rows = toy_chat_rows(5, seed=1, min_turns=1, max_turns=2, response_words=(3, 10))
    return write_jsonl(tmp_path_factory.mktemp("store-corpus") / "chat.jsonl", rows)


def _upload(local, url: str) -> str:
    resolve(url).put_file(local, "")
    return url


def _regenerated_folder(tmp_path, *, parts: dict[str, bytes]) -> Path:
    """A finished regenerated corpus folder holding `parts` (name -> bytes), with its manifest."""
    import hashlib

    from pipeline.chat import REGENERATED_KIND

    folder = tmp_path / "regen"
    folder.mkdir()
    records = []
    for index, (name, data) in enumerate(sorted(parts.items())):
        (folder / name).write_bytes(data)
        records.append({
            "index": index, "name": name, "lines": data.count(b"\n"), "written": data.count(b"\n"), "turns": 0,
            "turns_cut": 0, "generated_tokens": 0, "failed": {}, "skipped": {}, "sha256": "sha256:" + hashlib.sha256(data).hexdigest(),
        })  # fmt: skip
    manifest = {"kind": REGENERATED_KIND, "num_parts": len(records), "parts": records, "provenance": {}}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def test_a_store_corpus_reads_as_its_local_copy_and_a_changed_part_is_refused(corpus_file, tmp_path, s3_prefix):
    """A file URL and a regenerated folder URL read the same rows with the same hash as on disk; a
    part rewritten on the store after its manifest, an object the manifest does not list, and a
    URL with nothing there each stop in one line naming the URL (never a mangled `s3:/...`)."""
    url = _upload(corpus_file, f"{s3_prefix}/chat.jsonl")
    assert file_sha256(url) == file_sha256(corpus_file)
    assert [row for _, row in iter_corpus_rows(local_corpus(url))] == [row for _, row in iter_corpus_rows(corpus_file)]

    lines = corpus_file.read_bytes().splitlines(keepends=True)
    folder = _regenerated_folder(tmp_path, parts={"part-00000.jsonl": b"".join(lines[:3]), "part-00001.jsonl": b"".join(lines[3:])})
    regen = f"{s3_prefix}/regen"
    resolve(regen).upload_dir(folder)
    assert file_sha256(regen) == file_sha256(folder)  # the copy's own listing file is not part of the corpus
    assert [row for _, row in iter_corpus_rows(local_corpus(regen))] == [row for _, row in iter_corpus_rows(corpus_file)]

    resolve(regen).write_bytes("part-00001.jsonl", lines[3])  # rewritten after the manifest: other bytes
    with pytest.raises(ValueError, match=rf"^{regen}/part-00001.jsonl: sha256 .*; the part changed since its regeneration"):
        local_corpus(regen)
    resolve(regen).put_file(folder / "part-00001.jsonl", "part-00001.jsonl")
    resolve(regen).write_bytes("notes.txt", b"not a part")
    with pytest.raises(ValueError, match=rf"^{regen}/notes.txt: not listed in the regenerated corpus's manifest"):
        local_corpus(regen)
    with pytest.raises(ValueError, match=rf"^{s3_prefix}/nothing: corpus not found"):
        file_sha256(f"{s3_prefix}/nothing")


def test_a_node_whose_copy_differs_from_the_drivers_says_so(corpus_file, s3_prefix):
    """Each node hashes its own copy (ray_jobs/regenerate.py corpus_problem): the driver's hash of
    other bytes is refused naming the node and both hashes; the same bytes pass."""
    pytest.importorskip("ray")
    from ray_jobs.regenerate import corpus_problem

    url = _upload(corpus_file, f"{s3_prefix}/chat.jsonl")
    assert corpus_problem(url, driver_corpus_hash=file_sha256(corpus_file), node="n1") is None
    line = corpus_problem(url, driver_corpus_hash="sha256:" + "0" * 64, node="n1")
    assert line.startswith(f"node n1: --corpus {url} holds other rows than the driver's (corpus hash ")
    assert "corpus not found" in corpus_problem(f"{s3_prefix}/gone.jsonl", driver_corpus_hash="sha256:0", node="n1")


def test_regenerate_and_build_chain_on_the_store(ray_address, toy_target, corpus_file, s3_prefix, tmp_path):
    """regenerate --corpus s3://... --out s3://... then build --corpus <that output>: the README's
    promise (the regeneration output is a corpus the build reads as is) on an object store."""
    from ray_jobs.cli import cache_cli
    from storage.manifest import load_manifest

    corpus = _upload(corpus_file, f"{s3_prefix}/in/chat.jsonl")
    regen, cache = f"{s3_prefix}/regen", tmp_path / "cache"
    args = ["regenerate", "--target", str(toy_target), "--corpus", corpus, "--out", regen, "--max-new-tokens", "12",
            "--rows-per-part", "3", "--workers", "2", "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(cache_cli, args)
    assert result.exit_code == 0, result.output
    regen_manifest = json.loads(resolve(regen).read_bytes("manifest.json"))
    assert regen_manifest["provenance"]["corpus_hash"] == file_sha256(corpus_file)
    assert [part["index"] for part in regen_manifest["parts"]] == [0, 1]

    args = ["build", "--target", str(toy_target), "--corpus", regen, "--out", str(cache), "--layers", "0,2",
            "--anchors", "4", "--top-k", "4", "--max-length", "128", "--min-supervised-tokens", "2", "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(cache_cli, args)
    assert result.exit_code == 0, result.output
    manifest = load_manifest(cache)
    assert manifest.is_complete and manifest.corpus_path == regen
    assert manifest.settings.corpus_hash == file_sha256(regen)
    assert manifest.corpus_stats["rows"] == sum(part["lines"] for part in regen_manifest["parts"]) == 5
