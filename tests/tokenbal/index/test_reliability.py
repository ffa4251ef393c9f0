"""The index under kills, races, stale data and bad input (docs/RELIABILITY.md, "Index build and
reading"): real processes, real signals (SIGKILL, SIGTERM), real tar files, real FIFOs."""

from __future__ import annotations

import glob
import io
import json
import os
import pickle
import signal
import subprocess
import sys
import tarfile
import threading
import time

import numpy as np
import pytest
from PIL import Image

import tokenbal
import tokenbal.index.build as build_mod
from tests.helpers.corpus import Sample, image_bytes, make_corpus, rotated_jpeg, write_shard
from tokenbal.cli import main
from tokenbal.data.indexed import IndexedShardDataset, SampleReadError
from tokenbal.index import TokenIndex, build_index, verify_index
from tokenbal.index.build import IndexBuildError
from tokenbal.index.store import IndexDamagedError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tokenbal.__file__)))
GUARD = 180   # seconds: a hang guard for waits on other processes, never an assertion on speed


def wait_for(cond, what: str) -> None:
    deadline = time.monotonic() + GUARD
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.05)


def rows(idx: TokenIndex) -> list[tuple]:
    return [(idx.keys[i], idx.shard(i), int(idx.lengths[i]), idx.image_sizes(i)) for i in range(len(idx))]


def leftovers(parent) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(".idx"))


def start_hanging_build(tmp_path, shards, hang_at: int) -> subprocess.Popen:
    out = str(tmp_path / "idx")
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.index_kill", out, str(hang_at), *shards],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE)
    wait_for(lambda: os.path.exists(out + ".ready") or proc.poll() is not None,
             "the build to reach its pause")
    assert proc.poll() is None, proc.stderr.read().decode()
    return proc


# --- kills and races ----------------------------------------------------------------------------------

def test_sigkill_of_the_build_resumes_and_a_second_build_names_the_holder(tmp_path, monkeypatch):
    corpus = make_corpus(tmp_path / "data", n_shards=4, samples_per_shard=3, seed=1, bad=False)
    out = tmp_path / "idx"
    proc = start_hanging_build(tmp_path, corpus.shards, hang_at=2)
    # Two builds into one folder: the second fails at once, naming the first.
    with pytest.raises(IndexBuildError, match=f"pid {proc.pid} on host"):
        build_index(corpus.shards, out, progress=False)
    proc.kill()                                  # SIGKILL: no handler runs
    proc.wait(GUARD)
    assert [n for n in leftovers(tmp_path) if ".tmp-" in n], "the killed build left its folder"

    real, calls = build_mod.index_shard, []
    monkeypatch.setattr(build_mod, "index_shard", lambda p, *a, **k: calls.append(p) or real(p, *a, **k))
    report = build_index(corpus.shards, out, progress=False)
    assert calls == corpus.shards[2:] and report.num_reused == 2     # the checkpoint's shards were kept
    assert leftovers(tmp_path) == []                                  # nothing of the dead build is left
    fresh = TokenIndex.open(build_index(corpus.shards, tmp_path / "fresh", progress=False).out)
    assert rows(TokenIndex.open(out)) == rows(fresh)


