"""Sequence-parallel packed forward on real gloo ranks equals the single-process packed forward.

Each data-parallel group's packed row (``PackedCollator(sp_size=S)``, length not a multiple of S
before padding) is cut by ``collate.sp.shard_batch``; the ranks run ``enable_packed(model,
sp_group=...)`` (Ulysses text attention, whole images per rank, features routed to the slice that
holds their placeholders) with the global token-mean loss. The loss and every gradient (summed
over the world, then averaged as FSDP2 does) equal one process running the unsplit rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from collate import PackedCollator  # noqa: E402
from collate.loss import GlobalTokenCount, global_token_mean  # noqa: E402
from collate.models import enable_packed  # noqa: E402
from collate.sp import shard_batch, sp_mesh  # noqa: E402
from tests.helpers.dist_utils import run_ranks  # noqa: E402

# Per data-parallel group: its samples. Group 0: images and a video whose placeholders straddle
# the SP cut; group 1: one image straddling the cut, so one of its SP ranks owns no grid (it runs
# the idle dummy and only receives features).
QWEN2_SPECS = [
    [[("text", 5), ("image", (1, 4, 6)), ("text", 4)],
     [("text", 3), ("video", (2, 4, 8)), ("text", 5)],
     [("text", 6), ("image", (1, 2, 2)), ("text", 3)]],
    [[("text", 11), ("image", (1, 4, 8)), ("text", 3)],
     [("text", 7)]],
]
QWEN3_SPECS = [
    [[("text", 5), ("image", (1, 4, 4)), ("text", 4)],
     [("text", 2), ("video", (3, 4, 4)), ("text", 3)],
     [("text", 4), ("image", (1, 2, 2)), ("text", 2)]],
    [[("text", 9), ("image", (1, 4, 8)), ("text", 3)],
     [("text", 5)]],
]

# GLM-4.1V: (width, height) images and (frames, width, height) videos, grids from the index's
# estimator; a frame's placeholders are the image token.
GLM_SPECS = [
    [[("text", 5), ("image", (130, 90)), ("text", 4)],
     [("text", 3), ("video", (6, 56, 56)), ("text", 5)],
     [("text", 7), ("image", (30, 30)), ("text", 3)]],
]


def _family(name: str):
    if name == "glm4v":
        from transformers import Glm4vForConditionalGeneration

        from tests.helpers.tiny_glm4v import make_sample, tiny_config

        return Glm4vForConditionalGeneration, tiny_config(), make_sample, GLM_SPECS
    if name == "qwen2_vl":
        from transformers import Qwen2VLForConditionalGeneration

        from tests.helpers.tiny_mix import make_sample, tiny_config

        return Qwen2VLForConditionalGeneration, tiny_config(), make_sample, QWEN2_SPECS
    if name == "qwen2_5_vl":
        # Qwen2.5-VL: windowed vision attention (window 56 px = 2 merged tokens), so each rank's
        # tower gets its own grids' window order and segments, cut out of the collator's.
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        from tests.helpers.tiny_mix import IMG, VEND, VID, VSTART, make_sample, tiny_config

        config = Qwen2_5_VLConfig(
            text_config=tiny_config().text_config.to_dict(),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                               out_hidden_size=32, fullatt_block_indexes=[1], window_size=56, patch_size=14,
                               spatial_merge_size=2),
            image_token_id=IMG, video_token_id=VID, vision_start_token_id=VSTART, vision_end_token_id=VEND,
            attn_implementation="sdpa")
        return Qwen2_5_VLForConditionalGeneration, config, make_sample, QWEN2_SPECS
    from transformers import Qwen3VLForConditionalGeneration

    from tests.helpers.tiny_qwen3_vl import make_sample, tiny_config

    return Qwen3VLForConditionalGeneration, tiny_config(), make_sample, QWEN3_SPECS


def _model(name: str):
    cls, config, _, _ = _family(name)
    torch.manual_seed(0)
    return cls(config).float()


def _rows(name: str, dp: int) -> list[list[dict]]:
    _, _, make_sample, specs = _family(name)
    g = torch.Generator().manual_seed(3)
    return [[make_sample(g, spec) for spec in specs[d]] for d in range(dp)]


def _collator(name: str, sp: int) -> PackedCollator:
    _, config, _, _ = _family(name)
    return PackedCollator.from_config(config, pin_memory=False, sp_size=sp)


def _sp_rank(rank: int, world: int, name: str, sp: int, fsdp: bool = False) -> dict:
    mesh = sp_mesh(sp)
    dp_rank, sp_rank = mesh["dp"].get_local_rank(), mesh["sp"].get_local_rank()
    model = enable_packed(_model(name), sp_group=mesh["sp"].get_group())
    if fsdp:
        from dataclasses import asdict

        from collate.train import FSDPSettings, shard_qwen2_vl

        # FSDP2 over all dp x sp ranks (the default group), with the CPU overlap settings.
        model = shard_qwen2_vl(model, **asdict(FSDPSettings.for_device("cpu")))
    row = _collator(name, sp)(_rows(name, world // sp)[dp_rank])
    batch = shard_batch(row, sp_rank, sp)
    count = GlobalTokenCount.start(batch.num_loss_tokens)  # over the world: each token once
    out = model(**batch)
    loss_sum = out.loss * batch.num_loss_tokens
    global_token_mean(loss_sum, count).backward()
    total = loss_sum.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for n, p in model.named_parameters():
        if fsdp:  # FSDP2 has averaged the world's gradients already
            grads[n] = p.grad.full_tensor() if p.grad is not None else torch.zeros(p.shape)
            continue
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(grad)
        grads[n] = grad / world  # what FSDP2's reduce-scatter averages to
    errors = []
    if rank == 0 and not fsdp:
        errors.append(_error(lambda: model(**shard_batch(row, 1, sp))))  # wrong slice for this rank
        errors.append(_error(lambda: model(**row)))  # the whole row, not a slice
    bad = _bad_setups() if world == 2 and not fsdp else {}
    return {"loss": float(total / count.wait()), "grads": grads, "errors": errors,
            "own_grids": 0 if batch.image_grid_thw is None and batch.video_grid_thw is None else
            sum(int(g.shape[0]) for g in (batch.image_grid_thw, batch.video_grid_thw) if g is not None),
            "received": int(batch.vision_token_index.shape[0]) if batch.vision_token_index is not None else 0,
            "pad": row.sp_padding, "bad": bad}


def _error(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


def _reference(name: str, dp: int) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, the unsplit (unpadded) rows, the token mean over all of them."""
    model = enable_packed(_model(name))
    rows = [_collator(name, 1)(samples) for samples in _rows(name, dp)]
    total = sum(r.num_loss_tokens for r in rows)
    loss = sum(model(**r).loss * r.num_loss_tokens for r in rows) / total
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def _check(results: list[dict], name: str, dp: int, sp: int) -> None:
    want_loss, want = _reference(name, dp)
    checked = 0
    for res in results:
        assert res["loss"] == pytest.approx(want_loss, rel=1e-5)
        for n, g_ref in want.items():
            if g_ref is None:
                assert not res["grads"][n].any(), n
                continue
            scale = float(g_ref.abs().max())
            torch.testing.assert_close(res["grads"][n], g_ref, rtol=1e-5, atol=1e-5 * scale, msg=n)
            checked += 1
    assert checked > 20 * len(results)
    assert all(res["pad"] for res in results), "rows need padding: lengths not multiples of S"
    # Group 1's single image: one SP rank owns it, the other owns none but receives features.
    if dp > 1:
        group1 = results[sp:2 * sp]
        assert sorted(r["own_grids"] for r in group1) == [0, 1]
        assert all(r["received"] > 0 for r in group1)
    errors = results[0]["errors"]
    if not errors:  # the FSDP2 runs skip the error checks
        return
    assert "batch slice is sp_rank 1 of 2, but this rank is 0" in errors[0]
    assert "feed it collate.sp.shard_batch" in errors[1]


