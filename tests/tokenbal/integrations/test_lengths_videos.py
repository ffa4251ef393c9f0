"""``dataset_lengths`` on rows with videos: a ``videos`` column (paths, bytes, ``{bytes, path}`` as
``datasets.Video(decode=False)`` gives), ``{"type": "video"}`` parts, and videos named inline in the
parts (``video`` / ``path`` / ``url``), mixed with images, for every family with videos.

Here (no torchvision, so no real video processor): the processors are the families' real
processors with a stand-in video processor holding the real class's settings
(``family_processors.StandInVideoProcessor``); the expected count is the processor's own
``__call__`` on the text with each video placeholder replaced by the processor's own
``replace_video_token`` fed tokenbal's frame sampling (whose frames and grids
``tests/tokenbal/estimate/test_video.py`` checks against the video processors' ``sample_frames``),
so what is tested is the row-shape plumbing, the one-pass replacement and the token arithmetic.
``test_real_video_processors`` (marker ``compat``) runs the whole thing against the real video
processors in the side environments with torchvision (``tests/envs/tf-X.Y-video.txt``,
``tests/helpers/video_oracle_check.py``)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("av")
datasets = pytest.importorskip("datasets")

from tests.helpers import family_processors as fp  # noqa: E402
from tokenbal.integrations.hf import dataset_lengths  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")
N_ROWS = 40


def _has_replace_video_token(family: str) -> bool:
    try:
        cls = fp.processor_class(family)
    except (ImportError, ModuleNotFoundError) as e:   # 4.57's SmolVLMProcessor needs torchvision
        pytest.skip(f"{family}'s processor class cannot be imported here: {e}")
    return callable(getattr(cls, "replace_video_token", None))


def _processor(family: str, settings: dict | None = None, subclass: bool = True):
    try:
        return fp.video_family_processor(family, real=False, settings=settings, subclass=subclass)
    except (ImportError, ModuleNotFoundError, AttributeError) as e:
        pytest.skip(f"{family}'s processor or video processor class is not here: {e}")


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    return fp.write_videos(tmp_path_factory.mktemp("videos"), 16, seed=50)


def expected(proc, row: dict) -> int:
    """The rendered text with every image placeholder replaced by the processor's own
    ``replace_image_token`` (fed its own image processor's output) and every video placeholder by
    its own ``replace_video_token`` (fed tokenbal's sampling of each file), in one pass in text
    order as the processor's ``__call__`` replaces them, tokenized with its special-token rule."""
    import re

    from transformers.video_utils import VideoMetadata

    from tokenbal.estimate.chat import ChatTokenCounter
    from tokenbal.estimate.chat_video import sample_video
    from tokenbal.index.video import probe_video

    counter = ChatTokenCounter.from_processor(proc)
    # the processor's own template choice (SmolVLM swaps in its video template for video rows)
    text = proc.apply_chat_template([[dict(m) for m in row["messages"]]], tokenize=False)
    text = text[0] if isinstance(text, list) else text
    sampled = []
    for path in row["files"]:
        info = probe_video(path)
        sampled.append((info, *sample_video(proc, counter.family, counter.estimator, info)))
    # the row's videos go through one call, padded to its longest (SmolVLM 5.19-5.24 read that)
    longest = max((len(idx) for _, idx, _ in sampled), default=0)
    videos = []
    for info, idx, grid in sampled:
        md = VideoMetadata(total_num_frames=info.frames, fps=info.fps, duration=info.frames / info.fps,
                           frames_indices=idx)
        inputs = {"video_grid_thw": [np.array(grid if grid else (len(idx), 1, 1))], "video_metadata": [md],
                  "pixel_values_videos": [np.zeros((len(idx), 1, 1, 1), np.uint8)],
                  "pixel_values": np.zeros((1, longest, 1, 1, 1), np.uint8)}
        videos.append(proc.replace_video_token(inputs, 0))
    images = []
    if row["images"]:
        own = {"return_row_col_info": True} if fp.is_smolvlm(proc) else {}   # its processor's call default
        processed = proc.image_processor(images=[[fp.load(v) for v in row["images"]]], **own)   # one row
        images = [proc.replace_image_token(processed, j) for j in range(len(row["images"]))]
    if callable(getattr(proc, "get_text_with_replacements", None)):
        # the processor's own one-pass replacement (5.25's Qwen3-VL folds the template's vision
        # start / end around a video placeholder into the bare token first)
        out = proc.get_text_with_replacements([text], images, videos)[0][0]
    else:
        queues = {proc.video_token: iter(videos), proc.image_token: iter(images)}
        pattern = re.compile(f"{re.escape(proc.video_token)}|{re.escape(proc.image_token)}")
        out = pattern.sub(lambda m: next(queues[m.group(0)]), text)
    kw = {"add_special_tokens": False} if out.startswith(proc.tokenizer.bos_token) else {}
    return len(proc.tokenizer([out], **kw)["input_ids"][0])


def _rows(family: str, videos: list, seed: int) -> list:
    return fp.random_video_rows(N_ROWS, seed=seed, videos=videos)


@pytest.mark.parametrize("family", fp.VIDEO_FAMILIES)
def test_every_row_shape_through_the_processor(family, videos, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    if not _has_replace_video_token(family):
        return _refused_on_this_transformers(family, videos)
    for k, settings in enumerate(fp.VIDEO_SETTINGS[family]):
        proc = _processor(family, settings)
        rows = _rows(family, videos, seed=50 + k)
        accepted, want = [], []
        for i, row in enumerate(rows):
            try:
                n = expected(proc, row)
            except ValueError:   # tokenbal's sampler rejects the video (e.g. fewer frames than num_frames)
                with pytest.raises(ValueError, match=r"^row 0: video "):
                    dataset_lengths([row], proc)
                continue
            accepted.append(i)
            want.append(n)
        assert len(accepted) >= N_ROWS // 2, (settings, len(accepted))
        got = dataset_lengths([rows[i] for i in accepted], proc)
        np.testing.assert_array_equal(got, want, err_msg=str(settings))
        assert {rows[i]["shape"] for i in accepted} == set(fp.VIDEO_SHAPES)
        # rows of two videos included (InternVL's and OneVision's of different frame counts too: the
        # packed Trainer's process_row builds those video by video)
        assert {len(rows[i]["files"]) for i in accepted} >= {0, 1, 2}


def _refused_on_this_transformers(family, videos):
    """A transformers whose processors have no ``replace_video_token`` (before 5.1x): refused, named."""
    proc = _processor(family)
    row = {"messages": [{"role": "user", "content": [{"type": "video", "video": videos[0]}]}], "images": []}
    with pytest.raises(ValueError, match=r"row 0: video 0: .*no processor.replace_video_token.*5\.19"):
        dataset_lengths([row], proc)


def test_a_datasets_video_column_with_num_proc_and_a_changed_file(videos, tmp_path, monkeypatch):
    """A ``datasets.Dataset`` with a ``Video(decode=False)`` column: counted as the rows are, the
    same with ``num_proc=2``, cached, and recounted when a video file behind a path changes."""
    if not _has_replace_video_token("qwen2-vl"):
        pytest.skip("this transformers' processors have no replace_video_token")
    monkeypatch.delenv("TOKENBAL_CACHE", raising=False)
    proc = _processor("qwen2-vl")
    files = [str(shutil.copy(v, tmp_path / f"c{i}{os.path.splitext(v)[1]}"))
             for i, v in enumerate(videos[:6])]
    rows = fp.random_video_rows(24, seed=3, videos=files)
    rows = [r for r in rows if r["shape"] in ("column", "parts")]
    want = dataset_lengths(rows, proc)
    table = [{"messages": r["messages"], "images": r["images"],
              "videos": [{"bytes": None, "path": p} for p in r["files"]]} for r in rows]
    column = datasets.Sequence(datasets.Video(decode=False))
    ds = datasets.Dataset.from_list(table).cast_column("videos", column)
    ds = ds.map(lambda r: r, load_from_cache_file=False, cache_file_name=str(tmp_path / "ds.arrow"))
    np.testing.assert_array_equal(dataset_lengths(ds, proc), want)
    np.testing.assert_array_equal(dataset_lengths(ds, proc, num_proc=2, cache=False), want)
    assert list(tmp_path.glob("tokenbal-lengths-*.npy"))
    # other video settings on the same processor: a new cache key, recounted
    vp = proc.video_processor
    saved = (vp.do_sample_frames, vp.fps)
    vp.do_sample_frames, vp.fps = True, 1.0
    np.testing.assert_array_equal(dataset_lengths(ds, proc), dataset_lengths(rows, proc))
    assert not np.array_equal(dataset_lengths(ds, proc), want)
    vp.do_sample_frames, vp.fps = saved
    np.testing.assert_array_equal(dataset_lengths(ds, proc), want)
    # a video file replaced by a longer one under the same path: recounted, not served from the cache
    target = next(r["files"][0] for r in rows if r["files"])
    from tests.helpers.videos import write_video

    longer = write_video(str(tmp_path / "longer.mp4"), 90, 128, 96, 30)
    shutil.copy(longer, target + ".new")
    os.replace(target + ".new", target)
    again = dataset_lengths(ds, proc)
    np.testing.assert_array_equal(again, dataset_lengths(rows, proc))
    assert not np.array_equal(again, want)


def test_unreadable_and_unsupported_videos_are_named(videos, tmp_path):
    if not _has_replace_video_token("qwen2-vl"):
        pytest.skip("this transformers' processors have no replace_video_token")
    proc = _processor("qwen2-vl")
    bad = tmp_path / "broken.mp4"
    bad.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"junk" * 50)
    ok = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "images": []}

    def row(part):
        return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "what"}]}],
                "images": []}

    with pytest.raises(ValueError, match=r"row 1: video messages video part\[0\] \('.*broken\.mp4'\): "):
        dataset_lengths([ok, row({"type": "video", "path": str(bad)})], proc)
    with pytest.raises(ValueError, match=r"row 0: video videos\[0\] \(\d+ bytes\): "):
        dataset_lengths([{**row({"type": "video"}), "videos": [b"not a video"]}], proc)
    with pytest.raises(ValueError, match=r"row 0: video .* is a URL"):
        dataset_lengths([row({"type": "video", "url": "https://example.com/a.mp4"})], proc)
    with pytest.raises(ValueError, match=r"row 0: video .*no such file|row 0: video .*cannot read"):
        dataset_lengths([row({"type": "video", "video": str(tmp_path / "missing.mp4")})], proc)
    # placeholders and videos disagree: named as the processor would reject it
    with pytest.raises(ValueError, match=r"row 0: the chat template renders 1 video placeholder.*0 video"):
        dataset_lengths([{**row({"type": "video"}), "videos": []}], proc)
    # a processor without a video processor (transformers builds none without torchvision)
    bare = fp.processor("qwen2-vl")
    bare.chat_template = fp.template("qwen2-vl", video_token=bare.video_token)
    with pytest.raises(ValueError, match=r"row 0: video 0: .*has no video processor"):
        dataset_lengths([row({"type": "video", "video": videos[0]})], bare)
    # a transformers without replace_video_token
    old = type("OldQwen2VLProcessor", (type(proc),), {"replace_video_token": None})
    proc.__class__ = old
    with pytest.raises(ValueError, match=r"row 0: video 0: .*no processor.replace_video_token"):
        dataset_lengths([row({"type": "video", "video": videos[0]})], proc)


