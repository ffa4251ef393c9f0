"""Videos in the token index: per-sample planning at build time, the stored video table, and the
read side (which frames to decode for sample ``i``).

Storage (optional files; an index without them has no videos): ``video_start`` (int64, N+1: each
sample's rows in the video table), ``video_info`` (int64, (V, 7): member position within the
sample, source frames, width, height, rotation, sampled frames, tokens) and ``video_params``
(float64, (V, 8): fps, duration, and the message part's fps, min_frames, max_frames, nframes,
video_start, video_end; NaN where not given). A video's ``tokens`` are its placeholders + the
special tokens around them + the text the processor inserts (timestamps, frame labels, counted
with the index's text counter); they are part of the sample's ``vision_tokens``.

The frames to decode are not stored: they are recomputed from these rows with the estimator the
index was built with (``tokenbal.estimate.video.plan_video``), which is deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tokenbal.index.text import part_file_key
from tokenbal.index.video import VideoInfo

VIDEO_COLUMNS: dict[str, tuple[type, tuple[int, ...]]] = {
    "video_start": (np.int64, ()),
    "video_info": (np.int64, (7,)),
    "video_params": (np.float64, (8,)),
}
PART_FIELDS = ("fps", "min_frames", "max_frames", "nframes", "video_start", "video_end")


@dataclass
class SampleVideo:
    member: int                     # position of the video among the sample's members
    info: VideoInfo
    params: dict = field(default_factory=dict)   # message part fields (PART_FIELDS)
    sampled: int = 0                # set by plan_sample_videos
    tokens: int = 0


def part_params(part: dict, where: str) -> dict:
    """The clip / sampling fields of a Qwen-style ``{"type": "video", ...}`` part, validated."""
    out = {}
    for k in PART_FIELDS:
        v = part.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{where}.{k} must be a number >= 0, got {v!r}")
        if k in ("min_frames", "max_frames", "nframes") and (v != int(v) or v < 1):
            raise ValueError(f"{where}.{k} must be a positive integer, got {v!r}")
        if k == "fps" and v <= 0:
            raise ValueError(f"{where}.fps must be > 0, got {v!r}")
        out[k] = v
    return out


def request_of(info_row, params_row):
    """The ``VideoRequest`` of one stored video (rows of ``video_info`` / ``video_params``)."""
    from tokenbal.estimate.video import VideoRequest

    def opt(x, cast=float):
        return None if math.isnan(x) else cast(x)

    return VideoRequest(frames=int(info_row[1]), fps=float(params_row[0]), width=int(info_row[2]),
                        height=int(info_row[3]), sample_fps=opt(params_row[2]),
                        min_frames=opt(params_row[3], int), max_frames=opt(params_row[4], int),
                        nframes=opt(params_row[5], int), start=opt(params_row[6]), end=opt(params_row[7]))


def _request(v: SampleVideo):
    from tokenbal.estimate.video import VideoRequest

    p = v.params
    return VideoRequest(frames=v.info.frames, fps=v.info.fps, width=v.info.width, height=v.info.height,
                        sample_fps=p.get("fps"), min_frames=p.get("min_frames"),
                        max_frames=p.get("max_frames"),
                        nframes=p.get("nframes"), start=p.get("video_start"), end=p.get("video_end"))


def plan_sample_videos(samples: list, est, counter, path: str, errors: list[dict],
                       by_chat: bool = False) -> list:
    """Set ``sampled`` / ``tokens`` on every video of ``samples``; a sample with a video the family
    cannot take becomes an error (shard, key, reason) and is dropped. Returns the kept samples.
    ``by_chat``: samples with chat turns are left as they are (``index build --processor`` counts
    their videos through the processor, ``tokenbal.index.build._chat_text``)."""
    from tokenbal.estimate.video import plan_video, video_pipeline

    if not any(s.videos for s in samples):
        return samples
    supported = video_pipeline(est) is not None
    kept, texts, owners = [], [], []
    for s in samples:
        if not s.videos or (by_chat and s.chat is not None):
            kept.append(s)
            continue
        if not supported:
            errors.append({"shard": path, "key": s.key, "reason": (
                f"sample {s.key!r}: has a video, and estimator {est.name!r} has no video support")})
            continue
        try:
            for j, v in enumerate(s.videos):
                try:
                    plan = plan_video(est, _request(v))
                except ValueError as e:
                    raise ValueError(f"video {j} ({v.info.frames} frames, {v.info.width}x{v.info.height} at "
                                     f"{v.info.fps:g} fps): {e}") from None
                v.sampled, v.tokens = len(plan.indices), plan.tokens + plan.special
                for t in plan.texts:
                    texts.append(t)
                    owners.append(v)
        except ValueError as e:
            errors.append({"shard": path, "key": s.key, "reason": f"sample {s.key!r}: {e}"})
            continue
        kept.append(s)
    if texts:
        kept_ids = {id(v) for s in kept for v in (s.videos or [])}
        counts = np.asarray(counter.count_batch(texts), np.int64)
        for v, c in zip(owners, counts.tolist(), strict=True):
            if id(v) in kept_ids:
                v.tokens += int(c)
    return kept


def video_arrays(samples: list) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(videos per sample, video tokens per sample, video_info rows, video_params rows)."""
    n = len(samples)
    counts = np.fromiter((len(s.videos or ()) for s in samples), np.int64, count=n)
    tokens = np.fromiter((sum(v.tokens for v in (s.videos or ())) for s in samples), np.int64, count=n)
    vids = [v for s in samples for v in (s.videos or ())]
    info = np.array([[v.member, v.info.frames, v.info.width, v.info.height, v.info.rotation, v.sampled,
                      v.tokens] for v in vids], np.int64).reshape(-1, 7)
    nan = float("nan")
    params = np.array([[v.info.fps, v.info.duration, *(float(v.params.get(k, nan)) for k in PART_FIELDS)]
                       for v in vids], np.float64).reshape(-1, 8)
    return counts, tokens, info, params


