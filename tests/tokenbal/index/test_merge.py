"""Builds spread over machines (``--part`` + ``merge``, a torchrun run of 2 CPU ranks included) equal
one build; ``export`` and ``lengths_for_keys`` feed the lengths back by key."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import paths
from tests.helpers.corpus import make_corpus
from tokenbal import TokenBalancedBatchSampler
from tokenbal.cli import main
from tokenbal.index import TokenIndex, build_index, export_index, lengths_for_keys, merge_indexes
from tokenbal.index.export import read_export
from tokenbal.index.merge import parse_part

REPO = str(paths.REPO)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus"), n_shards=5, samples_per_shard=4)


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "index"
    build_index([os.path.join(corpus.root, "data-*.tar")], out, progress=False)
    return TokenIndex.open(out)


def assert_identical(a: TokenIndex, b: TokenIndex) -> None:
    for name in sorted(f for f in os.listdir(a.path) if f != "manifest.json"):
        with open(os.path.join(a.path, name), "rb") as fa, open(os.path.join(b.path, name), "rb") as fb:
            assert fa.read() == fb.read(), name
    # build_id names each written version (readers pin it), so like ``created`` it differs by design.
    ma, mb = (dict(m, created=None, tokenbal_version=None, build_id=None) for m in (a.manifest, b.manifest))
    assert json.dumps(ma, sort_keys=True) == json.dumps(mb, sort_keys=True)


def test_parts_merge_to_the_single_build(corpus, single, tmp_path):
    src = os.path.join(corpus.root, "data-*.tar")
    parts = []
    for i in (2, 0, 1):   # any order
        out = tmp_path / f"part-{i}"
        build_index([src], out, progress=False, part=(i, 3))
        parts.append(out)
        assert TokenIndex.open(out).shard_paths == single.shard_paths[i::3]
    report = merge_indexes(tmp_path / "merged", parts)
    assert report.num_samples == len(single) and report.num_bad_shards == 1
    # The bad shard is named, as a one-machine build names it (a CI limit check says which one).
    (bad,) = [s for s in single.manifest["shards"] if s["status"] != "ok"]
    assert report.bad_shards == [{"path": bad["path"], "status": bad["status"], "reason": bad["reason"]}]
    assert bad["path"] in report.limit_problems()[0]
    assert_identical(single, TokenIndex.open(tmp_path / "merged"))
    with pytest.raises(ValueError, match="part.s. 0/3 missing"):
        merge_indexes(tmp_path / "m2", parts[:1] + parts[2:])
    with pytest.raises(ValueError, match="part 2/3 given twice"):
        merge_indexes(tmp_path / "m3", parts + parts[:1])
    with pytest.raises(ValueError, match="not a part index"):
        merge_indexes(tmp_path / "m4", [single.path])
    build_index([os.path.join(corpus.root, "data-00[0-3].tar")], tmp_path / "other", progress=False,
                part=(1, 3))
    with pytest.raises(ValueError, match="other sources"):
        merge_indexes(tmp_path / "m5", [parts[1], tmp_path / "other", parts[0]])


def test_parts_built_by_different_tokenbal_versions_are_refused(tmp_path):
    corpus = make_corpus(tmp_path / "shards", n_shards=2, samples_per_shard=2, bad=False)
    src = os.path.join(corpus.root, "data-*.tar")
    parts = [tmp_path / "p0", tmp_path / "p1"]
    for i, out in enumerate(parts):
        build_index([src], out, progress=False, part=(i, 2))
    file = parts[1] / "manifest.json"
    m = json.loads(file.read_text())
    m["tokenbal_version"] = "0.0.9"
    file.write_text(json.dumps(m))
    with pytest.raises(ValueError,
                       match=rf"{parts[1]} was built by tokenbal 0\.0\.9, {parts[0]} by tokenbal "):
        merge_indexes(tmp_path / "m", parts)
    assert not os.path.exists(tmp_path / "m")


def test_an_interrupted_part_build_is_named_as_such_not_as_a_shard_gap(tmp_path):
    """SIGTERM during part 1/2's build leaves its finished shards in .p1.partial; given to the merge,
    it was refused as "1 shard(s) of the list in no part", not as the unfinished build it is."""
    import signal
    import time

    corpus = make_corpus(tmp_path / "shards", n_shards=4, samples_per_shard=2, bad=False)
    build_index(corpus.shards, tmp_path / "p0", progress=False, part=(0, 2))
    out = str(tmp_path / "p1")
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.index_kill", "--part", "1/2", out, "1",
                             *corpus.shards], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    deadline = time.monotonic() + 120
    while not os.path.exists(out + ".ready") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    partial = tmp_path / ".p1.partial"
    assert TokenIndex.open(partial).shard_paths == [corpus.shards[1]]
    with pytest.raises(ValueError, match=rf"{partial} is an interrupted build of part 1/2 \(1 of its 2 "
                                         r"shards done\); run that part's build again"):
        merge_indexes(tmp_path / "m", [tmp_path / "p0", partial])
    build_index(corpus.shards, out, progress=False, part=(1, 2))     # resumes, then the merge works
    assert merge_indexes(tmp_path / "m", [tmp_path / "p0", out]).num_shards == 4


def test_parse_part():
    assert parse_part("1/4") == (1, 4)
    assert parse_part("env", {"RANK": "3", "WORLD_SIZE": "8"}) == (3, 8)
    assert parse_part("env", {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "6",
                              "SLURM_ARRAY_TASK_MIN": "1"}) == (4, 6)
    # --array=0-14:2: eight tasks numbered 0, 2, ..., 14 are parts 0..7 (task 6 used to be part 6/8,
    # tasks 8-14 an error, parts 1, 3, 5 and 7 never built)
    stepped = {"SLURM_ARRAY_TASK_COUNT": "8", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_STEP": "2"}
    assert [parse_part("env", {**stepped, "SLURM_ARRAY_TASK_ID": str(t)})[0] for t in range(0, 15, 2)] \
        == list(range(8))
    with pytest.raises(ValueError, match="SLURM_ARRAY_TASK_ID 3 is not on the array's step 2"):
        parse_part("env", {**stepped, "SLURM_ARRAY_TASK_ID": "3"})
    for bad in ("4/4", "1", "a/b", "-1/2"):
        with pytest.raises(ValueError):
            parse_part(bad)
    with pytest.raises(ValueError, match="RANK"):
        parse_part("env", {})
    # A variable that is not a number: named (it was int()'s "invalid literal for int() with base 10: 'x'").
    with pytest.raises(ValueError, match=r"^--part env: RANK='x' is not an integer$"):
        parse_part("env", {"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match=r"^--part env: SLURM_ARRAY_TASK_MIN='' is not an integer$"):
        parse_part("env", {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2",
                           "SLURM_ARRAY_TASK_MIN": ""})


def test_torchrun_two_ranks_then_merge(corpus, single, tmp_path, capsys):
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tokenbal.cli", "index", "build", os.path.join(corpus.root, "data-*.tar"),
           "--part", "env", "--out", str(tmp_path / "parts" / "part-{i}-of-{n}"), "-q",
           "--max-bad-shards", "1"]   # the corpus's truncated shard: one part's build fails it otherwise
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    parts = sorted(str(p) for p in (tmp_path / "parts").iterdir())
    assert [os.path.basename(p) for p in parts] == ["part-0-of-2", "part-1-of-2"]
    assert main(["index", "merge", str(tmp_path / "merged"), *parts]) == 0
    assert_identical(single, TokenIndex.open(tmp_path / "merged"))
    # A bar over the shards merged (progress= was taken and ignored); -q turns it off.
    capsys.readouterr()
    assert main(["index", "merge", str(tmp_path / "merged"), *parts]) == 0
    shards = len(single.shard_paths)
    assert re.search(rf"merging: 100%.* {shards}/{shards} ", capsys.readouterr().err)
    assert main(["index", "merge", "-q", str(tmp_path / "merged"), *parts]) == 0
    assert "merging" not in capsys.readouterr().err


def test_an_out_with_part_numbers_needs_part(tmp_path, capsys):
    """``--out parts/part-{i}`` without ``--part`` (a launcher line copied without it) built the whole
    index into a folder literally named ``part-{i}``."""
    corpus = _small_corpus(tmp_path / "shards", 2)
    out = tmp_path / "parts" / "part-{i}"
    assert main(["index", "build", *corpus.shards, "--out", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert f"tokenbal index build: error: --out {out}: {{i}} and {{n}} are replaced only with --part" in err
    assert not (tmp_path / "parts").exists()


def test_a_part_build_does_not_silently_replace_another_part_or_a_whole_index(tmp_path, capsys):
    """``--part env --out /shared/parts/part`` (no ``{i}``), one Slurm task after another: each part's
    build replaced the one before with exit 0, and only the merge noticed, with parts missing."""
    corpus = _small_corpus(tmp_path / "shards", 4)
    src = os.path.join(corpus.root, "data-*.tar")
    same = tmp_path / "parts" / "part"
    build = ["index", "build", src, "--out", str(same), "-q"]
    assert main([*build, "--part", "0/2"]) == 0
    capsys.readouterr()
    assert main([*build, "--part", "1/2"]) == 2
    err = capsys.readouterr().err
    assert (f"tokenbal index build: error: --out {same} holds part 0/2 of 4 samples from 2 shards, which "
            "this build of part 1/2 would replace; give each part its own folder with {i} in --out") in err
    assert TokenIndex.open(same).manifest["part"]["index"] == 0          # untouched
    # A whole index is not replaced by one of its parts either.
    whole = tmp_path / "whole"
    build_index([src], whole, progress=False)
    assert main(["index", "build", src, "--out", str(whole), "-q", "--part", "1/2"]) == 2
    assert "holds a whole index (built without --part) of 8 samples from 4 shards" in capsys.readouterr().err
    assert len(TokenIndex.open(whole)) == 8
    # The same part again, a re-split (part 0 of 3 where part 0 of 2 was) and --rebuild replace it.
    assert main([*build, "--part", "0/2"]) == 0
    assert main([*build, "--part", "0/3"]) == 0
    assert main([*build, "--part", "1/3", "--rebuild"]) == 0
    assert TokenIndex.open(same).manifest["part"]["index"] == 1


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "npy"])
def test_export_and_join_by_key(single, tmp_path, fmt):
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    assert main(["index", "export", str(tmp_path / "x"), "--index", single.path, "--format", fmt]) == 0
    keys, cols = read_export(tmp_path / "x")
    assert keys == list(single.keys)
    np.testing.assert_array_equal(cols["length"], np.asarray(single.lengths))
    np.testing.assert_array_equal(cols["vision_tokens"] + cols["text_tokens"], cols["length"])
    # Another tool lists the samples in its own order: lengths come back in that order.
    perm = np.random.default_rng(0).permutation(len(keys))
    theirs = [keys[j] for j in perm]
    joined = lengths_for_keys(tmp_path / "x", theirs)
    np.testing.assert_array_equal(joined, np.asarray(single.lengths)[perm])
    np.testing.assert_array_equal(lengths_for_keys(single, theirs, "text_tokens"),
                                  np.asarray(single.text_tokens)[perm])
    sampler = TokenBalancedBatchSampler(joined, num_replicas=2, rank=0, global_batch_size=4, seed=0)
    batches = list(sampler)
    assert batches and all(0 <= j < len(theirs) for b in batches for j in b)
    with pytest.raises(KeyError, match="nope"):
        lengths_for_keys(tmp_path / "x", [theirs[0], "nope"])


def test_a_jsonl_export_reports_the_rows_written(single, tmp_path, capsys, monkeypatch):
    """A JSONL export writes a row at a time (~6 s per million rows, in silence): every PROGRESS_ROWS
    rows written is reported, and `tokenbal index export` shows a bar on stderr (none with -q)."""
    import tokenbal.index.scan as scan_mod

    monkeypatch.setattr(scan_mod, "PROGRESS_ROWS", 4)
    n = len(single)
    reports = []
    export_index(single.path, tmp_path / "x", "jsonl", progress=lambda *r: reports.append(r))
    assert n > 8 and reports == [*((k, n, "rows") for k in range(4, n, 4)), (n, n, "rows")]
    assert main(["index", "export", str(tmp_path / "y"), "--index", single.path, "--format", "jsonl"]) == 0
    out, err = capsys.readouterr()
    assert "exporting" in err and out.startswith("wrote ")
    quiet = ["index", "export", str(tmp_path / "z"), "--index", single.path, "--format", "jsonl", "-q"]
    assert main(quiet) == 0
    assert capsys.readouterr().err == ""


def test_export_into_a_file_is_one_line_naming_it(single, tmp_path, capsys):
    """``index export DIR`` where DIR (or a folder above it) is a file was ``[Errno 17] File exists:
    'DIR'`` / ``[Errno 20] Not a directory`` with exit 1, as if the environment had failed."""
    afile = tmp_path / "lengths.jsonl"
    afile.write_text("mine\n")
    for out in (afile, afile / "sub"):
        assert main(["index", "export", str(out), "--index", single.path, "--format", "jsonl"]) == 2
        err = capsys.readouterr().err
        assert err.strip() == (f"tokenbal index export: error: export folder {out}: a file of that name "
                               "(or of a folder above it) is in the way; give a folder to write lengths.* "
                               "into")
    assert afile.read_text() == "mine\n"


@pytest.mark.parametrize("fmt", ["jsonl", "npy"])
def test_an_export_cut_short_by_a_full_disk_leaves_the_previous_one_whole(single, tmp_path, fmt):
    """A real process under a file-size limit (a full disk stands in): ``index export`` used to leave a
    half-written lengths file in place of the previous, complete one, and said only ``[Errno 27] File
    too large`` without the file."""
    import resource

    out = tmp_path / "lengths"
    cmd = [sys.executable, "-m", "tokenbal.cli", "index", "export", str(out), "--index", single.path,
           "--format", fmt]
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONDONTWRITEBYTECODE": "1"}
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=120)
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    limit = min(len(b) for b in before.values()) // 2   # every file of the export is cut short

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    run = subprocess.run(cmd, env=env, preexec_fn=small_files, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert f"File too large: writing {out}{os.sep}lengths." in run.stderr


def test_a_damaged_jsonl_export_is_named_by_file_and_line(single, tmp_path):
    """``lengths_for_keys`` over a cut-short or foreign ``lengths.jsonl`` raised a bare
    ``JSONDecodeError: Expecting value: line 1 column 8`` or ``KeyError: 'length'``."""
    out = tmp_path / "x"
    export_index(single, out, "jsonl")
    path = out / "lengths.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])
    cut = rf"^{path}: line 3 is not JSON \(.*\); a cut-short export\? export it again$"
    with pytest.raises(ValueError, match=cut):
        lengths_for_keys(out, [single.keys[0]])
    path.write_text(lines[0] + '{"key": "a", "len": 3}\n')
    with pytest.raises(ValueError, match=rf"^{path}: line 2: length is '<absent>', not a count"):
        lengths_for_keys(out, ["a"])


def test_join_refuses_duplicate_keys(tmp_path):
    from tests.helpers.corpus import Sample, write_shard

    a = write_shard(tmp_path / "a.tar", [Sample("k", caption="one")])
    b = write_shard(tmp_path / "b.tar", [Sample("k", caption="two words")])
    build_index([a, b], tmp_path / "i", progress=False)
    export_index(tmp_path / "i", tmp_path / "x", "jsonl")
    with pytest.raises(ValueError, match="more than once"):
        lengths_for_keys(tmp_path / "x", ["k"])


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "npy"])
def test_export_keeps_unusual_keys_exactly_or_refuses_them(tmp_path, fmt):
    """Keys with a carriage return, non-ASCII letters and Unicode line separators: a format that can
    hold them gives them back exactly; npy's keys.txt (one line per key) refuses a line break."""
    from tests.helpers.corpus import Sample, write_shard

    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    keys = ["plain", "trail\r", "ünïcødé/日本", "\u2028sep", "x\x85y", "tab\t"]
    shard = write_shard(tmp_path / "a.tar", [Sample(k, caption="w " * (j + 1)) for j, k in enumerate(keys)])
    build_index([shard], tmp_path / "i", progress=False)
    idx = TokenIndex.open(tmp_path / "i")
    assert list(idx.keys) == keys
    if fmt == "npy":
        # The key "trail\r" used to come back as "trail" (its line read as "trail\r\n").
        with pytest.raises(ValueError, match=r"key or shard 'trail\\r' holds a line break"):
            export_index(idx, tmp_path / "x", fmt)
        keys = [k for k in keys if "\r" not in k]
        shard = write_shard(tmp_path / "b.tar",
                            [Sample(k, caption="w " * (j + 1)) for j, k in enumerate(keys)])
        build_index([shard], tmp_path / "j", progress=False)
        idx = TokenIndex.open(tmp_path / "j")
    export_index(idx, tmp_path / "x", fmt)
    got, cols = read_export(tmp_path / "x")
    assert got == keys
    np.testing.assert_array_equal(cols["length"], np.asarray(idx.lengths))


