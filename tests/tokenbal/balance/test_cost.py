import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbal.balance.cost import FlopsModel, resolve_costs, to_int_costs
from tokenbal.balance.plan import plan_epoch
from tokenbal.balance.simulate import step_balance
from tokenbal.hf_compat import rope_config


def test_tokens_is_the_default_and_returns_the_lengths():
    lens = np.array([5, 0, 300])
    assert resolve_costs(lens).tolist() == [5, 0, 300]
    assert resolve_costs(lens, "tokens").tolist() == [5, 0, 300]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 40_000), min_size=1, max_size=50))
def test_flops_are_token_equivalents_with_an_attention_surcharge(lengths):
    m = FlopsModel.qwen2_vl_7b()
    c = m.token_equivalents(np.array(lengths))
    lens = np.array(lengths)
    assert c.dtype == np.int64 and (c >= lens).all() and ((c == 0) == (lens == 0)).all()
    # the surcharge is the causal-attention term 2·h·s² per layer over one token's linear FLOPs
    expect = lens + 2 * m.hidden_size * m.num_layers * lens.astype(float) ** 2 / m.token_flops()
    assert np.all(np.abs(c - expect) <= 1)


def test_flops_make_one_long_sample_cost_more_than_many_short_ones():
    m = FlopsModel.qwen2_vl_7b()
    one, eight = m.token_equivalents(np.array([16_384, 2_048]))
    assert one > 8 * eight                        # tokens alone would call them equal
    # the vision term adds ViT work on the sample's patches
    with_vis = m.token_equivalents(np.array([2_048]), np.array([1_000]))
    assert with_vis[0] > eight


def test_from_a_transformers_config():
    from transformers import Qwen2VLConfig

    cfg = Qwen2VLConfig(text_config=dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                         num_attention_heads=4, num_key_value_heads=2),
                        vision_config=dict(embed_dim=32, depth=2, num_heads=2, spatial_merge_size=2))
    m = FlopsModel.from_config(cfg)
    assert (m.hidden_size, m.num_layers, m.intermediate_size, m.num_heads, m.num_kv_heads) == (
        64, 2, 128, 4, 2)
    assert (m.vision_hidden_size, m.vision_layers, m.vision_intermediate_size, m.merge_size) == (
        32, 2, 128, 2)
    text_only = FlopsModel.from_config(cfg.text_config)
    assert text_only.vision_layers == 0
    assert FlopsModel.from_config({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
                                  ).intermediate_size == 256
    with pytest.raises(ValueError, match="hidden_size"):
        FlopsModel.from_config({"num_hidden_layers": 2})


def test_flops_by_name_uses_the_index_vision_tokens_and_the_config():
    class Index:
        lengths = np.array([1000, 1000])
        vision_tokens = np.array([0, 900])

    c = resolve_costs(Index(), "flops")
    assert c[1] > c[0] > 1000
    small = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    # a narrow model spends relatively more on attention: the surcharge follows the config
    narrow = resolve_costs(np.array([1000]), "flops", config=small)[0]
    assert narrow > resolve_costs(np.array([1000]), "flops")[0] + 500


def test_user_arrays_and_callables():
    lens = np.array([1, 2, 3])
    assert resolve_costs(lens, np.array([3, 2, 1])).tolist() == [3, 2, 1]
    assert resolve_costs(lens, lambda s: s * s).tolist() == [1, 4, 9]
    f = resolve_costs(lens, np.array([0.5, 1e-9, 0.0]))
    assert f.tolist() == [1_000_000, 1, 0], "floats scaled, a positive cost never becomes free"
    with pytest.raises(ValueError, match="one value per sample"):
        resolve_costs(lens, np.array([1, 2]))
    with pytest.raises(ValueError, match="sample 1"):
        to_int_costs(np.array([1.0, -2.0]))
    with pytest.raises(ValueError, match="unknown cost"):
        resolve_costs(lens, "watts")


def test_planner_and_sampler_balance_the_chosen_cost():
    from tokenbal import TokenBalancedBatchSampler

    rng = np.random.default_rng(0)
    lens = np.exp(rng.normal(7, 1, 4000)).astype(np.int64) + 1
    m = FlopsModel.qwen2_vl_7b()
    flops = m.token_equivalents(lens)
    by_flops = plan_epoch(lens, 4, global_batch_size=64, cost=m)
    by_tokens = plan_epoch(lens, 4, global_batch_size=64)
    fb = step_balance(by_flops.step_rank_tokens(flops)).mean()
    assert fb < 1.01
    assert fb < step_balance(by_tokens.step_rank_tokens(flops)).mean()
    s = TokenBalancedBatchSampler(lens, num_replicas=4, rank=0, global_batch_size=64, cost=m)
    assert np.array_equal(s.plan().indices, by_flops.indices)
    assert s.fingerprint()["cost"] == "FlopsModel"
    t = TokenBalancedBatchSampler(lens, num_replicas=4, rank=0, global_batch_size=64)
    with pytest.raises(ValueError, match="cost"):
        s.load_state_dict(t.state_dict())


def test_vision_attention_is_per_image_when_the_image_table_is_given():
    model = FlopsModel(hidden_size=64, num_layers=2, intermediate_size=128, num_heads=4, num_kv_heads=2,
                       vision_hidden_size=32, vision_layers=2, vision_intermediate_size=64)
    lengths = np.array([2 * 100 + 10, 100 + 5, 100 + 5])          # two images in sample 0
    offsets, tokens = np.array([0, 2, 3, 4]), np.array([100, 100, 100, 100])
    per_image = model.flops(lengths, image_tokens=(offsets, tokens))
    one_block = model.flops(lengths, vision_tokens=np.array([200, 100, 100]))
    # Sample 0's images attend separately: cheaper than one 200-token block, and its ViT term is
    # exactly twice that of a one-image sample.
    assert per_image[0] < one_block[0]
    np.testing.assert_allclose(per_image[1:], one_block[1:])
    llm = model.flops(lengths)
    np.testing.assert_allclose(per_image[0] - llm[0], 2 * (per_image[1] - llm[1]))


def test_index_image_table_uses_the_index_estimator(tmp_path):
    from tests.helpers.corpus import Sample, write_shard
    from tokenbal.estimate import get_estimator
    from tokenbal.index import TokenIndex, build_index

    shard = write_shard(tmp_path / "s.tar", [
        Sample("a", images=[("png", 640, 480), ("png", 64, 900)], caption="two"),
        Sample("b", caption="none"), Sample("c", images=[("jpg", 1920, 1080)], caption="one")])
    out = build_index([shard], tmp_path / "idx", estimator_overrides={"max_pixels": 1003520}, progress=False)
    offsets, tokens = TokenIndex.open(out.out).image_tokens_table
    est = get_estimator("qwen2-vl", max_pixels=1003520)
    assert offsets.tolist() == [0, 2, 2, 3]
    assert tokens.tolist() == [est.image_tokens(w, h) for w, h in [(640, 480), (64, 900), (1920, 1080)]]
    costs = resolve_costs(TokenIndex.open(out.out), FlopsModel.qwen2_vl_7b())
    assert costs.shape == (3,) and costs[2] > costs[0] > costs[1]


# -- FlopsModel.from_config against the real model's layers (tiny configs, nothing downloaded) ----

_TINY_TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=64)


