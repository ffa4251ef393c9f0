"""Video token plans (tokenbal.estimate.video) against the families' own code, on real videos written
with PyAV and decoded at the planned frames.

Oracles: qwen-vl-utils' ``fetch_video`` (its ``calculate_video_frame_range`` / ``smart_nframes`` /
``smart_resize``, fed by a PyAV reader that works like its decord reader), transformers 5.24's video
processors' ``sample_frames`` and ``get_num_of_video_patches`` (the classes that import torchvision
are imported with shape-only stand-ins, see ``tests.helpers.videos.import_without_torchvision``) and the
processors' prompt builders (``replace_video_token``, ``_calculate_timestamps``).
"""

from __future__ import annotations

import importlib.util
import types
from fractions import Fraction

import numpy as np
import pytest

pytest.importorskip("av")
torch = pytest.importorskip("torch")

from tests.helpers.oracles import require_oracle  # noqa: E402
from tests.helpers.videos import import_without_torchvision, write_video  # noqa: E402
from tokenbal.estimate import get_estimator  # noqa: E402
from tokenbal.estimate.video import VideoRequest, plan_video, video_pipeline  # noqa: E402
from tokenbal.index.video import decode_frames, probe_video  # noqa: E402

NTSC = Fraction(30000, 1001)
VIDEOS = [("a.mp4", 61, 64, 36, NTSC, {}), ("b.webm", 50, 33, 47, 25, {}),
          ("c.mp4", 40, 48, 80, 30, {"gaps_ms": [33, 50, 100]}), ("d.avi", 90, 32, 16, 30, {})]
OPTIONS = [{}, {"fps": 1.0}, {"nframes": 6}, {"video_start": 0.4, "video_end": 1.5},
           {"min_frames": 8, "max_frames": 10}]


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    d = tmp_path_factory.mktemp("v")
    out = {}
    for name, n, w, h, fps, kw in VIDEOS:
        path = write_video(str(d / name), n, w, h, fps, **kw)
        out[name] = (path, decode_frames(path, range(n)))
    return out


def request(path: str, opts: dict) -> VideoRequest:
    info = probe_video(path)
    return VideoRequest(frames=info.frames, fps=info.fps, width=info.width, height=info.height,
                        sample_fps=opts.get("fps"), min_frames=opts.get("min_frames"),
                        max_frames=opts.get("max_frames"), nframes=opts.get("nframes"),
                        start=opts.get("video_start"), end=opts.get("video_end"))


def check_frames(frames_all, plan, frames_oracle_idx):
    assert list(plan.indices) == [int(i) for i in frames_oracle_idx]
    # what the index's reader decodes at the planned frames is the oracle's frames, pixel for pixel
    return frames_all[list(plan.indices)]


