"""Where a corpus is, for both stages that read one (`alrira-cache build` and `regenerate`): a local
file or folder, or the same on an object store (any URL --out takes: docs/design.md, "Caches on
object stores"), so that every output of one stage is an input of the next wherever it is stored.

A store corpus is read through a node-local copy (storage.location.StorePrefix.local_copy: one
listing, every key checked before it becomes a local path, a copy reused only when it holds exactly
the listed objects). A regenerated corpus folder's copy must hold every part its manifest names with
the manifest's checksum, and nothing the manifest does not list. Each node makes its own copy and
hashes it (file_sha256); the Ray workers compare that hash with the driver's (ray_jobs/regenerate.py
corpus_problem), as they do for the target.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

from pipeline.chat import REGENERATED_MANIFEST, REGENERATED_PROVENANCE, checked_regenerated_parts, regenerated_manifest
from storage.location import COPY_LISTING_FILE, is_url, remove_path_tolerant, resolve

# Files beside a corpus's content that are not part of it: a store copy's own listing and a
# regenerated corpus's provenance record (neither is hashed nor listed in its manifest).
CORPUS_RECORDS = frozenset({COPY_LISTING_FILE, REGENERATED_PROVENANCE})
_CHECKED_COPIES: set[Path] = set()  # node-local copies of regenerated corpora whose parts this process verified
_PINS_MADE: set[Path] = set()  # this process's own hard links to node-local copies (pinned_local_corpus)


def local_corpus(where: str | os.PathLike) -> Path:
    """A local path holding the corpus at `where`: `where` itself when it is a path, else this node's
    copy of the store object (a corpus file) or prefix (a regenerated folder, a save_to_disk
    directory). ValueError in one line naming the URL when nothing is there or a part's bytes are not
    the ones its manifest records."""
    if not is_url(where):
        return Path(where)
    url = str(where).rstrip("/")
    location = resolve(url)
    if location.is_local:
        return location.local_path
    if not location.exists():
        raise ValueError(f"{url}: corpus not found (no object or prefix there)")
    copy = location.local_copy()
    if location.is_file():
        return copy / url.rsplit("/", 1)[-1]
    if copy not in _CHECKED_COPIES:
        _check_regenerated_copy(copy, url=url)
        _CHECKED_COPIES.add(copy)
    return copy


def pinned_local_corpus(where: str | os.PathLike, *, attempts: int = 3) -> Path:
    """local_corpus for a process that reads the corpus part by part beside the other workers of its
    node (regeneration): its own hard links to the node's copy, which it alone removes
    (remove_pins). The node's copy belongs to the process that downloaded it, which removes it when
    it is released, while a sibling may still be reading."""
    if not is_url(where):
        return Path(where)
    for attempt in range(attempts):
        copy = local_corpus(where)
        root = copy.parent if copy.is_file() else copy
        pin = root.parent / f".pin-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            pin.mkdir(mode=0o700)
            _PINS_MADE.add(pin)
            for file in sorted(p for p in root.rglob("*") if p.is_file()):
                (pin / file.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
                os.link(file, pin / file.relative_to(root))
        except FileNotFoundError:  # the copy's owner removed it meanwhile: copy again
            if attempt == attempts - 1:
                raise
            continue
        return pin / copy.name if copy.is_file() else pin
    raise AssertionError("unreachable")


def remove_pins() -> list[Path]:
    """Remove this process's pinned_local_corpus links (never another's); returns them."""
    removed = sorted(_PINS_MADE)
    for pin in removed:
        remove_path_tolerant(pin)
    _PINS_MADE.clear()
    return removed


def _check_regenerated_copy(copy: Path, *, url: str) -> None:
    """A regenerated corpus's copy holds exactly its manifest and the parts it lists, each with the
    manifest's sha256 (a part rewritten on the store after the manifest fails here, not as rows
    silently different from the driver's). A folder that is not a regenerated corpus is left as is."""
    manifest = regenerated_manifest(copy)
    if manifest is None:
        return
    parts = checked_regenerated_parts(manifest, where=f"{url}/{REGENERATED_MANIFEST}")
    expected = {REGENERATED_MANIFEST, *CORPUS_RECORDS, *(part["name"] for part in parts)}
    extra = sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file() and p.relative_to(copy).as_posix() not in expected)
    if extra:
        raise ValueError(f"{url}/{extra[0]}: not listed in the regenerated corpus's manifest; remove it or point --corpus elsewhere")
    for part in parts:
        found = file_sha256(copy / part["name"]) if (copy / part["name"]).is_file() else None
        if found != part["sha256"]:
            state = "missing" if found is None else f"sha256 {found.removeprefix('sha256:')[:12]}, manifest {part['sha256'].removeprefix('sha256:')[:12]}"
            raise ValueError(f"{url}/{part['name']}: {state}; the part changed since its regeneration, rerun alrira-cache regenerate")


def file_sha256(path: str | os.PathLike) -> str:
    """"sha256:<hex>" of a file's bytes, or of a directory: every file under it in sorted
    relative-path order, each as its path and its own digest (a store copy's own listing file and
    a regenerated corpus's provenance record excluded). A URL: of this node's copy (local_corpus).
    Reads in 1 MiB chunks."""
    path = local_corpus(path)

    def digest(file: Path) -> bytes:
        h = hashlib.sha256()
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        return h.digest()

    if path.is_file():
        return "sha256:" + digest(path).hex()
    if path.is_dir():
        h = hashlib.sha256()
        files = sorted((p.relative_to(path).as_posix(), p) for p in path.rglob("*") if p.is_file())
        for relative, file in files:
            if relative in CORPUS_RECORDS:
                continue
            h.update(relative.encode() + b"\0")
            h.update(digest(file))
        return "sha256:" + h.hexdigest()
    raise ValueError(f"{path}: no such file or directory")


def default_image_root(corpus: str | os.PathLike) -> Path:
    """What relative image paths resolve against without --image-root: the corpus file's folder, a
    dataset's folder, or for a regenerated corpus the image root its regeneration used, recorded in
    its manifest (its rows keep their input's relative paths; docs/design.md, "Regeneration"). A
    store corpus: its node-local copy's folder (images are not copied: pass --image-root), or a
    regenerated corpus's recorded root."""
    corpus = local_corpus(corpus)
    if not corpus.is_dir():
        return corpus.parent
    provenance = (regenerated_manifest(corpus) or {}).get("provenance")
    recorded = provenance.get("image_root") if isinstance(provenance, dict) else None
    return Path(recorded) if isinstance(recorded, str) else corpus
