"""Videos through the index: tar members and annotation records with videos are indexed from their
headers, their tokens equal the family's pipeline on the decoded frames, bad videos are listed with
shard, key and reason, and IndexedShardDataset decodes exactly the sampled frames."""

from __future__ import annotations

import json
import os
from fractions import Fraction

import numpy as np
import pytest

pytest.importorskip("av")

from tests.helpers.corpus import Sample, write_shard  # noqa: E402
from tests.helpers.oracles import require_oracle  # noqa: E402
from tests.helpers.videos import huge_header_avi, write_audio_only, write_no_frames, write_video  # noqa: E402
from tokenbal.data.indexed import IndexedShardDataset, SampleReadError  # noqa: E402
from tokenbal.estimate import get_estimator, get_text_counter  # noqa: E402
from tokenbal.estimate.video import VideoRequest, plan_video  # noqa: E402
from tokenbal.index import TokenIndex, build_index  # noqa: E402
from tokenbal.index.store import index_stats  # noqa: E402
from tokenbal.index.video import count_decoded_frames  # noqa: E402

NTSC = Fraction(30000, 1001)


def reference_request(path: str, **opts) -> VideoRequest:
    """The request from a full decode (frame count) and the stream's rate, independent of the
    header rules under test."""
    import av

    with av.open(path) as c:
        s = c.streams.video[0]
        fps, w, h = float(s.average_rate), s.width, s.height
    return VideoRequest(frames=count_decoded_frames(path), fps=fps, width=w, height=h, **opts)


