"""Chat rows, for the corpus and for evaluation prompts: reading row files and normalising a row
to `[{"role": system|user|assistant, "content": str}, ...]`.

Rows come from JSONL or a JSON array (ShareGPT `conversations: [{from, value}]` or OpenAI
`messages: [{role, content}]`), parquet, arrow, or a `Dataset.save_to_disk` directory. A row for a vision-language
target may carry one image (LLaVA `image` + `<image>`, or an OpenAI `{"type": "image"}` content
part; docs/vision.md). Errors are one line naming the file and row (docs/design.md, "Bad input").
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
# A regenerated corpus (`alrira-cache regenerate`, docs/design.md "Regeneration") is a folder of
# JSONL parts listed in its manifest; the corpus reader takes the folder as one corpus.
REGENERATED_KIND = "alrira-regenerated-corpus"
REGENERATED_MANIFEST = "manifest.json"
# What produced it, one entry per invocation (pipeline/provenance.py): a record, not rows, so the
# corpus hash of the folder leaves it out (a rerun that only resumes adds an entry).
REGENERATED_PROVENANCE = "regenerate_provenance.json"
LOSS_TOKENS_KEY = "loss_tokens"  # on an assistant message: how many leading tokens carry loss


class CorpusError(ValueError):
    """A bad corpus row. The message is one line, "path:line: reason" (JSONL) or "path:row N:
    reason" (parquet/arrow); `reason` is the key it is counted under when bad rows are skipped."""

    def __init__(self, message: str, reason: str = "bad_row"):
        super().__init__(message)
        self.reason = reason


# ---------------------------------------------------------------------------------------------
# Reading rows


def is_jsonl_file(path: str | os.PathLike) -> bool:
    path = Path(path)
    return path.is_file() and path.suffix.lower() in JSONL_SUFFIXES


def row_locator(path: str | os.PathLike) -> Callable[[int], str]:
    """row_index -> where the row is, for error messages: "path:line" (1-based) for JSONL,
    "path:row N" (0-based) for parquet/arrow, "folder/part-00002.jsonl:line" for a regenerated
    corpus (whose row index counts the lines of its parts in order)."""
    path = Path(path)
    if is_jsonl_file(path):
        return lambda row_index: f"{path}:{row_index + 1}"
    parts = regenerated_parts(path)
    if parts is not None:
        firsts = [first for first, _ in parts]

        def locate(row_index: int) -> str:
            first, part = parts[bisect.bisect_right(firsts, row_index) - 1]
            return f"{part}:{row_index - first + 1}"

        return locate
    return lambda row_index: f"{path}:row {row_index}"


