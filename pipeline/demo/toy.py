"""Tiny real Hugging Face targets built in code: a word-level Qwen3-style tokenizer, a randomly
initialised Qwen3ForCausalLM saved as an ordinary model directory, and random chat rows.

Tests, the demo and the benchmarks use these instead of downloading a model: everything here is
deterministic in its seed and loads back offline with AutoModelForCausalLM/AutoTokenizer.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from pipeline.target import save_tokenizer

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


def _word_level_backend(words: list[str] | None, *, special_tokens: tuple[str, ...], added_tokens: tuple[str, ...] = ()) -> Tokenizer:
    """A word-level `tokenizers` backend over role words, punctuation, `words` (default
    DEFAULT_WORDS) and `<unk>`, then `special_tokens` and the non-special `added_tokens`."""
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
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special_tokens])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in added_tokens])
    return backend


def make_toy_tokenizer(words: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over `words` (plus role words and punctuation) with Qwen3's special
    tokens and a Qwen3-like chat template. Words outside the vocabulary map to `<unk>`."""
    # As in Qwen3, the think tags are added tokens but not special ones (decode keeps them).
    backend = _word_level_backend(
        words, special_tokens=(ENDOFTEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN), added_tokens=THINK_TOKENS
    )
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
    shape = ToyShape(  # refuses a shape vLLM cannot serve
        hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim, intermediate_size=intermediate_size,
    )  # fmt: skip
    tokenizer = make_toy_tokenizer(words)
    config = Qwen3Config(
        vocab_size=toy_vocab_size(len(tokenizer)),
        **dataclasses.asdict(shape),
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT_TOKEN),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END_TOKEN),
        dtype="float32",
    )
    return _save_toy_model(Qwen3ForCausalLM, config, tokenizer, Path(out_dir), seed=seed, peaked=peaked)


@dataclass(kw_only=True)
class ToyShape:
    """A toy decoder's sizes (make_toy_llama_target; make_toy_target takes them one by one)."""

    hidden_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    intermediate_size: int = 128

    def __post_init__(self):
        if self.head_dim < 32:
            raise ValueError(f"head_dim must be >= 32 (vLLM's CPU attention needs it), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )


def _save_toy_model(model_class, config, tokenizer, out_dir: Path, *, seed: int, peaked: bool, generation_config=None) -> Path:
    """Initialise `model_class(config)` from `seed` (fp32, lm_head scaled when `peaked`) and save it
    with its tokenizer (and `generation_config` when given) to `out_dir`."""
    # Fork the RNG so building a toy model leaves the caller's torch random state untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model = model.to(torch.float32).eval()
    if peaked:
        with torch.no_grad():
            model.lm_head.weight.mul_(PEAKED_LM_HEAD_STD / config.initializer_range)
    if generation_config is not None:
        model.generation_config = generation_config
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(tokenizer, out_dir)
    return out_dir


# Llama-architecture targets whose tokenizer fills the embedding (docs/design.md, "The target").
# "llama3": Llama 3 Instruct's special tokens (reserved ones included), its chat format (bos, role
# headers, content trimmed, <|eot_id|> per turn) and its three end ids in generation_config.json.
LLAMA3_SPECIAL_TOKENS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", *(f"<|reserved_special_token_{i}|>" for i in range(3, 8)),
)  # fmt: skip
LLAMA3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first %}{{- bos_token }}{%- endif %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# "smollm2": SmolLM2-Instruct's special tokens (ChatML plus StarCoder's code tokens) and its ChatML
# template, which adds a default system turn to rows without one.
SMOLLM2_SPECIAL_TOKENS = (
    ENDOFTEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN, "<repo_name>", "<reponame>", "<file_sep>", "<filename>",
    "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>",
    "<jupyter_code>", "<jupyter_output>", "<jupyter_script>", "<empty_output>",
)  # fmt: skip
SMOLLM2_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message.role != 'system' %}"
    "{{- '<|im_start|>system\\nyou are a good assistant<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA_CHAT_STYLES = ("llama3", "smollm2")


def make_toy_llama_tokenizer(words: list[str] | None = None, *, chat_style: str = "llama3") -> PreTrainedTokenizerFast:
    """A word-level tokenizer with the special tokens, roles and chat template of a Llama 3
    (`chat_style="llama3"`) or SmolLM2 (`"smollm2"`) instruct model; as in those, every token id is
    a row of the embedding (make_toy_llama_target), so no row is free for the mask token."""
    if chat_style not in LLAMA_CHAT_STYLES:
        raise ValueError(f"chat_style must be one of {LLAMA_CHAT_STYLES}, got {chat_style!r}")
    llama3 = chat_style == "llama3"
    backend = _word_level_backend(words, special_tokens=LLAMA3_SPECIAL_TOKENS if llama3 else SMOLLM2_SPECIAL_TOKENS)
    roles = (
        dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
        if llama3
        else dict(bos_token=IM_START_TOKEN, eos_token=IM_END_TOKEN, pad_token=IM_END_TOKEN)
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=UNK_TOKEN, model_max_length=131072, **roles)
    tokenizer.chat_template = LLAMA3_CHAT_TEMPLATE if llama3 else SMOLLM2_CHAT_TEMPLATE
    return tokenizer


def make_toy_llama_target(
    out_dir: str | Path,
    *,
    chat_style: str = "llama3",
    words: list[str] | None = None,
    shape: ToyShape | None = None,
    seed: int = 0,
    tie_word_embeddings: bool = True,
    peaked: bool = False,
) -> Path:
    """A randomly initialised fp32 LlamaForCausalLM as Llama 3.2 / SmolLM2 are built: GQA, tied
    embeddings by default, an embedding with exactly one row per token of
    `make_toy_llama_tokenizer(chat_style=...)`, and for "llama3" Llama 3's RoPE scaling and
    generation_config end ids ([<|end_of_text|>, <|eom_id|>, <|eot_id|>]). Same arguments ->
    identical files; `peaked` as in make_toy_target."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    shape = ToyShape() if shape is None else shape
    tokenizer = make_toy_llama_tokenizer(words, chat_style=chat_style)
    llama3 = chat_style == "llama3"
    ids = tokenizer.convert_tokens_to_ids
    end_ids = [ids("<|end_of_text|>"), ids("<|eom_id|>"), ids("<|eot_id|>")] if llama3 else [ids(IM_END_TOKEN)]
    rope = (
        {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
        if llama3 else {"rope_type": "default", "rope_theta": 100_000.0}
    )  # fmt: skip
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        **dataclasses.asdict(shape),
        max_position_embeddings=4096,
        rope_parameters=rope,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=ids(tokenizer.bos_token),
        eos_token_id=end_ids if llama3 else end_ids[0],
        dtype="float32",
    )
    generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=end_ids if llama3 else end_ids[0])
    return _save_toy_model(
        LlamaForCausalLM, config, tokenizer, Path(out_dir), seed=seed, peaked=peaked, generation_config=generation_config
    )


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
