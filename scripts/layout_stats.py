"""Layout numbers of a checkout, for ARCHITECTURE.md's before/after line: files and lines of
``tokenbal`` / ``collate``, import arrows (module-level; with lazy and string imports), import
circles among modules and among folders, and the arrows between ``tokenbal/index`` and
``tokenbal/data``. The import graph is ``tests/test_layout.py``'s, from *this* checkout, so two
trees are measured with the same rules:

    python scripts/layout_stats.py                 # this checkout
    python scripts/layout_stats.py /path/to/other  # another tree, the same graph code
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def load_layout(root: Path) -> types.ModuleType:
    src = (HERE / "tests" / "test_layout.py").read_text()
    src = src.replace("ROOT = Path(__file__).resolve().parents[1]", f"ROOT = Path({str(root)!r})")
    module = types.ModuleType("layout_rules")
    exec(compile(src, str(HERE / "tests" / "test_layout.py"), "exec"), module.__dict__)
    return module


def folder(layout: types.ModuleType, name: str) -> str:
    """``tokenbal.index.scan`` -> ``tokenbal.index``; a top-level module stands for itself."""
    parts = name.split(".")
    if len(parts) >= 2 and (layout.ROOT / parts[0] / parts[1]).is_dir():
        return ".".join(parts[:2])
    return name if len(parts) > 1 else f"{name}.__init__"


def main(argv: list[str]) -> None:
    root = Path(argv[0]).resolve() if argv else HERE
    layout = load_layout(root)
    eager, every = layout.import_graph(lazy=False), layout.import_graph()
    folders: dict[str, set[str]] = {}
    for a, targets in every.items():
        for b in targets:
            fa, fb = folder(layout, a), folder(layout, b)
            folders.setdefault(fa, set())
            folders.setdefault(fb, set())
            # the one allowed exception: `tokenbal demo` runs collate's demo
            if fa != fb and (a, b) not in layout.ALLOWED_TOKENBAL_TO_COLLATE:
                folders[fa].add(fb)

    def arrows(src: str, dst: str) -> int:
        return sum(1 for a, ts in every.items() for b in ts
                   if folder(layout, a) == src and folder(layout, b) == dst)

    lines = sum(len(p.read_text().splitlines()) for p in layout.MODULES.values())
    print(f"{root}: {len(layout.MODULES)} files, {lines} lines")
    print(f"import arrows: {sum(map(len, eager.values()))} module-level, {sum(map(len, every.values()))} "
          "with lazy and string imports")
    print(f"module circles: {len(layout.cycles(eager))} module-level, {len(layout.cycles(every))} with lazy: "
          f"{[sorted(c) for c in layout.cycles(every)]}")
    print(f"folder circles: {[sorted(c) for c in layout.cycles(folders)]}")
    print(f"arrows index -> data: {arrows('tokenbal.index', 'tokenbal.data')}, "
          f"data -> index: {arrows('tokenbal.data', 'tokenbal.index')}")


if __name__ == "__main__":
    main(sys.argv[1:])
