"""Comments and docstrings say what and why, not when (the house style, habit 17): no dates, issue
numbers or chaos seeds in the package's comments or docstrings. The git log keeps the history;
a reader of the code wants the reason that still holds. Static: tokenize and ast, nothing imported."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "drafter", "storage", "ray_jobs")

HISTORY = [
    ("a date", re.compile(r"\b(?:19|20)\d{2}-[01]\d-[0-3]\d\b")),
    ("an issue number", re.compile(r"\bissues?\s+#?\d+", re.I)),
    ("a chaos seed", re.compile(r"\bchaos\b[^.;)]*?\bseeds?\s+\d+", re.I | re.S)),
    ("a chaos seed", re.compile(r"\bseeds?\s+20\d{2}\b", re.I)),
]


def history_in(source: str) -> list[tuple[int, str, str]]:
    """(line, what, the text matched) for every date, issue number or chaos seed in a comment or
    a docstring of `source`; string literals that are neither are code, not prose, and pass."""
    texts = []  # [(first line, text)]
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            texts.append((token.start[0], token.string))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                texts.append((first.lineno, first.value.value))
    found = set()
    for line, text in texts:
        for what, pattern in HISTORY:
            for match in pattern.finditer(text):
                found.add((line + text.count("\n", 0, match.start()), what, " ".join(match.group().split())))
    return sorted(found)


def test_the_detector_reads_comments_and_docstrings_not_strings():
    source = '''"""A module (issue 12)."""
TOKENS = ["<issue_start>", "seed 2028", "2026-12-03"]  # a list of tokens


def f():
    """Found by the chaos harness,
    seed 30, round 4."""
    return 1  # since 2026-12-03


class C:
    """No history here: seed 0 draws the same anchors, 2 issues at once."""
'''
    assert [(line, what) for line, what, _ in history_in(source)] == [
        (1, "an issue number"), (6, "a chaos seed"), (8, "a date")]  # fmt: skip


def test_package_comments_carry_no_dates_issue_numbers_or_chaos_seeds():
    offending = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, what, text in history_in(path.read_text()):
                offending.append(f"{path.relative_to(ROOT)}:{line}: {what} ({text!r})")
    assert not offending, (
        "say what and why, and leave the when to the git log:\n" + "\n".join(offending))
