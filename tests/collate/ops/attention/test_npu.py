"""varlen_attention's NPU backend through a stand-in ``torch_npu.npu_fusion_attention``.

No Ascend hardware here. The stand-in implements the op's documented contract (Ascend/op-plugin docs,
../shared/research/mrope-kernels.md §5) and checks the arguments the way the docs state them:
``input_layout="TND"`` with q ``(T, N1, D)``, k/v ``(T, N2, D)``, ``N1 % N2 == 0``, ``head_num == N1``;
``actual_seq_qlen`` / ``actual_seq_kvlen`` are *host int lists* of cumulative segment ends without a
leading 0; ``sparse_mode=3`` (right-down causal per segment) needs the 2048x2048 upper-triangular bool
mask (True = masked out); ``sparse_mode=0`` with no mask is full attention; ``scale`` multiplies QK^T;
the first element of the returned tuple is the output. So the test checks our plumbing and the
numbers against the CPU SDPA path, not the NPU kernel.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from collate import varlen_attention
from collate.ops.attention import npu as attention_npu
from tests.helpers.attention import _batch, _Exploding, _qkv, masked_full_attention


class FakeTorchNpu(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.calls: list[dict] = []

    def npu_fusion_attention(
        self, query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
        scale=1.0, keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
        prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
        sync=False,
    ):  # fmt: skip
        assert input_layout == "TND"
        assert query.dim() == 3 and key.dim() == 3 and value.shape == key.shape
        assert head_num == query.shape[1] and query.shape[1] % key.shape[1] == 0
        for seq in (actual_seq_qlen, actual_seq_kvlen):
            assert isinstance(seq, list) and all(type(e) is int for e in seq), "host int list"
            assert seq[0] > 0 and all(b > a for a, b in zip(seq, seq[1:], strict=False))
            assert seq[-1] == query.shape[0]
        assert keep_prob == 1.0 and pse is None and padding_mask is None
        if sparse_mode == 3:
            assert atten_mask is not None and atten_mask.dtype == torch.bool
            assert atten_mask.shape == (2048, 2048)
            assert torch.equal(atten_mask.cpu(), torch.ones(2048, 2048, dtype=torch.bool).triu(1))
        else:
            assert sparse_mode == 0 and atten_mask is None
        self.calls.append({"qlen": list(actual_seq_qlen), "sparse_mode": sparse_mode, "scale": scale})
        rep = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(rep, dim=1)
        v = value.repeat_interleave(rep, dim=1)
        outs, q_start, kv_start = [], 0, 0
        for q_end, kv_end in zip(actual_seq_qlen, actual_seq_kvlen, strict=True):
            q_seg, k_seg, v_seg = query[q_start:q_end], k[kv_start:kv_end], v[kv_start:kv_end]
            scores = torch.einsum("thd,shd->hts", q_seg, k_seg) * scale
            if sparse_mode == 3:  # right-down causal: query i sees key j <= i + (Skv - Sq)
                sq, skv = q_end - q_start, kv_end - kv_start
                i = torch.arange(sq)[:, None]
                j = torch.arange(skv)[None, :]
                scores = scores.masked_fill(j > i + (skv - sq), float("-inf"))
            outs.append(torch.einsum("hts,shd->thd", scores.softmax(-1), v_seg))
            q_start, kv_start = q_end, kv_end
        out = torch.cat(outs, dim=0)
        return out, None, None, None, 0, 0, 0


@pytest.fixture
def fake_npu(monkeypatch):
    fake = FakeTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.setenv("TOKENBAL_ATTN_IMPL", "npu")
    return fake


def _sdpa(q, k, v, batch, **kw):
    """The CPU per-segment SDPA path (the backend the NPU result must agree with)."""
    from collate.ops.attention.sdpa import varlen_attention_sdpa
    from collate.ops.attention.segments import host_boundaries as _host_boundaries

    return varlen_attention_sdpa(q, k, v, _host_boundaries(batch, q.shape[0]), **kw)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2), (6, 1)])
def test_matches_sdpa_path(fake_npu, causal, hq, hk):
    seq_lens = [5, 1, 17, 9, 3]
    q, k, v = _qkv(sum(seq_lens), hq, hk, 16)
    batch = _batch(seq_lens)
    out = varlen_attention(q, k, v, batch, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, _sdpa(q, k, v, batch, causal=causal), atol=1e-5, rtol=1e-5)
    ref = masked_full_attention(q, k, v, seq_lens, causal=causal)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    call = fake_npu.calls[-1]
    assert call["qlen"] == [5, 6, 23, 32, 35]
    assert call["sparse_mode"] == (3 if causal else 0)
    assert call["scale"] == pytest.approx(16**-0.5)


def test_host_list_only_scale_and_empty_segments(fake_npu):
    q, k, v = _qkv(11, 2, 1, 8)
    ends = [3, 3, 9, 11]  # a zero-length segment
    out = varlen_attention(q, k, v, {"cu_seqlens": _Exploding(), "cu_seqlens_list": ends}, scale=0.3)
    assert fake_npu.calls[-1]["qlen"] == [3, 9, 11] and fake_npu.calls[-1]["scale"] == 0.3
    ref = _sdpa(q, k, v, {"cu_seqlens_list": ends}, scale=0.3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # seq_lens stands in for the list, as on the other paths.
    out2 = varlen_attention(q, k, v, {"seq_lens": [3, 6, 2]}, scale=0.3)
    torch.testing.assert_close(out2, ref, atol=1e-5, rtol=1e-5)


def test_gradients_match_sdpa_path(fake_npu):
    seq_lens = [4, 7, 2]
    q0, k0, v0 = _qkv(sum(seq_lens), 4, 2, 8, dtype=torch.float64)
    g = torch.randn(q0.shape, dtype=torch.float64)
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    (varlen_attention(q, k, v, _batch(seq_lens)) * g).sum().backward()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q0, k0, v0))
    (_sdpa(qr, kr, vr, _batch(seq_lens)) * g).sum().backward()
    for a, b in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=1e-8)


def test_mask_is_built_once_per_device(fake_npu):
    attention_npu._masks.clear()
    q, k, v = _qkv(6, 2, 2, 8)
    varlen_attention(q, k, v, _batch([2, 4]))
    first = attention_npu._masks[q.device]
    varlen_attention(q, k, v, _batch([6]))
    assert attention_npu._masks[q.device] is first and len(attention_npu._masks) == 1
