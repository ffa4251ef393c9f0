"""The segments of a packed batch, as ``varlen_attention`` and its backends read them.

A packed batch names its samples' boundaries three ways: ``cu_seqlens_list`` (host list of segment
ends without the leading 0), ``seq_lens`` (host lengths) and ``cu_seqlens`` (int32 tensor with the
leading 0, on the device). The host forms serve the SDPA loop and the NPU op; the device form serves
the CUDA kernels. Nothing here reads a device tensor back to the host. The dispatcher (dispatch.py)
and the backends (sdpa.py, flash.py, npu.py) import this file; it imports none of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["batch_field", "check_segment_ends", "host_boundaries", "segment_ends"]


def batch_field(batch: Any, name: str) -> Any:
    """``batch.name`` or ``batch[name]`` (dicts, dataclasses, mapping-like objects); None if absent."""
    value = getattr(batch, name, None)
    if value is not None:
        return value
    try:
        return batch[name]
    except (KeyError, TypeError, IndexError):
        return None


def host_boundaries(batch: Any, num_tokens: int) -> list[int]:
    """Segment ends of ``batch`` (no leading 0) as host ints, checked to end at ``num_tokens``."""
    ends = batch_field(batch, "cu_seqlens_list")
    if ends is None:
        seq_lens = batch_field(batch, "seq_lens")
        cu = batch_field(batch, "cu_seqlens")
        if seq_lens is not None:
            ends = segment_ends(seq_lens)
        elif isinstance(cu, torch.Tensor) and cu.device.type == "cpu":
            ends = cu[1:].tolist()  # already on the host: no device sync
        else:
            raise ValueError(
                "varlen_attention needs the host list batch['cu_seqlens_list'] (segment ends, no leading 0) "
                "or batch['seq_lens']; it never reads cu_seqlens back from the device"
            )
    ends = [int(e) for e in ends]
    if ends and ends[0] == 0:
        raise ValueError(f"cu_seqlens_list must not start with 0 (ends only), got {ends[:4]}...")
    check_segment_ends(ends, "cu_seqlens_list / seq_lens")
    if not ends or ends[-1] != num_tokens:
        last = ends[-1] if ends else None
        raise ValueError(f"cu_seqlens_list ends at {last} but q has {num_tokens} tokens")
    return ends


def check_segment_ends(ends: Sequence[int], field: str) -> None:
    """Raise unless the cumulative ``ends`` never go back (every segment length >= 0; an empty
    segment is allowed and skipped). A negative length would re-cover or merge segments without
    an error: ``[10, -2]`` over 8 tokens is one 8-token segment."""
    previous = 0
    for i, end in enumerate(ends):
        if end < previous:
            raise ValueError(f"{field}: segment {i} has length {end - previous} (ends {previous} -> {end}); "
                             "lengths must be >= 0")
        previous = end


def segment_ends(seq_lens: Sequence[int]) -> list[int]:
    """Cumulative segment ends (no leading 0) for a list of lengths: the ``cu_seqlens_list`` format."""
    ends, total = [], 0
    for n in seq_lens:
        total += int(n)
        ends.append(total)
    return ends
