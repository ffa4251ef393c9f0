"""Parquet sources in Hugging Face datasets' layout (images as bytes, multi-image rows): the index
counts what a tar build of the same samples counts; IndexedParquetDataset returns the rows."""

from __future__ import annotations

import random

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from tests.helpers.corpus import SIZES, WORDS, Sample, write_shard  # noqa: E402
from tokenbal.cli import main  # noqa: E402
from tokenbal.data import IndexedParquetDataset  # noqa: E402
from tokenbal.index import ParquetOptions, TokenIndex, build_index  # noqa: E402

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _samples(kind: str, n: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)

    def sentence(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    out = []
    for i in range(n):
        k = rng.randrange(0, 4) if kind == "messages" else 1
        images = [(rng.choice(["jpg", "png", "webp"]), *rng.choice(SIZES)) for _ in range(k)]
        if kind == "messages":
            turns = [{"role": "user", "content": "<image>" * k + sentence(rng.randrange(3, 30))},
                     {"role": "assistant", "content": sentence(rng.randrange(1, 50))}]
            out.append(Sample(f"{kind}{i:03d}", images=images, messages=turns, seed=seed * 100 + i))
        else:
            turns = [{"from": "human", "value": "<image>\n" + sentence(8)},
                     {"from": "gpt", "value": sentence(rng.randrange(1, 40))}]
            out.append(Sample(f"{kind}{i:03d}", images=images, conversations=turns, seed=seed * 100 + i))
    return out


def _image_bytes(s: Sample) -> list[bytes]:
    return [data for ext, data in s.members() if ext.rsplit(".", 1)[-1] in ("jpg", "png", "webp")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("pq")
    chats, convs = _samples("messages", 11, 1), _samples("conv", 5, 2)
    # HF datasets' layout: `images` a list of {bytes, path}, `messages` a list of {role, content}.
    t1 = pa.table({
        "id": [s.key for s in chats],
        "images": pa.array([[{"bytes": b, "path": f"{s.key}-{j}.img"} for j, b in enumerate(_image_bytes(s))]
                            for s in chats], pa.list_(IMAGE)),
        "messages": [s.messages for s in chats],
        "unused": [b"x" * 1000] * len(chats),
    })
    # One image per row (`image`, a struct) and LLaVA `conversations`.
    t2 = pa.table({
        "image": pa.array([{"bytes": _image_bytes(s)[0], "path": None} for s in convs], IMAGE),
        "conversations": [s.conversations for s in convs],
    })
    pq.write_table(t1, root / "a.parquet", row_group_size=4)
    pq.write_table(t2, root / "b.parquet", row_group_size=2)
    write_shard(root / "a.tar", chats)
    write_shard(root / "b.tar", convs)
    return root, chats + convs


def test_parquet_counts_equal_tar(data, tmp_path):
    root, samples = data
    build_index([str(root / "a.tar"), str(root / "b.tar")], tmp_path / "tar", progress=False)
    rc = main(["index", "build", str(root / "*.parquet"), "--out", str(tmp_path / "pq"), "-q"])
    assert rc == 0
    t, p = TokenIndex.open(tmp_path / "tar"), TokenIndex.open(tmp_path / "pq")
    assert len(p) == len(t) == len(samples) and p.errors == []
    for col in ("lengths", "vision_tokens", "text_tokens"):
        np.testing.assert_array_equal(np.asarray(getattr(p, col)), np.asarray(getattr(t, col)))
    assert [p.image_sizes(i) for i in range(len(p))] == [s.image_sizes for s in samples]
    assert max(len(s.images) for s in samples) >= 2 and min(len(s.images) for s in samples) == 0
    assert p.keys[5] == "a.parquet:1:1" and p.keys[len(p) - 1] == "b.parquet:2:0"


def test_indexed_parquet_dataset_returns_rows(data, tmp_path):
    root, samples = data
    build_index([str(root / "a.parquet"), str(root / "b.parquet")], tmp_path / "pq", progress=False)
    ds = IndexedParquetDataset(tmp_path / "pq")
    assert len(ds) == len(samples)
    for i in (0, 5, 10):
        row = ds[i]
        assert row["id"] == samples[i].key and row["messages"] == samples[i].messages
        assert [im["bytes"] for im in row["images"]] == _image_bytes(samples[i])
    batch = ds.__getitems__([12, 3, 15, 0])
    assert [b["__index__"] for b in batch] == [12, 3, 15, 0]
    assert batch[0]["conversations"] == samples[12].conversations
    pil = IndexedParquetDataset(tmp_path / "pq", columns=["image"], decode_images="pil")
    assert pil[13]["image"].size == samples[13].image_sizes[0]
    from tokenbal.data.indexed import IndexedShardDataset, SampleReadError

    with pytest.raises(SampleReadError, match="IndexedParquetDataset"):
        IndexedShardDataset(tmp_path / "pq", decode=None)[0]


def test_parquet_bad_rows_and_columns_are_errors(data, tmp_path):
    root, samples = data
    good = _image_bytes(samples[-1])[0]
    t = pa.table({"images": pa.array([[{"bytes": None, "path": "lost.jpg"}],
                                      [{"bytes": b"not an image at all", "path": None}],
                                      [{"bytes": good, "path": None}]], pa.list_(IMAGE)),
                  "text": ["a", "b", "c"]})
    pq.write_table(t, tmp_path / "bad.parquet")
    build_index([str(tmp_path / "bad.parquet")], tmp_path / "i", progress=False)
    idx = TokenIndex.open(tmp_path / "i")
    assert len(idx) == 1 and idx.keys[0] == "bad.parquet:0:2"
    reasons = [e["reason"] for e in idx.errors]
    assert "row group 0 row 0: image 0 ('lost.jpg') has no bytes" in reasons[0]
    assert "row 1: image 0 is not a readable image" in reasons[1]
    # A named column the file lacks: one file-level error naming the column.
    build_index([str(tmp_path / "bad.parquet")], tmp_path / "j", progress=False,
                parquet=ParquetOptions(messages_column="chat"))
    (err,) = TokenIndex.open(tmp_path / "j").errors
    assert err["key"] is None and "column 'chat' not in the file" in err["reason"]



def test_rows_without_image_values_are_text_rows_not_a_bad_file(data, tmp_path):
    """An images column with no image value in the whole file (Arrow types it ``list<null>``: every
    row an empty list, as in a file of text and video rows) and a one-image column with a null row
    (a text row of a datasets ``Image()`` column): those rows have no image and are counted as text,
    the file is not refused; a null inside a list of images is that row's error."""
    root, samples = data
    good = _image_bytes(samples[-1])[0]
    pq.write_table(pa.table({"images": [[], []], "text": ["one", "two words"]}), tmp_path / "none.parquet")
    pq.write_table(pa.table({"image": pa.array([None, {"bytes": good, "path": None}], IMAGE),
                             "text": ["text only", "with an image"]}), tmp_path / "some.parquet")
    pq.write_table(pa.table({"images": pa.array([[None], []], pa.list_(pa.null())), "text": ["a", "b"]}),
                   tmp_path / "nulls.parquet")
    assert pa.types.is_null(pq.read_table(tmp_path / "none.parquet").column("images").type.value_type)
    files = [str(tmp_path / f) for f in ("none.parquet", "some.parquet", "nulls.parquet")]
    report = build_index(files, tmp_path / "i", progress=False)
    idx = TokenIndex.open(tmp_path / "i")
    assert report.num_bad_shards == 0
    assert list(idx.keys) == ["none.parquet:0:0", "none.parquet:0:1", "some.parquet:0:0", "some.parquet:0:1",
                              "nulls.parquet:0:1"]
    assert idx.vision_tokens.tolist()[:3] == [0, 0, 0] and idx.vision_tokens[3] > 0
    assert [idx.image_sizes(i) for i in range(3)] == [[], [], []]
    (err,) = idx.errors
    assert err["key"] == "nulls.parquet:0:0" and "image 0 has no bytes" in err["reason"]

def test_remote_parquet_equals_local(data, tmp_path):
    pytest.importorskip("aiohttp")
    from tests.helpers.servers import FAST, serve

    root, samples = data
    build_index([str(root / "a.parquet"), str(root / "b.parquet")], tmp_path / "local", progress=False)
    with serve(str(root), latency=0.002, fail_at=(2,)) as (base, httpd):
        build_index([f"{base}/{{a,b}}.parquet"], tmp_path / "remote", progress=False, remote=FAST)
        local, remote = TokenIndex.open(tmp_path / "local"), TokenIndex.open(tmp_path / "remote")
        for col in ("lengths", "vision_tokens", "text_tokens"):
            np.testing.assert_array_equal(np.asarray(getattr(local, col)), np.asarray(getattr(remote, col)))
        assert list(local.keys) == list(remote.keys) and httpd.failed == 1
        assert [e["fingerprint"] for e in local.manifest["shards"]] == \
            [e["fingerprint"] for e in remote.manifest["shards"]]
        assert remote.shard_paths == [f"{base}/a.parquet", f"{base}/b.parquet"]
        row = IndexedParquetDataset(remote)[7]
        assert row["messages"] == samples[7].messages and row["__shard__"] == f"{base}/a.parquet"


def test_parquet_images_follow_the_index_exif_policy(tmp_path):
    """A rotated phone photo in a Parquet row is counted, and decoded by IndexedParquetDataset, as
    transformers' load_image sees it (the same EXIF policy as tar shards), or as stored with 'ignore'."""
    from PIL import Image, ImageOps

    from tests.helpers.corpus import rotated_jpeg

    photos = [rotated_jpeg(tmp_path / f"p{o}.jpg", 90, 30, o) for o in (6, 1, 8)]
    pq.write_table(pa.table({"images": pa.array([[{"bytes": b, "path": None}] for b in photos],
                                                pa.list_(IMAGE)),
                             "text": ["a photo"] * len(photos)}), tmp_path / "p.parquet")
    want = [ImageOps.exif_transpose(Image.open(tmp_path / f"p{o}.jpg")).size for o in (6, 1, 8)]
    assert want == [(30, 90), (90, 30), (30, 90)]
    for exif, sizes in (("transpose", want), ("ignore", [(90, 30)] * 3)):
        idx = TokenIndex.open(build_index([str(tmp_path / "p.parquet")], tmp_path / exif, exif=exif,
                                          progress=False).out)
        assert idx.manifest["exif"] == exif and idx.errors == []
        assert [idx.image_sizes(i)[0] for i in range(len(idx))] == sizes
        ds = IndexedParquetDataset(idx, decode_images="pil")
        assert [ds[i]["images"][0].size for i in range(len(ds))] == sizes


def test_remote_parquet_reads_are_retried_and_a_lasting_failure_is_a_read_failure(data, tmp_path):
    """Issue 33: a passing 503 on a column-chunk read (after the footer) used to fail the file as
    "corrupt"; now each ranged read is retried, and a failure that lasts is "unreadable" (rescanned
    by the next build, reported by verify)."""
    pytest.importorskip("aiohttp")
    import threading

    from tests.helpers.servers import FAST, serve
    from tokenbal.index import verify_index

    _, samples = data
    root, samples = tmp_path / "files", samples[:11]
    root.mkdir()
    # Large enough (incompressible filler) that column chunks are read apart from the footer's read.
    rng = random.Random(0)
    pq.write_table(pa.table({
        "images": pa.array([[{"bytes": b, "path": None} for b in _image_bytes(s)] for s in samples],
                           pa.list_(IMAGE)),
        "messages": [s.messages for s in samples],
        "filler": [rng.randbytes(40_000) for _ in samples]}), root / "a.parquet", row_group_size=4)
    size = (root / "a.parquet").stat().st_size
    footer = size - 8 - pq.ParquetFile(root / "a.parquet").metadata.serialized_size
    lock, seen, mode = threading.Lock(), [0], ["every other"]

    def column_chunks(path, rng):   # the reads of row groups' column chunks, not footer / fingerprint
        if not path.endswith("a.parquet") or rng is None or not 0 < int(rng[6:].split("-")[0]) < footer:
            return False
        with lock:
            seen[0] += 1
            return mode[0] == "always" or seen[0] % 2 == 1

    build_index([str(root / "a.parquet")], tmp_path / "local", progress=False)
    local = TokenIndex.open(tmp_path / "local")
    with serve(str(root), fail_if=column_chunks) as (base, httpd):
        url = f"{base}/a.parquet"
        build_index([url], tmp_path / "remote", progress=False, remote=FAST)
        remote = TokenIndex.open(tmp_path / "remote")
        assert httpd.failed > 0 and remote.errors == []
        np.testing.assert_array_equal(np.asarray(remote.lengths), np.asarray(local.lengths))
        row = IndexedParquetDataset(remote)[6]          # the reader retries too
        assert row["messages"] == samples[6].messages
        mode[0] = "always"
        build_index([url], tmp_path / "down", progress=False, remote=FAST)
        (entry,) = TokenIndex.open(tmp_path / "down").manifest["shards"]
        assert entry["status"] == "unreadable" and url in entry["reason"]
        assert any(p.startswith(f"shard failed at build time: {url}")
                   for p in verify_index(tmp_path / "down", remote=FAST))


@pytest.mark.parametrize("checksums", [True, False])
def test_a_flipped_bit_in_a_text_page_is_an_error_when_the_file_has_page_checksums(tmp_path, checksums):
    """Issue 33: Parquet's pages carry a CRC only when the writer stores one (pyarrow's
    write_page_checksum=True; not the default). With it, the build checks it: a flipped bit in a
    text value is a file error. Without it nothing can tell (documented): the row's text changes."""
    text = "the quick brown fox jumps over the lazy dog " * 4
    pq.write_table(pa.table({"text": [text, "another row"]}), tmp_path / "t.parquet", compression="none",
                   write_page_checksum=checksums)
    data = bytearray((tmp_path / "t.parquet").read_bytes())
    at = data.index(b"lazy dog")
    data[at] ^= 0x01                               # "lazy" -> "mazy"
    (tmp_path / "t.parquet").write_bytes(bytes(data))
    report = build_index([str(tmp_path / "t.parquet")], tmp_path / "i", progress=False)
    idx = TokenIndex.open(tmp_path / "i")
    if checksums:
        (err,) = idx.errors
        assert report.num_samples == 0 and err["key"] is None and "t.parquet" in err["reason"]
        assert "CRC" in err["reason"] or "checksum" in err["reason"].lower()
    else:
        assert report.num_samples == 2 and idx.errors == []


def test_a_parquet_file_reports_its_rows_after_each_row_group(tmp_path):
    """A Parquet file of millions of rows was scanned in silence: each row group scanned is reported,
    then the samples whose text is counted, as for tar shards and annotation files."""
    texts = [f"caption {i}" for i in range(10)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "t.parquet", row_group_size=3)
    path = str(tmp_path / "t.parquet")
    reports = []
    build_index([path], tmp_path / "i", progress=lambda *r: reports.append(r))
    assert [r[1:] for r in reports] == [(3, 10, "rows"), (6, 10, "rows"), (9, 10, "rows"), (10, 10, "rows"),
                                        (10, 10, "samples")]
    assert len(TokenIndex.open(tmp_path / "i")) == 10