def test_export_refuses_a_damaged_index_instead_of_copying_its_values(tmp_path):
    """A shard id of -1 used to be exported as the last shard's path (Python's negative indexing)."""
    from tests.helpers.corpus import Sample, write_shard

    a = write_shard(tmp_path / "a.tar", [Sample("a1", caption="one two"), Sample("a2", caption="x")])
    b = write_shard(tmp_path / "b.tar", [Sample("b1", caption="one two three")])
    build_index([a, b], tmp_path / "i", progress=False)
    ids = np.load(tmp_path / "i" / "shard_id.npy", mmap_mode="r+")
    ids[0] = -1
    ids.flush()
    del ids
    with pytest.raises(ValueError, match=r"cannot export .*shard_id\.npy: 1 shard id\(s\) outside 0\.\.1 "
                                         r"\(first: sample 0: -1\)"):
        export_index(tmp_path / "i", tmp_path / "x", "jsonl")
    assert not os.path.exists(tmp_path / "x" / "lengths.jsonl")
    assert main(["index", "export", str(tmp_path / "x"), "--index", str(tmp_path / "i"),
                 "--format", "jsonl"]) != 0


@pytest.mark.parametrize("fmt", ["npy", "jsonl"])
def test_export_into_an_index_folder_is_refused(single, tmp_path, fmt):
    """`tokenbal index export IDX --index IDX --format npy` wrote lengths.npy (N x 3) over the index's
    own lengths column: the index no longer opened."""
    idx = tmp_path / "idx"
    shutil.copytree(single.path, idx)
    before = (idx / "lengths.npy").read_bytes()
    assert main(["index", "export", str(idx), "--index", str(idx), "--format", fmt]) != 0
    with pytest.raises(ValueError, match=f"export folder {idx} holds a tokenbal index"):
        export_index(idx, idx, fmt)
    assert (idx / "lengths.npy").read_bytes() == before
    assert not (idx / "keys.txt").exists() and not (idx / "lengths.jsonl").exists()
    assert TokenIndex.open(idx).lengths.tolist() == single.lengths.tolist()