def _linear_flops_per_item(layers) -> float:
    """Forward FLOPs of one token (or patch) through the nn.Linear layers of ``layers``: 2 per
    weight; fused MoE experts (3-D weights) count for the routed share ``k / E`` of their weights."""
    import torch

    total = 0.0
    for layer in layers:
        total += sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
        experts = [p for n, p in layer.named_parameters() if "experts" in n and p.dim() == 3]
        if experts:
            moe = layer.mlp
            k, e = moe.gate.top_k, moe.gate.num_experts   # the router: k of e experts per token
            total += sum(p.numel() for p in experts) * k / e
    return 2.0 * total


def _real_model_layers(cfg):
    import torch
    import transformers

    model = transformers.AutoModel.from_config(cfg)
    lists = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)}
    text = next(m for n, m in lists.items() if n in ("layers", "language_model.layers", "text_model.layers"))
    vision = next((m for n, m in lists.items() if n.startswith(("visual.", "vision_"))), None)
    return text, vision


@pytest.mark.parametrize("build", [
    lambda T: T.LlamaConfig(**_TINY_TEXT, head_dim=32),
    lambda T: T.Qwen3VLConfig(text_config=dict(_TINY_TEXT, head_dim=32, **rope_config(
        T.Qwen3VLConfig, 1e4, mrope_section=[6, 5, 5], mrope_interleaved=True)),
                              vision_config=dict(depth=1, hidden_size=32, out_hidden_size=64,
                                                 intermediate_size=48, num_heads=2)),
], ids=["llama-head_dim", "qwen3-vl-head_dim"])
def test_from_config_counts_the_heads_width_when_head_dim_is_set_apart(build):
    import transformers

    cfg = build(transformers)
    text, _ = _real_model_layers(cfg)
    m = FlopsModel.from_config(cfg)
    assert m.token_flops() == pytest.approx(_linear_flops_per_item(text))
    # causal attention: QKᵀ and PV over the q heads' width (half the square), per layer
    q_width = text[0].self_attn.q_proj.out_features
    s = 1000.0
    lang = m.stage_flops(np.array([s]))[0, 1]
    assert lang - s * m.token_flops() == pytest.approx(2.0 * q_width * s * s * len(text))


