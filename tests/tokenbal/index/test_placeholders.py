"""One placeholder check for every source kind (docs/RELIABILITY.md): a tar sample, a JSON / JSONL
record or a Parquet row whose image placeholders (``<image>`` strings, ``{"type": "image"}`` message
parts) are not one per image is an error naming the sample and both counts; none at all is fine."""

from __future__ import annotations

import json

import pytest

from tests.helpers.corpus import Sample, image_bytes, write_shard
from tokenbal.index import TokenIndex, build_index

JPG = image_bytes("jpg", 64, 48)


def _reasons(idx: TokenIndex) -> dict[str, str]:
    return {e["key"]: e["reason"] for e in idx.errors}


def _parts(n_images: int, text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


def test_tar_samples_whose_placeholders_are_not_one_per_image_are_errors(tmp_path):
    two = [{"from": "human", "value": "<image>\n<image>\nSame?"}, {"from": "gpt", "value": "yes"}]
    one = [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "a cat"}]
    samples = [
        Sample("two_for_one", conversations=two, raw=[("jpg", JPG)]),          # the reproduction
        Sample("one_for_none", conversations=one),                             # a placeholder, no image
        Sample("parts_two_for_one", messages=_parts(2, "Same?"), raw=[("jpg", JPG)]),
        Sample("caption_for_two", caption="<image> a cat", raw=[("0.jpg", JPG), ("1.jpg", JPG)]),
        Sample("ok_conv", conversations=one, raw=[("jpg", JPG)]),
        Sample("ok_parts", messages=_parts(2, "Same?"), raw=[("0.jpg", JPG), ("1.jpg", JPG)]),
        Sample("ok_none", caption="a cat without a placeholder", raw=[("0.jpg", JPG), ("1.jpg", JPG)]),
    ]
    shard = write_shard(tmp_path / "s.tar", samples)
    idx = TokenIndex.open(build_index([shard], tmp_path / "idx", progress=False).out)
    assert list(idx.keys) == ["ok_conv", "ok_parts", "ok_none"]
    reasons = _reasons(idx)
    assert reasons["two_for_one"] == ("sample 'two_for_one': its text has 2 <image> placeholder(s) but "
                                      "the sample has 1 image(s); the processor would pair text and images "
                                      "wrongly")
    assert "has 1 <image> placeholder(s) but the sample has 0 image(s)" in reasons["one_for_none"]
    assert ("2 image placeholder(s) (0 <image>, 2 image message part(s)) but the sample has 1 image(s)"
            in reasons["parts_two_for_one"])
    assert "1 <image> placeholder(s) but the sample has 2 image(s)" in reasons["caption_for_two"]
    assert all(e["shard"] == shard for e in idx.errors)


def test_json_records_count_image_message_parts_too(tmp_path):
    (tmp_path / "a.jpg").write_bytes(JPG)
    records = [{"images": ["a.jpg"], "messages": _parts(2, "Same?")},
               {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.jpg"},
                                                          {"type": "text", "text": "What?"}]}]},
               {"conversations": [{"from": "human", "value": "<image> What?"}]}]
    path = tmp_path / "train.json"
    path.write_text(json.dumps(records))
    idx = TokenIndex.open(build_index([str(path)], tmp_path / "idx", progress=False).out)
    assert list(idx.keys) == ["train.json[1]"]
    reasons = _reasons(idx)
    assert reasons["train.json[0]"].startswith(f"{path}[0]: its text has 2 image placeholder(s) (0 <image>, "
                                               "2 image message part(s)) but the record names 1 image(s)")
    assert "1 <image> placeholder(s) but the record names 0 image(s)" in reasons["train.json[2]"]


def test_parquet_rows_whose_placeholders_are_not_one_per_image_are_errors(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    rows = [  # (images, messages)
        (1, [{"role": "user", "content": "<image><image> Same?"}]),    # the reproduction
        (0, [{"role": "user", "content": "<image> What?"}]),           # a placeholder, no image
        (1, [{"role": "user", "content": "<image> What?"}]),           # fine
        (2, [{"role": "user", "content": "Both, no placeholder"}]),   # fine
    ]
    images = pa.array([[{"bytes": JPG, "path": None}] * k for k, _ in rows], pa.list_(image))
    table = pa.table({"images": images, "messages": [m for _, m in rows]})
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path)
    # TRL's layout: content parts, one {"type": "image"} per image.
    part = pa.struct([("type", pa.string()), ("text", pa.string())])
    turn = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    parts = pa.table({
        "images": pa.array([[{"bytes": JPG, "path": None}]] * 2, pa.list_(image)),
        "messages": pa.array([[{"role": "user", "content": [{"type": "image", "text": None}] * k
                                + [{"type": "text", "text": "Same?"}]}] for k in (2, 1)], pa.list_(turn))})
    path2 = tmp_path / "parts.parquet"
    pq.write_table(parts, path2)
    idx = TokenIndex.open(build_index([str(path), str(path2)], tmp_path / "idx", progress=False).out)
    assert list(idx.keys) == ["rows.parquet:0:2", "rows.parquet:0:3", "parts.parquet:0:1"]
    reasons = _reasons(idx)
    assert reasons["rows.parquet:0:0"] == (f"{path} row group 0 row 0: its text has 2 <image> placeholder(s) "
                                           "but the row has 1 image(s); the processor would pair text and "
                                           "images wrongly")
    assert "1 <image> placeholder(s) but the row has 0 image(s)" in reasons["rows.parquet:0:1"]
    assert "(0 <image>, 2 image message part(s)) but the row has 1 image(s)" in reasons["parts.parquet:0:0"]
