"""The direct estimator API, ``get_estimator(family).video_tokens(frames, width, height, fps)``, against
the real video processors' ``__call__`` (they need torchvision: run in a ``tf-X.Y-video`` env). Run as
``python -m tests.helpers.video_tokens_oracle_check EXAMPLES SEED`` with this checkout on PYTHONPATH
(``test_video.py::test_direct_video_tokens_real_processor`` does, in each env).

Qwen2-VL / Qwen2.5-VL / Qwen3-VL: hypothesis over frame counts (1-160, some just past a float-arange
overshoot), frame sides (1-300, ratios past 200:1 included), source fps (``None``: frames already
sampled), the processor's fps / min / max frames, tiny pixel budgets and the opt-in per-frame cap
(``cap_pixels_per_frame``, ``max_video_tokens``). LLaVA-OneVision / InternVL: ``video_frames`` unset
or a fixed count, 1-40 frames. The estimator must refuse (ValueError) exactly the videos the processor
raises on, and give its count (``video_grid_thw``; the frames it returns) for every other. Prints one
JSON line per family: examples run, agreements, refusals both made, a disagreement (shrunk)."""

from __future__ import annotations

import json
import sys
import warnings


def processor_tokens(proc, frames: int, width: int, height: int, fps: float | None, merge: int) -> int:
    import numpy as np
    from transformers.video_utils import VideoMetadata

    video = np.zeros((frames, height, width, 3), np.uint8)
    # fps=None: the frames were sampled already (do_sample_frames=False); the metadata's fps is unused
    md = VideoMetadata(total_num_frames=frames, fps=fps or 24.0, duration=frames / (fps or 24.0),
                       width=width, height=height, frames_indices=list(range(frames)))
    # channels_last said outright: a side of 1 or 3 is otherwise taken for the channel axis
    out = proc(videos=[video], video_metadata=[md], return_tensors="pt", input_data_format="channels_last")
    return int(out["video_grid_thw"][0].prod()) // (merge * merge)


def _count(tally: dict, ours: int | str, theirs: int | str, case: dict) -> None:
    """One example into ``tally``: both refuse (an error text each), agree, or a disagreement
    recorded with its case and raised, so hypothesis shrinks it (the last one stays recorded)."""
    tally["examples"] += 1
    if isinstance(ours, str) and isinstance(theirs, str):
        tally["both_refuse"] += 1
    elif ours == theirs:
        tally["agree"] += 1
    else:
        tally["wrong"] = {**case, "ours": ours, "processor": str(theirs)[:200]}
        raise AssertionError(tally["wrong"])


def check_family(family: str, examples: int, seed: int) -> dict:
    import transformers
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    from tokenbal.estimate import get_estimator

    cls = transformers.Qwen3VLVideoProcessor if family == "qwen3-vl" else transformers.Qwen2VLVideoProcessor
    tally = {"family": family, "transformers": transformers.__version__, "examples": 0, "agree": 0,
             "both_refuse": 0, "wrong": None}
    side = st.one_of(st.integers(1, 300), st.sampled_from([1, 2, 3, 27, 28, 29, 31, 32, 33]))

    @hseed(seed)
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(frames=st.one_of(st.integers(1, 160), st.sampled_from([1, 2, 3, 17, 30, 34, 41, 59, 61])),
           width=side, height=side,
           fps=st.one_of(st.none(), st.sampled_from([0.5, 1.0, 2.0, 24.0, 29.97, 30.0]),
                         st.floats(0.01, 500.0, allow_nan=False)),
           target=st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_frames=st.integers(1, 8),
           max_frames=st.integers(1, 200), budget=st.sampled_from([(4, 64), (1, 16), (16, 1024)]),
           cap=st.booleans(), max_video_tokens=st.sampled_from([4, 64, 768, 128000]))
    def check(frames, width, height, fps, target, min_frames, max_frames, budget, cap, max_video_tokens):
        f = 32 if family == "qwen3-vl" else 28
        lo, hi = budget[0] * f * f, budget[1] * f * f
        est = get_estimator(family, video_fps=target, video_min_frames=min_frames,
                            video_max_frames=max_frames,
                            video_min_pixels=lo, video_max_pixels=hi, cap_pixels_per_frame=cap,
                            max_video_tokens=max_video_tokens)
        proc = cls(size={"shortest_edge": lo, "longest_edge": hi}, patch_size=est.patch_size,
                   temporal_patch_size=est.temporal_patch_size, merge_size=est.merge_size, fps=target,
                   min_frames=min_frames, max_frames=max_frames, do_sample_frames=fps is not None,
                   cap_pixels_per_frame=cap, max_video_tokens=max_video_tokens)
        try:
            ours: int | str = est.video_tokens(frames, width, height, fps)
        except ValueError as e:
            ours = f"ValueError: {e}"
        try:
            theirs: int | str = processor_tokens(proc, frames, width, height, fps, est.merge_size)
        except Exception as e:  # noqa: BLE001 - whatever the processor raises is a refusal
            theirs = f"{type(e).__name__}: {e}"
        _count(tally, ours, theirs, dict(frames=frames, width=width, height=height, fps=fps, target=target,
                                         min_frames=min_frames, max_frames=max_frames, pixels=[lo, hi],
                                         cap=cap, max_video_tokens=max_video_tokens))

    try:
        check()
    except AssertionError:
        pass
    return tally


