"""JSON / JSONL annotation sources (LLaVA / Qwen-VL fine-tuning format) with images on disk."""

from __future__ import annotations

import json
import os
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.corpus import Sample, image_bytes, write_shard
from tokenbal.cli import main
from tokenbal.estimate import get_estimator, get_text_counter
from tokenbal.index import TokenIndex, build_index, verify_index


@pytest.fixture()
def ann(tmp_path):
    """A JSONL and a JSON annotation file over real image files under images/, good and bad records."""
    root = tmp_path / "images"
    files = {"a/cat.jpg": ("jpg", 640, 480), "a/dog.png": ("png", 300, 1000), "b/x.webp": ("webp", 129, 77),
             "b/y.jpg": ("jpg", 28, 28)}
    for rel, (fmt, w, h) in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(image_bytes(fmt, w, h))
    (root / "broken.jpg").write_bytes(b"not an image at all")
    conv = [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A cat."}]
    lines = [
        json.dumps({"id": "1", "image": "a/cat.jpg", "conversations": conv}),                         # 1
        json.dumps({"image": ["a/cat.jpg", "b/x.webp"], "conversations": [                             # 2
            {"from": "human", "value": "<image>\n<image>\nWhat is it?"}, conv[1]]}),
        "",                                                                                             # 3
        json.dumps({"images": ["a/dog.png"], "messages": [
            {"role": "user", "content": "<image>Describe."},
            {"role": "assistant", "content": "Tall."}]}),                                              # 4
        json.dumps({"messages": [{"role": "user", "content": [
            {"type": "image", "image": "b/y.jpg"}, {"type": "text", "text": "Small?"}]},
            {"role": "assistant", "content": "Yes."}]}),                                               # 5
        json.dumps({"conversations": [{"from": "human", "value": "text only"}]}),                      # 6
        json.dumps({"image": "a/missing.jpg", "conversations": conv}),                                 # 7
        "{not json",                                                                                    # 8
        json.dumps(["not", "an", "object"]),                                                            # 9
        json.dumps({"video": "v.mp4", "conversations": conv}),                                         # 10
        json.dumps({"image": "broken.jpg", "conversations": conv}),                                    # 11
        json.dumps({"image": 3, "conversations": conv}),                                                # 12
        json.dumps({"id": "x"}),                                                                        # 13
    ]
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    js = tmp_path / "extra.json"
    js.write_text(json.dumps([{"image": str(root / "b/y.jpg"), "text": "absolute path"},
                              {"image": "b/x.webp", "caption": "a caption"}]))
    expected = {   # key -> (image sizes, text); a record's own id is its key (lines 1 and 13)
        "1": ([(640, 480)], "\nWhat is it?\nA cat."),
        "train.jsonl:2": ([(640, 480), (129, 77)], "\n\nWhat is it?\nA cat."),
        "train.jsonl:4": ([(300, 1000)], "Describe.\nTall."),
        "train.jsonl:5": ([(28, 28)], "Small?\nYes."),
        "train.jsonl:6": ([], "text only"),
        "extra.json[0]": ([(28, 28)], "absolute path"),
        "extra.json[1]": ([(129, 77)], "a caption"),
    }
    images = {"1": ["a/cat.jpg"], "train.jsonl:2": ["a/cat.jpg", "b/x.webp"],
              "train.jsonl:4": ["a/dog.png"], "train.jsonl:5": ["b/y.jpg"], "train.jsonl:6": [],
              "extra.json[0]": [str(root / "b/y.jpg")], "extra.json[1]": ["b/x.webp"]}
    bad = {
        "train.jsonl:7": f"{jsonl}:7: image 0 'a/missing.jpg' not found at {root / 'a/missing.jpg'}",
        "train.jsonl:8": f"{jsonl}:8: not valid JSON",
        "train.jsonl:9": f"{jsonl}:9: record is list, not an object",
        "train.jsonl:10": f"{jsonl}:10: video 0 'v.mp4' at {root / 'v.mp4'}: cannot read the video",
        "train.jsonl:11": f"{jsonl}:11: image 0 'broken.jpg' at {root / 'broken.jpg'} is not a readable "
                          "image",
        "train.jsonl:12": f"{jsonl}:12: 'image' must be a path or a list of paths",
        "x": f"{jsonl}:13: has neither images nor text",
    }
    return dict(root=str(root), jsonl=str(jsonl), json=str(js), expected=expected, images=images, bad=bad)


def test_annotation_records_are_indexed_exactly(tmp_path, ann):
    shard = write_shard(tmp_path / "s.tar", [Sample("t0", images=[("jpg", 64, 48)], caption="tar sample")])
    report = build_index([ann["jsonl"], ann["json"], shard], tmp_path / "idx", image_root=ann["root"],
                         progress=False)
    idx = TokenIndex.open(report.out)
    est, counter = get_estimator("qwen2-vl"), get_text_counter(None)
    assert list(idx.keys) == [*ann["expected"], "t0"]
    for i, (key, (sizes, text)) in enumerate(ann["expected"].items()):
        vision = sum(est.image_tokens(w, h) + est.wrapper_tokens for w, h in sizes)
        assert (idx.vision_tokens[i], idx.text_tokens[i]) == (vision, counter.count(text)), key
        assert idx.image_sizes(i) == sizes
        members = idx.members(i)
        assert [m.name for m in members] == ann["images"][key]
        for m in members:   # each member is the image file itself
            full = os.path.join(ann["root"], m.name)
            assert (m.shard, m.offset, m.size) == (full, 0, os.path.getsize(full))
        assert idx.shard(i) == (ann["json"] if key.startswith("extra") else ann["jsonl"])
    # The tar sample in the same index keeps its tar members.
    (m,) = [m for m in idx.members(len(idx) - 1) if m.name.endswith(".jpg")]
    assert m.shard == shard and m.name == "t0.jpg"
    errors = {e["key"]: e for e in idx.errors}
    assert set(errors) == set(ann["bad"])
    for key, reason in ann["bad"].items():
        assert errors[key]["shard"] == ann["jsonl"] and errors[key]["reason"].startswith(reason), key
    assert report.num_errors == len(ann["bad"]) and report.num_bad_shards == 0
    assert verify_index(report.out) == []



def test_a_record_whose_file_was_fixed_is_counted_on_the_next_build(tmp_path, ann):
    """A record that was an error because of its image (missing, unreadable) or video is counted by
    the next incremental build once that file appears or is replaced; the annotation file itself is
    unchanged. Files nobody touched keep their shard copied, not rescanned."""
    out = tmp_path / "idx"
    first = build_index([ann["jsonl"], ann["json"]], out, image_root=ann["root"], progress=False)
    assert first.num_errors == len(ann["bad"])
    again = build_index([ann["jsonl"], ann["json"]], out, image_root=ann["root"], progress=False)
    assert again.num_reused == 2 and again.num_errors == len(ann["bad"])   # nothing changed: copied
    root = ann["root"]
    with open(os.path.join(root, "a/missing.jpg"), "wb") as f:
        f.write(image_bytes("jpg", 100, 60))
    with open(os.path.join(root, "broken.jpg"), "wb") as f:
        f.write(image_bytes("jpg", 50, 70))
    report = build_index([ann["jsonl"], ann["json"]], out, image_root=ann["root"], progress=False)
    assert report.num_reused == 1     # extra.json copied; the JSONL file rescanned
    idx = TokenIndex.open(report.out)
    errors = {e["key"] for e in idx.errors}
    assert errors == set(ann["bad"]) - {"train.jsonl:7", "train.jsonl:11"}
    keys = list(idx.keys)
    assert idx.image_sizes(keys.index("train.jsonl:7")) == [(100, 60)]
    assert idx.image_sizes(keys.index("train.jsonl:11")) == [(50, 70)]
    # The image removed again: the record is an error again (a counted file changed); a file still
    # missing (the video of line 10) rescans nothing.
    os.remove(os.path.join(root, "a/missing.jpg"))
    report = build_index([ann["jsonl"], ann["json"]], out, image_root=ann["root"], progress=False)
    errors = {e["key"] for e in TokenIndex.open(report.out).errors}
    assert report.num_reused == 1 and "train.jsonl:7" in errors
    report = build_index([ann["jsonl"], ann["json"]], out, image_root=ann["root"], progress=False)
    assert report.num_reused == 2

def test_image_root_defaults_to_the_annotation_folder_and_bad_files(tmp_path, ann):
    # Without --image-root the paths are relative to the annotation file's folder: here that is
    # not where the images are, so each image record is an error naming the path it looked at.
    idx = TokenIndex.open(build_index([ann["jsonl"]], tmp_path / "idx", progress=False).out)
    assert list(idx.keys) == ["train.jsonl:6"]
    reason = {e["key"]: e["reason"] for e in idx.errors}["1"]
    assert f"not found at {tmp_path / 'a/cat.jpg'}" in reason
    notlist = tmp_path / "bad.json"
    notlist.write_text(json.dumps({"data": []}))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("[{")
    report = build_index([str(notlist), str(garbage)], tmp_path / "idx2", progress=False)
    idx = TokenIndex.open(report.out)
    assert report.num_bad_shards == 2 and len(idx) == 0
    assert [(e["shard"], e["key"]) for e in idx.errors] == [(str(notlist), None), (str(garbage), None)]
    assert "holds a dict, expected a list of records" in idx.errors[0]["reason"]
    assert "is not valid JSON" in idx.errors[1]["reason"]


def test_cli_image_root(tmp_path, ann, capsys):
    out = str(tmp_path / "idx")
    # Two worker processes: each must resolve image paths against --image-root too.
    assert main(["index", "build", ann["jsonl"], ann["json"], "--image-root", ann["root"], "--out", out,
                 "--workers", "2", "-q"]) == 0
    line = capsys.readouterr().out
    assert line.startswith("indexed 7 samples") and f"{len(ann['bad'])} errors" in line
    assert list(TokenIndex.open(out).keys) == list(ann["expected"])
    assert main(["index", "build", ann["jsonl"], "--image-root", str(tmp_path / "nope"), "--out", out,
                 "-q"]) == 2
    assert "nope is not a folder" in capsys.readouterr().err


def test_record_ids_are_keys_unique_within_a_file(tmp_path):
    (tmp_path / "a.jpg").write_bytes(image_bytes("jpg", 64, 48))
    rows = [
        {"id": "000000033471", "image": "a.jpg", "conversations": [{"from": "human", "value": "<image>hi"}]},
        {"id": 7, "text": "an integer id"},
        {"id": "dup", "text": "first of two"},
        {"id": "dup", "text": "second of two"},     # both fall back to their line: neither wins by order
        {"text": "no id"},
        {"id": "", "text": "empty id"},
        {"id": 1.5, "text": "a float is not a key"},
        {"id": True, "text": "nor a bool"},
        {"id": "t.jsonl:5", "text": "spelled like the place key of line 5"},
        {"id": "bad", "image": "missing.jpg", "text": "x"},   # an error keeps its record's id too
    ]
    jsonl = tmp_path / "t.jsonl"
    lines = [json.dumps(r) for r in rows] + ["{not json", json.dumps({"id": "t.jsonl:11", "text": "y"})]
    jsonl.write_text("\n".join(lines) + "\n")
    js = tmp_path / "t.json"
    js.write_text(json.dumps([{"id": "dup", "text": "one"}, {"id": "dup", "text": "two"},
                              {"id": "u", "text": "3"}]))
    idx = TokenIndex.open(build_index([str(jsonl), str(js)], tmp_path / "idx", progress=False).out)
    assert list(idx.keys) == ["000000033471", "7", "t.jsonl:3", "t.jsonl:4", "t.jsonl:5", "t.jsonl:6",
                              "t.jsonl:7", "t.jsonl:8", "t.jsonl:9", "t.jsonl:12", "t.json[0]", "t.json[1]",
                              "u"]
    assert [e["key"] for e in idx.errors] == ["bad", "t.jsonl:11"]   # line 11 is not JSON
    assert len(set(idx.keys[:10]) | {"bad", "t.jsonl:11"}) == 12


def test_a_part_naming_its_file_twice_is_an_error_naming_both_keys(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    # A processor collects a part's image / video under each of its keys, so a part naming two files
    # would be two images or videos: an error naming the part and both keys, in JSONL and Parquet rows.
    def turns(part):
        return [{"role": "user", "content": [part, {"type": "text", "text": "What?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "This."}]}]

    (tmp_path / "train.jsonl").write_text(
        json.dumps({"messages": turns({"type": "image", "image": "a.jpg", "url": "b.jpg"})}) + "\n"
        + json.dumps({"messages": turns({"type": "video", "video": "a.mp4", "path": "b.mp4"})}) + "\n")
    pq.write_table(pa.table({"messages": [turns({"type": "video", "url": "a.mp4", "path": "b.mp4"})]}),
                   str(tmp_path / "rows.parquet"))
    report = build_index([str(tmp_path / "train.jsonl"), str(tmp_path / "rows.parquet")], tmp_path / "idx",
                         progress=False)
    reasons = sorted(e["reason"] for e in TokenIndex.open(report.out).errors)
    assert len(reasons) == 3
    assert "names its video under url and path; a processor takes each as a video of its own" in reasons[0]
    assert "messages[0].content[0] names its image under image and url; a processor takes each as an image" \
        in reasons[1]
    assert "messages[0].content[0] names its video under video and path" in reasons[2]


# --- progress within one annotation file ---------------------------------------------------------

def _big_annotations(folder, fmt: str, n: int = 9000):
    """A text-only annotation file of ~10 MB: ``n`` records of ~1.1 KB."""
    records = [{"id": f"r{i}", "text": f"caption {i} " + "word " * 220} for i in range(n)]
    path = folder / f"big.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        path.write_text(json.dumps(records))
    return str(path), n


def test_a_jsonl_file_reports_the_bytes_scanned_as_it_goes(tmp_path):
    """One multi-GB file showed nothing for minutes: it was read whole, then scanned, in silence."""
    from tokenbal.index.annotations import PROGRESS_BYTES, scan_annotations

    path, n = _big_annotations(tmp_path, "jsonl")
    size = os.path.getsize(path)
    reports = []
    scan = scan_annotations(path, progress=lambda done, total, unit: reports.append((done, total, unit)))
    assert len(scan.samples) == n and not scan.errors
    line = size // n + 1
    assert {(total, unit) for _, total, unit in reports} == {(size, "B")}
    done = [d for d, _, _ in reports]
    # Every PROGRESS_BYTES of lines scanned (a line past each mark), then the end: the count moves
    # within the file, and never backwards.
    assert len(done) == size // PROGRESS_BYTES + 1 and done[-1] == size
    assert all(k * PROGRESS_BYTES <= d < k * PROGRESS_BYTES + line for k, d in enumerate(done[:-1], 1))
    quiet = scan_annotations(path)
    assert [s.key for s in quiet.samples] == [s.key for s in scan.samples]


def test_a_json_list_is_streamed_record_by_record_reporting_the_bytes_read(tmp_path):
    """A JSON list was read whole, then parsed whole (json.loads) in silence, held in memory twice:
    its records are now decoded as the file is read, each read reported."""
    from tokenbal.index.annotations import PROGRESS_BYTES, scan_annotations

    path, n = _big_annotations(tmp_path, "json")
    size = os.path.getsize(path)
    reports = []
    scan = scan_annotations(path, progress=lambda done, total, unit: reports.append((done, total, unit)))
    assert len(scan.samples) == n and not scan.errors
    reads = range(1, -(-size // PROGRESS_BYTES) + 1)
    assert reports == [(min(k * PROGRESS_BYTES, size), size, "B") for k in reads]
    # the same samples as the same records written as JSON Lines
    lines = tmp_path / "same.jsonl"
    lines.write_text("".join(json.dumps(r) + "\n" for r in json.loads(open(path).read())))
    again = scan_annotations(str(lines))
    assert [s.text for s in again.samples] == [s.text for s in scan.samples]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats(allow_nan=False)
    | st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(items=st.lists(JSON_VALUES, max_size=6), indent=st.sampled_from([None, 0, 2]),
       encoding=st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-32-be"]),
       chunk=st.integers(1, 40), cut=st.integers(0, 400),
       damage=st.sampled_from(["", ",", "]", "x", "[", " 1"]))
def test_a_json_list_read_item_by_item_is_what_json_loads_gives(items, indent, encoding, chunk, cut, damage):
    """Any JSON list, in any encoding json.loads reads, read in chunks of any size (an item, a number,
    a multi-byte character cut anywhere): the same items, or the same error message, as json.loads of
    the whole file; a document that is not a list is said to be so."""
    import io

    from tokenbal.index.text import NotAList, iter_json_list

    doc = json.dumps(items, indent=indent, ensure_ascii=False)
    if damage:
        at = cut % (len(doc) + 1)
        doc = doc[:at] + damage + doc[at:]
    data = doc.encode(encoding)
    try:
        want, want_error = json.loads(data), None
    except ValueError as e:
        want, want_error = None, e
    try:
        got = [v for v, _ in iter_json_list(io.BytesIO(data).read, chunk)]
    except NotAList:
        assert not isinstance(want, list)
        return
    except ValueError as e:
        assert want_error is not None
        # Python 3.13 words a trailing comma ("[1,]") its own way; the file is an error all the same
        assert str(e) == str(want_error) or sys.version_info >= (3, 13)
        return
    assert want_error is None and got == want


class _StopsAt:
    """A file of ``head`` then ``tail_size`` more bytes; reading into the tail raises (the test's
    proof that a reader stopped at the damage). ``read_bytes``: how much was handed out."""

    def __init__(self, head: bytes, tail_size: int) -> None:
        self.head, self.size, self.read_bytes = head, len(head) + tail_size, 0

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.read_bytes if n is None or n < 0 else n
        start, end = self.read_bytes, min(self.size, self.read_bytes + n)
        if end > len(self.head):
            raise AssertionError(f"read bytes {start}..{end}, past the damage at byte < {len(self.head)}")
        self.read_bytes = end
        return self.head[start:end]


@pytest.mark.parametrize("damage", ["{\"text\": \"a\" \"b\"}", "{\"text\": tru}", "{\"text\": \"a\u0001\"}",
                                    "{\"text\": \"a\"} {\"text\": \"b\"}", "{\"text\": \"a\\x\"}"])
def test_a_json_list_stops_at_its_damaged_record_without_reading_the_rest(damage):
    """A damaged record in a multi-GB JSON list was found only after the rest of the file was read (a
    decode error was taken for a record cut by the read, so the reader read on, to the end): it raises
    at the record, with json.loads' message for it, having read the chunk that holds it and no more."""
    from tokenbal.index.text import iter_json_list

    good = ",\n".join(json.dumps({"text": f"caption {i} " + "word " * 20}) for i in range(200))
    head = ("[" + good + ",\n" + damage + ",\n" + good).encode()
    chunk = 4096
    f = _StopsAt(head + b" " * chunk, tail_size=1 << 30)     # the rest: a GiB that must not be read
    items = []
    with pytest.raises(json.JSONDecodeError) as got:
        for value, _ in iter_json_list(f.read, chunk):
            items.append(value)
    want = None
    try:
        json.loads(head + b"]")
    except json.JSONDecodeError as e:
        want = e
    assert want is not None and str(got.value) == str(want)
    assert len(items) in (200, 201) and f.read_bytes <= len(head) + chunk


@pytest.mark.parametrize("doc", ["coco", "jsonl"])
def test_a_large_json_file_that_is_no_list_is_named_without_being_parsed_whole(tmp_path, monkeypatch, doc):
    """A .json file that is not a list was read and parsed whole to say what it is: a COCO-style
    {"images": [...]} of 132 MB took 600 MB and 1.9 s for one line of error, a multi-GB one the
    build's memory; JSON Lines named .json the same. Past PARSE_WHOLE_BYTES it is named by its first
    character, having read one chunk."""
    from tokenbal.index import annotations
    from tokenbal.index.annotations import PROGRESS_BYTES, ShardScan, _json_list_records, _ParseError

    assert annotations.PARSE_WHOLE_BYTES >= 16 << 20
    records = [{"id": i, "caption": "word " * 40} for i in range(2000)]
    text = json.dumps({"annotations": records}) if doc == "coco" else \
        "".join(json.dumps(r) + "\n" for r in records)
    path = tmp_path / "ann.json"
    path.write_text(text)
    small = annotations.scan_annotations(str(path))        # small: parsed whole, as before
    assert small.status == "corrupt" and ("holds a dict" in small.reason if doc == "coco" else
                                          "is not valid JSON: Extra data: line 2 column 1" in small.reason)
    monkeypatch.setattr(annotations, "PARSE_WHOLE_BYTES", 64 << 10)
    scan = annotations.scan_annotations(str(path))
    assert scan.status == "corrupt" and scan.reason == (
        f"annotation file {path} starts with a JSON object ('{{'), not '[': a .json file must hold a list "
        "of records (records one per line are JSON Lines: name the file .jsonl)")
    # its first PROGRESS_BYTES (one read), then a GiB that must not be read
    f = _StopsAt((text.encode() + b" " * PROGRESS_BYTES)[:PROGRESS_BYTES], tail_size=1 << 30)
    with pytest.raises(_ParseError, match="starts with a JSON object"):
        list(_json_list_records(f, len(f.head) + (1 << 30), str(path), "ann", ShardScan(path=str(path)),
                                lambda *r: None))
    assert f.read_bytes <= PROGRESS_BYTES


def test_a_damaged_json_list_record_is_a_file_error_naming_its_place_and_record(tmp_path):
    """The file error of a damaged JSON list names the file, the line and column, and the record."""
    from tokenbal.index.annotations import scan_annotations

    records = [json.dumps({"text": f"caption {i}"}) for i in range(5)]
    records[3] = '{"text": "caption 3" "oops"}'
    path = tmp_path / "list.json"
    path.write_text("[\n" + ",\n".join(records) + "\n]")
    scan = scan_annotations(str(path))
    assert scan.status == "corrupt" and not scan.samples
    assert scan.reason == (f"annotation file {path} is not valid JSON: Expecting ',' delimiter: "
                           "line 5 column 22 (char 92), at record [3]")


def test_the_build_reports_each_annotation_file_in_process_and_from_workers(tmp_path, capsys):
    """`tokenbal index build` shows a bar per annotation file under the shard bar (not with -q); the
    library takes a callable instead. With --workers the reports come back from the scan processes.
    After the scan, the samples whose text is counted (a real tokenizer over millions of rows took
    minutes in silence) every PROGRESS_ROWS."""
    from tokenbal.index.scan import PROGRESS_ROWS

    path, n = _big_annotations(tmp_path, "jsonl")
    size = os.path.getsize(path)
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"text": "a caption"}) + "\n")
    for workers, sources in ((1, [path]), (2, [path, str(small)])):
        reports = []
        build_index(sources, tmp_path / f"idx{workers}", model="qwen2-vl", workers=workers,
                    progress=lambda *r, reports=reports: reports.append(r))
        mine = [(done, total) for p, done, total, unit in reports if p == path and unit == "B"]
        assert len(mine) >= 3 and mine[-1] == (size, size)
        assert [d for d, _ in mine] == sorted({d for d, _ in mine})       # advancing within the file
        counted = [r[1:] for r in reports if r[0] == path and r[3] == "samples"]
        every = [(k, n, "samples") for k in range(PROGRESS_ROWS, n, PROGRESS_ROWS)]
        assert counted == [*every, (n, n, "samples")]
        small_reports = [r[1:] for r in reports if r[0] == str(small)]
        assert small_reports == [(22, 22, "B"), (1, 1, "samples")] * (workers - 1)
    assert main(["index", "build", path, "--model", "qwen2-vl", "--out", str(tmp_path / "cli")]) == 0
    err = capsys.readouterr().err
    assert "big.jsonl" in err and "indexing" in err and "big.jsonl (tokens)" in err
    assert main(["index", "build", path, "--model", "qwen2-vl", "--out", str(tmp_path / "q"), "-q"]) == 0
    assert capsys.readouterr().err == ""


# --- records Python's json reads oddly -----------------------------------------------------------

ODD_RECORDS = {  # a JSONL line -> what the error says of it (the build goes on; the line is named)
    "[" * 100_000 + "]" * 100_000: "JSON nested deeper than Python's recursion limit",
    '{"id": ' + "1" * 5000 + ', "text": "x"}': "JSON that Python cannot read (Exceeds the limit",
    '{"text": "a\\ud800b"}': "field 'text' holds a lone UTF-16 surrogate escape",
    '{"id": "x\\udc00", "text": "hello"}': "field 'id' holds a lone UTF-16 surrogate escape",
    '{"image": "a\\uDBFF.jpg", "text": "x"}': "field 'image' holds a lone UTF-16 surrogate escape",
    '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}':
        "field 'messages'[0]['content'][0]['text'] holds a lone UTF-16 surrogate escape",
    json.dumps({"image": "a\u0000b.jpg", "text": "x"}): "image 0 'a\\x00b.jpg': a path with a NUL character",
    json.dumps({"video": "v\u0000.mp4", "text": "x"}): "video 0 'v\\x00.mp4': a path with a NUL character",
}


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_records_python_cannot_read_are_errors_naming_the_line_not_a_failed_build(tmp_path, capsys, fmt):
    """A record nested past the recursion limit (RecursionError traceback), an integer of 5000 digits
    (ValueError), a lone surrogate escape ('utf-8' codec can't encode, no file named), a NUL in a path
    ('embedded null byte'): each used to stop the whole build."""
    good = json.dumps({"id": "ok", "text": "fine \\ud83d\\ude00"}).replace("\\\\", "\\")   # a pair: an emoji
    # In a JSON list, a record json cannot parse fails the whole file (below), as any syntax error does.
    whole_file = [line for line, why in ODD_RECORDS.items() if "nested" in why or "cannot read" in why]
    odd = {line: r for line, r in ODD_RECORDS.items() if fmt == "jsonl" or line not in whole_file}
    path = tmp_path / f"odd.{fmt}"
    if fmt == "jsonl":
        path.write_text("\n".join([good, *odd]) + "\n")
    else:
        path.write_text("[" + ",\n".join([good, *odd]) + "]")
    out = str(tmp_path / "idx")
    assert main(["index", "build", str(path), "--model", "qwen2-vl", "--out", out, "-q"]) == 0
    idx = TokenIndex.open(str(tmp_path / "idx"))
    assert list(idx.keys) == ["ok"] and idx.text_tokens[0] > 0
    reasons = [e["reason"] for e in idx.errors]
    assert len(reasons) == len(odd)
    for i, (reason, wanted) in enumerate(zip(reasons, odd.values(), strict=True), 2):
        place = f"{path}:{i}" if fmt == "jsonl" else f"{path}[{i - 1}]"
        assert reason.startswith(f"{place}: ") and wanted in reason, (reason, wanted)
    for n, line in enumerate(whole_file if fmt == "json" else []):
        bad = tmp_path / f"bad{n}.json"
        bad.write_text(f"[{good}, {line}]")
        (shard,) = build_index([str(bad)], tmp_path / f"bad{n}", progress=False).bad_shards
        assert shard["status"] == "corrupt"
        assert shard["reason"].startswith(f"annotation file {bad}: {ODD_RECORDS[line]}")
    capsys.readouterr()


def test_tar_json_members_python_cannot_read_are_sample_errors(tmp_path):
    shard = write_shard(tmp_path / "s.tar", [
        Sample("a", caption="fine"),
        Sample("b", raw=[("json", ("[" * 100_000 + "]" * 100_000).encode())]),
        Sample("c", raw=[("json", b'{"text": "x\\ud800"}')]),
        Sample("d", raw=[("json", b'{"text": "' + b"1" * 10 + b'", "n": ' + b"9" * 5000 + b"}")]),
    ])
    build_index([shard], tmp_path / "idx", progress=False)
    idx = TokenIndex.open(str(tmp_path / "idx"))
    assert list(idx.keys) == ["a"]
    reasons = {e["key"]: e["reason"] for e in idx.errors}
    assert "JSON nested deeper than Python's recursion limit" in reasons["b"]
    assert "field 'text' holds a lone UTF-16 surrogate escape" in reasons["c"]
    assert "JSON that Python cannot read" in reasons["d"]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "utf-8-sig"])
def test_a_jsonl_file_in_utf16_or_utf32_is_one_named_file_error(tmp_path, encoding):
    """PowerShell's `>` writes UTF-16: split at b"\\n", its first record was indexed and every other
    one was 'not valid JSON' (a line starting with the NUL of the line end before it)."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(3)).encode(encoding))
    report = build_index([str(path)], tmp_path / "idx", progress=False)
    if encoding == "utf-8-sig":
        assert report.num_samples == 3 and not report.bad_shards
        return
    name = encoding.upper() if encoding != "utf-16-le" else "UTF-16-LE"
    assert report.num_samples == 0 and report.bad_shards == [{
        "path": str(path), "status": "corrupt",
        "reason": f"annotation file {path} is {name} text: JSON Lines files are UTF-8; re-encode it (e.g. "
                  f"iconv -f {name} -t UTF-8)"}]


def test_verify_reports_the_shards_then_the_named_files_it_checks(ann, tmp_path, capsys, monkeypatch):
    """`tokenbal index verify` over thousands of shards and millions of named images (a read or a stat
    each) said nothing until its verdict: it reports each shard, then every PROGRESS_ROWS files."""
    import tokenbal.index.scan as scan_mod

    shard = write_shard(tmp_path / "s.tar", [Sample(key="k", caption="a caption")])
    out = build_index([ann["jsonl"], ann["json"], shard], tmp_path / "idx", image_root=ann["root"],
                      progress=False).out
    monkeypatch.setattr(scan_mod, "PROGRESS_ROWS", 2)
    reports = []
    assert verify_index(out, progress=lambda *r: reports.append(r)) == []
    named = 7     # the image files the good records of both files name, one per image a record holds
    assert reports == [(1, 3, "shards"), (2, 3, "shards"), (3, 3, "shards"),
                       (2, named, "files"), (4, named, "files"), (6, named, "files"), (named, named, "files")]
    assert main(["index", "verify", out]) == 0
    captured = capsys.readouterr()
    assert "verifying" in captured.err and "index is up to date" in captured.out
    assert main(["index", "verify", out, "-q"]) == 0
    assert capsys.readouterr().err == ""
