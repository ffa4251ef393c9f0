"""The Triton M-RoPE kernel, run on CPU by Triton's interpreter, against the PyTorch reference.

``TRITON_INTERPRET=1`` is read when ``@triton.jit`` decorates a kernel, so a module-scoped fixture sets
it, imports ``collate.ops.rope.triton`` fresh, and on teardown restores the environment and drops the
module again: nothing leaks into other test modules. Shapes are small (the interpreter is slow);
the big ones are marked ``slow``. Tolerances: fp32 2e-5 absolute; bf16/fp16 1e-2 relative.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

pytest.importorskip("triton")

from collate import apply_mrope  # noqa: E402
from collate.ops.rope import dispatch as rope_dispatch  # noqa: E402
from collate.ops.rope.reference import apply_mrope_reference  # noqa: E402
from tests.helpers.rope import (  # noqa: E402
    _inv_freq,
    _qk,
    _sample_positions,
    check_inplace_on_projection_views,
    hf_mrope,
    rope_1d_oracle,
)

_MOD = "collate.ops.rope.triton"


@pytest.fixture(scope="module")
def tri():
    saved = {key: os.environ.get(key) for key in ("TRITON_INTERPRET", rope_dispatch.IMPL_ENV)}
    os.environ["TRITON_INTERPRET"] = "1"
    sys.modules.pop(_MOD, None)
    try:
        yield importlib.import_module(_MOD).apply_mrope_triton
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        sys.modules.pop(_MOD, None)


CASES = [
    # (head_dim, rotary_dim, section, interleaved)
    (128, 128, [16, 24, 24], False),  # Qwen2-VL / Qwen2.5-VL
    (128, 128, [24, 20, 20], True),  # Qwen3-VL
    (64, 64, [8, 12, 12], False),
    (48, 32, [6, 5, 5], True),  # partial rotary, odd sections
    (40, 24, [4, 4, 4], False),  # partial rotary, non-power-of-two half and pass-through
]


def _packed_positions() -> torch.Tensor:
    text = torch.arange(6).expand(3, -1)
    parts = [_sample_positions(5, (2, 3, 4), 7), text, _sample_positions(3, (1, 4, 2), 2)]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("d,r,section,interleaved", CASES)
def test_fp32_matches_reference_and_hf(tri, d, r, section, interleaved):
    pos = _packed_positions()
    q, k = _qk(pos.shape[1], 4, 2, d)  # GQA: 4 query heads, 2 key heads
    inv = _inv_freq(r)
    qo, ko = tri(q, k, pos, inv, section, interleaved)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == torch.float32
    qr, kr = apply_mrope_reference(q, k, pos, inv, section, interleaved)
    torch.testing.assert_close(qo, qr, atol=2e-5, rtol=0)
    torch.testing.assert_close(ko, kr, atol=2e-5, rtol=0)
    qh, kh = hf_mrope(q, k, pos, inv, section, interleaved)
    torch.testing.assert_close(qo, qh, atol=2e-5, rtol=0)
    torch.testing.assert_close(ko, kh, atol=2e-5, rtol=0)
    if r < d:  # pass-through dims are copied bit for bit
        assert torch.equal(qo[..., r:], q[..., r:]) and torch.equal(ko[..., r:], k[..., r:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_half_precision_within_1e2_relative(tri, dtype, interleaved):
    section = [24, 20, 20] if interleaved else [16, 24, 24]
    pos = _sample_positions(6, (1, 6, 8), 9, offset=1000)
    q32, k32 = _qk(pos.shape[1], 4, 2, 128)
    q, k = q32.to(dtype), k32.to(dtype)
    inv = _inv_freq(128, theta=1e6)
    qo, ko = tri(q, k, pos, inv, section, interleaved)
    assert qo.dtype == dtype and ko.dtype == dtype
    q_exact, k_exact = apply_mrope_reference(q.float(), k.float(), pos, inv, section, interleaved)
    q_ref, _ = apply_mrope_reference(q, k, pos, inv, section, interleaved)
    for ours, exact in ((qo, q_exact), (ko, k_exact)):
        rel = (ours.float() - exact).norm() / exact.norm()
        assert rel < 1e-2
    # Same fp32 math and one final rounding as the reference: at most one rounding step apart.
    ulp = torch.finfo(dtype).eps * q_exact.abs().max()
    assert (qo.float() - q_ref.float()).abs().max() <= ulp


@pytest.mark.parametrize("interleaved", [False, True])
def test_gradients_equal_reference(tri, interleaved):
    section = [4, 6, 6] if not interleaved else [6, 5, 5]
    pos = _packed_positions()
    q0, k0 = _qk(pos.shape[1], 4, 2, 40)
    gq, gk = _qk(pos.shape[1], 4, 2, 40, seed=1)
    inv = _inv_freq(32)  # partial rotary: 32 of 40
    grads = []
    for fn in (tri, apply_mrope_reference):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        qo, ko = fn(q, k, pos, inv, section, interleaved, 0.7)
        torch.autograd.backward([qo, ko], [gq, gk])
        grads.append((q.grad, k.grad))
    (tq, tk), (rq, rk) = grads
    torch.testing.assert_close(tq, rq, atol=2e-5, rtol=0)
    torch.testing.assert_close(tk, rk, atol=2e-5, rtol=0)
    assert torch.equal(tq[..., 32:], gq[..., 32:])  # pass-through dims: identity gradient


def test_gradient_of_one_output_only(tri):
    pos = _sample_positions(2, (1, 2, 2), 2)
    q, k = (t.requires_grad_() for t in _qk(pos.shape[1], 2, 1, 16))
    qo, _ = tri(q, k, pos, _inv_freq(16), [2, 3, 3])
    qo.sum().backward()
    assert k.grad is not None and torch.count_nonzero(k.grad) == 0
    qd = q.detach().clone().requires_grad_()
    qr, _ = apply_mrope_reference(qd, k.detach(), pos, _inv_freq(16), [2, 3, 3])
    (grad_ref,) = torch.autograd.grad(qr.sum(), qd)
    torch.testing.assert_close(q.grad, grad_ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("interleaved", [False, True])
def test_text_tokens_are_exactly_1d_rope(tri, interleaved):
    T = 37
    pos1 = torch.arange(T) + 11
    q, k = _qk(T, 4, 2, 64)
    inv = _inv_freq(64)
    section = [10, 11, 11] if interleaved else [8, 12, 12]
    q3, k3 = tri(q, k, pos1.expand(3, -1), inv, section, interleaved)
    q1, k1 = tri(q, k, pos1, inv, section, interleaved)
    q4, _ = tri(q, k, torch.cat([pos1[None], pos1.expand(3, -1)])[:, None, :], inv, section, interleaved)
    assert torch.equal(q3, q1) and torch.equal(k3, k1) and torch.equal(q4, q1)
    torch.testing.assert_close(q1.double(), rope_1d_oracle(q, pos1, inv), atol=2e-5, rtol=0)


def test_packed_equals_per_sample(tri):
    samples = [
        _sample_positions(3, (1, 2, 4), 4),
        torch.arange(9).expand(3, -1),
        _sample_positions(0, (2, 4, 4), 6, offset=17),
    ]
    pos = torch.cat(samples, dim=1)
    q, k = _qk(pos.shape[1], 4, 2, 64)
    inv = _inv_freq(64)
    qp, kp = tri(q, k, pos, inv, [8, 12, 12])
    start = 0
    for s in samples:
        n = s.shape[1]
        qs, ks = tri(q[start : start + n], k[start : start + n], s, inv, [8, 12, 12])
        assert torch.equal(qp[start : start + n], qs) and torch.equal(kp[start : start + n], ks)
        start += n


@pytest.mark.parametrize("interleaved", [False, True])
def test_positions_up_to_30k(tri, interleaved):
    g = torch.Generator().manual_seed(3)
    pos = torch.randint(0, 30_000, (3, 40), generator=g)
    pos[:, :8] = 29_999
    q, k = _qk(40, 2, 1, 128)
    inv = _inv_freq(128, theta=1e6)
    section = [24, 20, 20] if interleaved else [16, 24, 24]
    qo, ko = tri(q, k, pos, inv, section, interleaved)
    qr, kr = apply_mrope_reference(q, k, pos, inv, section, interleaved)
    torch.testing.assert_close(qo, qr, atol=2e-5, rtol=0)
    torch.testing.assert_close(ko, kr, atol=2e-5, rtol=0)


def test_non_contiguous_views(tri):
    pos = _packed_positions()
    T, hq, hk, d = pos.shape[1], 4, 2, 64
    inv = _inv_freq(48)  # partial rotary
    qkv = torch.randn(T, hq + 2 * hk, d)
    q, k = qkv[:, :hq], qkv[:, hq : hq + hk]  # views out of a fused QKV projection
    assert not q.is_contiguous()
    qr, kr = apply_mrope_reference(q, k, pos, inv, [8, 8, 8])
    qo, ko = tri(q, k, pos, inv, [8, 8, 8])
    torch.testing.assert_close(qo, qr, atol=2e-5, rtol=0)
    torch.testing.assert_close(ko, kr, atol=2e-5, rtol=0)
    # Heads-first storage seen as (T, H, D), and a strided last dim.
    qt = q.contiguous().transpose(0, 1).contiguous().transpose(0, 1)
    wide = torch.zeros(T, hk, 2 * d)
    wide[..., ::2] = k
    kt = wide[..., ::2]
    qo2, ko2 = tri(qt, kt, pos, inv, [8, 8, 8])
    torch.testing.assert_close(qo2, qr, atol=2e-5, rtol=0)
    torch.testing.assert_close(ko2, kr, atol=2e-5, rtol=0)
    # Positions as a (3, 1, T) int32 view with a stride.
    qo3, _ = tri(q, k, pos.int()[:, None, :], inv, [8, 8, 8])
    assert torch.equal(qo3, qo)


def test_inplace(tri):
    pos = _packed_positions()
    q0, k0 = _qk(pos.shape[1], 4, 2, 40)
    inv = _inv_freq(32)
    qr, kr = tri(q0, k0, pos, inv, [4, 6, 6])
    q, k = q0.clone(), k0.clone()
    qo, ko = tri(q, k, pos, inv, [4, 6, 6], inplace=True)
    assert qo.data_ptr() == q.data_ptr() and ko.data_ptr() == k.data_ptr()
    assert torch.equal(q, qr) and torch.equal(k, kr)
    # Autograd through the in-place op on non-leaf tensors.
    a = q0.clone().requires_grad_()
    b = k0.clone().requires_grad_()
    qa, kb = a * 1.0, b * 1.0
    tri(qa, kb, pos, inv, [4, 6, 6], inplace=True)
    (qa.square().sum() + kb.sum()).backward()
    c = q0.clone().requires_grad_()
    e = k0.clone().requires_grad_()
    qc, ke = apply_mrope_reference(c, e, pos, inv, [4, 6, 6])
    (qc.square().sum() + ke.sum()).backward()
    torch.testing.assert_close(a.grad, c.grad, atol=2e-5, rtol=0)
    torch.testing.assert_close(b.grad, e.grad, atol=2e-5, rtol=0)
    check_inplace_on_projection_views(tri, pos, inv)


def test_dispatch_forced_triton(tri, monkeypatch):
    pos = _packed_positions()
    q, k = _qk(pos.shape[1], 2, 2, 32)
    inv = _inv_freq(32)
    monkeypatch.setenv(rope_dispatch.IMPL_ENV, "triton")
    fn = rope_dispatch._select_backend(q.device, q.dtype)
    assert fn.__module__ == _MOD
    qo, ko = apply_mrope(q, k, pos, inv, [4, 6, 6], interleaved=True)
    qr, kr = apply_mrope_reference(q, k, pos, inv, [4, 6, 6], True)
    torch.testing.assert_close(qo, qr, atol=2e-5, rtol=0)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        apply_mrope(q, k, pos, inv, [4, 6, 6])
    monkeypatch.setenv(rope_dispatch.IMPL_ENV, "cuda-graphs")
    with pytest.raises(ValueError, match="expected one of"):
        apply_mrope(q, k, pos, inv, [4, 6, 6])
    monkeypatch.delenv(rope_dispatch.IMPL_ENV)
    assert rope_dispatch._select_backend(q.device, q.dtype).__module__ == "collate.ops.rope.cpu"


def test_edge_cases_and_errors(tri):
    inv = _inv_freq(16)
    q, k = torch.empty(0, 2, 16), torch.empty(0, 1, 16)
    qo, ko = tri(q, k, torch.empty(3, 0, dtype=torch.long), inv, [2, 3, 3])
    assert qo.shape == (0, 2, 16) and ko.shape == (0, 1, 16)
    q, k = _qk(5, 2, 1, 16)
    pos = torch.arange(5).expand(3, -1)
    with pytest.raises(TypeError, match="fp32/bf16/fp16"):
        tri(q.double(), k.double(), pos, inv, [2, 3, 3])
    with pytest.raises(ValueError, match="sum"):
        tri(q, k, pos, inv, [2, 2, 2])
    with pytest.raises(ValueError, match="exceeds head dim"):
        tri(q, k, pos, _inv_freq(32), [4, 6, 6])
    with pytest.raises(ValueError, match="cover 4 tokens"):
        tri(q, k, pos[:, :4], inv, [2, 3, 3])


def test_no_rotary_dims_passes_through(tri):
    """``inv_freq`` empty (no rotated channel, section (0, 0, 0)): the heads pass through, out of
    place and in place, as on the PyTorch backend (it once raised the interpreter's
    ``arange's end argument must be greater than the start argument``)."""
    q, k = _qk(5, 2, 1, 16)
    pos = torch.arange(5).expand(3, -1)
    none = torch.empty(0)
    qo, ko = tri(q, k, pos, none, [0, 0, 0])
    assert torch.equal(qo, q) and torch.equal(ko, k) and qo.data_ptr() != q.data_ptr()
    qc, kc = q.clone(), k.clone()
    qi, ki = tri(qc, kc, pos, none, [0, 0, 0], inplace=True)
    assert qi is qc and torch.equal(qi, q) and torch.equal(ki, k)


@pytest.mark.slow
@pytest.mark.parametrize("interleaved", [False, True])
def test_qwen_sized_block(tri, interleaved):
    """Qwen2.5-VL-7B-like heads (28 q / 4 kv, D=128) over 512 packed tokens, bf16 and fp32, fwd + bwd."""
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 20_000, (3, 512), generator=g)
    section = [24, 20, 20] if interleaved else [16, 24, 24]
    inv = _inv_freq(128, theta=1e6)
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, None)):
        q0, k0 = _qk(512, 28, 4, 128, dtype=dtype)
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        qo, ko = tri(q, k, pos, inv, section, interleaved)
        (qo.float().square().sum() + ko.float().sum()).backward()
        qr, kr = apply_mrope_reference(q0.float(), k0.float(), pos, inv, section, interleaved)
        if tol is not None:
            torch.testing.assert_close(qo, qr, atol=tol, rtol=0)
            torch.testing.assert_close(ko, kr, atol=tol, rtol=0)
            torch.testing.assert_close(q.grad, 2 * q0, atol=1e-4, rtol=0)  # R^T R x = x
        else:
            assert ((qo.float() - qr).norm() / qr.norm()) < 1e-2