def _straddles(name: str, dp: int, sp: int) -> list[bool]:
    """Per group: does a grid's placeholder run cross an SP cut?"""
    out = []
    for samples in _rows(name, dp):
        row = _collator(name, sp)(samples)
        local = row.input_ids.shape[1] // sp
        slots = row.vision_token_index.numpy()
        grids = torch.cat([g for g in (row.image_grid_thw, row.video_grid_thw) if g is not None])
        cu = np.cumsum([0, *(grids.prod(1) // 4).tolist()])
        out.append(any(len(set(slots[cu[i]:cu[i + 1]] // local)) > 1 for i in range(len(grids))))
    return out


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl"])
def test_two_ranks_sp2_equal_single_process(name):
    assert _straddles(name, 1, 2) == [True]
    batch = _collator(name, 2)(_rows(name, 1)[0])
    video_slots = np.flatnonzero(batch.input_ids[0].numpy() == _family(name)[1].video_token_id)
    half = batch.input_ids.shape[1] // 2
    assert video_slots.min() < half <= video_slots.max(), "the video's placeholders straddle the cut"
    results = run_ranks(_sp_rank, 2, name, 2, timeout=300, collective_timeout=90)
    _check(results, name, 1, 2)
    for res in results:
        bad = res["bad"]
        assert "3 attention heads are not divisible by the SP size 2" in bad["heads"]
        assert bad["heads_left_unpatched"]
        assert "sp_size=3 must divide the world size 2" in bad["world"]
        assert "no packed patch for model_type='qwen2'" in bad["no_patch"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_four_ranks_dp2_sp2_equal_single_process(name):
    assert _straddles(name, 2, 2) == [True, True]
    results = run_ranks(_sp_rank, 4, name, 2, timeout=600, collective_timeout=120)
    _check(results, name, 2, 2)


def _bad_setups() -> dict:
    """Clear errors, raised before any collective (so no rank hangs)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2VLForConditionalGeneration

    from tests.helpers.tiny_mix import tiny_config

    out = {}
    config = tiny_config()
    config.text_config.num_attention_heads = 3
    config.text_config.num_key_value_heads = 3
    config.text_config.hidden_size = 24
    model = Qwen2VLForConditionalGeneration(config)
    out["heads"] = _error(lambda: enable_packed(model, sp_group=dist.group.WORLD))
    out["heads_left_unpatched"] = "_tokenbal_sp_group" not in model.__dict__
    try:
        sp_mesh(3)
    except ValueError as e:
        out["world"] = str(e)
    text = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2))
    try:
        enable_packed(text, sp_group=dist.group.WORLD)
    except TypeError as e:
        out["no_patch"] = str(e)
    return out



@pytest.mark.slow
def test_fsdp2_four_ranks_dp2_sp2_equal_single_process():
    results = run_ranks(_sp_rank, 4, "qwen2_vl", 2, True, timeout=600, collective_timeout=120)
    _check(results, "qwen2_vl", 2, 2)


@pytest.mark.slow  # two processes, ~1.5 min on a loaded 2-core machine
def test_two_ranks_sp2_glm4v_equal_single_process():
    """GLM-4.1V's own positions and partial pair-wise rotary under Ulysses, its frames routed as
    image-token features: equal to one process on the unsplit row."""
    assert _straddles("glm4v", 1, 2) == [True]
    results = run_ranks(_sp_rank, 2, "glm4v", 2, timeout=300, collective_timeout=90)
    _check(results, "glm4v", 1, 2)
