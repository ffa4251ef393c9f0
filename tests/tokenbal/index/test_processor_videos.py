"""``tokenbal index build --processor DIR`` on chat records with videos: JSONL records (a ``videos``
field, or ``{"type": "video"}`` parts naming the file under ``video`` / ``path`` / ``url``) and tar
samples (a JSON member with video parts + video members) are counted exactly as
``dataset_lengths`` counts the same rows (the same counter: the processor's own video settings and
``replace_video_token``), with each video's frames, fps and size in the index's video table.

Here (no torchvision, so transformers loads no video processor from a folder): the folder's
processor is the family's real processor with a stand-in video processor holding the real class's
settings (``family_processors.StandInVideoProcessor``), handed to the build where it loads the
folder (``tokenbal.estimate.chat._auto_processor``); a folder read without it is refused by name.
``test_real_video_processors_index_build`` (marker ``compat``) runs the build against the real
video processors in the ``tf-X.Y-video`` side envs (``tests/helpers/video_index_oracle_check.py``).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("av")

from tests.helpers import family_processors as fp  # noqa: E402
from tests.helpers.video_index_oracle_check import records_of  # noqa: E402
from tokenbal import TokenIndex  # noqa: E402
from tokenbal.cli import main  # noqa: E402
from tokenbal.index import build_index  # noqa: E402
from tokenbal.integrations.hf import dataset_lengths  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")
N_ROWS = 30


def _has_replace_video_token(family: str) -> bool:
    return callable(getattr(fp.processor_class(family), "replace_video_token", None))


def _processor(family: str, settings: dict | None = None):
    try:
        return fp.video_family_processor(family, real=False, settings=settings, subclass=True)
    except (ImportError, ModuleNotFoundError, AttributeError) as e:
        pytest.skip(f"{family}'s processor or video processor class is not here: {e}")


def save_folder(proc, family: str, folder):
    """``family_processors.save_folder`` plus the video processor's settings file
    (``video_preprocessor_config.json``, as ``save_pretrained`` writes it where the video processor
    exists), which the index's estimator reads as AutoProcessor does."""
    fp.save_folder(proc, family, folder)
    vp = getattr(proc, "video_processor", None)
    if vp is not None:
        settings = {k: v for k, v in vp.to_dict().items() if v is not None}
        settings["video_processor_type"] = fp.VIDEO_CLASS[family][1]
        (folder / "video_preprocessor_config.json").write_text(json.dumps(settings, default=str))
    return folder


def _load_as(monkeypatch, proc) -> None:
    """The build loads its folder's processor as ``proc`` (what AutoProcessor gives where
    torchvision is installed: the processor with its video processor)."""
    import tokenbal.estimate.chat as chat

    monkeypatch.setattr(chat, "_auto_processor", lambda folder: proc)


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    return fp.write_videos(tmp_path_factory.mktemp("videos"), 12, seed=51)


def write_jsonl(records: list[dict], path) -> str:
    path.write_text("\n".join(json.dumps(r) for r in records))
    return str(path)


def _expected(proc, rec: dict) -> int | None:
    """dataset_lengths on the record (as a row dict), or None when it refuses the row."""
    try:
        return int(dataset_lengths([rec], proc)[0])
    except ValueError:
        return None