def regenerated_manifest(path: str | os.PathLike) -> dict | None:
    """The manifest of a regenerated corpus folder, or None when `path` is not one."""
    manifest = Path(path) / REGENERATED_MANIFEST
    if not manifest.is_file():
        return None
    try:
        data = json.loads(manifest.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{manifest}: unreadable manifest ({error})") from None
    return data if isinstance(data, dict) and data.get("kind") == REGENERATED_KIND else None


def regenerated_part_name(index: int) -> str:
    return f"part-{index:05d}.jsonl"


_PART_COUNTS = ("lines", "written", "turns", "turns_cut", "generated_tokens")


def checked_regenerated_parts(manifest: dict, *, where: str) -> list[dict]:
    """The part records of a regeneration manifest, sorted by index, after checking every field a
    reader uses: a part's name must be the one its index gives (never a path from the file), so a
    crafted or damaged manifest stops in one line naming `where` (docs/design.md, "Bad input")."""
    num_parts, parts = manifest.get("num_parts"), manifest.get("parts")
    if not isinstance(num_parts, int) or num_parts < 0 or not isinstance(parts, list):
        raise ValueError(f"{where}: damaged manifest ('num_parts' or 'parts' missing or of the wrong type)")
    seen = set()
    for part in parts:
        index = part.get("index") if isinstance(part, dict) else None
        if not isinstance(index, int) or not 0 <= index < num_parts or index in seen:
            raise ValueError(f"{where}: damaged manifest (a part with a missing, repeated or out-of-range index)")
        seen.add(index)
        if part.get("name") != regenerated_part_name(index):
            name, expected = part.get("name"), regenerated_part_name(index)
            raise ValueError(f"{where}: damaged manifest (part {index} is named {name!r}, not {expected!r})")
        if not all(isinstance(part.get(key), int) and part[key] >= 0 for key in _PART_COUNTS) or not all(
            isinstance(part.get(key), dict) for key in ("failed", "skipped")
        ) or not isinstance(part.get("sha256"), str):  # fmt: skip
            raise ValueError(f"{where}: damaged manifest (part {index} lacks its counts or checksum)")
    return sorted(parts, key=lambda part: part["index"])


def regenerated_parts(path: str | os.PathLike) -> list[tuple[int, Path]] | None:
    """(row index of its first line, file) of every part of a finished regenerated corpus, in
    order; None when `path` is not a regenerated corpus. An unfinished one is refused."""
    path = Path(path)
    manifest = regenerated_manifest(path) if path.is_dir() else None
    if manifest is None:
        return None
    parts = checked_regenerated_parts(manifest, where=str(path / REGENERATED_MANIFEST))
    if len(parts) != manifest["num_parts"]:
        raise ValueError(
            f"{path}: regeneration not finished ({len(parts)}/{manifest['num_parts']} parts); rerun alrira-cache regenerate"
        )
    for part in parts:  # the row indices below come from these counts: checked against the parts themselves
        with open(path / part["name"], "rb") as f:
            lines = sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
        if lines != part["lines"]:
            raise ValueError(
                f"{path / part['name']}: holds {lines} lines, its manifest says {part['lines']} (edited or damaged); "
                "rerun alrira-cache regenerate on it"
            )
    firsts = itertools.accumulate((part["lines"] for part in parts), initial=0)
    return [(first, path / part["name"]) for first, part in zip(firsts, parts)]


def _iter_regenerated(parts: list[tuple[int, Path]]) -> Iterator[tuple[int, object]]:
    for first, part in parts:
        for line_index, row in _iter_jsonl(part):
            yield first + line_index, row


def iter_corpus_rows(path: str | os.PathLike, *, seek: tuple[int, int] | None = None) -> Iterator[tuple[int, object]]:
    """Yield (row_index, row) for every row of the corpus, row_index 0-based in the file (for JSONL
    the line index; blank lines are skipped but counted). A row that cannot be parsed is yielded as
    a CorpusError instead of a row, so the caller decides whether to stop or skip. `seek` (JSONL
    only, from jsonl_row_seeks) starts at that row instead of row 0."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: corpus not found")
    parts = regenerated_parts(path)
    if parts is not None:
        return _iter_regenerated(parts)
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
    if suffix == ".json" and _is_json_array(path):
        return _iter_json_array(path)
    if suffix in JSONL_SUFFIXES:
        return _iter_jsonl(path, seek or (0, 0))
    if seek is not None:
        raise ValueError(f"{path}: seek is for JSONL corpora only")
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


def _jsonl_lines(path: Path, seek: tuple[int, int] = (0, 0)) -> Iterator[tuple[int, int, str | UnicodeDecodeError]]:
    """(line index, byte offset, text or its decoding error) of every row line of a JSONL file
    (blank lines skipped), from `seek` = (byte offset, line index) of a line start on."""
    offset, first_line = seek
    with open(path, "rb") as f:
        f.seek(offset)
        for line_index, raw in enumerate(f, start=first_line):
            start, offset = offset, offset + len(raw)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield line_index, start, error
                continue
            if line_index == 0:
                text = text.lstrip("\ufeff")
            if text.strip():
                yield line_index, start, text


def jsonl_row_seeks(path: str | os.PathLike, *, every: int) -> list[tuple[int, int]]:
    """(byte offset, line index) of rows 0, every, 2 * every, ... of a JSONL corpus, read once without
    parsing: iter_corpus_rows(path, seek=...) starts there instead of at row 0."""
    return [(start, line_index) for row, (line_index, start, _) in enumerate(_jsonl_lines(Path(path))) if row % every == 0]


def _iter_jsonl(path: Path, seek: tuple[int, int] = (0, 0)) -> Iterator[tuple[int, object]]:
    for line_index, _, text in _jsonl_lines(path, seek):
        where = f"{path}:{line_index + 1}"
        if isinstance(text, UnicodeDecodeError):
            yield line_index, CorpusError(f"{where}: bad JSON: not UTF-8 at byte {text.start}", "bad_json")
            continue
        try:
            # Without its line break, so an error's column is on this line, not "line 2 column 1".
            yield line_index, json.loads(text.rstrip("\r\n"))
        except json.JSONDecodeError as error:
            yield line_index, CorpusError(f"{where}: bad JSON: {_json_error(error)}", "bad_json")


def _is_json_array(path: Path) -> bool:
    """A .json file holding one JSON array of rows (LLaVA / ALLaVA releases) rather than one row per line."""
    with open(path, "rb") as f:
        head = f.read(4096).decode("utf-8", errors="replace").lstrip("\ufeff \t\r\n")
    return head.startswith("[")


def _iter_json_array(path: Path) -> Iterator[tuple[int, object]]:
    """Rows of a JSON-array file, each yielded with the 0-based index of the line it starts on, so
    errors name "path:line" as for JSONL. A syntax error stops the file (a ValueError, not a
    skippable row: nothing after it can be located)."""
    try:
        text = path.read_text(encoding="utf-8").lstrip("\ufeff")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: bad JSON: not UTF-8 at byte {error.start}") from None
    decoder, whitespace = json.JSONDecoder(), " \t\r\n"
    pos, line, counted = text.index("[") + 1, 0, 0

    def skip(pos: int) -> int:
        while pos < len(text) and text[pos] in whitespace:
            pos += 1
        return pos

    pos = skip(pos)
    while pos < len(text) and text[pos] != "]":
        line += text.count("\n", counted, pos)
        counted = pos
        try:
            row, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{error.lineno}: bad JSON: {_json_error(error)} (the rest of the array cannot be read)") from None
        yield line, row
        pos = skip(pos)
        if pos < len(text) and text[pos] == ",":
            pos = skip(pos + 1)
        elif pos < len(text) and text[pos] != "]":
            raise ValueError(f"{path}:{line + text.count(chr(10), counted, pos) + 1}: bad JSON: expected ',' or ']' in the array")
    if pos >= len(text):
        raise ValueError(f"{path}: bad JSON: the array is not closed")


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


@dataclass(kw_only=True)
class ChatRow:
    """A normalized chat row: messages with string content, and the row's one image if it has one
    (its path as the row writes it, and the index of the user message it belongs to)."""

    messages: list[dict[str, str]]
    image: str | None = None
    image_turn: int | None = None


def normalize_messages(row: object, *, where: str, require_assistant: bool = True) -> list[dict[str, str]]:
    """A text chat row -> [{"role": system|user|assistant, "content": str}, ...]. Raises CorpusError
    (message "{where}: reason") for a row that is not a usable conversation, or that has an image
    (only a vision-language target reads those, through normalize_row); a corpus row must hold an
    assistant turn (`require_assistant`), a prompt row need not."""
    chat = normalize_row(row, where=where, require_assistant=require_assistant)
    if chat.image is not None:
        raise CorpusError(f"{where}: row has an image ({_short(chat.image)}) but the target is text-only", "image_for_text_target")
    return chat.messages


def normalize_row(row: object, *, where: str, require_assistant: bool = True) -> ChatRow:
    """A chat row -> ChatRow. Text rows come out as normalize_messages describes. An image comes
    from a LLaVA-style `image` key (its `<image>` placeholder, if any, removed and marking the user
    turn it belongs to, else the first user turn) or from an OpenAI content part `{"type": "image",
    "image": path}`; one image per row, no videos (docs/vision.md, "Corpus rows")."""
    if not isinstance(row, dict):
        raise CorpusError(f"{where}: row is a {type(row).__name__}, not an object", "bad_row")
    turns, role_key, content_key, roles = _turns(row, where=where)
    row_image = _row_image(row, where=where)

    normalized, part_images = [], []  # part_images: (message index, path) of image content parts
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
        if isinstance(content, list):
            content, images = _content_parts(content, where=where, message=j, key=content_key)
            part_images += [(j, path) for path in images]
        elif not isinstance(content, str):
            raise CorpusError(
                f"{where}: message {j} '{content_key}' is {type(content).__name__}, not a string", "bad_content"
            )
        message = {"role": roles[role.strip().lower()], "content": content}
        if LOSS_TOKENS_KEY in turn:
            message[LOSS_TOKENS_KEY] = _loss_tokens(turn[LOSS_TOKENS_KEY], role=message["role"], where=where, message=j)
        normalized.append(message)

    image, image_turn = _place_image(normalized, row_image=row_image, part_images=part_images, where=where)
    # Some ShareGPT exports keep the system prompt beside the turns.
    system = row.get("system")
    if isinstance(system, str) and system.strip() and normalized[0]["role"] != "system":
        normalized.insert(0, {"role": "system", "content": system})
        image_turn = None if image_turn is None else image_turn + 1
    if require_assistant and not any(m["role"] == "assistant" for m in normalized):
        raise CorpusError(f"{where}: conversation has no assistant turn", "no_assistant_turn")
    return ChatRow(messages=normalized, image=image, image_turn=image_turn)


def _turns(row: dict, *, where: str) -> tuple[list, str, str, dict[str, str]]:
    """(turns, role key, content key, role names) of a ShareGPT or OpenAI row."""
    conversations, messages = row.get("conversations"), row.get("messages")
    if conversations is not None and messages is not None:
        raise CorpusError(f"{where}: row has both 'conversations' and 'messages'", "bad_row")
    if conversations is not None:
        turns, role_key, content_key, roles, list_key = conversations, "from", "value", SHAREGPT_ROLES, "conversations"
    elif messages is not None:
        turns, role_key, content_key, roles, list_key = messages, "role", "content", OPENAI_ROLES, "messages"
    else:
        raise CorpusError(f"{where}: row has no 'conversations' or 'messages' list", "bad_row")
    if not isinstance(turns, list):
        raise CorpusError(f"{where}: '{list_key}' is a {type(turns).__name__}, not a list", "bad_row")
    if not turns:
        raise CorpusError(f"{where}: empty conversation", "empty_conversation")
    return turns, role_key, content_key, roles


def _loss_tokens(value: object, *, role: str, where: str, message: int) -> int:
    """A message's loss window (docs/design.md, "Regeneration"): a count >= 0 on an assistant turn."""
    if role != "assistant":
        raise CorpusError(f"{where}: message {message} is a {role} turn with '{LOSS_TOKENS_KEY}' (only assistant turns carry loss)", "bad_loss_tokens")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CorpusError(f"{where}: message {message} '{LOSS_TOKENS_KEY}' is {_short(value)}, not a count >= 0", "bad_loss_tokens")
    return value


def _row_image(row: dict, *, where: str) -> str | None:
    """The LLaVA-style `image` (or one-element `images`) path of a row, or None; a video is refused."""
    if row.get("video") is not None or row.get("videos") is not None:
        raise CorpusError(f"{where}: row has a video; only images are supported", "video")
    image, images = row.get("image"), row.get("images")
    if images is not None:
        if image is not None or not isinstance(images, list):
            raise CorpusError(f"{where}: row has both 'image' and 'images', or 'images' is not a list", "bad_image_field")
        if len(images) > 1:
            raise CorpusError(f"{where}: row has {len(images)} images; one image per row is supported", "multiple_images")
        image = images[0] if images else None
    if image is not None and (not isinstance(image, str) or not image.strip()):
        raise CorpusError(f"{where}: 'image' is {_short(image)}, not a non-empty path string", "bad_image_field")
    return image


def _content_parts(parts: list, *, where: str, message: int, key: str) -> tuple[str, list[str]]:
    """An OpenAI content list -> (its text parts joined, the paths of its image parts)."""
    texts, images = [], []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image" and isinstance(part.get("image"), str) and part["image"].strip():
            images.append(part["image"])
        elif kind == "video" or (isinstance(part, dict) and "video" in part):
            raise CorpusError(f"{where}: message {message} has a video; only images are supported", "video")
        else:
            raise CorpusError(
                f"{where}: message {message} '{key}' part {_short(part)} is neither "
                '{"type": "text", "text": str} nor {"type": "image", "image": path}',
                "bad_content",
            )
    return "".join(texts), images


IMAGE_PLACEHOLDER = re.compile(r"\n?<image>\n?")  # LLaVA's placeholder and the line break beside it


def _place_image(
    messages: list[dict[str, str]], *, row_image: str | None, part_images: list[tuple[int, str]], where: str
) -> tuple[str | None, int | None]:
    """(image path, index of its user message) of a row; strips the `<image>` placeholder of a
    LLaVA row. Placeholders in a row without an `image` key are text and stay."""
    num_images = len(part_images) + (row_image is not None)
    if num_images > 1:
        raise CorpusError(f"{where}: row has {num_images} images; one image per row is supported", "multiple_images")
    if part_images:
        turn, image = part_images[0]
    elif row_image is not None:
        marked = [j for j, m in enumerate(messages) if "<image>" in m["content"]]
        if sum(m["content"].count("<image>") for m in messages) > 1:
            raise CorpusError(f"{where}: row has more than one <image> placeholder for its one image", "multiple_images")
        users = [j for j, m in enumerate(messages) if m["role"] == "user"]
        turn, image = (marked[0] if marked else users[0] if users else 0), row_image
        messages[turn]["content"] = IMAGE_PLACEHOLDER.sub("", messages[turn]["content"], count=1)
    else:
        return None, None
    if messages[turn]["role"] != "user":
        raise CorpusError(f"{where}: the image belongs to a {messages[turn]['role']} message, not a user turn", "image_not_in_user_turn")
    return image, turn


# ---------------------------------------------------------------------------------------------
# Prompt rows (evaluation)


def prompt_messages(row: object, *, where: str) -> list[dict[str, str]]:
    """An evaluation prompts row -> the chat messages to answer (a text row; see prompt_row)."""
    chat = prompt_row(row, where=where)
    if chat.image is not None:
        raise CorpusError(f"{where}: row has an image ({_short(chat.image)}) but the target is text-only", "image_for_text_target")
    return chat.messages


def prompt_row(row: object, *, where: str) -> ChatRow:
    """An evaluation prompts row -> the ChatRow to answer: a 'prompt' string becomes one user turn
    (with the row's `image`, if any); a ShareGPT/OpenAI conversation loses its trailing assistant
    turn(s) and must then end with a user turn."""
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        image = _row_image(row, where=where)
        content = IMAGE_PLACEHOLDER.sub("", row["prompt"], count=1) if image is not None else row["prompt"]
        return ChatRow(messages=[{"role": "user", "content": content}], image=image, image_turn=None if image is None else 0)
    if isinstance(row, dict) and "conversations" not in row and "messages" not in row:
        raise CorpusError(f"{where}: row has no 'prompt' string, 'conversations' or 'messages' list")
    chat = normalize_row(row, where=where, require_assistant=False)
    messages = chat.messages
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages or messages[-1]["role"] != "user":
        raise CorpusError(f"{where}: the conversation has no user turn to answer")
    if chat.image_turn is not None and chat.image_turn >= len(messages):
        raise CorpusError(f"{where}: the image belongs to a dropped assistant turn", "image_not_in_user_turn")
    return chat
