"""A Parquet row whose chat turns or text are missing (a null value, an empty list of turns) is an
error naming the file, row and column, as ``dataset_lengths`` refuses the same row ("'messages' is
NoneType, not a non-empty list of chat turns"); it was indexed as an image with no text at all."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from tokenbal.index.parquet import scan_parquet

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.mark.parametrize("column", ["messages", "text"])
def test_a_row_with_null_or_empty_turns_or_null_text_is_an_error_naming_row_and_column(tmp_path, column):
    jpeg = _jpeg()
    if column == "messages":
        good = [{"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "ok"}]
        values, bad_rows = [good, None, [], good], {1: "null", 2: "an empty list"}
    else:
        values, bad_rows = ["<image>a cat", None, "", "<image>a dog"], {1: "null"}
    file = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"images": pa.array([[jpeg]] * 4, pa.list_(pa.binary())), column: values}), file)
    scan = scan_parquet(str(file))
    kept = sorted(int(s.key.rsplit(":", 1)[1]) for s in scan.samples)
    assert kept == [r for r in range(4) if r not in bad_rows]   # "" text with an image is an image-only row
    assert len(scan.errors) == len(bad_rows)
    for err, (row, what) in zip(scan.errors, bad_rows.items(), strict=True):
        assert f"rows.parquet row group 0 row {row}: column {column!r} is {what}" in err["reason"], err
