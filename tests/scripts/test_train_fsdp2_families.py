"""scripts/train_fsdp2.py --model-config with the non-Qwen families: a tiny LLaVA-NeXT / InternVL /
GLM-4.1V config.json trains on the demo data under FSDP2 on 2 ranks; the dataset checks every sample's
placeholder count against the index built with that family's estimator."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from tests.helpers.paths import REPO

pytest.importorskip("transformers")

ROOT = REPO
SCRIPT = ROOT / "scripts" / "train_fsdp2.py"


def _config(family: str):
    if family == "glm4v":
        from tests.helpers.tiny_glm4v import tiny_config

        return tiny_config()
    if family == "internvl":
        from tests.helpers.tiny_internvl import tiny_config

        return tiny_config()
    from tests.helpers.tiny_llava import tiny_config

    return tiny_config(family)


@pytest.mark.parametrize("family", ["llava_next", "llava_onevision", "internvl", "glm4v"])
def test_model_config_loads_and_builds(tmp_path, family):
    from collate.train.builders import build_model, load_model_config, match_tokenizer

    _config(family).save_pretrained(tmp_path)
    config = load_model_config(str(tmp_path / "config.json"))
    assert config.model_type == family
    ids = {"<|image_pad|>": 3, "<|video_pad|>": 4, "<|vision_start|>": 1, "<|vision_end|>": 2}
    changed = match_tokenizer(config, 559, ids)
    assert "image_token_id 120 -> 3" in changed and not any("vision_start" in c for c in changed)
    assert (getattr(config, "video_token_id", None) == 4) == (family in ("llava_onevision", "glm4v"))
    if family == "glm4v":  # its image wrappers are the demo's vision start / end
        assert (config.image_start_token_id, config.image_end_token_id) == (1, 2)
    assert type(build_model(config, 0)).__name__.lower().startswith(family.replace("_", ""))


@pytest.mark.parametrize("family", ["llava_next", "llava_onevision", "internvl", "glm4v"])
def test_index_lengths_equal_collated_samples(tmp_path, family):
    """The index built with the family's estimator predicts every sample's length, multi-image
    OneVision samples (base views only) included; IndexedSamples raises on any mismatch, and the
    collator then accepts every sample's placeholders."""
    from collate import PackedCollator
    from collate.train.builders import (
        MODEL_CLASSES,
        IndexedSamples,
        demo_config,
        estimator_overrides,
        prepare_data,
    )
    from tokenbal.index import build_index

    _config(family).save_pretrained(tmp_path / "model")
    paths = prepare_data(str(tmp_path / "data"), 24, 0)
    config = demo_config(paths.tokenizer, str(tmp_path / "model" / "config.json"))
    build_index(list(paths.shards), paths.index, model=MODEL_CLASSES[family][2], tokenizer=paths.tokenizer,
                estimator_overrides=estimator_overrides(config), progress=False)
    dataset = IndexedSamples(paths.index, paths.tokenizer, config=config)
    samples = [dataset[i] for i in range(len(dataset))]  # each checked against the index
    assert any("image_sizes" in s and s["image_sizes"].shape[0] > 1 for s in samples) or family in (
        "internvl", "glm4v")
    multi = any("image_grid_thw" in s and s["image_grid_thw"].shape[0] > 1 for s in samples)
    assert family != "glm4v" or multi
    batch = PackedCollator.from_config(config, pin_memory=False)(samples)
    assert batch.seq_lens == [int(n) for n in dataset.index.lengths[:len(samples)]]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llava_next", "llava_onevision", "internvl", "glm4v"])
def test_torchrun_two_ranks_with_a_family_config(tmp_path, family):
    _config(family).save_pretrained(tmp_path / "model")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(SCRIPT), "--synthetic", "8", "--global-batch-size", "4", "--sampler", "tokenbal",
           "--model-config", str(tmp_path / "model" / "config.json"), "--workdir", str(tmp_path / "data"),
           "--out", str(tmp_path / "out")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "out" / "steps.csv")))
    assert len(rows) == 2 * 2 and all(float(r["loss"]) > 0 for r in rows)


def test_demo_packed_loss_check_with_a_glm4v_config(tmp_path):
    """``tokenbal demo --model glm4v/config.json``'s last step: the packed loss on the demo data
    equals transformers' per-sample unpacked loss (images through Glm4vImageProcessorPil)."""
    from collate.demo import demo_config, estimator_overrides, packed_loss_check, prepare_data
    from tokenbal.index import build_index

    _config("glm4v").save_pretrained(tmp_path / "model")
    model_config = str(tmp_path / "model" / "config.json")
    paths = prepare_data(str(tmp_path / "data"), 12, 0)
    config = demo_config(paths.tokenizer, model_config)
    build_index(list(paths.shards), paths.index, model="glm-4.1v", tokenizer=paths.tokenizer,
                estimator_overrides=estimator_overrides(config), progress=False)
    packed, unpacked = packed_loss_check(paths, 0, model_config=model_config)
    assert abs(packed - unpacked) <= 1e-5 * abs(unpacked)
