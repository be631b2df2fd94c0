"""The demo world: a tiny trained target and an off-policy corpus, built on the CPU from a seed.

Two sparse first-order Markov chains over the same word vocabulary stand for two writers:
  source A  the language the target is trained on. Every word has a few successors; the most
            likely one (probability 0.55-0.8) follows a random cyclic order of all words, so a
            greedy continuation visits every word once before it repeats instead of falling
            into a short loop, and sampling at T = 1 still has about a nat of entropy per word.
  source B  "another model": half of its transition mass is source A's, half a second random
            chain's. It writes the training corpus, so the corpus next token is the target's
            greedy token only part of the time (printed by `build_world` as `corpus_agreement`).
A conversation is a user message of random words ending in "?" and an answer that continues the
chain from the last user word. The target (Qwen3 architecture, word-level tokenizer with the toy
Qwen3-style chat template) is trained with a plain AdamW loop on freshly sampled source-A
conversations, loss on assistant tokens only. Held-out prompts come in three groups: short
questions (`chat`), long questions (`long`) and a second question after a source-A answer
(`followup`).

Everything is deterministic in `WorldConfig.seed` (numpy Generator for text, seeded torch for the
target; torch's CPU kernels give the same weights for the same thread count).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.cache_build.corpus import render_sequence
from pipeline.demo.toy import DEFAULT_WORDS, make_toy_target

WORLD_FILE = "world.json"
TARGET_DIR = "target"
CORPUS_FILE = "corpus.jsonl"
PROMPTS_FILE = "prompts.jsonl"
PROMPT_GROUPS = ("chat", "long", "followup")


@dataclass(kw_only=True)
class WorldConfig:
    """Sizes of the demo world. The defaults fit the whole demo in ~10 minutes on 2 CPU cores."""

    seed: int = 0
    num_words: int = 64  # chain vocabulary: the first num_words of pipeline.demo.toy.DEFAULT_WORDS
    num_successors: int = 4  # successors per word in each chain (the mode plus 3 others)
    top_prob_range: tuple[float, float] = (0.55, 0.8)  # probability of each word's mode
    corpus_mix: float = 0.5  # share of source A in source B's transitions
    num_corpus_rows: int = 800
    prompts_per_group: int = 8
    response_words: tuple[int, int] = (40, 80)  # words per answer (the corpus and target training)
    two_turn_frac: float = 0.25  # conversations with two exchanges
    # The target: 6 layers so that a 2-layer drafter taps distinct layers [1, 3].
    hidden_size: int = 64
    num_hidden_layers: int = 6
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    intermediate_size: int = 192
    target_steps: int = 120
    target_batch_size: int = 32
    target_lr: float = 3e-3
    # One thread: on a shared 2-core machine a second torch thread makes small matmuls much slower.
    target_threads: int = 1

    def __post_init__(self):
        if not 2 <= self.num_words <= len(DEFAULT_WORDS):
            raise ValueError(f"num_words must be in [2, {len(DEFAULT_WORDS)}], got {self.num_words}")
        if not 2 <= self.num_successors < self.num_words:
            raise ValueError(f"num_successors must be in [2, num_words), got {self.num_successors}")
        low, high = self.top_prob_range
        if not 1 / self.num_successors < low <= high < 1:
            raise ValueError(f"top_prob_range must satisfy 1/num_successors < low <= high < 1, got {self.top_prob_range}")
        if not 0 <= self.corpus_mix <= 1:
            raise ValueError(f"corpus_mix must be in [0, 1], got {self.corpus_mix}")
        if not 1 <= self.response_words[0] <= self.response_words[1]:
            raise ValueError(f"response_words must be (lo, hi) with 1 <= lo <= hi, got {self.response_words}")
        if not 0 <= self.two_turn_frac <= 1:
            raise ValueError(f"two_turn_frac must be in [0, 1], got {self.two_turn_frac}")
        for name in ("num_corpus_rows", "prompts_per_group", "target_batch_size", "target_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.target_steps < 0 or self.target_lr <= 0:
            raise ValueError("target_steps must be >= 0 and target_lr > 0")
        self.top_prob_range = (float(low), float(high))
        self.response_words = tuple(self.response_words)

    @property
    def words(self) -> list[str]:
        return list(DEFAULT_WORDS[: self.num_words])


# ----------------------------------------------------------------------------------------------
# The two sources


@dataclass(kw_only=True)
class MarkovChain:
    """A sparse first-order chain over word ids 0..V-1 (ids of `WorldConfig.words`)."""

    successors: np.ndarray  # [V, S] int64 word ids, column 0 the mode
    probs: np.ndarray  # [V, S] float64, rows sum to 1

    @property
    def num_words(self) -> int:
        return self.successors.shape[0]

    def dense(self) -> np.ndarray:
        table = np.zeros((self.num_words, self.num_words))  # [V, V]
        np.add.at(table, (np.arange(self.num_words)[:, None], self.successors), self.probs)
        return table

    def mode(self) -> np.ndarray:
        return self.dense().argmax(-1)  # [V]

    def sample(self, *, start: int, num_words: int, rng: np.random.Generator) -> list[int]:
        """`num_words` words continuing from word `start` (which is not included)."""
        out, word = [], start
        for _ in range(num_words):
            word = int(self.successors[word, rng.choice(self.probs.shape[1], p=self.probs[word])])
            out.append(word)
        return out

    def log_likelihood(self, words: list[int], *, start: int) -> float:
        """Mean log-probability per word of `words` continuing from `start` (-inf if impossible)."""
        table, total, prev = self.dense(), 0.0, start
        for word in words:
            p = table[prev, word]
            total += math.log(p) if p > 0 else -math.inf
            prev = word
        return total / max(len(words), 1)


def random_chain(
    num_words: int, *, num_successors: int, top_prob_range: tuple[float, float], rng: np.random.Generator
) -> MarkovChain:
    """Each word's mode is its successor in a random cyclic order of all words (so greedy text runs
    through the whole vocabulary before repeating); the other successors are random distinct words
    sharing the remaining mass in decreasing random proportions."""
    order = rng.permutation(num_words)
    mode = np.empty(num_words, dtype=np.int64)
    mode[order] = np.roll(order, -1)
    successors = np.empty((num_words, num_successors), dtype=np.int64)
    probs = np.empty((num_words, num_successors))
    for w in range(num_words):
        others = rng.choice(np.setdiff1d(np.arange(num_words), [mode[w]]), size=num_successors - 1, replace=False)
        successors[w] = np.concatenate([[mode[w]], others])
        top = rng.uniform(*top_prob_range)
        rest = np.sort(rng.dirichlet(np.ones(num_successors - 1)))[::-1] * (1 - top)
        probs[w] = np.concatenate([[top], rest])
    return MarkovChain(successors=successors, probs=probs)


def mix_chains(first: MarkovChain, second: MarkovChain, *, weight: float) -> MarkovChain:
    """weight * first + (1 - weight) * second, on the union of their successors."""
    table = weight * first.dense() + (1 - weight) * second.dense()  # [V, V]
    width = int((table > 0).sum(-1).max())
    successors = np.argsort(-table, axis=-1, kind="stable")[:, :width]  # [V, S'] most likely first
    probs = np.take_along_axis(table, successors, axis=-1)
    return MarkovChain(successors=successors.astype(np.int64), probs=probs / probs.sum(-1, keepdims=True))


def make_sources(config: WorldConfig) -> tuple[MarkovChain, MarkovChain]:
    """(source A, source B) of the world."""
    rng = np.random.default_rng([config.seed, 0])
    kwargs = dict(num_successors=config.num_successors, top_prob_range=config.top_prob_range, rng=rng)
    source_a = random_chain(config.num_words, **kwargs)
    other = random_chain(config.num_words, **kwargs)
    return source_a, mix_chains(source_a, other, weight=config.corpus_mix)


# ----------------------------------------------------------------------------------------------
# Conversations


def _question(words: list[str], rng: np.random.Generator, *, num_words: tuple[int, int]) -> tuple[str, int]:
    """A user message of random words ending in '?', and the id of its last word."""
    ids = rng.integers(0, len(words), size=int(rng.integers(num_words[0], num_words[1] + 1)))
    return " ".join(words[i] for i in ids) + " ?", int(ids[-1])


def _answer(chain: MarkovChain, words: list[str], rng: np.random.Generator, *, start: int, num_words: int) -> str:
    return " ".join(words[i] for i in chain.sample(start=start, num_words=num_words, rng=rng)) + " ."


def make_conversation(
    chain: MarkovChain,
    words: list[str],
    rng: np.random.Generator,
    *,
    num_turns: int,
    response_words: tuple[int, int],
    question_words: tuple[int, int] = (3, 8),
) -> list[dict[str, str]]:
    """user/assistant exchanges; every answer continues `chain` from its question's last word."""
    messages = []
    for _ in range(num_turns):
        question, last = _question(words, rng, num_words=question_words)
        length = int(rng.integers(response_words[0], response_words[1] + 1))
        answer = _answer(chain, words, rng, start=last, num_words=length)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


