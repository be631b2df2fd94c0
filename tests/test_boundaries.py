"""Import boundaries keep the dependency arrows one way (STYLE 11)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imported_modules(package: str) -> set[str]:
    """Top-level names imported anywhere in a package's source (static, including lazy imports)."""
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
    return names


def _roots(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names}


def test_storage_imports_no_model_code_ray_or_transformers():
    assert not _roots(_imported_modules("storage")) & {"transformers", "ray", "drafter", "pipeline", "ray_jobs"}


def test_drafter_imports_neither_ray_nor_storage_nor_pipeline():
    assert not _roots(_imported_modules("drafter")) & {"ray", "storage", "pipeline", "ray_jobs", "transformers"}


def test_only_the_cli_imports_ray_jobs():
    offenders = []
    for path in (ROOT / "pipeline").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [module or ""]
            if any(n.split(".")[0] == "ray_jobs" for n in names) and path.name != "cli.py":
                offenders.append(path.name)
    assert offenders == []


def test_ray_jobs_imports_no_drafter_model():
    assert "drafter" not in _roots(_imported_modules("ray_jobs"))


@pytest.mark.parametrize(
    "module, forbidden",
    [
        ("drafter", {"ray", "storage", "transformers"}),
        ("storage", {"ray", "transformers"}),
        ("pipeline.train", {"ray", "transformers"}),  # the trainer never loads the target
    ],
)
def test_runtime_imports(module, forbidden):
    code = f"import sys, {module}; print(sorted(set({sorted(forbidden)!r}) & set(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