@pytest.mark.parametrize("family", fp.VIDEO_FAMILIES)
def test_video_chat_records_equal_dataset_lengths(family, videos, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    if not _has_replace_video_token(family):
        return _refused_on_this_transformers(family, videos, tmp_path, monkeypatch)
    for k, settings in enumerate(fp.VIDEO_SETTINGS[family]):
        proc = _processor(family, settings)
        folder = save_folder(proc, family, tmp_path / f"proc{k}")
        _load_as(monkeypatch, proc)
        records = records_of(fp.random_video_rows(N_ROWS, seed=60 + k, videos=videos), tmp_path)
        src = write_jsonl(records, tmp_path / f"train{k}.jsonl")
        out = tmp_path / f"idx{k}"
        assert main(["index", "build", src, "--processor", str(folder), "--out", str(out), "-q"]) == 0
        idx = TokenIndex.open(out)
        got = dict(zip(idx.keys, idx.lengths.tolist(), strict=True))
        errors = {e["key"]: e["reason"] for e in idx.errors}
        want = {r["id"]: _expected(proc, r) for r in records}
        assert {key for key, n in want.items() if n is None} == set(errors), (settings, errors)
        assert got == {key: n for key, n in want.items() if n is not None}, settings
        assert len(got) >= N_ROWS // 2
        np.testing.assert_array_equal(idx.vision_tokens + idx.text_tokens, idx.lengths)
        assert (idx.text_tokens > 0).all()
        _check_video_table(idx, proc, records)


def _check_video_table(idx: TokenIndex, proc, records: list[dict]) -> None:
    """Each video's row holds its header (frames, size, fps) and the frames the processor keeps."""
    from tokenbal.estimate.chat import ChatTokenCounter
    from tokenbal.estimate.chat_video import sample_video
    from tokenbal.index.video import probe_video
    from tokenbal.index.videoindex import video_rows

    counter = ChatTokenCounter.from_processor(proc)
    by_id = {r["id"]: r for r in records}
    n = 0
    for i, key in enumerate(idx.keys):
        rec = by_id[key]
        files = rec.get("videos") or counter.row_videos(rec["messages"])
        info, params = video_rows(idx, i)
        assert len(info) == len(files)
        for row, prm, f in zip(info, params, files, strict=True):
            head = probe_video(f)
            kept = len(sample_video(proc, counter.family, counter.estimator, head)[0])
            stored = (int(row[1]), int(row[2]), int(row[3]), int(row[5]))
            assert stored == (head.frames, head.width, head.height, kept)
            assert float(prm[0]) == pytest.approx(head.fps) and int(row[6]) > 0
            n += 1
    assert n > 0 and idx.manifest["num_videos"] == n


def _refused_on_this_transformers(family, videos, tmp_path, monkeypatch):
    """transformers without ``replace_video_token`` (4.57 / 5.6 / 5.9): each video record is an
    error naming the record, the file and the version; the rest is indexed."""
    proc = _processor(family)
    folder = save_folder(proc, family, tmp_path / "proc")
    _load_as(monkeypatch, proc)
    records = [{"id": "v", "messages": [{"role": "user", "content": [
                   {"type": "video", "video": videos[0]}, {"type": "text", "text": "what"}]}]},
               {"id": "t", "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]}]
    src = write_jsonl(records, tmp_path / "old.jsonl")
    report = build_index(src, tmp_path / "idx", processor=str(folder), progress=False)
    assert report.num_samples == 1 and report.num_bad_samples == 1
    [error] = TokenIndex.open(tmp_path / "idx").errors
    assert error["key"] == "v" and os.path.basename(videos[0]) in error["reason"]
    assert "no processor.replace_video_token" in error["reason"] and "5.19" in error["reason"]


def test_tar_samples_with_video_members(videos, tmp_path, monkeypatch):
    """A tar shard: a JSON member with ``{"type": "video"}`` parts and the sample's video members
    (in member order), as webdataset gives them; equal to dataset_lengths on the same row with the
    files; a sample whose parts and members disagree is an error naming it."""
    from tests.helpers.corpus import Sample, write_shard

    if not _has_replace_video_token("qwen3-vl"):
        pytest.skip("this transformers' processors have no replace_video_token")
    proc = _processor("qwen3-vl")
    folder = save_folder(proc, "qwen3-vl", tmp_path / "proc")
    _load_as(monkeypatch, proc)
    mp4 = [v for v in videos if v.endswith(".mp4")]
    rows = []
    samples = []
    for i, v in enumerate(mp4[:4]):
        msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": f"clip {i}?"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "a clip"}]}]
        samples.append(Sample(key=f"s{i}", messages=msgs, raw=[("mp4", open(v, "rb").read())]))
        rows.append({"messages": msgs, "videos": [v]})
    two = [{"role": "user", "content": [{"type": "video"}, {"type": "video"}, {"type": "text", "text": "x"}]}]
    samples.append(Sample(key="two_parts_one_video", messages=two, raw=[("mp4", open(mp4[0], "rb").read())]))
    shard = write_shard(tmp_path / "videos-000.tar", samples)
    report = build_index(shard, tmp_path / "idx", processor=str(folder), progress=False)
    idx = TokenIndex.open(tmp_path / "idx")
    assert report.num_samples == len(rows)
    np.testing.assert_array_equal(idx.lengths, dataset_lengths(rows, proc))
    [error] = idx.errors
    assert error["key"] == "two_parts_one_video" and "2 video placeholder(s)" in error["reason"]
    assert "1 video(s)" in error["reason"]


def test_bad_video_records_are_errors_naming_the_record_and_file(videos, tmp_path, monkeypatch):
    if not _has_replace_video_token("qwen2-vl"):
        pytest.skip("this transformers' processors have no replace_video_token")
    proc = _processor("qwen2-vl")
    folder = save_folder(proc, "qwen2-vl", tmp_path / "proc")
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 50)

    def rec(key, **part):
        return {"id": key, "messages": [{"role": "user", "content": [{"type": "video", **part},
                                                                       {"type": "text", "text": "what"}]}]}

    records = [rec("good", video=videos[0]), rec("missing", video=str(tmp_path / "missing.mp4")),
               rec("url", url="https://example.com/a.mp4"), rec("broken", path=str(broken)),
               rec("twice", video=videos[0], path=videos[1]),
               {"id": "frames", "messages": rec("x", video=["a.png", "b.png"])["messages"]}]
    src = write_jsonl(records, tmp_path / "bad.jsonl")

    def build(proc_loaded, out):
        if proc_loaded is not None:
            _load_as(monkeypatch, proc_loaded)
        report = build_index(src, tmp_path / out, processor=str(folder), progress=False)
        return report, {e["key"]: e["reason"] for e in TokenIndex.open(tmp_path / out).errors}

    report, errors = build(proc, "idx")
    assert report.num_samples == 1 and report.num_bad_samples == 5
    assert TokenIndex.open(tmp_path / "idx").lengths.tolist() == dataset_lengths([records[0]], proc).tolist()
    assert "missing.mp4" in errors["missing"] and "cannot read the video" in errors["missing"]
    assert "is a URL" in errors["url"] and "https://example.com/a.mp4" in errors["url"]
    assert "broken.mp4" in errors["broken"]
    assert "video and path" in errors["twice"]
    assert "frame-list videos are not supported" in errors["frames"]
    # a folder read without its processor (no video processor here without torchvision)
    monkeypatch.undo()
    _report, errors = build(None, "idx_files")
    assert "was read from its files, not loaded as a processor" in errors["good"]
    assert os.path.basename(videos[0]) in errors["good"]
    # a processor without a video processor, a family without videos, a transformers without
    # replace_video_token: each named, per record, with its file
    bare = fp.processor("qwen2-vl")
    bare.chat_template = fp.template("qwen2-vl", video_token=bare.video_token)
    _report, errors = build(bare, "idx_bare")
    assert "has no video processor" in errors["good"] and os.path.basename(videos[0]) in errors["good"]
    next_ = fp.processor("llava-next")
    _report, errors = build(next_, "idx_next")
    assert "videos are counted for the families" in errors["good"]
    old = _processor("qwen2-vl")
    old.__class__ = type("OldQwen2VLProcessor", (type(old),), {"replace_video_token": None})
    _report, errors = build(old, "idx_old")
    assert "no processor.replace_video_token" in errors["good"]


def test_rebuild_follows_the_video_files_and_the_video_settings(videos, tmp_path, monkeypatch):
    """An unchanged rebuild reuses the shard; a video file replaced under the same name (the JSONL
    unchanged) is rescanned and recounted; other video settings of the processor are other token
    rules (refused without --rebuild, naming the text counter, then counted anew)."""
    from tests.helpers.videos import write_video
    from tokenbal.index.build import OtherRulesError

    if not _has_replace_video_token("qwen2-vl"):
        pytest.skip("this transformers' processors have no replace_video_token")
    proc = _processor("qwen2-vl")
    folder = save_folder(proc, "qwen2-vl", tmp_path / "proc")
    _load_as(monkeypatch, proc)
    clip = str(shutil.copy(videos[0], tmp_path / ("clip" + os.path.splitext(videos[0])[1])))
    records = records_of(fp.random_video_rows(12, seed=70, videos=[clip, videos[1]]), tmp_path)
    src = write_jsonl(records, tmp_path / "train.jsonl")
    out = tmp_path / "idx"
    build_index(src, out, processor=str(folder), progress=False)
    before = TokenIndex.open(out).lengths.copy()
    np.testing.assert_array_equal(before, dataset_lengths(records, proc))
    assert build_index(src, out, processor=str(folder), progress=False).num_reused == 1
    longer = write_video(str(tmp_path / "longer.mp4"), 90, 128, 96, 30)
    os.replace(shutil.copy(longer, clip + ".new"), clip)
    report = build_index(src, out, processor=str(folder), progress=False)
    assert report.num_reused == 0
    after = TokenIndex.open(out).lengths
    np.testing.assert_array_equal(after, dataset_lengths(records, proc))
    assert not np.array_equal(after, before)
    # the processor's video sampling changed: other rules
    proc.video_processor.do_sample_frames, proc.video_processor.fps = True, 1.0
    with pytest.raises(OtherRulesError, match="text counter"):
        build_index(src, out, processor=str(folder), progress=False, on_other_rules="error")
    build_index(src, out, processor=str(folder), progress=False, incremental=False)
    np.testing.assert_array_equal(TokenIndex.open(out).lengths, dataset_lengths(records, proc))


def test_parquet_rows_with_video_parts_are_errors(tmp_path):
    """A Parquet row with a video part but no video (no ``videos`` column, no file in the part) is an
    error naming the row, with or without --processor (Parquet videos: test_parquet_videos.py)."""
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    msgs = [[{"role": "user", "content": [{"type": "video", "text": None}, {"type": "text", "text": "hi"}]}],
            [{"role": "user", "content": [{"type": "text", "text": "plain"}]}]]
    pq.write_table(pa.table({"messages": msgs}), str(tmp_path / "t.parquet"))
    report = build_index(str(tmp_path / "t.parquet"), tmp_path / "idx", progress=False)
    [error] = TokenIndex.open(tmp_path / "idx").errors
    assert report.num_samples == 1 and error["key"].endswith(":0:0") and "video part" in error["reason"]


def _video_envs() -> list[str]:
    from tests.helpers.envs import transformers_specs

    return transformers_specs("video")


@pytest.mark.compat
@pytest.mark.parametrize("env", _video_envs())
def test_real_video_processors_index_build(env):
    """Against the real video processors (torchvision) in each ``tf-X.Y-video`` side env
    (transformers 5.19 / 5.24 / 5.25, torchvision 0.29.1, PyAV): each family's real processor saved
    with ``save_pretrained`` and loaded by the build from that folder; 30 random videos, 40 random
    JSONL records per family x video settings (every row shape) + 6 tar samples, two scan workers:
    ``index build --processor`` == ``dataset_lengths`` == the processor's own ``input_ids`` length
    on every record (InternVL records its ``__call__`` cannot stack: ``process_row``'s length), and
    every record the processor rejects is an error of the index."""
    from tests.helpers.envs import oracle_in_env

    families = fp.VIDEO_ENV_FAMILIES
    results = oracle_in_env(env, "tests.helpers.video_index_oracle_check", "30", "40", "9",
                            ",".join(families))
    assert {r["family"] for r in results} == set(families)
    assert len(results) == sum(len(fp.VIDEO_SETTINGS[f]) for f in families)
    for r in results:
        assert r["n_wrong"] == 0 and r["agree"] >= 30 and r["videos_indexed"] > 0, r
        assert "tar" in r["shapes"] and len(r["shapes"]) >= 5, r


def _smolvlm_envs() -> list[str]:
    from tests.helpers.envs import transformers_specs

    return transformers_specs("video-smolvlm")


@pytest.mark.compat
@pytest.mark.parametrize("env", _smolvlm_envs())
def test_real_smolvlm_video_processor_index_build(env):
    """SmolVLM's real processor + video processor in each ``tf-X.Y-video-smolvlm`` side env (the
    video env + num2words), saved with ``save_pretrained`` and loaded by the build (two scan
    workers): 30 random videos + 5 long ones (200-600 frames), 40 JSONL records per video setting
    (every frame; fps 1 at most 8; fps 4 at most 6) + 6 tar samples: ``index build --processor`` ==
    ``dataset_lengths`` == the processor's own ``input_ids`` length on every record."""
    from tests.helpers.envs import oracle_in_env

    results = oracle_in_env(env, "tests.helpers.video_index_oracle_check", "30", "40", "9", "smolvlm")
    assert len(results) == len(fp.VIDEO_SETTINGS["smolvlm"])
    for r in results:
        print(env, {k: r[k] for k in ("settings", "records", "agree", "all_reject", "n_wrong",
                                      "videos_indexed")})
        assert r["family"] == "smolvlm" and r["n_wrong"] == 0 and r["agree"] >= 40, r
        assert r["videos_indexed"] > 0 and "tar" in r["shapes"] and len(r["shapes"]) >= 5, r


def test_reading_frames_back_never_differs_from_the_count(videos, tmp_path, monkeypatch):
    """The index's read side recomputes a video's frames with the index's estimator; where the
    processor sampled otherwise (Qwen2-VL's class default takes every frame, the estimator samples
    at 2 fps), asking the index for the frames is an error naming the sample, not other frames."""
    from tokenbal.index.videoindex import video_plans, video_rows

    if not _has_replace_video_token("qwen2-vl"):
        pytest.skip("this transformers' processors have no replace_video_token")
    rec = {"id": "clip", "messages": [{"role": "user", "content": [{"type": "video", "video": videos[0]},
                                                                    {"type": "text", "text": "what"}]}]}
    src = write_jsonl([rec], tmp_path / "one.jsonl")
    for k, settings in enumerate(fp.VIDEO_SETTINGS["qwen2-vl"]):
        proc = _processor("qwen2-vl", settings)
        folder = save_folder(proc, "qwen2-vl", tmp_path / f"proc{k}")
        _load_as(monkeypatch, proc)
        build_index(src, tmp_path / f"idx{k}", processor=str(folder), progress=False)
        idx = TokenIndex.open(tmp_path / f"idx{k}")
        info, _ = video_rows(idx, 0)
        if settings.get("do_sample_frames"):   # the estimator samples as the processor does
            assert [len(p.indices) for _, p in video_plans(idx, 0)] == [int(info[0, 5])]
        else:
            named = r"sample 0 \('clip'\) video 0: the index counted \d+ frames"
            with pytest.raises(ValueError, match=named):
                video_plans(idx, 0)