def test_a_folder_with_exports_in_two_formats_is_not_read_as_one(tmp_path):
    """An old Parquet export, then a JSONL export of the rebuilt index into the same folder: the
    stale lengths.parquet used to win."""
    from tests.helpers.corpus import Sample, write_shard

    shard = write_shard(tmp_path / "a.tar", [Sample("k", caption="one two three")])
    build_index([shard], tmp_path / "i", progress=False)
    export_index(tmp_path / "i", tmp_path / "x", "parquet")
    write_shard(tmp_path / "a.tar", [Sample("k", caption="one two three four five six seven eight")])
    build_index([shard], tmp_path / "i", progress=False)
    export_index(tmp_path / "i", tmp_path / "x", "jsonl")
    with pytest.raises(ValueError, match=r"holds exports in 2 formats \(lengths\.parquet, lengths\.jsonl\)"):
        lengths_for_keys(tmp_path / "x", ["k"])
    assert lengths_for_keys(tmp_path / "x" / "lengths.jsonl", ["k"]).tolist() == \
        lengths_for_keys(tmp_path / "i", ["k"]).tolist()


def _write_lengths(folder, fmt: str, rows: list[dict]) -> None:
    """An export as another tool may write or edit it (rows of key + the three counts, as given)."""
    os.makedirs(folder)
    if fmt == "jsonl":
        (folder / "lengths.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({c: [r[c] for r in rows] for c in ("key", "length", "vision_tokens",
                                                                   "text_tokens")}),
                       folder / "lengths.parquet")
    else:
        np.save(folder / "lengths.npy", np.array([[r["length"], r["vision_tokens"], r["text_tokens"]]
                                                  for r in rows]))
        (folder / "keys.txt").write_text("".join(r["key"] + "\n" for r in rows))


