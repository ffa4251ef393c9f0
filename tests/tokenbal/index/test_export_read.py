"""Reading an export back (``read_export`` / ``lengths_for_keys``) from files another tool wrote or
edited: string columns in any Arrow string layout are keys, and anything that is not a count or not a
key is an error naming the file, the row (line) and the column."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenbal.index.export import lengths_for_keys, read_export

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

KEYS = ["a", "ключ😀", "b\tc"]
COUNTS = {"length": [3, 5, 7], "vision_tokens": [1, 2, 3], "text_tokens": [2, 3, 4]}


def _table(key, **counts) -> pa.Table:
    cols = {k: pa.array(v, pa.int64()) for k, v in COUNTS.items()}
    cols.update(counts)
    return pa.table({"key": key, **cols})


@pytest.mark.parametrize("layout", ["dictionary", "large_string", "string_view"])
def test_a_parquet_export_with_keys_in_another_string_layout_is_read(tmp_path, layout):
    """polars / pandas write a categorical key column as dictionary-encoded strings, and newer Arrow
    writers large or view strings: the same keys (a dictionary column was refused as 'has type
    dictionary<values=string, ...>, expected strings')."""
    if layout == "string_view" and not hasattr(pa, "string_view"):
        pytest.skip("pyarrow < 16 has no string_view")
    key = {"dictionary": lambda: pa.array(KEYS).dictionary_encode(),
           "large_string": lambda: pa.array(KEYS, pa.large_string()),
           "string_view": lambda: pa.array(KEYS, pa.string_view())}[layout]()
    pq.write_table(_table(key), tmp_path / "lengths.parquet")
    keys, cols = read_export(tmp_path / "lengths.parquet")
    assert keys == KEYS
    np.testing.assert_array_equal(cols["length"], COUNTS["length"])
    np.testing.assert_array_equal(lengths_for_keys(tmp_path, ["b\tc", "a"]), [7, 3])


def test_a_parquet_export_missing_a_column_names_it(tmp_path):
    pq.write_table(pa.table({"key": KEYS, "length": COUNTS["length"]}), tmp_path / "lengths.parquet")
    with pytest.raises(ValueError, match=r"lengths\.parquet: no column 'vision_tokens', 'text_tokens' "
                                         r"\(columns: key, length\)"):
        read_export(tmp_path / "lengths.parquet")


def test_an_unsigned_count_past_int64_is_named_with_its_value(tmp_path):
    """A uint64 count of 2**63 + 5 was reported as '-9223372036854775803, not a count'."""
    big = 2**63 + 5
    pq.write_table(_table(pa.array(KEYS), length=pa.array([3, big, 7], pa.uint64())),
                   tmp_path / "lengths.parquet")
    with pytest.raises(ValueError, match=rf"row 1: length is {big}, .*int64"):
        read_export(tmp_path / "lengths.parquet")
    np.save(tmp_path / "lengths.npy", np.array([[1, 1, 0], [big, 1, 2]], np.uint64))
    (tmp_path / "keys.txt").write_text("a\nb\n")
    with pytest.raises(ValueError, match=rf"row 1: length is {big}, .*int64"):
        read_export(tmp_path / "lengths.npy")


def test_a_jsonl_count_past_int64_names_the_line(tmp_path):
    """2**70 in a JSONL export raised a bare 'OverflowError: Python int too large to convert to C long'."""
    rows = [{"key": "a", **{c: 1 for c in COUNTS}}, {"key": "b", "length": 2**70, "vision_tokens": 1,
                                                     "text_tokens": 2}]
    (tmp_path / "lengths.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=rf"lengths\.jsonl: line 2: length is {2**70}, .*int64"):
        read_export(tmp_path / "lengths.jsonl")


def test_an_export_that_is_not_utf8_names_the_file_and_line(tmp_path):
    """A bare UnicodeDecodeError ('utf-8' codec can't decode byte 0xe9 ...) named neither."""
    row = b'"length": 3, "vision_tokens": 1, "text_tokens": 2}\n'
    (tmp_path / "lengths.jsonl").write_bytes(b'{"key": "a", ' + row + b'{"key": "\xe9", ' + row)
    with pytest.raises(ValueError, match=r"lengths\.jsonl: line 2 is not UTF-8"):
        read_export(tmp_path / "lengths.jsonl")
    np.save(tmp_path / "lengths.npy", np.array([[3, 1, 2], [3, 1, 2]], np.int64))
    (tmp_path / "keys.txt").write_bytes(b"a\n\xff\n")
    with pytest.raises(ValueError, match=r"keys\.txt: line 2 is not UTF-8"):
        read_export(tmp_path / "lengths.npy")


def test_an_npy_export_without_keys_txt_names_it(tmp_path):
    np.save(tmp_path / "lengths.npy", np.array([[3, 1, 2]], np.int64))
    with pytest.raises(FileNotFoundError, match=r"keys\.txt.*lengths\.npy"):
        read_export(tmp_path / "lengths.npy")


def test_a_keys_txt_without_its_last_line_break_keeps_its_last_key(tmp_path):
    """Another tool's keys.txt ending without a newline lost its last key ('1 rows but keys.txt has 0
    keys'), and one of two keys read as ["a"]."""
    np.save(tmp_path / "lengths.npy", np.array([[3, 1, 2], [5, 2, 3]], np.int64))
    (tmp_path / "keys.txt").write_text("a\nb")
    assert read_export(tmp_path / "lengths.npy")[0] == ["a", "b"]
    (tmp_path / "keys.txt").write_text("a\n\n")   # an empty key is a key
    np.testing.assert_array_equal(lengths_for_keys(tmp_path, ["", "a"]), [5, 3])


@pytest.mark.parametrize("damage", ["cut", "empty", "text", "object"])
def test_a_damaged_npy_export_names_its_file_and_folder(tmp_path, damage):
    """A cut / empty / non-npy / pickled lengths.npy raised numpy's bare words ('EOF: reading array
    header, expected 118 bytes got 114', 'No data left in file', 'Object arrays cannot be loaded when
    allow_pickle=False'), naming neither lengths.npy nor the export folder it was read from."""
    file = tmp_path / "lengths.npy"
    np.save(file, np.array([[3, 1, 2], [5, 2, 3]], np.int64))
    (tmp_path / "keys.txt").write_text("a\nb\n")
    whole = file.read_bytes()
    if damage == "cut":
        file.write_bytes(whole[:len(whole) // 2])
    elif damage == "empty":
        file.write_bytes(b"")
    elif damage == "text":
        file.write_text("length,vision,text\n3,1,2\n")
    else:
        np.save(file, np.array([{"length": 3}, None], object), allow_pickle=True)
    for where in (file, tmp_path):
        with pytest.raises(ValueError, match=rf"{tmp_path}/lengths\.npy.* is damaged"):
            read_export(where)


@pytest.mark.parametrize("damage", ["cut", "empty"])
def test_a_damaged_parquet_export_names_its_file(tmp_path, damage):
    """pyarrow's 'Parquet magic bytes not found in footer' / 'Parquet file size is 0 bytes' named no file."""
    file = tmp_path / "lengths.parquet"
    pq.write_table(_table(pa.array(KEYS)), file)
    whole = file.read_bytes()
    file.write_bytes(whole[:len(whole) // 2] if damage == "cut" else b"")
    for where in (file, tmp_path):
        with pytest.raises(ValueError, match=rf"{tmp_path}/lengths\.parquet is damaged"):
            read_export(where)
