"""Training, target and image cases: nothing a run directory, a corpus or a cache holds
runs code, reads outside where it was pointed, or trains quietly on the wrong data
(docs/failure-modes.md)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from pipeline.train import TrainConfig, train
from storage.format import SHARD_DIR
from storage.manifest import load_manifest, save_manifest
from storage.checksums import shard_bytes, shard_checksum
from storage.format import shard_name
from tests.conftest import write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")

K = 7  # not the default 15: --rollout-depth must follow the cache's K


def _build(target: Path, corpus: Path, out: Path, **flags) -> Path:
    from pipeline.cache_build.config import CacheBuildConfig
    from pipeline.cache_build.driver import build_cache, run_shards_here

    config = CacheBuildConfig.from_flags(
        target=str(target), corpus=str(corpus), out=str(out), layers=[0, 2], anchors=8, top_k=4, max_length=128, **flags
    )  # fmt: skip
    build_cache(config, run_shards=run_shards_here, progress=False, log=lambda m: None)
    return out


@pytest.fixture(scope="module")
def caches(toy_target, toy_corpus, tmp_path_factory) -> dict[str, Path]:
    """A K = 7 Zarr cache of 3 shards (4, 4, 2 sequences) built in-process, and the same records
    as WebDataset tars with the build's tokenized corpus beside them."""
    from tests.test_wds_stream import rewrite_as_wds

    root = tmp_path_factory.mktemp("secdata")
    zarr_cache = _build(toy_target, toy_corpus, root / "zarr", shard_size=4, num_slots=K)
    sizes = [s.sequences for s in load_manifest(zarr_cache).shards]
    assert sizes == [4, 4, 2]
    wds_cache = rewrite_as_wds(zarr_cache, root / "wds", shard_sizes=sizes)
    shutil.copytree(zarr_cache / "corpus", wds_cache / "corpus")
    return {"zarr": zarr_cache, "wds": wds_cache}


def _config(cache: Path, out: Path, **overrides) -> TrainConfig:
    base = dict(cache=str(cache), out=str(out), method="alr", epochs=1, batch_size=2, num_workers=0, progress=False,
                save_dtype="float32")  # fmt: skip
    return TrainConfig.from_flags(**{**base, **overrides})


# ------------------------------------------------------------------------------------------------
# 2. A planted pickle in state.pt


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_planted_pickle_in_a_checkpoint_never_runs_and_stops_the_resume(caches, tmp_path):
    run = tmp_path / "run"
    train(_config(caches["zarr"], run, method="alr_ira", max_steps=2, save_every=1))
    # A real checkpoint resumes under weights_only=True.
    summary = train(_config(caches["zarr"], run, method="alr_ira", max_steps=3, save_every=1, resume=True))
    assert summary["steps"] == 3 and (run / "checkpoints" / "step-00000003" / "state.pt").is_file()
    marker = tmp_path / "code-ran"
    newest = run / "checkpoints" / "step-00000003" / "state.pt"
    state = torch.load(newest, weights_only=True)
    torch.save({**state, "config": _Payload(marker)}, newest)
    with pytest.raises(ValueError) as error:
        train(_config(caches["zarr"], run, method="alr_ira", max_steps=4, resume=True))
    message = str(error.value)
    assert "\n" not in message and f"{newest}: refused" in message and "nothing in it ran" in message
    assert not marker.exists()  # and the resume did not fall back to step 2 quietly either
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000003"
    # `latest` is a name that becomes a path: one pointing out of the run is refused, not followed.
    outside = tmp_path / "outside"
    (outside / "step-00000009").mkdir(parents=True)
    shutil.copy(run / "checkpoints" / "step-00000002" / "state.pt", outside / "step-00000009" / "state.pt")
    (run / "checkpoints" / "latest").write_text("../../outside/step-00000009\n")
    with pytest.raises(ValueError, match=r"latest: refused: names '\.\./\.\./outside/step-00000009'"):
        train(_config(caches["zarr"], run, method="alr_ira", max_steps=4, resume=True))


# ------------------------------------------------------------------------------------------------
# 9. --rollout-depth against the cache's K; 10. --out; 7. a partial cache