def corpus_rows(config: WorldConfig, source_b: MarkovChain) -> list[dict]:
    """The fixed training corpus (ShareGPT rows), every answer written by source B."""
    rng = np.random.default_rng([config.seed, 1])
    names = {"user": "human", "assistant": "gpt"}
    rows = []
    for _ in range(config.num_corpus_rows):
        num_turns = 2 if rng.random() < config.two_turn_frac else 1
        messages = make_conversation(source_b, config.words, rng, num_turns=num_turns, response_words=config.response_words)
        rows.append({"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in messages]})
    return rows


def prompt_rows(config: WorldConfig, source_a: MarkovChain) -> list[dict]:
    """Held-out prompts (OpenAI rows ending in a user turn) with a `benchmark` key per group."""
    rng = np.random.default_rng([config.seed, 2])
    words, rows = config.words, []
    for group in PROMPT_GROUPS:
        for _ in range(config.prompts_per_group):
            if group == "chat":
                messages = [{"role": "user", "content": _question(words, rng, num_words=(3, 8))[0]}]
            elif group == "long":
                messages = [{"role": "user", "content": _question(words, rng, num_words=(20, 40))[0]}]
            else:
                messages = make_conversation(source_a, words, rng, num_turns=1, response_words=(20, 40))
                messages.append({"role": "user", "content": _question(words, rng, num_words=(3, 8))[0]})
            rows.append({"benchmark": group, "messages": messages})
    return rows


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))


