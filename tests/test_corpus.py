"""Corpus ingestion: row forms, loss masks, truncation, filtering, bad rows, file formats, storage."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import numpy as np
import pytest

from pipeline.cache_build.corpus import (
    CorpusConfig,
    TokenizedCorpus,
    ingest_corpus,
    load_tokenized_corpus,
    render_sequence,
    save_tokenized_corpus,
)
from pipeline.chat import CorpusError, iter_corpus_rows, normalize_messages
from pipeline.corpus_source import file_sha256
from pipeline.demo.toy import TOY_CHAT_TEMPLATE, make_toy_tokenizer, toy_chat_rows

# A copy of Qwen3-4B's chat template (tokenizer_config.json), to check the masks on the real one.
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

CONVERSATION = [
    ("system", "be kind to every friend."),
    ("user", "what is the water like?"),
    ("assistant", "the water is good, the river is long."),
    ("user", "and the light at night?"),
    ("assistant", "light is part of the night, my friend."),
]


@pytest.fixture(scope="module")
def tokenizer():
    return make_toy_tokenizer()


def sharegpt(turns):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names[r], "value": c} for r, c in turns]}


def openai(turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def masked_tokens(tokenizer, ids, mask) -> list[str]:
    return tokenizer.convert_ids_to_tokens([i for i, m in zip(ids, mask) if m])


def supervised_runs(ids, mask) -> list[list[int]]:
    """The maximal runs of consecutive supervised tokens."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    return runs + [current] if current else runs


def test_both_row_forms_give_identical_ids_and_masks(tokenizer):
    a = normalize_messages(sharegpt(CONVERSATION), where="a.jsonl:1")
    b = normalize_messages(openai(CONVERSATION), where="b.jsonl:1")
    assert a == b == [{"role": r, "content": c} for r, c in CONVERSATION]
    assert render_sequence(tokenizer, a, max_length=1024) == render_sequence(tokenizer, b, max_length=1024)


def test_mask_covers_exactly_the_assistant_content_and_end_of_turn(tokenizer):
    messages = normalize_messages(openai(CONVERSATION[:3]), where="x")
    ids, mask = render_sequence(tokenizer, messages, max_length=1024)
    supervised = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(supervised) == "the water is good , the river is long . <|im_end|>"
    # Everything before is template or prompt, and the turn is the end of the sequence.
    tokens = tokenizer.convert_ids_to_tokens(ids)
    first = mask.index(1)
    assert tokens[first - 4 : first] == ["<|im_start|>", "assistant", "<think>", "</think>"]
    assert mask == [0] * first + [1] * (len(ids) - first)


def test_multi_turn_supervises_every_assistant_turn_and_nothing_else(tokenizer):
    messages = normalize_messages(sharegpt(CONVERSATION), where="x")
    ids, mask = render_sequence(tokenizer, messages, max_length=1024)
    runs = supervised_runs(ids, mask)
    assert [tokenizer.decode(run) for run in runs] == [
        "the water is good , the river is long . <|im_end|>",
        "light is part of the night , my friend . <|im_end|>",
    ]
    unsupervised = [t for t, m in zip(tokenizer.convert_ids_to_tokens(ids), mask) if not m]
    assert unsupervised.count("<|im_start|>") == 5 and unsupervised.count("<|im_end|>") == 3
    assert {"system", "user", "assistant", "<think>", "</think>", "kind", "what", "night"} <= set(unsupervised)


def test_real_qwen3_template_masks_the_same_tokens(tokenizer):
    qwen3 = make_toy_tokenizer()
    qwen3.chat_template = QWEN3_CHAT_TEMPLATE
    messages = [{"role": r, "content": c} for r, c in CONVERSATION]
    # The toy template renders a corpus conversation exactly as Qwen3's does ...
    for n in (3, 4, 5):
        for generation_prompt in (False, True):
            kwargs = dict(tokenize=False, add_generation_prompt=generation_prompt, enable_thinking=False)
            expected = tokenizer.apply_chat_template(messages[:n], **kwargs)
            assert qwen3.apply_chat_template(messages[:n], **kwargs) == expected
    # ... and both give the same ids and masks: the empty think block of the last turn (template,
    # only on that turn) and the one in the generation prompt are never supervised.
    ids, mask = render_sequence(qwen3, messages, max_length=1024)
    assert (ids, mask) == render_sequence(tokenizer, messages, max_length=1024)
    assert [tokenizer.decode(run) for run in supervised_runs(ids, mask)] == [
        "the water is good , the river is long . <|im_end|>",
        "light is part of the night , my friend . <|im_end|>",
    ]
    # Qwen3 strips leading newlines of the last answer only; the mask follows the rendering.
    messages[2]["content"] = "\n\n" + messages[2]["content"]
    messages[4]["content"] = "\n" + messages[4]["content"]
    assert render_sequence(qwen3, messages, max_length=1024) == (ids, mask)