@pytest.mark.parametrize("fmt, value, words", [
    ("jsonl", 3.7, r"lengths\.jsonl: line 2: length is 3\.7, not a count"),
    ("jsonl", True, r"lengths\.jsonl: line 2: length is True, not a count"),
    ("jsonl", None, r"lengths\.jsonl: line 2: length is None, not a count"),
    ("jsonl", -1, r"lengths\.jsonl: line 2: length is -1, not a count"),
    ("parquet", None, r"lengths\.parquet: row 1: length is null"),
    ("parquet", 3.7, r"lengths\.parquet: column 'length' has type double, expected integers"),
    ("parquet", -1, r"lengths\.parquet: row 1: length is -1, not a count"),
    ("npy", 3.7, r"lengths\.npy: dtype float64 shape \(2, 3\), expected integers"),
    ("npy", -1, r"lengths\.npy: row 1: length is -1, not a count"),
])
def test_an_export_with_a_count_that_is_not_a_count_is_refused_naming_the_row(tmp_path, fmt, value, words):
    """Such values were cast: 3.7 read as 3, True as 1, a Parquet null as -9223372036854775808."""
    if fmt == "parquet":
        pytest.importorskip("pyarrow")
    rows = [{"key": "a", "length": 5, "vision_tokens": 0, "text_tokens": 5},
            {"key": "b", "length": value, "vision_tokens": 0, "text_tokens": 2}]
    _write_lengths(tmp_path / "x", fmt, rows)
    with pytest.raises(ValueError, match=words):
        lengths_for_keys(tmp_path / "x", ["a", "b"])
    rows[1]["length"] = 2
    _write_lengths(tmp_path / "y", fmt, rows)
    assert lengths_for_keys(tmp_path / "y", ["b", "a"]).tolist() == [2, 5]


