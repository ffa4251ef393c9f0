"""Videos in Parquet rows (``tokenbal index build``): a ``videos`` column of paths, bytes or
``{bytes, path}`` structs (``datasets.Video(decode=False)``'s layout), else the files the
``{"type": "video"}`` parts name under ``video`` / ``path`` / ``url``, read from their container
headers. With ``--processor`` each row is counted as ``dataset_lengths`` counts the same row (the
same ``ChatTokenCounter`` video path); without one, as the same record in a JSONL file is counted.

Here (no torchvision): the family's real processor with a stand-in video processor holding the real
class's settings (``family_processors.StandInVideoProcessor``), handed to the build where it loads
the folder. ``test_real_video_processors_parquet`` (marker ``compat``) runs the build against the
real video processors in the ``tf-X.Y-video-smolvlm`` side envs
(``tests/helpers/parquet_video_oracle_check.py``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("av")
pytest.importorskip("pyarrow")

from tests.helpers import family_processors as fp  # noqa: E402
from tests.helpers.index_oracles import stand_in_video_folder  # noqa: E402
from tests.helpers.parquet_video_oracle_check import write_parquet_files  # noqa: E402
from tokenbal import TokenIndex  # noqa: E402
from tokenbal.index import build_index, verify_index  # noqa: E402
from tokenbal.index.parquet import ParquetOptions  # noqa: E402
from tokenbal.integrations.hf import dataset_lengths  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    return fp.write_videos(tmp_path_factory.mktemp("videos"), 8, seed=52)


def _row_lengths(idx: TokenIndex, files: dict) -> dict[int, int | str]:
    """Row index -> the index's length, or its error."""
    got = dict(zip(idx.keys, idx.lengths.tolist(), strict=True))
    errors = {e["key"]: e["reason"] for e in idx.errors}
    out = {}
    for path, ids in files.items():
        for k, i in enumerate(ids):
            key = f"{Path(path).name}:0:{k}"
            out[i] = got.get(key, f"error: {errors.get(key)}")
    return out


@pytest.mark.parametrize("family", ["qwen2.5-vl", "llava-onevision"])
def test_parquet_video_rows_equal_dataset_lengths(family, videos, tmp_path, monkeypatch):
    """Every video row shape (paths / bytes / struct ``videos`` columns, files named in the parts),
    with images: the index's lengths equal ``dataset_lengths`` on the same rows, rows it refuses are
    errors, and the video table holds each video's header."""
    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    proc, folder = stand_in_video_folder(family, tmp_path / "proc", monkeypatch)
    rows = fp.random_video_rows(36, seed=61, videos=videos)
    files = write_parquet_files(rows, tmp_path)
    assert len(files) == 4
    build_index(list(files), tmp_path / "idx", processor=str(folder), progress=False)
    idx = TokenIndex.open(tmp_path / "idx")
    got = _row_lengths(idx, files)
    counted = 0
    for i, row in enumerate(rows):
        try:
            want = int(dataset_lengths([{k: v for k, v in row.items() if k != "files"}], proc)[0])
        except ValueError:
            assert str(got[i]).startswith("error: "), (i, got[i])
            continue
        assert got[i] == want, (i, row["shape"])
        counted += 1
    assert counted >= 30 and idx.manifest["num_videos"] == sum(len(r["files"]) for r in rows)
    np.testing.assert_array_equal(idx.vision_tokens + idx.text_tokens, idx.lengths)


