"""Tiny real Hugging Face targets built in code: a word-level Qwen3-style tokenizer, a randomly
initialised Qwen3ForCausalLM saved as an ordinary model directory, and random chat rows.

Tests, the demo and the benchmarks use these instead of downloading a model: everything here is
deterministic in its seed and loads back offline with AutoModelForCausalLM/AutoTokenizer.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

DEFAULT_WORDS = """
the of and to in is was for on that with as by at from it be this are or an his which but not
have has had they their he she we you her one all were been there when more can would who so
if will no other time some what into out up only about new first two over my many then these
year may could them after like most also made way people than years much before because under
day work world life part well should each state long great through where back still just
good own those must between place end number small while found high come see last every city
make know take give find think tell ask call show turn leave play move live hold bring begin
keep seem help talk start run write read learn change follow stop open walk sit stand lose pay
meet include continue set watch grow house school water room mother father friend family
country question problem story point hand eye home word group money book light night fact
head car game name team power line side kind body door color river
""".split()

ROLE_WORDS = ("system", "user", "assistant")
PUNCTUATION = tuple(".,!?;:'\"()-")

UNK_TOKEN = "<unk>"
ENDOFTEXT_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
THINK_TOKENS = ("<think>", "</think>")

PEAKED_LM_HEAD_STD = 0.5  # lm_head init std of a `peaked` toy target (HF default: 0.02)

# Qwen3's template reduced to what a chat corpus uses (no tools, no reasoning_content), with the
# same two behaviours that matter for loss masks: an assistant turn that is the last message and
# follows the last user message gets an empty think block (whatever enable_thinking says, as in
# Qwen3), and with enable_thinking=False the generation prompt ends in an empty think block.
TOY_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=messages|length - 1) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.last and loop.index0 > ns.last_query_index %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def make_toy_tokenizer(words: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `words` (plus role words and punctuation) with Qwen3's special
    tokens and a Qwen3-like chat template. Words outside the vocabulary map to `<unk>`."""
    words = DEFAULT_WORDS if words is None else words
    if not words:
        raise ValueError("words must not be empty")
    for word in words:
        if not isinstance(word, str) or not word or any(ch.isspace() for ch in word):
            raise ValueError(f"words must be non-empty strings without whitespace, got {word!r}")
    vocab: dict[str, int] = {}
    for token in (*ROLE_WORDS, *PUNCTUATION, *words, UNK_TOKEN):
        vocab.setdefault(token, len(vocab))

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Split on whitespace, then isolate each punctuation character, so offsets stay exact.
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(behavior="isolated")]
    )
    # The WordPiece decoder without "##" pieces and without cleanup joins tokens with spaces.
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    specials = (ENDOFTEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    # As in Qwen3, the think tags are added tokens but not special ones (decode keeps them).
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in THINK_TOKENS])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END_TOKEN,
        pad_token=ENDOFTEXT_TOKEN,
        unk_token=UNK_TOKEN,
        extra_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        model_max_length=131072,
    )
    tokenizer.chat_template = TOY_CHAT_TEMPLATE
    return tokenizer


def toy_vocab_size(num_tokens: int) -> int:
    """Embedding rows for a tokenizer of `num_tokens`: the next multiple of 16 strictly above it, so
    row `num_tokens` (the DFlash mask token) exists and no token uses it."""
    return (num_tokens // 16 + 1) * 16


def make_toy_target(
    out_dir: str | Path,
    *,
    words: list[str] | None = None,
    hidden_size: int = 64,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    head_dim: int = 32,
    intermediate_size: int = 128,
    seed: int = 0,
    tie_word_embeddings: bool = False,
    peaked: bool = False,
) -> Path:
    """Build a randomly initialised fp32 Qwen3ForCausalLM with the toy tokenizer and save both to
    `out_dir` (safetensors). Same arguments -> identical files. Returns `out_dir` as a Path.

    With HF's default init the next-token distributions are nearly uniform (top-1 ~ 1/V). `peaked`
    scales lm_head to std PEAKED_LM_HEAD_STD so they look more like a trained model's (mean top-1
    probability ~0.5, top-8 mass ~0.9), which gives greedy rollouts and gates something to measure.
    With tied embeddings this scales the input embeddings too."""
    if head_dim < 32:
        raise ValueError(f"head_dim must be >= 32 (vLLM's CPU attention needs it), got {head_dim}")
    if num_attention_heads % num_key_value_heads != 0:
        raise ValueError(
            f"num_attention_heads ({num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({num_key_value_heads})"
        )
    out_dir = Path(out_dir)
    tokenizer = make_toy_tokenizer(words)
    config = Qwen3Config(
        vocab_size=toy_vocab_size(len(tokenizer)),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT_TOKEN),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END_TOKEN),
        dtype="float32",
    )
    # Fork the RNG so building a toy model leaves the caller's torch random state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model = model.to(torch.float32).eval()
    if peaked:
        with torch.no_grad():
            model.lm_head.weight.mul_(PEAKED_LM_HEAD_STD / config.initializer_range)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def toy_chat_rows(
    num_rows: int,
    *,
    seed: int,
    words: list[str] | None = None,
    form: str = "sharegpt",
    min_turns: int = 1,
    max_turns: int = 2,
    response_words: tuple[int, int] = (40, 90),
) -> list[dict]:
    """Deterministic random chat rows: an optional system message, then `min_turns..max_turns`
    user/assistant exchanges whose responses have `response_words` words (plus punctuation), so they
    pass the 2*16 supervised-token filter at the default (40, 90)."""
    if form not in ("sharegpt", "openai"):
        raise ValueError(f"form must be 'sharegpt' or 'openai', got {form!r}")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    if not 1 <= min_turns <= max_turns:
        raise ValueError(f"need 1 <= min_turns <= max_turns, got {min_turns}, {max_turns}")
    if not 1 <= response_words[0] <= response_words[1]:
        raise ValueError(f"response_words must be (lo, hi) with 1 <= lo <= hi, got {response_words}")
    words = DEFAULT_WORDS if words is None else words
    rng = random.Random(seed)

    def text(num_words: int) -> str:
        # Sentences of 4..12 words ending in '.', sometimes with a comma, for punctuation tokens.
        parts: list[str] = []
        sentence_left = rng.randint(4, 12)
        for i in range(num_words):
            word = rng.choice(words)
            sentence_left -= 1
            if sentence_left == 0 or i == num_words - 1:
                word += "."
                sentence_left = rng.randint(4, 12)
            elif rng.random() < 0.05:
                word += ","
            parts.append(word)
        return " ".join(parts)

    rows = []
    for _ in range(num_rows):
        messages = []
        if rng.random() < 0.5:
            messages.append(("system", text(rng.randint(5, 12))))
        for _ in range(rng.randint(min_turns, max_turns)):
            messages.append(("user", text(rng.randint(5, 20))))
            messages.append(("assistant", text(rng.randint(*response_words))))
        if form == "sharegpt":
            names = {"system": "system", "user": "human", "assistant": "gpt"}
            rows.append({"conversations": [{"from": names[r], "value": c} for r, c in messages]})
        else:
            rows.append({"messages": [{"role": r, "content": c} for r, c in messages]})
    return rows
