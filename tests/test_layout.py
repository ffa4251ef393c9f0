"""The package layout's rules (ARCHITECTURE.md), checked on the source with ``ast``, nothing imported:

- no import circle among ``tokenbal`` / ``collate`` modules: neither through module-level imports
  (which would fail or half-initialise a module on import) nor through imports inside functions
  (lazy on purpose, but a circle there is still two files that each need the other, e.g. a
  dispatcher and a backend importing each other). ``if TYPE_CHECKING:`` imports never run and are
  left out; so are a package's implicit imports of its parents, so a package front that re-exports
  its children is not a circle with them;
- no module imports a private (``_name``) symbol from a sibling family file in ``collate/models/``
  or a sibling backend in ``collate/ops/`` (shared pieces live in a shared file, with public names);
- ``tokenbal`` never imports ``collate`` (at module level or lazily), except the ``tokenbal demo``
  command, which runs collate's demo on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tokenbal", "collate")

# Known circles, each an explicit set of modules; empty, and a new entry needs a reason beside it.
ALLOWED_CYCLES: set[frozenset[str]] = set()

# (module, imported module) pairs allowed to cross from tokenbal into collate.
ALLOWED_TOKENBAL_TO_COLLATE = {
    ("tokenbal.cli", "collate.demo"),  # `tokenbal demo` drives the whole path; imported when run
}

# Folders whose files are siblings that must not share private names.
SIBLING_FOLDERS = ("collate/models", "collate/ops", "collate/ops/rope", "collate/ops/attention")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level(body: list[ast.stmt]):
    """Import statements that run on import: the module body and its if / try / with blocks,
    not function or class bodies, not ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _module_level(block)
        elif isinstance(node, ast.With):
            yield from _module_level(node.body)


def _runtime(tree: ast.AST):
    """Every import statement that can run: module level and inside functions, not ``if
    TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _runtime(ast.Module(body=[child], type_ignores=[]))
        else:
            yield from _runtime(node)


def _all_imports(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def _base(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module if _is_package(module) else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[tuple[str, str | None]]:
    """(imported module of ours, imported name or None) for one import statement."""
    out = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in MODULES:
                out.append((alias.name, None))
        return out
    base = _base(module, node)
    for alias in node.names:
        child = f"{base}.{alias.name}"
        if child in MODULES:
            out.append((child, None))          # `from pkg import submodule`
        elif base in MODULES:
            out.append((base, alias.name))
    return out


def _trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text(), filename=str(path)) for name, path in MODULES.items()}


TREES = _trees()


def import_graph(lazy: bool = True) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (``lazy=False``: at module level only). Importing
    ``a.b.c`` also runs ``a`` and ``a.b``'s ``__init__``; those implicit parent edges are left out,
    so a package front that re-exports its children is not a circle with them."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, tree in TREES.items():
        for node in (_runtime(tree) if lazy else _module_level(tree.body)):
            for target, _ in _targets(name, node):
                if target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)
    return found


def test_the_checker_sees_a_circle_and_a_clean_graph():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_the_graph_sees_known_edges():
    eager, every = import_graph(lazy=False), import_graph()
    assert "tokenbal.data.tar" in eager["tokenbal.index.scan"]
    assert "collate.ops.attention.segments" in eager["collate.ops.attention.npu"]
    # the dispatcher imports its backends inside functions: an edge only counting lazy imports
    assert "collate.ops.attention.npu" not in eager["collate.ops.attention.dispatch"]
    assert "collate.ops.attention.npu" in every["collate.ops.attention.dispatch"]
    # `if TYPE_CHECKING:` imports never run
    assert "tokenbal.index" not in every["tokenbal"]


def test_no_import_circles_at_module_level():
    found = cycles(import_graph(lazy=False))
    assert not found, "import circles among module-level imports: " + "; ".join(
        " <-> ".join(sorted(c)) for c in found)


def test_no_import_circles_counting_lazy_imports():
    found = [c for c in cycles(import_graph()) if frozenset(c) not in ALLOWED_CYCLES]
    assert not found, "import circles (lazy imports included): " + "; ".join(
        " <-> ".join(sorted(c)) for c in found)


def test_allowed_cycles_are_still_real():
    # An allow-list entry that no longer matches a circle must go (the circle was fixed).
    real = {frozenset(c) for c in cycles(import_graph())}
    stale = [sorted(c) for c in ALLOWED_CYCLES if c <= set(MODULES) and c not in real]
    assert not stale, f"remove these ALLOWED_CYCLES entries, the circles are gone: {stale}"


def _sibling_folder(name: str) -> str | None:
    folder = MODULES[name].parent.relative_to(ROOT).as_posix()
    return folder if folder in SIBLING_FOLDERS else None


def test_no_private_names_from_sibling_families_or_backends():
    bad = []
    for name, tree in TREES.items():
        folder = _sibling_folder(name)
        if folder is None:
            continue
        for node in _all_imports(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            for target, symbol in _targets(name, node):
                if symbol is None or not symbol.startswith("_") or symbol.startswith("__"):
                    continue
                if target != name and not _is_package(target) and _sibling_folder(target) == folder:
                    bad.append(f"{name} imports {symbol} from {target}")
    assert not bad, "private names across sibling files: " + "; ".join(bad)


def test_tokenbal_never_imports_collate():
    bad = []
    for name, tree in TREES.items():
        if not name.startswith("tokenbal"):
            continue
        for node in _all_imports(tree):
            targets = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [_base(name, node)])
            for target in targets:
                if target.split(".")[0] == "collate" and (name, target) not in ALLOWED_TOKENBAL_TO_COLLATE:
                    bad.append(f"{name} imports {target}")
    assert not bad, "tokenbal must not import collate: " + "; ".join(bad)