def _video_envs() -> list[str]:
    from tests.helpers.envs import transformers_specs

    return transformers_specs("video")


@pytest.mark.compat
@pytest.mark.parametrize("env", _video_envs())
def test_real_video_processors(env):
    """Against the real video processors (torchvision) in each ``tf-X.Y-video`` side env
    (tests/envs/: transformers 5.19 / 5.24 / 5.25 over torch 2.14.1 + torchvision 0.29.1 + PyAV): 40
    random videos (mp4 / webm / avi, 33-128 px, 5-30 fps, 4-80 frames, some variable-rate), 60 random
    rows per family x video settings, every row shape; rows the processor rejects must be rejected
    naming the row; a ``datasets`` Video column, num_proc=2; ``process_row`` (the packed Trainer's
    collator) gives the counted length, rows of two videos included."""
    from tests.helpers.envs import oracle_in_env

    families = fp.VIDEO_ENV_FAMILIES
    results = oracle_in_env(env, "tests.helpers.video_oracle_check", "40", "60", "5", ",".join(families))
    assert {r["family"] for r in results} == set(families)
    for r in results:
        assert r["n_wrong"] == 0 and r["agree"] >= 40 and len(r["shapes"]) == len(fp.VIDEO_SHAPES), r
        assert r["process_row"] >= 10, r   # the packed Trainer's collator step, 1- and 2-video rows
        if r["family"] in ("internvl", "llava-onevision"):   # video by video == the processor's call
            assert r["parts_equal_call"] >= 5, r
    # a processor subclass over a videos column of another name (dataset_lengths(videos="clips")): its
    # spot check runs rows through the processor, reading that column (a mismatch is in n_wrong)
    for family in families:
        assert any(r["renamed_override"] for r in results if r["family"] == family), family



