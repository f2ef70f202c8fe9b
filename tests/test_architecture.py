"""The product's packages import each other without a circle: each module can be read, tested
and moved knowing only what it imports. Imports inside functions count too: they are how a
circle hides."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "client_app", "server_app", "experiments")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def project_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules ``path`` imports anywhere in its body (``from a import b`` counts as
    ``a.b`` when that is a module, else as ``a``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in modules else node.module)
    return found & modules


def import_graph() -> dict[str, set[str]]:
    paths = [path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))]
    modules = {module_name(path) for path in paths}
    return {module_name(path): project_imports(path, modules) - {module_name(path)} for path in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the modules around it, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == "open":
                return stack[stack.index(imported):] + [imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_the_graph_sees_the_modules_and_their_imports():
    graph = import_graph()
    assert "common.config" in graph["common.training"]
    assert "common.drift" in graph["common.config"]


def test_a_circle_is_found_where_there_is_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_in_the_product():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


METHOD_PACKAGES = frozenset(path.parent.name for path in (ROOT / "common" / "methods").glob("*/__init__.py"))


def family(module: str) -> str | None:
    """The method package a module belongs to (``common.methods.fedpac.server`` and the package
    ``common.methods.fedpac`` itself -> ``fedpac``); None for a shared or harness module."""
    parts = module.split(".")
    return parts[2] if len(parts) >= 3 and parts[:2] == ["common", "methods"] and parts[2] in METHOD_PACKAGES else None


def single_method_modules(graph: dict[str, set[str]]) -> dict[str, str]:
    """The modules of ``common/`` (outside the method packages) that one method alone uses, each
    with that method: imported only by that method's package, or by modules it alone uses."""
    shared = [module for module in graph if module.startswith("common.") and not module.startswith("common.methods")]
    owner: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for module in (m for m in shared if m not in owner):
            families = {owner.get(importer) or family(importer)
                        for importer, imported in graph.items() if module in imported}
            if len(families) == 1 and None not in families:
                owner[module] = families.pop() or ""
                changed = True
    return owner


def test_common_holds_only_what_several_methods_or_the_harness_share():
    """A module of ``common/`` that only one method uses is that method's math: it belongs in
    the method's package, where a reader finds the method whole."""
    single = single_method_modules(import_graph())
    assert not single, f"modules of common/ only one method uses: {single}"


def test_a_module_only_one_method_uses_is_found():
    assert family("common.methods.fedpac.server") == family("common.methods.fedpac") == "fedpac"
    assert family("common.methods.base") is None
    assert family("common.statistics") is None
    graph = {
        "common.methods.fedpac": {"common.qp"},  # a package's __init__ counts as the method
        "common.qp": {"common.solver"},  # used only through a module one method alone uses
        "common.solver": set(),
        "common.methods.fedccfa.client": {"common.sums"},
        "common.methods.fedpac.client": {"common.sums"},  # two methods: shared
        "common.sums": set(),
        "server_app.app": {"common.config"},  # the harness: shared
        "common.config": set(),
    }
    assert single_method_modules(graph) == {"common.qp": "fedpac", "common.solver": "fedpac"}
