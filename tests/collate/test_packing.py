"""PackedCollator: layout, boundaries, positions vs transformers, 1-D mode, validation errors."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collate import PackedBatch, PackedCollator
from collate.packing import _should_pin
from collate.positions import mrope_positions, packed_mrope_positions
from tokenbal.hf_compat import get_rope_index

IMG, VID, VS, VE = 60, 61, 62, 63
MERGE = 2
FEAT = 8  # stand-in for C*T*P*P


def make_sample(rng: np.random.Generator, n_images: int, n_videos: int = 0, seconds: bool = False) -> dict:
    ids = list(rng.integers(0, 50, size=int(rng.integers(1, 6))))
    images, videos = [], []
    kinds = ["image"] * n_images + ["video"] * n_videos
    rng.shuffle(kinds)
    for kind in kinds:
        t = 1 if kind == "image" else int(rng.integers(1, 4))
        h, w = (MERGE * int(x) for x in rng.integers(1, 5, size=2))
        (images if kind == "image" else videos).append([t, h, w])
        ids += [VS] + [IMG if kind == "image" else VID] * (t * h * w // MERGE**2) + [VE]
        ids += list(rng.integers(0, 50, size=int(rng.integers(0, 5))))
    sample: dict = {"input_ids": np.asarray(ids, dtype=np.int64)}
    labels = sample["input_ids"].copy()
    labels[rng.random(len(ids)) < 0.3] = -100
    sample["labels"] = labels
    if images:
        g = np.asarray(images)
        sample["image_grid_thw"] = g
        sample["pixel_values"] = rng.standard_normal((int(g.prod(1).sum()), FEAT)).astype(np.float32)
    if videos:
        g = np.asarray(videos)
        sample["video_grid_thw"] = g
        sample["pixel_values_videos"] = torch.randn(int(g.prod(1).sum()), FEAT)
        if seconds:
            sample["second_per_grid_ts"] = [0.5] * len(videos)
    return sample


def collator(**kw) -> PackedCollator:
    return PackedCollator(
        rope="mrope",
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=VS,
        spatial_merge_size=MERGE,
        **kw,
    )


@pytest.fixture
def samples() -> list[dict]:
    rng = np.random.default_rng(0)
    return [make_sample(rng, n, v) for n, v in [(2, 0), (0, 0), (1, 1), (3, 0), (0, 2)]]


def test_layout_and_boundaries(samples):
    b = collator()(samples)
    assert isinstance(b, PackedBatch)
    lens = [len(s["input_ids"]) for s in samples]
    cu = np.cumsum([0] + lens)
    T = cu[-1]
    assert b.input_ids.shape == (1, T) and b.input_ids.dtype == torch.int64
    np.testing.assert_array_equal(b.input_ids[0].numpy(), np.concatenate([s["input_ids"] for s in samples]))
    assert b.labels.shape == (1, T) and b.labels.dtype == torch.int64
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens.tolist() == cu.tolist()
    assert b.cu_seqlens_list == cu[1:].tolist() and all(type(x) is int for x in b.cu_seqlens_list)
    assert b.seq_lens == lens and b.max_seqlen == max(lens) and type(b.max_seqlen) is int
    assert b.num_samples == len(samples)
    # labels: the sample's own -100s kept, plus -100 at every sample's first token
    for s, a, e in zip(samples, cu[:-1], cu[1:], strict=True):
        got = b.labels[0, a:e].numpy()
        assert got[0] == -100
        np.testing.assert_array_equal(got[1:], s["labels"][1:])
    # after HF's shift, the loss tokens are exactly the per-sample unpacked ones
    per_sample = sum(int((s["labels"][1:] != -100).sum()) for s in samples)
    assert b.num_loss_tokens == per_sample == int((b.labels[0, 1:] != -100).sum())
    assert type(b.num_loss_tokens) is int
    # text positions restart at 0 for every sample
    np.testing.assert_array_equal(
        b.text_position_ids[0].numpy(), np.concatenate([np.arange(n) for n in lens])
    )
    assert b.position_ids.shape == (3, 1, T) and b.position_ids.dtype == torch.int64
    four = b.position_ids_4row
    assert four.shape == (4, 1, T)
    assert torch.equal(four[0], b.text_position_ids) and torch.equal(four[1:], b.position_ids)
    assert not np.shares_memory(b.labels.numpy(), samples[0]["labels"])


def test_packed_positions_are_per_sample_concatenated(samples):
    b = collator()(samples)
    ref = [
        mrope_positions(
            s["input_ids"],
            s.get("image_grid_thw"),
            s.get("video_grid_thw"),
            image_token_id=IMG,
            video_token_id=VID,
            vision_start_token_id=VS,
            spatial_merge_size=MERGE,
        )
        for s in samples
    ]
    np.testing.assert_array_equal(b.position_ids[:, 0].numpy(), np.concatenate(ref, axis=1))


def test_packed_positions_equal_hf_per_sample():
    """End to end against transformers: per-sample get_rope_index, concatenated (images only)."""
    pytest.importorskip("transformers")
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    cfg = Qwen2VLConfig(
        text_config=_tiny_text(),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, spatial_merge_size=MERGE),
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=VS,
        vision_end_token_id=VE,
    )
    model = Qwen2VLModel(cfg)
    coll = PackedCollator.from_config(cfg)
    assert (coll.rope, coll.image_token_id, coll.video_token_id) == ("mrope", IMG, VID)
    assert (coll.vision_start_token_id, coll.spatial_merge_size, coll.tokens_per_second) == (VS, MERGE, None)
    rng = np.random.default_rng(3)
    samples = [make_sample(rng, int(rng.integers(0, 4))) for _ in range(6)]
    b = coll(samples)
    ref = []
    for s in samples:
        ids = torch.as_tensor(s["input_ids"])[None]
        grid = torch.as_tensor(s["image_grid_thw"]) if "image_grid_thw" in s else None
        pos = get_rope_index(model, ids, mm_token_type_ids=(ids == IMG).int(), image_grid_thw=grid)
        ref.append(pos)
    assert torch.equal(b.position_ids, torch.cat(ref, dim=2))


def test_vision_fields(samples):
    b = collator()(samples)
    imgs = [s for s in samples if "pixel_values" in s]
    vids = [s for s in samples if "pixel_values_videos" in s]
    np.testing.assert_array_equal(b.pixel_values.numpy(), np.concatenate([s["pixel_values"] for s in imgs]))
    np.testing.assert_array_equal(
        b.image_grid_thw.numpy(), np.concatenate([s["image_grid_thw"] for s in imgs])
    )
    assert torch.equal(b.pixel_values_videos, torch.cat([s["pixel_values_videos"] for s in vids]))
    np.testing.assert_array_equal(
        b.video_grid_thw.numpy(), np.concatenate([s["video_grid_thw"] for s in vids])
    )
    assert b.image_grid_thw.dtype == torch.int64 and b.pixel_values.dtype == torch.float32
    assert b.second_per_grid_ts is None
    # What Qwen2-VL's vision tower computes from the grids (images first, then videos).
    g = torch.cat([b.image_grid_thw, b.video_grid_thw])
    ref = torch.repeat_interleave(g[:, 1] * g[:, 2], g[:, 0]).cumsum(0, dtype=torch.int32)
    ref = torch.nn.functional.pad(ref, (1, 0), value=0)
    assert b.vision_cu_seqlens.dtype == torch.int32 and torch.equal(b.vision_cu_seqlens, ref)
    assert b.vision_max_seqlen == int((g[:, 1] * g[:, 2]).max())


def test_text_only_batch_has_no_vision():
    b = collator()([{"input_ids": [1, 2, 3]}, {"input_ids": torch.tensor([4, 5])}])
    assert b.pixel_values is None and b.image_grid_thw is None and b.video_grid_thw is None
    assert b.vision_cu_seqlens is None and b.vision_max_seqlen == 0
    assert b.labels.tolist() == [[-100, 2, 3, -100, 5]] and b.num_loss_tokens == 3
    assert b.position_ids[:, 0].tolist() == [[0, 1, 2, 0, 1]] * 3


def test_second_per_grid_ts_qwen25():
    rng = np.random.default_rng(5)
    s1, s2 = make_sample(rng, 1, 2, seconds=True), make_sample(rng, 0, 1)
    coll = collator(tokens_per_second=2)
    b = coll([s1, s2])
    assert b.second_per_grid_ts.dtype == torch.float32
    assert b.second_per_grid_ts.tolist() == [0.5, 0.5, 1.0]  # sample 2 gets transformers' default 1 s
    ref = mrope_positions(
        s1["input_ids"],
        s1["image_grid_thw"],
        s1["video_grid_thw"],
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=VS,
        spatial_merge_size=MERGE,
        second_per_grid_ts=[0.5, 0.5],
        tokens_per_second=2,
    )
    np.testing.assert_array_equal(b.position_ids[:, 0, : len(s1["input_ids"])].numpy(), ref)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.5])
def test_second_per_grid_ts_must_be_finite_and_not_negative(bad):
    """NaN read as "unscaled" (1 step a frame), inf gave positions of -2**63, a negative step ran the
    frames backwards: all without an error."""
    rng = np.random.default_rng(5)
    s1, s2 = make_sample(rng, 0, 1), make_sample(rng, 1, 2, seconds=True)
    s2["second_per_grid_ts"] = [0.5, bad]
    with pytest.raises(ValueError, match=r"sample 1: field 'second_per_grid_ts' must be finite and >= 0"):
        collator(tokens_per_second=2)([s1, s2])
    # the packed function names the sample too (s1: one video, no image; s2: one image, two videos)
    ids = np.concatenate([s1["input_ids"], s2["input_ids"]])
    with pytest.raises(ValueError, match=r"sample 1: second_per_grid_ts must be finite and >= 0"):
        packed_mrope_positions(
            ids, np.array([0, len(s1["input_ids"]), len(ids)]), np.asarray(s2["image_grid_thw"]),
            np.concatenate([s1["video_grid_thw"], s2["video_grid_thw"]]), images_per_sample=np.array([0, 1]),
            videos_per_sample=np.array([1, 2]), image_token_id=IMG, video_token_id=VID,
            vision_start_token_id=VS, spatial_merge_size=MERGE, second_per_grid_ts=np.array([1.0, 0.5, bad]),
            tokens_per_second=2)
    with pytest.raises(ValueError, match=r"second_per_grid_ts must be finite and >= 0"):
        mrope_positions(s2["input_ids"], s2["image_grid_thw"], s2["video_grid_thw"], image_token_id=IMG,
                        video_token_id=VID, vision_start_token_id=VS, spatial_merge_size=MERGE,
                        second_per_grid_ts=s2["second_per_grid_ts"], tokens_per_second=2)


def test_mapping_view(samples):
    b = collator()(samples)
    assert b["input_ids"] is b.input_ids
    assert "cu_seqlens" in b and "nope" not in b
    keys = b.keys()
    for name in (
        "input_ids",
        "labels",
        "position_ids",
        "text_position_ids",
        "cu_seqlens",
        "cu_seqlens_list",
        "max_seqlen",
        "seq_lens",
        "num_loss_tokens",
        "pixel_values",
        "image_grid_thw",
        "pixel_values_videos",
        "video_grid_thw",
        "second_per_grid_ts",
        "vision_cu_seqlens",
        "vision_max_seqlen",
    ):
        assert name in keys

    def f(**kw):
        return kw

    kw = f(**b)
    assert set(kw) == set(keys) and kw["max_seqlen"] == b.max_seqlen
    assert dict(b)["seq_lens"] == b.seq_lens and len(b) == len(keys)
    with pytest.raises(KeyError):
        b["position_ids_4row"]
    b2 = pickle.loads(pickle.dumps(b))  # DataLoader workers send batches through pickle
    assert torch.equal(b2.position_ids, b.position_ids) and b2.cu_seqlens_list == b.cu_seqlens_list


def test_one_d_mode_and_from_config():
    transformers = pytest.importorskip("transformers")
    coll = PackedCollator.from_config(transformers.LlamaConfig())
    assert coll.rope == "1d"
    b = coll(
        [{"input_ids": [5, 6, 7, 8]}, {"input_ids": np.array([9, 10], dtype=np.int32), "labels": [-100, 3]}]
    )
    assert b.position_ids.shape == (1, 6)
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 0, 1]] and torch.equal(
        b.position_ids, b.text_position_ids
    )
    assert b.labels.tolist() == [[-100, 6, 7, 8, -100, 3]] and b.num_loss_tokens == 4
    assert b.input_ids.dtype == torch.int64
    assert b.position_ids_4row.shape == (4, 1, 6)
    # 1-D mode passes vision tensors through
    b = PackedCollator(rope="1d")([{"input_ids": [1, 2], "pixel_values": np.ones((4, 3), np.float32),
                                    "image_grid_thw": [[1, 2, 2]]}])  # fmt: skip
    assert b.pixel_values.shape == (4, 3)


def test_one_d_mode_checks_placeholders_of_samples_without_grids():
    """With image_token_id set, a sample's image tokens without grids (their features nowhere) are
    named like a count that disagrees with its grids; only samples with grids were checked."""
    coll = PackedCollator(rope="1d", image_token_id=IMG, sp_size=3)
    with_grid = {"input_ids": [1, IMG, IMG], "pixel_values": np.ones((8, 3), np.float32),
                 "image_grid_thw": [[1, 2, 4]]}
    assert coll([with_grid, {"input_ids": [4, 5]}]).seq_lens == [3, 2, 1]
    with pytest.raises(ValueError, match=r"sample 1: 2 image placeholder tokens in input_ids but "
                                         r"image_grid_thw \[\] needs 0"):
        coll([with_grid, {"input_ids": [4, IMG, IMG]}])
    with pytest.raises(ValueError, match=r"sample 0: 1 image placeholder tokens .* \[\[1, 2, 4\]\] needs 2"):
        coll([{**with_grid, "input_ids": [1, IMG]}])


def test_from_config_qwen25_and_unsupported():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2_5_VLConfig(vision_config=dict(tokens_per_second=4, spatial_merge_size=2))
    coll = PackedCollator.from_config(cfg)
    assert coll.rope == "mrope" and coll.tokens_per_second == 4 and not coll.split_video_frames
    assert coll.image_token_id == cfg.image_token_id and coll.video_token_id == cfg.video_token_id
    assert PackedCollator.from_config(cfg, pin_memory=False).pin_memory is False
    q3 = PackedCollator.from_config(transformers.Qwen3VLConfig())
    assert q3.rope == "mrope" and q3.split_video_frames and q3.tokens_per_second is None
    assert q3.image_token_id == transformers.Qwen3VLConfig().image_token_id
    glm_cfg = transformers.Glm4vConfig()
    glm = PackedCollator.from_config(glm_cfg)
    assert glm.rope == "mrope" and glm.mrope_style == "glm4v"
    assert glm.video_span_token_ids == (glm_cfg.video_start_token_id, glm_cfg.video_end_token_id)
    assert glm.vision_start_token_id == glm_cfg.image_start_token_id


@pytest.mark.parametrize("name", ["Qwen2_5OmniThinkerConfig", "Qwen2_5OmniConfig", "Qwen3OmniMoeConfig",
                                  "Ernie4_5_VLMoeConfig"])
def test_from_config_refuses_an_mrope_family_it_does_not_lay_out(name):
    """Models whose transformers class builds its own M-RoPE positions (get_rope_index) but whose
    layout the collator does not know got plain 1-D positions without a word: wrong for every
    vision token and the text after it."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    cfg = getattr(transformers, name)()
    with pytest.raises(ValueError, match=rf"model_type='{cfg.model_type}' lays out multi-row .*get_rope_"):
        PackedCollator.from_config(cfg)
    assert PackedCollator.from_config(cfg, rope="1d").rope == "1d"  # said explicitly: the caller's call


