"""llama.cpp's CPU tools and converter, from the pinned llama-cpp-python sdist (docs/serving.md, "llama.cpp").

The sdist vendors the llama.cpp that serves `--spec-type draft-dflash` / `draft-dspark` (SPEC §13).
Everything lives in one tools folder outside the repository (`--tools-dir`, $ALRIRA_LLAMA_CPP, else
~/.cache/alrira/llama-cpp) and is made once:

  sdist/            the downloaded llama_cpp_python-VERSION.tar.gz
  src/              its extracted tree; vendor/llama.cpp holds the sources, convert_hf_to_gguf.py, gguf-py
  build/bin/        llama-server (cmake, CPU only, static), stamped by tools.json
  convert-deps/     transformers at the sdist's pin and its two readers, installed --no-deps with
                    --target: the converter runs under this interpreter with PYTHONPATH = gguf-py
                    (the sdist's own) + convert-deps, so the project's .venv is never changed

A rerun finds tools.json and the binary and builds nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
TOOLS_ENV = "ALRIRA_LLAMA_CPP"
BINARIES = ("llama-server",)
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF", "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
)  # fmt: skip
# The converter's pin (vendor/llama.cpp/requirements/requirements-convert_legacy_llama.txt) and the
# hub/tokenizers releases of its line (the same as .ci/install's transformers-4.57).
CONVERT_DEPS = ("transformers==4.57.6", "huggingface_hub==0.36.2", "tokenizers==0.22.2")


def default_tools_dir() -> Path:
    if os.environ.get(TOOLS_ENV):
        return Path(os.environ[TOOLS_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "alrira" / "llama-cpp"


@dataclass(kw_only=True)
class Tools:
    root: Path

    @property
    def source(self) -> Path:
        return self.root / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"

    @property
    def bin(self) -> Path:
        return self.root / "build" / "bin"

    @property
    def stamp(self) -> Path:
        return self.root / "tools.json"

    def built(self) -> bool:
        """tools.json of this version and flags, and every binary there."""
        try:
            stamp = json.loads(self.stamp.read_text())
        except (OSError, json.JSONDecodeError):
            return False
        wanted = {"version": VERSION, "cmake_flags": list(CMAKE_FLAGS), "binaries": list(BINARIES)}
        return all(stamp.get(k) == v for k, v in wanted.items()) and all((self.bin / b).is_file() for b in BINARIES)

    def converter_ready(self) -> bool:
        try:
            return json.loads((self.root / "convert-deps" / "deps.json").read_text()) == list(CONVERT_DEPS)
        except (OSError, json.JSONDecodeError):
            return False


def ensure_tools(root: Path, *, jobs: int = 2, log=print) -> Tools:
    """Download, extract and build once; return the tools. Each step is skipped when its output is there."""
    tools = Tools(root=root)
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / "sdist" / SDIST
    if not sdist.is_file():
        log(f"llama.cpp: pip download llama-cpp-python=={VERSION} (sdist) into {sdist.parent}")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={VERSION}", "-d", str(sdist.parent)], check=True)  # fmt: skip
    if not (tools.source / "convert_hf_to_gguf.py").is_file():
        log(f"llama.cpp: extracting {sdist.name}")
        with tarfile.open(sdist) as archive:
            archive.extractall(root / "src", filter="data")
    if not tools.built():
        started = time.monotonic()
        log(f"llama.cpp: cmake build of {', '.join(BINARIES)} (-j{jobs}, CPU only) into {tools.bin.parent}")
        subprocess.run(["cmake", "-S", str(tools.source), "-B", str(root / "build"), *CMAKE_FLAGS], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["nice", "-n", "10", "cmake", "--build", str(root / "build"), f"-j{jobs}", "--target", *BINARIES], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        stamp = {"version": VERSION, "cmake_flags": list(CMAKE_FLAGS), "binaries": list(BINARIES),
                 "build_s": round(time.monotonic() - started, 1)}  # fmt: skip
        tools.stamp.write_text(json.dumps(stamp, indent=2) + "\n")
        log(f"llama.cpp: built in {stamp['build_s']:.0f} s")
    if not tools.converter_ready():
        deps = root / "convert-deps"
        shutil.rmtree(deps, ignore_errors=True)
        log(f"llama.cpp: converter dependencies {' '.join(CONVERT_DEPS)} into {deps}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                        "--target", str(deps), *CONVERT_DEPS], check=True)  # fmt: skip
        (deps / "deps.json").write_text(json.dumps(list(CONVERT_DEPS)))
    return tools


def converter_env(tools: Tools) -> dict:
    env = dict(os.environ)
    # gguf-py first: the sdist's own gguf package, never the one in site-packages.
    env["PYTHONPATH"] = os.pathsep.join([str(tools.source / "gguf-py"), str(tools.root / "convert-deps")])
    return env


@dataclass(kw_only=True)
class Converted:
    gguf: Path | None  # None: the converter refused
    command: list[str]
    error: str = ""  # its last error line when it refused


def convert(tools: Tools, model_dir: Path, out: Path, *, outtype: str = "f32", target_dir: Path | None = None) -> Converted:
    """`convert_hf_to_gguf.py MODEL_DIR --outfile OUT --outtype T [--target-model-dir TARGET]`,
    reused while OUT is newer than the model's config and weights."""
    command = [sys.executable, str(tools.source / "convert_hf_to_gguf.py"), str(model_dir), "--outfile", str(out), "--outtype", outtype]
    command += ["--target-model-dir", str(target_dir)] if target_dir is not None else []
    inputs = [p for p in model_dir.iterdir() if p.suffix in (".json", ".safetensors")]
    if out.is_file() and all(out.stat().st_mtime > p.stat().st_mtime for p in inputs):
        return Converted(gguf=out, command=command)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(command, capture_output=True, text=True, env=converter_env(tools))
    if result.returncode != 0:
        out.unlink(missing_ok=True)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        return Converted(gguf=None, command=command, error=lines[-1] if lines else f"exit {result.returncode}")
    return Converted(gguf=out, command=command)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The server's per-step lines: every generation step of a slot computes its draft budget (a DEBUG