def test_sigterm_of_the_build_saves_its_finished_shards(tmp_path):
    corpus = make_corpus(tmp_path / "data", n_shards=4, samples_per_shard=3, seed=2, bad=False)
    proc = start_hanging_build(tmp_path, corpus.shards, hang_at=3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(GUARD) == 128 + signal.SIGTERM
    assert leftovers(tmp_path) == [".idx.partial"]
    partial = TokenIndex.open(tmp_path / ".idx.partial")
    assert partial.shard_paths == corpus.shards[:3] and partial.manifest["partial"] is True


def test_a_scan_worker_killed_by_sigkill_ends_the_build_naming_its_shard(tmp_path, monkeypatch):
    from tests.helpers import index_kill

    corpus = make_corpus(tmp_path / "data", n_shards=3, samples_per_shard=2, seed=3, bad=False)
    hang = write_shard(tmp_path / "data" / "hang.tar", [Sample("h0", caption="x y z")])
    shards = [*corpus.shards[:2], hang, corpus.shards[2]]
    monkeypatch.setattr(build_mod, "_worker_index_shard", index_kill.scan_or_hang)
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(build_index(shards, tmp_path / "idx", workers=2, progress=False))
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)

    builder = threading.Thread(target=run, daemon=True)
    builder.start()
    wait_for(lambda: os.path.exists(hang + ".pid"), "a worker to start on hang.tar")
    with open(hang + ".pid") as f:
        os.kill(int(f.read()), signal.SIGKILL)   # what the out-of-memory killer does
    builder.join(GUARD)
    assert not builder.is_alive(), "the build kept waiting for a dead worker"
    assert isinstance(outcome[0], IndexBuildError), outcome
    assert "a scan worker died" in str(outcome[0]) and hang in str(outcome[0])
    # The shards that finished before the kill are kept, in order. Which ones finished is up to the
    # scheduler (the kill breaks every scan still in flight), so only the order is pinned here.
    partial = tmp_path / ".idx.partial"
    kept = TokenIndex.open(partial).shard_paths if partial.exists() else []
    assert kept == corpus.shards[:len(kept)]


def test_naming_only_new_shards_keeps_the_old_ones_and_user_files(tmp_path, capsys):
    corpus = make_corpus(tmp_path / "data", n_shards=3, samples_per_shard=2, seed=4, bad=False)
    out = tmp_path / "idx"
    build_index(corpus.shards[:2], out, progress=False)
    (out / "NOTES.md").write_text("my notes")
    (out / "extra").mkdir()
    (out / "extra" / "keep.bin").write_bytes(b"mine")
    report = build_index(corpus.shards[2:], out, progress=False)            # only the new shard
    assert TokenIndex.open(out).shard_paths == corpus.shards and report.num_kept == 2
    assert "2 shards of the previous index kept" in report.summary()
    assert main(["index", "build", corpus.shards[2], "--out", str(out), "-q", "--drop-unlisted"]) == 0
    assert "kept" not in capsys.readouterr().out
    assert TokenIndex.open(out).shard_paths == corpus.shards[2:]
    assert (out / "NOTES.md").read_text() == "my notes"
    assert (out / "extra" / "keep.bin").read_bytes() == b"mine"
    assert leftovers(tmp_path) == []


def _first_key(ds) -> str:
    return ds[0]["__key__"]


def test_a_job_reads_the_version_it_opened_while_the_index_is_rebuilt(tmp_path):
    from torch.utils.data import DataLoader

    a = write_shard(tmp_path / "a.tar", [Sample("old", images=[("png", 40, 30)], caption="old sample")])
    b = write_shard(tmp_path / "b.tar", [Sample("new", images=[("png", 50, 20)], caption="new sample")])
    out = tmp_path / "idx"
    build_index([a], out, progress=False)
    ds = IndexedShardDataset(out, decode=None)
    build_index([b], out, progress=False, keep_unlisted=False)               # rebuilt in place mid-job
    assert TokenIndex.open(out).keys[0] == "new"
    # A spawn-started worker unpickles the dataset: it must read the version the job opened.
    loader = DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    assert [s["__key__"] for s in loader] == ["old"]
    assert pickle.loads(pickle.dumps(ds)).index.build_id == ds.index.build_id
    kept = [n for n in leftovers(tmp_path) if ".v-" in n]
    assert kept, "the version a reader holds was deleted"
    del ds, loader
    import gc

    gc.collect()
    build_index([b], out, progress=False)           # no reader holds the old version any more
    assert leftovers(tmp_path) == []


# --- staleness ----------------------------------------------------------------------------------------

