"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL estimators against transformers' own processors.

Oracles (transformers 5.24, no torchvision needed):
  * ``Qwen2VLImageProcessorPil`` on real PIL images -> ``image_grid_thw`` (a subset of sizes: the
    processor really resizes, which costs up to seconds for big images);
  * its pixel-free ``get_number_of_image_patches`` on the full >= 700-size grid. The two are tied
    together here on the real-image subset, and in transformers both call the same ``smart_resize``;
  * ``transformers...qwen3_vl.video_processing_qwen3_vl``: ``Qwen3VLVideoProcessor.sample_frames``
    and ``get_num_of_video_patches`` (importable without torchvision), and its 3-D ``smart_resize``.
Qwen2-VL's video processor and qwen-vl-utils import torchvision at module level; their tests skip
without it, and the worked numbers from the research note (measured with torchvision there) pin
the same paths here.
"""

from __future__ import annotations

import copy
import importlib
import math
import random
import warnings

import numpy as np
import pytest

from tests.helpers.processors import write_json
from tests.helpers.sizes import size_grid
from tokenbal.estimate import get_estimator, load_estimator
from tokenbal.estimate.qwen import qvu_smart_resize, smart_resize, smart_resize_3d, smart_resize_np

transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

from tests.helpers.oracles import require_oracle  # noqa: E402
from tokenbal.hf_compat import (  # noqa: E402
    image_processing_module,
    image_processor_class,
    qwen2_vl_loaded_image_size_kept,
    qwen3_vl_video_resize,
)

Qwen2VLImageProcessorPil = image_processor_class("Qwen2VLImageProcessorPil")
_CLASS_SIZE = copy.deepcopy(getattr(Qwen2VLImageProcessorPil, "size", None))


@pytest.fixture(autouse=True)
def _pristine_class_size():
    """5.6-5.9's ``Qwen2VLImageProcessorPil.__init__`` writes ``min_pixels`` / ``max_pixels`` into the
    *class* ``size`` dict when no ``size`` is given (``size = self.size`` then item assignment), so a
    processor built with them changes the defaults of every later one in the process. Each test
    here starts from the class defaults as imported, whatever the tests before it built."""
    yield
    if _CLASS_SIZE is not None:
        Qwen2VLImageProcessorPil.size = copy.deepcopy(_CLASS_SIZE)
hf_qwen2_img = image_processing_module("qwen2_vl")

# importlib, not ``from ... import``: the package's lazy loader hands out a torchvision-requiring
# dummy for the submodule, while the module itself only needs torchvision to resize pixels.
hf_qwen3_vid = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl")
from transformers.video_utils import VideoMetadata  # noqa: E402

# Official hub preprocessor_config.json values (research note §1.1).
HUB_QWEN2 = dict(min_pixels=3136, max_pixels=12845056, patch_size=14, merge_size=2, temporal_patch_size=2)
HUB_QWEN3 = dict(
    size={"shortest_edge": 65536, "longest_edge": 16777216},
    patch_size=16,
    merge_size=2,
    temporal_patch_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
)
CARD = dict(min_pixels=256 * 28 * 28, max_pixels=1280 * 28 * 28)  # model-card recommendation

EDGE = [  # (width, height): tiny, thin, half-to-even roundings, exact multiples, the 200:1 limit
    (1, 1),
    (10, 10),
    (14, 14),
    (27, 29),
    (29, 27),
    (3000, 20),
    (11, 2000),
    (70, 70),
    (42, 42),
    (98, 98),
    (126, 126),
    (70, 126),
    (28, 28),
    (56, 56),
    (224, 224),
    (448, 448),
    (5600, 28),
    (28, 5600),
    (200, 1),
    (1, 200),
    (3, 600),
    (133, 10),
    (10, 133),
    (13, 13),
    (15, 15),
    (4095, 4097),
    (8192, 8192),
    (20000, 100),
]




GRID = size_grid(EDGE)
assert len(GRID) >= 700


def hf_pixel_free_tokens(proc, w: int, h: int) -> int:
    return proc.get_number_of_image_patches(h, w, {}) // proc.merge_size**2


def hf_real_grid(proc, w: int, h: int) -> tuple[int, int, int]:
    img = Image.new("RGB", (w, h), (90, 160, 30))
    # channels_last explicitly: a 3-pixel-wide image would otherwise look channels-first
    out = proc(images=img, input_data_format="channels_last")
    return tuple(int(x) for x in out["image_grid_thw"][0])


def pil_processor(**settings):
    """The installed PIL Qwen2-VL image processor with these pixel bounds. 4.57's slow class drops a
    ``size`` argument (its ``__init__`` keeps its class defaults unless ``min_pixels`` /
    ``max_pixels`` are given; its torchvision class keeps ``size``), so there the same bounds go in
    as ``min_pixels`` / ``max_pixels``: the oracle is that version's own counting of those bounds."""
    proc = Qwen2VLImageProcessorPil(**settings)
    size = settings.get("size")
    if size is not None and {k: proc.size[k] for k in size} != size:
        rest = {k: v for k, v in settings.items() if k != "size"}
        proc = Qwen2VLImageProcessorPil(**rest, min_pixels=size["shortest_edge"],
                                        max_pixels=size["longest_edge"])
    return proc


