"""Shared steps of the ``index build --processor`` oracles (Phi-4, LLaVA-Video records, Parquet
videos) and of their CI stand-in tests."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path


def build_and_read(sources: list[str], out: Path, processor: Path) -> tuple[dict, dict, object]:
    """``build_index(sources, out, processor=...)`` with two scan workers (spawned processes, each
    loading the folder's processor itself); ``(key -> length, key -> error reason, the index)``."""
    from tokenbal import TokenIndex
    from tokenbal.index import build_index

    build_index(sources, out, processor=str(processor), progress=False, workers=2)
    idx = TokenIndex.open(out)
    got = dict(zip(idx.keys, idx.lengths.tolist(), strict=True))
    return got, {e["key"]: e["reason"] for e in idx.errors}, idx


def each_video_family(prefix: str, n_videos: int, seed: int, check, *args) -> int:
    """``check(family, videos, *args, seed + k, folder)`` for every video family (k its place), over
    ``n_videos`` random videos; prints each result as a JSON line; the number of failed cases
    (``n_wrong``, plus ``placeholder_error`` where reported and false)."""
    from tests.helpers import family_processors as fp

    root = Path(tempfile.mkdtemp(prefix=prefix))
    videos = fp.write_videos(root, n_videos, seed=seed)
    failed = 0
    for k, family in enumerate(fp.VIDEO_FAMILIES):
        folder = root / family
        folder.mkdir()
        result = check(family, videos, *args, seed + k, folder)
        failed += result["n_wrong"] + (not result.get("placeholder_error", True))
        print(json.dumps(result), flush=True)
    return failed


def stand_in_video_folder(family: str, folder: Path, monkeypatch):
    """CI (no torchvision): the family's processor (a user's subclass) with a stand-in video
    processor, its saved folder (with ``video_preprocessor_config.json``), and the build made to
    load the folder as that processor (what AutoProcessor gives where torchvision is installed).
    Skips where the classes or ``replace_video_token`` (5.19+) are missing."""
    import pytest

    import tokenbal.estimate.chat as chat
    from tests.helpers import family_processors as fp

    try:
        proc = fp.video_family_processor(family, real=False, subclass=True)
    except (ImportError, ModuleNotFoundError, AttributeError) as e:
        pytest.skip(f"{family}'s processor or video processor class is not here: {e}")
    if not callable(getattr(fp.processor_class(family), "replace_video_token", None)):
        pytest.skip("this transformers' processors have no replace_video_token (5.19+)")
    fp.save_folder(proc, family, folder)
    settings = {k: v for k, v in proc.video_processor.to_dict().items() if v is not None}
    (folder / "video_preprocessor_config.json").write_text(json.dumps(
        {**settings, "video_processor_type": fp.VIDEO_CLASS[family][1]}, default=str))
    monkeypatch.setattr(chat, "_auto_processor", lambda d: proc)
    return proc, folder