@pytest.mark.parametrize("name", ["LlamaConfig", "Qwen2Config", "LlavaConfig", "InternVLConfig",
                                  "Qwen3_5TextConfig"])
def test_from_config_keeps_plain_rope_models_one_dimensional(name):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    assert PackedCollator.from_config(getattr(transformers, name)()).rope == "1d"


@pytest.mark.parametrize("name", ["Qwen3VLMoeConfig", "Qwen3_5Config", "Qwen3_5MoeConfig"])
def test_from_config_qwen3_family(name):
    """Their get_rope_index is Qwen3-VL's code verbatim in transformers 5.24 (checked by diff)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, name):
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    cfg = getattr(transformers, name)()
    coll = PackedCollator.from_config(cfg)
    assert coll.rope == "mrope" and coll.split_video_frames and coll.tokens_per_second is None
    assert (coll.image_token_id, coll.video_token_id) == (cfg.image_token_id, cfg.video_token_id)
    assert coll.vision_start_token_id == cfg.vision_start_token_id


def _tiny_text(**extra) -> dict:
    from transformers import Qwen2VLConfig

    from tokenbal.hf_compat import rope_config

    return dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        bos_token_id=None,
        eos_token_id=None,
        **rope_config(Qwen2VLConfig, 1e4, mrope_section=[1, 1, 2]),
        **extra,
    )


def _hf_packed(model, samples, seconds_key=False) -> torch.Tensor:
    ref = []
    for s in samples:
        ids = torch.as_tensor(s["input_ids"])[None]
        kw = {}
        if seconds_key and "second_per_grid_ts" in s:
            kw["second_per_grid_ts"] = torch.as_tensor(s["second_per_grid_ts"], dtype=torch.float32)
        pos = get_rope_index(
            model, ids,
            mm_token_type_ids=(ids == IMG).int() + 2 * (ids == VID).int(),
            image_grid_thw=torch.as_tensor(s["image_grid_thw"]) if "image_grid_thw" in s else None,
            video_grid_thw=torch.as_tensor(s["video_grid_thw"]) if "video_grid_thw" in s else None,
            **kw,
        )
        ref.append(pos)
    return torch.cat(ref, dim=2)


def make_qwen3_sample(rng: np.random.Generator, n_images: int, n_videos: int) -> dict:
    """Qwen3-VL prompt: each video frame is ``<timestamp> <vs> frame <ve>``; one grid row per video."""
    ids = list(rng.integers(0, 50, size=int(rng.integers(1, 6))))
    images, videos = [], []
    kinds = ["image"] * n_images + ["video"] * n_videos
    rng.shuffle(kinds)
    for kind in kinds:
        h, w = (MERGE * int(x) for x in rng.integers(1, 5, size=2))
        if kind == "image":
            images.append([1, h, w])
            ids += [VS] + [IMG] * (h * w // MERGE**2) + [VE]
        else:
            t = int(rng.integers(1, 5))
            videos.append([t, h, w])
            for _ in range(t):
                ids += list(rng.integers(0, 50, size=3)) + [VS] + [VID] * (h * w // MERGE**2) + [VE]
        ids += list(rng.integers(0, 50, size=int(rng.integers(0, 5))))
    sample: dict = {"input_ids": np.asarray(ids, dtype=np.int64)}
    if images:
        g = np.asarray(images)
        sample["image_grid_thw"] = g
        sample["pixel_values"] = rng.standard_normal((int(g.prod(1).sum()), FEAT)).astype(np.float32)
    if videos:
        g = np.asarray(videos)
        sample["video_grid_thw"] = g
        sample["pixel_values_videos"] = torch.randn(int(g.prod(1).sum()), FEAT)
    return sample


def test_qwen3vl_packed_positions_equal_hf_per_sample():
    """from_config(Qwen3VLConfig) + collate == transformers' Qwen3VLModel.get_rope_index per sample,
    concatenated, with images and multi-frame videos (every token, text after videos included)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    cfg = transformers.Qwen3VLConfig(
        text_config=_tiny_text(head_dim=8),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=16,
            spatial_merge_size=MERGE,
            deepstack_visual_indexes=[0],
            num_position_embeddings=16,
        ),
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=VS,
        vision_end_token_id=VE,
    )
    model = Qwen3VLModel(cfg)
    coll = PackedCollator.from_config(cfg, pin_memory=False)
    rng = np.random.default_rng(8)
    samples = [make_qwen3_sample(rng, int(rng.integers(0, 3)), int(rng.integers(0, 3))) for _ in range(8)]
    assert sum("video_grid_thw" in s for s in samples) >= 3
    b = coll(samples)
    assert torch.equal(b.position_ids, _hf_packed(model, samples))
    # The vision tower still sees the original (t, h, w) grids: one cu_seqlens entry per frame.
    assert torch.equal(b.video_grid_thw, torch.cat([torch.as_tensor(s["video_grid_thw"]) for s in samples
                                                    if "video_grid_thw" in s]))  # fmt: skip


