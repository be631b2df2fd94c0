"""What the code imports is declared (pyproject.toml) with a lower bound that the tested install
meets, and a store client older than that bound is refused in one line naming it
(docs/failure-modes.md, "Installs")."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from storage.location import MIN_CLIENT_VERSIONS, _version_tuple
from tests.waits import run_to_end

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LOCAL = {"pipeline", "storage", "ray_jobs", "drafter", "tests", "benchmarks"}
# Imported from a checkout named at run time, not installed: DeepSpec's reference code
# (benchmarks/checks/deepspec_check.py puts $ALRIRA_DEEPSPEC on sys.path; it is no package on the index).
CHECKOUTS = {"deepspec"}
# The peer trainers benchmarks/speed/peer_step.py compares against, each installed with --no-deps into its
# own virtualenv (--make-peer-venvs), never beside alrira: their dependencies would replace torch.
PEER_VENVS = {"specforge", "speculators"}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _declared(*extras: str) -> dict[str, str]:
    """{distribution name: requirement} of the dependencies and the given extras."""
    project = PYPROJECT["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    return {_name(r): r for r in requirements}


def _imports(folder: Path) -> dict[str, str]:
    """{top-level module: a file importing it} of every absolute import under `folder`, local ones left out."""
    local = LOCAL | {p.stem for d in LOCAL for p in (ROOT / d).rglob("*.py")}  # a script's sibling, put on sys.path
    found = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local | CHECKOUTS | PEER_VENVS and top != "__future__":
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def _distributions(module: str) -> set[str]:
    names = metadata.packages_distributions().get(module) or [module]
    return {n.lower().replace("_", "-") for n in names}


@pytest.mark.parametrize(
    ("folders", "extras"),
    [
        (("pipeline", "storage", "ray_jobs", "drafter"), ("plot", "vllm", "vllm-cpu", "real")),
        (("tests", "benchmarks"), ("test", "plot", "vllm", "vllm-cpu", "real")),
    ],
)
def test_every_import_is_declared(folders, extras):
    """Pillow was imported by pipeline/vision.py and four test modules and declared nowhere: an
    install that did not happen to bring it stopped at collection (No module named 'PIL')."""
    declared = _declared(*extras)
    undeclared = []
    for folder in folders:
        for module, where in _imports(ROOT / folder).items():
            if not _distributions(module) & set(declared):
                undeclared.append(f"{module} ({where})")
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def test_every_dependency_has_a_lower_bound_the_install_meets():
    """No unbounded dependency (a resolver with boto3 pinned fell back to s3fs 0.4.2), and every
    bound is one the tested install satisfies."""
    for name, requirement in _declared("test", "plot").items():
        assert ">=" in requirement, f"{requirement}: no lower bound"
        minimum = re.search(r">=\s*([0-9][0-9.]*)", requirement).group(1)
        installed = metadata.version(name)
        assert _version_tuple(installed) >= _version_tuple(minimum), f"{requirement}: installed {installed} is below it"


def test_store_client_bounds_match_pyproject():
    declared = _declared()
    for package, minimum in MIN_CLIENT_VERSIONS.items():
        assert declared[package] == f"{package}>={minimum}"


def test_version_tuple_orders_calendar_and_old_versions():
    assert _version_tuple("0.4.2") < _version_tuple("2026.9.0") <= _version_tuple("2026.9.0.post1") < _version_tuple("2026.10.0")
    assert _version_tuple("2026.9.0rc1") == (2026, 9, 0)


def _dist_info(site: Path, package: str, version: str) -> None:
    info = site / f"{package}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")


def test_too_old_s3fs_is_one_line_naming_it(tmp_path):
    """The s3fs found first on the path is 0.4.2 (its metadata, first on sys.path, as an environment
    with boto3 pinned resolves it): opening an s3:// location stops in one line naming the package,
    the version found and the one needed, before the client is imported."""
    site = tmp_path / "site"
    _dist_info(site, "s3fs", "0.4.2")
    (site / "s3fs").mkdir()
    (site / "s3fs" / "__init__.py").write_text("raise ImportError('the old client must not be imported')\n")
    code = (
        "from storage.location import resolve\n"
        "try:\n    resolve('s3://bucket/cache')\nexcept ValueError as error:\n    print(error)\n"
    )
    done = run_to_end([sys.executable, "-c", code], cwd=ROOT, env={"PYTHONPATH": f"{site}:{ROOT}", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert "\n" not in line
    assert line == (
        f"s3://bucket/cache: needs s3fs >= {MIN_CLIENT_VERSIONS['s3fs']} (the oldest release tested), found s3fs 0.4.2; "
        f"pip install -U 's3fs>={MIN_CLIENT_VERSIONS['s3fs']}'"
    )
