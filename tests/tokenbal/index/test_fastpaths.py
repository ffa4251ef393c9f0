"""The build's fast paths agree with their references: the raw tar header walk with CPython's
``tarfile`` (clean, PAX, GNU and damaged shards), the hand JPEG header parse with Pillow."""

from __future__ import annotations

import functools
import io
import os
import random
import tarfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
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
from tests.helpers.shards import tarfile_listing, walk_listing
from tokenbal.index.imagesize import ImageSizeError, image_size, jpeg_size
from tokenbal.index.scan import scan_shard


def write_tar(path, fmt, entries) -> str:
    """entries: (name, bytes | None for a directory | ("link", target))."""
    with tarfile.open(path, "w", format=fmt) as tf:
        for name, data in entries:
            ti = tarfile.TarInfo(name)
            ti.mtime = 1_700_000_000
            if data is None:
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
            elif isinstance(data, tuple):
                ti.type, ti.linkname = tarfile.SYMTYPE, data[1]
                tf.addfile(ti)
            else:
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    return os.fspath(path)


JPG = image_bytes("jpg", 40, 30)
ENTRIES = [
    ("dir", None),
    ("dir/a.jpg", JPG), ("dir/a.txt", b"caption"),
    ("x" * 90 + "/" + "k" * 60 + ".jpg", JPG),            # > 100 chars: ustar prefix or PAX / GNU
    ("x" * 90 + "/" + "k" * 60 + ".txt", b"long"),
    ("caf\u00e9/\u00fcber.jpg", JPG), ("caf\u00e9/\u00fcber.txt", b"non-ascii name"),
    ("lnk.jpg", ("link", "dir/a.jpg")),
    ("big.bin", bytes(70_000)),
    ("empty.txt", b""),
]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_walk_equals_tarfile_on_clean_shards(tmp_path, fmt):
    entries = [e for e in ENTRIES if fmt != tarfile.USTAR_FORMAT or e[0].isascii()]
    path = write_tar(tmp_path / "s.tar", fmt, entries)
    got = walk_listing(path)
    assert got is not None                      # the fast path handles every common writer
    assert got == tarfile_listing(path)
    assert [m[0] for m in got[0]] == [e[0] for e in entries]


def test_walk_on_corpus_shards(tmp_path):
    shard = write_shard(tmp_path / "c.tar", [Sample(f"k{i}", images=[("png", 10 + i, 9)], caption="x")
                                            for i in range(5)])
    assert walk_listing(shard) == tarfile_listing(shard)


@pytest.mark.parametrize("damage", [
    truncate_mid_payload, strip_end_blocks, lambda p: corrupt_header(p, 3),
    lambda p: truncate_bytes(p, member_offsets(p)[-1][1] + 200), lambda p: truncate_bytes(p, 700),
])
def test_walk_leaves_damage_to_tarfile(tmp_path, damage):
    path = write_shard(tmp_path / "d.tar", [Sample(f"k{i}", images=[("jpg", 30, 20)], caption=f"c{i}")
                                           for i in range(4)])
    damage(path)
    assert walk_listing(path) is None               # the scan then lists it with tarfile
    assert scan_shard(path).status in ("corrupt", "truncated")


@functools.cache
def jpeg_variants() -> dict[str, bytes]:
    rgb = Image.effect_noise((123, 77), 30).convert("RGB")
    exif = Image.Exif()
    exif[0x0112], exif[0x010F] = 6, "cam"       # orientation, make
    out = {}
    for name, im, kw in [
        ("baseline", rgb, {}),
        ("progressive", rgb, {"progressive": True}),
        ("optimized", rgb, {"optimize": True}),
        ("gray", rgb.convert("L"), {}),
        ("cmyk", rgb.convert("CMYK"), {}),
        ("subsampling-444", rgb, {"subsampling": 0}),
        ("restart-markers", rgb, {"restart_marker_blocks": 1}),
        ("icc-small", rgb, {"icc_profile": bytes(range(256)) * 4}),
        ("icc-multi-segment", rgb, {"icc_profile": bytes(150_000)}),
        ("exif", rgb, {"exif": exif}),
        ("comment", rgb, {"comment": b"hello"}),
    ]:
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=80, **kw)
        out[name] = buf.getvalue()
    return out