def test_alr_ira_trains_on_a_cache_with_k_7_and_depth_is_checked_against_it(caches, tmp_path):
    assert train(_config(caches["zarr"], tmp_path / "default", method="alr_ira", max_steps=1))["steps"] == 1
    saved = json.loads((tmp_path / "default" / "train_config.json").read_text())
    assert saved["rollout_depth"] == K - 1  # the resolved depth is what a resume compares
    assert train(_config(caches["zarr"], tmp_path / "k-1", method="alr_ira", rollout_depth=K - 1, max_steps=1))["steps"] == 1
    with pytest.raises(ValueError, match=rf"--rollout-depth \(rollout_depth\) must be K - 1 = {K - 1} for alr_ira on this cache"):
        train(_config(caches["zarr"], tmp_path / "k-2", method="alr_ira", rollout_depth=K - 2))
    with pytest.raises(ValueError, match=rf"must be <= K - 1 = {K - 1}"):
        train(_config(caches["zarr"], tmp_path / "deep", method="alr", rollout_depth=K))


def test_out_must_be_a_run_directory_and_not_the_cache(caches, tmp_path):
    cache = caches["zarr"]
    for out in (cache, cache / "runs" / "x"):
        with pytest.raises(ValueError, match=rf"^--out {out}: is the cache \(--cache {cache}\) or inside it"):
            train(_config(cache, out))
    users = tmp_path / "users"
    users.mkdir()
    (users / "metrics.jsonl").write_text("my numbers\n")
    with pytest.raises(ValueError, match=rf"^--out {users}: not empty and not a training run .*holds metrics.jsonl\)"):
        train(_config(cache, users))
    assert (users / "metrics.jsonl").read_text() == "my numbers\n" and sorted(os.listdir(users)) == ["metrics.jsonl"]
    assert not (cache / "runs").exists()


