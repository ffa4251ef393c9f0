"""apply_mrope against an independent transformers-5.x-style M-RoPE written out here.

The oracle follows transformers 5.24 ``Qwen2VLRotaryEmbedding.forward`` + ``recomposition_frequencies``
(chunked) and ``Qwen3VLTextRotaryEmbedding.recomposition_frequencies`` (interleaved), then
``apply_rotary_pos_emb`` with ``rotate_half``, on HF's ``(B, H, L, D)`` layout.
Tolerances: fp32 2e-5 absolute; bf16 1e-2 relative (HF rounds cos/sin to bf16, we rotate in fp32).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collate import apply_mrope
from collate.ops.rope.reference import normalize_positions
from tests.helpers.rope import _inv_freq, _qk, _sample_positions, hf_mrope, rope_1d_oracle

CASES = [
    # (head_dim, section, interleaved)
    (128, [16, 24, 24], False),  # Qwen2-VL / Qwen2.5-VL
    (128, [24, 20, 20], True),  # Qwen3-VL
    (64, [8, 12, 12], False),
    (32, [6, 5, 5], True),
]


@pytest.mark.parametrize("d,section,interleaved", CASES)
def test_matches_hf_formula_fp32(d, section, interleaved):
    pos = torch.cat([_sample_positions(5, (2, 3, 4), 7), _sample_positions(3, (1, 4, 2), 2)], dim=1)
    q, k = _qk(pos.shape[1], 4, 2, d)
    inv = _inv_freq(d)
    qo, ko = apply_mrope(q, k, pos, inv, section, interleaved=interleaved)
    qr, kr = hf_mrope(q, k, pos, inv, section, interleaved)
    assert qo.dtype == q.dtype and qo.shape == q.shape and ko.shape == k.shape
    torch.testing.assert_close(qo, qr, atol=2e-5, rtol=0)
    torch.testing.assert_close(ko, kr, atol=2e-5, rtol=0)


@pytest.mark.parametrize("d,section,interleaved", CASES[:2])
def test_bf16_close_to_hf(d, section, interleaved):
    pos = _sample_positions(6, (1, 6, 8), 9)
    q32, k32 = _qk(pos.shape[1], 4, 2, d)
    q, k = q32.bfloat16(), k32.bfloat16()
    inv = _inv_freq(d)
    qo, ko = apply_mrope(q, k, pos, inv, section, interleaved=interleaved)
    assert qo.dtype == torch.bfloat16 and ko.dtype == torch.bfloat16
    qr, kr = hf_mrope(q, k, pos, inv, section, interleaved)  # HF in bf16
    q_exact, _ = hf_mrope(q.float(), k.float(), pos, inv, section, interleaved)
    for ours, theirs in ((qo, qr), (ko, kr)):
        rel = (ours.float() - theirs.float()).norm() / theirs.float().norm()
        assert rel < 1e-2
    # Rotating in fp32 is at least as accurate as HF's bf16 multiply.
    err_ours = (qo.float() - q_exact).abs().max()
    err_hf = (qr.float() - q_exact).abs().max()
    assert err_ours <= err_hf + 1e-6


@pytest.mark.parametrize("d,section,interleaved", CASES)
def test_text_tokens_equal_1d_rope(d, section, interleaved):
    T = 37
    pos1 = torch.arange(T) + 11
    pos3 = pos1.expand(3, -1)
    q, k = _qk(T, 4, 2, d)
    inv = _inv_freq(d)
    q3, k3 = apply_mrope(q, k, pos3, inv, section, interleaved=interleaved)
    q1, k1 = apply_mrope(q, k, pos1, inv, section, interleaved=interleaved)
    q1b, _ = apply_mrope(q, k, pos1[None], inv, section, interleaved=interleaved)
    assert torch.equal(q3, q1) and torch.equal(k3, k1) and torch.equal(q1, q1b)
    torch.testing.assert_close(q1.double(), rope_1d_oracle(q, pos1, inv), atol=2e-5, rtol=0)


def test_position_layouts_agree():
    pos = _sample_positions(4, (1, 4, 4), 5)
    T = pos.shape[1]
    q, k = _qk(T, 2, 2, 32)
    inv = _inv_freq(32)
    ref = apply_mrope(q, k, pos, inv, [4, 6, 6])
    text = torch.arange(T)[None]
    for layout in (pos[:, None, :], pos.int(), torch.cat([text, pos])[:, None, :]):
        out = apply_mrope(q, k, layout, inv, [4, 6, 6])
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_packed_equals_per_sample():
    samples = [
        _sample_positions(3, (1, 2, 4), 4),
        torch.arange(9).expand(3, -1),
        _sample_positions(0, (2, 4, 4), 6),
    ]
    lens = [s.shape[1] for s in samples]
    pos = torch.cat(samples, dim=1)
    q, k = _qk(pos.shape[1], 4, 2, 64)
    inv = _inv_freq(64)
    qp, kp = apply_mrope(q, k, pos, inv, [8, 12, 12])
    start = 0
    for s, n in zip(samples, lens, strict=True):
        qs, ks = apply_mrope(q[start : start + n], k[start : start + n], s, inv, [8, 12, 12])
        assert torch.equal(qp[start : start + n], qs) and torch.equal(kp[start : start + n], ks)
        start += n


@settings(max_examples=20, deadline=None)
@given(
    lens=st.lists(st.integers(1, 12), min_size=1, max_size=5),
    offset=st.integers(0, 5000),
    interleaved=st.booleans(),
)
def test_packed_equals_per_sample_property(lens, offset, interleaved):
    g = torch.Generator().manual_seed(sum(lens) + offset)
    samples = [torch.randint(offset, offset + 40, (3, n), generator=g) for n in lens]
    pos = torch.cat(samples, dim=1)
    q, k = _qk(pos.shape[1], 2, 1, 16)
    inv = _inv_freq(16)
    qp, kp = apply_mrope(q, k, pos, inv, [2, 3, 3], interleaved=interleaved)
    qr, kr = hf_mrope(q, k, pos, inv, [2, 3, 3], interleaved)
    torch.testing.assert_close(qp, qr, atol=2e-5, rtol=0)
    start = 0
    for s in samples:
        n = s.shape[1]
        qs, _ = apply_mrope(
            q[start : start + n], k[start : start + n], s, inv, [2, 3, 3], interleaved=interleaved
        )
        assert torch.equal(qp[start : start + n], qs)
        start += n


@pytest.mark.parametrize("interleaved", [False, True])
def test_gradcheck_float64(interleaved):
    pos = _sample_positions(2, (1, 2, 2), 2)
    T = pos.shape[1]
    q = torch.randn(T, 2, 12, dtype=torch.float64, requires_grad=True)
    k = torch.randn(T, 1, 12, dtype=torch.float64, requires_grad=True)
    inv = _inv_freq(8)  # partial rotary: R = 8 < D = 12
    assert torch.autograd.gradcheck(lambda a, b: apply_mrope(a, b, pos, inv, [2, 1, 1], interleaved), (q, k))


def test_gradients_match_hf_and_conjugate():
    pos = _sample_positions(4, (1, 4, 6), 3)
    q0, k0 = _qk(pos.shape[1], 4, 2, 64)
    inv = _inv_freq(64)
    gq, gk = _qk(pos.shape[1], 4, 2, 64, seed=1)
    q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
    qo, ko = apply_mrope(q, k, pos, inv, [8, 12, 12])
    torch.autograd.backward([qo, ko], [gq, gk])
    qh, kh = q0.clone().requires_grad_(), k0.clone().requires_grad_()
    qr, kr = hf_mrope(qh, kh, pos, inv, [8, 12, 12])
    torch.autograd.backward([qr, kr], [gq, gk])
    torch.testing.assert_close(q.grad, qh.grad, atol=2e-5, rtol=0)
    torch.testing.assert_close(k.grad, kh.grad, atol=2e-5, rtol=0)
    # The rotation is orthogonal: backward is the forward with the angle negated (-pos).
    back, _ = apply_mrope(gq, gk, -pos, inv, [8, 12, 12])
    torch.testing.assert_close(q.grad, back, atol=2e-5, rtol=0)


def test_partial_rotary_passes_through():
    pos = _sample_positions(3, (1, 2, 2), 3)
    q, k = _qk(pos.shape[1], 4, 2, 48)
    inv = _inv_freq(32)  # R = 32 of D = 48
    qo, ko = apply_mrope(q, k, pos, inv, [4, 6, 6])
    assert torch.equal(qo[..., 32:], q[..., 32:]) and torch.equal(ko[..., 32:], k[..., 32:])
    qr, kr = hf_mrope(q, k, pos, inv, [4, 6, 6])
    torch.testing.assert_close(qo, qr, atol=2e-5, rtol=0)
    torch.testing.assert_close(ko, kr, atol=2e-5, rtol=0)


def test_gqa_heads_rotate_identically():
    pos = _sample_positions(2, (1, 2, 2), 2)
    T = pos.shape[1]
    q, k = _qk(T, 8, 2, 32)
    k = q[:, :2].clone()  # same data as the first two query heads
    qo, ko = apply_mrope(q, k, pos, _inv_freq(32), [4, 6, 6])
    assert ko.shape == (T, 2, 32)
    assert torch.equal(qo[:, :2], ko)


@pytest.mark.parametrize("interleaved", [False, True])
def test_large_positions(interleaved):
    g = torch.Generator().manual_seed(3)
    pos = torch.randint(0, 30_000, (3, 64), generator=g)
    pos[:, :8] = 29_999
    q, k = _qk(64, 2, 2, 128)
    inv = _inv_freq(128, theta=1e6)
    section = [24, 20, 20] if interleaved else [16, 24, 24]
    qo, ko = apply_mrope(q, k, pos, inv, section, interleaved=interleaved)
    qr, kr = hf_mrope(q, k, pos, inv, section, interleaved)
    # Same fp32 angle product as HF, so agreement stays tight at large positions.
    torch.testing.assert_close(qo, qr, atol=2e-5, rtol=0)
    torch.testing.assert_close(ko, kr, atol=2e-5, rtol=0)
    # And against float64 math (text tokens, 1-D): the fp32 angle rounding bounds the error.
    p1 = pos[0]
    q1, _ = apply_mrope(q, k, p1, inv, section, interleaved=interleaved)
    err = (q1.double() - rope_1d_oracle(q, p1, inv)).abs().max()
    assert err < 5e-3 * q.abs().max()


def test_attention_scaling_and_dtype_and_no_mutation():
    pos = _sample_positions(2, (1, 2, 2), 2)
    q, k = _qk(pos.shape[1], 2, 2, 16)
    q_copy, k_copy = q.clone(), k.clone()
    inv = _inv_freq(16)
    qo, ko = apply_mrope(q, k, pos, inv, [2, 3, 3], attention_scaling=0.5)
    qr, kr = hf_mrope(q, k, pos, inv, [2, 3, 3], scaling=0.5)
    torch.testing.assert_close(qo, qr, atol=2e-5, rtol=0)
    assert torch.equal(q, q_copy) and torch.equal(k, k_copy)
    qh, _ = apply_mrope(q.half(), k.half(), pos, inv, [2, 3, 3])
    assert qh.dtype == torch.float16


def test_bad_inputs_raise():
    q, k = _qk(5, 2, 2, 16)
    pos = torch.arange(5).expand(3, -1)
    inv = _inv_freq(16)
    with pytest.raises(ValueError, match="sum"):
        apply_mrope(q, k, pos, inv, [2, 2, 2])
    with pytest.raises(TypeError, match="integer"):
        apply_mrope(q, k, pos.float(), inv, [2, 3, 3])
    with pytest.raises(ValueError, match="cover 4 tokens"):
        apply_mrope(q, k, pos[:, :4], inv, [2, 3, 3])
    with pytest.raises(ValueError, match="batch dimension 1"):
        apply_mrope(q, k, pos[:, None].expand(3, 2, 5), inv, [2, 3, 3])
    with pytest.raises(ValueError, match="exceeds head dim"):
        apply_mrope(q, k, pos, _inv_freq(32), [4, 6, 6])
    with pytest.raises(ValueError):
        normalize_positions(torch.zeros(2, 5, dtype=torch.long), 5)


@pytest.mark.parametrize("impl", ["reference", "cpu"])
def test_vision_axial_rotation_is_an_mrope_with_no_time_section(impl, monkeypatch):
    """The Qwen-VL / GLM-4V vision towers' axial rotation (transformers' ``apply_rotary_pos_emb_vision``
    over ``cat(f * row, f * col)`` twice) is ``apply_mrope`` with positions ``(., row, col)``,
    ``inv_freq = cat(f, f)`` and ``mrope_section = (0, D/4, D/4)``: the fusion the packed vision
    attention could use (docs/models.md)."""
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    from collate.vision import vision_rotary_positions

    monkeypatch.setenv("TOKENBAL_ROPE_IMPL", impl)
    heads, dim = 3, 16
    pos = torch.from_numpy(vision_rotary_positions([[1, 4, 6], [2, 2, 4]], 2))  # (N, 2) row, column
    freq = 1.0 / (10000 ** (torch.arange(0, dim // 2, 2, dtype=torch.float) / (dim // 2)))
    angles = torch.cat((pos[:, :1] * freq, pos[:, 1:] * freq), dim=-1)  # the tower's rotary_pos_emb
    emb = torch.cat((angles, angles), dim=-1)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(pos.shape[0], heads, dim, generator=g), torch.randn(pos.shape[0], 1, dim, generator=g)
    want = apply_rotary_pos_emb_vision(q, k, emb.cos(), emb.sin())
    got = apply_mrope(q, k, torch.stack((pos[:, 0], pos[:, 0], pos[:, 1])), torch.cat((freq, freq)),
                      (0, dim // 4, dim // 4))
    for g_, w_ in zip(got, want, strict=True):
        torch.testing.assert_close(g_, w_, rtol=0, atol=2e-6)
