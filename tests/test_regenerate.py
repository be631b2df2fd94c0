"""`alrira-cache regenerate` (docs/design.md, "Regeneration"): turn-by-turn order, same bytes twice,
resume after a kill, length control and the build's loss window, accounting, bad rows, a store
--out, HF vs vLLM, a vision-language row."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from pipeline.cache_build.corpus import CorpusConfig, _turn_masks, ingest_corpus
from pipeline.chat import iter_corpus_rows, normalize_row
from pipeline.demo.toy import toy_chat_rows
from pipeline.regenerate.config import RegenerateConfig
from pipeline.regenerate.driver import regenerate_corpus, summary_line
from pipeline.eval.evaluate import render_prompt
from pipeline.target import load_target, load_tokenizer
from pipeline.vision import VisionInputConfig
from storage.location import resolve
from tests.conftest import write_jsonl
from tests.waits import HANG_CAP_S

pytestmark = pytest.mark.usefixtures("one_thread")
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
MAX_NEW = 12


@pytest.fixture(scope="module")
def short_corpus(tmp_path_factory) -> Path:
    """Five rows of one or two exchanges with answers of 3-10 words: some corpus turns are shorter
    than --max-new-tokens, so truncate and window have something to cut."""
    rows = toy_chat_rows(5, seed=1, min_turns=1, max_turns=2, response_words=(3, 10))
    return write_jsonl(tmp_path_factory.mktemp("regen") / "chat.jsonl", rows)


def config(target, corpus, out, **flags) -> RegenerateConfig:
    return RegenerateConfig.from_flags(
        target=str(target), corpus=str(corpus), out=str(out), max_new_tokens=MAX_NEW, rows_per_part=2, **flags
    )


def parts(out) -> dict[str, bytes]:
    location = resolve(out)
    return {name: location.read_bytes(name) for name in location.names() if name.startswith("part-")}


def rows_of(out) -> list[dict]:
    return [row for _, row in iter_corpus_rows(out)]


@pytest.fixture(scope="module")
def greedy_run(ray_address, toy_target, short_corpus, tmp_path_factory):
    """The corpus regenerated on Ray (two workers, three parts), through the CLI."""
    from ray_jobs.cli import cache_cli

    out = tmp_path_factory.mktemp("greedy") / "out"
    args = ["regenerate", "--target", str(toy_target), "--corpus", str(short_corpus), "--out", str(out),
            "--max-new-tokens", str(MAX_NEW), "--rows-per-part", "2", "--workers", "2", "--no-progress"]  # fmt: skip
    result = CliRunner().invoke(cache_cli, args)
    assert result.exit_code == 0, result.output
    return out, result.output


def test_every_assistant_turn_is_rewritten_in_order(greedy_run, toy_target, short_corpus):
    """Turn 2 is what the target writes after the original user turns and the regenerated turn 1."""
    from pipeline.regenerate.backends import HfGenerator, TurnRequest
    from pipeline.regenerate.config import SamplingConfig
    import torch

    out, output = greedy_run
    assert f"{out}: 5 rows in = 5 written + 0 failed + 0 skipped; 7 turns, " in output
    originals = [row for _, row in iter_corpus_rows(short_corpus)]
    rows = rows_of(out)
    assert [row["source_row"] for row in rows] == list(range(5))
    generator = HfGenerator(str(toy_target), sampling=SamplingConfig(), device="cpu", dtype=torch.float32, batch_tokens=1 << 20)
    tokenizer = generator.tokenizer
    two_turn = next(i for i, row in enumerate(rows) if sum(t["from"] == "gpt" for t in row["conversations"]) == 2)
    new, old = normalize_row(rows[two_turn], where="out").messages, normalize_row(originals[two_turn], where="in").messages
    assert [m["role"] for m in new] == [m["role"] for m in old]
    assert [m["content"] for m in new if m["role"] != "assistant"] == [m["content"] for m in old if m["role"] != "assistant"]
    assert all(a["content"] != b["content"] for a, b in zip(new, old) if a["role"] == "assistant")
    last = max(i for i, m in enumerate(new) if m["role"] == "assistant")
    prompt = tokenizer.apply_chat_template(new[:last], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    request = TurnRequest(prompt_ids=tokenizer(prompt, add_special_tokens=False)["input_ids"], max_new_tokens=MAX_NEW, seed=0)
    expected = tokenizer.decode(generator.generate_one(request).token_ids, skip_special_tokens=False)
    assert new[last]["content"] == expected


def test_a_rerun_writes_the_same_bytes_and_a_killed_run_resumes(greedy_run, toy_target, short_corpus, tmp_path):
    """In process, one worker: the same bytes as the two-worker Ray run. Then a run killed after
    its first part resumes: the part kept as it was, a corrupted part rewritten, the rest written."""
    out, _ = greedy_run
    here = tmp_path / "here"
    cfg = config(toy_target, short_corpus, here)

    def one_part_then_die(plan, pending):
        from pipeline.regenerate.parts import PartWriter

        yield PartWriter(plan.config).write(pending[0])
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        regenerate_corpus(cfg, run_parts=one_part_then_die, log=lambda m: None)
    kept = (here / "part-00000.jsonl").stat().st_mtime_ns
    manifest = json.loads((here / "manifest.json").read_text())
    assert [p["name"] for p in manifest["parts"]] == ["part-00000.jsonl"] and "totals" in manifest
    logs = []
    final = regenerate_corpus(cfg, log=logs.append)
    assert "resuming, 1/3 part(s) already written and intact" in logs[0]
    assert (here / "part-00000.jsonl").stat().st_mtime_ns == kept
    assert parts(here) == parts(out)
    (here / "part-00001.jsonl").write_bytes(b"{}\n")  # damaged since it was written: redone
    logs.clear()
    regenerate_corpus(cfg, log=logs.append)
    assert "resuming, 2/3 part(s)" in logs[0] and parts(here) == parts(out)
    assert final["provenance"]["target_hash"].startswith("sha256:") and final["provenance"]["versions"]["torch"]
    assert final["totals"]["written"] == 5


def test_out_refuses_foreign_folders_and_names_changed_settings(greedy_run, toy_target, short_corpus, tmp_path):
    out, _ = greedy_run
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and not a regeneration output"):
        regenerate_corpus(config(toy_target, short_corpus, tmp_path))
    with pytest.raises(ValueError, match=r"settings\.temperature: 0\.0 -> 0\.7.*--overwrite"):
        regenerate_corpus(config(toy_target, short_corpus, out, temperature=0.7))
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_sampling_is_seeded_per_row_and_overwrite_replaces_the_output(greedy_run, toy_target, short_corpus, tmp_path):
    """T > 0: a row's text depends on --seed and the row only (not on the part it falls in), and
    differs from greedy; --overwrite replaces an output written with other settings."""
    out, _ = greedy_run
    sampled = tmp_path / "sampled"
    regenerate_corpus(config(toy_target, short_corpus, sampled), log=lambda m: None)
    flags = dict(temperature=0.8, top_p=0.9, seed=3)
    manifest = regenerate_corpus(config(toy_target, short_corpus, sampled, overwrite=True, **flags), log=lambda m: None)
    assert manifest["provenance"]["settings"]["temperature"] == 0.8
    one_part = RegenerateConfig.from_flags(
        target=str(toy_target), corpus=str(short_corpus), out=str(tmp_path / "one"), max_new_tokens=MAX_NEW, rows_per_part=5, **flags
    )  # fmt: skip
    regenerate_corpus(one_part, log=lambda m: None)
    assert rows_of(sampled) == rows_of(tmp_path / "one") != rows_of(out)


def test_every_invocation_records_its_provenance(toy_target, short_corpus, tmp_path, monkeypatch):
    """OUT/regenerate_provenance.json: one entry per invocation (a rerun that resumes adds its own),
    each with the command, package versions, its flags and the compute `auto` resolved to; an
    --overwrite replaces it with the output, and the output it leaves is still ours to resume."""
    from pipeline.corpus_source import file_sha256
    from pipeline.precision import CPU_BF16_ENV

    monkeypatch.setenv(CPU_BF16_ENV, "0")  # `auto` resolves to fp32 on this CPU
    out = tmp_path / "out"
    regenerate_corpus(config(toy_target, short_corpus, out), log=lambda m: None)
    corpus_hash = file_sha256(out)
    regenerate_corpus(config(toy_target, short_corpus, out), log=lambda m: None)  # every part kept
    assert file_sha256(out) == corpus_hash  # the record is not rows: a cache built from OUT still resumes
    first, second = json.loads((out / "regenerate_provenance.json").read_text())["invocations"]
    for entry in (first, second):
        assert entry["config"]["target"] == str(toy_target) and entry["config"]["max_new_tokens"] == MAX_NEW
        assert entry["config"]["target_dtype"] == "auto" and entry["config"]["compute"] == {"dtype": "float32", "device": "cpu"}
        assert entry["versions"]["torch"] and isinstance(entry["command"], list)
    regenerate_corpus(config(toy_target, short_corpus, out, length_control="truncate", overwrite=True), log=lambda m: None)
    [replaced] = json.loads((out / "regenerate_provenance.json").read_text())["invocations"]
    assert replaced["config"]["length_control"] == "truncate" and replaced["config"]["overwrite"] is True


def test_truncate_and_window_match_the_corpus_turn_lengths_in_the_build(toy_target, short_corpus, tmp_path):
    """truncate: every turn's supervised length <= the corpus turn's, equal where the target wrote
    more. window: the whole turn kept, the build's loss mask covers its first loss_tokens tokens
    (end-of-turn included only inside the window)."""
    tokenizer = load_tokenizer(toy_target)
    corpus_lengths = [_lengths(tokenizer, row) for _, row in iter_corpus_rows(short_corpus)]
    regenerate_corpus(config(toy_target, short_corpus, tmp_path / "none"), log=lambda m: None)
    regenerate_corpus(config(toy_target, short_corpus, tmp_path / "truncate", length_control="truncate"), log=lambda m: None)
    regenerate_corpus(config(toy_target, short_corpus, tmp_path / "window", length_control="window"), log=lambda m: None)
    whole = [_lengths(tokenizer, row) for row in rows_of(tmp_path / "none")]
    cut = [_lengths(tokenizer, row) for row in rows_of(tmp_path / "truncate")]
    assert any(w > c for ws, cs in zip(whole, corpus_lengths) for w, c in zip(ws, cs))  # something to cut
    for ws, cs, ts in zip(whole, corpus_lengths, cut):
        # Turn 1 is the same text as without length control, cut; later turns follow the cut turns.
        assert ts[0] == min(ws[0], cs[0]) and all(t <= c for t, c in zip(ts, cs))

    windowed = rows_of(tmp_path / "window")
    assert [_lengths(tokenizer, row) for row in windowed] == whole  # the text is kept whole
    built = ingest_corpus(CorpusConfig(path=str(tmp_path / "window"), min_supervised_tokens=0), tokenizer, progress=False)
    for i, row in enumerate(windowed):
        messages = normalize_row(row, where="window").messages
        windows = [m["loss_tokens"] for m in messages if m["role"] == "assistant"]
        assert windows == corpus_lengths[i]
        input_ids, masks = _turn_masks(tokenizer, [{k: v for k, v in m.items() if k != "loss_tokens"} for m in messages], where="w")
        expected = np.zeros(len(input_ids), np.uint8)
        for (_, mask), window in zip(masks, windows):
            expected[np.flatnonzero(mask)[:window]] = 1  # the first N of content + end-of-turn
        assert np.array_equal(built.sequence(i)[1], expected)
    supervised = sum(min(w, c) for ws, cs in zip(whole, corpus_lengths) for w, c in zip(ws, cs))
    assert int(built.loss_mask.sum()) == supervised
    # The build (its driver, shards written in-process) takes the folder as its --corpus.
    from pipeline.cache_build.config import CacheBuildConfig
    from pipeline.cache_build.driver import build_cache, run_shards_here

    cache = CacheBuildConfig.from_flags(
        target=str(toy_target), corpus=str(tmp_path / "window"), out=str(tmp_path / "cache"), layers=[0, 2], anchors=4,
        top_k=4, num_slots=7, min_supervised_tokens=0, rollouts=False,
    )  # fmt: skip
    manifest = build_cache(cache, run_shards=run_shards_here, progress=False, log=lambda m: None)
    assert manifest.corpus_stats["supervised_tokens"] == supervised and manifest.corpus_stats["sequences"] == 5


def _lengths(tokenizer, row) -> list[int]:
    from pipeline.cache_build.corpus import assistant_turn_lengths

    messages = [{k: v for k, v in m.items() if k != "loss_tokens"} for m in normalize_row(row, where="row").messages]
    return assistant_turn_lengths(tokenizer, messages)


def test_bad_rows_stop_with_their_line_or_are_counted(toy_target, short_corpus, tmp_path):
    lines = short_corpus.read_text().splitlines()
    too_long = {"messages": [{"role": "user", "content": "the " * 4100}, {"role": "assistant", "content": "a cat ."}]}
    bad = write_jsonl(tmp_path / "bad.jsonl", [lines[0], "{not json", lines[1], json.dumps({"messages": []}), too_long])
    with pytest.raises(ValueError, match=rf"^{bad}:2: bad JSON"):
        regenerate_corpus(config(toy_target, bad, tmp_path / "stop"), log=lambda m: None)
    manifest = regenerate_corpus(config(toy_target, bad, tmp_path / "skip", skip_bad_rows=True), log=lambda m: None)
    assert summary_line(manifest).startswith(
        f"{tmp_path / 'skip'}: 5 rows in = 2 written + 1 failed (prompt_too_long 1) + 2 skipped (bad_json 1, empty_conversation 1); "
    )
    assert [part["failed_rows"] for part in manifest["parts"]] == [[], [], [4]]
    assert [row["source_row"] for row in rows_of(tmp_path / "skip")] == [0, 2]


def test_a_store_out_holds_the_same_parts(greedy_run, toy_target, short_corpus, s3_prefix):
    out, _ = greedy_run
    manifest = regenerate_corpus(config(toy_target, short_corpus, s3_prefix), log=lambda m: None)
    assert parts(s3_prefix) == parts(out)
    assert json.loads(resolve(s3_prefix).read_bytes("manifest.json"))["totals"] == manifest["totals"]


@needs_vllm
def test_hf_and_vllm_write_the_same_text(ray_address, greedy_run, toy_target, short_corpus, tmp_path):
    """On the tiny peaked target greedy decoding has no logit ties: every row agrees."""
    from ray_jobs.regenerate import regenerate_corpus as on_ray

    out, _ = greedy_run
    vllm_out = tmp_path / "vllm"
    on_ray(config(toy_target, short_corpus, vllm_out, backend="vllm"), progress=False, log=lambda m: None)
    hf_rows, vllm_rows = rows_of(out), rows_of(vllm_out)
    differing = [i for i, (a, b) in enumerate(zip(hf_rows, vllm_rows)) if a != b]
    assert len(vllm_rows) == 5 and differing == []


def test_a_vision_language_row_is_regenerated_with_its_image(vl_target, vl_corpus, tmp_path):
    out = tmp_path / "vl"
    manifest = regenerate_corpus(
        RegenerateConfig.from_flags(target=str(vl_target), corpus=str(vl_corpus), out=str(out), max_new_tokens=6), log=lambda m: None
    )
    assert manifest["totals"]["written"] == 6
    rows = rows_of(out)
    assert rows[0]["image"] == "images/a.png" and rows[0]["conversations"][1]["value"]
    assert manifest["provenance"]["image_root"] == str(vl_corpus.parent.resolve())
    tokenizer = load_tokenizer(vl_target)
    from pipeline.cache_build.corpus import corpus_vision_inputs

    corpus = CorpusConfig(path=str(out), min_supervised_tokens=0)
    built = ingest_corpus(corpus, tokenizer, progress=False, vision=corpus_vision_inputs(vl_target, corpus))
    assert built.stats["images"] == 4 and len(built) == 6
    explicit = CorpusConfig(path=str(out), vision_input=VisionInputConfig(image_root=str(tmp_path)))
    assert corpus_vision_inputs(vl_target, explicit).image_root == tmp_path  # --image-root still wins
    with pytest.raises(ValueError, match="vision-language target"):
        regenerate_corpus(RegenerateConfig.from_flags(target=str(vl_target), corpus=str(vl_corpus), out=str(tmp_path / "v"), backend="vllm"))


def test_a_damaged_manifest_stops_in_one_line(toy_target, short_corpus, tmp_path):
    """A part name from the manifest is never joined onto the folder: it must be its index's name."""
    folder = tmp_path / "regen"
    folder.mkdir()
    (folder / "x.jsonl").write_text(short_corpus.read_text())
    part = {"index": 0, "name": "../chat.jsonl", "lines": 5, "written": 5, "turns": 5, "turns_cut": 0,
            "generated_tokens": 9, "failed": {}, "skipped": {}, "sha256": "sha256:0"}  # fmt: skip
    manifest = {"kind": "alrira-regenerated-corpus", "num_parts": 1, "parts": [part], "provenance": {}}
    for damage, message in [({}, "is named '../chat.jsonl'"), ({"parts": None}, "'parts' missing"),
                            ({"parts": [{**part, "name": "part-00000.jsonl", "lines": "5"}]}, "lacks its counts")]:  # fmt: skip
        (folder / "manifest.json").write_text(json.dumps({**manifest, **damage}))
        with pytest.raises(ValueError, match=rf"^{folder / 'manifest.json'}: damaged manifest \(.*{message}"):
            list(iter_corpus_rows(folder))
        with pytest.raises(ValueError, match=rf"^{folder / 'manifest.json'}: damaged manifest"):
            regenerate_corpus(config(toy_target, short_corpus, folder), log=lambda m: None)


