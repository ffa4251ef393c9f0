"""The package layout's rules (ARCHITECTURE.md), checked on the source with ``ast``, nothing imported:

- no import circle among ``tokenbal`` / ``collate`` modules: neither through module-level imports
  (which would fail or half-initialise a module on import) nor through imports inside functions
  (lazy on purpose, but a circle there is still two files that each need the other, e.g. a
  dispatcher and a backend importing each other), nor through ``importlib.import_module("...")``
  with a literal name or a lazy front's ``_LAZY = {name: "module"}`` table (an import all the same).
  ``if TYPE_CHECKING:`` imports never run and are left out; so are a package's implicit imports of
  its parents, so a package front that re-exports its children is not a circle with them;
- the project's own code (``tokenbal``, ``collate``, ``scripts``, ``examples``, ``tests``) imports
  no deprecated or removed old path (``DEPRECATED_PATHS``, ``REMOVED_PATHS``); only the test of
  those paths does. ``tokenbal.partition`` (the contract's path) is imported by tests only;
- the layers of ``FORBIDDEN`` hold, lazy imports included: ``tokenbal/io`` (tar headers, byte ranges,
  remote reads) imports nothing else of ours, and ``tokenbal/index`` never imports the readers
  (``tokenbal/data``) or the balancing, so index/ and data/ meet only in io/ (and data/ reading a
  ``TokenIndex``);
- a module ``__getattr__`` only in a package front (lazy re-exports of its children's names), or
  where ``MODULE_GETATTR`` says why;
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
    # TokenBalancedTrainer(packed=True) wires both layers (DESIGN.md's exception): the packed
    # collator and enable_packed, imported when packed=True is asked for
    ("tokenbal.integrations.hf", "collate"),
    ("tokenbal.integrations.hf", "collate.models"),
    # torchtitan's packed alternative to its padding collator: imported when packed_collate() is called
    ("tokenbal.integrations.torchtitan", "collate"),
    # LLaMA-Factory's packed rows (tokenbal: {packed: true}): imported when packed rows are asked for
    ("tokenbal.integrations.llamafactory", "collate"),
}

# Old module paths kept for users: each warns (DeprecationWarning, with its removal version) and the
# project's own code never imports them. tokenbal.partition is not here: it is the public contract's
# path (DESIGN.md), kept without a warning, and the project's code imports tokenbal.balance.partition.
DEPRECATED_PATHS = {"tokenbal.cost", "tokenbal.plan", "tokenbal.sampler", "tokenbal.wds"}
# Old paths that are gone; nothing may import them again.
REMOVED_PATHS = {"tokenbal.index.tarwalk", "collate.ops.rope_cpu", "collate.ops.rope_npu",
                 "collate.ops.rope_reference", "collate.ops.rope_triton", "collate.ops.attention_flash",
                 "collate.ops.attention_npu", "collate.ops.attention_sdpa"}
# Modules other than package fronts that define a module-level __getattr__, and why.
MODULE_GETATTR = {
    # builds TokenBalancedTrainer (a transformers.Trainer subclass) on first access, so importing the
    # module does not import transformers
    "tokenbal.integrations.hf",
    # builds TokenBalancedSeq2SeqTrainer (a subclass of ms-swift's trainer) when ms-swift's trainer
    # mapping asks for it, so importing the module does not import ms-swift
    "tokenbal.integrations.swift",
}
# The test that checks the old paths themselves (it imports them on purpose).
OLD_PATH_TEST = "tests/tokenbal/balance/test_layout.py"

# Layers: a module under the key may not import (lazily either) a module under any of the listed
# prefixes. tokenbal.io is the bottom: "everything of ours but tokenbal.io" is spelled by `"*"`.
FORBIDDEN = {
    "tokenbal.io": ("*",),   # but the BOTTOM helpers
    "tokenbal.index": ("tokenbal.data", "tokenbal.balance", "tokenbal.integrations", "collate"),
    "tokenbal.estimate": ("tokenbal.index", "tokenbal.data", "tokenbal.balance", "tokenbal.io", "collate"),
}

# Helpers below every layer: they import nothing of ours, so any module may use them.
BOTTOM = {"tokenbal._extras"}

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


def _is_import_module(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and (
        isinstance(node.args[0].value, str)) and (
        (isinstance(node.func, ast.Name) and node.func.id == "import_module")
        or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"))


def _dynamic_imports(tree: ast.Module) -> set[str]:
    """Module names imported by string: ``import_module("a.b")`` anywhere outside ``if
    TYPE_CHECKING:``, and the values of a module-level ``_LAZY = {...}`` table."""
    found = set()
    for node in _runtime_nodes(tree):
        if _is_import_module(node):
            found.add(node.args[0].value)
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)):
            found.update(v.value for v in node.value.values
                         if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node that can run, leaving out ``if TYPE_CHECKING:`` bodies."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield child
                yield from _runtime_nodes(child)
            continue
        yield node
        yield from _runtime_nodes(node)


def _trees() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text(), filename=str(path)) for name, path in MODULES.items()}


TREES = _trees()


def import_graph(lazy: bool = True) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (``lazy=False``: at module level only). Importing
    ``a.b.c`` also runs ``a`` and ``a.b``'s ``__init__``; those implicit parent edges are left out,
    so a package front that re-exports its children is not a circle with them, and so are a
    function's imports of an ancestor package (loaded before the module itself)."""
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, tree in TREES.items():
        eager = {id(node) for node in _module_level(tree.body)}
        for node in (_runtime(tree) if lazy else _module_level(tree.body)):
            for target, _ in _targets(name, node):
                # An import of an own ancestor package inside a function (``from tokenbal import
                # __version__``) finds it fully loaded, as importing ``name`` ran it first: no edge.
                if target != name and not (id(node) not in eager and name.startswith(target + ".")):
                    graph[name].add(target)
        if lazy:
            graph[name].update(t for t in _dynamic_imports(tree) if t in MODULES and t != name)
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
    assert "tokenbal.io.tar" in eager["tokenbal.index.scan"]
    assert "collate.ops.attention.segments" in eager["collate.ops.attention.npu"]
    # the dispatcher imports its backends inside functions: an edge only counting lazy imports
    assert "collate.ops.attention.npu" not in eager["collate.ops.attention.dispatch"]
    assert "collate.ops.attention.npu" in every["collate.ops.attention.dispatch"]
    # `if TYPE_CHECKING:` imports never run
    assert "tokenbal.index" not in eager["tokenbal"]
    # imports by string: a lazy front's table, import_module("...") with a literal name
    assert "tokenbal.index" in every["tokenbal"] and "tokenbal.data.stream" in every["tokenbal.data"]
    tree = ast.parse("import importlib\nif TYPE_CHECKING:\n    importlib.import_module('a.x')\n"
                     "def f():\n    return importlib.import_module('a.b')\n_LAZY = {'n': 'a.c'}\n")
    assert _dynamic_imports(tree) == {"a.b", "a.c"}


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