# --- issue 33: the parts must split one shard list --------------------------------------------------

def _small_corpus(root, n):
    return make_corpus(root, n_shards=n, samples_per_shard=2, bad=False)


def test_a_shard_added_between_the_parts_builds_is_named_not_lost_or_doubled(tmp_path):
    """The reproduction: part 0/2 built over 4 shards, a 5th appears in the middle of the glob, part 1/2
    built over 5: the merge used to exit 0 with one shard twice and two missing."""
    corpus = _small_corpus(tmp_path / "shards", 4)
    src = os.path.join(corpus.root, "data-*.tar")
    build_index([src], tmp_path / "p0", progress=False, part=(0, 2))
    extra = make_corpus(tmp_path / "more", n_shards=1, samples_per_shard=2, bad=False, seed=3).shards[0]
    added = os.path.join(corpus.root, "data-0015.tar")     # sorts between data-001 and data-002
    os.rename(extra, added)
    build_index([src], tmp_path / "p1", progress=False, part=(1, 2))
    with pytest.raises(ValueError, match="split different shard lists") as e:
        merge_indexes(tmp_path / "m", [tmp_path / "p0", tmp_path / "p1"])
    assert f"only part 1/2 ({tmp_path / 'p1'}) saw {added}" in str(e.value)
    assert not os.path.exists(tmp_path / "m")
    assert main(["index", "merge", str(tmp_path / "m"), str(tmp_path / "p0"), str(tmp_path / "p1")]) != 0