def _tiny_vlm(name: str):
    import transformers as T

    cls = {"qwen2-vl": T.Qwen2VLConfig, "qwen2.5-vl": T.Qwen2_5_VLConfig, "qwen3-vl": T.Qwen3VLConfig,
           "glm-4.1v": T.Glm4vConfig}[name]
    rope = dict(mrope_section=[2, 3, 3], **({"mrope_interleaved": True} if name == "qwen3-vl" else {}))
    text = dict(_TINY_TEXT, **rope_config(cls, 1e4, **rope))
    vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2)
    if name == "qwen2-vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=3)
    if name == "qwen2.5-vl":
        vision["fullatt_block_indexes"] = [1]
    if name == "qwen3-vl":
        vision["deepstack_visual_indexes"] = [0]
    return cls(text_config=text, vision_config=vision)


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "glm-4.1v"])
def test_from_config_vision_blocks_cost_what_the_real_tower_computes(name):
    """Per patch, the vision blocks' linear layers (Qwen2.5-VL's and GLM-4.1V's MLPs are gated,
    GLM's out_hidden_size wide), plus attention over the image's patches."""
    cfg = _tiny_vlm(name)
    _, blocks = _real_model_layers(cfg)
    m = FlopsModel.from_config(cfg, vision_window=10**9)   # every layer over the whole image
    width = blocks[0].attn.qkv.in_features
    patches = 40 * m.merge_size ** 2
    vit = m.stage_flops(np.array([0]), vision_tokens=np.array([40]))[0, 0]
    expect = _linear_flops_per_item(blocks) * patches + 4.0 * width * patches * patches * len(blocks)
    assert vit == pytest.approx(expect)


def _moe_config(name: str):
    import transformers as T

    if name == "mixtral":
        return T.MixtralConfig(**_TINY_TEXT, num_local_experts=4, num_experts_per_tok=2)
    if name == "qwen3-vl-moe":
        cls = T.Qwen3VLMoeConfig
        text = dict(_TINY_TEXT, num_hidden_layers=3, moe_intermediate_size=24, num_experts=4,
                    num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
                    **rope_config(cls, 1e4, mrope_section=[2, 3, 3], mrope_interleaved=True))
        return cls(text_config=text, vision_config=dict(depth=1, hidden_size=32, out_hidden_size=64,
                                                        intermediate_size=48, num_heads=2))
    if name == "qwen2-moe":
        return T.Qwen2MoeConfig(**dict(_TINY_TEXT, num_hidden_layers=4), moe_intermediate_size=24,
                                shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2,
                                decoder_sparse_step=2)
    if name == "glm-4.5v":
        cls = T.Glm4vMoeConfig
        text = dict(_TINY_TEXT, num_hidden_layers=3, head_dim=32, moe_intermediate_size=24,
                    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                    n_group=1, topk_group=1,
                    **rope_config(cls, 1e4, mrope_section=[4, 6, 6], partial_rotary_factor=0.5))
        return cls(text_config=text, vision_config=dict(depth=1, hidden_size=32, out_hidden_size=64,
                                                        intermediate_size=48, num_heads=2))
    raise KeyError(name)


def _routed_linear_flops(layers, k: int, e: int) -> float:
    """2 x the nn.Linear / fused-expert weights one token goes through: the routed experts count
    k / e of their weights (ModuleList experts on 4.x, 3-D fused weights on 5.x); the router's
    scores (hidden x experts, and Qwen2-MoE's one-wide shared-expert gate) are left out."""
    total = 0.0
    for layer in layers:
        for name, p in layer.named_parameters():
            if p.dim() < 2 or name.endswith((".gate.weight", "router.weight", "shared_expert_gate.weight")):
                continue   # norms, biases, routers
            total += p.numel() * (k / e if ".experts." in name else 1)
    return 2.0 * total


@pytest.mark.parametrize("name", ["mixtral", "qwen3-vl-moe", "qwen2-moe", "glm-4.5v"])
def test_from_config_counts_the_experts_a_token_is_routed_through(name):
    cfg = _moe_config(name)
    text_cfg = cfg.get_text_config()
    text, _ = _real_model_layers(cfg)
    k = text_cfg.num_experts_per_tok
    e = getattr(text_cfg, "n_routed_experts", None) or getattr(text_cfg, "num_local_experts", None) \
        or text_cfg.num_experts
    assert FlopsModel.from_config(cfg).token_flops() == pytest.approx(_routed_linear_flops(text, k, e))