def test_qwen25vl_packed_video_blocks_equal_hf():
    """from_config(Qwen2.5-VL) with per-sample second_per_grid_ts: samples with at most one video
    equal transformers exactly up to the video's end; the video block itself is always identical."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    cfg = transformers.Qwen2_5_VLConfig(
        text_config=_tiny_text(),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            out_hidden_size=16,
            num_heads=2,
            spatial_merge_size=MERGE,
            tokens_per_second=2,
        ),  # fmt: skip
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=VS,
        vision_end_token_id=VE,
    )
    model = Qwen2_5_VLModel(cfg)
    coll = PackedCollator.from_config(cfg, pin_memory=False)
    assert coll.tokens_per_second == 2
    rng = np.random.default_rng(9)
    samples = []
    for _ in range(8):
        s = make_sample(rng, int(rng.integers(0, 3)), 1)
        s["second_per_grid_ts"] = [float(2.0 / rng.uniform(0.5, 8.0))]  # temporal_patch_size / fps
        samples.append(s)
    b = coll(samples)
    ref = _hf_packed(model, samples, seconds_key=True)
    ids = b.input_ids[0]
    starts = [0, *b.cu_seqlens_list[:-1]]
    for a, e in zip(starts, b.cu_seqlens_list, strict=True):
        vid = torch.nonzero(ids[a:e] == VID).flatten() + a
        end = int(vid[-1]) + 1
        assert torch.equal(b.position_ids[:, :, a:end], ref[:, :, a:end])
    assert b.second_per_grid_ts.dtype == torch.float32


def test_not_pinned_on_cpu(samples):
    if torch.accelerator.is_available():
        pytest.skip("accelerator present")
    assert _should_pin(None) is False
    b = collator()(samples)
    assert not b.input_ids.is_pinned() and not b.pixel_values.is_pinned()


def test_dataloader_roundtrip(samples):
    loader = torch.utils.data.DataLoader(samples, batch_size=2, collate_fn=collator())
    batches = list(loader)
    assert [x.seq_lens for x in batches] == [
        [len(s["input_ids"]) for s in samples[i : i + 2]] for i in (0, 2, 4)
    ]


def _ok() -> dict:
    return {
        "input_ids": [1, VS, IMG, IMG, VE],
        "pixel_values": np.zeros((8, FEAT), np.float32),
        "image_grid_thw": [[1, 2, 4]],
    }


@pytest.mark.parametrize(
    "change,match",
    [
        ({"input_ids": [1.0, 2.0]}, r"sample 1: field 'input_ids' must hold integers"),
        ({"input_ids": torch.tensor([1.0])}, r"sample 1: field 'input_ids' must hold integers"),
        ({"input_ids": []}, r"sample 1: field 'input_ids'"),
        ({"input_ids": None}, r"sample 1: field 'input_ids' is missing"),
        ({"labels": [1, 2]}, r"sample 1: field 'labels' has length 2"),
        ({"labels": np.zeros(5, np.float32)}, r"sample 1: field 'labels' must hold integers"),
        ({"pixel_values": None}, r"sample 1: field 'image_grid_thw' given without 'pixel_values'"),
        ({"image_grid_thw": None}, r"sample 1: field 'pixel_values' given without 'image_grid_thw'"),
        ({"image_grid_thw": [[1, 4, 4]]}, r"sample 1: field 'pixel_values' has shape \(8, 8\)"),
        (
            {"image_grid_thw": [[1, 4, 4]], "pixel_values": np.zeros((16, FEAT), np.float32)},
            r"sample 1: 2 image placeholder tokens in input_ids but image_grid_thw",
        ),
        ({"input_ids": [1, IMG, IMG, VE]}, r"sample 1: image 0 at token index 1 does not follow"),
        ({"image_grid_thw": [[1.0, 2.0, 4.0]]}, r"sample 1: field 'image_grid_thw'.*integer"),
        ({"pixel_values": np.zeros((8, FEAT), np.int64)}, r"sample 1: field 'pixel_values' must be floating"),
        ({"pixel_values": np.zeros((8, FEAT), np.float64)}, r"'pixel_values' is torch.float64"),
        ({"attention_mask": [1, 1, 1, 1, 0]}, r"sample 1: field 'attention_mask' has zeros"),
        ({"second_per_grid_ts": [1.0]}, r"sample 1: field 'second_per_grid_ts' has 1 entries for 0 videos"),
        # an embedding lookup or the loss would fail on these far from the sample (on an accelerator:
        # a device-side assert), and a stray negative label would count as a loss token
        ({"input_ids": [-1, VS, IMG, IMG, VE]}, r"sample 1: field 'input_ids' holds -1 at index 0"),
        ({"labels": [5, -1, 7, 7, 7]}, r"sample 1: field 'labels' holds -1 at index 1, .*ignore_index -100"),
        ({"attention_mask": [1, 1, 1]}, r"sample 1: field 'attention_mask' has 3 entries, input_ids has 5"),
        # uint64 above int64: the cast to int64 wrapped it, and the error named a value the sample does not
        # hold ("holds -9223372036854775803 at index 4")
        ({"input_ids": np.array([1, VS, IMG, IMG, 2**63 + 5], np.uint64)},
         r"sample 1: field 'input_ids' holds 9223372036854775813 at index 4, above int64"),
        ({"labels": torch.from_numpy(np.array([[2**63 + 5, 6, 7, 7, 7]], np.uint64))},
         r"sample 1: field 'labels' holds 9223372036854775813 at index 0, above int64"),
    ],
)
def test_errors_name_sample_and_field(change, match):
    bad = {**_ok(), **change}
    with pytest.raises(ValueError, match=match):
        collator()([_ok(), bad])


@pytest.mark.parametrize("sample", [[1, 2, 3], np.array([1, 2, 3]), "text"])
def test_a_sample_that_is_not_a_mapping_is_named(sample):
    with pytest.raises(TypeError, match=r"sample 1 is a (list|ndarray|str), not a mapping of fields"):
        collator()([_ok(), sample])


def test_labels_under_another_ignore_index():
    """The collator's own ignore_index is the one negative label allowed; -100 is then a stray."""
    coll = PackedCollator(rope="1d", ignore_index=-1)
    ok = coll([{"input_ids": [1, 2, 3], "labels": [-1, 2, 3]}])
    assert ok.labels.tolist() == [[-1, 2, 3]] and ok.num_loss_tokens == 2
    with pytest.raises(ValueError, match=r"sample 0: field 'labels' holds -100 at index 0, .*index -1$"):
        coll([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}])


