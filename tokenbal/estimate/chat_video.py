"""Videos in chat rows, counted as a transformers processor counts them, from container headers.

A processor's ``__call__`` replaces the ``i``-th video placeholder of the rendered text with
``processor.replace_video_token(video_inputs, i)``: placeholders × the video's token count, plus
whatever the family writes around them (Qwen3-VL's ``<t seconds>`` and per-frame vision start /
end, GLM-4.1V's per-frame image markers and whole-second stamps, InternVL's ``FrameN:`` labels,
SmolVLM's intro sentence and ``Frame from MM:SS:`` + one image run per frame).
What that method reads of the processed video is its shape only: ``video_grid_thw`` (frames,
height, width in patches), the sampled frames' indices and the source fps (``video_metadata``),
and the number of frames (``pixel_values_videos[i].shape[0]``; SmolVLM 5.19-5.24: the call's
padded ``pixel_values.shape[1]``, see :func:`tokenbal.hf_compat.video_token_inputs`).

:func:`video_replacement` computes those from the container header alone
(:func:`tokenbal.index.video.probe_video`: frames, fps, size; no frame decoded) with the frame
sampling and resize rules of :mod:`tokenbal.estimate.video` at the processor's own video settings
(``do_sample_frames``, ``fps``, ``num_frames``, ``min_frames`` / ``max_frames``, ``size``), and
calls the processor's own ``replace_video_token`` on shape-only stand-ins, so the text around the
placeholders is the installed transformers' own. Processors without ``replace_video_token``
(transformers before its multimodal-replacement API) are refused with the reason.
"""

from __future__ import annotations

from typing import Any

from tokenbal.estimate.conversation import content_parts
from tokenbal.estimate.video import GLM_VIDEO, GlmVideoSettings, VideoRequest, plan_video, smolvlm_frames

VIDEO_FAMILIES = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl", "glm-4.1v", "llava-onevision", "internvl", "smolvlm")


class VideoCountError(ValueError):
    """A video a processor would take but whose tokens are not modelled (the message says why)."""


def video_settings(processor: Any) -> dict:
    """The processor's video sampling settings that change counts (``do_sample_frames``, ``fps``,
    ``num_frames``, ``min_frames``, ``max_frames``), read off its video processor."""
    vp = getattr(processor, "video_processor", None)
    if vp is None:
        raise VideoCountError(f"{type(processor).__name__} has no video processor (transformers builds "
                              "none without torchvision), so it cannot take videos")
    return {k: getattr(vp, k, None) for k in ("do_sample_frames", "fps", "num_frames", "min_frames",
                                                "max_frames")}


def check_video_support(processor: Any, family: str | None, est: Any) -> None:
    """``VideoCountError`` when the processor's videos cannot be counted here: an unsupported
    family, no video processor, no ``replace_video_token``, or settings not modelled."""
    name = type(processor).__name__
    if family not in VIDEO_FAMILIES:
        raise VideoCountError(f"{name} ({family}): videos are counted for the families "
                              f"{', '.join(VIDEO_FAMILIES)} only")
    video_settings(processor)
    if not callable(getattr(processor, "replace_video_token", None)):
        from tokenbal.hf_compat import transformers_version

        raise VideoCountError(f"{name}: this transformers ({transformers_version()}) has no "
                              "processor.replace_video_token, which tokenbal calls to write a video's "
                              "text exactly as the processor does; counting videos needs a transformers "
                              "whose processors have it (5.19 and later)")
    if family == "smolvlm":
        vp = processor.video_processor
        s = video_settings(processor)
        if s["do_sample_frames"] and (s["fps"] is None or s["num_frames"] is None):
            raise VideoCountError(f"{name}: do_sample_frames with fps={s['fps']}, num_frames="
                                  f"{s['num_frames']}: SmolVLMVideoProcessor.sample_frames needs both (the "
                                  "processor itself raises)")
        if not getattr(vp, "do_pad", True):
            raise VideoCountError(f"{name}: SmolVLM video do_pad=False is not modelled (only the class "
                                  "default do_pad=True: a call's videos padded to its longest)")
    if family == "glm-4.1v":
        glm_video_settings(processor)


def glm_video_settings(processor: Any) -> GlmVideoSettings:
    """A GLM-4.1V processor's video settings that change counts (``VideoCountError`` where the
    processor itself could not process a video: no ``size.shortest_edge`` / ``longest_edge``, sampling
    without ``fps``, or no resize, which this counter does not model)."""
    vp = processor.video_processor
    name = type(processor).__name__
    size = dict(getattr(vp, "size", None) or {})
    lo, hi = size.get("shortest_edge"), size.get("longest_edge")
    if not lo or not hi:
        raise VideoCountError(f"{name}: GLM-4.1V video processor size={size} lacks shortest_edge / "
                              "longest_edge (its resize raises on that)")
    if not getattr(vp, "do_resize", True):
        raise VideoCountError(f"{name}: GLM-4.1V video processor with do_resize=False is not modelled")
    sample = bool(getattr(vp, "do_sample_frames", True))
    fps = getattr(vp, "fps", None)
    if sample and fps is None:
        raise VideoCountError(f"{name}: GLM-4.1V do_sample_frames without fps: the processor itself "
                              "cannot sample")
    max_duration = getattr(vp, "max_duration", None)
    return GlmVideoSettings(
        fps=float(fps) if fps is not None else GLM_VIDEO["fps"],
        max_duration=GLM_VIDEO["max_duration"] if max_duration is None else int(max_duration),
        min_pixels=int(lo), max_pixels=int(hi), patch_size=int(getattr(vp, "patch_size", 14)),
        merge_size=int(getattr(vp, "merge_size", 2)),
        temporal_patch_size=int(getattr(vp, "temporal_patch_size", 2)), sample=sample)