@pytest.fixture(scope="module")
def procs():
    return {
        "qwen2-vl": Qwen2VLImageProcessorPil(**HUB_QWEN2),
        "qwen3-vl": pil_processor(**HUB_QWEN3),
        "card": Qwen2VLImageProcessorPil(**{**HUB_QWEN2, **CARD}),
    }


ESTIMATORS = {
    "qwen2-vl": lambda: get_estimator("qwen2-vl"),
    "qwen3-vl": lambda: get_estimator("qwen3-vl"),
    "card": lambda: get_estimator("qwen2.5-vl", **CARD),
}


# ---------------------------------------------------------------------------------------------
# images


@pytest.mark.parametrize("key", list(ESTIMATORS))
def test_image_tokens_equal_processor_on_grid(procs, key):
    est, proc = ESTIMATORS[key](), procs[key]
    got = [est.image_tokens(w, h) for w, h in GRID]
    want = [hf_pixel_free_tokens(proc, w, h) for w, h in GRID]
    bad = [(GRID[i], got[i], want[i]) for i in range(len(GRID)) if got[i] != want[i]]
    assert not bad, f"{len(bad)}/{len(GRID)} differ, first: {bad[:5]}"
    assert est.image_tokens_batch([w for w, _ in GRID], [h for _, h in GRID]).tolist() == want


# Real images: small-to-medium outputs (the processor's resize dominates the cost), plus the
# downscale branch through the card config, whose 1 MP budget keeps outputs small.
REAL_HUB = [
    (10, 10),
    (14, 14),
    (27, 29),
    (3, 600),
    (600, 3),
    (133, 10),
    (70, 70),
    (42, 42),
    (98, 126),
    (126, 98),
    (28, 5600),
    (5600, 28),
    (64, 64),
    (100, 300),
    (336, 336),
    (448, 448),
    (500, 375),
    (640, 480),
    (720, 405),
    (800, 600),
    (123, 457),
    (999, 77),
    (1024, 256),
    (31, 1000),
]
REAL_CARD = [
    (100, 100),
    (300, 200),
    (640, 480),
    (1024, 768),
    (1280, 720),
    (1920, 1080),
    (2000, 11),
    (11, 2000),
    (1500, 1500),
    (4096, 64),
    (2560, 1440),
    (1000, 1000),
]