def test_a_shard_rewritten_between_the_parts_builds_is_named(tmp_path):
    corpus = _small_corpus(tmp_path / "shards", 4)
    src = os.path.join(corpus.root, "data-*.tar")
    build_index([src], tmp_path / "p0", progress=False, part=(0, 2))
    # data-000 is part 0's; part 1 sees it rewritten (same list, another size and mtime).
    with open(corpus.shards[0], "ab") as f:
        f.write(b"\0" * 1024)
    os.utime(corpus.shards[0], ns=(1, 1))
    build_index([src], tmp_path / "p1", progress=False, part=(1, 2))
    with pytest.raises(ValueError, match=r"1 shard\(s\) changed between the parts' builds: "
                                         + corpus.shards[0].replace(".", r"\.")):
        merge_indexes(tmp_path / "m", [tmp_path / "p0", tmp_path / "p1"])


def test_parts_that_overlap_or_leave_a_gap_are_refused(tmp_path):
    corpus = _small_corpus(tmp_path / "shards", 4)
    src = os.path.join(corpus.root, "data-*.tar")
    build_index([src], tmp_path / "p0", progress=False, part=(0, 2))
    # A part 0 passed off as part 1 (a launcher that gave two machines the same rank, then a rename):
    # its shard list agrees, but it holds part 0's shards again.
    build_index([src], tmp_path / "p1", progress=False, part=(0, 2))
    file = tmp_path / "p1" / "manifest.json"
    m = json.loads(file.read_text())
    m["part"]["index"] = 1
    file.write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"2 shard\(s\) in more than one part: .*2 shard\(s\) of the list in "
                                         r"no part: .*data-001\.tar, .*data-003\.tar"):
        merge_indexes(tmp_path / "m", [tmp_path / "p0", tmp_path / "p1"])
    # A part from before the shard list was recorded cannot be checked: refused, naming it.
    del m["part"]["expanded"]
    file.write_text(json.dumps(m))
    with pytest.raises(ValueError, match="did not record the shard list"):
        merge_indexes(tmp_path / "m", [tmp_path / "p0", tmp_path / "p1"])


