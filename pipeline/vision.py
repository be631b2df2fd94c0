"""Vision-language targets (Qwen3-VL; docs/vision.md): whether a target is one, its image
processor, image files -> checked model inputs, and the 3-D M-RoPE positions of a sequence.

Shared by the corpus (which needs each image's token count and hash), the stage-1 target pass
(which re-reads and re-processes the image: pixel values are never cached) and evaluation.
Errors about an image are one line naming where the row is and the image path.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.chat import ChatRow, CorpusError
from pipeline.config import opt

DEFAULT_MIN_PIXELS = 50176  # 224 x 224, the paper's vision recipe
DEFAULT_MAX_PIXELS = 200704  # 448 x 448
DEFAULT_VL_SYSTEM_PROMPT = "You are a helpful assistant."  # the reference's system prompt for VL corpora
MODALITY = "image-text"
# Recorded in the manifest: what the cached features at image positions are (docs/vision.md, "Stage 1": deepstack).
DEEPSTACK_NOTE = (
    "features are HF hidden_states[id + 1]; at image positions of the first {n} decoder layer(s) they "
    "exclude the deepstack visual addition (the next layer's input includes it); serving engines may tap after it"
)
# Drafter positions are the sequence index in training and in alrira-eval; vLLM differs (docs/vision.md, "Serving").
DRAFTER_POSITIONS_NOTE = (
    "drafter context/block positions are the sequence index; vLLM's DFlash proposer feeds the M-RoPE time row on image prompts"
)
_PROCESSOR_SETTINGS = (
    "patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "rescale_factor",
    "do_rescale", "do_normalize", "do_convert_rgb", "resample",
)  # fmt: skip


def is_vision_config(config: dict) -> bool:
    """A config.json dict of a vision-language target (Qwen3-VL keeps the LM under text_config)."""
    return isinstance(config.get("vision_config"), dict)


def is_vision_target(target_dir: str | os.PathLike) -> bool:
    path = Path(target_dir) / "config.json"
    return path.is_file() and is_vision_config(json.loads(path.read_text()))


@dataclass(kw_only=True)
class VisionInputConfig:
    """How rows are rendered for the target: the system prompt rows without one get, and for a
    vision-language target where relative image paths resolve and the pixel limits images are
    resized to. One group, nested by the build's corpus and by the evaluation's prompts."""

    system_prompt: str | None = opt(
        "System prompt for rows without one (default: 'You are a helpful assistant.' for vision-language "
        "targets, none for text targets; '' for none).",
        default=None,
    )
    image_root: str | None = opt(
        "Vision-language targets: folder that relative 'image' paths are resolved against (default: the corpus or "
        "prompts file's folder).",
        default=None,
    )
    min_pixels: int = opt("Vision-language targets: images are resized to at least this many pixels.", default=DEFAULT_MIN_PIXELS)
    max_pixels: int = opt("Vision-language targets: images are resized to at most this many pixels.", default=DEFAULT_MAX_PIXELS)
    allow_images_outside_root: bool = opt(
        "Vision-language targets: read image paths that lead outside the image root ('..', absolute paths, "
        "symlinks out of it); refused by default.",
        default=False,
    )

    def __post_init__(self):
        if not 1 <= self.min_pixels <= self.max_pixels:
            raise ValueError(f"--min-pixels ({self.min_pixels}) must be >= 1 and <= --max-pixels ({self.max_pixels})")

    def load(self, target_dir: str | os.PathLike, *, default_image_root: str | os.PathLike) -> VisionInputs | None:
        """The target's VisionInputs at these settings (None for a text target); relative image
        paths resolve against --image-root, else `default_image_root`."""
        image_root = self.image_root if self.image_root is not None else default_image_root
        return load_vision_inputs(
            target_dir, image_root=image_root, min_pixels=self.min_pixels, max_pixels=self.max_pixels,
            allow_outside_root=self.allow_images_outside_root,
        )  # fmt: skip


@dataclass(kw_only=True)
class VisionInputs:
    """What turns a row's image into target inputs: the image processor at fixed pixel limits,
    the vision special token ids, and the folder relative image paths are resolved against."""

    image_processor: Any  # a Qwen2-VL-style HF image processor (PIL backend on CPU machines)
    processor_class: str  # the class that loaded it: the processor, or the image processor fallback
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    num_deepstack_layers: int
    min_pixels: int
    max_pixels: int
    image_root: Path
    allow_outside_root: bool = False  # --allow-images-outside-root

    @property
    def merge_size(self) -> int:
        return int(self.image_processor.merge_size)

    def grid_thw(self, *, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) patch grid of an image of this size after the processor's resize."""
        factor = int(self.image_processor.patch_size) * self.merge_size
        resized_h, resized_w = smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        return 1, resized_h // int(self.image_processor.patch_size), resized_w // int(self.image_processor.patch_size)

    def image_path(self, path: str, *, where: str) -> Path:
        """A row's image path resolved against the image root, checked to stay inside it."""
        full = resolve_image_path(path, image_root=self.image_root)
        self.check_inside_root(full, where=where)
        return full

    def check_inside_root(self, path: Path, *, where: str) -> None:
        """Refuse (CorpusError image_outside_root) a path that leads out of the image root: '..',
        an absolute path elsewhere or a symlink out of it, unless --allow-images-outside-root. A
        corpus is often someone else's file; it must not read what the user did not point at."""
        if self.allow_outside_root:
            return
        root, real = self.image_root.resolve(), path.resolve()
        if real != root and root not in real.parents:
            raise CorpusError(
                f"{where}: image {path}: outside the image root {root} (it resolves to {real}); "
                "pass --allow-images-outside-root to read it",
                "image_outside_root",
            )

    def num_image_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        return math.prod(grid_thw) // self.merge_size**2

    def pixel_inputs(self, image) -> tuple[torch.Tensor, torch.Tensor]:
        """PIL image -> (pixel_values [P, D] float32, image_grid_thw [1, 3] long)."""
        size = {"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}
        out = self.image_processor(images=[image], size=size, return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    def settings(self) -> dict:
        """What the manifest records of the vision side (all of it changes cache content)."""
        processor = {}
        for name in _PROCESSOR_SETTINGS:
            value = getattr(self.image_processor, name, None)
            if value is not None:
                processor[name] = _json_value(value)
        return {
            "modality": MODALITY,
            "processor_class": self.processor_class,
            "image_processor": processor,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "deepstack_note": DEEPSTACK_NOTE.format(n=self.num_deepstack_layers),
            "drafter_positions": DRAFTER_POSITIONS_NOTE,
        }


def _json_value(value):
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, (bool, int, float, str)):
        return value
    return int(value) if hasattr(value, "__int__") else str(value)  # e.g. a PIL resampling enum


def smart_resize(height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The Qwen2-VL / Qwen3-VL processors' resize rule: both sides multiples of `factor`, the area
    within [min_pixels, max_pixels], the aspect ratio kept as far as rounding allows."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    return hf_smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def load_image_processor(target_dir: str | os.PathLike) -> tuple[Any, str]:
    """(image processor, class name of what loaded it). AutoProcessor needs torchvision for
    Qwen3-VL's video processor, which CPU machines here lack (docs/vision.md, "Stage 1"): fall back to
    AutoImageProcessor (the PIL `Qwen2VLImageProcessorPil`); the tokenizer is loaded apart."""
    from transformers import AutoImageProcessor, AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(target_dir))
    except (ImportError, OSError, ValueError, KeyError, TypeError, AttributeError):
        processor = None
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is not None:
        return image_processor, type(processor).__name__
    try:
        image_processor = AutoImageProcessor.from_pretrained(str(target_dir))
    except (ImportError, OSError, ValueError) as error:
        raise ValueError(f"{target_dir}: vision-language target without a usable image processor ({error})") from None
    return image_processor, type(image_processor).__name__


def load_vision_inputs(
    target_dir: str | os.PathLike, *, image_root: str | os.PathLike, min_pixels: int, max_pixels: int,
    allow_outside_root: bool = False,
) -> VisionInputs | None:  # fmt: skip
    """VisionInputs of a vision-language target; None for a text target."""
    path = Path(target_dir) / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    if not is_vision_config(config):
        return None
    image_processor, processor_class = load_image_processor(target_dir)
    ids = {}
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        if not isinstance(config.get(name), int):
            raise ValueError(f"{path}: vision-language config without {name}")
        ids[name] = config[name]
    return VisionInputs(
        image_processor=image_processor,
        processor_class=processor_class,
        num_deepstack_layers=len(config["vision_config"].get("deepstack_visual_indexes") or ()),
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        image_root=Path(image_root),
        allow_outside_root=allow_outside_root,
        **ids,
    )


# ---------------------------------------------------------------------------------------------
# Rows with an image: rendering and image tokens (the corpus and evaluation prompts)


def effective_system_prompt(system_prompt: str | None, *, vision: VisionInputs | None) -> str | None:
    """--system-prompt, else the reference's default for a vision-language target (docs/vision.md, "Corpus rows"); '' = none."""
    if system_prompt is None:
        return DEFAULT_VL_SYSTEM_PROMPT if vision is not None else None
    return system_prompt or None


def resolve_image_path(path: str, *, image_root: Path) -> Path:
    return Path(path) if Path(path).is_absolute() else image_root / path


def template_messages(chat: ChatRow, *, system_prompt: str | None) -> list[dict]:
    """Messages for the chat template: the system prompt first when the row has none, and the
    image first in its user turn's content (`[image, text]`, as the reference renders them)."""
    messages = [dict(m) for m in chat.messages]
    turn = chat.image_turn
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
        turn = None if turn is None else turn + 1
    if turn is not None:
        messages[turn] = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": messages[turn]["content"]}]}
    return messages


def image_record(chat: ChatRow, *, vision: VisionInputs, where: str) -> dict:
    """The row's image as the tokenized corpus records it: decoded once here, so a missing,
    unreadable or corrupt file is this row's one-line error (or a counted skip)."""
    image, digest = read_image(vision.image_path(chat.image, where=where), where=where)
    grid = vision.grid_thw(height=image.height, width=image.width)
    return {"path": chat.image, "sha256": digest, "grid_thw": list(grid), "num_tokens": vision.num_image_tokens(grid)}


def expand_image_tokens(
    input_ids: np.ndarray, loss_mask: np.ndarray, *, image: dict | None, vision: VisionInputs, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """The rendered conversation with its one `<|image_pad|>` repeated to the image's token count
    (loss mask 0), as the Qwen-VL processors expand it; refuses vision tokens the row cannot fill."""
    if np.any(input_ids == vision.video_token_id):
        raise CorpusError(f"{where}: the rendered conversation holds a video token; only images are supported", "video")
    pads = np.flatnonzero(input_ids == vision.image_token_id)
    expected = 0 if image is None else 1
    if len(pads) != expected:
        what = "a text-only row" if image is None else f"image {image['path']}"
        raise CorpusError(
            f"{where}: the rendered conversation holds {len(pads)} image placeholder token(s) for {what} (expected {expected})",
            "vision_token_mismatch",
        )
    if image is None:
        return input_ids, loss_mask
    pad = int(pads[0])
    assert loss_mask[pad] == 0, "an image placeholder inside an assistant span"
    repeat = np.ones(len(input_ids), dtype=np.int64)
    repeat[pad] = image["num_tokens"]
    return np.repeat(input_ids, repeat), np.repeat(loss_mask, repeat)


# ---------------------------------------------------------------------------------------------
# Image files


def read_image(path: Path, *, where: str):
    """(PIL RGB image as the serving engines load it (`serving_rgb`), "sha256:<hex>" of the file's
    bytes), decoded in full so a truncated or corrupt file fails here. CorpusError "{where}: image {path}: reason", counted as image_missing /
    image_unreadable / image_corrupt."""
    from PIL import Image, UnidentifiedImageError

    if not path.exists():
        raise CorpusError(f"{where}: image {path}: not found", "image_missing")
    if not path.is_file():
        raise CorpusError(f"{where}: image {path}: unreadable (not a regular file)", "image_unreadable")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise CorpusError(f"{where}: image {path}: unreadable ({error.strerror or error})", "image_unreadable") from None
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            rgb = serving_rgb(image)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CorpusError(f"{where}: image {path}: corrupt or not an image ({reason})", "image_corrupt") from None
    return rgb, "sha256:" + hashlib.sha256(data).hexdigest()


def serving_rgb(image):
    """A decoded PIL image as RGB pixels the way vLLM's image loader and HF `load_image` give them
    to the processor (docs/vision.md, "Corpus rows"): EXIF orientation applied first, then an image
    with transparency (RGBA, LA, PA, or a palette / L / RGB image with a tRNS entry) composited on
    white, any other mode (CMYK, 16-bit, L, P, YCbCr...) converted by PIL's own `convert("RGB")`.
    (HF `load_image` drops alpha instead of compositing: the two agree on opaque pixels; we follow
    vLLM, which serves the drafter.)"""
    from PIL import Image, ImageOps

    try:
        image = ImageOps.exif_transpose(image)  # a copy (the caller closes the file's image), turned as EXIF says
    except Exception:  # a broken EXIF block leaves the pixels as stored, as vLLM does
        image = image.copy()
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        flattened = Image.new("RGB", rgba.size, (255, 255, 255))
        flattened.paste(rgba, mask=rgba.getchannel("A"))
        return flattened
    return image.convert("RGB")


IMAGES_WHERE = "the tokenized corpus's images.json"


def changed_images(entries: list[dict | None], *, vision: VisionInputs) -> list[str]:
    """The recorded images (a tokenized corpus's `images`) whose file no longer has the recorded
    sha256 (or is gone): the corpus's token counts and every shard computed from them are stale."""
    digests: dict[str, str | None] = {}
    for entry in entries:
        if entry is not None and entry["path"] not in digests:
            try:
                path = vision.image_path(entry["path"], where=IMAGES_WHERE)
                digests[entry["path"]] = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
            except (OSError, CorpusError):  # gone, unreadable or now outside the root: not the recorded image
                digests[entry["path"]] = None
    return sorted({e["path"] for e in entries if e is not None and digests[e["path"]] != e["sha256"]})


@dataclass(kw_only=True)
class SequenceImage:
    """The image of one tokenized sequence, as the stage-1 worker reloads it: its file, the hash and
    grid recorded when the corpus was tokenized, and the processor to turn it into pixels."""

    path: Path
    sha256: str
    grid_thw: tuple[int, int, int]
    where: str  # the corpus row, for errors
    vision: VisionInputs

    def pixel_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values [P, D], image_grid_thw [1, 3]); refuses an image whose bytes changed
        since the corpus was tokenized (its token count and the cache would no longer match)."""
        self.vision.check_inside_root(self.path, where=self.where)  # a symlink may have changed since
        image, digest = read_image(self.path, where=self.where)
        if digest != self.sha256:
            raise ValueError(
                f"{self.where}: image {self.path} changed since the corpus was tokenized "
                f"({self.sha256[:19]}... -> {digest[:19]}...); rerun the build with --overwrite (it re-tokenizes the "
                "corpus and rebuilds every shard), or restore the image"
            )
        pixel_values, grid = self.vision.pixel_inputs(image)
        if tuple(int(v) for v in grid[0]) != tuple(self.grid_thw):
            raise ValueError(
                f"{self.where}: image {self.path} processes to grid {grid[0].tolist()}, the corpus recorded "
                f"{list(self.grid_thw)} (another image processor?); rebuild the cache with --overwrite"
            )
        return pixel_values, grid


# ---------------------------------------------------------------------------------------------
# Positions


def mm_token_type_ids(input_ids: torch.Tensor, *, image_token_id: int) -> torch.Tensor:
    """1 on image tokens, 0 elsewhere (transformers 5 needs it to place the M-RoPE grid)."""
    return (input_ids == image_token_id).int()


def rope_positions(model, input_ids: torch.Tensor, *, image_grid_thw: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """3-D M-RoPE positions [3, T] of one unpadded sequence input_ids [T] and its rope delta
    (position of a text token after the image = sequence index + delta). Text tokens have
    t = h = w; an image spans a (h, w) grid and advances the position by max(h, w) // merge."""
    token_types = mm_token_type_ids(input_ids, image_token_id=model.config.image_token_id)
    positions, deltas = model.model.get_rope_index(
        input_ids[None], mm_token_type_ids=token_types[None], image_grid_thw=image_grid_thw
    )  # [3, 1, T], [1, 1]
    return positions[:, 0], int(deltas.reshape(-1)[0])


def shifted_positions(start: int, length: int, *, rope_delta: int, device) -> torch.Tensor:
    """Positions [3, 1, length] of text tokens at sequence indices start .. start + length - 1 after
    the prompt: index + rope_delta on all three axes (how generate continues after an image)."""
    return (torch.arange(start, start + length, device=device) + rope_delta).view(1, 1, -1).expand(3, 1, -1)