def test_a_worker_that_cannot_load_the_target_stops_in_one_line(ray_address, toy_target, short_corpus, tmp_path):
    """The weights missing on the nodes (the driver hashes the same files): the worker's own error
    in one line, not three worker deaths and a traceback."""
    import shutil

    from ray_jobs.cli import cache_cli

    target = shutil.copytree(toy_target, tmp_path / "target")
    for weights in target.glob("*.safetensors"):
        weights.unlink()
    args = ["regenerate", "--target", str(target), "--corpus", str(short_corpus), "--out", str(tmp_path / "out"), "--no-progress"]
    result = CliRunner().invoke(cache_cli, args)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert result.output.startswith("Error: node ") and "worker died" not in result.output


def test_the_targets_generation_config_does_not_change_the_tokens(toy_target, tmp_path):
    """A banned first token, repetition penalty and minimum length in generation_config.json are
    not ours: the output is plain greedy decoding."""
    import shutil

    import torch
    from transformers import GenerationConfig

    from pipeline.regenerate.backends import HfGenerator, TurnRequest

    target = shutil.copytree(toy_target, tmp_path / "target")
    sampling = RegenerateConfig.from_flags(target=str(target), corpus="c.jsonl", out="o", max_new_tokens=MAX_NEW).sampling
    model = load_target(target, device="cpu", dtype=torch.float32)
    prompt = render_prompt(load_tokenizer(target), [{"role": "user", "content": "the cat"}])
    ids = list(prompt)
    with torch.no_grad():  # plain greedy decoding, one forward per token
        for _ in range(MAX_NEW):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    greedy = ids[len(prompt) :]
    config_file = target / "generation_config.json"
    settings = json.loads(config_file.read_text()) if config_file.is_file() else {}
    settings.update(suppress_tokens=[greedy[0]], repetition_penalty=100.0, min_new_tokens=MAX_NEW)
    config_file.write_text(json.dumps(settings))
    with torch.no_grad():  # what the target's settings would make of the same prompt
        target_settings = GenerationConfig.from_pretrained(target)
        penalized = model.generate(torch.tensor([prompt]), generation_config=target_settings, max_new_tokens=MAX_NEW)
    assert penalized[0, len(prompt)].item() != greedy[0]
    generator = HfGenerator(str(target), sampling=sampling, device="cpu", dtype=torch.float32, batch_tokens=4096)
    [output] = generator.generate([TurnRequest(prompt_ids=prompt, max_new_tokens=MAX_NEW, seed=0, image=None)])
    stop = next((i for i, token in enumerate(greedy) if token in generator.stop_ids), len(greedy))
    assert output.token_ids == greedy[:stop] and output.stopped == (stop < len(greedy))