@pytest.mark.parametrize(
    ("key", "sizes"), [("qwen2-vl", REAL_HUB), ("qwen3-vl", REAL_HUB), ("card", REAL_CARD)]
)
def test_image_grid_equals_real_processor(procs, key, sizes):
    est, proc = ESTIMATORS[key](), procs[key]
    for w, h in sizes:
        grid = hf_real_grid(proc, w, h)
        assert est.image_grid(w, h) == grid, (w, h)
        # ties the pixel-free oracle used on the big grid to the processor's real output
        assert hf_pixel_free_tokens(proc, w, h) == est.image_tokens(w, h) == math.prod(grid) // 4


def test_worked_numbers_from_research_note():
    sizes = [(1024, 768), (1920, 1080), (4032, 3024), (336, 336), (64, 4096)]
    assert [get_estimator("qwen2.5-vl").image_tokens(w, h) for w, h in sizes] == [999, 2691, 15552, 144, 292]
    assert [get_estimator("qwen3-vl").image_tokens(w, h) for w, h in sizes] == [768, 2040, 11844, 100, 256]
    # transformers' *class default* (1280 tokens) is not what the hub checkpoints use
    small = get_estimator("qwen2-vl", max_pixels=28 * 28 * 1280)
    assert [small.image_tokens(w, h) for w, h in sizes[:3]] == [999, 1222, 1230]
    assert small.image_tokens(1920, 1080) == hf_pixel_free_tokens(Qwen2VLImageProcessorPil(), 1920, 1080)


def test_half_to_even_rounding():
    est = get_estimator("qwen2-vl", min_pixels=28 * 28)
    # 70/28 = 2.5 -> 2 (not 3); 126/28 = 4.5 -> 4; 98/28 = 3.5 -> 4; 42/28 = 1.5 -> 2
    assert est.image_grid(70, 126) == (1, 4 * 2, 2 * 2)
    assert est.image_grid(98, 42) == (1, 2 * 2, 4 * 2)
    assert est.image_tokens_batch([70, 98], [126, 42]).tolist() == [8, 8]


def test_smart_resize_port_equals_transformers_dense():
    # every (h, w) in a dense box, three budgets; transformers' function is the oracle
    configs = [(28, 3136, 12845056), (28, 200704, 1003520), (32, 65536, 16777216), (28, 3136, 6000)]
    hs, ws = np.meshgrid(np.arange(1, 301), np.arange(1, 301), indexing="ij")
    hs, ws = hs.ravel(), ws.ravel()
    ok = np.maximum(hs, ws) / np.minimum(hs, ws) <= 200
    hs, ws = hs[ok], ws[ok]
    for f, lo, hi in configs:
        want = [hf_qwen2_img.smart_resize(int(h), int(w), f, lo, hi) for h, w in zip(hs, ws, strict=True)]
        got_h, got_w = smart_resize_np(hs, ws, f, lo, hi)
        assert list(zip(got_h.tolist(), got_w.tolist(), strict=True)) == want, (f, lo, hi)
        scalar = [smart_resize(int(h), int(w), f, lo, hi) for h, w in zip(hs[::7], ws[::7], strict=True)]
        assert scalar == want[::7]


def test_batch_equals_scalar_random_large():
    rng = np.random.default_rng(1)
    n = 20000
    w = np.exp(rng.uniform(0, math.log(30000), n)).astype(np.int64) + 1
    h = np.clip((w * np.exp(rng.uniform(-5.2, 5.2, n))).astype(np.int64), 1, None)
    keep = np.maximum(w, h) / np.minimum(w, h) <= 200
    w, h = w[keep], h[keep]
    for name, kw in [
        ("qwen2-vl", {}),
        ("qwen3-vl", {}),
        ("qwen2.5-vl", CARD),
        ("qwen2.5-vl", {"pipeline": "qwen-vl-utils"}),
        ("qwen3-vl", {"pipeline": "qwen-vl-utils"}),
    ]:
        est = get_estimator(name, **kw)
        scalar = []
        for a, b in zip(w.tolist(), h.tolist(), strict=True):
            try:
                scalar.append(est.image_tokens(a, b))
            except ValueError as e:  # qwen-vl-utils can round a 199:1 image past 200:1
                assert "qwen-vl-utils resizes it to" in str(e)
                scalar.append(-1)
        scalar = np.array(scalar)
        ok = scalar >= 0
        assert ok.mean() > 0.99
        batch = est.image_tokens_batch(w[ok], h[ok])
        assert batch.dtype == np.int64
        assert batch.tolist() == scalar[ok].tolist(), (name, kw)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            with pytest.raises(
                ValueError, match=rf"element {i}: image {w[i]}x{h[i]} .* qwen-vl-utils resizes"
            ):
                est.image_tokens_batch(w, h)


