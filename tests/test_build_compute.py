"""What a cache build computed in, and from which bytes (docs/failure-modes.md, "Cache build"):
the resolved compute dtype and device are recorded in the manifest, in each shard's record and in a
Zarr shard's attributes, and shown by `info`; a build resumed where `auto` resolves to another
dtype refuses in one line naming both, and a worker that resolves otherwise is refused before its
shard is listed; a cache built before the record still reads and resumes. The corpus is read once:
its hash and its tokenized rows come from one local copy, for a store corpus too. Builds run in
this process (the driver with run_shards_here: the same files as the Ray pool) on the toy target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import zarr
from click.testing import CliRunner

from pipeline.cache_build import driver
from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.driver import build_cache, run_shards_here
from pipeline.corpus_source import file_sha256
from pipeline.precision import CPU_BF16_ENV
from ray_jobs.cli import cache_cli
from storage.format import MANIFEST_FILE, SHARD_DIR
from storage.manifest import load_manifest
from tests.conftest import write_jsonl

FP32_CPU = {"dtype": "float32", "device": "cpu"}


def _config(toy_target: Path, corpus: Path, out: Path, **flags) -> CacheBuildConfig:
    small = {"anchors": 4, "shard_size": 2, "max_length": 128, "layers": [0, 2], "top_k": 4, "num_slots": 4}
    return CacheBuildConfig.from_flags(target=str(toy_target), corpus=str(corpus), out=str(out), **{**small, **flags})


def _build(config: CacheBuildConfig, run_shards=run_shards_here):
    return build_cache(config, run_shards=run_shards, progress=False, log=lambda line: None)


@pytest.fixture
def small_corpus(toy_corpus, tmp_path) -> Path:
    return write_jsonl(tmp_path / "chat.jsonl", [json.loads(line) for line in toy_corpus.read_text().splitlines()[:4]])


def test_the_compute_dtype_is_recorded_and_a_resume_in_another_refuses(toy_target, small_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "0")  # `auto` is fp32 on this CPU
    out = tmp_path / "cache"
    manifest = _build(_config(toy_target, small_corpus, out))
    assert manifest.compute == FP32_CPU and all(s.compute == FP32_CPU for s in manifest.shards)
    on_disk = json.loads((out / MANIFEST_FILE).read_text())
    assert on_disk["compute"] == FP32_CPU and all(s["compute"] == FP32_CPU for s in on_disk["shards"])
    assert zarr.open_group(str(out / SHARD_DIR / manifest.shards[0].name), mode="r").attrs["compute"] == FP32_CPU
    info = CliRunner().invoke(cache_cli, ["info", str(out), "--json"])
    assert info.exit_code == 0 and json.loads(info.output)["compute"] == "float32 on cpu", info.output

    # The same command where `auto` resolves to bf16 (a CPU with bf16 matrix units): one line, both named.
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    before = (out / MANIFEST_FILE).read_bytes()
    with pytest.raises(ValueError) as refused:
        _build(_config(toy_target, small_corpus, out))
    assert str(refused.value) == (
        f"{out}: the cache was computed in float32 on cpu, this build would compute in bfloat16 on cpu (--target-dtype auto); "
        "pass --target-dtype float32 to continue it, --overwrite to replace it, or use a new --out"
    )
    assert (out / MANIFEST_FILE).read_bytes() == before
    assert _build(_config(toy_target, small_corpus, out, target_dtype="float32")).compute == FP32_CPU  # continued as recorded


def test_a_worker_resolving_another_dtype_is_refused_before_its_shard_is_listed(toy_target, small_corpus, tmp_path, monkeypatch):
    """The plan resolves `auto` on the driver's machine; a worker on a machine that resolves it
    otherwise (here: the same process after the CPU's answer changed) computes a shard in bf16,
    which is refused instead of mixed into the fp32 cache."""
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    out = tmp_path / "cache"

    def on_another_machine(plan, pending, *, progress=True):
        monkeypatch.setenv(CPU_BF16_ENV, "1")
        return run_shards_here(plan, pending, progress=progress)

    with pytest.raises(ValueError) as refused:
        _build(_config(toy_target, small_corpus, out), run_shards=on_another_machine)
    assert str(refused.value).startswith(f"{out / SHARD_DIR}/shard-00000.zarr: computed in bfloat16 on cpu, the cache in float32 on cpu")
    assert not (out / MANIFEST_FILE).exists() or load_manifest(out).shards == []


def test_a_cache_built_before_the_record_reads_and_resumes(toy_target, small_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    out = tmp_path / "cache"
    _build(_config(toy_target, small_corpus, out))
    data = json.loads((out / MANIFEST_FILE).read_text())
    del data["compute"]
    for shard in data["shards"]:
        del shard["compute"]
    data["shards"] = data["shards"][:1]  # interrupted after its first shard
    (out / MANIFEST_FILE).write_text(json.dumps(data))
    assert load_manifest(out).compute is None
    monkeypatch.setenv(CPU_BF16_ENV, "1")  # nothing recorded to compare with: it resumes
    resumed = _build(_config(toy_target, small_corpus, out))
    assert resumed.is_complete and resumed.compute is None  # it vouches for no dtype of the old shard
    info = CliRunner().invoke(cache_cli, ["info", str(out), "--json"])
    assert json.loads(info.output)["compute"] == "not recorded (built before the compute dtype was)"


def test_a_corpus_rewritten_while_it_is_read_stops_the_build(toy_target, small_corpus, tmp_path, monkeypatch):
    """The corpus changes after it was hashed (another job rewrites it): rows and hash would differ."""
    real = driver.tokenize_corpus

    def rewritten_meanwhile(path, config, tokenizer, **kwargs):
        Path(config.path).write_text(Path(config.path).read_text().splitlines()[0] + "\n")
        return real(path, config, tokenizer, **kwargs)

    monkeypatch.setattr(driver, "tokenize_corpus", rewritten_meanwhile)
    with pytest.raises(ValueError, match=rf"^{small_corpus}: changed while the build read it \(sha256:.*; rerun the build"):
        _build(_config(toy_target, small_corpus, tmp_path / "cache"))


def test_a_store_corpus_is_fetched_once_and_hashed_from_its_rows(toy_target, small_corpus, tmp_path, s3_prefix, monkeypatch):
    """The object is replaced on the store after the build fetched it: the tokenized rows are still
    the fetched ones, and so is the recorded hash (a second fetch used to tokenize the new object)."""
    import fsspec

    url = f"{s3_prefix}/chat.jsonl"
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    fs.put_file(str(small_corpus), url)
    real = driver.tokenize_corpus

    def replaced_meanwhile(path, config, tokenizer, **kwargs):
        fs.pipe_file(url, small_corpus.read_text().splitlines()[0].encode() + b"\n")
        return real(path, config, tokenizer, **kwargs)

    monkeypatch.setattr(driver, "tokenize_corpus", replaced_meanwhile)
    manifest = _build(_config(toy_target, url, tmp_path / "cache"))
    assert manifest.settings.corpus_hash == file_sha256(small_corpus)
    assert manifest.corpus_stats["rows"] == 4


def test_verify_names_a_shard_computed_in_another_dtype(toy_target, small_corpus, tmp_path, monkeypatch):
    """A shard whose attributes say bf16 in an fp32 cache (one copied in from a bf16 build): verify names it."""
    from storage.verify import verify_cache

    monkeypatch.setenv(CPU_BF16_ENV, "0")
    out = tmp_path / "fp32"
    _build(_config(toy_target, small_corpus, out))
    name = load_manifest(out).shards[0].name
    group = zarr.open_group(str(out / SHARD_DIR / name), mode="r+")
    group.update_attributes({"compute": {"dtype": "bfloat16", "device": "cpu"}})
    problems = verify_cache(out)
    assert any(name in p and "attribute compute" in p and "another dtype" in p for p in problems), problems