def byte_level_tokenizer(chat_template: str):
    """A small byte-level BPE tokenizer (Qwen's kind: whitespace and newlines are tokens too)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [m["content"] for row in toy_chat_rows(50, seed=0, form="openai") for m in row["messages"]]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts + ["system\nuser\nassistant\n\n"], trainer)
    backend.add_tokens([AddedToken(t, normalized=False) for t in ("<think>", "</think>")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = chat_template
    return tokenizer


def test_byte_level_tokenizer_masks_exactly_content_and_end_of_turn():
    """With newline tokens (as in Qwen's tokenizer) the newline after <|im_end|> and the empty think
    block's newlines stay unsupervised, and the decoded supervised text is the content verbatim."""
    for template in (QWEN3_CHAT_TEMPLATE, TOY_CHAT_TEMPLATE):
        tokenizer = byte_level_tokenizer(template)
        messages = [{"role": r, "content": c} for r, c in CONVERSATION]
        ids, mask = render_sequence(tokenizer, messages, max_length=1024)
        assert [tokenizer.decode(run) for run in supervised_runs(ids, mask)] == [
            CONVERSATION[2][1] + "<|im_end|>",
            CONVERSATION[4][1] + "<|im_end|>",
        ]
        assert tokenizer.decode(ids[-1:]) == "\n" and mask[-1] == 0


def test_an_empty_think_block_written_only_into_the_turn_is_not_supervised(tokenizer):
    """A template that ignores enable_thinking in its generation prompt but still writes the empty
    think block before the last answer: the block is template, not response."""
    no_switch = make_toy_tokenizer()
    switch = "enable_thinking is defined and enable_thinking is false"
    no_switch.chat_template = TOY_CHAT_TEMPLATE.replace(switch, "false")
    messages = [{"role": r, "content": c} for r, c in CONVERSATION]
    kwargs = dict(tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert no_switch.apply_chat_template(messages[:4], **kwargs).endswith("<|im_start|>assistant\n")
    expected = render_sequence(tokenizer, messages, max_length=1024)
    assert render_sequence(no_switch, messages, max_length=1024) == expected


def test_a_turn_rendered_differently_in_history_is_refused(tokenizer):
    """If an earlier answer is rewritten when it is not the last message, its text cannot be found
    after its header; it must not be matched to a later identical answer."""
    summarizing = make_toy_tokenizer()
    summarizing.chat_template = TOY_CHAT_TEMPLATE.replace(
        "{{- message.content + '<|im_end|>\\n' }}",
        "{{- (message.content if loop.last else 'the end .') + '<|im_end|>\\n' }}",
    )
    messages = [
        {"role": "user", "content": "a question ?"},
        {"role": "assistant", "content": "same answer ."},
        {"role": "user", "content": "again ?"},
        {"role": "assistant", "content": "same answer ."},
    ]
    assert "the end ." in summarizing.apply_chat_template(messages, tokenize=False)
    with pytest.raises(CorpusError, match=r"row 7: chat template is not prefix-stable at assistant turn \(message 1\)"):
        render_sequence(summarizing, messages, max_length=1024, where="row 7")


def test_a_template_that_is_not_prefix_stable_is_named(tokenizer, tmp_path):
    unstable = make_toy_tokenizer()
    unstable.chat_template = "{{- 'turns ' + messages|length|string + '\n' }}" + TOY_CHAT_TEMPLATE
    path = write_jsonl(tmp_path / "rows.jsonl", toy_chat_rows(2, seed=0))
    with pytest.raises(CorpusError, match=r"rows\.jsonl:1: chat template is not prefix-stable") as error:
        ingest_corpus(CorpusConfig(path=str(path)), unstable, progress=False)
    assert error.value.reason == "template_not_prefix_stable"


def test_truncation_at_max_length(tokenizer, tmp_path):
    messages = normalize_messages(openai(CONVERSATION), where="x")
    ids, mask = render_sequence(tokenizer, messages, max_length=1024)
    short_ids, short_mask = render_sequence(tokenizer, messages, max_length=40)
    assert len(ids) > 40 and (short_ids, short_mask) == (ids[:40], mask[:40])

    path = write_jsonl(tmp_path / "rows.jsonl", toy_chat_rows(4, seed=2, response_words=(80, 90)))
    config = CorpusConfig(path=str(path), max_length=64, min_supervised_tokens=10)
    corpus = ingest_corpus(config, tokenizer, progress=False)
    assert len(corpus) == 4 and corpus.stats["truncated"] == 4
    assert np.all(np.diff(corpus.offsets) == 64)


def test_short_rows_are_dropped_and_counted(tokenizer, tmp_path):
    rows = toy_chat_rows(6, seed=3, max_turns=1, response_words=(40, 50))
    rows[1] = openai([("user", "a question ?"), ("assistant", "short answer .")])
    rows[4] = openai([("user", "a question ?"), ("assistant", " ".join(["word"] * 30))])  # 31 with <|im_end|>
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    corpus = ingest_corpus(CorpusConfig(path=str(path)), tokenizer, progress=False)
    assert corpus.stats["dropped"] == {"too_few_supervised_tokens": 2}
    assert corpus.source_rows.tolist() == [0, 2, 3, 5]
    assert all(corpus.sequence(i)[1].sum() >= 32 for i in range(len(corpus)))
    relaxed = ingest_corpus(CorpusConfig(path=str(path), min_supervised_tokens=31), tokenizer, progress=False)
    assert relaxed.source_rows.tolist() == [0, 2, 3, 4, 5]


BAD_ROWS = {
    "bad_json": '{"messages": [',
    "bad_row": "[1, 2]",
    "missing_role": {"conversations": [{"value": "hi"}, {"from": "gpt", "value": "yes"}]},
    "unknown_role": {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
    "bad_content": {"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "y"}]},
    "empty_conversation": {"conversations": []},
    "no_assistant_turn": {"messages": [{"role": "user", "content": "hi"}]},
    "assistant_first": {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]},
}


@pytest.mark.parametrize("reason", sorted(BAD_ROWS))
def test_a_bad_row_is_a_one_line_error_naming_file_and_line(reason, tokenizer, tmp_path):
    good = toy_chat_rows(2, seed=4)
    path = write_jsonl(tmp_path / "corpus.jsonl", [good[0], "", BAD_ROWS[reason], good[1]])  # line 3
    with pytest.raises(CorpusError) as error:
        ingest_corpus(CorpusConfig(path=str(path)), tokenizer, progress=False)
    message = str(error.value)
    assert message.startswith(f"{path}:3: ") and "\n" not in message
    assert error.value.reason == reason


@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"messages": [', "bad JSON: Expecting value at column 15"),
        ('{"messages": "no end', "bad JSON: Unterminated string starting at column 14"),
        ('{"prompt": "tab\there"}', "bad JSON: Invalid control character at column 16"),
    ],
)
def test_bad_json_names_its_column_once(line, expected, tmp_path):
    """json's own message may already end in "at" ("Unterminated string starting at"): the
    column is appended once, never as "at at column"."""
    path = write_jsonl(tmp_path / "prompts.jsonl", [line])
    [(_, error)] = list(iter_corpus_rows(path))
    assert isinstance(error, CorpusError) and str(error) == f"{path}:1: {expected}"


def test_a_directory_that_is_not_a_dataset_is_a_one_line_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"a directory but not a dataset saved with save_to_disk") as error:
        iter_corpus_rows(tmp_path)
    assert str(error.value).startswith(f"{tmp_path}: ") and "\n" not in str(error.value)


def test_bad_rows_are_skipped_and_counted_by_reason(tokenizer, tmp_path):
    good = toy_chat_rows(len(BAD_ROWS) + 1, seed=5)
    lines, good_lines = [], []
    for i, reason in enumerate(sorted(BAD_ROWS)):
        good_lines.append(len(lines))
        lines += [good[i], BAD_ROWS[reason]]
    good_lines.append(len(lines))
    lines.append(good[-1])
    path = write_jsonl(tmp_path / "corpus.jsonl", lines)
    corpus = ingest_corpus(CorpusConfig(path=str(path), skip_bad_rows=True), tokenizer, progress=False)
    assert corpus.stats["dropped"] == {reason: 1 for reason in BAD_ROWS}
    assert corpus.stats["rows"] == len(lines) and corpus.stats["sequences"] == len(good)
    assert corpus.source_rows.tolist() == good_lines
    expected = render_sequence(tokenizer, normalize_messages(good[-1], where="x"), max_length=1024)
    assert [a.tolist() for a in corpus.sequence(-1)] == list(expected)


def test_parquet_arrow_and_save_to_disk_match_jsonl(tokenizer, tmp_path):
    for form in ("sharegpt", "openai"):
        rows = toy_chat_rows(5, seed=6, form=form)
        sources = {"jsonl": write_jsonl(tmp_path / f"{form}.jsonl", rows)}
        dataset = datasets.Dataset.from_list(rows)
        dataset.to_parquet(str(tmp_path / f"{form}.parquet"))
        sources["parquet"] = tmp_path / f"{form}.parquet"
        dataset.save_to_disk(str(tmp_path / f"{form}-dataset"))
        sources["save_to_disk"] = tmp_path / f"{form}-dataset"
        sources["arrow"] = next(sources["save_to_disk"].glob("*.arrow"))
        corpora = {
            name: ingest_corpus(CorpusConfig(path=str(p)), tokenizer, progress=False) for name, p in sources.items()
        }
        reference = corpora.pop("jsonl")
        assert len(reference) == 5
        for corpus in corpora.values():
            assert corpus.stats == reference.stats
            for name in ("source_rows", "offsets", "input_ids", "loss_mask"):
                assert np.array_equal(getattr(corpus, name), getattr(reference, name))


def test_blank_lines_and_a_byte_order_mark_are_tolerated(tokenizer, tmp_path):
    rows = toy_chat_rows(2, seed=10)
    path = tmp_path / "bom.jsonl"
    path.write_bytes(("\ufeff" + json.dumps(rows[0]) + "\n\n  \n" + json.dumps(rows[1]) + "\n").encode())
    corpus = ingest_corpus(CorpusConfig(path=str(path)), tokenizer, progress=False)
    assert corpus.source_rows.tolist() == [0, 3] and corpus.stats["rows"] == 2


def test_a_bad_parquet_row_names_its_row_index(tokenizer, tmp_path):
    rows = toy_chat_rows(3, seed=7, form="openai")
    rows[2]["messages"][0]["role"] = "robot"
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    with pytest.raises(CorpusError, match=r"rows\.parquet:row 2: message 0 has unknown role 'robot'"):
        ingest_corpus(CorpusConfig(path=str(tmp_path / "rows.parquet")), tokenizer, progress=False)
    assert [i for i, _ in iter_corpus_rows(tmp_path / "rows.parquet")] == [0, 1, 2]


def test_save_load_round_trip_with_mmap(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", toy_chat_rows(5, seed=8))
    corpus = ingest_corpus(CorpusConfig(path=str(path)), tokenizer, progress=False)
    out = tmp_path / "cache" / "corpus"
    save_tokenized_corpus(corpus, out)
    loaded = load_tokenized_corpus(out)
    assert isinstance(loaded.input_ids, np.memmap) and loaded.stats == corpus.stats
    dtypes = {"source_rows": np.int64, "offsets": np.int64, "input_ids": np.int32, "loss_mask": np.uint8}
    for name, dtype in dtypes.items():
        assert getattr(loaded, name).dtype == dtype
        assert np.array_equal(getattr(loaded, name), getattr(corpus, name))
    assert all(np.array_equal(a, b) for i in range(len(corpus)) for a, b in zip(loaded.sequence(i), corpus.sequence(i)))
    # Saving again replaces the directory whole and leaves no temporary directories behind.
    smaller = TokenizedCorpus(
        source_rows=corpus.source_rows[:1], offsets=corpus.offsets[:2],
        input_ids=corpus.input_ids[: corpus.offsets[1]], loss_mask=corpus.loss_mask[: corpus.offsets[1]],
        stats={"sequences": 1},
    )
    save_tokenized_corpus(smaller, out)
    assert len(load_tokenized_corpus(out, mmap=False)) == 1
    assert sorted(p.name for p in out.parent.iterdir()) == ["corpus"]
    with pytest.raises(ValueError, match="not a tokenized corpus"):
        load_tokenized_corpus(tmp_path)


def test_file_sha256_changes_when_a_byte_changes(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", toy_chat_rows(3, seed=9))
    before = file_sha256(path)
    assert before.startswith("sha256:") and before == file_sha256(path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    assert file_sha256(path) != before

    directory = tmp_path / "dataset"
    datasets.Dataset.from_list(toy_chat_rows(3, seed=9)).save_to_disk(str(directory))
    before = file_sha256(directory)
    arrow = next(directory.glob("*.arrow"))
    data = bytearray(arrow.read_bytes())
    data[-100] ^= 1
    arrow.write_bytes(bytes(data))
    assert file_sha256(directory) != before


def test_config_and_path_errors_name_the_problem(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="max_length"):
        CorpusConfig(path="x.jsonl", max_length=1)
    with pytest.raises(ValueError, match="min_supervised_tokens"):
        CorpusConfig(path="x.jsonl", max_length=16)
    with pytest.raises(ValueError, match="corpus not found"):
        ingest_corpus(CorpusConfig(path=str(tmp_path / "missing.jsonl")), tokenizer, progress=False)
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported corpus file type"):
        iter_corpus_rows(tmp_path / "rows.csv")
