"""The evaluation split cannot lie (storage/eval_split.py, pipeline/eval/split.py): it is checked like
a shard before use by `verify`, `info` and training (record fields and types, counts against the
tensors, token ids against the vocabulary, feature widths against the taps); a bad or empty
--eval-prompts is refused before any shard; its repeats and corpus overlaps are counted; every
evaluation point names the split it measured and a resume never joins two splits; `--estimate`
counts its bytes. In-process builds of the toy target (pipeline/cache_build/driver.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors

from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.driver import build_cache
from pipeline.train.config import TrainConfig
from ray_jobs.cli import cache_cli
from storage.eval_split import EVAL_SPLIT_FILE, EVAL_SPLIT_RECORD, SplitFit, read_eval_split, split_identity, write_eval_split
from storage.location import resolve
from storage.manifest import load_manifest
from storage.verify import verify_cache
from tests.conftest import write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")
NEW_TOKENS = 10
PROMPTS = [
    {"benchmark": "a", "prompt": "tell me a story about the river ."},
    {"benchmark": "a", "prompt": "what is the name of the city ?"},
    {"benchmark": "b", "prompt": "tell me a story about the river ."},  # repeats row 0
]


def _config(target: Path, corpus: Path, out: Path, **flags) -> CacheBuildConfig:
    small = {"anchors": 4, "shard_size": 2, "max_length": 128, "layers": [0, 2], "top_k": 4, "num_slots": 4,
             "eval_max_new_tokens": NEW_TOKENS}  # fmt: skip
    return CacheBuildConfig.from_flags(target=str(target), corpus=str(corpus), out=str(out), **{**small, **flags})


@pytest.fixture(scope="module")
def corpus(toy_corpus, tmp_path_factory) -> Path:
    rows = [json.loads(line) for line in toy_corpus.read_text().splitlines()[:4]]
    return write_jsonl(tmp_path_factory.mktemp("split-corpus") / "chat.jsonl", rows)


@pytest.fixture(scope="module")
def split_cache(toy_target, corpus, tmp_path_factory) -> tuple[Path, list[str]]:
    """A cache whose split holds 4 prompts: one repeats another, one is a corpus row's conversation."""
    root = tmp_path_factory.mktemp("split-checks")
    from_corpus = {"conversations": json.loads(corpus.read_text().splitlines()[1])["conversations"][:2]}  # system + first user turn
    prompts = write_jsonl(root / "held_out.jsonl", [*PROMPTS, from_corpus])
    logs: list[str] = []
    build_cache(_config(toy_target, corpus, root / "cache", eval_prompts=str(prompts)), progress=False, log=logs.append)
    return root / "cache", logs


def _train(cache: Path, out: Path, **overrides):
    from pipeline.train.loop import train

    flags = dict(cache=str(cache), out=str(out), method="alr", epochs=1, batch_size=2, num_workers=0, progress=False, log_every=100,
                 lr=3e-3, save_dtype="float32", eval_every=1, rollout_depth=3)  # fmt: skip
    return train(TrainConfig.from_flags(**{**flags, **overrides}))


# ----------------------------------------------------------------------------------------------
# Checked like a shard


def _craft(cache: Path, *, tensors=None, record=None) -> None:
    """Edit the split's tensors (`tensors(dict)`, then the record's sha256 and bytes updated as a
    careful forger would) and/or its record (`record(dict)`)."""
    record_path = cache / EVAL_SPLIT_RECORD
    saved = json.loads(record_path.read_text())
    if tensors is not None:
        arrays = dict(load_tensors((cache / EVAL_SPLIT_FILE).read_bytes()))
        tensors(arrays)
        data = save_tensors(arrays)
        (cache / EVAL_SPLIT_FILE).write_bytes(data)
        import hashlib

        saved.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    if record is not None:
        saved = record(saved)
    record_path.write_text(json.dumps(saved))


def _set(d: dict, **values) -> dict:
    d.update(values)
    return d


def _without(d: dict, name: str) -> dict:
    d.pop(name)
    return d


def _vocab(cache: Path) -> int:
    return load_manifest(cache).vocab_size