def test_batch_accepts_lists_floats_and_empty():
    est = get_estimator("qwen2-vl")
    assert est.image_tokens_batch([640.0, 10], np.array([480, 10], dtype=np.int32)).tolist() == [
        est.image_tokens(640, 480),
        4,
    ]
    assert est.image_tokens(640.0, np.int16(480)) == est.image_tokens(640, 480)
    assert est.image_tokens_batch([], []).shape == (0,)


# ---------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    ("w", "h", "match"),
    [
        (0, 10, r"width must be a positive integer, got 0"),
        (10, -3, r"height must be a positive integer, got -3"),
        (float("nan"), 10, r"width must be a positive integer, got nan"),
        (640.5, 10, r"width must be a positive integer, got 640.5"),
        ("640", 10, r"width must be a positive integer, got '640'"),
        (None, 10, r"width must be a positive integer, got None"),
        (True, 10, r"width must be a positive integer, got True"),
        (20100, 100, r"20100x100 \(width x height\) has aspect ratio 201, above the 200:1 limit"),
        (1, 201, r"1x201 .* aspect ratio 201"),
    ],
)
def test_scalar_errors(w, h, match):
    with pytest.raises(ValueError, match=match):
        get_estimator("qwen2-vl").image_tokens(w, h)


def test_aspect_limit_matches_transformers():
    est = get_estimator("qwen2-vl")
    assert est.image_tokens(200, 1) == hf_pixel_free_tokens(Qwen2VLImageProcessorPil(**HUB_QWEN2), 200, 1)
    with pytest.raises(ValueError, match="aspect ratio"):
        hf_qwen2_img.smart_resize(1, 201, 28, 3136, 12845056)  # the oracle raises too


@pytest.mark.parametrize(
    ("ws", "hs", "match"),
    [
        ([640, 0, 5], [480, 480, 5], r"widths\[1\] must be a positive integer, got 0"),
        ([640, 5], [480, -1], r"heights\[1\] must be a positive integer, got -1"),
        ([640.0, float("nan")], [1, 2], r"widths\[1\] must be a positive integer, got nan"),
        ([640.0, 3.5], [1, 2], r"widths\[1\] must be a positive integer, got 3.5"),
        ([640, None], [1, 2], r"widths\[1\] must be a positive integer, got None"),
        ([640, 1, 2], [1, 2], r"differ in length: 3 vs 2"),
        ([10, 10, 20100], [10, 10, 100], r"element 2: image 20100x100 .* aspect ratio 201"),
    ],
)
def test_batch_errors_name_the_index(ws, hs, match):
    with pytest.raises(ValueError, match=match):
        get_estimator("qwen2-vl").image_tokens_batch(ws, hs)


def test_settings_errors():
    with pytest.raises(ValueError, match="unknown estimator 'qwen9'"):
        get_estimator("qwen9")
    with pytest.raises(TypeError, match=r"unknown setting\(s\) \['max_pixel'\]"):
        get_estimator("qwen2-vl", max_pixel=5)
    with pytest.raises(ValueError, match="min_pixels=10 > max_pixels=5"):
        get_estimator("qwen2-vl", min_pixels=10, max_pixels=5)
    with pytest.raises(ValueError, match="patch_size must be a positive int"):
        get_estimator("qwen2-vl", patch_size=0)
    with pytest.raises(ValueError, match="pipeline must be one of"):
        get_estimator("qwen2-vl", pipeline="vllm")


