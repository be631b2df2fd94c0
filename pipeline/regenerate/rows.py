"""One corpus row through regeneration: which turns to write, each turn's prompt (the original
system/user turns and the assistant turns already rewritten before it), length control, and the
row written back in its own format (docs/design.md, "Regeneration").

Lengths are the build's: a corpus turn's length is its supervised token count (content and
end-of-turn token) as `alrira-cache build` masks it (pipeline/cache_build/corpus.py
`assistant_turn_lengths`), so N below is exactly what the fixed-corpus arm trains on for that turn.
- truncate: the regenerated content is cut to N - 1 tokens; the template's end-of-turn token makes
  the turn's supervised length N again.
- window: the whole turn is kept and the message records `"loss_tokens": N`; the build gives loss
  to the first N tokens of the turn only (its end-of-turn token only when the turn fits in them).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field

import numpy as np

from pipeline.cache_build.corpus import assistant_turn_lengths
from pipeline.chat import LOSS_TOKENS_KEY, ChatRow, CorpusError, normalize_row
from pipeline.eval.evaluate import render_prompt
from pipeline.regenerate.backends import TurnOutput, TurnRequest
from pipeline.vision import VisionInputs, expand_image_tokens, image_record, resolve_image_path, template_messages


def turn_seed(seed: int, *, source_row: int, turn: int) -> int:
    """The sampling seed of one turn: a function of --seed, the corpus row and the turn only."""
    digest = hashlib.sha256(f"{seed}:{source_row}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass(kw_only=True)
class RowRegeneration:
    """A row being rewritten. `messages` are the chat-template messages (system prompt and image
    placed as the build renders them); `offset` maps a ChatRow message index to them."""

    source_row: int
    where: str
    raw: dict
    chat: ChatRow
    messages: list[dict]
    offset: int
    turns: list[int]  # ChatRow indices of the assistant messages, in order
    corpus_lengths: list[int]  # supervised tokens of each replaced turn (the build's count)
    image: dict | None = None  # the image record (vision-language targets)
    pixels: tuple | None = None  # (pixel_values, image_grid_thw), computed once per row
    written: list[TurnOutput] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.written) == len(self.turns)


def prepare_row(
    raw: object, *, source_row: int, where: str, tokenizer, vision: VisionInputs | None, system_prompt: str | None
) -> RowRegeneration:
    """A corpus row ready for its first turn; CorpusError (the build's one-line errors) for a bad row."""
    refuse_tool_calls(raw, where=where)
    chat = normalize_row(raw, where=where)
    if chat.image is not None and vision is None:
        raise CorpusError(f"{where}: row has an image ({chat.image}) but the target is text-only", "image_for_text_target")
    messages = template_messages(chat, system_prompt=system_prompt)
    offset = len(messages) - len(chat.messages)
    turns = [i for i, m in enumerate(chat.messages) if m["role"] == "assistant"]
    if turns[0] == 0:
        raise CorpusError(f"{where}: conversation starts with an assistant turn (nothing to prompt it)", "assistant_first")
    unwindowed = [{k: v for k, v in m.items() if k != LOSS_TOKENS_KEY} for m in messages]
    row = RowRegeneration(
        source_row=source_row, where=where, raw=raw, chat=chat, messages=messages, offset=offset, turns=turns,
        corpus_lengths=assistant_turn_lengths(tokenizer, unwindowed, where=where),
    )  # fmt: skip
    if chat.image is not None:
        row.image = image_record(chat, vision=vision, where=where)
    return row


TOOL_CALL_KEYS = ("tool_calls", "function_call")


def refuse_tool_calls(raw: object, *, where: str) -> None:
    """CorpusError "assistant_tool_calls" for a row with an assistant turn that carries tool calls:
    its text would be rewritten while the calls stay as the original model made them, no longer
    matching it, so such rows are not regenerated (counted as skipped under --skip-bad-rows;
    docs/failure-modes.md)."""
    if not isinstance(raw, dict):
        return
    for key in ("messages", "conversations"):
        for i, message in enumerate(raw.get(key) or []):
            if not isinstance(message, dict) or message.get("role", message.get("from")) not in ("assistant", "gpt"):
                continue
            calls = next((k for k in TOOL_CALL_KEYS if message.get(k)), None)
            if calls:
                raise CorpusError(
                    f"{where}: assistant message {i} carries {calls!r}; regeneration would rewrite its text but keep the "
                    "original calls, so the row is not regenerated (--skip-bad-rows counts and drops such rows)",
                    "assistant_tool_calls",
                )


def next_request(row: RowRegeneration, *, tokenizer, vision: VisionInputs | None, seed: int, max_new_tokens: int, max_context: int) -> TurnRequest:
    """The request for the row's next turn: its prompt renders every message before it, assistant
    turns already rewritten. CorpusError "prompt_too_long" when the prompt leaves no room."""
    turn = len(row.written)
    message = row.turns[turn] + row.offset
    prompt_ids = render_prompt(tokenizer, row.messages[:message])
    if vision is not None:
        ids = np.asarray(prompt_ids, dtype=np.int64)
        prompt_ids = expand_image_tokens(ids, np.zeros_like(ids), image=row.image, vision=vision, where=row.where)[0].tolist()
    room = max_context - len(prompt_ids)
    if room < 1:
        raise CorpusError(
            f"{row.where}: the prompt of assistant turn {turn} has {len(prompt_ids)} tokens, the target's context is {max_context}",
            "prompt_too_long",
        )
    if row.image is not None and row.pixels is None:
        row.pixels = vision.pixel_inputs(_read_rgb(row, vision))
    return TurnRequest(
        prompt_ids=prompt_ids, max_new_tokens=min(max_new_tokens, room), seed=turn_seed(seed, source_row=row.source_row, turn=turn),
        image=row.pixels,
    )  # fmt: skip


def _read_rgb(row: RowRegeneration, vision: VisionInputs):
    from pipeline.vision import read_image

    return read_image(resolve_image_path(row.chat.image, image_root=vision.image_root), where=row.where)[0]


def apply_turn(row: RowRegeneration, output: TurnOutput, *, tokenizer, length_control: str) -> None:
    """Record the row's next turn: its text (cut under truncate) goes into the prompt of later turns."""
    turn = len(row.written)
    text = tokenizer.decode(output.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if length_control == "truncate":
        text = cut_text(tokenizer, text, num_tokens=row.corpus_lengths[turn] - 1)
    message = row.messages[row.turns[turn] + row.offset]
    message["content"] = text
    message.pop(LOSS_TOKENS_KEY, None)
    if length_control == "window":
        message[LOSS_TOKENS_KEY] = row.corpus_lengths[turn]
    row.written.append(output)


def cut_text(tokenizer, text: str, *, num_tokens: int) -> str:
    """`text` cut after its first `num_tokens` tokens as the tokenizer splits the text itself (not
    the generated ids: decoding and re-tokenizing need not give them back, and the build counts
    the text's tokens)."""
    if num_tokens <= 0:
        return ""
    spans = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    return text if len(spans) <= num_tokens else text[: spans[num_tokens - 1][1]]


def output_row(row: RowRegeneration, *, vision: VisionInputs | None) -> dict:
    """The input row in its own format (ShareGPT or OpenAI) with every assistant turn rewritten, the
    window on windowed turns, and `source_row`. Image paths stay as the row gave them: the manifest
    records the image root they resolve against, which the build uses for the output folder."""
    raw = copy.deepcopy(row.raw)
    list_key, content_key = ("conversations", "value") if raw.get("conversations") is not None else ("messages", "content")
    turns = raw[list_key]
    inserted = len(row.chat.messages) - len(turns)  # 1 when the row's top-level 'system' became message 0
    for i in row.turns:
        message, turn = row.messages[i + row.offset], turns[i - inserted]
        turn[content_key] = message["content"]
        turn.pop(LOSS_TOKENS_KEY, None)
        if LOSS_TOKENS_KEY in message:
            turn[LOSS_TOKENS_KEY] = message[LOSS_TOKENS_KEY]
    raw["source_row"] = row.source_row
    return raw
