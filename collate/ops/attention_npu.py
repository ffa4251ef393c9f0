"""Varlen attention on Ascend NPUs (placeholder).

The planned kernel is ``torch_npu.npu_fusion_attention(..., input_layout="TND",
actual_seq_qlen=cu_seqlens_list, actual_seq_kvlen=cu_seqlens_list, sparse_mode=3)`` fed from the
batch's *host* list (transformers' shim calls ``.cpu()`` on the device tensor: a host sync per layer).
Until it is written and checked on hardware this raises, rather than silently running a slow path.
"""

from __future__ import annotations

import torch


def varlen_attention_npu(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    raise NotImplementedError(
        "varlen_attention has no NPU kernel yet (npu_fusion_attention TND is planned). "
        "Set TOKENBAL_ATTN_IMPL=sdpa to run the per-segment SDPA fallback on the NPU meanwhile."
    )