def _big_shard(path, middle: bytes, middle_mtime: int, fmt_ext: str = "jpg") -> str:
    """Three samples, the first and last padded past 1 MiB, so the middle sample lies outside the
    first/last-MiB fingerprint."""
    pad = bytes(1_300_000)
    members = [("s0.jpg", image_bytes("jpg", 64, 48, seed=1), 1_700_000_000), ("s0.bin", pad, 1_700_000_000),
               (f"s1.{fmt_ext}", middle, middle_mtime), ("s1.txt", b"the middle one", 1_700_000_000),
               ("s2.bin", pad, 1_700_000_000), ("s2.jpg", image_bytes("jpg", 64, 48, seed=2), 1_700_000_000)]
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data, mtime in members:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime = len(data), mtime
            tf.addfile(ti, io.BytesIO(data))
    return os.fspath(path)


def test_a_same_size_member_rewrite_mid_shard_is_caught_by_verify_and_the_reader(tmp_path):
    one = image_bytes("jpg", 200, 100, seed=5)
    other = bytearray(one)
    other[-200:-2] = bytes(198)              # other pixels, same length, still a complete JPEG
    shard = _big_shard(tmp_path / "s.tar", one, 1_700_000_000)
    out = tmp_path / "idx"
    build_index([shard], out, progress=False)
    size = os.path.getsize(shard)
    _big_shard(tmp_path / "s.tar", bytes(other), 1_700_009_999)            # regenerated: a new mtime
    assert os.path.getsize(shard) == size
    problems = verify_index(out)
    assert len(problems) == 1 and "member 's1.jpg' of sample 's1'" in problems[0], problems
    assert main(["index", "verify", str(out)]) == 1
    ds = IndexedShardDataset(out, decode=None)
    assert ds[0]["__key__"] == "s0"
    with pytest.raises(SampleReadError, match=r"'s1\.jpg' of sample 1 \(key 's1'\) in shard .*rewritten"):
        ds[1]


def test_a_rewrite_that_keeps_the_header_is_caught_by_the_decoded_size(tmp_path):
    # 24-bit BMPs of 32x24 and 24x32 have the same byte size; same name and mtime: the same header.
    def bmp(w, h):
        buf = io.BytesIO()
        Image.new("RGB", (w, h), (9, 9, 9)).save(buf, "BMP")
        return buf.getvalue()

    wide, tall = bmp(32, 24), bmp(24, 32)
    assert len(wide) == len(tall)
    shard = _big_shard(tmp_path / "s.tar", wide, 1_700_000_000, "bmp")
    out = tmp_path / "idx"
    build_index([shard], out, progress=False)
    _big_shard(tmp_path / "s.tar", tall, 1_700_000_000, "bmp")
    with pytest.raises(SampleReadError, match=r"s1\.bmp of sample 1 in shard .*s\.tar decodes to 24x32, "
                                              r"the index counted 32x24"):
        IndexedShardDataset(out, decode="pil")[1]
    assert any("shard modified" in p for p in verify_index(out))       # its mtime changed


# --- counts ------------------------------------------------------------------------------------------

