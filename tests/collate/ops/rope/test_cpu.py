"""The lean PyTorch backend (rope/cpu.py) against the plain reference formula (rope/reference.py).

Tolerances: fp32 2e-5 absolute; bf16/fp16 one rounding step of the reference; gradients 2e-5.
test_rope.py additionally checks this backend (the CPU default of ``apply_mrope``) against an
independent transformers-style implementation.
"""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from collate import apply_mrope
from collate.ops.rope import cpu as rope_cpu
from collate.ops.rope import dispatch as rope_dispatch
from collate.ops.rope.cpu import apply_mrope_cpu
from collate.ops.rope.reference import apply_mrope_reference
from tests.helpers.rope import _inv_freq, _qk, _sample_positions, check_inplace_on_projection_views

CASES = [
    (128, 128, [16, 24, 24], False),
    (128, 128, [24, 20, 20], True),
    (48, 32, [6, 5, 5], True),
    (40, 24, [4, 4, 4], False),
]


def _positions() -> torch.Tensor:
    text = torch.arange(6).expand(3, -1)
    return torch.cat([_sample_positions(5, (2, 3, 4), 7), text, _sample_positions(3, (1, 4, 2), 2, 50)], 1)


@pytest.mark.parametrize("d,r,section,interleaved", CASES)
def test_fp32_matches_reference(d, r, section, interleaved):
    pos = _positions()
    q, k = _qk(pos.shape[1], 4, 2, d)
    inv = _inv_freq(r)
    qo, ko = apply_mrope_cpu(q, k, pos, inv, section, interleaved, 0.8)
    qr, kr = apply_mrope_reference(q, k, pos, inv, section, interleaved, 0.8)
    torch.testing.assert_close(qo, qr, atol=2e-5, rtol=0)
    torch.testing.assert_close(ko, kr, atol=2e-5, rtol=0)
    assert torch.equal(qo[..., r:], q[..., r:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [1024, 7])  # one block, and many blocks with a ragged tail
def test_half_precision_blocks(monkeypatch, dtype, block):
    monkeypatch.setattr(rope_cpu, "BLOCK_ELEMENTS", block * 4 * 48)  # `block` tokens of 4 heads x R=48
    pos = _positions()
    q32, k32 = _qk(pos.shape[1], 4, 2, 64)
    q, k = q32.to(dtype), k32.to(dtype)
    inv = _inv_freq(48)
    qo, ko = apply_mrope_cpu(q, k, pos, inv, [8, 8, 8])
    qr, kr = apply_mrope_reference(q, k, pos, inv, [8, 8, 8])
    assert qo.dtype == dtype and ko.dtype == dtype
    for ours, ref in ((qo, qr), (ko, kr)):
        ulp = torch.finfo(dtype).eps * ref.float().abs().max()
        assert (ours.float() - ref.float()).abs().max() <= ulp
        assert torch.equal(ours[..., 48:], (q if ours is qo else k)[..., 48:])


@pytest.mark.parametrize("interleaved", [False, True])
def test_gradients_equal_reference(interleaved):
    pos = _positions()
    q0, k0 = _qk(pos.shape[1], 4, 2, 40)
    gq, gk = _qk(pos.shape[1], 4, 2, 40, seed=2)
    inv = _inv_freq(32)
    section = [6, 5, 5] if interleaved else [4, 6, 6]
    grads = []
    for fn in (apply_mrope_cpu, apply_mrope_reference):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        torch.autograd.backward(list(fn(q, k, pos, inv, section, interleaved, 1.3)), [gq, gk])
        grads.append((q.grad, k.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=2e-5, rtol=0)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=2e-5, rtol=0)


def test_gradcheck_float64():
    pos = _sample_positions(2, (1, 2, 2), 2)
    q = torch.randn(pos.shape[1], 2, 12, dtype=torch.float64, requires_grad=True)
    k = torch.randn(pos.shape[1], 1, 12, dtype=torch.float64, requires_grad=True)
    inv = _inv_freq(8)
    for interleaved in (False, True):
        assert torch.autograd.gradcheck(
            lambda a, b, il=interleaved: apply_mrope_cpu(a, b, pos, inv, [2, 1, 1], il, 0.9), (q, k)
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_and_autograd_through_it(dtype):
    pos = _positions()
    q0, k0 = _qk(pos.shape[1], 4, 2, 40, dtype=dtype)
    inv = _inv_freq(32)
    qr, kr = apply_mrope_cpu(q0, k0, pos, inv, [4, 6, 6])
    q, k = q0.clone(), k0.clone()
    qo, ko = apply_mrope(q, k, pos, inv, [4, 6, 6], inplace=True)
    assert qo is q and ko is k
    assert torch.equal(q, qr) and torch.equal(k, kr)
    a = q0.float().requires_grad_()
    qa = a * 1.0
    apply_mrope_cpu(qa, k0.float() * 1.0, pos, inv, [4, 6, 6], inplace=True)
    qa.square().sum().backward()
    b = q0.float().requires_grad_()
    apply_mrope_reference(b, k0.float(), pos, inv, [4, 6, 6])[0].square().sum().backward()
    torch.testing.assert_close(a.grad, b.grad, atol=2e-5, rtol=0)
    check_inplace_on_projection_views(apply_mrope_cpu, pos, inv)


def test_non_contiguous_and_mixed_dtypes():
    pos = _positions()
    T = pos.shape[1]
    qkv = torch.randn(T, 8, 64)
    q, k = qkv[:, :4], qkv[:, 4:6]
    inv = _inv_freq(64)
    qo, ko = apply_mrope_cpu(q, k, pos, inv, [8, 12, 12])
    qr, kr = apply_mrope_reference(q, k, pos, inv, [8, 12, 12])
    torch.testing.assert_close(qo, qr, atol=2e-5, rtol=0)
    torch.testing.assert_close(ko, kr, atol=2e-5, rtol=0)
    qo, ko = apply_mrope_cpu(q.bfloat16(), k, pos, inv, [8, 12, 12])
    assert qo.dtype == torch.bfloat16 and ko.dtype == torch.float32
    torch.testing.assert_close(ko, kr, atol=2e-5, rtol=0)


class _Bytes(TorchDispatchMode):
    """Bytes of new storages created by ops: cumulative ``total`` and ``peak`` live (at op boundaries)."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.peak = 0
        self._refs: list[tuple[StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = [*args, *(kwargs or {}).values()]  # out= tensors arrive as kwargs
        ins = {a.untyped_storage().data_ptr() for a in given if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                self.total += t.untyped_storage().nbytes()
                self._refs.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
        self.peak = max(self.peak, sum(n for ref, n in self._refs if not ref.expired()))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_peak_memory_is_about_the_outputs(dtype):
    """No (T, D) cos/sin and no full-size temporaries: peak new bytes ~ outputs + O(T * R) + O(block)."""
    T, hq, hk, d = 4096, 8, 2, 64
    pos = torch.arange(T).expand(3, -1)
    q, k = _qk(T, hq, hk, d, dtype=dtype)
    inv = _inv_freq(d)
    with torch.no_grad(), _Bytes() as counter:
        out = apply_mrope_cpu(q, k, pos, inv, [8, 12, 12])
    out_bytes = (q.numel() + k.numel()) * q.element_size()
    small = 6 * T * (d // 2) * 4  # index_select, angles, cos, sin: (T, R/2) tables
    block = 3 * rope_cpu.BLOCK_ELEMENTS * 4 if dtype != torch.float32 else 0  # two fp32 scratch blocks
    assert counter.peak <= out_bytes + small + block
    with torch.no_grad(), _Bytes() as ref_counter:
        ref = apply_mrope_reference(q, k, pos, inv, [8, 12, 12])
    torch.testing.assert_close(out, ref, atol=1e-2 if dtype == torch.bfloat16 else 2e-5, rtol=0)
    assert counter.peak < ref_counter.peak and counter.total < ref_counter.total


def test_dispatch_names(monkeypatch):
    q, k = _qk(4, 1, 1, 8)
    assert rope_dispatch._select_backend(q.device).__module__ == "collate.ops.rope.cpu"
    monkeypatch.setenv(rope_dispatch.IMPL_ENV, "reference")
    assert rope_dispatch._select_backend(q.device) is rope_dispatch._reference_inplace_aware
    monkeypatch.setenv(rope_dispatch.IMPL_ENV, "cpu")
    assert rope_dispatch._select_backend(q.device).__module__ == "collate.ops.rope.cpu"
    qo, _ = apply_mrope(q, k, torch.arange(4), _inv_freq(8), [2, 1, 1])
    qr, _ = apply_mrope_reference(q, k, torch.arange(4), _inv_freq(8), [2, 1, 1])
    torch.testing.assert_close(qo, qr, atol=2e-5, rtol=0)