def _smolvlm_envs() -> list[str]:
    from tests.helpers.envs import transformers_specs

    return transformers_specs("video-smolvlm")


@pytest.mark.compat
@pytest.mark.parametrize("env", _smolvlm_envs())
def test_real_smolvlm_video_processor(env):
    """SmolVLM against its real processor + video processor in each ``tf-X.Y-video-smolvlm`` side
    env (the video env + num2words): 40 random videos of 4-80 frames and 6 long ones (200-600
    frames, 7-120 s), 70 random rows per video setting (every frame; fps 1 at most 8, where clips
    over 10 s skip a second at each end; fps 4 at most 6) + 7 text-only rows of string content,
    through a subclass of the processor: 0-2 videos + 0-2 images, every row shape. The processor's
    ``input_ids`` (with ``return_tensors="pt"``: 5.19 / 5.24 raise without it) against
    ``dataset_lengths``, a datasets Video column with num_proc=2, and ``process_row`` (rows with
    images and videos refused by name: the processor returns only the videos' pixels for them)."""
    from tests.helpers.envs import oracle_in_env

    results = oracle_in_env(env, "tests.helpers.video_oracle_check", "40", "70", "5", "smolvlm")
    assert len(results) == len(fp.VIDEO_SETTINGS["smolvlm"])
    for r in results:
        print(env, {k: r[k] for k in ("settings", "rows", "agree", "both_reject", "n_wrong", "process_row",
                                      "process_row_refused")})
        assert r["family"] == "smolvlm" and r["rows"] == 77, r
        assert r["n_wrong"] == 0 and r["agree"] >= 70 and set(fp.VIDEO_SHAPES) <= set(r["shapes"]), r
        assert r["process_row"] >= 10 and r["process_row_refused"] >= 1, r


