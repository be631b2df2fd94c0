"""The target model, as stage 1 and evaluation see it: identity hash, config, loading, taps,
stop tokens, and the frozen embedding / lm_head the trainer reuses (docs/design.md, "The target").

A vision-language target (Qwen3-VL, docs/vision.md) loads with AutoModelForImageTextToText; its layer
count, hidden size, vocabulary and RoPE come from the text config, its embedding and lm_head from
the language model (docs/vision.md).

Training never imports this module: it reads everything it needs of the target from the cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.vision import is_vision_target
from storage.atomic import atomic_write_text

# Files that define what a target computes; their bytes make the target hash.
_TARGET_IDENTITY_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",  # a vision-language processor's template
    "preprocessor_config.json",  # a vision-language target's image processor
)


WEIGHT_PATTERNS = ("*.safetensors", "*.bin")  # the weights transformers loads from a model directory
DIGESTS_FILE = ".alrira-weight-digests.json"  # beside the target, or under the user cache dir (read-only targets)
HASH_CHUNK_BYTES = 8 << 20


def target_hash(target_dir: str | Path) -> str:
    """Content hash of what defines the target: its config and tokenizer files, and the sha256 of
    every weights file's whole content, so two targets that differ in one tensor anywhere differ
    (docs/design.md, "The target"). Each file's digest is computed once, streamed, and kept in a
    digests file keyed by the file's size, mtime and ctime (docs/benchmarks.md: 8 GB in seconds),
    so a build and each node hash the weights once, and a changed file is hashed again."""
    target_dir = Path(target_dir)
    digest = hashlib.sha256()
    for name in _TARGET_IDENTITY_FILES:
        path = target_dir / name
        if path.is_file():
            digest.update(name.encode())
            digest.update(path.read_bytes())
    weights = sorted({path for pattern in WEIGHT_PATTERNS for path in target_dir.glob(pattern) if path.is_file()})
    for path, file_digest in zip(weights, _weight_digests(target_dir, weights)):
        digest.update(f"{path.name}:{file_digest}".encode())
    return "sha256:" + digest.hexdigest()


def _weight_digests(target_dir: Path, weights: list[Path]) -> list[str]:
    """The full-content sha256 of each weights file, from the digests file where its size, mtime
    and ctime still match, else streamed (and recorded for next time where a digests file can be written)."""
    places = [target_dir / DIGESTS_FILE, _user_digests_file(target_dir)]
    known = {}
    for place in reversed(places):  # the one beside the target wins
        with contextlib.suppress(OSError, ValueError):
            recorded = json.loads(place.read_text())
            known.update(recorded if isinstance(recorded, dict) else {})  # valid JSON of another shape: as absent
    digests, changed = [], False
    for path in weights:
        stat = path.stat()
        key = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]
        entry = known.get(path.name)
        if not (isinstance(entry, dict) and entry.get("key") == key and isinstance(entry.get("sha256"), str)):
            entry, changed = {"key": key, "sha256": _file_sha256(path)}, True
            known[path.name] = entry
        digests.append(entry["sha256"])
    if changed:
        text = json.dumps({path.name: known[path.name] for path in weights}, indent=1, sort_keys=True)
        for place in places:  # a read-only target directory: the user cache dir instead
            try:
                place.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(place, text)
                break
            except OSError:
                continue
    return digests


def _user_digests_file(target_dir: Path) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "alrira" / "target-digests"
    return root / (hashlib.sha256(str(target_dir.resolve()).encode()).hexdigest()[:32] + ".json")


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def read_target_config(target_dir: str | Path) -> dict:
    path = Path(target_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path}: no config.json; --target must be a local HF model directory")
    config = json.loads(path.read_text())
    # Multimodal targets (Qwen3-VL) keep the language model's keys under text_config.
    return config.get("text_config", config)


# A tokenizer without a limit reports transformers' VERY_LARGE_INTEGER (1e30) as model_max_length.
_NO_TOKENIZER_LIMIT = 1 << 40


@dataclass(frozen=True)
class ContextLimit:
    """The most positions the target reads (prompt + generated tokens) and what says so."""

    positions: int | None  # None: neither the config nor the tokenizer states one
    source: str  # "max_position_embeddings", "the tokenizer's model_max_length", or ""

    def budget(self, prompt_length: int, max_new_tokens: int) -> int:
        """The tokens a prompt of `prompt_length` may generate: `max_new_tokens`, or what the
        context leaves after the prompt (< 1: the prompt fills it)."""
        return max_new_tokens if self.positions is None else min(max_new_tokens, self.positions - prompt_length)


def context_limit(target_dir: str | Path, tokenizer=None) -> ContextLimit:
    """The target's context: its (text) config's max_position_embeddings, or the tokenizer's
    model_max_length where that is smaller. Decoding past it runs on positions the target was never
    trained at (RoPE extrapolates silently), so every generation is capped by it (docs/design.md,
    "Evaluation")."""
    limits = []
    positions = read_target_config(target_dir).get("max_position_embeddings")
    if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0:
        limits.append((positions, "max_position_embeddings"))
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tokenizer_limit, int) and 0 < tokenizer_limit < _NO_TOKENIZER_LIMIT:
        limits.append((tokenizer_limit, "the tokenizer's model_max_length"))
    return ContextLimit(*min(limits)) if limits else ContextLimit(None, "")


def prompt_budgets(limit: ContextLimit, prompt_lengths: list[int], *, max_new_tokens: int, flag: str,
                   where: list[str]) -> tuple[list[int], str | None]:  # fmt: skip
    """Each prompt's generation budget under the target's context, and the line that says a budget
    was cut (None when none was). A prompt that leaves no room is refused, naming it (`where`)."""
    budgets = [limit.budget(n, max_new_tokens) for n in prompt_lengths]
    for budget, length, row in zip(budgets, prompt_lengths, where, strict=True):
        if budget < 1:
            raise ValueError(
                f"{row}: the prompt has {length} tokens, the target's context is {limit.positions} ({limit.source}); "
                f"nothing can be generated after it: shorten or remove the prompt"
            )
    cut = [b for b in budgets if b < max_new_tokens]
    if not cut:
        return budgets, None
    return budgets, (
        f"{flag} {max_new_tokens}: capped by the target's context ({limit.positions} positions, {limit.source}): "
        f"{len(cut)} of {len(budgets)} prompt(s) generate at most {max(cut)} tokens (as few as {min(cut)})"
    )


def read_generation_config(target_dir: str | Path) -> dict | None:
    path = Path(target_dir) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def load_target(target_dir: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Load a local HF causal LM, or a vision-language model (AutoModelForCausalLM rejects
    Qwen3VLConfig), for feature extraction (eval mode, SDPA attention)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    auto_class = AutoModelForImageTextToText if is_vision_target(target_dir) else AutoModelForCausalLM
    try:
        model = auto_class.from_pretrained(str(target_dir), dtype=dtype, attn_implementation="sdpa")
    except Exception:
        check_target_weights(target_dir)  # a damaged weights file: one line naming it
        raise
    if getattr(model.config.get_text_config(), "use_sliding_window", False):
        raise ValueError(f"{target_dir}: sliding-window targets are not supported")
    return model.to(device).eval()


def check_target_weights(target_dir: str | Path) -> None:
    """ValueError naming the first *.safetensors file of `target_dir` that does not open or read
    whole (truncated, overwritten): transformers reports it as a traceback from deep inside."""
    from safetensors import SafetensorError, safe_open

    for path in sorted(Path(target_dir).glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as error:
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ValueError(f"{path}: damaged weights file ({reason}); copy the target again") from None


def load_tokenizer(target_dir: str | Path):
    """The target's tokenizer; a vision-language target whose template lives only in the
    processor's chat_template.json gets that template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    processor_template = Path(target_dir) / "chat_template.json"
    if not getattr(tokenizer, "chat_template", None) and processor_template.is_file():
        tokenizer.chat_template = json.loads(processor_template.read_text()).get("chat_template")
    return tokenizer


