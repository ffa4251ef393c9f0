"""An index folder whose manifest.json or errors.jsonl parses as JSON but lacks what the readers use
(written by another tool, edited by hand, a field renamed by an older tokenbal) is named as damaged by
every command (``IndexDamagedError`` naming the file and the field), never a KeyError traceback."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers.corpus import Sample, write_shard
from tokenbal.cli import main
from tokenbal.index import TokenIndex, build_index
from tokenbal.index.store import IndexDamagedError


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("dmg")
    shard = write_shard(root / "a.tar", [Sample(f"k{i}", caption="hello world " * i, images=[("jpg", 40, 30)])
                                         for i in range(4)])
    return build_index([shard], root / "idx", progress=False).out


def _edit(m: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for p in parents:
        m = m[int(p)] if isinstance(m, list) else m[p]
    if value is _DROP:
        del m[int(last) if isinstance(m, list) else last]
    elif isinstance(m, list):
        m[int(last)] = value
    else:
        m[last] = value


_DROP = object()
CASES = [("shards", _DROP, "no 'shards' field"),
         ("extensions", _DROP, "no 'extensions' field"),
         ("estimator", _DROP, "no 'estimator' field"),
         ("text_counter", _DROP, "no 'text_counter' field"),
         ("num_errors", _DROP, "no 'num_errors' field"),
         ("shards", {"a.tar": 1}, "'shards' is a dict, not a list"),
         ("shards.0.path", _DROP, "shards[0] has no 'path'"),
         ("shards.0", "a.tar", "shards[0] is a str, not an object"),
         ("extensions", ["jpg", 3], "extensions[1] is an int, not a string"),
         ("estimator.name", _DROP, "estimator has no 'name'"),
         ("num_samples", "4", "'num_samples' is a str, not an integer"),
         # stats: KeyError: 'status' / TypeError ('<' between str and None), tracebacks, exit 1
         ("shards.0.status", _DROP, "shards[0] has no 'status' string"),
         ("shards.0.status", None, "shards[0] has no 'status' string"),
         ("shards.0.n_read_failures", "x", "shards[0].n_read_failures is a str, not an integer")]


@pytest.mark.parametrize("field,value,words", CASES, ids=[c[0] + ("-drop" if c[1] is _DROP else
                                                                   "-null" if c[1] is None else "")
                                                            for c in CASES])
def test_a_manifest_without_what_readers_use_is_named_by_every_command(built, tmp_path, capsys, field, value,
                                                                        words):
    """Before: KeyError: 'shards' (or TypeError: string indices must be integers) with a traceback, exit
    1, from verify, stats, export and plan simulate alike; a manifest without 'estimator' passed verify
    and crashed stats."""
    idx = tmp_path / "idx"
    shutil.copytree(built, idx)
    m = json.loads((idx / "manifest.json").read_text())
    _edit(m, field, value)
    (idx / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(IndexDamagedError, match="manifest.json is damaged: " + words.replace("[", r"\[")
                       .replace("]", r"\]")):
        TokenIndex.open(idx)
    capsys.readouterr()
    assert main(["index", "verify", str(idx), "-q"]) == 1
    out = capsys.readouterr().out
    assert "index damaged" in out and words in out and "Traceback" not in out
    for argv in (["index", "stats", str(idx)], ["index", "export", "--index", str(idx), str(tmp_path / "x")],
                 ["plan", "simulate", "--index", str(idx), "--world-size", "2", "--global-batch-size", "2"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, (argv, err)


@pytest.mark.parametrize("line", ['"a string"', "[1, 2]", "3"])
def test_an_errors_line_that_is_not_an_object_is_named(built, tmp_path, capsys, line):
    """Before: index stats raised AttributeError: 'list' object has no attribute 'get'."""
    idx = tmp_path / "idx"
    shutil.copytree(built, idx)
    (idx / "errors.jsonl").write_text(line + "\n")
    with pytest.raises(IndexDamagedError, match=r"errors\.jsonl is damaged at line 1: it holds a"):
        TokenIndex.open(idx).errors   # noqa: B018
    assert main(["index", "stats", str(idx)]) == 2
    assert "errors.jsonl is damaged at line 1" in capsys.readouterr().err