def test_a_damaged_part_is_refused_not_merged_into_a_clean_looking_index(tmp_path):
    """The merge writes a fresh, self-consistent index from the parts' columns: a part's damage (a
    token count that no longer sums, errors.jsonl cut at a line) would pass every verify after it."""
    corpus = make_corpus(tmp_path / "shards", n_shards=2, samples_per_shard=2, bad=True)
    src = os.path.join(corpus.root, "data-*.tar")
    parts = [tmp_path / "p0", tmp_path / "p1"]
    for i, out in enumerate(parts):
        build_index([src], out, progress=False, part=(i, 2))
    vision = np.load(parts[1] / "vision_tokens.npy")
    vision[0] += 1000
    np.save(parts[1] / "vision_tokens.npy", vision)
    with pytest.raises(ValueError, match=rf"part 1/2 \({parts[1]}\) is damaged: .*lengths\.npy: 1 sample"):
        merge_indexes(tmp_path / "m", parts)
    assert not os.path.exists(tmp_path / "m")
    vision[0] -= 1000
    np.save(parts[1] / "vision_tokens.npy", vision)
    errors = parts[0] / "errors.jsonl"
    lines = errors.read_text(encoding="utf-8").splitlines(keepends=True)
    errors.write_text("".join(lines[:-1]), encoding="utf-8")
    with pytest.raises(ValueError, match=rf"part 0/2 \({parts[0]}\) is damaged: .*errors\.jsonl: "
                                         rf"{len(lines) - 1} line\(s\), manifest\.json says num_errors"):
        merge_indexes(tmp_path / "m", parts)
    errors.write_text("".join(lines), encoding="utf-8")
    assert merge_indexes(tmp_path / "m", parts).num_errors == len(lines)