def check_fixed_frames(family: str, examples: int, seed: int) -> dict:
    """LLaVA-OneVision / InternVL: ``video_tokens`` with ``video_frames`` unset (the frames were sampled
    already: every one is used) or N (the processor samples N of them): refused exactly where the
    processor's ``__call__`` raises, else the count of the frames it returns."""
    import torch
    import transformers
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st
    from transformers.video_utils import VideoMetadata

    from tokenbal.estimate import get_estimator

    cls = (transformers.LlavaOnevisionVideoProcessor if family == "llava-onevision"
           else transformers.InternVLVideoProcessor)
    tally = {"family": family, "transformers": transformers.__version__, "examples": 0, "agree": 0,
             "both_refuse": 0, "wrong": None}

    @hseed(seed)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(frames=st.integers(1, 40), video_frames=st.one_of(st.none(), st.integers(1, 40)),
           width=st.integers(1, 200), height=st.integers(1, 200))
    def check(frames, video_frames, width, height):
        est = get_estimator(family, video_frames=video_frames)
        try:
            ours: int | str = est.video_tokens(frames, width, height, 24.0)
        except ValueError as e:
            ours = f"ValueError: {e}"
        proc = cls(size={"height": 28, "width": 28}, num_frames=video_frames,
                   do_sample_frames=video_frames is not None)
        # a torch video: InternVLVideoProcessor's one-frame sample (a 1-element torch index) indexes a numpy
        # video as a scalar and drops its frame axis (RuntimeError in permute, transformers 5.19-5.25),
        # a bug of that input type, not a refusal of the video
        video = torch.zeros((frames, height, width, 3), dtype=torch.uint8)
        md = VideoMetadata(total_num_frames=frames, fps=24.0, duration=frames / 24, width=width,
                           height=height)
        try:
            out = proc(videos=[video], video_metadata=[md], return_tensors="pt",
                       input_data_format="channels_last")
            n = int(out["pixel_values_videos"].shape[1])
            theirs: int | str = est.replace(video_frames=None).video_tokens(n, width, height, None)
        except Exception as e:  # noqa: BLE001 - whatever the processor raises is a refusal
            theirs = f"{type(e).__name__}: {e}"
        _count(tally, ours, theirs, dict(frames=frames, video_frames=video_frames, width=width,
                                         height=height))

    try:
        check()
    except AssertionError:
        pass
    return tally


def main(examples: int, seed: int) -> int:
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    for family in ("qwen2-vl", "qwen2.5-vl", "qwen3-vl"):
        print(json.dumps(check_family(family, examples, seed)), flush=True)
    for family in ("llava-onevision", "internvl"):
        print(json.dumps(check_fixed_frames(family, examples, seed)), flush=True)
    return 0   # the test reads the JSON lines (a disagreement is a line, not an exit status)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
