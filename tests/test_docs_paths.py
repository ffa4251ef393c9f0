"""Every file path the docs cite (``tests/…py``, ``scripts/…py``, ``tokenbal/…py``, ``docs/…md`` …) exists,
and every dotted name (```tokenbal.io.remote.RetryingFile```) imports: files and classes move, and a doc
pointing at the old place sends a reader nowhere."""

from __future__ import annotations

import importlib
import re
import warnings

import pytest

from tests.helpers.paths import REPO

DOCS = [REPO / "README.md", REPO / "ARCHITECTURE.md", REPO / "tests" / "README.md",
        *sorted((REPO / "docs").rglob("*.md"))]
PATH = re.compile(r"(?<![\w/.-])((?:tests|scripts|tokenbal|collate|examples|docs)/[\w/.-]*"
                  r"\.(?:py|md|json|toml))")


def cited() -> list[tuple[str, str]]:
    return sorted({(doc.relative_to(REPO).as_posix(), m)
                   for doc in DOCS for m in PATH.findall(doc.read_text())})


def test_the_docs_cite_paths():
    assert len(cited()) >= 40   # the pattern keeps matching the docs' spelling


@pytest.mark.parametrize("doc,path", cited())
def test_cited_path_exists(doc, path):
    # Relative to the repository, or to the citing document's folder (tests/README.md says
    # `tokenbal/balance/plan.py` for the module under test).
    here = (REPO / doc).parent
    assert (REPO / path).exists() or (here / path).exists() or (REPO / "tests" / path).exists(), \
        f"{doc} cites {path}, which does not exist"


# `tokenbal.x.y` / `collate.x.Y` in backticks. docs/bench/ is a log of past measurements: where it names a
# module's earlier home ("earlier in `tokenbal.data.tar`"), that name is history, not a pointer.
DOTTED = re.compile(r"`((?:tokenbal|collate)(?:\.\w+)+)`")


def cited_names() -> list[tuple[str, str]]:
    return sorted({(doc.relative_to(REPO).as_posix(), m) for doc in DOCS if "bench" not in doc.parts
                   for m in DOTTED.findall(doc.read_text())})


def resolves(dotted: str) -> bool:
    """The longest importable module prefix of ``dotted``, then attributes for the rest."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            with warnings.catch_warnings():   # a deprecated old path the docs name as such still resolves
                warnings.simplefilter("ignore", DeprecationWarning)
                obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for name in parts[k:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_the_docs_cite_names():
    assert len(cited_names()) >= 40


@pytest.mark.parametrize("doc,name", cited_names())
def test_cited_name_resolves(doc, name):
    assert resolves(name), f"{doc} cites `{name}`, which does not import"
