"""A tiny random InternVL config (Qwen2 text, 32-px tiles, 4 tokens per tile). transformers is
imported when the config is built."""

from __future__ import annotations

IMG = 120
SIDE = 32  # tile side; patch 8 -> 4 x 4 features, pixel shuffle 0.5 -> 4 tokens per tile


# Per language model type, what its tiny text config needs beyond the shared sizes (experts).
TEXT_EXTRA: dict[str, dict] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
}


def tiny_config(attn: str = "sdpa", text_model: str = "qwen2"):
    """``text_model``: the language model's ``model_type`` (InternVL3 ships Qwen2, InternVL3.5
    Qwen3, whose attention normalises every q / k head before the rotary, or Qwen3-MoE)."""
    from transformers import InternVLConfig

    return InternVLConfig(
        text_config=dict(model_type=text_model, vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, **TEXT_EXTRA.get(text_model, {})),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=[SIDE, SIDE], patch_size=[8, 8]),
        image_token_id=IMG, image_seq_length=4, attn_implementation=attn)