def pillow_size(data: bytes):
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.size
    except Exception as e:   # noqa: BLE001 - any Pillow failure means "no size"
        return type(e)


@pytest.mark.parametrize("name", list(jpeg_variants()))
def test_jpeg_parse_equals_pillow(name):
    data = jpeg_variants()[name]
    want = pillow_size(data)
    assert want == (123, 77)
    got = jpeg_size(data)
    assert got in (want, None)
    if name not in ("icc-multi-segment",):
        assert got == want                       # the fast path is taken for ordinary JPEGs
    # Every cut through the header: the hand parse either gives Pillow's size or defers to it.
    header_end = data.find(b"\xff\xda") + 64
    for cut in range(0, min(len(data), header_end), max(7, header_end // 150)):
        part = data[:cut]
        fast = jpeg_size(part)
        if fast is not None:
            assert fast == pillow_size(part), (name, cut)
        slow = pillow_size(part)
        if isinstance(slow, tuple):
            assert image_size(part) == slow
        else:
            with pytest.raises(ImageSizeError):
                image_size(part)


def test_jpeg_parse_defers_on_what_pillow_rejects():
    data = jpeg_variants()["baseline"]
    sof = data.find(b"\xff\xc0")
    twelve_bit = data[:sof + 4] + b"\x0c" + data[sof + 5:]      # 12-bit samples
    assert jpeg_size(twelve_bit) is None
    assert not isinstance(pillow_size(twelve_bit), tuple)          # Pillow cannot handle 12-bit
    with pytest.raises(ImageSizeError):
        image_size(twelve_bit)
    bomb = data[:sof + 5] + b"\xff\xff\xff\xff" + data[sof + 9:]   # 65535 x 65535 > 2x Pillow's limit
    assert jpeg_size(bomb) is None
    with pytest.raises(ImageSizeError, match="DecompressionBomb"):
        image_size(bomb)
    app0_end = 4 + int.from_bytes(data[4:6], "big")
    junk = data[:app0_end] + b"\x00\x00" + data[app0_end:]          # junk Pillow skips: Pillow judges
    assert jpeg_size(junk) is None and image_size(junk) == pillow_size(junk)


NAME_CHARS = "abcxyz019_-./\u00e9\u4e2d"   # with slashes: trailing ones are where tarfile's rules differ


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.lists(st.tuples(st.text(NAME_CHARS, min_size=1, max_size=150),
                                  st.sampled_from(["file", "file", "dir", "link"]),
                                  st.integers(0, 1500)), min_size=0, max_size=8),
       fmt=st.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT]),
       flip=st.one_of(st.none(), st.integers(0, 1 << 20)))
def test_walk_equals_tarfile_on_random_archives(tmp_path, entries, fmt, flip):
    path = os.fspath(tmp_path / "r.tar")
    spec = [(name, None if kind == "dir" else ("link", "t") if kind == "link" else bytes([n % 251]) * n)
            for name, kind, n in entries]
    write_tar(path, fmt, spec)
    if flip is not None:      # one damaged byte anywhere (header, payload, padding or end blocks)
        with open(path, "r+b") as f:
            data = bytearray(f.read())
            data[flip % len(data)] ^= 0x5A
            f.seek(0)
            f.write(data)
    got = walk_listing(path)
    try:
        want = tarfile_listing(path)
    except tarfile.TarError:
        want = None
    if flip is None:
        assert got is not None
    if got is not None:
        assert got == want


@pytest.mark.filterwarnings("ignore::UserWarning")     # Pillow warns about the EXIF blocks we damage
def test_jpeg_parse_never_disagrees_with_pillow_on_damaged_headers():
    rng = random.Random(0)
    fast = 0
    for name, data in jpeg_variants().items():
        header_end = data.find(b"\xff\xda") + 20
        for _ in range(200):
            damaged = bytearray(data)
            damaged[rng.randrange(header_end)] = rng.randrange(256)
            got = jpeg_size(bytes(damaged))
            if got is not None:      # whenever the fast path answers, Pillow gives the same size
                fast += 1
                assert got == pillow_size(bytes(damaged)), name
    assert fast > 1000              # and it does answer for most of them