# ----------------------------------------------------------------------------------------------
# The target


@dataclass(kw_only=True)
class TokenBatch:
    input_ids: torch.Tensor  # [B, S] right-padded
    loss_mask: torch.Tensor  # [B, S] 1 where the token is an assistant token to predict
    attention_mask: torch.Tensor  # [B, S]


def tokenize_conversations(tokenizer, conversations: list[list[dict[str, str]]]) -> TokenBatch:
    """Render with the chat template (pipeline.cache_build.corpus, the same loss masks stage 1 uses) and pad."""
    sequences = [render_sequence(tokenizer, messages, max_length=4096) for messages in conversations]
    length = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), length), tokenizer.pad_token_id, dtype=torch.long)  # [B, S]
    loss_mask = torch.zeros((len(sequences), length), dtype=torch.bool)  # [B, S]
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)  # [B, S]
    for i, (ids, mask) in enumerate(sequences):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        loss_mask[i, : len(ids)] = torch.tensor(mask, dtype=torch.bool)
        attention_mask[i, : len(ids)] = 1
    return TokenBatch(input_ids=input_ids, loss_mask=loss_mask, attention_mask=attention_mask)


def next_token_logits(model, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [M, V], targets [M], previous tokens [M]) at every position whose NEXT token is
    supervised: the loss of one batch is cross_entropy(logits, targets)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits  # [B, S, V]
    predicts = batch.loss_mask[:, 1:]  # [B, S-1] position t predicts token t+1
    return logits[:, :-1][predicts].float(), batch.input_ids[:, 1:][predicts], batch.input_ids[:, :-1][predicts]


def target_loss(model, batch: TokenBatch) -> torch.Tensor:
    logits, targets, _ = next_token_logits(model, batch)
    return F.cross_entropy(logits, targets)