def test_config_is_json_and_round_trips():
    import json

    for name in ("qwen2-vl", "qwen2.5-vl", "qwen3-vl"):
        est = get_estimator(name, pipeline="qwen-vl-utils")
        cfg = json.loads(json.dumps(est.config))
        assert cfg["estimator"] == est.name == name and est.wrapper_tokens == 2
        cfg.pop("estimator")
        assert get_estimator(name, **{k: v for k, v in cfg.items() if k != "family"}) == est
    assert get_estimator("qwen2_5_vl") == get_estimator("qwen2.5-vl")


# ---------------------------------------------------------------------------------------------
# qwen-vl-utils pipeline (README recipe)


def test_qvu_image_pipeline_differences():
    hf, qvu = get_estimator("qwen2.5-vl"), get_estimator("qwen2.5-vl", pipeline="qwen-vl-utils")
    # research note §7.3: H x W 10 x 133 -> HF 28 x 224, qwen-vl-utils 28 x 140
    assert smart_resize(10, 133, 28, 3136, 12845056) == (28, 224)
    assert qvu_smart_resize(10, 133, 28, 3136, 12845056) == (28, 140)
    assert hf.image_tokens(133, 10) == 8 and qvu.image_tokens(133, 10) == 5
    assert all(hf.image_tokens(w, h) == qvu.image_tokens(w, h) for w, h in GRID if min(w, h) > 14)
    # Qwen3 README: qwen-vl-utils (min 4 * 32^2) then do_resize=False, so small images stay small
    q3, q3u = get_estimator("qwen3-vl"), get_estimator("qwen3-vl", pipeline="qwen-vl-utils")
    assert (q3.image_tokens(60, 50), q3u.image_tokens(60, 50)) == (72, 4)
    assert q3u.image_tokens(60, 50) == (lambda h, w: (h // 32) * (w // 32))(
        *qvu_smart_resize(50, 60, 32, 4096, 16384 * 1024)
    )


def test_qvu_video_worked_numbers():
    qvu = get_estimator("qwen2.5-vl", pipeline="qwen-vl-utils")
    # 10 min 720p @ 30 fps, 2 fps sampling -> 768 frames at 336 x 644 (research note §1.2)
    assert qvu.sampled_frames(18000, 30.0) == 768
    assert qvu.video_grid(18000, 1280, 720, 30.0) == (384, 24, 46)
    assert qvu.video_tokens(18000, 1280, 720, 30.0) == 105984
    # Qwen3 README recipe: 60 s 1080p -> 120 frames, 768-token frames: 43,200 (§7.4)
    assert get_estimator("qwen3-vl", pipeline="qwen-vl-utils").video_tokens(1800, 1920, 1080, 30.0) == 43200
    with pytest.raises(ValueError, match="needs the source video's fps"):
        qvu.video_tokens(16, 640, 480, None)
    with pytest.raises(ValueError, match="qwen-vl-utils samples 0 frames"):
        qvu.video_tokens(1, 640, 480, 30.0)


def test_qvu_against_qwen_vl_utils():
    qvu_mod = pytest.importorskip("qwen_vl_utils.vision_process")  # imports torchvision
    for w, h in GRID:
        if max(w, h) / min(w, h) <= 200:
            assert qvu_mod.smart_resize(h, w, 28) == qvu_smart_resize(h, w, 28, 4 * 784, 16384 * 784)
    est = get_estimator("qwen2.5-vl", pipeline="qwen-vl-utils")
    for total, fps in [(18000, 30.0), (100, 25.0), (7, 30.0), (4, 1.0), (1500, 59.94)]:
        assert est.sampled_frames(total, fps) == qvu_mod.smart_nframes({}, total, fps)


# ---------------------------------------------------------------------------------------------
# videos, "hf" pipeline


def test_qwen2_video_worked_numbers():
    # class-default video size (128..768 * 28^2) as in the research note; verified there with torchvision
    est = get_estimator("qwen2.5-vl", video_min_pixels=128 * 784, video_max_pixels=768 * 784)
    assert est.video_tokens(18000, 1280, 720, 30.0) == 276480  # 10 min 720p, no cap
    assert est.video_tokens(450, 1280, 720, None) == 162000  # 450 pre-sampled frames, no cap
    assert est.replace(cap_pixels_per_frame=True).video_tokens(450, 1280, 720, None) == 108000
    assert est.video_grid(5, 640, 480, None)[0] == 3  # odd frame count: last frame repeated
    assert est.video_wrapper_tokens(450, None) == 2 and est.video_timestamps(450, None) == []
    with pytest.raises(ValueError, match="too short"):
        est.video_tokens(1, 640, 480, 30.0)


def test_qwen2_video_against_processor():
    # needs torchvision (Qwen2VLVideoProcessor resizes with it); skipped where it is missing
    pytest.importorskip("torchvision")
    from transformers import Qwen2VLVideoProcessor

    cases = [
        (30, 30.0, 64, 48),
        (95, 29.97, 320, 240),
        (61, 25.0, 31, 33),
        (8, 2.0, 100, 1000),
        (5, 1.0, 200, 120),
    ]
    for cap in (False, True):
        presampled = Qwen2VLVideoProcessor(**HUB_QWEN2, cap_pixels_per_frame=cap)
        sampling = Qwen2VLVideoProcessor(**HUB_QWEN2, cap_pixels_per_frame=cap, do_sample_frames=True, fps=2)
        est = get_estimator("qwen2-vl", cap_pixels_per_frame=cap)
        for t, fps, w, h in cases:
            video = np.zeros((t, h, w, 3), dtype=np.uint8)
            kw = dict(return_tensors="np", input_data_format="channels_last")
            grid = presampled(videos=[video], **kw)["video_grid_thw"][0]
            assert est.video_grid(t, w, h, None) == tuple(int(x) for x in grid)
            md = VideoMetadata(total_num_frames=t, fps=fps)
            grid = sampling(videos=[video], video_metadata=[md], **kw)["video_grid_thw"][0]
            assert est.video_grid(t, w, h, fps) == tuple(int(x) for x in grid)


QWEN3_VIDEO_HUB = dict(
    size={"shortest_edge": 4096, "longest_edge": 25165824}, patch_size=16, temporal_patch_size=2, merge_size=2
)
VIDEO_CASES = [  # (total frames, source fps, width, height)
    (1800, 30.0, 1920, 1080),
    (18000, 30.0, 1280, 720),
    (90, 29.97, 640, 360),
    (3, 30.0, 320, 240),
    (10, 1.0, 100, 3000),
    (240, 24.0, 20, 400),
    (61, 25.0, 31, 33),
    (100000, 60.0, 3840, 2160),
    (25, 2.0, 720, 1280),
    (1, 30.0, 640, 480),
]


@pytest.mark.parametrize("cap", [False, True])
def test_qwen3_video_against_processor_helpers(cap):
    proc = hf_qwen3_vid.Qwen3VLVideoProcessor(**QWEN3_VIDEO_HUB, cap_pixels_per_frame=cap)
    est = get_estimator("qwen3-vl", cap_pixels_per_frame=cap)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for total, fps, w, h in VIDEO_CASES:
            t = len(proc.sample_frames(VideoMetadata(total_num_frames=total, fps=fps)))
            assert est.sampled_frames(total, fps) == t
            if t < 2:  # the processor's smart_resize refuses a single frame; so do we
                with pytest.raises(ValueError, match="needs at least temporal_patch_size=2"):
                    est.video_tokens(total, w, h, fps)
                continue
            require_oracle(proc, "get_num_of_video_patches")
            patches = proc.get_num_of_video_patches(t, h, w, {})
            assert est.video_tokens(total, w, h, fps) == patches // 4, (total, fps, w, h)
            grid_t, gh, gw = est.video_grid(total, w, h, fps)
            assert grid_t * gh * gw == patches and grid_t == -(-t // 2)


def test_qwen3_video_worked_numbers_and_wrappers():
    est = get_estimator("qwen3-vl")
    assert est.video_tokens(1800, 1920, 1080, 30.0) == 11400  # <= 12,288 whole-clip cap
    assert est.video_wrapper_tokens(1800, 30.0) == 2 + 2 * 60
    ts = est.video_timestamps(1800, 30.0)
    assert len(ts) == 60 and ts[0] == "<0.2 seconds>" and ts[-1].endswith(" seconds>")


def test_smart_resize_3d_port_equals_transformers():
    rng = random.Random(3)
    cases = [
        (rng.choice([2, 3, 4, 7, 64, 768]), rng.randint(1, 4000), rng.randint(1, 4000)) for _ in range(3000)
    ]
    cases += [(2, 1, 1), (4, 31, 33), (2, 10, 2000), (768, 1080, 1920)]
    rule = qwen3_vl_video_resize()  # the installed release's variant
    for t, h, w in cases:
        try:
            want = hf_qwen3_vid.smart_resize(t, h, w, 2, 32, 4096, 25165824)
        except ValueError:
            with pytest.raises(ValueError):
                smart_resize_3d(t, h, w, 2, 32, 4096, 25165824, **rule)
            continue
        assert smart_resize_3d(t, h, w, 2, 32, 4096, 25165824, **rule) == want, (t, h, w)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 640, 480, 30.0), "num_frames must be a positive integer, got 0"),
        ((10, 640, 480, 0.0), r"fps must be a finite number > 0, got 0.0"),
        ((10, 640, 480, float("nan")), "fps must be a finite number > 0"),
        ((10, 0, 480, 30.0), "width must be a positive integer, got 0"),
    ],
)
def test_video_errors(args, match):
    with pytest.raises(ValueError, match=match):
        get_estimator("qwen3-vl").video_tokens(*args)


