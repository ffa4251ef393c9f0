"""scripts/train_fsdp2.py, the script users start from: argument checks, and (slow) a real torchrun."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

ROOT = REPO
SCRIPT = ROOT / "scripts" / "train_fsdp2.py"


def _script():
    spec = importlib.util.spec_from_file_location("train_fsdp2", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stages_need_a_cost_with_a_vision_part():
    with pytest.raises(SystemExit, match="--stages needs --cost flops or fitted"):
        _script().main(["--synthetic", "8", "--stages"])


def test_defaults_and_help():
    args = _script().parse_args(["--synthetic", "8"])
    assert (args.cost, args.repeats, args.stages, args.sampler) == ("tokens", 1, None, "both")
    assert (args.floor, args.keep_freed_memory, args.sp_size) == (False, None, 1)
    with pytest.raises(SystemExit):
        _script().parse_args(["--help"])


def test_fsdp_overlap_defaults_follow_the_device_and_flags_override_them():
    import torch

    from collate.train import FSDPSettings

    script = _script()
    cpu = script.fsdp_settings(script.parse_args(["--synthetic", "8"]), torch.device("cpu"))
    assert cpu == FSDPSettings(prefetch_depth=-1, async_unshard=True, async_reduce_scatter=True,
                               reshard_after_forward=False)
    cuda = script.fsdp_settings(script.parse_args(["--synthetic", "8"]), torch.device("cuda", 0))
    assert cuda == FSDPSettings()  # FSDP2's own: layer prefetch 1, blocking, reshard after forward
    flags = ["--synthetic", "8", "--prefetch-depth", "0", "--no-async-reduce-scatter",
             "--reshard-after-forward"]
    assert script.fsdp_settings(script.parse_args(flags), torch.device("cpu")) == FSDPSettings(
        prefetch_depth=0, async_unshard=True, async_reduce_scatter=False, reshard_after_forward=True)


def test_keep_freed_memory_is_for_cpu_ranks_unless_asked():
    import torch

    script = _script()
    # Only the paths that leave this process's allocator alone (keep_freed_memory is process-wide).
    default = script.parse_args(["--synthetic", "8"])
    assert not script.keep_freed_memory_if_asked(default, torch.device("cuda", 0))
    off = script.parse_args(["--synthetic", "8", "--no-keep-freed-memory"])
    assert not script.keep_freed_memory_if_asked(off, torch.device("cpu"))


@pytest.mark.slow
def test_torchrun_two_ranks_fitted_costs_and_repeats(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPT), "--synthetic", "40", "--train-samples", "8", "--global-batch-size", "4",
           "--sampler", "both", "--floor", "--cost", "fitted", "--calibration-batches", "4", "--repeats", "2",
           "--workdir", str(tmp_path / "data"), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokenbal is" in done.stdout and "as fast as DistributedSampler" in done.stdout
    assert "vision+language stages" in done.stdout
    fitted = json.loads((out / "stage_costs.json").read_text())
    assert set(fitted) >= {"vision", "language"} and min(fitted["vision"] + fitted["language"]) >= 0
    rows = list(csv.DictReader(open(out / "steps.csv")))
    assert {r["sampler"] for r in rows} == {"distributed", "tokenbal", "identical"}
    for kind in ("distributed", "tokenbal", "identical"):
        mine = [r for r in rows if r["sampler"] == kind]
        assert len(mine) == 2 * 2          # 8 samples / 4 per step = 2 steps, x 2 ranks (medians of 2)
        assert all(0 <= float(r["vision_s"]) <= float(r["compute_s"]) for r in mine)
    # The control: both ranks got tokenbal's rank-0 batch at every step.
    for step in ("0", "1"):
        control = [r for r in rows if r["sampler"] == "identical" and r["step"] == step]
        first = next(r for r in rows if r["sampler"] == "tokenbal" and r["step"] == step and r["rank"] == "0")
        assert {(r["tokens"], r["samples"]) for r in control} == {(first["tokens"], first["samples"])}
    assert "perfect balance (every rank the same micro-batch) reaches epoch/ideal" in done.stdout
    assert (out / "timeline.png").stat().st_size > 0


@pytest.mark.slow
def test_torchrun_profile_writes_traces_tokenbal_profile_reads(tmp_path):
    from tokenbal.profile import profile_run

    prof = tmp_path / "prof"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPT), "--synthetic", "40", "--train-samples", "16", "--global-batch-size", "4",
           "--sampler", "both", "--profile", str(prof), "--profile-steps", "2",
           "--workdir", str(tmp_path / "data"), "--out", str(tmp_path / "out")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    for kind in ("distributed", "tokenbal"):
        p = profile_run(str(prof / kind))
        assert p.ranks == [0, 1] and len(p.per_step()) == 2 and p.has_python_stacks
        # FSDP2 on gloo: all-gathers, and gradient reduce-scatters that gloo runs as all-reduces
        assert {c.kind for c in p.collectives} >= {"all_gather", "all_reduce"}
        assert all(s.compute_s > 0 for s in p.steps)


def tiny_qwen2_5_vl_checkpoint_config() -> dict:
    """A Qwen2.5-VL config.json in the layout of the published checkpoints (text settings at the top
    level, legacy ``rope_scaling``, their own token ids), shrunk."""
    return {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 32768,
            "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
            "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
            "vision_end_token_id": 151653, "torch_dtype": "bfloat16",
            "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                              "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                              "window_size": 112, "fullatt_block_indexes": [1], "temporal_patch_size": 2,
                              "tokens_per_second": 2}}


def tiny_qwen3_vl_checkpoint_config() -> dict:
    """A Qwen3-VL config.json in the published layout (nested text / vision configs), shrunk."""
    return {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
            "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
            "vision_end_token_id": 151653, "tie_word_embeddings": False,
            "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 64, "intermediate_size": 96,
                            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "head_dim": 32, "vocab_size": 300, "max_position_embeddings": 32768,
                            "rope_scaling": {"rope_type": "default", "mrope_section": [6, 5, 5],
                                             "mrope_interleaved": True},
                            "rope_theta": 5e6, "dtype": "bfloat16"},
            "vision_config": {"model_type": "qwen3_vl", "depth": 3, "hidden_size": 32,
                              "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                              "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1]}}


def test_model_config_loads_by_model_type_and_adapts_to_the_tokenizer(tmp_path):
    from collate.train.builders import build_model, load_model_config, match_tokenizer

    path = tmp_path / "config.json"
    path.write_text(json.dumps(tiny_qwen2_5_vl_checkpoint_config()))
    config = load_model_config(str(path))
    assert type(config).__name__ == "Qwen2_5_VLConfig" and config.vision_config.window_size == 112
    ids = {"<|image_pad|>": 3, "<|video_pad|>": 4, "<|vision_start|>": 1, "<|vision_end|>": 2}
    changed = match_tokenizer(config, 559, ids)
    assert "image_token_id 151655 -> 3" in changed and "vocab_size 300 -> 559" in changed
    assert match_tokenizer(config, 559, ids) == []        # a matching tokenizer changes nothing
    model = build_model(config, 0)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert model.get_input_embeddings().num_embeddings == 559
    path.write_text(json.dumps(tiny_qwen3_vl_checkpoint_config()))
    qwen3 = load_model_config(str(path))
    assert type(qwen3).__name__ == "Qwen3VLConfig" and qwen3.vision_config.patch_size == 16
    assert qwen3.text_config.rope_parameters["mrope_interleaved"] is True
    path.write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ValueError, match="model_type 'llava'.*qwen3_vl"):
        load_model_config(str(path))


@pytest.mark.slow
@pytest.mark.parametrize("make_config", [tiny_qwen2_5_vl_checkpoint_config, tiny_qwen3_vl_checkpoint_config],
                         ids=["qwen2.5-vl", "qwen3-vl"])
def test_torchrun_two_ranks_with_a_checkpoint_config(tmp_path, make_config):
    """A checkpoint-style Qwen2.5-VL (windowed vision tower) or Qwen3-VL (16-px patches, DeepStack)
    config.json trains on the demo data, indexed with its own token rule, with FLOPs and stages,
    under FSDP2 on 2 ranks; the dataset checks every sample's tokens against the index."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(make_config()))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPT), "--synthetic", "16", "--global-batch-size", "4", "--sampler", "tokenbal",
           "--cost", "flops", "--model-config", str(config), "--workdir", str(tmp_path / "data"),
           "--out", str(tmp_path / "out")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--model-config adapted to" in done.stdout and "image_token_id 151655 ->" in done.stdout
    rows = list(csv.DictReader(open(tmp_path / "out" / "steps.csv")))
    assert len(rows) == 2 * 4 and all(float(r["loss"]) > 0 for r in rows)   # 16 samples / 4 = 4 steps


@pytest.mark.slow
def test_torchrun_four_ranks_sequence_parallel(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(SCRIPT), "--synthetic", "24", "--train-samples", "8", "--global-batch-size", "4",
           "--sampler", "tokenbal", "--sp-size", "2", "--max-steps", "2",
           "--workdir", str(tmp_path / "data"), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 data-parallel groups x sequence parallel 2" in done.stdout
    rows = list(csv.DictReader(open(out / "steps.csv")))
    assert len(rows) == 2 * 4
    for step in ("0", "1"):
        by_rank = {r["rank"]: r for r in rows if r["step"] == step}
        # SP peers (ranks 0-1, 2-3) hold halves of one row: the same slice length and sample count.
        for a, b in (("0", "1"), ("2", "3")):
            for key in ("tokens", "samples"):
                assert by_rank[a][key] == by_rank[b][key]
    assert all(float(r["loss"]) >= 0 for r in rows)