def expected_video_tokens(est, counter, path: str, **opts) -> int:
    plan = plan_video(est, reference_request(path, **opts))
    texts = int(np.sum(counter.count_batch(list(plan.texts)))) if plan.texts else 0
    return plan.tokens + plan.special + texts


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("vid")
    f = {
        "a.mp4": write_video(str(d / "a.mp4"), 61, 64, 36, NTSC),
        "b.webm": write_video(str(d / "b.webm"), 50, 33, 47, 25),
        "c.mp4": write_video(str(d / "c.mp4"), 40, 32, 48, 30, gaps_ms=[33, 50, 100], rotation=90),
        "audio.mp4": write_audio_only(str(d / "audio.mp4")),
        "zero.mp4": write_no_frames(str(d / "zero.mp4")),
    }
    f["huge.avi"] = huge_header_avi(str(d / "huge.avi"), write_video(str(d / "raw.avi"), 3, 2, 2, 10,
                                                                     codec="rawvideo"))
    data = open(f["a.mp4"], "rb").read()
    f["cut.mp4"] = str(d / "cut.mp4")
    with open(f["cut.mp4"], "wb") as out:
        out.write(data[: len(data) // 2])          # the moov box, written last, is gone
    return d, f


def read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


@pytest.fixture(scope="module")
def shard_index(files, tmp_path_factory):
    d, f = files
    samples = [
        Sample("clip", caption="a short clip", raw=[("mp4", read(f["a.mp4"]))]),
        Sample("mixed", images=[("jpg", 64, 48)], raw=[("webm", read(f["b.webm"])),
                                                        ("json", json.dumps({"caption": "x y"}).encode())]),
        Sample("vfr", raw=[("mp4", read(f["c.mp4"]))]),
        Sample("cut", caption="bad", raw=[("mp4", read(f["cut.mp4"]))]),
        Sample("audio", caption="bad", raw=[("mp4", read(f["audio.mp4"]))]),
        Sample("zero", caption="bad", raw=[("mp4", read(f["zero.mp4"]))]),
        Sample("huge", caption="bad", raw=[("avi", read(f["huge.avi"]))]),
        Sample("img", images=[("png", 100, 80)], caption="an image"),
    ]
    shard = write_shard(d / "videos-000.tar", samples)
    out = tmp_path_factory.mktemp("idx") / "index"
    build_index([shard], out, model="qwen3-vl", progress=False)
    return shard, TokenIndex.open(out), f


def test_shard_videos_counted_exactly(shard_index):
    shard, idx, f = shard_index
    est, counter = get_estimator("qwen3-vl"), get_text_counter(None)
    keys = list(idx.keys)
    assert keys == ["clip", "mixed", "vfr", "img"]
    want = {"clip": expected_video_tokens(est, counter, f["a.mp4"]),
            "mixed": expected_video_tokens(est, counter, f["b.webm"]),
            "vfr": expected_video_tokens(est, counter, f["c.mp4"]), "img": 0}
    assert {k: int(idx.video_tokens[i]) for i, k in enumerate(keys)} == want
    images = {"mixed": est.image_tokens(64, 48) + 2, "img": est.image_tokens(100, 80) + 2}
    for i, k in enumerate(keys):
        assert int(idx.vision_tokens[i]) == want[k] + images.get(k, 0)
    frames = {k: len(plan_video(est, reference_request(f[n])).indices)
              for k, n in (("clip", "a.mp4"), ("mixed", "b.webm"), ("vfr", "c.mp4"))}
    assert [int(x) for x in idx.video_frames] == [frames["clip"], frames["mixed"], frames["vfr"], 0]
    assert "qwen3-vl" in idx.manifest["video_pipeline"] and idx.manifest["num_videos"] == 3


def test_bad_videos_listed_with_shard_key_reason(shard_index):
    shard, idx, _ = shard_index
    errs = {e["key"]: e for e in idx.errors}
    assert set(errs) == {"cut", "audio", "zero", "huge"}
    assert all(e["shard"] == shard for e in errs.values())
    assert "cut.mp4" in errs["cut"]["reason"] and "not a readable video container" in errs["cut"]["reason"]
    assert "audio-only" in errs["audio"]["reason"]
    assert "zero frames" in errs["zero"]["reason"]
    assert "frame size" in errs["huge"]["reason"]


def test_stats_has_a_video_row(shard_index):
    _, idx, _ = shard_index
    text = index_stats(idx.path)
    assert "videos: 3 in 3 samples" in text and "video pipeline: qwen3-vl" in text


def test_dataset_decodes_the_sampled_frames(shard_index):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from tokenbal.data.indexed import IndexedShardDataset
    from tokenbal.index.video import decode_frames

    _, idx, f = shard_index
    est = get_estimator("qwen3-vl")
    proc = Qwen3VLVideoProcessor(size={"shortest_edge": est.video_min_pixels,
                                       "longest_edge": est.video_max_pixels})
    ds = IndexedShardDataset(idx, decode="rgb8")
    for i, (key, name) in enumerate((("clip", "a.mp4"), ("mixed", "webm"), ("vfr", "c.mp4"))):
        s = ds[i]
        assert s["__key__"] == key
        (meta,) = s["__videos__"]
        frames = s[meta["member"]]
        src = f[name] if name in f else f["b.webm"]
        # the frames the processor itself samples from the whole decoded video
        md = VideoMetadata(total_num_frames=count_decoded_frames(src), fps=meta["fps"])
        want_idx = proc.sample_frames(md).tolist()
        assert meta["frames_indices"] == want_idx
        assert np.array_equal(frames, decode_frames(src, want_idx))
        t, h, w = frames.shape[:3]
        plan = plan_video(est, reference_request(src))
        if hasattr(proc, "get_num_of_video_patches"):
            assert proc.get_num_of_video_patches(t, h, w) // 4 == plan.tokens
    assert isinstance(IndexedShardDataset(idx, decode=None)[0]["mp4"], bytes)
    # the frames are checked above on every version; the count needs the processor's helper
    require_oracle(proc, "get_num_of_video_patches")


def test_annotation_videos_with_clip_fields(files, tmp_path):
    d, f = files
    rows = [
        {"video": os.path.basename(f["a.mp4"]), "conversations": [{"from": "human", "value": "<video>hi"}]},
        {"messages": [{"role": "user", "content": [
            {"type": "video", "video": os.path.basename(f["b.webm"]), "fps": 1.0,
             "video_start": 0.4, "video_end": 1.6},
            {"type": "text", "text": "what happens?"}]}]},
        {"messages": [{"role": "user", "content": [
            {"type": "video", "video": os.path.basename(f["c.mp4"]), "nframes": 6}]}]},
        {"video": "missing.mp4", "text": "x"},
        {"messages": [{"role": "user", "content": [{"type": "video", "video": ["f1.jpg", "f2.jpg"]}]}]},
        {"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4", "fps": -1}]}]},
        {"video": os.path.basename(f["audio.mp4"]), "text": "x"},
    ]
    ann = tmp_path / "train.jsonl"
    ann.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "index"
    build_index([str(ann)], out, model="qwen2.5-vl", image_root=str(d),
                estimator_overrides={"pipeline": "qwen-vl-utils"}, progress=False)
    idx = TokenIndex.open(out)
    est, counter = get_estimator("qwen2.5-vl", pipeline="qwen-vl-utils"), get_text_counter(None)
    assert list(idx.keys) == ["train.jsonl:1", "train.jsonl:2", "train.jsonl:3"]
    want = [expected_video_tokens(est, counter, f["a.mp4"]),
            expected_video_tokens(est, counter, f["b.webm"], sample_fps=1.0, start=0.4, end=1.6),
            expected_video_tokens(est, counter, f["c.mp4"], nframes=6)]
    assert [int(x) for x in idx.video_tokens] == want
    assert int(idx.video_frames[2]) == 6
    assert "qwen-vl-utils" in idx.manifest["video_pipeline"]
    errs = {e["key"]: e["reason"] for e in idx.errors}
    assert "not found" in errs["train.jsonl:4"] or "cannot read" in errs["train.jsonl:4"]
    assert "frame-list" in errs["train.jsonl:5"]
    assert "fps" in errs["train.jsonl:6"]
    assert "audio-only" in errs["train.jsonl:7"]
    # read back through the dataset: the clip's sampled frames
    from tokenbal.data.indexed import IndexedShardDataset
    from tokenbal.index.video import decode_frames

    s = IndexedShardDataset(idx, decode="rgb8")[1]
    (meta,) = s["__videos__"]
    plan = plan_video(est, reference_request(f["b.webm"], sample_fps=1.0, start=0.4, end=1.6))
    assert meta["frames_indices"] == list(plan.indices) and min(plan.indices) >= 10
    assert np.array_equal(s[meta["member"]], decode_frames(f["b.webm"], plan.indices))


