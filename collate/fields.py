"""The packed batch's field names, grouped by who consumes them: the one place they are spelled.

:class:`collate.PackedBatch` and :class:`collate.sp.SPBatch` declare the fields (types and
meaning); this module says which of them transformers takes as its own inputs and which the packed
model wrapper (:mod:`collate.models.core`) takes out of a call before transformers sees it.
``tests/collate/test_fields.py`` checks every name here against those dataclasses.
"""

from __future__ import annotations

# transformers' own vision inputs, passed through to the model unchanged (images, then videos).
TOWER_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")

# The whole row's segments: what varlen attention and the loss need.
SEGMENTS = ("cu_seqlens", "cu_seqlens_list", "max_seqlen", "seq_lens")

# The collator's precomputed vision-tower inputs (collate.vision) and feature slots.
VISION_PLAN = (
    "vision_cu_seqlens",
    "vision_cu_seqlens_list",
    "vision_max_seqlen",
    "vision_position_ids",
    "vision_token_index",
    "vision_window_index",
    "vision_cu_window_seqlens",
    "vision_cu_window_seqlens_list",
    "vision_max_window_seqlen",
)

# What an SP slice adds to a packed batch for the wrapper (collate.sp.shard_batch);
# ``shift_labels`` is not here: it goes on to transformers' loss.
SP_ROUTING = ("sp_rank", "sp_size", "vision_sp_send_index", "vision_sp_send_counts", "vision_sp_recv_counts")

# Batch keys the wrapper takes out of a packed call (never passed into transformers). ``position_ids``
# is also taken, and handed back to HF as the packed ids. ``second_per_grid_ts`` only feeds HF's own
# position computation (Qwen2.5-VL), which the precomputed positions replace; ``sp_padding`` marks
# the SP padding segment.
CONSUMED_BY_WRAPPER = (
    *SEGMENTS,
    "text_position_ids",
    "num_loss_tokens",
    "second_per_grid_ts",
    *VISION_PLAN,
    *SP_ROUTING,
    "sp_padding",
)
