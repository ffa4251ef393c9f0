"""LLaVA-Video / OneVision training records (``{"video": "x.mp4", "conversations": [{"from":
"human", "value": "<video>\\n..."}, ...]}``): each ``<video>`` becomes a ``{"type": "video"}`` part
in place (as each ``<image>`` becomes an image part), so ``tokenbal index build --processor DIR``
counts the record's video through the processor's video path, equal to ``dataset_lengths`` on the
chat row the processor takes.

Here: the family's real processor with a stand-in video processor (the real class's settings;
``family_processors.StandInVideoProcessor``), handed to the build where it loads the folder.
``test_real_processors_llava_video_records`` (marker ``compat``) runs the build against the real
video processors in the ``tf-X.Y-video-smolvlm`` side envs (``tests/helpers/llava_video_oracle_check.py``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tokenbal.index.text import chat_messages


def test_video_placeholders_become_video_parts():
    rec = {"video": "a.mp4", "conversations": [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "<video>\nWhat happens? <image> too"},
        {"from": "gpt", "value": "A cat <jumps>."}]}
    assert chat_messages(rec) == [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "\nWhat happens? "},
                                     {"type": "image"}, {"type": "text", "text": " too"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat <jumps>."}]}]
    assert chat_messages({"conversations": [{"from": "human", "value": "<video><video>"}]}) == [
        {"role": "user", "content": [{"type": "video"}, {"type": "video"}]}]
    assert chat_messages({"conversations": [{"from": "gpt", "value": ""}]}) == [
        {"role": "assistant", "content": [{"type": "text", "text": ""}]}]


def test_llava_video_records_equal_dataset_lengths(tmp_path, monkeypatch):
    """JSONL records and tar samples in the LLaVA-Video layout: the index's lengths equal
    ``dataset_lengths`` on the chat rows the processor takes; a record whose ``<video>`` count is
    not its video count is an error naming it."""
    pytest.importorskip("transformers")
    pytest.importorskip("av")
    from tests.helpers import family_processors as fp
    from tests.helpers.corpus import Sample, write_shard
    from tests.helpers.index_oracles import stand_in_video_folder
    from tests.helpers.llava_video_oracle_check import llava_video_record
    from tokenbal import TokenIndex
    from tokenbal.index import build_index
    from tokenbal.integrations.hf import dataset_lengths

    monkeypatch.setenv("TOKENBAL_CACHE", str(tmp_path))
    family = "qwen2-vl"
    proc, folder = stand_in_video_folder(family, tmp_path / "proc", monkeypatch)
    videos = fp.write_videos(tmp_path, 5, seed=3)
    rng = random.Random(4)
    cases = [llava_video_record(rng, rng.choice(videos), f"r{i}") for i in range(12)]
    bad = {"id": "two", "video": videos[0], "conversations": [{"from": "human", "value": "<video><video>x"},
                                                              {"from": "gpt", "value": "y"}]}
    src = tmp_path / "train.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in [rec for rec, _ in cases] + [bad]))
    mp4 = [c for c in cases if c[0]["video"].endswith(".mp4")][:3]
    shard = write_shard(tmp_path / "t-000.tar", [
        Sample(key=f"t{k}", conversations=rec["conversations"],
               raw=[("mp4", Path(rec["video"]).read_bytes())]) for k, (rec, _) in enumerate(mp4)])
    build_index([str(src), shard], tmp_path / "idx", processor=str(folder), progress=False)
    idx = TokenIndex.open(tmp_path / "idx")
    rows = [{k: v for k, v in row.items() if k != "files"} for _, row in cases]
    want = dict(zip([rec["id"] for rec, _ in cases], dataset_lengths(rows, proc).tolist(), strict=True))
    want.update({f"t{k}": want[rec["id"]] for k, (rec, _) in enumerate(mp4)})
    assert dict(zip(idx.keys, idx.lengths.tolist(), strict=True)) == want and mp4
    [error] = idx.errors
    assert error["key"] == "two" and "2 video placeholder(s)" in error["reason"]
    assert idx.manifest["num_videos"] == len(want)


def _video_envs() -> list[str]:
    from tests.helpers.envs import transformers_specs

    # The tf-X.Y-video-smolvlm overlays: tf-X.Y-video + num2words, so SmolVLM's processor runs too.
    return transformers_specs("video-smolvlm")


@pytest.mark.compat
@pytest.mark.parametrize("env", _video_envs())
def test_real_processors_llava_video_records(env):
    """Against the real video processors (torchvision) in each ``tf-X.Y-video-smolvlm`` side env: every
    video family's processor saved with ``save_pretrained`` and loaded by the build; 30 LLaVA-Video
    records per family (system turns, 1-3 exchanges, ``<video>`` first / last / inside the text) +
    tar samples, two scan workers: the index's length is the processor's own ``input_ids`` length
    of the chat row on every record."""
    from tests.helpers import family_processors as fp
    from tests.helpers.envs import oracle_in_env

    results = oracle_in_env(env, "tests.helpers.llava_video_oracle_check", "12", "30", "21")
    assert {r["family"] for r in results} == set(fp.VIDEO_FAMILIES)
    for r in results:
        assert r["n_wrong"] == 0 and r["agree"] >= 25 and r["placeholder_error"], r
        assert r["tar_samples"] > 0 and r["videos_indexed"] >= r["agree"], r