def test_smolvlm_video_refusals(videos):
    """SmolVLM: a row with images and videos is counted (its processor's ``input_ids``) but the
    packed Trainer's ``process_row`` refuses it by name (the processor returns only the videos'
    ``pixel_values`` for it); sampling without both ``fps`` and ``num_frames`` (the processor raises)
    and ``do_pad=False`` are refused naming the setting."""
    from tokenbal.integrations.trainer_support import process_row

    proc = _processor("smolvlm")
    if not _has_replace_video_token("smolvlm"):
        pytest.skip("this transformers' processors have no replace_video_token")
    parts = [{"type": "image"}, {"type": "video", "video": videos[0]}, {"type": "text", "text": "what"}]
    both = {"messages": [{"role": "user", "content": parts}], "images": [fp.image_bytes(40, 30, "PNG", 1)]}
    assert dataset_lengths([both], proc)[0] == expected(proc, {**both, "files": [videos[0]]})
    with pytest.raises(ValueError, match=r"row \?: has 1 image\(s\) and 1 video\(s\); MySmolvlmProcessor "
                                         r"returns only the videos' pixel_values"):
        process_row(both, proc)
    video_only = {"messages": [{"role": "user", "content": [{"type": "video", "video": videos[0]}]}],
                  "images": []}
    for settings, named in (({"do_sample_frames": True, "fps": None, "num_frames": 8}, "needs both"),
                            ({"do_pad": False}, "do_pad=False is not modelled")):
        with pytest.raises(ValueError, match=rf"row 0: video 0: MySmolvlmProcessor: .*{named}"):
            dataset_lengths([video_only], _processor("smolvlm", settings))
