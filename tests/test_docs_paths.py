"""Every file path the docs cite (``tests/…py``, ``scripts/…py``, ``tokenbal/…py``, ``docs/…md`` …) exists:
files move, and a doc pointing at the old place sends a reader nowhere."""

from __future__ import annotations

import re

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