def test_video_placeholders_not_one_per_video_are_an_error_in_records_and_shards(files, tmp_path):
    # As images: two <video> (LLaVA-Video) or two video parts for one video, in a JSONL record or a tar
    # sample, is an error naming it (as the Parquet row already was), not a sample counted with one.
    d, f = files
    clip = os.path.basename(f["a.mp4"])
    two_parts = [{"role": "user", "content": [{"type": "video"}, {"type": "video"},
                                              {"type": "text", "text": "?"}]}]
    llava = {"conversations": [{"from": "human", "value": "<video>\n<video>\ncompare"},
                               {"from": "gpt", "value": "ok"}]}
    rows = [{"video": clip, **llava}, {"videos": [clip], "messages": two_parts},
            {"video": clip, "conversations": [{"from": "human", "value": "<video>\nwhat?"}]}]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    build_index([str(tmp_path / "r.jsonl")], tmp_path / "ann", model="qwen2-vl", image_root=str(d),
                progress=False)
    ann = TokenIndex.open(tmp_path / "ann")
    assert list(ann.keys) == ["r.jsonl:3"]
    for key in ("r.jsonl:1", "r.jsonl:2"):
        reason = next(e["reason"] for e in ann.errors if e["key"] == key)
        assert "2 video placeholder(s) (<video> or video parts) but the record names 1 video(s)" in reason
    shard = write_shard(tmp_path / "s.tar", [
        Sample("a", raw=[("mp4", read(f["a.mp4"])), ("json", json.dumps(llava).encode())]),
        Sample("b", raw=[("json", json.dumps({"messages": two_parts}).encode())]),
        Sample("c", raw=[("mp4", read(f["a.mp4"])), ("txt", b"one clip")])])
    build_index([shard], tmp_path / "tar", model="qwen2-vl", progress=False)
    tar = TokenIndex.open(tmp_path / "tar")
    assert list(tar.keys) == ["c"]
    reasons = {e["key"]: e["reason"] for e in tar.errors}
    assert "2 video placeholder(s) (<video> or video parts) but the sample has 1 video(s)" in reasons["a"]
    assert "but the sample has 0 video(s)" in reasons["b"]