def test_a_partial_cache_trains_only_with_allow_partial_which_says_how_much(caches, tmp_path, capsys):
    partial = tmp_path / "partial"
    shutil.copytree(caches["zarr"], partial)
    manifest = load_manifest(partial)
    save_manifest(partial, dataclasses.replace(manifest, shards=manifest.shards[:2]))  # the build died after 2 of 3
    with pytest.raises(ValueError, match=r"the build did not finish: 2 of 3 planned shards \(8 sequences\) are complete.*--allow-partial"):
        train(_config(partial, tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()
    assert train(_config(partial, tmp_path / "allowed", allow_partial=True, max_steps=1))["steps"] == 1
    assert "--allow-partial: training on 2 of 3 planned shards (8 sequences)" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# 6. A swapped shard


def _swap_in_shard_0(cache: Path, storage_format: str) -> Path:
    """Shard 1 replaced by a copy of shard 0 (another valid shard of the same sequence count), the
    manifest's sizes and checksum made to match it: only which rows it holds tells them apart."""
    copy = cache.parent / f"{cache.name}-swapped"
    shutil.copytree(cache, copy)
    first, second = (copy / SHARD_DIR / shard_name(i, storage_format) for i in (0, 1))
    shutil.rmtree(second) if second.is_dir() else second.unlink()
    (shutil.copytree if first.is_dir() else shutil.copy)(first, second)
    manifest = load_manifest(copy)
    zero, one = manifest.shards[0], manifest.shards[1]
    swapped = dataclasses.replace(
        one, tokens=zero.tokens, anchors=zero.anchors, bytes=shard_bytes(second), checksum=shard_checksum(second)
    )
    save_manifest(copy, dataclasses.replace(manifest, shards=[zero, swapped, *manifest.shards[2:]]))
    return copy


@pytest.mark.parametrize("storage_format", ["zarr", "wds"])
def test_a_swapped_shard_is_refused_at_open_by_both_loaders_and_flagged_by_info(caches, tmp_path, storage_format):
    from ray_jobs.cli import cache_cli
    from storage.reader import open_cache
    from storage.verify import verify_cache

    good = CliRunner().invoke(cache_cli, ["info", str(caches[storage_format])])
    assert good.exit_code == 0 and "note:" not in good.output, good.output
    swapped = _swap_in_shard_0(caches[storage_format], storage_format)
    name = shard_name(1, storage_format)
    reader = open_cache(swapped)
    reader.read(0)  # shard 0 is itself
    with pytest.raises(ValueError, match=rf"{name}: holds corpus rows .* where the build put rows .* in {name}; it was replaced"):
        reader.read(4)
    result = CliRunner().invoke(cache_cli, ["info", str(swapped)])
    assert result.exit_code != 0 and f"{name}: " in result.output and "holds corpus rows" in result.output, result.output
    assert any(p.startswith(f"{name}: ") and "holds corpus rows" in p for p in verify_cache(swapped))
    with pytest.raises(ValueError, match=rf"{name}: holds corpus rows"):
        train(_config(swapped, tmp_path / "map"))
    if storage_format == "wds":
        with pytest.raises(ValueError, match=rf"{name}: sample '\d+' is corpus row \d+, not one of the rows the build put"):
            train(_config(swapped, tmp_path / "stream", loader="stream", shuffle_buffer=2))


# ------------------------------------------------------------------------------------------------
# 5. The target hash covers every byte of the weights


def test_the_target_hash_sees_one_changed_weight_in_the_middle(toy_target, tmp_path, monkeypatch):
    from pipeline.target import DIGESTS_FILE, target_hash

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    other = tmp_path / "other"
    shutil.copytree(toy_target, other, ignore=shutil.ignore_patterns(DIGESTS_FILE))
    assert target_hash(other) == target_hash(toy_target)
    assert (other / DIGESTS_FILE).is_file()  # computed once, kept beside the target
    weights = other / "model.safetensors"
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one tensor, far from the header and either end
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size and mtime: its ctime still moved
    changed = target_hash(other)
    assert changed != target_hash(toy_target)
    # A target directory the digests file cannot be written in: the user cache dir holds it instead.
    (other / DIGESTS_FILE).unlink()
    (other / DIGESTS_FILE).mkdir()
    assert target_hash(other) == changed and list((tmp_path / "user-cache" / "alrira" / "target-digests").glob("*.json"))
    # Digests files that are valid JSON but not an object count as absent: the weights are hashed again.
    (other / DIGESTS_FILE).rmdir()
    for not_an_object in ("[1, 2]", "3", '[["model.safetensors", {}]]'):
        (other / DIGESTS_FILE).write_text(not_an_object)
        for user_file in (tmp_path / "user-cache" / "alrira" / "target-digests").glob("*.json"):
            user_file.write_text(not_an_object)
        assert target_hash(other) == changed


# ------------------------------------------------------------------------------------------------
# 4. Image paths stay inside the image root; 8. images load as the serving engines load them


@pytest.fixture(scope="module")
def vl_tokenizer(vl_target):
    from pipeline.target import load_tokenizer

    return load_tokenizer(vl_target)


def test_image_paths_outside_the_image_root_are_refused_skipped_or_allowed(vl_target, vl_tokenizer, tmp_path):
    from pipeline.cache_build.corpus import CorpusConfig, corpus_vision_inputs, ingest_corpus
    from pipeline.chat import CorpusError
    from pipeline.vision import VisionInputConfig
    from tests.vl_fixtures import llava_row, write_png

    root = tmp_path / "data"
    write_png(root / "images" / "ok.png", width=64, height=64, seed=0)
    secret = write_png(tmp_path / "secret.png", width=64, height=64, seed=1)
    (root / "images" / "link.png").symlink_to(secret)
    rows = [llava_row(p, seed=i) for i, p in enumerate(["images/ok.png", "../secret.png", str(secret), "images/link.png"])]
    path = write_jsonl(root / "corpus.jsonl", rows)

    def ingest(*, skip_bad_rows=False, allow_images_outside_root=False):
        vision_input = VisionInputConfig(allow_images_outside_root=allow_images_outside_root)
        config = CorpusConfig(path=str(path), min_supervised_tokens=0, skip_bad_rows=skip_bad_rows, vision_input=vision_input)
        return ingest_corpus(config, vl_tokenizer, progress=False, vision=corpus_vision_inputs(vl_target, config))

    with pytest.raises(CorpusError, match=rf"^{path}:2: image {root}/../secret.png: outside the image root {root} \(it resolves to {secret}\); pass --allow-images-outside-root to read it$"):
        ingest()
    skipped = ingest(skip_bad_rows=True)
    assert skipped.source_rows.tolist() == [0] and skipped.stats["dropped"] == {"image_outside_root": 3}
    allowed = ingest(allow_images_outside_root=True)
    assert allowed.source_rows.tolist() == [0, 1, 2, 3]


def _pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB") if image.mode != "RGB" else image)


def test_images_load_with_the_pixels_hf_load_image_and_vllm_give(tmp_path):
    from PIL import Image
    from transformers.image_utils import load_image
    from vllm.multimodal.media.image import ImageMediaIO

    from pipeline.vision import read_image

    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, size=(24, 40, 3), dtype=np.uint8))
    rgba = np.concatenate([np.asarray(rgb), rng.integers(0, 256, size=(24, 40, 1), dtype=np.uint8)], axis=2)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    files = {
        "exif6.png": lambda p: rgb.save(p, exif=exif),
        "rgba.png": lambda p: Image.fromarray(rgba, "RGBA").save(p),
        "palette.png": lambda p: palette.save(p),
        "palette-transparent.png": lambda p: palette.save(p, transparency=3),
        "cmyk.jpg": lambda p: rgb.convert("CMYK").save(p, quality=95),
        "gray16.png": lambda p: Image.fromarray(rng.integers(0, 65536, size=(24, 40), dtype=np.uint16)).save(p),
    }
    vllm_io = ImageMediaIO(image_mode="RGB")
    for name, write in files.items():
        path = tmp_path / name
        write(path)
        ours, _ = read_image(path, where=name)
        assert ours.mode == "RGB"
        served = np.asarray(vllm_io.load_file(path).media)
        assert np.array_equal(np.asarray(ours), served), name  # vLLM, which serves the drafter
        hf = np.asarray(load_image(str(path)))
        if name in ("rgba.png", "palette-transparent.png"):
            # HF's load_image drops alpha where vLLM composites on white: they agree where opaque.
            alpha = np.asarray(Image.open(path).convert("RGBA"))[..., 3]
            assert np.array_equal(np.asarray(ours)[alpha == 255], hf[alpha == 255]), name
            assert (alpha < 255).any() and not np.array_equal(np.asarray(ours), hf)
        else:
            assert np.array_equal(np.asarray(ours), hf), name
    assert read_image(tmp_path / "exif6.png", where="x")[0].size == (24, 40)  # turned: 40 x 24 stored