def test_constructor_errors():
    with pytest.raises(ValueError, match="image_token_id"):
        PackedCollator(rope="mrope")
    with pytest.raises(ValueError, match="rope"):
        PackedCollator(rope="2d")  # type: ignore[arg-type]
    # An empty list is an empty rank's step, not an error: tests/collate/train/test_empty_rank.py.


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(min_value=-1, max_value=40), min_size=1, max_size=12),
        min_size=1,
        max_size=8,
    )
)
def test_boundary_invariants(seqs):
    """Random lengths and label masks (-1 marks an ignored label): the packed row keeps every
    per-sample loss token and no cross-sample one."""
    samples = []
    for s in seqs:
        ids = np.abs(np.asarray(s, dtype=np.int64))
        labels = np.where(np.asarray(s) < 0, -100, ids)
        samples.append({"input_ids": ids, "labels": labels})
    for coll in (PackedCollator(rope="1d"), collator()):
        b = coll(samples)
        lens = [len(s) for s in seqs]
        cu = b.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[1:] == b.cu_seqlens_list and np.diff(cu).tolist() == lens == b.seq_lens
        assert b.max_seqlen == max(lens) and b.input_ids.shape[1] == cu[-1]
        lab = b.labels[0]
        assert all(lab[c] == -100 for c in cu[:-1])
        # shifted targets: position p predicts lab[p+1]; a target inside sample k must come from sample k
        targets = torch.nonzero(lab[1:] != -100).flatten() + 1
        starts = torch.tensor(cu[:-1])
        assert not torch.isin(targets, starts).any()
        assert (
            b.num_loss_tokens == targets.numel() == sum(int((x["labels"][1:] != -100).sum()) for x in samples)
        )
        tp = b.text_position_ids[0]
        assert (tp[starts] == 0).all() and int(tp.max()) == max(lens) - 1


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(-3, 9), st.sampled_from([-100, -7, -1, 0, 5])),
                         min_size=1, max_size=6), min_size=1, max_size=5))