# tokenizer_config.json as transformers 5 writes it holds two things 4.x readers (llama.cpp's
# converter pins 4.57, and so do vLLM releases of that line) refuse: a class name only 5.x has, and
# `extra_special_tokens` as a list (4.x reads that key as a dict of named tokens and fails on a list;
# its list is `additional_special_tokens`, which 5.x still reads). PORTABLE_TOKENIZER_CLASSES maps
# such a class to the one both majors load the same tokenizer.json with (in 5.x
# PreTrainedTokenizerFast is TokenizersBackend); docs/serving.md, "llama.cpp".
PORTABLE_TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}


def save_tokenizer(tokenizer, out_dir: str | Path) -> None:
    """tokenizer.save_pretrained(out_dir) with a tokenizer_config.json every transformers major
    reads the same (see PORTABLE_TOKENIZER_CLASSES). Every target or tokenizer folder the project
    writes goes through here."""
    tokenizer.save_pretrained(str(out_dir))
    config_path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    portable = dict(config)
    portable["tokenizer_class"] = PORTABLE_TOKENIZER_CLASSES.get(config.get("tokenizer_class"), config.get("tokenizer_class"))
    if isinstance(config.get("extra_special_tokens"), list):
        extra = portable.pop("extra_special_tokens")
        portable["additional_special_tokens"] = [t for t in portable.get("additional_special_tokens", []) if t not in extra] + extra
    if portable != config:
        atomic_write_text(config_path, json.dumps(portable, indent=2, ensure_ascii=False) + "\n")