# --- read side --------------------------------------------------------------------------------------

def has_videos(idx) -> bool:
    return "video_start" in idx._cols and int(idx._cols["video_start"][-1]) > 0


def video_rows(idx, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Sample ``i``'s rows of ``video_info`` / ``video_params`` (empty for an index without videos)."""
    if "video_start" not in idx._cols:
        return np.zeros((0, 7), np.int64), np.zeros((0, 8))
    a, b = (int(x) for x in idx._cols["video_start"][i:i + 2])
    return idx._cols["video_info"][a:b], idx._cols["video_params"][a:b]


def _estimator(idx):
    cache = idx.__dict__.setdefault("_video_est", [])
    if not cache:
        from tokenbal.estimate import get_estimator

        built = idx.manifest["estimator"]
        cache.append(get_estimator(built["model"], **built.get("overrides", {})))
    return cache[0]


def video_plans(idx, i: int) -> list[tuple[int, object]]:
    """``(member position, VideoPlan)`` of each video of sample ``i``."""
    from tokenbal.estimate.video import plan_video

    info, params = video_rows(idx, i)
    est = _estimator(idx)
    out = []
    for j, (r, p) in enumerate(zip(info, params, strict=True)):
        plan = plan_video(est, request_of(r, p))
        if len(plan.indices) != int(r[5]):
            # ``index build --processor`` counts a chat record's video with the processor's own frame
            # sampling, which this estimator need not reproduce: decoding other frames than were
            # counted would be silently wrong
            raise ValueError(
                f"sample {i} ({idx.keys[i]!r}) video {j}: the index counted {int(r[5])} frames of it (the "
                f"processor's sampling, index build --processor) but estimator {est.name!r} samples "
                f"{len(plan.indices)}; give the video file to the processor, which samples its own frames")
        out.append((int(r[0]), plan))
    return out


def per_sample(idx, column: int) -> np.ndarray:
    """Sum of ``video_info[:, column]`` per sample (zeros without videos)."""
    n = len(idx)
    if "video_start" not in idx._cols or len(idx._cols["video_info"]) == 0:
        return np.zeros(n, np.int64)
    starts = np.asarray(idx._cols["video_start"])
    vals = np.asarray(idx._cols["video_info"][:, column])
    out = np.zeros(n, np.int64)
    counts = np.diff(starts)
    np.add.at(out, np.repeat(np.arange(n), counts), vals)
    return out


def stats_line(idx) -> str | None:
    """The ``index stats`` video row, or ``None`` without videos."""
    if not has_videos(idx):
        return None
    info = np.asarray(idx._cols["video_info"])
    params = np.asarray(idx._cols["video_params"])
    n_vid = np.diff(np.asarray(idx._cols["video_start"]))
    dur = params[:, 1]
    return (f"  videos: {len(info)} in {int((n_vid > 0).sum())} samples   source frames: "
            f"{int(info[:, 1].sum()):,}   sampled frames: {int(info[:, 5].sum()):,}   "
            f"seconds: {float(dur.sum()):.1f} (max {float(dur.max()):.1f})   "
            f"tokens: {int(info[:, 6].sum()):,} (max per video {int(info[:, 6].max()):,})\n"
            f"  video pipeline: {idx.manifest.get('video_pipeline')}")


def video_parts(rec: dict) -> list[tuple[str, dict]]:
    """(path, part fields) of each video of an annotation record: ``videos`` / ``video`` fields, else
    the ``{"type": "video", ...}`` parts of ``messages`` contents (the file under ``video``, ``url``
    or ``path``). ``ValueError`` when malformed."""
    for name in ("videos", "video"):
        value = rec.get(name)
        if value is None:
            continue
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(p, str) and p for p in items):
            raise ValueError(f"'{name}' must be a path or a list of paths, got {str(value)[:80]}")
        return [(p, {}) for p in items]
    out = []
    for i, msg in enumerate(rec.get("messages") or []):
        content = msg.get("content") if isinstance(msg, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not (isinstance(part, dict) and part.get("type") == "video"):
                continue
            where = f"messages[{i}].content[{j}]"
            # the file under ``video``, else ``url`` / ``path`` (as a processor's chat template collects
            # a video part's file, ``tokenbal.estimate.chat_video.content_videos``)
            key = part_file_key(part, "video", where) or "video"
            v = part.get(key)
            if isinstance(v, list):
                raise ValueError(f"{where}.{key} is a list of frames; frame-list videos are not supported")
            if not isinstance(v, str) or not v:
                raise ValueError(f"{where}.{key} must be a path string, got {str(v)[:80]}")
            out.append((v, part_params(part, where)))
    return out


class VideoDecodeError(ValueError):
    """A video member of a read sample does not decode; ``k`` is its member key (as webdataset's
    ``DecodingError`` names the field), the cause is chained."""

    def __init__(self, k: str, cause: BaseException) -> None:
        super().__init__(f"video member {k!r}: {type(cause).__name__}: {cause}")
        self.k = k


def _member_keys(idx, i: int) -> list[str]:
    """The sample-dict key of each member of sample ``i``, as ``IndexedShardDataset.read_raw`` names
    them (tar: the extension; annotation files: the extension, numbered when there are several)."""
    members = idx.members(i)
    key, local = idx.keys[i], idx.shard(i)
    plain = [m.offset == 0 or m.shard != local for m in members]
    n_files = sum(plain)
    out = []
    for j, (m, p) in enumerate(zip(members, plain, strict=True)):
        if p:
            ext = m.name.rsplit("/", 1)[-1].rsplit(".", 1)[-1].lower()
            out.append(f"{j}.{ext}" if n_files > 1 else ext)
        else:
            out.append(m.name[len(key) + 1:].lower())
    return out


def decode_sample_videos(idx, sample: dict) -> dict:
    """Replace the video members of a read sample (bytes) by the frames the index's family samples,
    and add ``__videos__`` (member key, fps, frames_indices, total_num_frames per video)."""
    if not has_videos(idx):
        return sample
    i = int(sample["__index__"])
    plans = video_plans(idx, i)
    if not plans:
        return sample
    from tokenbal.index.video import decode_frames

    keys = _member_keys(idx, i)
    info, params = video_rows(idx, i)
    meta = []
    for (pos, plan), row, prm in zip(plans, info, params, strict=True):
        k = keys[pos]
        data = sample.get(k)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            continue       # already decoded by a user handler
        try:
            sample[k] = decode_frames(bytes(data), plan.indices)
        except Exception as e:   # VideoError, or FFmpeg's own (a cut or damaged stream)
            raise VideoDecodeError(k, e) from e
        meta.append({"member": k, "fps": float(prm[0]), "frames_indices": list(plan.indices),
                     "total_num_frames": int(row[1])})
    sample["__videos__"] = meta
    return sample
