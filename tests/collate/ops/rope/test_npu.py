"""The torch_npu M-RoPE backend, through a stand-in ``torch_npu`` module, against the reference.

No Ascend hardware here. The stand-in implements the *documented* math of the two ops we call
(Ascend/op-plugin docs, see ../shared/research/mrope-kernels.md §5), including their argument checks:

- ``npu_rotary_mul(x, r1, r2, rotary_mode="half")``: 4-D ``x`` (BSND here), r1/r2 broadcastable
  ``1S1D`` in x's dtype; ``out = x * r1 + rotate_half(x) * r2``; differentiable.
- ``npu_mrope(positions, query (T, Nq*hd), key (T, Nk*hd), cos_sin_cache (max_pos, R), head_size,
  mrope_section, rotary_mode, cache_mode)``: gathers ``cos | sin`` rows per position, merges sections
  (``default`` = chunked; ``interleave`` bounds both H and W by ``3 * s_h`` as the op's golden test
  does), rotates the first R dims of each head; out of place.

So these tests check our plumbing (shapes, layouts, dtypes, section handling) and the numbers
against the reference, not the NPU kernels themselves.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from collate import apply_mrope
from collate.ops.rope import dispatch as rope_dispatch
from collate.ops.rope import npu as rope_npu
from collate.ops.rope.reference import apply_mrope_reference
from tests.helpers.rope import _inv_freq, _qk, _sample_positions, hf_mrope


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_interleave(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class FakeTorchNpu(types.ModuleType):
    """Documented math of torch_npu.npu_rotary_mul / npu_mrope, with their documented input checks."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.calls: list[tuple[str, dict]] = []

    def npu_rotary_mul(self, x, r1, r2, rotary_mode="half", rotate=None):
        assert x.dim() == 4, "npu_rotary_mul takes 4-D BNSD/BSND/SBND tensors"
        assert r1.dim() == 4 and r2.shape == r1.shape
        assert r1.dtype == x.dtype and r2.dtype == x.dtype, "r1/r2 must have x's dtype"
        assert x.shape[-1] % 2 == 0 and x.shape[-1] < 896
        torch.broadcast_shapes(x.shape, r1.shape)
        assert rotary_mode in ("half", "interleave")
        self.calls.append(
            ("npu_rotary_mul", {"x": tuple(x.shape), "r": tuple(r1.shape), "mode": rotary_mode})
        )
        rot = _rotate_half(x) if rotary_mode == "half" else _rotate_interleave(x)
        return x * r1 + rot * r2

    def npu_mrope(
        self, positions, query, key, cos_sin_cache, head_size, *, mrope_section=None, rotary_mode="half",
        cache_mode="default",
    ):  # fmt: skip
        assert rotary_mode in ("half", "interleave"), "checked in C++: exactly 'half' or 'interleave'"
        assert cache_mode in ("default", "interleave")
        assert query.dim() == 2 and key.dim() == 2 and query.shape[0] == key.shape[0]
        assert query.shape[1] % head_size == 0 and key.shape[1] % head_size == 0
        assert positions.dtype in (torch.int32, torch.int64)
        assert not torch.is_floating_point(positions)
        rotary = cos_sin_cache.shape[1]
        half = rotary // 2
        num_tokens = query.shape[0]
        self.calls.append(("npu_mrope", {"section": list(mrope_section or []), "cache_mode": cache_mode}))
        if positions.dim() == 1:
            pos_j = positions[:, None].expand(num_tokens, half)
        else:
            assert positions.shape[0] == 3 and positions.shape[1] == num_tokens
            s_t, s_h, s_w = mrope_section
            assert s_t + s_h + s_w == half
            axis = []
            for j in range(half):
                if cache_mode == "interleave":
                    axis.append(1 if j % 3 == 1 and j < 3 * s_h else 2 if j % 3 == 2 and j < 3 * s_h else 0)
                else:
                    axis.append(0 if j < s_t else 1 if j < s_t + s_h else 2)
            pos_j = positions.long()[torch.tensor(axis)].t()  # (T, R/2)
        rows = cos_sin_cache[pos_j.long()]  # (T, R/2, R)
        j = torch.arange(half)
        cos = rows[:, j, j]
        sin = rows[:, j, half + j]
        cos = torch.cat((cos, cos), dim=-1)[:, None, :]
        sin = torch.cat((sin, sin), dim=-1)[:, None, :]
        outs = []
        for x in (query, key):
            xh = x.view(num_tokens, -1, head_size)
            xr = xh[..., :rotary]
            rot = _rotate_half(xr) if rotary_mode == "half" else _rotate_interleave(xr)
            y = torch.cat((xr * cos + rot * sin, xh[..., rotary:]), dim=-1)
            outs.append(y.reshape(num_tokens, -1))
        return outs[0], outs[1]


