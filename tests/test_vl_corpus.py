"""Vision-language corpora (docs/vision.md, "Corpus rows"): LLaVA / OpenAI rows with one image on a
tiny real Qwen3-VL, rendered image-first with the system prompt, image tokens expanded as the HF
processor expands them and never supervised; every bad-image class a one-line error or a counted skip."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.cache_build.corpus import (
    IMAGES_FILE,
    CorpusConfig,
    corpus_vision_inputs,
    ingest_corpus,
    load_tokenized_corpus,
    save_tokenized_corpus,
)
from pipeline.chat import CorpusError, normalize_messages, normalize_row, prompt_row
from pipeline.config import from_flags
from pipeline.target import load_tokenizer
from pipeline.vision import DEFAULT_VL_SYSTEM_PROMPT
from tests.conftest import write_jsonl
from tests.vl_fixtures import IMAGE_SIZES, llava_row, mixed_vl_rows, write_images, write_png

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer(vl_target):
    return load_tokenizer(vl_target)


@pytest.fixture(scope="module")
def corpus(vl_corpus, tokenizer, vl_vision):
    return ingest_corpus(CorpusConfig(path=str(vl_corpus)), tokenizer, progress=False, vision=vl_vision)


def processor_image_tokens(vision, name: str) -> int:
    """Image tokens of an image as the HF image processor counts them (grid / merge^2)."""
    image = Image.open(Path(vision.image_root) / "images" / name).convert("RGB")
    _, grid = vision.pixel_inputs(image)
    return int(grid.prod()) // vision.merge_size**2


def test_rows_normalize_to_one_image_in_its_user_turn():
    row = llava_row("images/a.png", seed=1)
    chat = normalize_row(row, where="x:1")
    assert chat.image == "images/a.png" and chat.image_turn == 0
    assert "<image>" not in chat.messages[0]["content"] and chat.messages[0]["content"] == row["conversations"][0]["value"][8:]
    openai = mixed_vl_rows()[2]
    chat = normalize_row(openai, where="x:3")
    assert chat.image == "images/b.png" and chat.image_turn == 0 and isinstance(chat.messages[0]["content"], str)
    with pytest.raises(CorpusError, match=r"^x:1: row has an image \('images/a.png'\) but the target is text-only$"):
        normalize_messages(row, where="x:1")
    prompt = prompt_row({"prompt": "<image>\nwhat is it ?", "image": "p.png"}, where="p:1")
    assert prompt.messages == [{"role": "user", "content": "what is it ?"}] and prompt.image == "p.png"


def test_image_rows_render_image_first_with_the_system_prompt_and_processor_token_count(corpus, tokenizer, vl_vision):
    ids, mask = corpus.sequence(0)  # row 1: LLaVA, image a.png
    image_token = vl_vision.image_token_id
    num_image = processor_image_tokens(vl_vision, "a.png")
    assert int((ids == image_token).sum()) == num_image == corpus.images[0]["num_tokens"]
    row = mixed_vl_rows()[0]
    question, answer = row["conversations"][0]["value"][len("<image>\n"):], row["conversations"][1]["value"]
    # The same ids as the Qwen-VL processors build them: the rendered text with <|image_pad|>
    # repeated grid / merge^2 times, then tokenized.
    messages = [{"role": "system", "content": DEFAULT_VL_SYSTEM_PROMPT},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
                {"role": "assistant", "content": answer}]  # fmt: skip
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered.startswith(
        f"<|im_start|>system\n{DEFAULT_VL_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{question}"
    )
    rendered = rendered.replace("<|image_pad|>", "<|image_pad|>" * num_image)
    assert ids.tolist() == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    # Supervised: exactly the answer and its end-of-turn; never an image token.
    assert tokenizer.decode(ids[mask == 1]) == tokenizer.decode(tokenizer(answer + "<|im_end|>")["input_ids"])
    assert not np.any(mask[ids == image_token])


def test_a_mixed_corpus_keeps_image_and_text_rows(corpus, vl_vision, vl_corpus, tmp_path):
    assert corpus.source_rows.tolist() == [0, 1, 2, 3, 4, 5] and corpus.stats["dropped"] == {}
    expected = ["a.png", None, "b.png", "c.png", None, "b.png"]
    assert [None if e is None else Path(e["path"]).name for e in corpus.images] == expected
    assert corpus.stats["images"] == 4
    assert corpus.stats["image_tokens"] == sum(processor_image_tokens(vl_vision, n) for n in expected if n is not None)
    for i, name in enumerate(expected):
        ids, _ = corpus.sequence(i)
        assert int((ids == vl_vision.image_token_id).sum()) == (0 if name is None else corpus.images[i]["num_tokens"])
    # Text rows in a VL corpus get the VL system prompt too, and no vision tokens.
    ids, _ = corpus.sequence(1)
    assert not np.isin(ids, [vl_vision.vision_start_token_id, vl_vision.vision_end_token_id]).any()
    # c.png is wider than tall: its grid says so; a.png and b.png share the sizes the processor gives.
    grids = {Path(e["path"]).name: e["grid_thw"] for e in corpus.images if e}
    assert grids["c.png"][2] > grids["c.png"][1] and len(set(IMAGE_SIZES)) == 3
    # Saved and loaded with the images; a worker's sequence carries its checked image.
    save_tokenized_corpus(corpus, tmp_path / "corpus")
    assert json.loads((tmp_path / "corpus" / IMAGES_FILE).read_text())["sequences"] == corpus.images
    loaded = load_tokenized_corpus(tmp_path / "corpus")
    sequence = loaded.target_sequence(2, vision=vl_vision)
    assert sequence.image.path == vl_corpus.parent / "images" / "b.png" and sequence.image.where == f"{vl_corpus}:3"
    pixel_values, grid = sequence.image.pixel_inputs()
    assert grid[0].tolist() == corpus.images[2]["grid_thw"] and pixel_values.shape[0] == int(grid.prod())
    assert loaded.target_sequence(1, vision=vl_vision).image is None
    # A worker whose image processor differs (torchvision on it, not where the corpus was tokenized) stops.
    with pytest.raises(ValueError, match=r"^the corpus was tokenized with image processor \S+, this worker loads Other;"):
        loaded.target_sequence(2, vision=dataclasses.replace(vl_vision, processor_class="Other"))


def test_image_root_and_system_prompt_flags(vl_target, tokenizer, tmp_path):
    images = write_images(tmp_path / "elsewhere")
    (tmp_path / "rows").mkdir()
    corpus_path = write_jsonl(tmp_path / "rows" / "c.jsonl", [llava_row("a.png", seed=1)])
    config = from_flags(CorpusConfig, corpus=str(corpus_path), image_root=str(images), system_prompt="")
    vision = corpus_vision_inputs(vl_target, config)
    corpus = ingest_corpus(config, tokenizer, progress=False, vision=vision)
    assert corpus.images[0]["path"] == "a.png" and vision.image_root == images
    first = tokenizer.convert_ids_to_tokens(corpus.sequence(0)[0][:3].tolist())
    assert first == ["<|im_start|>", "user", "<|vision_start|>"]  # '' = no system prompt
    with pytest.raises(CorpusError, match="image .*elsewhere2/a.png: not found"):
        missing = from_flags(CorpusConfig, corpus=str(corpus_path), image_root=str(tmp_path / "elsewhere2"))
        ingest_corpus(missing, tokenizer, progress=False, vision=corpus_vision_inputs(vl_target, missing))


def _bad_rows(folder: Path) -> dict[str, tuple[object, str | None]]:
    """reason -> (row, the image path its error names, or None)."""
    write_images(folder / "images")
    (folder / "images" / "noise.png").write_bytes(b"not an image at all" * 10)
    good = (folder / "images" / "a.png").read_bytes()
    (folder / "images" / "cut.png").write_bytes(good[: len(good) // 2])
    (folder / "images" / "folder.png").mkdir()
    two_parts = {"messages": [
        {"role": "user", "content": [{"type": "image", "image": "images/a.png"}, {"type": "image", "image": "images/b.png"},
                                     {"type": "text", "text": "the two ?"}]},
        {"role": "assistant", "content": "both ."}]}  # fmt: skip
    video_part = {"messages": [
        {"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "what ?"}]},
        {"role": "assistant", "content": "a film ."}]}  # fmt: skip
    two_placeholders = llava_row("images/a.png", seed=5)
    two_placeholders["conversations"][0]["value"] += "\n<image>"
    return {
        "image_missing": (llava_row("images/gone.png", seed=5), "images/gone.png"),
        "image_unreadable": (llava_row("images/folder.png", seed=5), "images/folder.png"),
        "image_corrupt": (llava_row("images/noise.png", seed=5), "images/noise.png"),
        "image_corrupt/truncated": (llava_row("images/cut.png", seed=5), "images/cut.png"),
        "multiple_images": (two_parts, None),
        "multiple_images/list": ({**llava_row(None, seed=5), "images": ["images/a.png", "images/b.png"]}, None),
        "multiple_images/placeholders": (two_placeholders, None),
        "video": ({**llava_row(None, seed=5), "video": "clip.mp4"}, None),
        "video/part": (video_part, None),
        "image_truncated": (llava_row("images/a.png", seed=5), "images/a.png"),
    }


@pytest.mark.parametrize(
    "case", ["image_missing", "image_unreadable", "image_corrupt", "image_corrupt/truncated", "multiple_images",
             "multiple_images/list", "multiple_images/placeholders", "video", "video/part", "image_truncated"],
)  # fmt: skip
def test_a_bad_image_row_is_a_one_line_error_or_a_counted_skip(case, vl_target, tokenizer, tmp_path):
    row, image = _bad_rows(tmp_path)[case]
    reason = case.split("/")[0]
    # --max-length 30 keeps the text rows but cuts into every image span (it starts at token ~12),
    # so there the good rows are text-only.
    max_length = 30 if reason == "image_truncated" else 1024
    first = llava_row(None if reason == "image_truncated" else "images/b.png", seed=1)
    path = write_jsonl(tmp_path / "corpus.jsonl", [first, row, llava_row(None, seed=2)])
    config = CorpusConfig(path=str(path), max_length=max_length, min_supervised_tokens=0)
    vision = corpus_vision_inputs(vl_target, config)
    with pytest.raises(CorpusError) as error:
        ingest_corpus(config, tokenizer, progress=False, vision=vision)
    message = str(error.value)
    assert message.startswith(f"{path}:2: ") and "\n" not in message and error.value.reason == reason
    if image is not None:
        assert str(tmp_path / image) in message or image in message
    skipping = CorpusConfig(path=str(path), max_length=max_length, min_supervised_tokens=0, skip_bad_rows=True)
    corpus = ingest_corpus(skipping, tokenizer, progress=False, vision=vision)
    assert corpus.source_rows.tolist() == [0, 2] and corpus.stats["dropped"] == {reason: 1}


def test_an_image_row_for_a_text_target_is_refused(toy_target, tmp_path):
    write_png(tmp_path / "a.png", width=32, height=32, seed=0)
    path = write_jsonl(tmp_path / "corpus.jsonl", [llava_row("a.png", seed=1)])
    config = CorpusConfig(path=str(path))
    assert corpus_vision_inputs(toy_target, config) is None
    with pytest.raises(CorpusError, match=rf"^{path}:1: row has an image \(a.png\) but the target is text-only$"):
        ingest_corpus(config, load_tokenizer(toy_target), progress=False)


def test_a_changed_image_is_refused_by_the_worker_naming_it(vl_target, tokenizer, tmp_path):
    write_images(tmp_path / "images")
    path = write_jsonl(tmp_path / "corpus.jsonl", [llava_row("images/a.png", seed=1)])
    config = CorpusConfig(path=str(path))
    vision = corpus_vision_inputs(vl_target, config)
    corpus = ingest_corpus(config, tokenizer, progress=False, vision=vision)
    write_png(tmp_path / "images" / "a.png", width=80, height=60, seed=99)  # same size, other pixels
    image = corpus.target_sequence(0, vision=vision).image
    with pytest.raises(ValueError, match=rf"^{path}:1: image {tmp_path}/images/a.png changed since the corpus was tokenized"):
        image.pixel_inputs()


def test_a_json_array_corpus_reads_as_its_jsonl_twin_and_names_lines(vl_corpus, tokenizer, vl_vision, corpus, tmp_path):
    """ALLaVA / LLaVA releases ship one JSON array; rows are located by the line they start on."""
    path = vl_corpus.parent / "corpus-array.json"
    rows = mixed_vl_rows()
    path.write_text(json.dumps(rows, indent=2))
    array_corpus = ingest_corpus(CorpusConfig(path=str(path)), tokenizer, progress=False, vision=vl_vision)
    assert np.array_equal(array_corpus.input_ids, corpus.input_ids) and array_corpus.images == corpus.images
    bad = [rows[0], llava_row("images/gone.png", seed=9)]
    bad_path = vl_corpus.parent / "bad-array.json"
    bad_path.write_text(json.dumps(bad, indent=2))
    second_row_line = json.dumps(bad, indent=2).splitlines().index("  {", 2) + 1  # the second "  {" line
    with pytest.raises(CorpusError, match=rf"^{bad_path}:{second_row_line}: image .*gone.png: not found$"):
        ingest_corpus(CorpusConfig(path=str(bad_path)), tokenizer, progress=False, vision=vl_vision)
