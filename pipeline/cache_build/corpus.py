"""Corpus ingestion: chat rows (pipeline/chat.py) -> token ids and loss masks, rendered with the
target's chat template, saved once per cache as the tokenized corpus. Each conversation is rendered
once with the tokenizer's chat template (thinking disabled), tokenized with offsets, and the tokens
that fall inside an assistant turn's content or its end-of-turn token get loss mask 1. The turn
spans come from rendering prefixes of the conversation, so no template is special-cased beyond the
empty `<think></think>` block Qwen3 puts in front of a non-thinking answer.

For a vision-language target (docs/vision.md) a row's one image goes first in its user turn; the
rendered `<|image_pad|>` becomes the image's token count (from its size and the pixel limits),
loss mask 0, and the image's path, sha256 and grid are kept beside the tokens (`images.json`) so
the stage-1 worker can re-read it: pixel values are never cached.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from pipeline.cache_build.rollouts import TargetSequence
from pipeline.chat import LOSS_TOKENS_KEY, CorpusError, iter_corpus_rows, normalize_row, row_locator
from pipeline.config import group, opt
from pipeline.corpus_source import default_image_root, local_corpus
from pipeline.vision import (
    SequenceImage,
    VisionInputConfig,
    VisionInputs,
    changed_images,
    effective_system_prompt,
    expand_image_tokens,
    image_record,
    is_vision_target,
    resolve_image_path,
    template_messages,
)
from storage.atomic import atomic_write_dir
from storage.errors import first_line
from storage.location import Location, resolve
from storage.ownership import foreign_files


# Qwen3 renders a non-thinking answer as "<think>\n\n</think>\n\n" + content: template, not response.
EMPTY_THINK_BLOCK = re.compile(r"<think>\s*</think>\s*")
TRAILING_EMPTY_THINK_BLOCK = re.compile(r"(<think>\s*</think>)?\s*$")

ARRAY_DTYPES = {"source_rows": "int64", "offsets": "int64", "input_ids": "int32", "loss_mask": "uint8"}
STATS_FILE = "stats.json"
IMAGES_FILE = "images.json"  # vision-language targets only: each sequence's image (or null)
CORPUS_FILES = (*(f"{name}.npy" for name in ARRAY_DTYPES), STATS_FILE, IMAGES_FILE)  # all a saved corpus may hold


@dataclass(kw_only=True)
class CorpusConfig:
    """Which corpus, and which of its conversations become training sequences."""

    path: str = opt(
        "Corpus: JSONL or a JSON array (ShareGPT, OpenAI or LLaVA rows), parquet, arrow, or a save_to_disk directory.",
        flag="corpus",
    )
    max_length: int = opt("Truncate rendered conversations to this many tokens.", default=1024)
    min_supervised_tokens: int = opt("Drop sequences with fewer supervised tokens (2 * block size).", default=32)
    skip_bad_rows: bool = opt("Skip (and count) malformed corpus rows instead of stopping.", default=False)
    vision_input: VisionInputConfig = group(VisionInputConfig)

    def __post_init__(self):
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ValueError(f"path must be a non-empty path, got {self.path!r}")
        self.path = os.fspath(self.path)
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        if self.min_supervised_tokens < 0:
            raise ValueError(f"min_supervised_tokens must be >= 0, got {self.min_supervised_tokens}")
        if self.min_supervised_tokens > self.max_length:
            raise ValueError(
                f"min_supervised_tokens ({self.min_supervised_tokens}) must not exceed "
                f"max_length ({self.max_length}): every sequence would be dropped"
            )


@dataclass(kw_only=True)
class TokenizedCorpus:
    """Kept sequences, concatenated: sequence i is input_ids[offsets[i]:offsets[i + 1]]."""

    source_rows: np.ndarray  # [n] int64, 0-based row of the corpus file each sequence came from
    offsets: np.ndarray  # [n + 1] int64
    input_ids: np.ndarray  # [total] int32
    loss_mask: np.ndarray  # [total] uint8, 1 on assistant content and its end-of-turn token
    stats: dict
    # Vision-language targets: per sequence None or {"path" (as the row writes it), "sha256",
    # "grid_thw", "num_tokens"}; None for a text target's corpus (which stores no images.json).
    images: list[dict | None] | None = None
    corpus_path: str | None = None  # the corpus file, for errors naming a sequence's row
    image_processor_class: str | None = None  # what counted the image tokens (VisionInputs.processor_class)

    def __post_init__(self):
        n = len(self.source_rows)
        if len(self.offsets) != n + 1 or self.offsets[0] != 0 or self.offsets[-1] != len(self.input_ids):
            raise ValueError(
                f"offsets must have {n + 1} entries from 0 to {len(self.input_ids)}, "
                f"got {len(self.offsets)} ending at {self.offsets[-1] if len(self.offsets) else None}"
            )
        if len(self.loss_mask) != len(self.input_ids):
            raise ValueError(f"loss_mask has {len(self.loss_mask)} tokens, input_ids {len(self.input_ids)}")
        if n and np.any(np.diff(self.offsets) < 0):
            raise ValueError("offsets must be non-decreasing")
        if self.images is not None and len(self.images) != n:
            raise ValueError(f"images has {len(self.images)} entries for {n} sequences")

    def __len__(self) -> int:
        return len(self.source_rows)

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, loss_mask) of sequence i: views into the flat arrays."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {len(self)} sequences")
        i = i % len(self)
        start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[start:stop], self.loss_mask[start:stop]

    def target_sequence(self, i: int, *, vision: VisionInputs | None = None) -> TargetSequence:
        """Sequence i as the stage-1 target pass takes it; its image (if any) is re-read from
        `vision.image_root` when the batch runs and checked against the recorded hash and grid."""
        input_ids, loss_mask = self.sequence(i)
        i = i % len(self)
        entry = None if self.images is None else self.images[i]
        image = None
        if entry is not None:
            if vision is None:
                raise ValueError(f"sequence {i} has an image but the target has no image processor (is it a vision-language target?)")
            if vision.processor_class != self.image_processor_class:
                # e.g. torchvision on the workers but not where the corpus was tokenized: other pixels.
                raise ValueError(
                    f"the corpus was tokenized with image processor {self.image_processor_class}, this worker loads "
                    f"{vision.processor_class}; use the same transformers/torchvision on every machine"
                )
            where = row_locator(self.corpus_path or "corpus")(int(self.source_rows[i]))
            image = SequenceImage(
                path=resolve_image_path(entry["path"], image_root=vision.image_root),
                sha256=entry["sha256"], grid_thw=tuple(entry["grid_thw"]), where=where, vision=vision,
            )  # fmt: skip
        return TargetSequence(
            source_row=int(self.source_rows[i]), input_ids=np.asarray(input_ids), loss_mask=np.asarray(loss_mask), image=image
        )



def _render(tokenizer, messages: list[dict[str, str]], *, add_generation_prompt: bool, where: str) -> str:
    import jinja2

    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, enable_thinking=False
        )
    except jinja2.TemplateError as error:
        reason = f"the chat template refused the conversation: {first_line(error)}"
        raise CorpusError(f"{where}: {reason}", "template_error") from error
    assert isinstance(text, str), type(text)
    return text


def _not_prefix_stable(where: str, turn: int) -> CorpusError:
    return CorpusError(
        f"{where}: chat template is not prefix-stable at assistant turn (message {turn}): rendering "
        "the conversation up to that turn does not give a prefix of the full rendering",
        "template_not_prefix_stable",
    )


def _assistant_span(tokenizer, messages: list[dict[str, str]], i: int, full: str, *, where: str) -> tuple[int, int]:
    """Character span in `full` of assistant message i's content and its end-of-turn token.

    Rendering messages[:i] gives the text before the turn; adding the generation prompt gives the
    turn header; rendering messages[:i + 1] gives the turn as the template writes it when it is the
    last message. Qwen3 writes an earlier turn with a shorter header (no empty think block) than
    the generation prompt, so when the turn as last message is not a prefix of `full`, the turn's
    text is looked up right after a (possibly shortened) header instead.
    """
    if i == 0:
        reason = "conversation starts with an assistant turn (nothing to prompt it)"
        raise CorpusError(f"{where}: {reason}", "assistant_first")
    before = _render(tokenizer, messages[:i], add_generation_prompt=False, where=where)
    prompt = _render(tokenizer, messages[:i], add_generation_prompt=True, where=where)
    upto = _render(tokenizer, messages[: i + 1], add_generation_prompt=False, where=where)
    if not (full.startswith(before) and prompt.startswith(before) and upto.startswith(prompt)):
        raise _not_prefix_stable(where, i)
    header = prompt[len(before) :]
    # Content + end-of-turn token; the newline the template writes after it is not response, nor
    # is an empty think block the template writes into the turn rather than the generation prompt.
    turn = upto[len(prompt) :].rstrip()
    think = EMPTY_THINK_BLOCK.match(turn)
    skip = think.end() if think is not None else 0
    if full.startswith(upto):
        start = len(prompt) + skip
    else:
        start = full.find(turn[skip:], len(before))
        gap = TRAILING_EMPTY_THINK_BLOCK.sub("", full[len(before) : max(start, len(before))])
        if start < 0 or not header.startswith(gap):
            raise _not_prefix_stable(where, i)
    stop = start + len(turn) - skip
    return start, stop


def _turn_masks(tokenizer, messages: list[dict], *, where: str) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    """(input_ids [S] int32, [(message index, loss mask [S] bool)] of each assistant turn) of one
    untruncated conversation; a turn's mask covers its content and its end-of-turn token."""
    full = _render(tokenizer, messages, add_generation_prompt=False, where=where)
    spans = [
        (i, _assistant_span(tokenizer, messages, i, full, where=where))
        for i, message in enumerate(messages)
        if message["role"] == "assistant"
    ]
    encoding = tokenizer(full, return_offsets_mapping=True, add_special_tokens=False)
    input_ids = np.asarray(encoding["input_ids"], dtype=np.int32)  # [S]
    token_spans = np.asarray(encoding["offset_mapping"], dtype=np.int64).reshape(-1, 2)  # [S, 2] char offsets
    token_start, token_stop = token_spans[:, 0], token_spans[:, 1]
    # Only tokens wholly inside the span: a token straddling the header boundary is template.
    masks = [(i, (token_start >= start) & (token_stop <= stop) & (token_stop > token_start)) for i, (start, stop) in spans]
    return input_ids, masks