# line), and with LLAMA_TRACE=1 every verified draft logs what it accepted
# (tools/server/server-context.cpp, `get_n_draft_max` and the `accepted %2zu/%2zu draft tokens` line).
STEP_LINE = re.compile(r"task (\d+) \| max possible draft: (-?\d+)")
ACCEPT_LINE = re.compile(r"task (\d+) \| accepted +(\d+)/ *(\d+) draft tokens")
SPEC_FAILED = "failed to initialize speculative decoding context"  # tools/server/server-context.cpp, load_model


@dataclass(kw_only=True)
class Completion:
    tokens: list[int]
    steps: list[tuple[int, int]] = field(default_factory=list)  # per generation step: (drafts verified, accepted); (0, 0) = no draft
    draft_n: int = 0  # the response's timings: draft tokens verified
    draft_n_accepted: int = 0


class Server:
    """`llama-server -m TARGET [-md DRAFTER --spec-type T --spec-draft-n-max N --spec-draft-p-min P]`
    on a free local port, one request at a time, with its log in LOG."""

    def __init__(self, tools: Tools, target: Path, *, log_path: Path, drafter: Path | None = None, spec_type: str | None = None,
                 n_max: int = 0, p_min: float = 0.0, threads: int = 1, ctx: int = 2048):  # fmt: skip
        self.port = _free_port()
        self.command = [str(tools.bin / "llama-server"), "-m", str(target), "--host", "127.0.0.1", "--port", str(self.port),
                        "-t", str(threads), "-c", str(ctx), "-np", "1", "--no-webui", "-lv", "5", "--no-cache-prompt"]  # fmt: skip
        if drafter is not None:
            self.command += ["-md", str(drafter), "--spec-type", spec_type, "--spec-draft-n-max", str(n_max),
                             "--spec-draft-p-min", f"{p_min:g}", "-td", str(threads)]  # fmt: skip
        self.log_path = log_path
        self.process = None

    def __enter__(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_file = open(self.log_path, "w")
        env = dict(os.environ, LLAMA_TRACE="1")
        self.process = subprocess.Popen(self.command, stdout=self.log_file, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 600  # a cap against a hang, not a speed bound: loading takes seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ValueError(f"llama-server exited {self.process.returncode}: {self.last_error()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        else:
            raise ValueError(f"llama-server not ready after 600 s (log: {self.log_path})")
        # A drafter llama-server cannot draft with (a positive --spec-draft-p-min on a DSpark drafter
        # without a confidence head) is an error line, and the server then serves the target alone.
        self.log_file.flush()
        dropped = [line for line in self.log_path.read_text(errors="replace").splitlines() if SPEC_FAILED in line]
        if "-md" in self.command and dropped:
            raise ValueError(f"llama-server serves without the drafter: {dropped[-1].split(SPEC_FAILED, 1)[1].lstrip(': ')}")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log_file.close()

    def last_error(self) -> str:
        self.log_file.flush()
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if re.search(r"error|failed|exception|what\(\)", line, re.IGNORECASE)]
        return (errors or lines or ["no output"])[-1].strip()

    def complete(self, prompt_ids: list[int], *, n_predict: int) -> Completion:
        """Greedy completion of PROMPT_IDS (token ids in, token ids out) and its steps from the log."""
        body = {"prompt": prompt_ids, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                "return_tokens": True, "stream": False, "samplers": ["top_k"]}  # fmt: skip
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        offset = self.log_path.stat().st_size
        with urllib.request.urlopen(request, timeout=3600) as response:
            reply = json.loads(response.read())
        timings = reply.get("timings", {})
        return Completion(tokens=list(reply["tokens"]), steps=self._steps(offset), draft_n=timings.get("draft_n", 0),
                          draft_n_accepted=timings.get("draft_n_accepted", 0))  # fmt: skip

    def _steps(self, offset: int) -> list[tuple[int, int]]:
        """The generation steps of the request whose log starts at OFFSET, in order: (verified,
        accepted) after each draft-budget line, (0, 0) where no draft was verified (an empty draft: a
        plain decode step). The server logs from its own thread, so this waits for the request's
        `stop processing` line."""
        deadline = time.monotonic() + 60  # a cap against a lost line, not a speed bound
        while True:
            self.log_file.flush()
            with open(self.log_path, errors="replace") as f:
                f.seek(offset)
                lines = f.read().splitlines()
            if any("stop processing" in line for line in lines):
                break
            if time.monotonic() > deadline:
                raise ValueError(f"llama-server logged no end of the request after 60 s (log: {self.log_path})")
            time.sleep(0.05)
        task = None
        steps: list[list[int]] = []
        for line in lines:
            if (m := STEP_LINE.search(line)) is not None:
                task = task or m.group(1)  # one request at a time: the first step line names its task
                if m.group(1) == task:
                    steps.append([0, 0])
            elif (m := ACCEPT_LINE.search(line)) is not None and m.group(1) == task and steps:
                steps[-1] = [int(m.group(3)), int(m.group(2))]
        return [(verified, accepted) for verified, accepted in steps]