@pytest.fixture
def fake_npu(monkeypatch):
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.delenv(rope_npu.MROPE_MAX_POS_ENV, raising=False)
    rope_npu._cache.clear()
    return fake


def _positions() -> torch.Tensor:
    return torch.cat([_sample_positions(4, (2, 3, 4), 5), torch.arange(7).expand(3, -1) + 3], dim=1)


CASES = [
    (128, 128, [16, 24, 24], False),
    (128, 128, [24, 20, 20], True),
    (48, 32, [6, 5, 5], True),  # partial rotary, s_h != s_w
    (64, 48, [4, 10, 10], False),
]


@pytest.mark.parametrize("d,r,section,interleaved", CASES)
def test_rotary_mul_path_matches_reference(fake_npu, d, r, section, interleaved):
    pos = _positions()
    T = pos.shape[1]
    q, k = _qk(T, 4, 2, d)
    inv = _inv_freq(r)
    qo, ko = rope_npu.apply_mrope_npu(q, k, pos, inv, section, interleaved, 0.9)
    qr, kr = apply_mrope_reference(q, k, pos, inv, section, interleaved, 0.9)
    torch.testing.assert_close(qo, qr, atol=2e-5, rtol=0)
    torch.testing.assert_close(ko, kr, atol=2e-5, rtol=0)
    # One call per tensor, on (1, T, N, R) BSND views with (1, T, 1, R) cos/sin, "half" mode.
    assert [c[0] for c in fake_npu.calls] == ["npu_rotary_mul", "npu_rotary_mul"]
    assert fake_npu.calls[0][1] == {"x": (1, T, 4, r), "r": (1, T, 1, r), "mode": "half"}
    assert fake_npu.calls[1][1]["x"] == (1, T, 2, r)


def test_rotary_mul_path_bf16_and_gradients(fake_npu):
    pos = _positions()
    q0, k0 = _qk(pos.shape[1], 4, 2, 64)
    inv = _inv_freq(64)
    qb, kb = rope_npu.apply_mrope_npu(q0.bfloat16(), k0.bfloat16(), pos, inv, [8, 12, 12])
    assert qb.dtype == torch.bfloat16
    qh, _ = hf_mrope(q0.bfloat16(), k0.bfloat16(), pos, inv, [8, 12, 12])  # HF: bf16 cos/sin, like the op
    q_exact, _ = apply_mrope_reference(q0, k0, pos, inv, [8, 12, 12])
    assert (qb.float() - q_exact).norm() / q_exact.norm() < 1e-2
    torch.testing.assert_close(qb, qh, atol=0, rtol=0)  # same rounding of cos/sin as transformers
    gq, gk = _qk(pos.shape[1], 4, 2, 64, seed=5)
    grads = []
    for fn in (rope_npu.apply_mrope_npu, apply_mrope_reference):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        torch.autograd.backward(list(fn(q, k, pos, inv, [8, 12, 12])), [gq, gk])
        grads.append((q.grad, k.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=2e-5, rtol=0)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=2e-5, rtol=0)


def test_dispatch_and_inplace(fake_npu, monkeypatch):
    pos = _positions()
    q, k = _qk(pos.shape[1], 2, 2, 32)
    inv = _inv_freq(32)
    monkeypatch.setenv(rope_dispatch.IMPL_ENV, "npu")
    assert rope_dispatch._select_backend(q.device) is rope_npu.apply_mrope_npu
    qr, kr = apply_mrope_reference(q, k, pos, inv, [4, 6, 6])
    qc, kc = q.clone(), k.clone()
    qo, ko = apply_mrope(qc, kc, pos, inv, [4, 6, 6], inplace=True)
    assert qo is qc and ko is kc
    torch.testing.assert_close(qc, qr, atol=2e-5, rtol=0)
    torch.testing.assert_close(kc, kr, atol=2e-5, rtol=0)
    assert fake_npu.calls and fake_npu.calls[0][0] == "npu_rotary_mul"


