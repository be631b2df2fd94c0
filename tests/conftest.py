"""Shared fixtures: one local Ray cluster per test session, a tiny real Qwen3 target, a toy corpus,
an S3 server on 127.0.0.1 (tests/s3_fixtures.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.s3_fixtures import s3_bucket, s3_prefix  # noqa: F401 (one S3 server per session, started on first use)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `auto` dtypes as on a CPU without bf16 matrix units (pipeline/precision.py): the tests' numbers (golden
# trace, reference comparisons) must not depend on whether the CI machine has AMX.
os.environ.setdefault("ALRIRA_CPU_BF16", "0")


@pytest.fixture(scope="module")
def one_thread():
    """torch on 1 thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): tiny
    models gain nothing from intra-op threads, and spinning threads crawl on a shared CPU."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def ray_address(tmp_path_factory, s3_bucket):
    """Start a local 2-CPU Ray cluster once; tests and CLI subprocesses join it by address. It starts
    after the S3 server, so its workers inherit the store's AWS_* environment, as a user's nodes
    have it (whichever test asks for Ray first)."""
    import ray

    temp_dir = tmp_path_factory.mktemp("ray")
    context = ray.init(
        num_cpus=2,
        _temp_dir=str(temp_dir),
        include_dashboard=False,
        logging_level="WARNING",
        log_to_driver=False,
    )
    yield context.address_info["gcs_address"]
    ray.shutdown()


@pytest.fixture(scope="session")
def toy_target(tmp_path_factory) -> Path:
    """A tiny random Qwen3 (head_dim 32) with a word-level chat tokenizer, saved as an HF directory."""
    from pipeline.demo.toy import make_toy_target

    return make_toy_target(tmp_path_factory.mktemp("target") / "toy-qwen3", seed=0, peaked=True)


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "w") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")
    return path


@pytest.fixture(scope="session")
def toy_corpus(tmp_path_factory) -> Path:
    from pipeline.demo.toy import toy_chat_rows

    rows = toy_chat_rows(10, seed=1, response_words=(30, 60))
    return write_jsonl(tmp_path_factory.mktemp("corpus") / "chat.jsonl", rows)


@pytest.fixture(scope="session")
def k7_cache(ray_address, toy_target, toy_corpus, tmp_path_factory) -> Path:
    """A small real cache (K = 7, taps [0, 2], 16 anchors per sequence) built once per session with
    the Ray job, for tests that need a trained drafter."""
    from pipeline.cache_build.config import CacheBuildConfig
    from ray_jobs.build import build_cache

    cache = tmp_path_factory.mktemp("k7") / "cache"
    config = CacheBuildConfig.from_flags(
        target=str(toy_target), corpus=str(toy_corpus), out=str(cache), layers=[0, 2], anchors=16, top_k=4,
        max_length=128, shard_size=10, num_slots=7,
    )  # fmt: skip
    build_cache(config, progress=False, log=lambda m: None)
    return cache


@pytest.fixture(scope="session")
def shard1_reference(ray_address, toy_target, toy_corpus, tmp_path_factory) -> Path:
    """A clean build of tests/test_cache_build.py's small settings at --shard-size 1 on two workers
    (one shard per sequence), built once: the killed, interrupted and contested builds of
    test_cache_build.py and test_faults.py must resume to its shards (names and checksums, which do
    not depend on the number of workers)."""
    from ray_jobs.build import build_cache
    from tests.test_cache_build import _config

    out = tmp_path_factory.mktemp("shard1") / "reference"
    build_cache(_config(toy_target, toy_corpus, out, shard_size=1, workers=2), progress=False, log=lambda m: None)
    return out


def train_alr_drafter(cache: Path, run: Path, *, epochs: int, draft_layers: int | None = None) -> Path:
    """Train an alr drafter on `cache` (fp32 export); its checkpoint directory."""
    from pipeline.train import TrainConfig, train

    train(TrainConfig.from_flags(
        cache=str(cache), out=str(run), method="alr", epochs=epochs, batch_size=2, num_workers=0, rollout_depth=6,
        lr=3e-3, progress=False, save_dtype="float32", draft_layers=draft_layers,
    ))  # fmt: skip
    return run / "drafter"


# Vision-language (Qwen3-VL) fixtures: tests/vl_fixtures.py builds them.


@pytest.fixture(scope="session")
def vl_target(tmp_path_factory) -> Path:
    """A tiny random Qwen3-VL (untied) with its PIL image processor and a vision-token tokenizer."""
    from tests.vl_fixtures import make_toy_vl_target

    return make_toy_vl_target(tmp_path_factory.mktemp("vl-target") / "toy-qwen3-vl", seed=0)


@pytest.fixture(scope="session")
def vl_corpus(tmp_path_factory) -> Path:
    """corpus.jsonl with image rows in every accepted form and text-only rows, images/ beside it."""
    from tests.vl_fixtures import mixed_vl_rows, write_images

    folder = tmp_path_factory.mktemp("vl-corpus")
    write_images(folder / "images")
    return write_jsonl(folder / "corpus.jsonl", mixed_vl_rows())


@pytest.fixture(scope="session")
def vl_vision(vl_target, vl_corpus):
    """The vision inputs a build of vl_corpus on vl_target resolves (its processor, image root and
    image tokens)."""
    from pipeline.cache_build.corpus import CorpusConfig, corpus_vision_inputs

    return corpus_vision_inputs(vl_target, CorpusConfig(path=str(vl_corpus)))


# Llama-architecture targets (docs/design.md, "The target"): the tokenizer fills the embedding, so
# the mask token is an existing one.

LLAMA_MASK_TOKEN = "<|reserved_special_token_0|>"


@pytest.fixture(scope="session")
def llama_target(tmp_path_factory) -> Path:
    """A tiny random Llama 3 style target: GQA, tied embeddings, Llama 3's RoPE scaling, special
    tokens, chat format and end ids, and one embedding row per token."""
    from pipeline.demo.toy import make_toy_llama_target

    return make_toy_llama_target(tmp_path_factory.mktemp("llama-target") / "toy-llama3", chat_style="llama3", peaked=True)


@pytest.fixture(scope="session")
def llama_cache(ray_address, llama_target, toy_corpus, tmp_path_factory) -> Path:
    """k7_cache's settings on the Llama 3 style target, the mask token a reserved special token."""
    from pipeline.cache_build.config import CacheBuildConfig
    from ray_jobs.build import build_cache

    cache = tmp_path_factory.mktemp("llama-k7") / "cache"
    config = CacheBuildConfig.from_flags(
        target=str(llama_target), corpus=str(toy_corpus), out=str(cache), mask_token=LLAMA_MASK_TOKEN, layers=[0, 2],
        anchors=16, top_k=4, max_length=128, shard_size=10, num_slots=7,
    )  # fmt: skip
    build_cache(config, progress=False, log=lambda m: None)
    return cache


@pytest.fixture(scope="session")
def llama_drafter(llama_cache, tmp_path_factory) -> Path:
    """A 1-layer alr drafter trained on llama_cache (as tests/test_vllm_serving.py's Qwen3 ones)."""
    return train_alr_drafter(llama_cache, tmp_path_factory.mktemp("llama-run") / "run", epochs=12, draft_layers=1)