def test_regenerate_on_a_builds_out_leaves_its_actors_alone(ray_address, toy_target, short_corpus, tmp_path):
    """A mistyped `--out CACHE`: refused before anything is stopped, and a build's actor names are not
    regeneration's anyway."""
    import ray

    from ray_jobs.pool import ACTOR_NAMESPACE, actor_prefix
    from ray_jobs.cli import cache_cli

    @ray.remote(num_cpus=0)
    class Live:
        def ping(self) -> int:
            return 1

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text("{}")
    name = actor_prefix(cache, stage="cache") + "live"
    assert not name.startswith(actor_prefix(cache, stage="regenerate"))
    live = Live.options(name=name, namespace=ACTOR_NAMESPACE).remote()
    try:
        args = ["regenerate", "--target", str(toy_target), "--corpus", str(short_corpus), "--out", str(cache), "--no-progress"]
        result = CliRunner().invoke(cache_cli, args)
        assert result.output.startswith(f"Error: {cache}: not empty and not a regeneration output"), result.output
        assert ray.get(live.ping.remote(), timeout=HANG_CAP_S) == 1
    finally:
        ray.kill(live)


def test_out_may_not_be_the_corpus(greedy_run, toy_target, tmp_path):
    out, _ = greedy_run
    for corpus, target_out in [(out, out), (out, out / "again"), (out / "part-00000.jsonl", out)]:
        with pytest.raises(ValueError, match=rf"^--out {target_out}: is, or lies inside or around, --corpus {corpus}"):
            regenerate_corpus(config(toy_target, corpus, target_out, overwrite=True), log=lambda m: None)
    assert (out / "part-00000.jsonl").is_file()