def _project_files() -> dict[str, Path]:
    found = {}
    for folder in (*PACKAGES, "scripts", "examples", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found[path.relative_to(ROOT).as_posix()] = path
    return found


def _imported_names(tree: ast.Module) -> set[str]:
    """Every module path a file names in an import (``from a.b import c`` names ``a.b`` and
    ``a.b.c``), lazily or by ``import_module("...")``, ``TYPE_CHECKING`` blocks included."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif _is_import_module(node):
            names.add(node.args[0].value)
    return names


def test_no_old_path_is_imported_by_the_projects_own_code():
    bad = []
    for rel, path in _project_files().items():
        if rel == OLD_PATH_TEST:
            continue
        names = _imported_names(ast.parse(path.read_text(), filename=rel))
        # tests may import the contract's path (to test it), and the package front names it (so that
        # ``tokenbal.partition`` is that module whatever the import order); the code imports the
        # canonical one
        names_it = rel.startswith("tests/") or rel == "tokenbal/__init__.py"
        contract = set() if names_it else {"tokenbal.partition"}
        old = sorted(n for n in names if n in DEPRECATED_PATHS | REMOVED_PATHS | contract)
        if old:
            bad.append(f"{rel} imports {', '.join(old)}")
    assert not bad, "use the canonical paths (tokenbal.balance.*, tokenbal.data.*, collate.ops.<op>.*): " + (
        "; ".join(bad))


def test_deprecated_paths_exist_and_removed_ones_are_gone():
    assert DEPRECATED_PATHS <= set(MODULES) and "tokenbal.partition" in MODULES
    assert not REMOVED_PATHS & set(MODULES)
    for name in DEPRECATED_PATHS:
        assert "DeprecationWarning" in MODULES[name].read_text() and "0.3.0" in MODULES[name].read_text()


def test_module_getattr_only_in_package_fronts():
    bad = []
    for name, tree in TREES.items():
        defines = any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body)
        if defines and not _is_package(name) and name not in MODULE_GETATTR:
            bad.append(name)
    assert not bad, f"module __getattr__ outside a package front (say why in MODULE_GETATTR): {bad}"


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_bottom_helpers_import_nothing_of_ours():
    graph = import_graph()
    assert all(not graph[name] for name in BOTTOM), {name: graph[name] for name in BOTTOM}


def test_layers_never_import_upwards():
    bad = []
    for name, targets in import_graph().items():
        for layer, forbidden in FORBIDDEN.items():
            if not _under(name, layer):
                continue
            for target in targets:
                outside = "*" in forbidden and not _under(target, layer) and target not in BOTTOM
                if outside or any(_under(target, f) for f in forbidden):
                    bad.append(f"{name} imports {target}")
    assert not bad, "imports across the layers (see FORBIDDEN): " + "; ".join(sorted(bad))