CRAFTED = {
    # name: (tensors edit, record edit, what the line says, whether `info` (header only) sees it)
    "num_prompts-edited": (None, lambda r: _set(r, num_prompts=r["num_prompts"] + 1), "its record (5 prompts", True),
    "num_tokens-edited": (None, lambda r: _set(r, num_tokens=r["num_tokens"] - 1), "tokens is I64", True),
    "field-missing": (None, lambda r: _without(r, "num_tokens"), "damaged record: num_tokens must be an integer >= 0, got None", True),
    "key-field-missing": (None, lambda r: _without(r["key"], "max_new_tokens") and r, "damaged record: key.max_new_tokens", True),
    "wrong-type": (None, lambda r: _set(r, num_prompts="4"), "damaged record: num_prompts must be an integer >= 0, got '4'", True),
    "layer-ids-type": (None, lambda r: _set(r["key"], layer_ids="0,2") and r, "damaged record: key.layer_ids must be a list", True),
    "not-an-object": (None, lambda r: [r], "damaged record: a JSON object, got list", True),
    "zero-prompts": (None, lambda r: _set(r, num_prompts=0), "num_prompts must be >= 1", True),
    "token-past-vocab": (lambda t: t["tokens"].__setitem__(-1, 10**6), None, "outside the target's vocabulary", False),
    "negative-token": (lambda t: t["tokens"].__setitem__(0, -1), None, "outside the target's vocabulary", False),
    "feature-width": (lambda t: t.__setitem__("features", np.ascontiguousarray(t["features"][:, :-1])), None,
                      "features is F32", True),
    "features-fp16": (lambda t: t.__setitem__("features", t["features"].astype(np.float16)), None, "features is F16", True),
    "tokens-int32": (lambda t: t.__setitem__("tokens", t["tokens"].astype(np.int32)), None, "tokens is I32", True),
    "offsets-past-end": (lambda t: t["offsets"].__setitem__(-1, t["offsets"][-1] + 5), None, "offsets do not cut", False),
    "prompt-longer-than-sequence": (lambda t: t["prompt_lengths"].__setitem__(0, 10**4), None, "a prompt length", False),
    "nan-features": (lambda t: t["features"].__setitem__((0, 0), np.nan), None, "features hold NaN", False),
    "tensor-missing": (lambda t: t.pop("prompt_ids"), None, "holds tensors", True),
    "other-taps": (None, lambda r: _set(r["key"], layer_ids=[0, 1]) and r, "computed for another target or taps", True),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_verify_info_and_training_check_the_split_like_a_shard(split_cache, tmp_path, case):
    """An edited record or a crafted split whose checksum was updated with it: `verify` names it
    (an edited num_prompts passed, a crafted token id said OK), `info` names what the header shows
    (it printed the edited count), training refuses before step 1 and before --out is claimed (an
    IndexError after step 1, KeyError tracebacks)."""
    tensors, record, message, header_shows = CRAFTED[case]
    cache = tmp_path / "cache"
    shutil.copytree(split_cache[0], cache)
    _craft(cache, tensors=tensors, record=record)
    problems = verify_cache(cache)
    assert len(problems) == 1 and message in problems[0] and EVAL_SPLIT_FILE.split(".")[0] in problems[0], problems
    info = CliRunner().invoke(cache_cli, ["info", str(cache)])
    assert "Traceback" not in info.output
    if header_shows:
        assert info.exit_code == 1 and message in info.output, info.output
    else:
        assert info.exit_code == 0, info.output  # token values: read by verify and training, not by info
    run = tmp_path / "run"
    with pytest.raises(ValueError, match="eval_split") as refused:
        _train(cache, run)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not run.exists()  # refused before step 1: --out never claimed


def test_the_intact_split_passes_every_check(split_cache):
    cache, _ = split_cache
    assert verify_cache(cache) == []
    split = read_eval_split(resolve(cache), SplitFit.of(load_manifest(cache)))
    assert split.num_prompts == 4 and int(split.tokens.max()) < _vocab(cache) and split.features.shape[1] == load_manifest(cache).feature_dim


def test_a_rebuild_computes_a_damaged_split_again(split_cache, toy_target, corpus, tmp_path):
    """What the refusals advise works: the same build again keeps the shards and replaces a split
    that fails its checks (a split of the same key was kept, damaged or not)."""
    cache = tmp_path / "cache"
    shutil.copytree(split_cache[0], cache)
    _craft(cache, tensors=CRAFTED["token-past-vocab"][0])
    prompts = json.loads((cache / "build_provenance.json").read_text())["invocations"][0]["config"]["eval_prompts"]
    logs: list[str] = []
    build_cache(_config(toy_target, corpus, cache, eval_prompts=prompts), progress=False, log=logs.append)
    assert any("outside the target's vocabulary" in line and line.endswith("; computing it again") for line in logs), logs
    assert verify_cache(cache) == [] and (cache / EVAL_SPLIT_FILE).read_bytes() == (split_cache[0] / EVAL_SPLIT_FILE).read_bytes()


@pytest.mark.parametrize(
    "rows, message",
    [
        ([], "no prompts"),
        (['{"prompt": "a"}', "{not json"], ":2: bad JSON"),
        ([{"text": "no prompt here"}], "row has no 'prompt' string"),
        ([{"prompt": "look <image>", "image": "x.png"}], "has an image"),
        ([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}, {"from": "gpt", "value": "y"}]},
          {"messages": [{"role": "assistant", "content": "only"}]}], ":2: "),
    ],
    ids=["empty", "bad-json", "no-prompt", "image", "no-user-turn"],
)
def test_a_bad_or_empty_eval_prompts_is_refused_before_any_shard(toy_target, corpus, tmp_path, rows, message):
    """Refused by the plan, before --out is claimed (it was refused after every shard was built,
    leaving a cache without its provenance record)."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "cache"
    with pytest.raises(ValueError, match="--eval-prompts") as refused:
        build_cache(_config(toy_target, corpus, out, eval_prompts=str(prompts)), progress=False, log=lambda m: None)
    assert message in str(refused.value) and str(prompts) in str(refused.value)
    assert not out.exists()


# ----------------------------------------------------------------------------------------------
# Held out? Repeats and corpus overlaps


def test_repeats_and_corpus_overlaps_are_reported_by_the_build_and_info(split_cache):
    cache, logs = split_cache
    record = json.loads((cache / EVAL_SPLIT_RECORD).read_text())
    assert record["held_out"] == {"duplicate_prompts": 1, "corpus_overlaps": 1}
    assert any("not all held out: 1 of 4 prompt(s) repeat an earlier one, 1 are also in the corpus" in line for line in logs), logs
    info = CliRunner().invoke(cache_cli, ["info", str(cache)])
    assert info.exit_code == 0 and "4 prompts" in info.output and "1 repeat an earlier prompt, 1 also in the corpus" in info.output


def test_a_held_out_split_reports_nothing(toy_target, corpus, tmp_path):
    from pipeline.eval.split import held_out_counts
    from pipeline.eval.evaluate import load_prompts
    from pipeline.target import load_tokenizer

    prompts = write_jsonl(tmp_path / "p.jsonl", PROMPTS[:2])
    rows = load_prompts(prompts, load_tokenizer(toy_target))
    assert held_out_counts(str(prompts), rows, corpus=corpus) == {"duplicate_prompts": 0, "corpus_overlaps": 0}


# ----------------------------------------------------------------------------------------------
# Which split an evaluation point measured


def test_every_eval_point_names_its_split_and_a_resume_on_another_split_is_refused(split_cache, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(split_cache[0], cache)
    run = tmp_path / "run"
    _train(cache, run)
    record = json.loads((cache / EVAL_SPLIT_RECORD).read_text())
    points = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evaluated = [p["eval"] for p in points if "eval" in p]
    assert evaluated and all(e["split"] == split_identity(record) for e in evaluated)
    _train(cache, run, epochs=2, resume=True)  # the same split: the curve goes on
    # The cache's split replaced by another (3 of its prompts, as a rebuild with other --eval-prompts leaves it).
    split = read_eval_split(resolve(cache), SplitFit.of(load_manifest(cache)))
    n = 3
    write_eval_split(
        resolve(cache), sequences=[split.sequence(i)[0] for i in range(n)], prompt_lengths=split.prompt_lengths[:n].tolist(),
        prompt_ids=split.prompt_ids[:n].tolist(), features=[split.sequence(i)[2] for i in range(n)],
        key={**split.key, "prompts_sha256": "sha256:" + "0" * 64},
    )  # fmt: skip
    with pytest.raises(ValueError) as refused:
        _train(cache, run, epochs=3, resume=True)
    line = str(refused.value)
    assert "--resume: its evaluation points measured split sha256:" in line and "(4 prompts" in line and "(3 prompts" in line, line
    assert f"split sha256:{record['sha256'][:12]}" in line and "\n" not in line


# ----------------------------------------------------------------------------------------------
# --estimate counts the split


def test_the_estimate_counts_the_split(toy_target, corpus, split_cache, tmp_path):
    from pipeline.cache_build.estimate import estimate_build, estimate_lines
    from storage.eval_split import split_file_bytes

    cache, _ = split_cache
    record = json.loads((cache / EVAL_SPLIT_RECORD).read_text())
    prompts = json.loads((cache / "build_provenance.json").read_text())["invocations"][0]["config"]["eval_prompts"]
    with_split = estimate_build(_config(toy_target, corpus, tmp_path / "c", eval_prompts=prompts), progress=False, log=lambda m: None)
    without = estimate_build(_config(toy_target, corpus, tmp_path / "c"), progress=False)
    split, width = with_split["eval_split"], load_manifest(cache).feature_dim
    written = (cache / EVAL_SPLIT_FILE).stat().st_size
    # At most every prompt's budget: the bound holds what was written, and misses it only by the
    # tokens the target did not generate (a stop token) and the header's slack.
    assert written <= split["bytes"] <= written + (split["max_tokens"] - record["num_tokens"]) * (8 + 4 * width) + 1024
    assert split["bytes"] == split_file_bytes(num_tokens=split["max_tokens"], num_prompts=4, feature_width=width)
    assert with_split["bytes"] - without["bytes"] == split["bytes"]
    assert with_split["upper_bytes"] - without["upper_bytes"] > split["bytes"]
    assert any(line.startswith("eval split: 4 prompts, at most") for line in estimate_lines(with_split))