def test_a_node_whose_corpus_differs_writes_nothing(ray_address, toy_target, short_corpus, tmp_path):
    """The driver hashed other rows than this node reads (a stale copy at the same path)."""
    import dataclasses

    from pipeline.regenerate.driver import plan_regenerate
    from ray_jobs.pool import plan_pool
    from ray_jobs.regenerate import run_parts_on_ray

    out = tmp_path / "out"
    regen = config(toy_target, short_corpus, out)
    plan = plan_regenerate(regen)
    plan = dataclasses.replace(plan, provenance={**plan.provenance, "corpus_hash": "sha256:" + "0" * 64})
    placements, published = plan_pool(regen.compute, workers_per_node=None), []
    refused = rf"^node \S+: --corpus {short_corpus} holds other rows than the driver's \(corpus hash \w+, driver 000000000000\)"
    with pytest.raises(ValueError, match=refused):
        published.extend(run_parts_on_ray(plan, plan.pending[:1], placements=placements, progress=False))
    assert published == [] and not (out / "part-00000.jsonl").exists()


def test_a_part_reads_the_corpus_from_its_own_first_row(short_corpus, tmp_path):
    """jsonl_row_seeks finds each part's first row once; a part then starts there (blank lines,
    a BOM and bad lines counted as the full read counts them), never re-reading the rows before it."""
    from pipeline.chat import jsonl_row_seeks
    from pipeline.regenerate.parts import corpus_rows

    lines = short_corpus.read_text().splitlines()
    path = tmp_path / "c.jsonl"
    path.write_bytes(("\ufeff" + "\n\n".join([lines[0], "{bad", *lines[1:], "", lines[2]]) + "\n").encode())
    seeks = jsonl_row_seeks(path, every=2)
    num_rows = sum(1 for _ in iter_corpus_rows(path))
    assert num_rows == 7 and len(seeks) == 4
    whole = [repr(row) for row in corpus_rows(str(path), start=0, stop=num_rows)]
    seeked = [repr(row) for i, seek in enumerate(seeks) for row in corpus_rows(str(path), start=2 * i, stop=2 * i + 2, seek=seek)]
    assert seeked == whole
    head = path.read_bytes()[: seeks[2][0]]
    path.write_bytes(b"\n" * len(head) + path.read_bytes()[len(head) :])  # rows 0-3 blanked: only a seek still finds rows 4-5
    assert [repr(row) for row in corpus_rows(str(path), start=4, stop=6, seek=seeks[2])] == whole[4:6]