def test_merge_does_not_silently_replace_an_index_it_would_lose_something_of(tmp_path, capsys):
    """The reproduction: ``index build --tokenizer T --out idx``, then ``index merge idx parts/*`` of
    parts built without the tokenizer: the merge used to replace the index (every text count now the
    heuristic's) with exit 0 and no word; ``index build`` refuses the same replacement."""
    corpus = _small_corpus(tmp_path / "shards", 4)
    src = os.path.join(corpus.root, "data-*.tar")
    parts = [tmp_path / "p0", tmp_path / "p1"]
    for i, part in enumerate(parts):
        build_index([src], part, progress=False, part=(i, 2))
    other = tmp_path / "other"
    build_index([src], other, progress=False, estimator_overrides={"max_pixels": 200704})
    before = TokenIndex.open(other).lengths.tolist()
    assert main(["index", "merge", str(other), *map(str, parts)]) == 2
    err = capsys.readouterr().err
    assert f"{other} holds an index of" in err and "max_pixels: index 200704, this build 12845056" in err
    assert "--replace" in err
    assert TokenIndex.open(other).lengths.tolist() == before        # untouched
    # An index of the same settings with a shard the parts do not hold: it would be dropped.
    extra = make_corpus(tmp_path / "more", n_shards=1, samples_per_shard=2, bad=False, seed=3).shards[0]
    wider = tmp_path / "wider"
    build_index([src, extra], wider, progress=False)
    dropped = r"1 of its shards are in none of the parts \(" + extra.replace(".", r"\.")
    with pytest.raises(ValueError, match=dropped):
        merge_indexes(wider, parts)
    # --replace replaces; re-running one merge, or merging into one of its own parts, needs no flag.
    assert main(["index", "merge", "--replace", str(other), *map(str, parts)]) == 0
    assert TokenIndex.open(other).manifest["estimator"]["config"]["max_pixels"] == 12845056
    assert main(["index", "merge", str(other), *map(str, parts)]) == 0
    assert main(["index", "merge", str(parts[0]), *map(str, parts)]) == 0


def test_a_merge_into_a_file_or_a_folder_of_other_things_names_out_not_an_option(tmp_path, capsys):
    """``index merge OUT PART...`` has no ``--out``, but its refusals said ``--out OUT ...``."""
    corpus = _small_corpus(tmp_path / "shards", 2)
    src = os.path.join(corpus.root, "data-*.tar")
    parts = [str(tmp_path / f"p{i}") for i in range(2)]
    for i, part in enumerate(parts):
        build_index([src], part, progress=False, part=(i, 2))
    afile, folder = tmp_path / "afile", tmp_path / "notes"
    afile.write_text("x")
    folder.mkdir()
    (folder / "mine.txt").write_text("x")
    for out, why in ((afile, "exists and is not a folder"),
                     (folder, "is a non-empty folder that is not a tokenbal index; refusing to replace it")):
        assert main(["index", "merge", str(out), *parts]) == 2
        assert capsys.readouterr().err.strip() == f"tokenbal index merge: error: merge: OUT {out} {why}"
    assert (folder / "mine.txt").read_text() == "x" and afile.read_text() == "x"
