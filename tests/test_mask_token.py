"""`--mask-token`: which token the drafter's blocks are filled with (docs/design.md, "The target").

The default stays the first unused embedding row; a tokenizer that fills its embedding needs an
existing token, named or given by id; a corpus holding the chosen token is refused naming its row,
and a changed mask token is a named setting difference on resume.
"""

from __future__ import annotations

import pytest
from tokenizers import AddedToken

from pipeline.cache_build.config import CacheBuildConfig
from pipeline.cache_build.driver import build_cache, run_shards_here
from pipeline.demo.toy import make_toy_tokenizer
from pipeline.target import resolve_mask_token_id, unused_special_tokens
from storage.manifest import load_manifest
from tests.conftest import write_jsonl

RESERVED = "<|reserved_special_token_0|>"
SMALL = dict(layers=[0, 2], anchors=4, top_k=4, max_length=96, shard_size=4, batch_tokens=512)


def _resolve(tokenizer, mask_token, *, vocab_size=None, stop_ids=()):
    vocab_size = len(tokenizer) if vocab_size is None else vocab_size
    return resolve_mask_token_id(tokenizer, vocab_size=vocab_size, mask_token=mask_token, stop_ids=list(stop_ids), target="T")


def test_mask_token_resolution():
    tokenizer = make_toy_tokenizer()
    n = len(tokenizer)
    assert _resolve(tokenizer, None, vocab_size=n + 16) == n  # the first unused row, as for Qwen3
    assert _resolve(tokenizer, "(", vocab_size=n + 16) == tokenizer.convert_tokens_to_ids("(")  # an existing token wins
    assert _resolve(tokenizer, "7") == 7  # digits are an id
    # A full embedding and no unused special token: the flag is named, with its form.
    with pytest.raises(ValueError, match=r"^--mask-token: the tokenizer of T fills the whole embedding \(\d+ rows\).*--mask-token TOKEN\|ID$"):
        _resolve(tokenizer, None)
    with pytest.raises(ValueError, match=r"^--mask-token 'nope': not a token of the tokenizer of T"):
        _resolve(tokenizer, "nope")
    with pytest.raises(ValueError, match=rf"^--mask-token {n}: out of range for the target's {n}-row embedding$"):
        _resolve(tokenizer, str(n))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(ValueError, match=rf"^--mask-token <\|im_end\|>: id {eos} is a stop token of T"):
        _resolve(tokenizer, "<|im_end|>", stop_ids=[eos])

    # An unused special token (Llama 3's reserved ones) is suggested; template and role tokens are not.
    tokenizer.add_tokens([AddedToken("<extra_code>", special=True), AddedToken(RESERVED, special=True)])
    assert unused_special_tokens(tokenizer) == [RESERVED, "<extra_code>"]
    with pytest.raises(ValueError, match=rf"fills the whole embedding .* e\.g\. --mask-token '{RESERVED}'$"):
        _resolve(tokenizer, None)
    assert _resolve(tokenizer, RESERVED) == len(tokenizer) - 1


def _config(target, corpus, out, **overrides) -> CacheBuildConfig:
    return CacheBuildConfig.from_flags(target=str(target), corpus=str(corpus), out=str(out), **{**SMALL, **overrides})


def _build(config: CacheBuildConfig):
    return build_cache(config, run_shards=run_shards_here, progress=False, log=lambda m: None)


def test_mask_token_is_recorded_checked_against_the_corpus_and_a_setting(toy_target, toy_corpus, tmp_path):
    corpus = write_jsonl(tmp_path / "chat.jsonl", toy_corpus.read_text().splitlines()[:4])
    tokenizer = make_toy_tokenizer()
    paren = tokenizer.convert_tokens_to_ids("(")  # the toy rows write only '.' and ','

    out = tmp_path / "cache"
    manifest = _build(_config(toy_target, corpus, out, mask_token="("))
    assert manifest.mask_token_id == load_manifest(out).mask_token_id == paren

    # The same token by id is the same setting (nothing rebuilt); another one is a named difference.
    again = _build(_config(toy_target, corpus, out, mask_token=str(paren)))
    assert [s.checksum for s in again.shards] == [s.checksum for s in manifest.shards]
    with pytest.raises(ValueError, match=rf"different settings \(mask_token_id \(--mask-token\): {paren} -> {len(tokenizer)}\)"):
        _build(_config(toy_target, corpus, out))

    # The toy template writes an empty think block into every row's last assistant turn (kept whole
    # at this --max-length), so the first row holds it.
    refused = tmp_path / "refused"
    with pytest.raises(ValueError, match=rf"^{corpus}:1: contains the mask token '<think>' \(id \d+\); .*--mask-token$"):
        _build(_config(toy_target, corpus, refused, mask_token="<think>", max_length=1024))
    assert not refused.exists()  # the failed build removed what it wrote