# ---------------------------------------------------------------------------------------------
# load_estimator: the same folder read by transformers is the oracle


def test_load_estimator_qwen2_hub_folder(tmp_path):
    write_json(tmp_path, "config.json", {"model_type": "qwen2_5_vl"})
    write_json(
        tmp_path,
        "preprocessor_config.json",
        {
            **HUB_QWEN2,
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen2_5_VLProcessor",
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
        },
    )
    est = load_estimator(tmp_path)
    assert est == get_estimator("qwen2.5-vl")
    proc = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    assert all(est.image_tokens(w, h) == hf_pixel_free_tokens(proc, w, h) for w, h in GRID[::5])
    assert load_estimator(tmp_path, pipeline="qwen-vl-utils").pipeline == "qwen-vl-utils"


def test_load_estimator_qwen3_folder_with_video_config(tmp_path):
    write_json(tmp_path, "config.json", {"model_type": "qwen3_vl"})
    write_json(
        tmp_path,
        "preprocessor_config.json",
        {**HUB_QWEN3, "image_processor_type": "Qwen2VLImageProcessorFast"},
    )
    write_json(
        tmp_path,
        "video_preprocessor_config.json",
        {**QWEN3_VIDEO_HUB, "fps": 2, "min_frames": 4, "max_frames": 768, "do_sample_frames": True},
    )
    est = load_estimator(tmp_path)
    # the image processor these files load here (4.57 without torchvision: the slow class, which
    # drops `size` and counts with its class defaults; every other install keeps the hub bounds)
    try:
        proc = transformers.AutoImageProcessor.from_pretrained(tmp_path)
    except ImportError:  # 5.6-5.9 map the Fast type to the torchvision class only: the PIL one
        proc = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    if qwen2_vl_loaded_image_size_kept():
        assert est == get_estimator("qwen3-vl")
    else:
        bounds = (est.min_pixels, est.max_pixels)
        assert bounds == (proc.min_pixels, proc.max_pixels) == (56 * 56, 28 * 28 * 1280)
    assert all(est.image_tokens(w, h) == hf_pixel_free_tokens(proc, w, h) for w, h in GRID[::5])
    vproc = hf_qwen3_vid.Qwen3VLVideoProcessor.from_pretrained(tmp_path)
    require_oracle(vproc, "get_num_of_video_patches")
    assert vproc.get_num_of_video_patches(120, 1080, 1920, {}) // 4 == est.video_tokens(120, 1920, 1080, None)