def test_manifest_counts_are_checked_against_the_parts(greedy_run, toy_target, short_corpus, tmp_path):
    """docs/failure-modes.md: a manifest whose per-part counts were edited does not resume as intact
    (the part is written again, the totals add up), and a finished one is refused by its readers."""
    import shutil

    out, _ = greedy_run
    edited = shutil.copytree(out, tmp_path / "edited")
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["parts"][0]["written"] += 7
    (edited / "manifest.json").write_text(json.dumps(manifest))
    logs = []
    final = regenerate_corpus(config(toy_target, short_corpus, edited), log=logs.append)
    assert any(line.startswith("part-00000.jsonl: not kept (written 9 in the manifest, 2 in the part") for line in logs), logs
    assert final["totals"]["written"] == 5 and summary_line(final).startswith(f"{edited}: 5 rows in = 5 written")
    assert parts(edited) == parts(out)
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["parts"][1]["lines"] += 1
    (edited / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"part-00001.jsonl: holds 2 lines, its manifest says 3 \(edited or damaged\)"):
        list(iter_corpus_rows(edited))


def test_an_assistant_turn_with_tool_calls_is_refused_or_counted(toy_target, short_corpus, tmp_path):
    call = [{"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]
    with_calls = {"messages": [{"role": "user", "content": "where is the river ?"},
                               {"role": "assistant", "content": "let me look .", "tool_calls": call}]}  # fmt: skip
    corpus = write_jsonl(tmp_path / "tools.jsonl", [short_corpus.read_text().splitlines()[0], with_calls])
    with pytest.raises(ValueError, match=rf"^{corpus}:2: assistant message 1 carries 'tool_calls'"):
        regenerate_corpus(config(toy_target, corpus, tmp_path / "stop"), log=lambda m: None)
    manifest = regenerate_corpus(config(toy_target, corpus, tmp_path / "skip", skip_bad_rows=True), log=lambda m: None)
    assert "1 written + 0 failed + 1 skipped (assistant_tool_calls 1)" in summary_line(manifest)
    assert [row["source_row"] for row in rows_of(tmp_path / "skip")] == [0]


def test_a_target_with_damaged_weights_is_named_not_a_worker_death(ray_address, toy_target, short_corpus, tmp_path):
    import shutil

    from ray_jobs.cli import cache_cli

    target = shutil.copytree(toy_target, tmp_path / "target")
    for weights in target.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:1000])
    args = ["regenerate", "--target", str(target), "--corpus", str(short_corpus), "--out", str(tmp_path / "out"), "--no-progress"]
    result = CliRunner().invoke(cache_cli, args)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "model.safetensors: damaged weights file" in result.output and "worker died" not in result.output
