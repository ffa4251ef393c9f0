"""webdataset decodes ``k.jpg.gz`` / ``k.txt.gz`` (its ``gzfilter`` handler): a gzip-compressed image or
text member is part of the sample it trains on. The index does not decompress members, so such a
sample is an error naming the member, never a sample counted without its image or caption."""

from __future__ import annotations

import bz2
import gzip
import io

import pytest
from PIL import Image

from tests.helpers.corpus import Sample, write_shard
from tokenbal.index.scan import scan_shard


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 20, 30)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.mark.parametrize("codec,compress", [("gz", gzip.compress), ("bz2", bz2.compress)])
def test_a_compressed_image_or_text_member_is_an_error_naming_it(tmp_path, codec, compress):
    """Before: 'k.jpg.gz' was an 'other' member: the sample was indexed as its caption alone (0 vision
    tokens), and 'm.txt.gz' beside 'm.jpg' as an image without its caption."""
    jpeg = _jpeg()
    scan = scan_shard(write_shard(tmp_path / "s.tar", [
        Sample("k", raw=[(f"jpg.{codec}", compress(jpeg)), ("txt", b"a photo of a cat")]),
        Sample("m", raw=[("jpg", jpeg), (f"txt.{codec}", compress(b"a photo of a dog"))]),
        Sample("n", raw=[("jpg", jpeg), ("txt", b"fine"), (f"npy.{codec}", compress(b"not counted"))])]))
    assert [(s.key, s.image_sizes) for s in scan.samples] == [("n", [(64, 48)])]
    reasons = {e["key"]: e["reason"] for e in scan.errors}
    assert set(reasons) == {"k", "m"}
    assert f"member 'k.jpg.{codec}' is a compressed image" in reasons["k"]
    assert f"member 'm.txt.{codec}' is a compressed text" in reasons["m"]