def lr_at(step: int, *, total_steps: int, peak_lr: float) -> float:
    """Linear warm-up over 5% of the steps, then cosine to 10% of the peak."""
    warmup = max(1, math.ceil(0.05 * total_steps))
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_target(model, tokenizer, source: MarkovChain, config: WorldConfig, *, steps: int, log=None) -> list[float]:
    """Next-token training on freshly sampled `source` conversations (assistant tokens only).
    Returns the per-step losses."""
    rng = np.random.default_rng([config.seed, 3])
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.target_lr, weight_decay=0.01, betas=(0.9, 0.98))
    model.train()
    losses, started = [], time.time()
    for step in range(steps):
        conversations = []
        for _ in range(config.target_batch_size):
            num_turns = 2 if rng.random() < config.two_turn_frac else 1
            conversations.append(make_conversation(source, config.words, rng, num_turns=num_turns, response_words=config.response_words))
        loss = target_loss(model, tokenize_conversations(tokenizer, conversations))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total_steps=steps, peak_lr=config.target_lr)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if log is not None and (step + 1) % max(1, steps // 5) == 0:
            log(f"  target step {step + 1}/{steps}: loss {loss.item():.3f} ({time.time() - started:.0f}s)")
    model.eval()
    return losses


@torch.no_grad()
def score_target(
    model, tokenizer, conversations: list[list[dict[str, str]]], *, source: MarkovChain, word_ids: dict[int, int]
) -> dict:
    """Teacher-forced scores on assistant tokens of `conversations`:
    accuracy        target argmax == the text's next token
    mode_agreement  target argmax == `source`'s most likely successor (answer words after a word)
    loss            mean next-token cross-entropy."""
    correct = mode_hits = mode_total = total = 0
    loss_sum = 0.0
    mode = source.mode()
    for i in range(0, len(conversations), 32):
        logits, targets, previous = next_token_logits(model, tokenize_conversations(tokenizer, conversations[i : i + 32]))
        predicted = logits.argmax(-1)
        correct += int((predicted == targets).sum())
        total += len(targets)
        loss_sum += float(F.cross_entropy(logits, targets, reduction="sum"))
        for prev, guess in zip(previous.tolist(), predicted.tolist(), strict=True):
            if prev in word_ids:  # the answer's chain state is a word (not '?' or the template)
                mode_hits += int(word_ids.get(guess, -1) == mode[word_ids[prev]])
                mode_total += 1
    return {"accuracy": correct / total, "mode_agreement": mode_hits / max(mode_total, 1), "loss": loss_sum / total}


# ----------------------------------------------------------------------------------------------
# The world on disk


@dataclass(kw_only=True)
class World:
    root: Path
    target: Path
    corpus: Path
    prompts: Path
    stats: dict = field(default_factory=dict)


def load_world(root: str | Path) -> World:
    root = Path(root)
    return World(
        root=root, target=root / TARGET_DIR, corpus=root / CORPUS_FILE, prompts=root / PROMPTS_FILE,
        stats=json.loads((root / WORLD_FILE).read_text()),
    )  # fmt: skip


def build_world(root: str | Path, config: WorldConfig, *, log=print) -> World:
    """Create (or reuse, if `root` holds a world of the same config) the target, corpus and prompts."""
    root = Path(root)
    if (root / WORLD_FILE).is_file():
        world = load_world(root)
        if world.stats.get("config") == json.loads(json.dumps(asdict(config))):
            log(f"world: reusing {root}")
            return world
        raise ValueError(f"{root}: holds a world with a different config; use another directory")
    started = time.time()
    root.mkdir(parents=True, exist_ok=True)
    source_a, source_b = make_sources(config)
    words = config.words
    write_jsonl(root / CORPUS_FILE, corpus_rows(config, source_b))
    write_jsonl(root / PROMPTS_FILE, prompt_rows(config, source_a))

    target_dir = root / TARGET_DIR
    make_toy_target(
        target_dir, words=words, hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, intermediate_size=config.intermediate_size, seed=config.seed,
    )  # fmt: skip
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    word_ids = {tokenizer.convert_tokens_to_ids(w): i for i, w in enumerate(words)}
    threads = torch.get_num_threads()
    torch.set_num_threads(config.target_threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
            log(f"world: training the target on source A ({config.target_steps} steps of {config.target_batch_size} conversations)")
            losses = train_target(model, tokenizer, source_a, config, steps=config.target_steps, log=log)
        model.save_pretrained(target_dir, safe_serialization=True)

        rng = np.random.default_rng([config.seed, 4])
        held_out_a = [make_conversation(source_a, words, rng, num_turns=1, response_words=config.response_words) for _ in range(64)]
        corpus = [[{"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]} for t in row["conversations"]]
                  for row in corpus_rows(config, source_b)]  # fmt: skip
        on_a = score_target(model, tokenizer, held_out_a, source=source_a, word_ids=word_ids)
        on_corpus = score_target(model, tokenizer, corpus, source=source_a, word_ids=word_ids)
    finally:
        torch.set_num_threads(threads)
    stats = {
        "config": json.loads(json.dumps(asdict(config))),
        "target_final_loss": float(np.mean(losses[-10:])) if losses else None,
        # The best any model can do on source-A text: the mean probability of the mode.
        "source_a_bayes_accuracy": float(source_a.probs[:, 0].mean()),
        "target_accuracy_on_a": on_a["accuracy"],
        "target_mode_agreement_on_a": on_a["mode_agreement"],
        "target_loss_on_a": on_a["loss"],
        "source_a_entropy_nats": float(-(source_a.probs * np.log(source_a.probs)).sum(-1).mean()),
        # How off-policy the corpus is: target greedy token == corpus next token.
        "corpus_agreement": on_corpus["accuracy"],
        "corpus_loss_under_target": on_corpus["loss"],
        "modes_shared_by_a_and_b": float((source_b.mode() == source_a.mode()).mean()),
        "source_b_prob_of_a_mode": float(source_b.dense()[np.arange(config.num_words), source_a.mode()].mean()),
        "build_s": time.time() - started,
    }
    (root / WORLD_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    log(
        f"world: target accuracy on held-out source A {on_a['accuracy']:.3f} (best possible ~{stats['source_a_bayes_accuracy']:.3f}), "
        f"argmax = source-A mode {on_a['mode_agreement']:.3f}; corpus agreement (target greedy == corpus token) "
        f"{on_corpus['accuracy']:.3f}; built in {stats['build_s']:.0f}s"
    )
    return load_world(root)
