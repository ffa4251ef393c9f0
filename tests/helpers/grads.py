"""Gradient comparison of a packed model against its transformers reference."""

from __future__ import annotations

import torch


def assert_grads_match(packed, reference) -> int:
    """Every gradient equals the reference's (relative 1e-5 of its largest entry); returns how many
    were compared. A parameter the reference gives no gradient must get none (or zeros) here too.
    FSDP2's sharded gradients are compared whole. Vision-tower key biases of the LLaVA / InternVL
    towers (``vision_tower...self_attn.k_proj.bias``) get none: attention is invariant to a bias
    added to every key, so theirs are rounding noise on both sides (checked to be negligible)."""
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    scale = max(float(g.abs().max()) for g in ref_grads.values() if g is not None)
    checked = 0
    for name, p in packed.named_parameters():
        g_ref = ref_grads[name]
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if g_ref is None:  # e.g. tower layers after vision_feature_layer: unused by HF as well
            assert got is None or not got.any(), name
            continue
        if name.endswith("self_attn.k_proj.bias") and "vision_tower" in name:
            assert float(got.abs().max()) < 1e-6 * scale and float(g_ref.abs().max()) < 1e-6 * scale, name
            continue
        torch.testing.assert_close(got, g_ref, rtol=1e-5, atol=1e-5 * float(g_ref.abs().max()))
        checked += 1
    return checked
