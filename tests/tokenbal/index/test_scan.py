"""Shard scanning: sources, member names, header-only image sizes, text rules, damaged shards."""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile

import pytest
from PIL import Image

from tests.helpers.corpus import (
    Sample,
    corrupt_header,
    image_bytes,
    member_offsets,
    strip_end_blocks,
    truncate_bytes,
    truncate_mid_payload,
    write_shard,
)
from tokenbal.index.imagesize import ImageSizeError, image_size, read_image_size, webp_size
from tokenbal.index.scan import scan_shard, shard_fingerprint, split_name
from tokenbal.index.sources import expand_braces, expand_sources
from tokenbal.index.text import SampleTextError, join_text, json_text, text_pieces


def write_members(path, members: list[tuple[str, bytes]]) -> str:
    """A tar with exactly these (name, bytes) members, in this order."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for name, data in members:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return os.fspath(path)


JPG = image_bytes("jpg", 40, 30)


# --- sources and names ---------------------------------------------------------------------------

def test_expand_braces():
    assert expand_braces("d-{000..003}.tar") == [f"d-{i:03d}.tar" for i in range(4)]
    assert expand_braces("d-{8..11}.tar") == ["d-8.tar", "d-9.tar", "d-10.tar", "d-11.tar"]
    assert expand_braces("{a,b}/x-{0..1}.tar") == ["a/x-0.tar", "a/x-1.tar", "b/x-0.tar", "b/x-1.tar"]
    assert expand_braces("x-{a,{b,c}}.tar") == ["x-a.tar", "x-b.tar", "x-c.tar"]
    assert expand_braces("plain.tar") == ["plain.tar"]
    assert expand_braces("odd{x}.tar") == ["odd{x}.tar"]


def test_expand_sources(tmp_path):
    for i in range(3):
        (tmp_path / f"d-{i:02d}.tar").write_bytes(b"")
    got = expand_sources([str(tmp_path / "d-{00..01}.tar"), str(tmp_path / "*.tar")])
    assert got == [str(tmp_path / f"d-{i:02d}.tar") for i in (0, 1, 2)]   # ordered, no duplicates
    with pytest.raises(FileNotFoundError, match=r"d-07\.tar"):
        expand_sources([str(tmp_path / "d-{00..07}.tar")])
    with pytest.raises(FileNotFoundError, match="matches no file"):
        expand_sources([str(tmp_path / "nope-*.tar")])
    with pytest.raises(ValueError, match="is a directory"):
        expand_sources([str(tmp_path)])
    (tmp_path / "ann.jsonl").write_text("{}\n")     # annotation files are sources too
    assert expand_sources([str(tmp_path / "ann.jsonl")]) == [str(tmp_path / "ann.jsonl")]


@pytest.mark.parametrize("name, want", [
    ("k.jpg", ("k", "jpg")),
    ("a/b/0001.0.jpg", ("a/b/0001", "0.jpg")),
    ("v1.2/x.y/0001.json", ("v1.2/x.y/0001", "json")),
    ("noext", None),
    ("dir/.hidden", None),
    ("dir.d/noext", None),
])
def test_split_name(name, want):
    assert split_name(name) == want


# --- image sizes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["jpg", "png", "webp", "webp-lossless", "webp-alpha", "gif", "bmp"])
@pytest.mark.parametrize("wh", [(1, 1), (37, 1000), (1920, 1080), (16383, 3)])
def test_image_size_matches_pillow(fmt, wh):
    if fmt.startswith("webp") and max(wh) > 16383:
        pytest.skip("WebP max dimension")
    data = image_bytes(fmt, *wh)
    assert image_size(data) == wh
    assert image_size(data[:30] if fmt.startswith("webp") else data) == wh   # WebP: 30 bytes suffice
    with Image.open(io.BytesIO(data)) as im:
        assert im.size == wh


def test_webp_chunk_kinds():
    # The three WebP header layouts are each exercised (and each parsed from 30 bytes).
    chunks = {fmt: image_bytes(fmt, 301, 77)[12:16] for fmt in ("webp", "webp-lossless", "webp-alpha")}
    assert chunks == {"webp": b"VP8 ", "webp-lossless": b"VP8L", "webp-alpha": b"VP8X"}
    assert webp_size(JPG[:30]) is None
    with pytest.raises(ImageSizeError, match="unknown first chunk"):
        webp_size(b"RIFF\0\0\0\0WEBPXXXX" + bytes(14))


def test_read_image_size_prefix_and_fallback(tmp_path):
    big_icc = image_bytes("jpg", 640, 480, icc_size=200_000)   # SOF sits past a 64 KiB prefix
    assert len(big_icc) > 200_000
    webp = image_bytes("webp", 99, 98)
    path = write_members(tmp_path / "s.tar", [("a.jpg", JPG), ("b.jpg", big_icc), ("c.webp", webp)])
    fd = os.open(path, os.O_RDONLY)
    try:
        (_, _, off_a, size_a), (_, _, off_b, size_b), (_, _, off_c, size_c) = member_offsets(path)
        assert read_image_size(fd, off_a, size_a) == ((40, 30), False)
        assert read_image_size(fd, off_b, size_b) == ((640, 480), True)
        assert read_image_size(fd, off_c, size_c, prefix=30) == ((99, 98), False)
        with pytest.raises(ImageSizeError, match="empty"):
            read_image_size(fd, off_a, 0)
    finally:
        os.close(fd)


def test_image_size_errors():
    with pytest.raises(ImageSizeError, match=r"not a known image format \(starts with b'hello"):
        image_size(b"hello world, not an image")
    with pytest.raises(ImageSizeError, match="empty"):
        image_size(b"")


# --- text ----------------------------------------------------------------------------------------

def test_text_rules():
    conv = {"conversations": [{"from": "human", "value": "<image>\nWhat?"},
                              {"from": "gpt", "value": "A cat."}]}
    assert join_text(json_text(conv)) == "\nWhat?\nA cat."
    msgs = {"messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}, "raw part"]},
        {"role": "assistant", "content": "A dog."},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]}
    assert json_text(msgs) == ["Describe.", "raw part", "A dog."]
    assert json_text({"text": "t"}) == ["t"]
    assert json_text({"caption": "c", "url": "u"}) == ["c"]
    assert json_text({"caption": None, "url": "u"}) is None     # img2dataset metadata
    assert json_text([1, 2]) is None
    assert text_pieces("txt", "héllo".encode()) == ["héllo"]
    assert text_pieces("0.json", json.dumps({"text": "x"}).encode()) == ["x"]
    with pytest.raises(SampleTextError, match="not valid UTF-8"):
        text_pieces("txt", b"\xff\xfe")
    with pytest.raises(SampleTextError, match="not valid JSON"):
        text_pieces("json", b"{nope")
    with pytest.raises(SampleTextError, match=r"conversations\[1\]\.value is int"):
        json_text({"conversations": [{"value": "a"}, {"value": 3}]})
    with pytest.raises(SampleTextError, match="'messages' is dict"):
        json_text({"messages": {}})


# --- scanning ------------------------------------------------------------------------------------

def test_scan_offsets_and_grouping(tmp_path):
    long_key = "deep/" + "k" * 120              # > 100 chars: needs a PAX/GNU header
    samples = [Sample("a/0", images=[("jpg", 40, 30), ("png", 50, 20)], caption="two images"),
               Sample(long_key, images=[("webp", 33, 44)], caption="long name")]
    path = os.path.join(tmp_path, "s.tar")
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        d = tarfile.TarInfo("a")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)                                   # directories are skipped
        meta = b"shard metadata"
        ti = tarfile.TarInfo("__meta__")
        ti.size = len(meta)
        tf.addfile(ti, io.BytesIO(meta))                # webdataset meta member: skipped
        for s in samples:
            for ext, data in s.members():
                ti = tarfile.TarInfo(f"{s.key}.{ext}")
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    scan = scan_shard(path)
    assert scan.status == "ok" and scan.errors == []
    assert [s.key for s in scan.samples] == ["a/0", long_key]
    assert scan.samples[0].image_sizes == [(40, 30), (50, 20)]
    assert scan.samples[1].image_sizes == [(33, 44)]
    assert [m[0] for m in scan.samples[0].members] == ["0.jpg", "1.png", "txt"]
    with open(path, "rb") as f:
        raw = f.read()
    for sample, spec in zip(scan.samples, samples, strict=True):
        assert [raw[o:o + n] for _, o, n in sample.members] == [d for _, d in spec.members()]
        assert sample.text == spec.expected_text


def test_scan_bad_samples(tmp_path):
    conv = json.dumps({"conversations": [{"from": "human", "value": "hi"}]}).encode()
    path = write_members(tmp_path / "s.tar", [
        ("ok.jpg", JPG), ("ok.txt", b"fine"),
        ("junk.jpg", b"\x00not an image at all"), ("junk.txt", b"x"),
        ("empty.png", b""), ("empty.txt", b"x"),
        ("split.jpg", JPG), ("other.txt", b"between"), ("split.txt", b"later"),   # non-adjacent
        ("dup.jpg", JPG), ("dup.JPG", JPG),                                      # duplicate (case)
        ("vid.mp4", b"\0\0\0\x18ftypmp42"), ("vid.json", conv),                  # a broken video
        ("meta.json", b'{"url": "http://x"}'), ("meta.jpg", JPG),                # unknown JSON schema
        ("nothing.cls", b"3"),                                                   # neither image nor text
        ("badjson.json", b"{"), ("noext", b"x"),
        ("imgonly.png", image_bytes("png", 9, 8)),                               # fine: 0 text tokens
    ])
    scan = scan_shard(path)
    assert scan.status == "ok"
    assert [s.key for s in scan.samples] == ["ok", "other", "imgonly"]
    reasons = {e["key"]: e["reason"] for e in scan.errors}
    assert all(e["shard"] == path for e in scan.errors)
    expect = {
        "junk": "sample 'junk': member 'junk.jpg' is not a readable image: not a known image format",
        "empty": "sample 'empty': member 'empty.png' is not a readable image: empty (0 bytes)",
        "split": "sample 'split': its members are not adjacent",
        "dup": "member 'dup.JPG' appears twice",
        "vid": "sample 'vid': member 'vid.mp4' is not a readable video: not a readable video container",
        "meta": "no text found",
        "nothing": "has neither images nor text",
        "badjson": "member 'badjson.json': not valid JSON",
        "noext": "has no extension",
    }
    assert set(reasons) == set(expect)
    for key, want in expect.items():
        assert want in reasons[key], (key, reasons[key])


def test_scan_non_utf8_member_name(tmp_path):
    path = str(tmp_path / "s.tar")
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT, encoding="utf-8") as tf:
        for name, data in (("ok.jpg", JPG), ("bad\udcff.jpg", JPG)):   # written as the raw byte 0xff
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    scan = scan_shard(path)
    assert [s.key for s in scan.samples] == ["ok"]
    assert scan.errors == [{"shard": path, "key": "bad\\xff.jpg",
                            "reason": "member name 'bad\\\\xff.jpg' is not valid UTF-8"}]
    json.dumps(scan.errors).encode("utf-8")      # what errors.jsonl needs


def _good_shard(tmp_path, name="s.tar", n=6) -> str:
    return write_shard(tmp_path / name, [Sample(f"k{i}", images=[("jpg", 30 + i, 20)], caption=f"c{i}")
                                         for i in range(n)])


def test_corrupt_header_is_not_silently_short(tmp_path):
    path = _good_shard(tmp_path)
    corrupt_header(path, 5)          # tarfile alone would stop here and report 2 samples, no error
    with tarfile.open(path, "r:") as tf:
        assert len(tf.getmembers()) == 5
    scan = scan_shard(path)
    assert scan.status == "corrupt" and scan.samples == []
    assert scan.errors == [{"shard": path, "key": None, "reason": scan.reason}]
    assert "is not zero" in scan.reason and "after 5 members" in scan.reason


@pytest.mark.parametrize("damage, status, words", [
    (truncate_mid_payload, "truncated", "unexpected end of data"),
    (strip_end_blocks, "truncated", "end-of-archive marker"),
    (lambda p: truncate_bytes(p, member_offsets(p)[-1][1] + 200), "corrupt", "is not zero"),   # mid-header
    (lambda p: truncate_bytes(p, 0), "empty", "0-byte"),
])
def test_damaged_shards(tmp_path, damage, status, words):
    path = _good_shard(tmp_path)
    damage(path)
    scan = scan_shard(path)
    assert (scan.status, scan.samples) == (status, [])
    assert words in scan.reason
    assert [e["key"] for e in scan.errors] == [None]


def test_other_bad_shards(tmp_path):
    empty = tmp_path / "empty.tar"
    with tarfile.open(empty, "w"):
        pass
    assert scan_shard(str(empty)).status == "empty"
    gz = tmp_path / "c.tar"
    gz.write_bytes(gzip.compress(open(_good_shard(tmp_path), "rb").read()))
    scan = scan_shard(str(gz))
    assert scan.status == "corrupt" and "gzip-compressed" in scan.reason
    missing = scan_shard(str(tmp_path / "gone.tar"))
    assert missing.status == "missing" and "not found" in missing.reason
    notar = tmp_path / "n.tar"
    notar.write_bytes(b"x" * 5000)
    assert scan_shard(str(notar)).status == "corrupt"


def test_fingerprint_sees_same_size_rewrite(tmp_path):
    a = _good_shard(tmp_path, "a.tar")
    before = (os.path.getsize(a), shard_fingerprint(a))
    write_shard(a, [Sample(f"k{i}", images=[("jpg", 30 + i, 20)], caption=f"C{i}") for i in range(6)])
    assert os.path.getsize(a) == before[0]
    assert shard_fingerprint(a) != before[1]
    # Large file: only the first and last MiB (and the size) count.
    big = tmp_path / "big.bin"
    big.write_bytes(bytes(5 << 20))
    fp = shard_fingerprint(str(big))
    with open(big, "r+b") as f:
        f.seek((5 << 20) - 10)
        f.write(b"x")
    assert shard_fingerprint(str(big)) != fp