def test_images_cut_short_and_empty_samples_are_errors(tmp_path):
    jpg = image_bytes("jpg", 300, 200, seed=7)
    png = image_bytes("png", 300, 200, seed=7)
    shard = write_shard(tmp_path / "s.tar", [
        Sample("good", images=[("jpg", 64, 48)], caption="fine"),
        Sample("cutjpg", caption="x", raw=[("jpg", jpg[:len(jpg) * 2 // 3])]),
        Sample("cutpng", caption="x", raw=[("png", png[:-12])]),
        Sample("empty", caption=""),
    ])
    idx = TokenIndex.open(build_index([shard], tmp_path / "idx", progress=False).out)
    assert list(idx.keys) == ["good"]
    reasons = {e["key"]: e["reason"] for e in idx.errors}
    assert all(e["shard"] == shard for e in idx.errors)
    assert "JPEG cut short: no end-of-image marker" in reasons["cutjpg"]
    assert "PNG cut short: no IEND chunk" in reasons["cutpng"]
    assert "its text is empty and it has no image" in reasons["empty"]


@pytest.mark.parametrize("progressive", [False, True])
def test_bytes_after_a_complete_image_are_no_error_but_a_cut_image_still_is(tmp_path, progressive):
    # A motion photo (an MP4 after the JPEG's end marker), zero padding, bytes after a PNG's IEND: Pillow
    # decodes all of them, so they are counted; the same images cut mid-data and then padded are not.
    def jpeg(w, h, seed):
        buf = io.BytesIO()
        rng = np.random.default_rng(seed)
        exif = Image.Exif()
        exif[0x0112] = 6                                   # rotated: the counted size is 48x64
        Image.fromarray(rng.integers(0, 255, (h, w, 3), np.uint8)).save(buf, "JPEG", progressive=progressive,
                                                                        exif=exif.tobytes())
        return buf.getvalue()

    jpg, png = jpeg(64, 48, 1), image_bytes("png", 64, 48, seed=2)
    video = b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8        # holds FF D9 and other markers
    shard = write_shard(tmp_path / "s.tar", [
        Sample("motion", caption="x", raw=[("jpg", jpg + video)]),
        Sample("padded", caption="x", raw=[("jpg", jpg + b"\0" * 64)]),
        Sample("pngtail", caption="x", raw=[("png", png + b"x" * 100)]),
        Sample("cutjpg", caption="x", raw=[("jpg", jpg[:len(jpg) * 2 // 3] + b"\0" * 64)]),
        Sample("cutpng", caption="x", raw=[("png", png[:-12] + b"\0" * 64)]),
    ])
    idx = TokenIndex.open(build_index([shard], tmp_path / "idx", progress=False).out)
    assert list(idx.keys) == ["motion", "padded", "pngtail"]
    sizes = [[tuple(wh) for wh in idx.image_sizes(i)] for i in range(3)]
    assert sizes == [[(48, 64)], [(48, 64)], [(64, 48)]]
    reasons = {e["key"]: e["reason"] for e in idx.errors}
    assert "JPEG cut short" in reasons["cutjpg"] and "PNG cut short" in reasons["cutpng"]
    for data in (jpg + video, jpg + b"\0" * 64, png + b"x" * 100):
        Image.open(io.BytesIO(data)).load()                 # what the reader and load_image do


def test_annotation_rows_with_mismatched_placeholders_or_no_content_are_errors(tmp_path):
    (tmp_path / "a.jpg").write_bytes(image_bytes("jpg", 64, 48))
    rows_ = [{"image": "a.jpg", "conversations": [{"from": "human", "value": "<image>\n<image>\nTwo?"}]},
             {"images": ["a.jpg", "a.jpg"], "conversations": [{"from": "human", "value": "<image> one"}]},
             {"text": ""},
             {"image": "a.jpg", "conversations": [{"from": "human", "value": "<image>\nok"}]}]
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows_) + "\n")
    idx = TokenIndex.open(build_index([str(jsonl)], tmp_path / "idx", progress=False).out)
    assert list(idx.keys) == ["train.jsonl:4"]
    reasons = {e["key"]: e["reason"] for e in idx.errors}
    assert reasons["train.jsonl:1"].startswith(f"{jsonl}:1: its text has 2 <image> placeholder(s) but the "
                                               "record names 1 image(s)")
    assert "has 1 <image> placeholder(s) but the record names 2" in reasons["train.jsonl:2"]
    assert "its text is empty and it has no image" in reasons["train.jsonl:3"]


# --- EXIF orientation against transformers' processors --------------------------------------------------

SHAPES = [(1000, 400, 6), (1000, 400, 8), (1000, 400, 3), (1000, 400, 1), (300, 900, 5)]


@pytest.fixture(scope="module")
def rotated(tmp_path_factory):
    root = tmp_path_factory.mktemp("exif")
    samples, files = [], []
    for k, (w, h, o) in enumerate(SHAPES):
        path = root / f"p{k}.jpg"
        data = rotated_jpeg(path, w, h, o)
        samples.append(Sample(f"p{k}", caption="a phone photo", raw=[("jpg", data)]))
        files.append(str(path))
    return write_shard(root / "photos.tar", samples), files, root


def _index_tokens(rotated, model: str, exif: str = "transpose") -> list[int]:
    shard, _, root = rotated
    idx = TokenIndex.open(build_index([shard], root / f"idx-{model}-{exif}", model=model, exif=exif,
                                      progress=False).out)
    assert idx.manifest["exif"] == exif
    offsets, tokens = idx.image_tokens_table
    return [int(tokens[offsets[i]]) for i in range(len(idx))]


def _check_against(rotated, model: str, processor_count) -> None:
    from transformers.image_utils import load_image

    _, files, _ = rotated
    want = [processor_count(*load_image(f).size) for f in files]
    assert _index_tokens(rotated, model) == want
    # The test can fail: counting the stored size gives other numbers for the rotated photos.
    assert _index_tokens(rotated, model, exif="ignore") != want


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "PNG", "TIFF"])
def test_counted_size_is_exif_transpose_size_for_every_orientation(tmp_path, fmt):
    from PIL import ImageOps

    from tokenbal.index.imagesize import read_image_size

    for orientation in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = orientation
        path = tmp_path / f"o{orientation}.img"
        Image.new("RGB", (60, 40), (1, 2, 3)).save(path, fmt, exif=exif if fmt == "TIFF" else exif.tobytes())
        fd = os.open(path, os.O_RDONLY)
        try:
            got = read_image_size(fd, 0, os.path.getsize(path), exif="transpose")[0]
        finally:
            os.close(fd)
        with Image.open(path) as im:
            assert got == ImageOps.exif_transpose(im).size, (fmt, orientation)


def test_exif_orientation_llava_next(rotated, next_proc):
    def count(w, h):
        out = next_proc(text="hi <image>", images=Image.new("RGB", (w, h)), return_tensors="np")
        return int((out["input_ids"] == 1).sum())

    _check_against(rotated, "llava-next", count)


def test_exif_orientation_llava_onevision(rotated, ov_proc):
    _check_against(rotated, "llava-onevision", lambda w, h: ov_proc._get_number_of_features(h, w, 384, 384))


def test_exif_orientation_phi4(rotated, phi4_oracle):
    _check_against(rotated, "phi-4-multimodal", phi4_oracle)


def test_the_reader_applies_the_index_exif_policy(rotated):
    from transformers.image_utils import load_image

    shard, files, root = rotated
    idx = TokenIndex.open(build_index([shard], root / "idx-read", progress=False).out)
    for decode in ("pil", "rgb8", "torchrgb8"):
        ds = IndexedShardDataset(idx, decode=decode)
        for i, f in enumerate(files):
            img = ds[i]["jpg"]
            got = img.size if decode == "pil" else (img.shape[1], img.shape[0]) if decode == "rgb8" \
                else (img.shape[2], img.shape[1])
            assert got == load_image(f).size == idx.image_sizes(i)[0]
    pix = np.asarray(IndexedShardDataset(idx, decode="pil")[0]["jpg"])
    np.testing.assert_array_equal(pix, np.asarray(load_image(files[0])))     # the same pixels, too


# --- unclear errors -------------------------------------------------------------------------------------

def test_a_shard_name_with_brackets_is_that_file(tmp_path):
    literal = write_shard(tmp_path / "shard[1].tar", [Sample("lit", caption="the literal one")])
    write_shard(tmp_path / "shard1.tar", [Sample("glob", caption="what the glob would match")])
    idx = TokenIndex.open(build_index([literal], tmp_path / "idx", progress=False).out)
    assert idx.shard_paths == [literal] and list(idx.keys) == ["lit"]


def test_a_gnu_sparse_member_is_named_as_such(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.txt").write_text("caption")
    with open(src / "k.jpg", "wb") as f:                  # a JPEG with a 2 MiB hole in its middle
        f.write(image_bytes("jpg", 64, 48))
        f.seek(2 << 20)
        f.write(b"\xff\xd9")
    (src / "ok.txt").write_text("fine")
    shard = tmp_path / "sparse.tar"
    subprocess.run(["tar", "--sparse", "--format=gnu", "-cf", str(shard), "-C", str(src), "k.jpg", "k.txt",
                    "ok.txt"], check=True)
    idx = TokenIndex.open(build_index([str(shard)], tmp_path / "idx", progress=False).out)
    assert list(idx.keys) == ["ok"]
    (err,) = idx.errors
    assert err["key"] == "k" and "GNU sparse file" in err["reason"] and "cut short" not in err["reason"]


@pytest.mark.parametrize("victim", ["manifest.json", "lengths.npy"])
def test_a_truncated_index_file_is_named_and_verify_fails(tmp_path, capsys, victim):
    shard = write_shard(tmp_path / "s.tar", [Sample(f"k{i}", caption="some text") for i in range(50)])
    out = tmp_path / "idx"
    build_index([shard], out, progress=False)
    file = out / victim
    os.truncate(file, os.path.getsize(file) // 2)
    with pytest.raises(IndexDamagedError, match=f"index file {file} is damaged"):
        TokenIndex.open(out)
    (problem,) = verify_index(out)
    assert problem.startswith("index damaged:") and str(file) in problem
    assert main(["index", "verify", str(out)]) == 1
    assert "up to date" not in capsys.readouterr().out


def test_a_fifo_as_a_shard_is_an_error_not_a_hang(tmp_path):
    fifo = tmp_path / "stuck.tar"
    os.mkfifo(fifo)
    good = write_shard(tmp_path / "good.tar", [Sample("g", caption="fine")])
    outcome: list = []
    t = threading.Thread(target=lambda: outcome.append(build_index([str(fifo), good], tmp_path / "idx",
                                                                   progress=False)), daemon=True)
    t.start()
    t.join(GUARD)
    if t.is_alive():        # unblock the reader so the stuck thread can end, then fail
        with open(fifo, "wb"):
            pass
        pytest.fail("the build blocked on the FIFO")
    report = outcome[0]
    assert (report.num_samples, report.num_bad_shards) == (1, 1)
    (err,) = TokenIndex.open(report.out).errors
    assert err["shard"] == str(fifo) and "is a FIFO (named pipe), not a regular file" in err["reason"]
    assert glob.glob(str(tmp_path / ".idx*")) == []




# --- issue 33: damage verify used to miss; a killed build's workers --------------------------------

@pytest.fixture
def small_index(tmp_path):
    shards = [write_shard(tmp_path / f"s{j}.tar", [Sample(f"k{j}-{i}", images=[("png", 32, 24)],
                                                          caption="a few words here") for i in range(4)])
              for j in range(2)]
    out = tmp_path / "idx"
    build_index(shards, out, progress=False)
    assert verify_index(out) == []
    return out


def _poke(file, row: int, value) -> None:
    """Overwrite one value of an index column in place (a flipped bit, a hand edit)."""
    arr = np.load(file, mmap_mode="r+")
    arr[row] = value
    arr.flush()
    del arr


def test_a_flipped_bit_in_lengths_is_named_by_verify(small_index, capsys):
    file = small_index / "lengths.npy"
    want = int(np.load(file)[5])
    _poke(file, 5, want ^ (1 << 4))
    (problem,) = verify_index(small_index)
    assert problem.startswith(f"index damaged: {file}: 1 sample(s) whose length is not vision_tokens + "
                              f"text_tokens (first: sample 5: {want ^ 16} != ")
    assert main(["index", "verify", str(small_index)]) == 1
    assert "up to date" not in capsys.readouterr().out


def test_an_out_of_range_shard_id_is_named_by_verify_and_the_reader(small_index):
    file = small_index / "shard_id.npy"
    _poke(file, 6, 7)
    (problem,) = verify_index(small_index)
    assert problem == f"index damaged: {file}: 1 shard id(s) outside 0..1 (first: sample 6: 7)"
    idx = TokenIndex.open(small_index)
    with pytest.raises(IndexDamagedError, match=f"index file {file} is damaged: sample 6 has shard id 7"):
        idx.shard(6)
    with pytest.raises(IndexDamagedError, match="shard_id.npy is damaged"):
        IndexedShardDataset(idx, decode=None)[6]
    assert IndexedShardDataset(idx, decode=None)[5]["__key__"] == "k1-1"   # the others still read


def test_a_non_monotonic_member_start_is_named_not_blamed_on_the_shard(small_index):
    file = small_index / "member_start.npy"
    _poke(file, 3, 1)   # sample 2 now spans members 4..1, sample 3 members 1..8
    problems = verify_index(small_index)
    assert problems == [f"index damaged: {file}: not monotonic: 1 place(s) where it goes down "
                        "(first: row 3: 4 -> 1)"]
    idx = TokenIndex.open(small_index)
    with pytest.raises(IndexDamagedError, match=f"index file {file} is damaged: sample 2 spans rows 4..1"):
        IndexedShardDataset(idx, decode=None)[2]
    # Other CSR columns and tables are checked the same way.
    _poke(file, 3, 6)
    _poke(small_index / "image_start.npy", 0, 1)
    _poke(small_index / "member_ext.npy", 0, 9)
    problems = verify_index(small_index)
    starts = f"index damaged: {small_index / 'image_start.npy'}: starts at 1"
    assert any(p.startswith(starts) for p in problems)
    assert any(str(small_index / "member_ext.npy") in p and "extension id(s) outside" in p for p in problems)
    with pytest.raises(IndexDamagedError, match="member_ext.npy is damaged"):
        TokenIndex.open(small_index).members(0)


def test_a_key_that_is_not_utf8_is_named_by_verify_and_the_reader(small_index):
    """A flipped bit in keys.bin: verify said nothing and reading the key raised a bare
    UnicodeDecodeError."""
    file = small_index / "keys.bin"
    blob = bytearray(file.read_bytes())
    row = 5
    start = int(np.load(small_index / "key_offsets.npy")[row])
    blob[start] = 0xFF
    file.write_bytes(bytes(blob))
    assert verify_index(small_index) == [f"index damaged: {file}: byte {start} (row {row}) is not UTF-8"]
    idx = TokenIndex.open(small_index)
    with pytest.raises(IndexDamagedError, match=f"index file {file} is damaged: row {row} is not UTF-8"):
        idx.keys[row]
    assert idx.keys[row - 1] == "k1-0"      # the others still read


def test_errors_jsonl_cut_at_a_line_boundary_is_named_by_verify(tmp_path):
    """Cut between two lines, errors.jsonl still parses; only the manifest's count shows that bad
    samples or shards went unreported."""
    corpus = make_corpus(tmp_path / "shards", n_shards=1, samples_per_shard=2, bad=True)
    out = tmp_path / "idx"
    build_index(corpus.shards, out, progress=False)
    file = out / "errors.jsonl"
    lines = file.read_text(encoding="utf-8").splitlines(keepends=True)
    assert len(lines) >= 2 and verify_index(out) == []
    file.write_text("".join(lines[:-1]), encoding="utf-8")
    assert verify_index(out) == [f"index damaged: {file}: {len(lines) - 1} line(s), manifest.json says "
                                 f"num_errors {len(lines)} (errors were lost: rebuild the index)"]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"   # a zombie has ended
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def test_scan_workers_die_with_a_sigkilled_build_and_a_pipe_to_cat_ends(tmp_path):
    """The reproduction: ``tokenbal index build ... | cat`` with a worker busy on a shard; SIGKILL the
    build: its workers used to live on (blocked on their result pipe), holding the pipe open, and
    ``cat`` never ended."""
    corpus = make_corpus(tmp_path / "data", n_shards=2, samples_per_shard=2, seed=4, bad=False)
    hang = write_shard(tmp_path / "data" / "hang.tar", [Sample("h0", caption="x y z")])
    out = str(tmp_path / "idx")
    cmd = (f"{sys.executable} -m tests.helpers.index_kill --pool {out} {hang} {' '.join(corpus.shards)}"
           " | cat")
    pipeline = subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: os.path.exists(hang + ".pid") or pipeline.poll() is not None,
                 "a worker to start on hang.tar")
        assert pipeline.poll() is None
        with open(out + ".ready") as f:
            build_pid = int(f.read())
        with open(hang + ".pid") as f:
            worker_pid = int(f.read())
        os.kill(build_pid, signal.SIGKILL)
        try:
            pipeline.wait(GUARD)
        except subprocess.TimeoutExpired:
            pytest.fail("`index build | cat` did not end after the build was SIGKILLed")
        wait_for(lambda: _gone(worker_pid), "the scan worker to die with the build")
    finally:
        if pipeline.poll() is None:
            os.killpg(pipeline.pid, signal.SIGKILL)


def test_a_pool_build_leaves_no_executor_thread_to_race_interpreter_exit(tmp_path):
    """The racing build that exited 0 printing ``OSError: [Errno 9] Bad file descriptor``: Python
    3.11's concurrent.futures exit hook wakes an executor manager thread that may be closing that
    very pipe. The build now returns only after its manager thread has ended (no race left)."""
    from concurrent.futures.process import _ExecutorManagerThread

    corpus = make_corpus(tmp_path / "data", n_shards=3, samples_per_shard=2, seed=6, bad=False)
    build_index(corpus.shards, tmp_path / "idx", workers=2, progress=False)
    assert not [t for t in threading.enumerate() if isinstance(t, _ExecutorManagerThread) and t.is_alive()]


def test_a_flipped_bit_in_a_column_header_is_named(small_index):
    """Found by scripts/adversarial_index.py: a flipped byte in a ``.npy`` header dict made numpy raise
    ``tokenize.TokenError`` (not a ValueError), which escaped ``TokenIndex.open`` unnamed."""
    file = small_index / "lengths.npy"
    data = bytearray(file.read_bytes())
    at = data.index(b"(8,)")
    data[at + 3] = ord("(")                            # 'shape': (8,( }
    file.write_bytes(bytes(data))
    with pytest.raises(IndexDamagedError, match=f"index file {file} is damaged .TokenError"):
        TokenIndex.open(small_index)
    (problem,) = verify_index(small_index)
    assert problem.startswith("index damaged:") and str(file) in problem


def test_a_sample_whose_image_could_not_be_read_is_retried_by_the_next_build(tmp_path):
    """The sample-level half of "failed shards are never unchanged": an annotation record whose image
    read fails (here a symlink loop: ELOOP, an I/O error rather than a verdict on bytes) leaves the
    file's other samples indexed, marks the file's entry (``n_read_failures``), makes ``verify``
    report it, and the next build rescans the file although it did not change."""
    root = tmp_path / "images"
    root.mkdir()
    (root / "ok.png").write_bytes(image_bytes("png", 64, 48))
    os.symlink("loop.png", root / "loop.png")            # open() fails with ELOOP
    conv = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A picture."}]
    ann = tmp_path / "train.jsonl"
    ann.write_text("\n".join(json.dumps({"image": name, "conversations": conv})
                             for name in ("ok.png", "loop.png")) + "\n")
    out = tmp_path / "idx"
    first = build_index([str(ann)], out, image_root=str(root), progress=False)
    idx = TokenIndex.open(out)
    assert first.num_samples == 1 and "loop.png" in idx.errors[0]["reason"]
    assert idx.manifest["shards"][0]["n_read_failures"] == 1
    assert verify_index(out) == [f"shard partly failed at build time: {ann} (1 sample(s) could not be read, "
                                 "listed in errors.jsonl); rebuild the index to retry them"]
    assert verify_index(out, allow_failed=True) == []
    os.remove(root / "loop.png")
    (root / "loop.png").write_bytes(image_bytes("png", 32, 32))   # the image is readable again
    again = build_index([str(ann)], out, image_root=str(root), progress=False)
    assert (again.num_reused, again.num_samples) == (0, 2) and verify_index(out) == []
