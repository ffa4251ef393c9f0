"""IndexedShardDataset against real tar shards: bytes equal to tarfile's, webdataset decoders, long
names, and every kind of damage (stale index, missing / truncated shard, corrupt header / payload)."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import tarfile

import pytest
import torch
from PIL import Image

from tests.helpers.corpus import Sample, corrupt_header, member_offsets, write_shard
from tests.helpers.shards import as_members, build, first_key_batch, tar_members
from tokenbal import TokenBalancedBatchSampler
from tokenbal.data.indexed import IndexedShardDataset, SampleReadError
from tokenbal.index import TokenIndex, build_index
from tokenbal.io.tar import parse_tar_header


@pytest.fixture(scope="module")
def corpus_index(tmp_path_factory):
    return build(tmp_path_factory.mktemp("wds"))


@pytest.fixture
def own_index(tmp_path):
    """A corpus this test may damage."""
    return build(tmp_path, n_shards=2, samples_per_shard=5, seed=3)


# --- reading --------------------------------------------------------------------------------------


def test_raw_bytes_equal_tarfile(corpus_index):
    idx, shards = corpus_index
    truth = tar_members(shards)
    ds = IndexedShardDataset(idx, decode=None)
    seen = {}
    for i in range(len(ds)):
        s = ds[i]
        assert s["__key__"] == idx.keys[i] and s["__index__"] == i and s["__shard__"] == idx.shard(i)
        seen.update(as_members(s))
    assert seen == truth   # every member of every shard, byte for byte


def test_decoded_with_webdataset_handlers(corpus_index):
    idx, shards = corpus_index
    truth = tar_members(shards)
    ds = IndexedShardDataset(idx, decode="pil")
    n_img = 0
    for i in range(len(ds)):
        s = ds[i]
        for ext, v in s.items():
            if ext.startswith("__"):
                continue
            raw = truth[f"{s['__key__']}.{ext}"]
            if ext.rsplit(".", 1)[-1] in ("jpg", "png", "webp"):
                assert isinstance(v, Image.Image)
                assert v.size == Image.open(io.BytesIO(raw)).size
                n_img += 1
            elif ext == "txt":
                assert v == raw.decode("utf-8")
            elif ext == "json":
                assert isinstance(v, dict)
    assert n_img > 0
    # A user handler runs first, as in wds.decode(handler, "pil").
    shout = IndexedShardDataset(idx, decode=[lambda k, d: d.decode().upper() if k == ".txt" else None, "pil"])
    i = next(i for i in range(len(idx)) if any(m.name.endswith(".txt") for m in idx.members(i)))
    assert shout[i]["txt"] == ds[i]["txt"].upper()


def test_long_unicode_and_prefix_names(tmp_path):
    """PAX (webdataset TarWriter / tarfile default), GNU long names, ustar prefix split, non-ASCII."""
    long_key = "d" * 60 + "/" + "k" * 120            # > 100 bytes: PAX / GNU record, or ustar prefix
    keys = [long_key + "-a", "caf\u00e9/\u65e5\u672c-b", "x" * 90 + "/" + "y" * 50 + "-c", "short-d"]
    samples = [Sample(k, images=[("png", 20 + j, 10)], caption=f"caption {j}", seed=j)
               for j, k in enumerate(keys)]
    shards = []
    for fmt, name in ((tarfile.PAX_FORMAT, "pax"), (tarfile.GNU_FORMAT, "gnu")):
        path = str(tmp_path / f"{name}.tar")
        with tarfile.open(path, "w", format=fmt) as tf:
            for s in samples:
                for ext, data in s.members():
                    ti = tarfile.TarInfo(f"{s.key}.{ext}")
                    ti.size = len(data)
                    tf.addfile(ti, io.BytesIO(data))
        shards.append(path)
    ustar = samples[2:]   # ASCII, and each path splits into a 155-byte prefix and a 100-byte name
    shards.append(write_shard(tmp_path / "ustar.tar", [Sample(s.key, images=s.images, caption=s.caption,
                                                              seed=s.seed) for s in ustar]))
    build_index(shards, tmp_path / "idx", progress=False)
    idx = TokenIndex.open(tmp_path / "idx")
    assert len(idx) == 4 + 4 + 2
    ds = IndexedShardDataset(idx, decode=None)
    got = {}
    for i in range(len(ds)):
        got[(ds[i]["__shard__"], ds[i]["__key__"])] = as_members(ds[i])
    for shard in shards:
        truth = tar_members([shard])
        mine = {}
        for (sh, _), m in got.items():
            if sh == shard:
                mine.update(m)
        assert mine == truth, shard


_NEEDS_GNU_TAR = pytest.mark.skipif(shutil.which("tar") is None or "GNU tar" not in subprocess.run(
    ["tar", "--version"], capture_output=True, text=True).stdout, reason="needs GNU tar")


def _write_members(src, keys: list[str]) -> list[str]:
    """One small image sample per key as loose files under ``src`` (for GNU tar to pack); their names."""
    names = []
    for j, key in enumerate(keys):
        for ext, data in Sample(key, images=[("png", 20 + j, 10)], caption=f"caption {j}", seed=j).members():
            (src / key).parent.mkdir(parents=True, exist_ok=True)
            (src / f"{key}.{ext}").write_bytes(data)
            names.append(f"{key}.{ext}")
    return names


@_NEEDS_GNU_TAR
@pytest.mark.parametrize("fmt", ["oldgnu", "gnu", "posix"])
def test_long_names_written_by_gnu_tar(tmp_path, fmt):
    """GNU tar's formats keep a long name in a record and a truncated copy in the ustar field: 100
    bytes for gnu / posix, 99 (NUL-terminated) for oldgnu; every one reads, none is a "stale index"."""
    keys = ["d" * 60 + "/" + "k" * 120 + "-a", "\u00fc" * 70 + "-b", "z" * 99 + "-c", "short-d"]
    src = tmp_path / "src"
    names = _write_members(src, keys)
    shard = str(tmp_path / f"{fmt}.tar")
    subprocess.run(["tar", f"--format={fmt}", "-cf", shard, "-C", str(src), "--no-recursion", *names],
                   check=True, capture_output=True)
    build_index([shard], tmp_path / "idx", progress=False)
    idx = TokenIndex.open(tmp_path / "idx")
    assert len(idx) == 4 and not idx.errors
    ds = IndexedShardDataset(idx, decode=None)
    got = {}
    for i in range(len(ds)):
        got.update(as_members(ds[i]))
    assert got == tar_members([shard])


@_NEEDS_GNU_TAR
def test_gnu_incremental_archive_reads(tmp_path):
    """GNU tar --incremental fills the GNU atime / ctime fields, which tarfile (and so the index) reads
    as a ustar prefix of every name: the reader takes the header by the same rule, not as stale."""
    keys = ["k0", "k1", "d/" + "x" * 120 + "-long"]
    src = tmp_path / "src"
    names = _write_members(src, keys)
    shard = str(tmp_path / "incremental.tar")
    subprocess.run(["tar", "--format=gnu", "--incremental", "-cf", shard, "-C", str(src), "--no-recursion",
                    *names], check=True, capture_output=True)
    build_index([shard], tmp_path / "idx", progress=False)
    idx = TokenIndex.open(tmp_path / "idx")
    assert len(idx) == 3
    ds = IndexedShardDataset(idx, decode="pil")
    got = {}
    for i in range(len(ds)):
        got.update(as_members(ds.read_raw(i)))
        j = next(j for j, key in enumerate(keys) if idx.keys[i].endswith(key))
        assert ds[i]["png"].size == (20 + j, 10)
    assert got == tar_members([shard])


def test_every_regular_member_type_the_index_takes_reads(tmp_path):
    """Type "0", the old "\\0" and contiguous "7" members are all regular files to tarfile (and the
    index): the reader returns their bytes instead of calling the index stale."""
    samples = [Sample(f"k{j}", images=[("png", 20 + j, 10)], caption=f"caption {j}", seed=j)
               for j in range(3)]
    path = str(tmp_path / "types.tar")
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for s, kind in zip(samples, (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE), strict=True):
            for ext, data in s.members():
                ti = tarfile.TarInfo(f"{s.key}.{ext}")
                ti.size, ti.type = len(data), kind
                tf.addfile(ti, io.BytesIO(data))
    build_index([path], tmp_path / "idx", progress=False)
    idx = TokenIndex.open(tmp_path / "idx")
    assert len(idx) == 3 and not idx.errors
    ds = IndexedShardDataset(idx, decode="pil")
    got = {}
    for i in range(len(ds)):
        got.update(as_members(ds.read_raw(i)))
        assert ds[i]["png"].size == (20 + i, 10)
    assert got == tar_members([path])


def test_parse_tar_header_matches_tarfile(corpus_index):
    _, shards = corpus_index
    with open(shards[0], "rb") as f:
        data = f.read()
    for name, _, off, size in member_offsets(shards[0]):
        stored, hsize, typeflag = parse_tar_header(data[off - 512:off])
        assert (stored.decode(), hsize, typeflag) == (name, size, b"0")
    with pytest.raises(ValueError, match="checksum"):
        parse_tar_header(bytes([data[0] ^ 1]) + data[1:512])
    with pytest.raises(ValueError, match="end of archive"):
        parse_tar_header(b"\0" * 512)
    # GNU base-256 size (members over 8 GiB); tobuf writes the header only, no payload.
    big = tarfile.TarInfo("k/big.bin")
    big.size = 1 << 34
    assert parse_tar_header(big.tobuf(tarfile.GNU_FORMAT)) == (b"k/big.bin", 1 << 34, b"0")
    # The historic signed checksum (bytes > 127 counted negative), which tarfile also accepts.
    hdr = bytearray(tarfile.TarInfo("caf\u00e9.txt").tobuf(tarfile.GNU_FORMAT, encoding="utf-8"))
    hdr[148:156] = b" " * 8
    signed = sum(b - 256 if b > 127 else b for b in hdr)
    hdr[148:156] = b"%06o\0 " % signed
    assert parse_tar_header(bytes(hdr))[0] == "caf\u00e9.txt".encode()


def test_getitems_order_lru_and_pickle(corpus_index):
    idx, _ = corpus_index
    ds = IndexedShardDataset(idx, decode=None, max_open_shards=1)
    order = [20, 0, 14, 1, 7, 19]
    batch = ds.__getitems__(order)
    assert [s["__index__"] for s in batch] == order
    assert [s for s in batch] == [ds[i] for i in order]
    # Batch reads are sorted by shard: 3 shards -> 3 opens even with an LRU of one.
    ds2 = IndexedShardDataset(idx, decode=None, max_open_shards=1)
    ds2.__getitems__(order)
    assert ds2.shards_opened == 3
    # Alternating single reads with an LRU of one reopen every time; of two, they do not.
    for size, want in ((1, 4), (2, 2)):
        d = IndexedShardDataset(idx, decode=None, max_open_shards=size)
        for i in (0, 20, 0, 20):
            d[i]
        assert d.shards_opened == want
    # Pickling (spawn workers) carries the index path, not the arrays nor open handles.
    blob = pickle.dumps(ds)
    assert len(blob) < 4096
    again = pickle.loads(blob)
    assert again[5] == ds[5] and again.shards_opened == 1


# --- damage ---------------------------------------------------------------------------------------


def _rewrite_with_insert(shard: str) -> None:
    """Re-tar ``shard`` with one new sample in front: every old offset now points elsewhere."""
    with tarfile.open(shard, "r:") as tf:
        members = [(ti, tf.extractfile(ti).read()) for ti in tf]
    tmp = shard + ".new"
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tf:
        new = tarfile.TarInfo("zz/inserted.txt")
        new.size = 3
        tf.addfile(new, io.BytesIO(b"new"))
        for ti, data in members:
            tf.addfile(ti, io.BytesIO(data))
    os.replace(tmp, shard)


def test_stale_index_is_an_error_not_other_bytes(own_index):
    idx, shards = own_index
    _rewrite_with_insert(shards[1])
    ds = IndexedShardDataset(idx, decode=None)
    first_in_1 = next(i for i in range(len(idx)) if idx.shard(i) == shards[1])
    with pytest.raises(SampleReadError, match="stale index") as e:
        ds[first_in_1]
    assert shards[1] in str(e.value) and repr(idx.keys[first_in_1]) in str(e.value)
    stale = 0
    for i in range(len(idx)):
        if idx.shard(i) == shards[1]:
            with pytest.raises(SampleReadError, match="stale index"):
                ds[i]
            stale += 1
        else:
            ds[i]   # the untouched shard still reads
    assert stale == 5


def test_stale_index_same_name_other_size(own_index):
    """A member rewritten in place with a different size: the name matches, the size does not."""
    idx, shards = own_index
    with tarfile.open(shards[0], "r:") as tf:
        members = [(ti, tf.extractfile(ti).read()) for ti in tf]
    with tarfile.open(shards[0], "w", format=tarfile.USTAR_FORMAT) as tf:
        for ti, data in members:
            if ti.name == members[0][0].name:
                data = data + b"\0" * 7
                ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    ds = IndexedShardDataset(idx, decode=None)
    with pytest.raises(SampleReadError, match=r"stale index.*with \d+ bytes"):
        ds[0]


def test_missing_shard(own_index):
    idx, shards = own_index
    os.remove(shards[0])
    ds = IndexedShardDataset(idx, decode=None)
    with pytest.raises(SampleReadError, match="shard missing") as e:
        ds[0]
    assert shards[0] in str(e.value) and repr(idx.keys[0]) in str(e.value)


def test_truncated_shard(own_index):
    idx, shards = own_index
    _, _, data, size = member_offsets(shards[0])[-1]
    os.truncate(shards[0], data + size // 2)
    ds = IndexedShardDataset(idx, decode=None)
    last = max(i for i in range(len(idx)) if idx.shard(i) == shards[0])
    with pytest.raises(SampleReadError, match="shard truncated") as e:
        ds[last]
    assert shards[0] in str(e.value) and repr(idx.keys[last]) in str(e.value)
    ds[0]   # members before the cut still read


def test_corrupt_header(own_index):
    idx, shards = own_index
    name = member_offsets(shards[0])[1][0]
    corrupt_header(shards[0], 1)
    i = next(i for i in range(len(idx)) if any(m.name == name for m in idx.members(i)))
    with pytest.raises(SampleReadError, match="corrupt shard.*checksum") as e:
        IndexedShardDataset(idx, decode=None)[i]
    assert name in str(e.value) and shards[0] in str(e.value)


def corrupt_payload(idx: TokenIndex, ext: str = "jpg") -> int:
    """Overwrite the first ``ext`` payload with garbage (header intact); returns its sample."""
    for i in range(len(idx)):
        for m in idx.members(i):
            if m.name.endswith("." + ext):
                with open(m.shard, "r+b") as f:
                    f.seek(m.offset)
                    f.write(b"\x00garbage" * (min(m.size, 64) // 8))
                return i
    raise AssertionError(f"no {ext} member")


def test_corrupt_payload_raise_or_mark(own_index):
    idx, _ = own_index
    i = corrupt_payload(idx)
    assert IndexedShardDataset(idx, decode=None)[i]   # bytes are what the shard holds
    with pytest.raises(SampleReadError, match="cannot decode member") as e:
        IndexedShardDataset(idx, decode="pil")[i]
    assert repr(idx.keys[i])[1:-1] in str(e.value) and idx.shard(i) in str(e.value)
    marked = IndexedShardDataset(idx, decode="pil", on_error="mark")
    s = marked[i]
    assert s["__key__"] == idx.keys[i] and "cannot decode" in s["__error__"]
    assert not [k for k in s if not k.startswith("__")]
    assert "__error__" not in marked[(i + 1) % len(idx)]


def test_bad_arguments(corpus_index):
    idx, shards = corpus_index
    with pytest.raises(ValueError, match="on_error"):
        IndexedShardDataset(idx, on_error="skip")
    with pytest.raises(ValueError, match="3 shards"):
        IndexedShardDataset(idx, shards=["a.tar"])
    with pytest.raises(TypeError, match="decode"):
        IndexedShardDataset(idx, decode=[3])
    moved = IndexedShardDataset(idx, decode=None, shards=lambda p: p + ".gone")
    with pytest.raises(SampleReadError, match=r"shard missing: .*\.gone"):
        moved[0]


# --- DataLoader -----------------------------------------------------------------------------------


def _epoch(ds, sampler, workers):
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=workers,
                                         collate_fn=first_key_batch, timeout=60 if workers else 0)
    return [[(s["__key__"], as_members(s)) for s in batch] for batch in loader]


def test_dataloader_workers_do_not_change_order(corpus_index):
    idx, shards = corpus_index
    ds = IndexedShardDataset(idx, decode=None, max_open_shards=2)
    runs = {}
    for workers in (0, 2):
        sampler = TokenBalancedBatchSampler(idx, num_replicas=2, rank=1, global_batch_size=6, seed=5)
        sampler.set_epoch(1)
        runs[workers] = _epoch(ds, sampler, workers)
    assert runs[0] == runs[2]
    assert len(runs[0]) == len(sampler) and all(runs[0])
    truth = tar_members(shards)
    for batch in runs[0]:
        for _, members in batch:
            assert all(truth[k] == v for k, v in members.items())


def test_dataloader_worker_error_surfaces(own_index):
    idx, _ = own_index
    bad = corrupt_payload(idx)
    ds = IndexedShardDataset(idx, decode="pil")
    sampler = TokenBalancedBatchSampler(idx, num_replicas=1, rank=0, global_batch_size=2, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=2,
                                         collate_fn=first_key_batch, timeout=60)
    with pytest.raises(SampleReadError, match="cannot decode member") as e:
        for _ in loader:
            pass
    assert idx.keys[bad] in str(e.value)


def test_fewer_samples_than_ranks(tmp_path):
    idx, shards = build(tmp_path, n_shards=1, samples_per_shard=3)
    ds = IndexedShardDataset(idx, decode=None)
    per_rank = []
    for rank in range(4):
        sampler = TokenBalancedBatchSampler(idx, num_replicas=4, rank=rank, global_batch_size=4)
        per_rank.append(_epoch(ds, sampler, 0))
    assert len({len(r) for r in per_rank}) == 1       # same number of steps on every rank
    keys = [k for r in per_rank for batch in r for k, _ in batch]
    assert sorted(keys) == sorted(idx.keys)           # every sample once
    assert any(batch == [] for r in per_rank for batch in r)   # the empty rank still gets a step


def test_fork_reopens_handles(corpus_index):
    """Handles opened in the parent are not reused by a forked child (it opens its own)."""
    import multiprocessing as mp

    global _DS
    idx, _ = corpus_index
    _DS = IndexedShardDataset(idx, decode=None)
    _DS[0]
    assert _DS.shards_opened == 1
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_read_inherited, args=(0, send))   # inherits _DS, open fd and all
    try:
        child.start()
        assert recv.poll(60), "child did not answer"
        child_opened, child_pid, child_sample = recv.recv()
        child.join(60)
    finally:
        ds, _DS = _DS, None
    assert child.exitcode == 0
    assert child_pid != os.getpid() and child_opened == 1 and child_sample == ds[0]


_DS = None


def _read_inherited(i, send):
    assert _DS is not None and _DS._readers.pid != os.getpid()   # inherited, not pickled
    s = _DS[i]
    send.send((_DS.shards_opened, _DS._readers.pid, s))


def _host_store():
    """An fsspec store addressed by host, as ftp:// and sftp:// are (``tbhost://HOST/path``): the host
    comes from the URL (``_get_kwargs_from_urls``) and the filesystem cannot be made without one."""
    from urllib.parse import urlsplit

    fsspec = pytest.importorskip("fsspec")
    from fsspec.spec import AbstractFileSystem

    class HostStore(AbstractFileSystem):
        protocol = "tbhost"
        objects: dict = {}     # (host, path) -> bytes

        def __init__(self, host, **kwargs):
            super().__init__(**kwargs)
            self.host = host

        @staticmethod
        def _get_kwargs_from_urls(url):
            return {"host": urlsplit(url).hostname}

        @classmethod
        def _strip_protocol(cls, path):
            return urlsplit(path).path if "://" in path else path

        def info(self, path, **kwargs):
            path = self._strip_protocol(path)
            if (self.host, path) not in self.objects:
                raise FileNotFoundError(f"{self.host}:{path}")
            return {"name": path, "size": len(self.objects[self.host, path]), "type": "file"}

        def cat_file(self, path, start=None, end=None, **kwargs):
            self.info(path)
            return self.objects[self.host, self._strip_protocol(path)][start:end]

    fsspec.register_implementation("tbhost", HostStore, clobber=True)
    return HostStore


def test_urls_on_two_hosts_read_each_from_its_own_host(corpus_index):
    """The host an ftp:// / sftp://-style URL names is where the shard is read, for every shard: the
    reader makes its filesystem from the URL, not one per protocol without the host."""
    idx, shards = corpus_index
    store = _host_store()
    urls = []
    for j, path in enumerate(shards):        # the same path on each host, different shards behind it
        with open(path, "rb") as f:
            store.objects[f"host{j}", "/data/shard.tar"] = f.read()
        urls.append(f"tbhost://host{j}/data/shard.tar")
    ds = IndexedShardDataset(idx, decode=None, shards=urls)
    got = {}
    for i in range(len(ds)):
        s = ds[i]
        assert s["__shard__"] == urls[int(idx.shard_ids[i])]
        got.update(as_members(s))
    assert got == tar_members(shards)


def test_copy_of_tree_reads_with_shards_mapping(corpus_index, tmp_path):
    """Shards moved after indexing: ``shards=`` points the index at the new place."""
    idx, shards = corpus_index
    moved = [shutil.copy(s, tmp_path / os.path.basename(s)) for s in shards]
    ds = IndexedShardDataset(idx, decode=None, shards=[str(m) for m in moved])
    assert ds[4]["__shard__"].startswith(str(tmp_path))
    assert as_members(ds[4]) == as_members(IndexedShardDataset(idx, decode=None)[4])


def test_annotation_records_read_their_image_files(tmp_path):
    """JSON/JSONL annotation sources: members are whole image files (offset 0), read and size-checked."""
    import json

    from tests.helpers.corpus import image_bytes

    files = {"a.jpg": image_bytes("jpg", 64, 48), "b.png": image_bytes("png", 32, 32, seed=1)}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    records = [{"image": "a.jpg", "text": "one"}, {"images": ["a.jpg", "b.png"], "text": "two"}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    try:
        build_index([str(tmp_path / "data.jsonl")], tmp_path / "idx", progress=False)
    except (ValueError, FileNotFoundError) as e:
        pytest.skip(f"this tree's index build does not take annotation files: {e}")
    idx = TokenIndex.open(tmp_path / "idx")
    ds = IndexedShardDataset(idx, decode=None)
    assert ds[0]["jpg"] == files["a.jpg"]
    assert (ds[1]["0.jpg"], ds[1]["1.png"]) == (files["a.jpg"], files["b.png"])
    assert IndexedShardDataset(idx, decode="pil")[1]["1.png"].size == (32, 32)
    (tmp_path / "b.png").write_bytes(files["b.png"] + b"\0")
    with pytest.raises(SampleReadError, match=r"stale index: file .*b\.png.*more bytes"):
        ds[1]
    os.remove(tmp_path / "a.jpg")   # a fresh dataset: an open descriptor would still read the old file
    with pytest.raises(SampleReadError, match=r"file missing: .*a\.jpg"):
        IndexedShardDataset(idx, decode=None)[0]


def _open_descriptors_of(paths) -> int:
    """How many of this process's file descriptors point at one of ``paths`` (Linux /proc)."""
    wanted = {os.path.realpath(p) for p in paths}
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") in wanted
        except OSError:
            pass
    return n


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors through /proc")
def test_a_dropped_dataset_closes_its_shards(corpus_index):
    import gc

    idx, shards = corpus_index
    gc.collect()     # datasets of earlier tests that only a collection frees: not counted here
    before = _open_descriptors_of(shards)
    for _ in range(5):
        ds = IndexedShardDataset(idx, decode=None)
        for i in range(len(ds)):
            ds[i]
        assert _open_descriptors_of(shards) == before + len(shards)
        del ds
        gc.collect()
        assert _open_descriptors_of(shards) == before