# ------------------------------------------------------------------------------------------------
# 13. A changed image: the advice (--overwrite) works


def test_a_changed_image_is_rebuilt_by_the_overwrite_the_error_advises(vl_target, tmp_path):
    from pipeline.cache_build.config import CacheBuildConfig
    from pipeline.cache_build.corpus import load_tokenized_corpus
    from pipeline.cache_build.driver import build_cache, run_shards_here
    from storage.verify import verify_cache
    from tests.vl_fixtures import llava_row, write_png

    write_png(tmp_path / "images" / "a.png", width=64, height=64, seed=0)
    write_png(tmp_path / "images" / "b.png", width=64, height=64, seed=1)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [llava_row("images/a.png", seed=1), llava_row("images/b.png", seed=2)])
    out = tmp_path / "cache"

    def build(*, overwrite: bool, stop_after: int | None = None, log=lambda m: None):
        config = CacheBuildConfig.from_flags(
            target=str(vl_target), corpus=str(corpus), out=str(out), layers=[0, 2], anchors=4, top_k=4, max_length=512,
            shard_size=1, num_slots=K, overwrite=overwrite,
        )  # fmt: skip

        def run_some(plan, pending, progress):
            yield from run_shards_here(plan, pending if stop_after is None else pending[:stop_after], progress=progress)
            if stop_after is not None and len(pending) > stop_after:
                raise KeyboardInterrupt("killed")

        return build_cache(config, run_shards=run_some, progress=False, log=log)

    with pytest.raises(KeyboardInterrupt):
        build(overwrite=False, stop_after=1)  # killed after one shard
    changed = write_png(tmp_path / "images" / "b.png", width=64, height=64, seed=99)  # same size, other pixels
    with pytest.raises(ValueError, match=r"image .*b.png changed since the corpus was tokenized .*rerun the build with --overwrite"):
        build(overwrite=False)
    logged = []
    manifest = build(overwrite=True, log=logged.append)
    assert any("--overwrite: 1 image(s) changed since the corpus was tokenized (images/b.png" in m for m in logged), logged
    assert manifest.is_complete and verify_cache(out) == []
    recorded = {e["path"]: e["sha256"] for e in load_tokenized_corpus(out / "corpus").images}
    assert recorded["images/b.png"] == "sha256:" + hashlib.sha256(changed.read_bytes()).hexdigest()
