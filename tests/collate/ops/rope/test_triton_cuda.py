"""The compiled Triton M-RoPE kernel on a CUDA GPU against the PyTorch reference (skipped without one).

Same checks as test_triton.py (which runs the kernel in Triton's interpreter on CPU), at model
sizes and with positions up to 2**17 to catch an approximate sin/cos lowering on the device.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiled kernels only"),
]

from collate import apply_mrope  # noqa: E402
from collate.ops.rope import dispatch as rope_dispatch  # noqa: E402
from collate.ops.rope.reference import apply_mrope_reference  # noqa: E402


def _inv_freq(rotary_dim: int, theta: float, device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device) / rotary_dim))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("max_pos", [30_000, 1 << 17])
def test_cuda_matches_reference(interleaved, max_pos):
    dev = torch.device("cuda")
    fn = rope_dispatch._select_backend(dev, torch.bfloat16)
    assert fn.__module__ == "collate.ops.rope.triton"
    g = torch.Generator(device=dev).manual_seed(0)
    T, hq, hk, d = 4099, 28, 4, 128
    pos = torch.randint(0, max_pos, (3, T), generator=g, device=dev)
    pos[:, :16] = max_pos - 1
    section = [24, 20, 20] if interleaved else [16, 24, 24]
    inv = _inv_freq(d, 1e6, dev)
    qkv = torch.randn(T, hq + 2 * hk, d, generator=g, device=dev)
    q, k = qkv[:, :hq], qkv[:, hq : hq + hk]  # non-contiguous views
    qo, ko = apply_mrope(q, k, pos, inv, section, interleaved=interleaved)
    qr, kr = apply_mrope_reference(q, k, pos, inv, section, interleaved)
    torch.testing.assert_close(qo, qr, atol=2e-5, rtol=0)
    torch.testing.assert_close(ko, kr, atol=2e-5, rtol=0)
    # float64 angles: the fp32 kernel is within fp32 angle rounding of exact math.
    qd, _ = apply_mrope_reference(q.double(), k.double(), pos, inv.double(), section, interleaved)
    assert (qo.double() - qd).abs().max() < 5e-3 * q.abs().max()

    qb, kb = q.bfloat16().requires_grad_(), k.bfloat16().requires_grad_()
    qbo, kbo = apply_mrope(qb, kb, pos, inv, section, interleaved=interleaved)
    for ours, exact in ((qbo, qr), (kbo, kr)):
        assert ((ours.float() - exact).norm() / exact.norm()) < 1e-2
    gq, gk = torch.randn_like(qbo), torch.randn_like(kbo)
    torch.autograd.backward([qbo, kbo], [gq, gk])
    q32, k32 = q.clone().requires_grad_(), k.clone().requires_grad_()
    torch.autograd.backward(
        list(apply_mrope_reference(q32, k32, pos, inv, section, interleaved)), [gq.float(), gk.float()]
    )
    assert ((qb.grad.float() - q32.grad).norm() / q32.grad.norm()) < 1e-2
    assert ((kb.grad.float() - k32.grad).norm() / k32.grad.norm()) < 1e-2


def test_cuda_int64_offsets_large_tensor():
    """More than 2**31 elements addressed through one tensor (skipped if memory is short)."""
    dev = torch.device("cuda")
    hq, hk, d = 28, 4, 128
    T = (1 << 31) // (hq * d) + 4096  # q alone has > 2**31 elements
    need = T * (hq + hk) * d * 2 * 2  # bf16 in + out
    if torch.cuda.mem_get_info()[0] < need * 1.3:
        pytest.skip("not enough GPU memory for a > 2**31-element tensor")
    pos = torch.arange(T, device=dev).expand(3, -1)
    q = torch.ones(T, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.ones(T, hk, d, device=dev, dtype=torch.bfloat16)
    inv = _inv_freq(d, 1e6, dev)
    qo, _ = apply_mrope(q, k, pos, inv, [16, 24, 24])
    tail = slice(T - 8, T)
    qr, _ = apply_mrope_reference(q[tail], k[tail], pos[:, tail], inv, [16, 24, 24])
    torch.testing.assert_close(qo[tail], qr, atol=1e-2, rtol=0)
