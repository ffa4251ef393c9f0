"""The direct estimator API, ``get_estimator(family).video_tokens(frames, width, height, fps)``, against
the real Qwen2-VL / Qwen3-VL video processors' ``__call__`` (they need torchvision: run in a
``tf-X.Y-video`` env). Run as ``python -m tests.helpers.video_tokens_oracle_check EXAMPLES SEED`` with
this checkout on PYTHONPATH (``test_video.py::test_direct_video_tokens_real_processor`` does, in each
env). Hypothesis over frame counts (1-160, some just past a float-arange overshoot), frame sides
(1-300, ratios past 200:1 included), source fps (``None``: frames already sampled), the processor's
fps / min / max frames and tiny pixel budgets: the estimator must refuse (ValueError) exactly the
videos the processor raises on, and give its ``video_grid_thw`` token count for every other. Prints
one JSON line per family: examples run, agreements, refusals both made, a disagreement (shrunk)."""

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
           max_frames=st.integers(1, 200), budget=st.sampled_from([(4, 64), (1, 16), (16, 1024)]))
    def check(frames, width, height, fps, target, min_frames, max_frames, budget):
        f = 32 if family == "qwen3-vl" else 28
        lo, hi = budget[0] * f * f, budget[1] * f * f
        est = get_estimator(family, video_fps=target, video_min_frames=min_frames,
                            video_max_frames=max_frames,
                            video_min_pixels=lo, video_max_pixels=hi)
        proc = cls(size={"shortest_edge": lo, "longest_edge": hi}, patch_size=est.patch_size,
                   temporal_patch_size=est.temporal_patch_size, merge_size=est.merge_size, fps=target,
                   min_frames=min_frames, max_frames=max_frames, do_sample_frames=fps is not None)
        try:
            ours: int | str = est.video_tokens(frames, width, height, fps)
        except ValueError as e:
            ours = f"ValueError: {e}"
        try:
            theirs: int | str = processor_tokens(proc, frames, width, height, fps, est.merge_size)
        except Exception as e:  # noqa: BLE001 - whatever the processor raises is a refusal
            theirs = f"{type(e).__name__}: {e}"
        tally["examples"] += 1
        if isinstance(ours, str) and isinstance(theirs, str):
            tally["both_refuse"] += 1
        elif ours == theirs:
            tally["agree"] += 1
        else:
            case = dict(frames=frames, width=width, height=height, fps=fps, target=target,
                        min_frames=min_frames, max_frames=max_frames, pixels=[lo, hi])
            tally["wrong"] = {**case, "ours": ours, "processor": str(theirs)[:200]}
            raise AssertionError(tally["wrong"])   # hypothesis shrinks it; the last one is printed

    try:
        check()
    except AssertionError:
        pass
    return tally


def main(examples: int, seed: int) -> int:
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    failed = 0
    for family in ("qwen2-vl", "qwen2.5-vl", "qwen3-vl"):
        tally = check_family(family, examples, seed)
        failed += tally["wrong"] is not None
        print(json.dumps(tally), flush=True)
    return 0   # the test reads the JSON lines (a disagreement is a line, not an exit status)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