def test_value_checks_name_the_first_bad_token(rows):
    """A negative token id, or a negative label other than ignore_index, raises naming the first
    offending sample, field and index (ids before labels); anything else collates."""
    samples = [{"input_ids": [t for t, _ in r], "labels": [lab for _, lab in r]} for r in rows]
    bad_id = next(((i, j, t) for i, r in enumerate(rows) for j, (t, _) in enumerate(r) if t < 0), None)
    bad_label = next(((i, j, lab) for i, r in enumerate(rows) for j, (_, lab) in enumerate(r)
                      if lab < 0 and lab != -100), None)
    first = bad_id or bad_label
    if first is None:
        assert PackedCollator(rope="1d")(samples).seq_lens == [len(r) for r in rows]
        return
    sample, index, value = first
    field = "input_ids" if bad_id else "labels"
    expected = rf"^sample {sample}: field '{field}' holds {value} at index {index},"
    with pytest.raises(ValueError, match=expected):
        PackedCollator(rope="1d")(samples)


def _ok_fast() -> dict:
    """A valid sample in the types the collator checks batch-wide (numpy ids and grids, torch pixel
    rows); the errors below must be the same ones the per-sample path words."""
    return {
        "input_ids": np.array([1, VS, IMG, IMG, VE], np.int64),
        "pixel_values": torch.zeros(8, FEAT),
        "image_grid_thw": np.array([[1, 2, 4]], np.int64),
    }


