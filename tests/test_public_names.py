"""Every dotted public name the README documents (``tokenbal.x.y`` / ``collate.x.y`` in its text,
and its ``from ... import ...`` lines) imports where it is documented: files move, names stay."""

from __future__ import annotations

import importlib
import re

import pytest

from tests.helpers.paths import REPO

README = (REPO / "README.md").read_text()
DOTTED = sorted(set(re.findall(r"(?<![\w/.-])((?:tokenbal|collate)(?:\.[A-Za-z_]\w*)+)", README)))
FROM_IMPORTS = sorted(set(re.findall(r"^from ((?:tokenbal|collate)[\w.]*) import ([\w, ]+)$", README, re.M)))


def resolve(name: str) -> object:
    """The object ``name`` names: the longest importable module prefix, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_the_readme_documents_names():
    # The pattern must keep seeing the README's names (a reworded README must not empty the test).
    assert len(DOTTED) >= 30 and len(FROM_IMPORTS) >= 4


@pytest.mark.parametrize("name", DOTTED)
def test_documented_name_imports(name):
    assert resolve(name) is not None


@pytest.mark.parametrize("module,names", FROM_IMPORTS)
def test_documented_import_line_works(module, names):
    mod = importlib.import_module(module)
    for name in (n.strip() for n in names.split(",")):
        assert hasattr(mod, name), f"from {module} import {name}"