@pytest.mark.parametrize(
    "d,section,interleaved,dtype",
    [
        (128, [16, 24, 24], False, torch.float32),
        (128, [24, 20, 20], True, torch.float32),
        (64, [8, 12, 12], False, torch.bfloat16),
    ],
)
def test_npu_mrope_inference_path(fake_npu, monkeypatch, d, section, interleaved, dtype):
    monkeypatch.setenv(rope_npu.MROPE_MAX_POS_ENV, "4096")
    pos = _positions()
    q32, k32 = _qk(pos.shape[1], 4, 2, d)
    q, k = q32.to(dtype), k32.to(dtype)
    inv = _inv_freq(d)
    with torch.no_grad():
        qo, ko = rope_npu.apply_mrope_npu(q, k, pos, inv, section, interleaved)
        qo1, _ = rope_npu.apply_mrope_npu(q, k, pos[0], inv, section, interleaved)  # 1-D positions
    assert [c[0] for c in fake_npu.calls] == ["npu_mrope", "npu_mrope"]
    assert fake_npu.calls[0][1] == {
        "section": section,
        "cache_mode": "interleave" if interleaved else "default",
    }
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == dtype
    qr, kr = hf_mrope(q, k, pos, inv, section, interleaved)  # the op rounds its cache to x.dtype, as HF does
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(qo, qr, atol=tol, rtol=0)
    torch.testing.assert_close(ko, kr, atol=tol, rtol=0)
    q1r, _ = hf_mrope(q, k, pos[0].expand(3, -1), inv, section, interleaved)
    torch.testing.assert_close(qo1, q1r, atol=tol, rtol=0)


def test_npu_mrope_cache_follows_a_new_inv_freq_at_a_freed_address(fake_npu, monkeypatch):
    """The cos/sin cache is keyed by ``inv_freq``'s address and version. A new ``inv_freq`` (another
    model's rotary, a rebuilt buffer) may be allocated where a freed one was, at version 0 too;
    it must get its own cos/sin, not the freed tensor's (it once did: a silently wrong rotation)."""
    monkeypatch.setenv(rope_npu.MROPE_MAX_POS_ENV, "4096")
    pos = _positions()
    q, k = _qk(pos.shape[1], 4, 2, 128)
    # A caching allocator hands a freed block to the next tensor of its size: modelled with one
    # host buffer that two tensors wrap in turn (the same address, each at version 0).
    block = _inv_freq(128).numpy()
    first = torch.from_numpy(block)
    with torch.no_grad():
        rope_npu.apply_mrope_npu(q, k, pos, first, [16, 24, 24])
    del first
    block[:] = _inv_freq(128, theta=1e6).numpy()
    second = torch.from_numpy(block)
    assert second._version == 0
    with torch.no_grad():
        got, _ = rope_npu.apply_mrope_npu(q, k, pos, second, [16, 24, 24])
    want, _ = hf_mrope(q, k, pos, second, [16, 24, 24])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


def test_npu_mrope_not_used_when_ineligible(fake_npu, monkeypatch):
    monkeypatch.setenv(rope_npu.MROPE_MAX_POS_ENV, "4096")
    pos = _positions()
    inv = _inv_freq(128)
    q, k = _qk(pos.shape[1], 4, 2, 128)
    # Gradients needed -> the training path.
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    rope_npu.apply_mrope_npu(qg, kg, pos, inv, [16, 24, 24])
    # A section the op docs do not list, and an interleaved one with s_h != s_w.
    with torch.no_grad():
        rope_npu.apply_mrope_npu(q, k, pos, inv, [32, 16, 16])
        out = rope_npu.apply_mrope_npu(q, k, pos, _inv_freq(32), [6, 5, 5], True)
    assert {c[0] for c in fake_npu.calls} == {"npu_rotary_mul"}
    qr, _ = apply_mrope_reference(q, k, pos, _inv_freq(32), [6, 5, 5], True)
    torch.testing.assert_close(out[0], qr, atol=2e-5, rtol=0)
    # Misaligned head dim for bf16 (needs multiples of 32).
    fake_npu.calls.clear()
    q16, k16 = _qk(pos.shape[1], 2, 2, 48, dtype=torch.bfloat16)
    with torch.no_grad():
        rope_npu.apply_mrope_npu(q16, k16, pos, _inv_freq(48), [8, 8, 8])
    assert {c[0] for c in fake_npu.calls} == {"npu_rotary_mul"}


def test_torch_npu_is_imported_lazily():
    # Importing the backend module must not import torch_npu (it is absent here).
    assert "torch_npu" not in sys.modules or isinstance(sys.modules["torch_npu"], FakeTorchNpu)
    q, k = _qk(3, 1, 1, 8)
    with pytest.raises(ModuleNotFoundError, match="torch_npu"):
        rope_npu.apply_mrope_npu(q, k, torch.arange(3), _inv_freq(8), [2, 1, 1])