@pytest.mark.parametrize(
    "change,match",
    [
        ({"pixel_values": torch.zeros(16, FEAT)}, r"sample 1: field 'pixel_values' has shape \(16, 8\)"),
        ({"pixel_values": torch.zeros(8, FEAT, 1)}, r"sample 1: field 'pixel_values' has shape \(8, 8, 1\)"),
        ({"pixel_values": torch.zeros(8, FEAT, dtype=torch.int64)},
         r"sample 1: field 'pixel_values' must be floating"),
        ({"pixel_values": torch.zeros(8, FEAT, dtype=torch.float64)}, r"'pixel_values' is torch.float64"),
        ({"pixel_values": torch.zeros(8, FEAT + 1)},
         r"sample 1: field 'pixel_values' is torch.float32 \(8, 9\)"),
        ({"image_grid_thw": np.array([[1, -2, -4]], np.int64)},
         r"sample 1: field 'image_grid_thw'.*positive"),
        ({"image_grid_thw": np.array([[1.0, 2.0, 4.0]])}, r"sample 1: field 'image_grid_thw'.*integer"),
        ({"image_grid_thw": np.array([[1, 4, 4]], np.int64), "pixel_values": torch.zeros(16, FEAT)},
         r"sample 1: 2 image placeholder tokens in input_ids but image_grid_thw"),
    ],
)
def test_errors_name_sample_and_field_batch_checked(change, match):
    bad = {**_ok_fast(), **change}
    with pytest.raises(ValueError, match=match):
        collator()([_ok_fast(), bad])