def video_replacement(processor: Any, family: str, est: Any, info: Any,
                      call_frames: int | None = None) -> tuple[str, int]:
    """The text the processor puts in place of this video's placeholder (``info``: a
    :class:`tokenbal.index.video.VideoInfo` of the file), and the number of frames it keeps.
    ``call_frames``: the most frames a video of the same processor call (the row) keeps, which
    SmolVLM's text reads on some releases (None: this video's). ``ValueError`` with the reason when
    the processor would reject the video (too short to sample, ...)."""
    from transformers.video_utils import VideoMetadata

    from tokenbal.hf_compat import video_token_inputs

    indices, grid = sample_video(processor, family, est, info)
    md = VideoMetadata(total_num_frames=int(info.frames), fps=float(info.fps),
                       duration=float(info.frames / info.fps), width=int(info.width), height=int(info.height),
                       frames_indices=list(indices))
    inputs = video_token_inputs(grid, md, len(indices), call_frames)
    return str(processor.replace_video_token(inputs, 0)), len(indices)


def internvl_row_rejected(text: str, image_token: str, video_token: str, frames: list[int]) -> str | None:
    """Why transformers' ``InternVLProcessor`` raises on a row, or None: it stacks a row's videos
    into one tensor (so they must keep the same number of frames), and its pixel batches fail when
    a video comes before the first image (both seen on transformers 5.19-5.25:
    ``stack expects each tensor to be equal size`` / ``expected Tensor as element 1``). Such rows
    are counted all the same: the packed Trainer's ``process_row`` builds them from the processor's
    parts (``trainer_support.internvl_by_parts``), which InternVL's model takes."""
    if len(set(frames)) > 1:
        return (f"its videos keep different numbers of frames ({frames}); InternVLProcessor stacks them "
                "and raises")
    first_image, first_video = text.find(image_token), text.find(video_token)
    if first_image >= 0 and 0 <= first_video < first_image:
        return "a video comes before the first image; InternVLProcessor raises on such a row"
    return None


def sample_video(processor: Any, family: str, est: Any, info: Any) -> tuple[list[int], tuple | None]:
    """(source frame indices the processor's video processor keeps, ``video_grid_thw`` or None)."""
    s = video_settings(processor)
    total = int(info.frames)
    sample = bool(s["do_sample_frames"])
    nframes = s["num_frames"] if sample else None
    fps = s["fps"] if sample and nframes is None else None
    if family in ("qwen2-vl", "qwen2.5-vl", "qwen3-vl"):
        if not sample:   # every decoded frame (odd counts: the processor repeats the last one)
            grid = est.video_grid(total, info.width, info.height, None)
            return list(range(total)), tuple(int(x) for x in grid)
        if nframes is None and fps is None and family == "qwen3-vl":
            # Qwen3VLVideoProcessor.sample_frames without either: every frame, at least
            # min_frames (repeated) and at most max_frames
            lo = s["min_frames"] if s["min_frames"] is not None else est.video_min_frames
            hi = s["max_frames"] if s["max_frames"] is not None else est.video_max_frames
            nframes = min(max(total, int(lo)), int(hi))
        if nframes is None and fps is None:
            raise VideoCountError(f"{type(processor).__name__}: do_sample_frames with neither fps nor "
                                  "num_frames: the processor itself cannot sample")
        pairs = (("video_min_frames", s["min_frames"]), ("video_max_frames", s["max_frames"]),
                 ("video_fps", fps))
        over = {k: v for k, v in pairs if v is not None}
        e = est.replace(**over) if over else est
        plan = plan_video(e, _request(info, nframes=nframes))
        return list(plan.indices), plan.grid
    if family == "glm-4.1v":
        plan = plan_video(est, _request(info), glm=glm_video_settings(processor))   # its fps in there
        return list(plan.indices), plan.grid
    if family == "smolvlm":   # its own sample_frames: fps and num_frames (the most) together
        if not sample:
            return list(range(total)), None
        return smolvlm_frames(total, float(info.fps), int(s["num_frames"]), float(s["fps"])), None
    # LLaVA-OneVision / InternVL: the frame count is all that counts
    if not sample:
        return list(range(total)), None
    plan = plan_video(est.replace(video_frames=None), _request(info, nframes=nframes, sample_fps=fps))
    return list(plan.indices), None


def _request(info: Any, nframes: int | None = None, sample_fps: float | None = None) -> VideoRequest:
    return VideoRequest(frames=int(info.frames), fps=float(info.fps), width=int(info.width),
                        height=int(info.height), nframes=None if nframes is None else int(nframes),
                        sample_fps=None if sample_fps is None else float(sample_fps))


def content_videos(conversation: Any) -> list[Any]:
    """The videos named inside a conversation's content parts, in order, as a processor's
    ``apply_chat_template`` collects them: the non-``None`` ``video`` / ``url`` / ``path`` of
    ``{"type": "video"}`` parts."""
    out = []
    for part in content_parts(conversation):
        if part.get("type") == "video":
            out.extend(part[k] for k in ("video", "url", "path") if part.get(k) is not None)
    return out