def _tiled_vlm(name: str, side: int):
    import transformers as T

    text = dict(_TINY_TEXT, model_type="qwen2" if name == "internvl" else "llama")
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  image_size=side, patch_size=14)
    if name == "llava-next":
        return T.LlavaNextForConditionalGeneration(T.LlavaNextConfig(
            text_config=text, vision_config=dict(vision, model_type="clip_vision_model")))
    if name in ("idefics3", "smolvlm"):
        cls = T.Idefics3Config if name == "idefics3" else T.SmolVLMConfig
        return T.AutoModel.from_config(cls(text_config=text, vision_config=vision,
                                           scale_factor=2 if name == "idefics3" else 4))
    if name == "internvl":
        return T.InternVLForConditionalGeneration(T.InternVLConfig(
            text_config=text, vision_config=dict(vision, image_size=[side, side], patch_size=[14, 14])))
    raise KeyError(name)


@pytest.mark.parametrize("name", ["llava-next", "idefics3", "smolvlm", "internvl"])
def test_from_config_vision_cost_of_tiling_towers_follows_the_real_tiles(name):
    """Tiling towers encode each tile on its own: the placeholder tokens of n tiles stand for n
    tiles' patches (LLaVA: one token per patch, Idefics3 / SmolVLM: scale_factor² patches, InternVL:
    1 / downsample_ratio² patches), and attention stays within a tile."""
    import torch

    from tokenbal.hf_compat import internvl_image_features

    side, tiles = 112, 3
    model = _tiled_vlm(name, side).eval()
    px = torch.zeros(tiles, 3, side, side)
    with torch.no_grad():
        if name == "llava-next":
            tower = model.model.vision_tower
            hidden = tower(px).last_hidden_state
            per_tile = model.model.multi_modal_projector(hidden[:, 1:]).shape[1]   # "default": CLS dropped
        elif name == "internvl":
            tower = model.model.vision_tower
            hidden = tower(px).last_hidden_state
            per_tile = internvl_image_features(model, px).shape[1]
        else:
            tower = model.vision_model
            hidden = tower(px).last_hidden_state
            per_tile = model.connector(hidden).shape[1]
    patches = hidden.shape[1]   # per tile, as the tower ran (CLIP / InternViT add a CLS token)
    blocks = next(m for m in tower.modules() if isinstance(m, torch.nn.ModuleList))
    width = model.config.vision_config.hidden_size
    real = tiles * (_linear_flops_per_item(blocks) * patches + 4.0 * width * patches * patches * len(blocks))
    m = FlopsModel.from_config(model.config)
    ours = m.stage_flops(np.array([0]), vision_tokens=np.array([tiles * per_tile]))[0, 0]
    assert ours == pytest.approx(real, rel=0.05)   # the CLS token (1 of 65 patches) is not modelled


def _qwen2_5_vl_window_lengths(model, grid_thw):
    """The real tower's attention windows (patches per window) of ``grid_thw``: 5.9+ has
    ``transformers.vision_utils.get_vision_window_index``, earlier releases the tower's method."""
    import torch

    visual = model.visual
    try:
        from transformers.vision_utils import get_vision_window_index
    except ImportError:
        _, cu = visual.get_window_index(grid_thw)
    else:
        _, cu = get_vision_window_index(grid_thw, spatial_merge_size=visual.spatial_merge_size,
                                        window_size=visual.window_size, patch_size=visual.patch_size)
    cu = torch.unique_consecutive(torch.as_tensor(cu))
    return (cu[1:] - cu[:-1]).tolist()


@pytest.mark.parametrize("grid", [(1, 16, 16), (1, 8, 24), (1, 32, 8)])
def test_from_config_qwen2_5_vl_vision_attention_is_windowed_but_in_the_full_attention_layers(grid):
    """Qwen2.5-VL's vision layers attend within 112-px windows (8 x 8 patches), except those in
    fullatt_block_indexes, which attend over the whole image."""
    import torch
    import transformers as T

    cfg = T.Qwen2_5_VLConfig(
        text_config=dict(_TINY_TEXT, **rope_config(T.Qwen2_5_VLConfig, 1e4, mrope_section=[2, 3, 3])),
        vision_config=dict(depth=4, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2,
                           window_size=112, patch_size=14, fullatt_block_indexes=[1, 3]))
    model = T.AutoModel.from_config(cfg)
    blocks = model.visual.blocks
    windows = _qwen2_5_vl_window_lengths(model, torch.tensor([grid]))
    patches = grid[0] * grid[1] * grid[2]
    assert sum(windows) == patches
    full = set(cfg.vision_config.fullatt_block_indexes)
    width = cfg.vision_config.hidden_size
    attention = sum(4.0 * width * (patches**2 if i in full else sum(w * w for w in windows))
                    for i in range(len(blocks)))
    real = _linear_flops_per_item(blocks) * patches + attention
    m = FlopsModel.from_config(cfg)
    ours = m.stage_flops(np.array([0]), vision_tokens=np.array([patches // m.merge_size**2]))[0, 0]
    assert ours == pytest.approx(real)
