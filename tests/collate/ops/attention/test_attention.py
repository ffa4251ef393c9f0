"""varlen_attention (CPU / per-segment SDPA) against full attention with a block-diagonal mask."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from collate import varlen_attention
from collate.ops.attention import segment_ends
from tests.helpers.attention import _batch, _Exploding, _qkv, masked_full_attention


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2), (6, 1)])
def test_matches_masked_full_attention(causal, hq, hk):
    seq_lens = [5, 1, 17, 9, 3]
    q, k, v = _qkv(sum(seq_lens), hq, hk, 16)
    out = varlen_attention(q, k, v, _batch(seq_lens), causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = masked_full_attention(q, k, v, seq_lens, causal=causal)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_scale_and_single_segment_equals_sdpa():
    q, k, v = _qkv(12, 2, 2, 8)
    out = varlen_attention(q, k, v, _batch([12]), scale=0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=0.3
    ).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    ref2 = masked_full_attention(q, k, v, [12], scale=0.3)
    torch.testing.assert_close(out.double(), ref2, atol=1e-5, rtol=1e-5)


def test_gradients_match_masked_full_attention():
    seq_lens = [4, 7, 2]
    q0, k0, v0 = _qkv(sum(seq_lens), 4, 2, 8, dtype=torch.float64)
    g = torch.randn(q0.shape, dtype=torch.float64)
    q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
    (varlen_attention(q, k, v, _batch(seq_lens)) * g).sum().backward()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q0, k0, v0))
    (masked_full_attention(qr, kr, vr, seq_lens) * g).sum().backward()
    for a, b in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=1e-8)


def test_bf16_close():
    seq_lens = [20, 11]
    q, k, v = _qkv(31, 4, 2, 32, dtype=torch.bfloat16)
    out = varlen_attention(q, k, v, _batch(seq_lens))
    assert out.dtype == torch.bfloat16
    ref = masked_full_attention(q, k, v, seq_lens)
    assert ((out.double() - ref).norm() / ref.norm()) < 1e-2


@dataclasses.dataclass
class _PackedLike:
    cu_seqlens: torch.Tensor
    cu_seqlens_list: list[int]
    max_seqlen: int


def test_batch_forms_and_host_list_only():
    seq_lens = [3, 6, 2]
    q, k, v = _qkv(11, 2, 1, 8)
    ref = varlen_attention(q, k, v, _batch(seq_lens))
    ends = segment_ends(seq_lens)
    obj = _PackedLike(torch.tensor([0, *ends], dtype=torch.int32), ends, 6)
    assert torch.equal(varlen_attention(q, k, v, obj), ref)
    # Only the host list is used on CPU.
    assert torch.equal(varlen_attention(q, k, v, {"cu_seqlens": _Exploding(), "cu_seqlens_list": ends}), ref)
    # seq_lens, or a host cu_seqlens tensor, stand in for a missing list.
    assert torch.equal(varlen_attention(q, k, v, {"seq_lens": seq_lens}), ref)
    assert torch.equal(varlen_attention(q, k, v, {"cu_seqlens": obj.cu_seqlens}), ref)


def test_empty_segment_is_skipped():
    q, k, v = _qkv(7, 2, 2, 8)
    out = varlen_attention(q, k, v, {"cu_seqlens_list": [3, 3, 7]})
    torch.testing.assert_close(out, varlen_attention(q, k, v, _batch([3, 4])))


def test_bad_inputs_raise(monkeypatch):
    q, k, v = _qkv(8, 4, 2, 8)
    with pytest.raises(ValueError, match="ends at 7"):
        varlen_attention(q, k, v, {"cu_seqlens_list": [3, 7]})
    with pytest.raises(ValueError, match="start with 0"):
        varlen_attention(q, k, v, {"cu_seqlens_list": [0, 3, 8]})
    with pytest.raises(ValueError, match="cu_seqlens_list"):
        varlen_attention(q, k, v, {"max_seqlen": 8})
    # a negative length (ends going back) re-covered or merged segments without a word: [10, -2]
    # attended over all 8 tokens as one sample, [5, -2, 5] returned 10 rows for 8 tokens
    for bad in ({"seq_lens": [5, -2, 5]}, {"cu_seqlens_list": [5, 3, 8]}, {"seq_lens": [10, -2]}):
        with pytest.raises(ValueError, match=r"segment 1 has length -2"):
            varlen_attention(q, k, v, bad)
    with pytest.raises(ValueError, match="multiple"):
        varlen_attention(q[:, :3].contiguous(), k, v, _batch([8]))
    monkeypatch.setenv("TOKENBAL_ATTN_IMPL", "npu")
    if importlib.util.find_spec("torch_npu") is None:
        with pytest.raises(ImportError, match="torch_npu"):
            varlen_attention(q, k, v, _batch([8]))
    monkeypatch.setenv("TOKENBAL_ATTN_IMPL", "bogus")
    with pytest.raises(ValueError, match="TOKENBAL_ATTN_IMPL"):
        varlen_attention(q, k, v, _batch([8]))
    monkeypatch.setenv("TOKENBAL_ATTN_IMPL", "flash_attn")
    with pytest.raises(ValueError, match="python int"):
        varlen_attention(q, k, v, {**_batch([8]), "max_seqlen": torch.tensor(8)})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-3, 4), min_size=1, max_size=6))
def test_segment_lengths_must_not_be_negative(seq_lens):
    """Any negative length raises naming the first such segment (even when the ends still total
    the token count); non-negative lengths attend segment by segment, empty ones skipped."""
    total = sum(seq_lens)
    q, k, v = _qkv(max(total, 1), 2, 1, 8)
    q, k, v = q[:total], k[:total], v[:total]
    negative = [i for i, n in enumerate(seq_lens) if n < 0]
    if total <= 0 or seq_lens[0] == 0:
        return  # no tokens, or a first end of 0 (refused as cu_seqlens' own leading 0)
    if negative:
        with pytest.raises(ValueError, match=rf"segment {negative[0]} has length {seq_lens[negative[0]]}"):
            varlen_attention(q, k, v, {"seq_lens": seq_lens})
        return
    out = varlen_attention(q, k, v, {"seq_lens": seq_lens})
    want = varlen_attention(q, k, v, {"seq_lens": [n for n in seq_lens if n]})
    assert torch.equal(out, want)


def test_cuda_dispatch_choice_without_a_gpu(monkeypatch):
    """Backend choice is pure host logic: check it with the probes stubbed (no CUDA needed)."""
    import sys

    import collate.ops.attention.flash as fl
    from collate.ops.attention.dispatch import _select

    cuda = torch.device("cuda")
    monkeypatch.setattr(fl, "flash_attn_varlen_fn", lambda: object())
    assert _select(cuda, torch.bfloat16) == "flash_attn"
    assert _select(cuda, torch.float32) == "sdpa"  # the CUDA kernels are half precision only
    monkeypatch.setattr(fl, "flash_attn_varlen_fn", lambda: None)
    monkeypatch.setattr(fl, "torch_varlen_attn_fn", lambda: object())
    assert _select(cuda, torch.float16) == "torch_varlen"
    monkeypatch.setattr(fl, "torch_varlen_attn_fn", lambda: None)
    assert _select(cuda, torch.float16) == "sdpa"
    assert _select(torch.device("cpu"), torch.bfloat16) == "sdpa"
    monkeypatch.setenv("TOKENBAL_ATTN_IMPL", "sdpa")
    monkeypatch.setattr(fl, "flash_attn_varlen_fn", lambda: object())
    assert _select(cuda, torch.bfloat16) == "sdpa"
    monkeypatch.undo()
    # A missing or broken flash-attn install is probed lazily and reported as absent.
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    fl.flash_attn_varlen_fn.cache_clear()
    try:
        assert fl.flash_attn_varlen_fn() is None
    finally:
        fl.flash_attn_varlen_fn.cache_clear()