def test_batch_checked_vision_equals_per_sample_path():
    """Torch pixel rows with numpy grids (checked on the concatenation) and numpy pixel rows with
    list grids (checked sample by sample) give the same batch; a (3,) grid and int32 grids too."""
    rng = np.random.default_rng(3)
    fast = [make_sample(rng, n_images=k, n_videos=k % 2) for k in (0, 1, 2, 3, 1)]
    for s in fast:
        for key in ("pixel_values", "pixel_values_videos"):
            if key in s:
                s[key] = torch.as_tensor(s[key])
    slow = [{k: (v.numpy() if isinstance(v, torch.Tensor) else v.tolist() if k.endswith("grid_thw") else v)
             for k, v in s.items()} for s in fast]
    odd = [dict(s) for s in fast]
    odd[1]["image_grid_thw"] = odd[1]["image_grid_thw"][0]  # one image as a (3,) grid
    odd[2]["image_grid_thw"] = odd[2]["image_grid_thw"].astype(np.int32)
    a, b, c = collator()(fast), collator()(slow), collator()(odd)
    for other in (b, c):
        for key in a.keys():
            x, y = a[key], other[key]
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and torch.equal(x, y), key
            else:
                assert x == y, key
    assert a.image_grid_thw.dtype == torch.int64
    # The batch's grids are copies: writing into them leaves the samples' grids alone.
    a.image_grid_thw.fill_(0)
    assert fast[1]["image_grid_thw"].min() > 0
