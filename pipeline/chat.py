"""Chat rows, for the corpus and for evaluation prompts: reading row files and normalising a row
to `[{"role": system|user|assistant, "content": str}, ...]`.

Rows come from JSONL (ShareGPT `conversations: [{from, value}]` or OpenAI `messages: [{role,
content}]`), parquet, arrow, or a `Dataset.save_to_disk` directory. Errors are one line naming the
file and row (docs/design.md, "Bad input").
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
}
OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}
JSONL_SUFFIXES = (".jsonl", ".json")


class CorpusError(ValueError):
    """A bad corpus row. The message is one line, "path:line: reason" (JSONL) or "path:row N:
    reason" (parquet/arrow); `reason` is the key it is counted under when bad rows are skipped."""

    def __init__(self, message: str, reason: str = "bad_row"):
        super().__init__(message)
        self.reason = reason




# ---------------------------------------------------------------------------------------------
# Reading rows


def _is_jsonl(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in JSONL_SUFFIXES


def row_locator(path: str | os.PathLike) -> Callable[[int], str]:
    """row_index -> where the row is, for error messages: "path:line" (1-based) for JSONL,
    "path:row N" (0-based) for parquet/arrow."""
    path = Path(path)
    if _is_jsonl(path):
        return lambda row_index: f"{path}:{row_index + 1}"
    return lambda row_index: f"{path}:row {row_index}"


def iter_corpus_rows(path: str | os.PathLike) -> Iterator[tuple[int, object]]:
    """Yield (row_index, row) for every row of the corpus, row_index 0-based in the file (for JSONL
    the line index; blank lines are skipped but counted). A row that cannot be parsed is yielded as
    a CorpusError instead of a row, so the caller decides whether to stop or skip."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: corpus not found")
    if path.is_dir():
        import datasets

        try:
            dataset = datasets.load_from_disk(str(path))
        except FileNotFoundError:
            raise ValueError(
                f"{path}: a directory but not a dataset saved with save_to_disk "
                "(point --corpus at a .jsonl, .parquet or .arrow file, or at one split's directory)"
            ) from None
        if isinstance(dataset, datasets.DatasetDict):
            raise ValueError(f"{path}: holds a DatasetDict (splits {list(dataset)}); point at one split's directory")
        return _iter_arrow_batches(dataset.with_format("arrow").iter(batch_size=1024))
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return _iter_jsonl(path)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        # Streamed batch by batch: a parquet corpus is never copied into the datasets cache.
        return _iter_arrow_batches(pq.ParquetFile(path).iter_batches(batch_size=1024))
    if suffix == ".arrow":
        import datasets

        return _iter_arrow_batches(datasets.Dataset.from_file(str(path)).with_format("arrow").iter(batch_size=1024))
    raise ValueError(
        f"{path}: unsupported corpus file type {suffix!r} (expected .jsonl, .json, .parquet, .arrow or a directory)"
    )


def _iter_jsonl(path: Path) -> Iterator[tuple[int, object]]:
    with open(path, "rb") as f:
        for line_index, raw in enumerate(f):
            where = f"{path}:{line_index + 1}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield line_index, CorpusError(f"{where}: bad JSON: not UTF-8 at byte {error.start}", "bad_json")
                continue
            if line_index == 0:
                text = text.lstrip("\ufeff")
            if not text.strip():
                continue
            try:
                # Without its line break, so an error's column is on this line, not "line 2 column 1".
                yield line_index, json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as error:
                yield line_index, CorpusError(f"{where}: bad JSON: {_json_error(error)}", "bad_json")


def _json_error(error: json.JSONDecodeError) -> str:
    """"Expecting value at column 4"; json's own "Unterminated string starting at" already ends in
    "at" (the column is where the string starts)."""
    glue = " " if error.msg.endswith(" at") else " at "
    return f"{error.msg}{glue}column {error.colno}"


def _iter_arrow_batches(batches) -> Iterator[tuple[int, object]]:
    row_index = 0
    for batch in batches:
        for row in batch.to_pylist():
            yield row_index, row
            row_index += 1


def _short(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def normalize_messages(row: object, *, where: str, require_assistant: bool = True) -> list[dict[str, str]]:
    """A chat row -> [{"role": system|user|assistant, "content": str}, ...]. Raises CorpusError
    (message "{where}: reason") for a row that is not a usable conversation; a corpus row must
    hold an assistant turn (`require_assistant`), a prompt row need not."""
    if not isinstance(row, dict):
        raise CorpusError(f"{where}: row is a {type(row).__name__}, not an object", "bad_row")
    conversations, messages = row.get("conversations"), row.get("messages")
    if conversations is not None and messages is not None:
        raise CorpusError(f"{where}: row has both 'conversations' and 'messages'", "bad_row")
    if conversations is not None:
        turns, role_key, content_key, roles = conversations, "from", "value", SHAREGPT_ROLES
        list_key = "conversations"
    elif messages is not None:
        turns, role_key, content_key, roles = messages, "role", "content", OPENAI_ROLES
        list_key = "messages"
    else:
        raise CorpusError(f"{where}: row has no 'conversations' or 'messages' list", "bad_row")
    if not isinstance(turns, list):
        raise CorpusError(f"{where}: '{list_key}' is a {type(turns).__name__}, not a list", "bad_row")
    if not turns:
        raise CorpusError(f"{where}: empty conversation", "empty_conversation")

    normalized = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise CorpusError(f"{where}: message {j} is a {type(turn).__name__}, not an object", "bad_row")
        role = turn.get(role_key)
        if role is None:
            raise CorpusError(f"{where}: message {j} has no '{role_key}'", "missing_role")
        if not isinstance(role, str) or role.strip().lower() not in roles:
            raise CorpusError(
                f"{where}: message {j} has unknown role {_short(role)} (expected one of {sorted(roles)})",
                "unknown_role",
            )
        content = turn.get(content_key)
        if not isinstance(content, str):
            raise CorpusError(
                f"{where}: message {j} '{content_key}' is {type(content).__name__}, not a string", "bad_content"
            )
        normalized.append({"role": roles[role.strip().lower()], "content": content})

    # Some ShareGPT exports keep the system prompt beside the turns.
    system = row.get("system")
    if isinstance(system, str) and system.strip() and normalized[0]["role"] != "system":
        normalized.insert(0, {"role": "system", "content": system})
    if require_assistant and not any(m["role"] == "assistant" for m in normalized):
        raise CorpusError(f"{where}: conversation has no assistant turn", "no_assistant_turn")
    return normalized


# ---------------------------------------------------------------------------------------------
# Prompt rows (evaluation)


def prompt_messages(row: object, *, where: str) -> list[dict[str, str]]:
    """An evaluation prompts row -> the chat messages to answer: a 'prompt' string becomes one user
    turn; a ShareGPT/OpenAI conversation loses its trailing assistant turn(s) and must then end with
    a user turn."""
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
    if isinstance(row, dict) and "conversations" not in row and "messages" not in row:
        raise CorpusError(f"{where}: row has no 'prompt' string, 'conversations' or 'messages' list")
    messages = normalize_messages(row, where=where, require_assistant=False)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages or messages[-1]["role"] != "user":
        raise CorpusError(f"{where}: the conversation has no user turn to answer")
    return messages