def assistant_turn_lengths(tokenizer, messages: list[dict], *, where: str = "conversation") -> list[int]:
    """Supervised tokens (content + end-of-turn) of each assistant turn, in order, as the build's
    loss mask counts them before any loss window: what `alrira-cache regenerate` matches lengths to."""
    return [int(mask.sum()) for _, mask in _turn_masks(tokenizer, messages, where=where)[1]]


def _tokenize_conversation(tokenizer, messages: list[dict], *, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Untruncated (input_ids [S] int32, loss_mask [S] uint8) of one normalized conversation. An
    assistant message with a loss window (`loss_tokens` N, docs/design.md "Regeneration") keeps
    loss on the first N tokens of its turn only: its end-of-turn token is supervised only when the
    whole turn fits in the window."""
    input_ids, masks = _turn_masks(tokenizer, messages, where=where)
    loss_mask = np.zeros(len(input_ids), dtype=np.uint8)  # [S]
    for i, mask in masks:
        window = messages[i].get(LOSS_TOKENS_KEY)
        if window is not None:
            mask = mask.copy()
            mask[np.flatnonzero(mask)[window:]] = False
        loss_mask |= mask
    return input_ids, loss_mask


def render_sequence(
    tokenizer, messages: list[dict[str, str]], *, max_length: int, where: str = "conversation"
) -> tuple[list[int], list[int]]:
    """Render normalized `messages` with the tokenizer's chat template (thinking disabled) and
    return (input_ids, loss_mask) truncated to `max_length`; the mask is 1 on assistant content and
    its end-of-turn token. Raises CorpusError ("{where}: reason") when the template cannot be used."""
    input_ids, loss_mask = _tokenize_conversation(tokenizer, messages, where=where)
    return input_ids[:max_length].tolist(), loss_mask[:max_length].tolist()


# ---------------------------------------------------------------------------------------------
# Vision-language rows (docs/vision.md)


def corpus_vision_inputs(target_dir: str | os.PathLike, config: CorpusConfig) -> VisionInputs | None:
    """The VisionInputs the corpus of `config` is tokenized and computed with; None for a text target.
    Relative image paths resolve against --image-root, else default_image_root (looked for only for
    a vision-language target: a text target never copies a store corpus for it)."""
    if not is_vision_target(target_dir):
        return None
    return config.vision_input.load(target_dir, default_image_root=default_image_root(config.path))


def check_image_fits(input_ids: np.ndarray, *, image: dict | None, vision: VisionInputs, max_length: int, where: str) -> None:
    """A truncation to max_length must keep the whole image span (vision start .. vision end)."""
    if image is None or len(input_ids) <= max_length:
        return
    pads = np.flatnonzero(input_ids == vision.image_token_id)
    start, stop = int(pads[0]), int(pads[-1]) + 1
    start -= int(start > 0 and input_ids[start - 1] == vision.vision_start_token_id)
    stop += int(stop < len(input_ids) and input_ids[stop] == vision.vision_end_token_id)
    if stop > max_length:
        raise CorpusError(
            f"{where}: --max-length {max_length} would cut into the span of image {image['path']} "
            f"(tokens {start}..{stop - 1}); raise --max-length or lower --max-pixels",
            "image_truncated",
        )


def tokenize_row(
    tokenizer, row: object, *, where: str, config: CorpusConfig, vision: VisionInputs | None, system_prompt: str | None
) -> tuple[np.ndarray, np.ndarray, dict | None]:
    """Untruncated (input_ids [S] int32, loss_mask [S] uint8, image record or None) of one row;
    CorpusError for a bad row."""
    chat = normalize_row(row, where=where)
    if chat.image is not None and vision is None:
        raise CorpusError(f"{where}: row has an image ({chat.image}) but the target is text-only", "image_for_text_target")
    input_ids, loss_mask = _tokenize_conversation(tokenizer, template_messages(chat, system_prompt=system_prompt), where=where)
    if vision is None:
        return input_ids, loss_mask, None
    image = image_record(chat, vision=vision, where=where) if chat.image is not None else None
    input_ids, loss_mask = expand_image_tokens(input_ids, loss_mask, image=image, vision=vision, where=where)
    check_image_fits(input_ids, image=image, vision=vision, max_length=config.max_length, where=where)
    return input_ids, loss_mask, image


# ---------------------------------------------------------------------------------------------
# The whole corpus


def ingest_corpus(config: CorpusConfig, tokenizer, *, progress: bool = True, vision: VisionInputs | None = None) -> TokenizedCorpus:
    """tokenize_corpus of `config.path` (a store corpus: this node's copy, pipeline/corpus_source.py),
    with the system prompt --system-prompt and `vision` give (pipeline.vision.effective_system_prompt)."""
    system_prompt = effective_system_prompt(config.vision_input.system_prompt, vision=vision)
    return tokenize_corpus(local_corpus(config.path), config, tokenizer, system_prompt=system_prompt, vision=vision, progress=progress)


def tokenize_corpus(
    path: Path, config: CorpusConfig, tokenizer, *, system_prompt: str | None, vision: VisionInputs | None, progress: bool
) -> TokenizedCorpus:
    """Read, render and filter every row of the corpus at the local `path` (`config.path`, or its
    local copy; with `vision`, images included). A bad row raises CorpusError, or with
    `skip_bad_rows` is counted in stats["dropped"] under its reason; so are short sequences."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target tokenizer has no chat template; the corpus cannot be rendered")
    rows = iter_corpus_rows(path)
    locate = row_locator(path)
    source_rows: list[int] = []
    lengths: list[int] = []
    id_chunks: list[np.ndarray] = []
    mask_chunks: list[np.ndarray] = []
    images: list[dict | None] = []
    dropped: Counter[str] = Counter()
    num_rows = num_truncated = 0
    bar = tqdm(rows, desc=f"tokenizing {Path(config.path).name}", unit=" rows", disable=not progress)
    for row_index, row in bar:
        num_rows += 1
        try:
            if isinstance(row, CorpusError):
                raise row
            where = locate(row_index)
            input_ids, loss_mask, image = tokenize_row(
                tokenizer, row, where=where, config=config, vision=vision, system_prompt=system_prompt
            )
        except CorpusError as error:
            if not config.skip_bad_rows:
                raise
            dropped[error.reason] += 1
            continue
        truncated = len(input_ids) > config.max_length
        input_ids, loss_mask = input_ids[: config.max_length], loss_mask[: config.max_length]
        if int(loss_mask.sum()) < config.min_supervised_tokens:
            dropped["too_few_supervised_tokens"] += 1
            continue
        num_truncated += truncated
        source_rows.append(row_index)
        lengths.append(len(input_ids))
        id_chunks.append(input_ids)
        mask_chunks.append(loss_mask)
        images.append(image)

    input_ids = np.concatenate(id_chunks) if id_chunks else np.zeros(0, dtype=np.int32)
    loss_mask = np.concatenate(mask_chunks) if mask_chunks else np.zeros(0, dtype=np.uint8)
    stats = {
        "rows": num_rows,
        "sequences": len(source_rows),
        "tokens": int(len(input_ids)),
        "supervised_tokens": int(loss_mask.sum(dtype=np.int64)),
        "truncated": num_truncated,
        "dropped": dict(sorted(dropped.items())),
    }
    if vision is not None:
        stats["images"] = sum(image is not None for image in images)
        stats["image_tokens"] = sum(image["num_tokens"] for image in images if image is not None)
    return TokenizedCorpus(
        source_rows=np.asarray(source_rows, dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64),
        input_ids=input_ids,
        loss_mask=loss_mask,
        stats=stats,
        images=images if vision is not None else None,
        corpus_path=str(config.path),
        image_processor_class=None if vision is None else vision.processor_class,
    )


def check_corpus_lacks_mask_token(corpus, *, mask_token_id: int, tokenizer, corpus_path: str) -> None:
    """Refuse, naming the first row, a tokenized corpus that holds the mask token: the drafter
    could not tell that token in its context from a slot to predict (docs/design.md, "The target")."""
    hits = np.flatnonzero(np.asarray(corpus.input_ids) == mask_token_id)
    if len(hits) == 0:
        return
    sequence = int(np.searchsorted(np.asarray(corpus.offsets), hits[0], side="right")) - 1
    where = row_locator(corpus_path)(int(corpus.source_rows[sequence]))
    token = tokenizer.convert_ids_to_tokens(mask_token_id)
    raise ValueError(
        f"{where}: contains the mask token {token!r} (id {mask_token_id}); pick a token the corpus never contains "
        "with --mask-token"
    )


def save_tokenized_corpus(corpus: TokenizedCorpus, out_dir: str | os.PathLike) -> None:
    """Write `corpus` to `out_dir` as {source_rows,offsets,input_ids,loss_mask}.npy + stats.json
    (+ images.json for a vision-language target), atomically (storage.atomic.atomic_write_dir): a reader sees the old directory or the new one.
    An existing `out_dir` is replaced only if it holds nothing but these files: a directory with
    anything else in it is not a tokenized corpus this code wrote, and is refused, not deleted."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir}: exists and is not a tokenized corpus directory")
    foreign = foreign_files(resolve(out_dir), CORPUS_FILES)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ValueError(f"{out_dir}: holds files a cache build did not write ({shown}); move them or use another --out")

    def write(tmp_dir: Path) -> None:
        for name, dtype in ARRAY_DTYPES.items():
            with open(tmp_dir / f"{name}.npy", "wb") as f:
                np.save(f, np.ascontiguousarray(getattr(corpus, name), dtype=dtype))
        (tmp_dir / STATS_FILE).write_text(json.dumps(corpus.stats, indent=2, sort_keys=True))
        if corpus.images is not None:
            images = {
                "corpus_path": corpus.corpus_path,
                "image_processor_class": corpus.image_processor_class,
                "sequences": corpus.images,
            }
            (tmp_dir / IMAGES_FILE).write_text(json.dumps(images, separators=(",", ":")) + "\n")

    atomic_write_dir(out_dir, write)


def load_tokenized_corpus(out_dir: str | os.PathLike, *, mmap: bool = True) -> TokenizedCorpus:
    """Read a corpus written by save_tokenized_corpus; with `mmap` the arrays are read-only maps."""
    out_dir = Path(out_dir)
    missing = [f"{n}.npy" for n in ARRAY_DTYPES if not (out_dir / f"{n}.npy").is_file()]
    missing += [] if (out_dir / STATS_FILE).is_file() else [STATS_FILE]
    if missing:
        raise ValueError(f"{out_dir}: not a tokenized corpus (missing {', '.join(missing)})")
    arrays = {}
    for name, dtype in ARRAY_DTYPES.items():
        array = np.load(out_dir / f"{name}.npy", mmap_mode="r" if mmap else None, allow_pickle=False)
        if array.dtype != np.dtype(dtype) or array.ndim != 1:
            raise ValueError(f"{out_dir}/{name}.npy: expected 1-D {dtype}, got {array.ndim}-D {array.dtype}")
        arrays[name] = array
    stats = json.loads((out_dir / STATS_FILE).read_text())
    images = json.loads((out_dir / IMAGES_FILE).read_text()) if (out_dir / IMAGES_FILE).is_file() else {}
    return TokenizedCorpus(
        **arrays, stats=stats, images=images.get("sequences"), corpus_path=images.get("corpus_path"),
        image_processor_class=images.get("image_processor_class"),
    )  # fmt: skip


def changed_corpus_images(corpus_dir: Location, *, vision: VisionInputs | None) -> list[str]:
    """The images of the tokenized corpus saved in `corpus_dir` whose file changed since it was
    tokenized (pipeline.vision.changed_images); [] for a text target or a corpus without images."""
    if vision is None or not corpus_dir.is_file(IMAGES_FILE):
        return []
    corpus = load_tokenized_corpus(corpus_dir.local_copy(), mmap=True)
    return changed_images(corpus.images or [], vision=vision)