def test_family_without_video_support_rejects_the_sample(files, tmp_path):
    d, f = files
    shard = write_shard(tmp_path / "s.tar", [Sample("v", raw=[("mp4", read(f["a.mp4"]))]),
                                             Sample("i", images=[("jpg", 64, 48)], caption="x")])
    build_index([shard], tmp_path / "idx", model="phi-4-multimodal", progress=False)
    idx = TokenIndex.open(tmp_path / "idx")
    assert list(idx.keys) == ["i"]
    assert "no video support" in idx.errors[0]["reason"] and idx.errors[0]["key"] == "v"


def test_rebuild_reuses_video_rows(shard_index, tmp_path):
    import shutil

    shard, idx, _ = shard_index
    out = tmp_path / "index"
    shutil.copytree(idx.path, out)
    report = build_index([shard], out, model="qwen3-vl", progress=False)
    assert report.num_reused == 1
    again = TokenIndex.open(out)
    for name in ("video_start", "video_info", "video_params"):
        assert np.array_equal(again._cols[name], idx._cols[name], equal_nan=name == "video_params")
    assert np.array_equal(again.vision_tokens, idx.vision_tokens)
    # other rules (another video pipeline): rescanned, video counts change with them
    report = build_index([shard], out, model="qwen3-vl", estimator_overrides={"pipeline": "qwen-vl-utils"},
                         progress=False)
    assert report.num_reused == 0
    assert "qwen-vl-utils" in TokenIndex.open(out).manifest["video_pipeline"]


def _faststart(tmp_path) -> tuple[bytes, int]:
    """A faststart mp4 (``moov`` before ``mdat``) and the offset of its ``mdat`` payload."""
    data = read(write_video(str(tmp_path / "fast.mp4"), 30, 64, 36, 30, faststart=True, noise=True))
    pos = 0
    while data[pos + 4:pos + 8] != b"mdat":
        pos += int.from_bytes(data[pos:pos + 4], "big")
    assert data.index(b"moov") < pos, "the moov box comes first"
    return data, pos + 8


def test_a_faststart_mp4_cut_inside_mdat_is_an_index_error_naming_the_member(tmp_path):
    data, mdat = _faststart(tmp_path)
    cut = data[:mdat + (len(data) - mdat) // 2]
    shard = write_shard(tmp_path / "cut.tar", [Sample("clip", caption="ok", raw=[("mp4", data)]),
                                                Sample("cutclip", caption="bad", raw=[("mp4", cut)])])
    idx = TokenIndex.open(build_index([shard], tmp_path / "idx", progress=False).out)
    assert list(idx.keys) == ["clip"]
    (err,) = idx.errors
    assert err["key"] == "cutclip" and "'cutclip.mp4' is not a readable video" in err["reason"]
    assert "cut short: its 'mdat' box at byte" in err["reason"]


def test_a_video_that_fails_to_decode_at_read_time_names_its_member(tmp_path):
    # The index was built from the good clip; the shard then lost its frame data in place (same
    # size, same tar headers): the read names the member, not only the sample.
    data, mdat = _faststart(tmp_path)
    shard = write_shard(tmp_path / "v.tar", [Sample("clip", caption="a clip", raw=[("mp4", data)])])
    idx = TokenIndex.open(build_index([shard], tmp_path / "idx", model="qwen2-vl", progress=False).out)
    zeroed = data[:mdat] + bytes(len(data) - mdat)
    write_shard(shard, [Sample("clip", caption="a clip", raw=[("mp4", zeroed)])])
    named = r"cannot decode member clip\.mp4 of sample 0 in shard .*v\.tar"
    with pytest.raises(SampleReadError, match=named):
        IndexedShardDataset(idx, decode="pil")[0]