@pytest.fixture(scope="module")
def qvu():
    if importlib.util.find_spec("qwen_vl_utils") is None:  # in the test extra; not in the matrix envs
        pytest.skip("qwen-vl-utils is not installed (the oracle of this test)")
    vp = import_without_torchvision("qwen_vl_utils.vision_process")

    def pyav_reader(ele):   # qwen-vl-utils' decord reader, with PyAV decoding the file
        import av

        with av.open(ele["video"]) as c:
            fps = float(c.streams.video[0].average_rate)
            frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
        start, end, total = vp.calculate_video_frame_range(ele, len(frames), fps)
        n = vp.smart_nframes(ele, total_frames=total, video_fps=fps)
        idx = torch.linspace(start, end, n).round().long().tolist()
        video = torch.from_numpy(frames[idx]).permute(0, 3, 1, 2)
        return video, {"fps": fps, "frames_indices": idx, "total_num_frames": total}, n / total * fps

    vp.VIDEO_READER_BACKENDS["pyav"] = pyav_reader
    vp.FORCE_QWENVL_VIDEO_READER = "pyav"
    vp.get_video_reader_backend.cache_clear()
    return vp


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_qwen_vl_utils_pipeline(videos, qvu, family):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_resize
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    est = get_estimator(family, pipeline="qwen-vl-utils")
    assert "qwen-vl-utils" in video_pipeline(est)
    patch = est.patch_size
    for path, frames in videos.values():
        for opts in OPTIONS:
            ele = {"video": path, **opts}
            video, meta = qvu.fetch_video(ele, image_patch_size=patch, return_video_metadata=True)
            plan = plan_video(est, request(path, opts))
            got = check_frames(frames, plan, meta["frames_indices"])
            assert len(got) == video.shape[0]
            n, _, h, w = video.shape
            if est.processor_resize:   # Qwen2.5-VL README: the processor resizes again
                h, w = hf_resize(h, w, est.factor, est.video_min_pixels, est.video_max_pixels)
            want = -(-n // 2) * (h // est.factor) * (w // est.factor)
            assert plan.tokens == want, (path, opts)
            if family == "qwen3-vl":
                stamps = Qwen3VLProcessor._calculate_timestamps(None, list(meta["frames_indices"]),
                                                               meta["fps"], 2)
                assert plan.texts == tuple(f"<{t:.1f} seconds>" for t in stamps)
                assert plan.special == 2 + 2 * (n // 2)


def _hf_metadata(path: str, first: int, last: int):
    from transformers.video_utils import VideoMetadata

    info = probe_video(path)
    total = last - first + 1
    return VideoMetadata(total_num_frames=total, fps=info.fps, width=info.width, height=info.height,
                         duration=total / info.fps)


def _clip(path, opts):
    from tokenbal.estimate.video import clip_range

    info = probe_video(path)
    return clip_range(info.frames, info.fps, opts.get("video_start"), opts.get("video_end"))


def test_qwen3_processor_pipeline(videos):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    est = get_estimator("qwen3-vl")
    size = {"shortest_edge": est.video_min_pixels, "longest_edge": est.video_max_pixels}
    proc = Qwen3VLVideoProcessor(size=size)
    for path, frames in videos.values():
        for opts in OPTIONS:
            first, last = _clip(path, opts)
            md = _hf_metadata(path, first, last)
            kw = {"fps": opts["fps"]} if "fps" in opts else {}
            if "nframes" in opts:
                kw = {"num_frames": opts["nframes"]}
            p = proc
            if "min_frames" in opts:
                p = Qwen3VLVideoProcessor(size=size, min_frames=opts["min_frames"],
                                          max_frames=opts["max_frames"])
            idx = [first + int(i) for i in p.sample_frames(md, **kw)]
            plan = plan_video(est, request(path, opts))
            got = check_frames(frames, plan, idx)
            t, h, w = got.shape[:3]
            require_oracle(proc, "get_num_of_video_patches")
            assert plan.tokens == proc.get_num_of_video_patches(t, h, w) // 4, (path, opts)
            stamps = Qwen3VLProcessor._calculate_timestamps(None, idx, md.fps, 2)
            assert plan.texts == tuple(f"<{s:.1f} seconds>" for s in stamps)


def test_qwen2_processor_pipeline(videos):
    mod = import_without_torchvision("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    est = get_estimator("qwen2-vl")
    C = mod.Qwen2VLVideoProcessor
    for path, frames in videos.values():
        for opts in OPTIONS:
            first, last = _clip(path, opts)
            md = _hf_metadata(path, first, last)
            ns = types.SimpleNamespace(num_frames=None, fps=opts.get("fps", 2.0), temporal_patch_size=2,
                                       min_frames=opts.get("min_frames", 4),
                                       max_frames=opts.get("max_frames", 768),
                                       merge_size=2, patch_size=14,
                                       size={"shortest_edge": est.video_min_pixels,
                                             "longest_edge": est.video_max_pixels})
            # 5.25's get_num_of_video_patches reads its settings through this method: the
            # namespace's own fields (the processor it stands in for has no other defaults)
            ns._merge_and_standardize_kwargs = lambda ns=ns, **kw: {**vars(ns), **kw}
            kw = {"num_frames": opts["nframes"], "fps": None} if "nframes" in opts else {}
            idx = [first + int(i) for i in C.sample_frames(ns, md, **kw)]
            plan = plan_video(est, request(path, opts))
            got = check_frames(frames, plan, idx)
            t, h, w = got.shape[:3]
            assert plan.tokens == C.get_num_of_video_patches(ns, t, h, w, {}) // 4, (path, opts)
            assert plan.special == 2 and plan.texts == ()


def test_glm4v(videos):
    # 5.6-5.9's GLM-4V video processor module imports torchvision
    module = pytest.importorskip("transformers.models.glm4v.video_processing_glm4v")
    Glm4vVideoProcessor = module.Glm4vVideoProcessor

    est = get_estimator("glm-4.1v")
    proc = Glm4vVideoProcessor()
    for path, frames in videos.values():
        for opts in [o for o in OPTIONS if set(o) <= {"fps", "video_start", "video_end"}]:
            first, last = _clip(path, opts)
            md = _hf_metadata(path, first, last)
            rel = proc.sample_frames(md, fps=opts.get("fps"))
            idx = [first + int(i) for i in rel]
            plan = plan_video(est, request(path, opts))
            got = check_frames(frames, plan, idx)
            t, h, w = got.shape[:3]
            require_oracle(proc, "get_num_of_video_patches")
            assert plan.tokens == proc.get_num_of_video_patches(t, h, w) // 4, (path, opts)
            assert plan.texts == tuple(str(int(i / md.fps)) for i in idx[::2])
            assert plan.special == 2 + 2 * (t // 2)



GLM_SETTINGS = [
    {"fps": 1.0, "max_duration": 1, "size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 40}},
    {"do_sample_frames": False, "size": {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 64}},
    {"fps": 3.0, "temporal_patch_size": 3, "merge_size": 1, "patch_size": 16},
]


@pytest.mark.parametrize("settings", GLM_SETTINGS, ids=["small-short", "every-frame", "geometry"])
def test_glm4v_processor_settings(videos, settings):
    """A GLM-4.1V video processor at settings other than the checkpoints': the frames its
    sample_frames keeps (every frame without sampling) and its own patch count, as
    chat_video.glm_video_settings reads them off the processor."""
    module = pytest.importorskip("transformers.models.glm4v.video_processing_glm4v")
    from tokenbal.estimate.chat_video import glm_video_settings

    proc = module.Glm4vVideoProcessor(**settings)
    glm = glm_video_settings(types.SimpleNamespace(video_processor=proc))
    assert glm.sample == settings.get("do_sample_frames", True)
    est = get_estimator("glm-4.1v")
    for path, frames in videos.values():
        md = _hf_metadata(path, *_clip(path, {}))
        idx = ([int(i) for i in proc.sample_frames(md)] if glm.sample
               else list(range(md.total_num_frames)))
        tp = proc.temporal_patch_size
        if len(idx) < tp:
            with pytest.raises(ValueError, match="temporal_patch_size"):
                plan_video(est, request(path, {}), glm=glm)
            continue
        plan = plan_video(est, request(path, {}), glm=glm)
        got = check_frames(frames, plan, idx)
        t, h, w = got.shape[:3]
        require_oracle(proc, "get_num_of_video_patches")
        merged = proc.merge_size ** 2
        assert plan.tokens == proc.get_num_of_video_patches(t, h, w) // merged, (path, settings)
        assert plan.grid[0] == -(-t // tp) and plan.special == 2 + 2 * plan.grid[0]

def test_llava_onevision(videos):
    import importlib

    lp = importlib.import_module("transformers.models.llava_onevision.processing_llava_onevision")
    lv = importlib.import_module("transformers.models.llava_onevision.video_processing_llava_onevision")

    LlavaOnevisionProcessor = lp.LlavaOnevisionProcessor
    proc = lv.LlavaOnevisionVideoProcessor()
    ns = types.SimpleNamespace(num_image_tokens=729, video_token="<video>")
    for frames_setting in (None, 8):
        est = get_estimator("llava-onevision", video_frames=frames_setting)
        for path, frames in videos.values():
            for opts in [{}, {"nframes": 6}, {"video_start": 0.4, "video_end": 1.5}]:
                first, last = _clip(path, opts)
                md = _hf_metadata(path, first, last)
                n = opts.get("nframes", frames_setting)
                rel = proc.sample_frames(md, num_frames=n) if n else range(md.total_num_frames)
                idx = [first + int(i) for i in rel]
                plan = plan_video(est, request(path, opts))
                got = check_frames(frames, plan, idx)
                require_oracle(LlavaOnevisionProcessor, "replace_video_token")
                prompt = LlavaOnevisionProcessor.replace_video_token(ns, {"pixel_values_videos": [got]}, 0)
                assert plan.tokens == prompt.count("<video>"), (path, opts)


def test_internvl(videos):
    mod = import_without_torchvision("transformers.models.internvl.video_processing_internvl")
    from transformers.models.internvl.processing_internvl import InternVLProcessor

    C = mod.InternVLVideoProcessor
    ns = types.SimpleNamespace(num_frames=None, fps=None, initial_shift=True)
    pns = types.SimpleNamespace(start_image_token="<img>", end_image_token="</img>",
                                image_token="<IMG_CONTEXT>", image_seq_length=256)
    est = get_estimator("internvl", video_frames=8)
    for path, frames in videos.values():
        for opts in [{}, {"nframes": 6}, {"video_start": 0.4, "video_end": 1.5}]:
            first, last = _clip(path, opts)
            md = _hf_metadata(path, first, last)
            idx = [first + int(i) for i in C.sample_frames(ns, md, num_frames=opts.get("nframes", 8))]
            plan = plan_video(est, request(path, opts))
            got = check_frames(frames, plan, idx)
            require_oracle(InternVLProcessor, "replace_video_token")
            prompt = InternVLProcessor.replace_video_token(pns, {"pixel_values_videos": [got]}, 0)
            assert plan.tokens == prompt.count("<IMG_CONTEXT>")
            assert plan.special == prompt.count("<img>") + prompt.count("</img>")
            rest = prompt.replace("<IMG_CONTEXT>", "").replace("<img>", "").replace("</img>", "")
            assert "".join(plan.texts) == rest


@pytest.fixture(scope="module")
def smolvlm_sampler():
    try:
        mod = import_without_torchvision("transformers.models.smolvlm.video_processing_smolvlm")
    except ImportError as e:
        pytest.skip(f"no SmolVLM video processor module here: {e}")
    from transformers.video_utils import VideoMetadata

    ns = types.SimpleNamespace(num_frames=None, fps=None)

    def sample(total, fps, num_frames, sample_fps):
        md = VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps)
        return [int(i) for i in mod.SmolVLMVideoProcessor.sample_frames(ns, md, num_frames=num_frames,
                                                                          fps=sample_fps)]
    return sample


def test_smolvlm_sample_frames(smolvlm_sampler):
    """``smolvlm_frames`` == ``SmolVLMVideoProcessor.sample_frames`` on clips from 1 frame to 20
    minutes, around the skip-a-second line (duration - 2 s vs num_frames / fps) and the rounding of
    fps x duration."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from tokenbal.estimate.video import smolvlm_frames

    rates = [5, 10, 12.5, float(NTSC), 24, 25, 30, 60]
    cases = [(1, 30, 64, 1), (2, 30, 64, 1), (59, 30, 8, 1), (300, 30, 8, 1), (301, 30, 8, 1),
             (330, 30, 8, 1), (331, 30, 8, 1), (36000, 30, 64, 1), (45, 30, 8, 4.0), (2, 5, 1, 0.5)]
    for case in cases:
        assert smolvlm_frames(*case) == smolvlm_sampler(*case), case

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(st.integers(1, 40000), st.sampled_from(rates), st.integers(1, 96),
           st.sampled_from([0.25, 0.5, 1, 2, 3.0, 4.0, 8]))
    def check(total, fps, num_frames, sample_fps):
        assert smolvlm_frames(total, fps, num_frames, sample_fps) == smolvlm_sampler(total, fps, num_frames,
                                                                                     sample_fps)
    check()


def test_errors():
    est = get_estimator("qwen2-vl", pipeline="qwen-vl-utils")
    with pytest.raises(ValueError, match="empty"):
        plan_video(est, VideoRequest(frames=30, fps=30.0, width=32, height=32, start=0.9, end=0.5))
    with pytest.raises(ValueError, match="no video support"):
        plan_video(get_estimator("phi-4-multimodal"), VideoRequest(frames=30, fps=30.0, width=32, height=32))
    assert video_pipeline(get_estimator("phi-4-multimodal")) is None


def test_glm4v_settings_the_processor_cannot_run_are_named():
    from tokenbal.estimate.chat_video import VideoCountError, glm_video_settings

    def settings(**vp):
        return glm_video_settings(types.SimpleNamespace(video_processor=types.SimpleNamespace(**vp)))

    with pytest.raises(VideoCountError, match="lacks shortest_edge"):
        settings(size={"height": 224, "width": 224})
    with pytest.raises(VideoCountError, match="without fps"):
        settings(size={"shortest_edge": 1, "longest_edge": 2}, do_sample_frames=True, fps=None)
    with pytest.raises(VideoCountError, match="do_resize=False"):
        settings(size={"shortest_edge": 1, "longest_edge": 2}, do_resize=False)
    got = settings(size={"shortest_edge": 10, "longest_edge": 20}, do_sample_frames=False, fps=None)
    assert (got.sample, got.min_pixels, got.max_pixels, got.max_duration) == (False, 10, 20, 300)


@pytest.mark.parametrize("temporal_patch_size, nframes", [(3, 7), (3, 5), (1, 7), (4, 10)])
def test_qwen2_processor_num_frames_round_to_its_temporal_patch(temporal_patch_size, nframes):
    """``Qwen2VLVideoProcessor.sample_frames`` rounds ``num_frames`` to a multiple of its own
    ``temporal_patch_size``, not of 2."""
    mod = import_without_torchvision("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    C = mod.Qwen2VLVideoProcessor
    est = get_estimator("qwen2-vl", temporal_patch_size=temporal_patch_size)
    total, fps = 90, 30.0
    md = types.SimpleNamespace(total_num_frames=total, fps=fps, duration=total / fps)
    ns = types.SimpleNamespace(num_frames=None, fps=None, temporal_patch_size=temporal_patch_size,
                               min_frames=4, max_frames=768)
    want = [int(i) for i in C.sample_frames(ns, md, num_frames=nframes, fps=None)]
    plan = plan_video(est, VideoRequest(frames=total, fps=fps, width=64, height=48, nframes=nframes))
    assert list(plan.indices) == want
    assert plan.grid[0] == -(-len(want) // temporal_patch_size)


@pytest.mark.parametrize("total, fps, opts",
                         [(59, 2.0, {}), (17, 1.0, {"nframes": 14}), (61, 30.0, {"nframes": 56})])
def test_qwen2_processor_sampling_past_the_last_frame_is_an_error(total, fps, opts):
    """For some clip lengths ``Qwen2VLVideoProcessor.sample_frames``' float ``arange`` takes one step
    more than the frames it samples and picks the frame after the clip (the processor then raises
    IndexError indexing the video): the plan refuses the video rather than count frames that are
    not there."""
    mod = import_without_torchvision("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    C = mod.Qwen2VLVideoProcessor
    md = types.SimpleNamespace(total_num_frames=total, fps=fps, duration=total / fps)
    ns = types.SimpleNamespace(num_frames=None, fps=2.0, temporal_patch_size=2, min_frames=4, max_frames=768)
    kw = {"num_frames": opts["nframes"], "fps": None} if "nframes" in opts else {}
    assert int(C.sample_frames(ns, md, **kw)[-1]) == total   # past the last frame, total - 1
    req = VideoRequest(frames=total, fps=fps, width=64, height=48, nframes=opts.get("nframes"))
    with pytest.raises(ValueError, match="raises IndexError"):
        plan_video(get_estimator("qwen2-vl"), req)


@pytest.mark.parametrize("total, settings", [
    (3, {"num_frames": 7, "fps": None}), (5, {"num_frames": 8, "fps": None}), (2, {"fps": None}),
    (3, {"fps": None, "min_frames": 6}), (40, {"fps": None, "max_frames": 9})])
def test_qwen3_processor_samples_with_repeats_where_the_clip_is_short(total, settings):
    """``Qwen3VLVideoProcessor.sample_frames`` takes ``num_frames`` above the clip's frame count
    (and, with neither fps nor num_frames, ``min(max(total, min_frames), max_frames)`` frames),
    repeating frames by ``linspace``: the count follows instead of refusing the video."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from tests.helpers import family_processors as fp
    from tokenbal.estimate.chat_video import sample_video
    from tokenbal.estimate.vision import estimator_from_processor

    fps, w, h = 30.0, 64, 48
    settings = {"do_sample_frames": True, **settings}
    real = Qwen3VLVideoProcessor(**{**fp._video_size("qwen3-vl"), **settings})
    md = VideoMetadata(total_num_frames=total, fps=fps, width=w, height=h, duration=total / fps)
    # the processor hands its own num_frames / fps to sample_frames
    want = [int(i) for i in real.sample_frames(md, num_frames=real.num_frames, fps=real.fps)]
    proc = fp.video_family_processor("qwen3-vl", real=False, settings=settings)
    est = estimator_from_processor(proc)
    info = types.SimpleNamespace(frames=total, fps=fps, width=w, height=h)
    idx, grid = sample_video(proc, "qwen3-vl", est, info)
    assert idx == want
    require_oracle(real, "get_num_of_video_patches")
    assert grid[0] * grid[1] * grid[2] == real.get_num_of_video_patches(len(want), h, w)


def test_direct_video_tokens_refuse_what_qwen2_sample_frames_cannot_sample():
    """``est.video_tokens(frames, w, h, fps)`` (the direct API, not ``plan_video``) refuses the clips
    whose frame sampling ``Qwen2VLVideoProcessor.sample_frames`` takes past the last frame (the processor
    raises IndexError on them: 59 frames at 2 fps gave 116 tokens), and otherwise counts the frames it
    samples: hypothesis over clip lengths, frame rates and sampling settings against the real class's
    ``sample_frames`` (and Qwen3-VL's, which never overshoots)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    qwen2 = import_without_torchvision("transformers.models.qwen2_vl.video_processing_qwen2_vl")
    qwen3 = import_without_torchvision("transformers.models.qwen3_vl.video_processing_qwen3_vl")
    with pytest.raises(ValueError, match="raises IndexError"):
        get_estimator("qwen2-vl").video_tokens(59, 64, 48, 2.0)

    @settings(max_examples=400, deadline=None)
    @given(family=st.sampled_from(["qwen2-vl", "qwen2.5-vl", "qwen3-vl"]), total=st.integers(1, 400),
           fps=st.one_of(st.sampled_from([1.0, 2.0, 24.0, 25.0, 29.97, 30.0, 60.0]),
                         st.floats(0.05, 120.0, allow_nan=False)),
           target=st.sampled_from([0.5, 1.0, 2.0, 3.0, 4.0]), min_frames=st.integers(1, 8),
           max_frames=st.integers(1, 800), temporal=st.integers(1, 4))
    def check(family, total, fps, target, min_frames, max_frames, temporal):
        est = get_estimator(family, video_fps=target, video_min_frames=min_frames,
                            video_max_frames=max_frames,
                            temporal_patch_size=temporal)
        md = types.SimpleNamespace(total_num_frames=total, fps=fps, duration=total / fps)
        ns = types.SimpleNamespace(num_frames=None, fps=target, temporal_patch_size=temporal,
                                   min_frames=min_frames, max_frames=max_frames)
        try:
            if family == "qwen3-vl":
                picked = [int(i) for i in qwen3.Qwen3VLVideoProcessor.sample_frames(ns, md)]
            else:
                picked = [int(i) for i in qwen2.Qwen2VLVideoProcessor.sample_frames(ns, md, fps=target)]
            refused = picked[-1] >= total   # video[indices]: IndexError
        except (ZeroDivisionError, ValueError):
            refused = True
        if refused:
            with pytest.raises(ValueError):
                est.sampled_frames(total, fps)
            with pytest.raises(ValueError):
                est.video_tokens(total, 64, 48, fps)
        else:
            assert est.sampled_frames(total, fps) == len(picked)
            if family != "qwen3-vl":   # (Qwen3-VL's resize has its own frame checks, per version)
                assert est.video_grid(total, 64, 48, fps)[0] == -(-len(picked) // temporal)

    check()


def _video_envs() -> list[str]:
    from tests.helpers.envs import transformers_specs

    return transformers_specs("video")


@pytest.mark.compat
@pytest.mark.parametrize("env", _video_envs())
def test_direct_video_tokens_real_processor(env):
    """``video_tokens(frames, w, h, fps)`` against the real Qwen2-VL / Qwen2.5-VL / Qwen3-VL,
    LLaVA-OneVision and InternVL video processors' ``__call__`` in each ``tf-X.Y-video`` env
    (torchvision): 300 hypothesis examples per family over frame counts, frame sides, source fps,
    sampling settings (``video_frames``), tiny pixel budgets and the per-frame cap; the estimator
    refuses exactly what the processor raises on and agrees on every count
    (``tests/helpers/video_tokens_oracle_check.py``)."""
    from tests.helpers.envs import oracle_in_env

    results = oracle_in_env(env, "tests.helpers.video_tokens_oracle_check", "300", "0")
    assert [r["family"] for r in results] == ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "llava-onevision",
                                              "internvl"]
    for r in results:
        assert r["wrong"] is None and r["examples"] == 300 and r["agree"] >= 150, r


@pytest.mark.parametrize("family", ["llava-onevision", "internvl"])
def test_direct_video_tokens_of_a_clip_shorter_than_video_frames_are_refused(family):
    """``video_frames=N`` (a fixed number of sampled frames) and a video of fewer frames: the processor's
    sampler (``BaseVideoProcessor`` / ``InternVLVideoProcessor.sample_frames``) raises, and
    ``video_tokens`` used to count N frames of it anyway (LLaVA-OneVision 1569 tokens, InternVL 2048 for
    a 3-frame clip). From N frames up the counts are the N sampled frames'."""
    if family == "internvl":
        mod = import_without_torchvision("transformers.models.internvl.video_processing_internvl")
        ns = types.SimpleNamespace(num_frames=None, fps=None, initial_shift=True)

        def sample(md, n):
            return mod.InternVLVideoProcessor.sample_frames(ns, md, num_frames=n)
    else:   # BaseVideoProcessor.sample_frames (from 5.19 through default_sample_indices_fn)
        name = "transformers.models.llava_onevision.video_processing_llava_onevision"
        proc = import_without_torchvision(name).LlavaOnevisionVideoProcessor()

        def sample(md, n):
            return proc.sample_frames(md, num_frames=n)
    est = get_estimator(family, video_frames=8)
    for total in (1, 3, 7, 8, 9, 40):
        md = types.SimpleNamespace(total_num_frames=total, fps=24.0, duration=total / 24)
        try:
            picked = len(sample(md, 8))
        except ValueError:
            picked = None
        if picked is None:
            with pytest.raises(ValueError, match="video_frames=8 frames cannot be sampled"):
                est.video_tokens(total, 64, 48, 24.0)
        else:
            assert picked == 8
            assert est.video_tokens(total, 64, 48, 24.0) == est.replace(video_frames=None).video_tokens(
                8, 64, 48, None)