def test_parquet_videos_without_a_processor_count_as_jsonl_records(videos, tmp_path):
    """``--model qwen2-vl`` (the estimator's video rules): a Parquet row with a video counts as the
    same record in a JSONL file (the video read from the column's bytes or the part's path; a
    caption row's video, without parts, too)."""
    ask = {"type": "text", "text": "what?"}
    msgs = [{"role": "user", "content": [{"type": "video", "video": None}, ask]}]
    inline = [{"role": "user", "content": [{"type": "video", "video": videos[1]}, ask]}]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"messages": [msgs], "videos": [[Path(videos[0]).read_bytes()]]}),
                   str(tmp_path / "bytes.parquet"))
    pq.write_table(pa.table({"messages": [inline]}), str(tmp_path / "inline.parquet"))
    pq.write_table(pa.table({"text": ["a clip"], "videos": [[videos[2]]]}), str(tmp_path / "text.parquet"))
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"id": "a", "messages": msgs, "videos": [videos[0]]}, {"id": "b", "messages": inline},
        {"id": "c", "text": "a clip", "videos": [videos[2]]}]))
    build_index([str(tmp_path / n) for n in ("bytes.parquet", "inline.parquet", "text.parquet")],
                tmp_path / "pq", progress=False)
    build_index(str(tmp_path / "r.jsonl"), tmp_path / "js", progress=False)
    pq_idx, js_idx = TokenIndex.open(tmp_path / "pq"), TokenIndex.open(tmp_path / "js")
    assert not pq_idx.errors and not js_idx.errors
    np.testing.assert_array_equal(pq_idx.lengths, js_idx.lengths)
    np.testing.assert_array_equal(pq_idx.video_tokens, js_idx.video_tokens)
    assert (pq_idx.video_tokens > 0).all()


def test_bad_parquet_videos_are_errors_naming_the_row(videos, tmp_path):
    """A video part with no video, a missing file, a URL, bytes that are no video, a part naming its
    file twice: each an error naming the file, row group and row; the good rows are indexed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def msgs(**part):
        return [{"role": "user", "content": [{"type": "video", **part}, {"type": "text", "text": "wh"}]}]

    gone = str(tmp_path / "gone.mp4")
    table = pa.table({"messages": [msgs(path=videos[0]), msgs(path=None), msgs(path=gone),
                                   msgs(path="https://example.com/a.mp4")]})
    pq.write_table(table, str(tmp_path / "p.parquet"))
    pq.write_table(pa.table({"messages": [msgs(video=None), msgs(video=None)],
                             "videos": [[Path(videos[0]).read_bytes()], [b"\x00\x00\x00\x18ftypmp42"]]}),
                   str(tmp_path / "b.parquet"))
    twice = pa.table({"messages": [msgs(video=videos[0], url=videos[1])]})
    pq.write_table(twice, str(tmp_path / "t.parquet"))
    build_index([str(tmp_path / n) for n in ("p.parquet", "b.parquet", "t.parquet")], tmp_path / "idx",
                progress=False)
    idx = TokenIndex.open(tmp_path / "idx")
    errors = {e["key"]: e["reason"] for e in idx.errors}
    assert sorted(idx.keys) == ["b.parquet:0:0", "p.parquet:0:0"]
    assert "row group 0 row 1" in errors["p.parquet:0:1"] and "1 video part(s)" in errors["p.parquet:0:1"]
    assert "gone.mp4" in errors["p.parquet:0:2"] and "cannot read the video" in errors["p.parquet:0:2"]
    assert "is a URL" in errors["p.parquet:0:3"]
    assert "videos[0] (" in errors["b.parquet:0:1"] and "bytes)" in errors["b.parquet:0:1"]
    assert "video and url" in errors["t.parquet:0:0"]


def test_a_rebuild_follows_the_video_files_parquet_rows_name(videos, tmp_path):
    """The Parquet file unchanged, a video it names by path replaced (other size / mtime): the
    rebuild rescans the file and counts the new video; unchanged, the file is reused."""
    from tests.helpers.videos import write_video

    clip = str(shutil.copy(videos[0], tmp_path / ("clip" + os.path.splitext(videos[0])[1])))
    import pyarrow as pa
    import pyarrow.parquet as pq

    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what"}]}]
    pq.write_table(pa.table({"messages": [msgs], "videos": [[clip]]}), str(tmp_path / "v.parquet"))
    src, out = str(tmp_path / "v.parquet"), tmp_path / "idx"
    build_index(src, out, progress=False)
    before = TokenIndex.open(out).video_tokens.copy()
    assert build_index(src, out, progress=False).num_reused == 1
    assert verify_index(out) == []
    longer = write_video(str(tmp_path / "longer.mp4"), 90, 128, 96, 30)
    os.replace(shutil.copy(longer, clip + ".new"), clip)
    # verify says what the rebuild will act on: the named video changed (it said "up to date")
    assert [p for p in verify_index(out) if p.startswith(f"video file changed: {clip} (named by {src}")]
    assert build_index(src, out, progress=False).num_reused == 0
    assert TokenIndex.open(out).video_tokens[0] > before[0]
    assert verify_index(out) == []
    os.remove(clip)
    assert verify_index(out) == [f"video file missing: {clip} (named by {src})"]



def test_a_parquet_row_whose_video_was_missing_is_counted_once_it_appears(videos, tmp_path):
    """A row naming a video that is not there is an error; the Parquet file unchanged, the next build
    rescans it once the video appears (and not while it is still missing)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    clip = str(tmp_path / ("later" + os.path.splitext(videos[0])[1]))
    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what"}]}]
    pq.write_table(pa.table({"messages": [msgs, msgs], "videos": [[clip], [videos[1]]]}),
                   str(tmp_path / "v.parquet"))
    src, out = str(tmp_path / "v.parquet"), tmp_path / "idx"
    first = build_index(src, out, progress=False)
    assert first.num_errors == 1 and "cannot read the video" in TokenIndex.open(out).errors[0]["reason"]
    assert build_index(src, out, progress=False).num_reused == 1      # still missing: nothing to rescan
    assert verify_index(out) == []
    shutil.copy(videos[0], clip)
    assert [p for p in verify_index(out) if p.startswith(f"video file appeared: {clip}")]
    report = build_index(src, out, progress=False)
    assert report.num_reused == 0 and report.num_errors == 0 and len(TokenIndex.open(out)) == 2