def test_load_estimator_missing_keys_use_class_defaults(tmp_path):
    # a file without size -> transformers uses its class default (1280 tokens), and so do we
    write_json(tmp_path, "config.json", {"model_type": "qwen2_vl"})
    write_json(tmp_path, "preprocessor_config.json", {"patch_size": 14})
    est = load_estimator(tmp_path)
    proc = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)
    assert est.max_pixels == 28 * 28 * 1280
    assert all(est.image_tokens(w, h) == hf_pixel_free_tokens(proc, w, h) for w, h in GRID[::5])


def test_load_estimator_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_estimator(tmp_path)
    write_json(tmp_path, "config.json", {"model_type": "bert"})
    with pytest.raises(ValueError, match="model_type 'bert' has no estimator"):
        load_estimator(tmp_path)
    write_json(tmp_path, "config.json", {"model_type": "qwen2_vl"})
    with pytest.raises(FileNotFoundError, match="neither preprocessor_config.json"):
        load_estimator(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="cannot read"):
        load_estimator(tmp_path)


def test_image_tokens_checked_isolates_bad_images():
    from tokenbal.estimate import image_tokens_checked

    est = get_estimator("qwen2-vl")
    tokens, errors = image_tokens_checked(est, [640, 0, 20100, 336], [480, 10, 100, 336])
    assert tokens.tolist() == [est.image_tokens(640, 480), -1, -1, 144]
    assert set(errors) == {1, 2}
    assert "width must be a positive integer, got 0" in errors[1] and "aspect ratio 201" in errors[2]
    clean, none = image_tokens_checked(est, np.array([640, 336]), np.array([480, 336]))
    assert clean.tolist() == [est.image_tokens(640, 480), 144] and none == {}
    with pytest.raises(ValueError, match="differ in length"):
        image_tokens_checked(est, [1, 2], [1])


@pytest.mark.parametrize("attribute, value", [("max_pixels", 200_000), ("min_pixels", 400_000)])
def test_estimator_from_processor_follows_pixel_attributes_set_after_construction(attribute, value):
    """``processor.image_processor.max_pixels = ...`` on a loaded processor: 4.57 and 5.19+ resize
    by it, 5.6-5.9 by ``size`` alone. The estimator counts what the installed processor does."""
    from tests.helpers.family_processors import _build, tokenizer
    from tokenbal.estimate.vision import estimator_from_processor

    image_proc = Qwen2VLImageProcessorPil()
    setattr(image_proc, attribute, value)
    proc = _build(transformers.Qwen2VLProcessor, image_processor=image_proc, tokenizer=tokenizer(),
                  video_processor=None)
    est = estimator_from_processor(proc)
    for w, h in [(1000, 800), (2000, 1500), (50, 40), (300, 300)]:
        out = image_proc(images=[np.zeros((h, w, 3), np.uint8)], return_tensors="np",
                         input_data_format="channels_last")
        assert est.image_tokens(w, h) == int(np.prod(out["image_grid_thw"][0])) // 4, (w, h)