def is_vision_model(model) -> bool:
    return getattr(model.config, "vision_config", None) is not None


def decoder_stack(model):
    """The decoder that text-only forwards run: Qwen3's `model.model`, Qwen3-VL's language model."""
    return getattr(model.model, "language_model", model.model)


def attention_mask_for(model, mask: torch.Tensor):
    """Our boolean 4-D mask [B, 1, Q, K] as the model takes it. A {layer_type: mask} dict skips
    transformers' own mask construction and hands it to every layer; a text config without
    layer_types (Qwen3-VL's) takes the 4-D tensor itself, which transformers passes through as is."""
    layer_types = getattr(model.config.get_text_config(), "layer_types", None)
    return {layer_type: mask for layer_type in set(layer_types)} if layer_types else mask


def stop_token_ids(tokenizer, generation_config: dict | None = None) -> list[int]:
    """eos / end-of-turn ids: a rollout slot after one of these is not trained, a decode stops."""
    ids = set()
    for token in (tokenizer.eos_token, "<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        if token is None:
            continue
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    eos = (generation_config or {}).get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(ids)


def unused_special_tokens(tokenizer, *, stop_ids: Collection[int] = ()) -> list[str]:
    """Special tokens the tokenizer defines that neither its chat template, its bos/eos/unk/pad
    roles nor a stop id use (Llama 3's `<|reserved_special_token_N|>`, SmolLM2's code tokens), names
    with "reserved" or "unused" first, then by id: candidates for the mask token of a target whose
    tokenizer fills the embedding (docs/design.md, "The target")."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    roles = {getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    candidates = [
        token.content
        for token_id, token in sorted(tokenizer.added_tokens_decoder.items())
        if token.special and token_id not in stop_ids and token.content not in roles and token.content not in template
    ]
    reserved = [t for t in candidates if "reserved" in t.lower() or "unused" in t.lower()]
    return reserved + [t for t in candidates if t not in reserved]


def resolve_mask_token_id(
    tokenizer, *, vocab_size: int, mask_token: str | None, stop_ids: Collection[int], target: str | Path
) -> int:
    """The drafter's mask token id: `--mask-token` (a token of the tokenizer, or an id when all
    digits), else the first unused embedding row, len(tokenizer) (z-lab's Qwen3 heads). A tokenizer
    that fills the embedding (Llama 3, SmolLM2) has no such row: the error names the flag and
    suggests an unused special token. A stop id is refused (every supervised turn ends in one)."""
    suggestions = unused_special_tokens(tokenizer, stop_ids=stop_ids)
    example = f"e.g. --mask-token '{suggestions[0]}'" if suggestions else "--mask-token TOKEN|ID"
    if mask_token is None:
        if len(tokenizer) < vocab_size:
            return len(tokenizer)
        raise ValueError(
            f"--mask-token: the tokenizer of {target} fills the whole embedding ({vocab_size} rows), so no unused "
            f"row can be the mask token; pick an existing token the corpus never contains, {example}"
        )
    if mask_token.isdigit():
        token_id = int(mask_token)
        if token_id >= vocab_size:
            raise ValueError(f"--mask-token {mask_token}: out of range for the target's {vocab_size}-row embedding")
    else:
        token_id = tokenizer.get_vocab().get(mask_token)
        if token_id is None:
            raise ValueError(f"--mask-token {mask_token!r}: not a token of the tokenizer of {target}; {example}")
    if token_id in stop_ids:
        raise ValueError(f"--mask-token {mask_token}: id {token_id} is a stop token of {target}; {example}")
    return token_id


def tapped_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """Residual stream after each tapped decoder layer, concatenated: [..., len(layer_ids) * H].

    HF's hidden_states[0] is the embedding output and hidden_states[id + 1] the output of decoder
    layer id (before the final norm as long as id < L - 1; hidden_states[-1] is after it).
    """
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def read_target_head(target_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, H], lm_head [V, H]) read straight from the target's safetensors files,
    without building the model; a tied target gives its embedding twice."""
    from safetensors import safe_open

    embed = lm_head = None
    for path in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if key.endswith("embed_tokens.weight") and "visual" not in key and embed is None:
                    embed = f.get_tensor(key)
                elif key.endswith("lm_head.weight") and lm_head is None:
                    lm_head = f.get_tensor(key)
    if embed is None:
        raise ValueError(f"{target_dir}: no embed_tokens.weight in its *.safetensors files")
    return embed, (lm_head if lm_head is not None else embed)