def test_a_named_video_column(videos, tmp_path):
    """``--video-column clips`` reads a row's videos from that column (counted as from ``videos``); a
    named column the file lacks is the file's error, naming it; an index built without the option
    keeps its settings (the option enters the index's Parquet settings only when given)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenbal.cli import main as cli

    msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what"}]}]
    pq.write_table(pa.table({"messages": [msgs], "videos": [[videos[2]]]}), str(tmp_path / "a.parquet"))
    pq.write_table(pa.table({"messages": [msgs], "clips": [[videos[2]]]}), str(tmp_path / "b.parquet"))
    build_index(str(tmp_path / "a.parquet"), tmp_path / "ia", progress=False)
    assert cli(["index", "build", str(tmp_path / "b.parquet"), "--out", str(tmp_path / "ib"),
                "--video-column", "clips", "--quiet"]) == 0
    a, b = TokenIndex.open(tmp_path / "ia"), TokenIndex.open(tmp_path / "ib")
    assert len(b) == 1 and b.lengths.tolist() == a.lengths.tolist() and b.video_tokens[0] > 0
    assert b.manifest["parquet"]["video_column"] == "clips" and "video_column" not in a.manifest["parquet"]
    report = build_index(str(tmp_path / "a.parquet"), tmp_path / "ic", progress=False,
                         parquet=ParquetOptions(video_column="clips"))
    assert report.num_bad_shards == 1 and "column 'clips' not in the file" in report.bad_shards[0]["reason"]

def _video_envs() -> list[str]:
    from tests.helpers.envs import transformers_specs

    # The tf-X.Y-video-smolvlm overlays: tf-X.Y-video + num2words, so SmolVLM's processor runs too.
    return transformers_specs("video-smolvlm")


@pytest.mark.compat
@pytest.mark.parametrize("env", _video_envs())
def test_real_video_processors_parquet(env):
    """Against the real video processors (torchvision) in each ``tf-X.Y-video-smolvlm`` side env: every video
    family's processor saved with ``save_pretrained`` and loaded by the build (two scan workers);
    40 random rows per family in Parquet files of every ``videos`` column kind and of parts naming
    the files: the index's length is the processor's own ``input_ids`` length on every row, rows it
    rejects are errors."""
    from tests.helpers.envs import oracle_in_env

    results = oracle_in_env(env, "tests.helpers.parquet_video_oracle_check", "16", "40", "13")
    assert {r["family"] for r in results} == set(fp.VIDEO_FAMILIES)
    for r in results:
        assert r["n_wrong"] == 0 and r["agree"] >= 30 and r["videos_indexed"] > 0, r
        assert len(r["shapes"]) >= 5, r
