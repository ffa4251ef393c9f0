"""docs/estimators.md's Python block, run as written: its placeholders (the two folders, ``processor``,
``ws, hs``, the video arguments) bound to real local objects, and the numbers its comments state."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tests.helpers.paths import REPO

pytest.importorskip("transformers")


def estimators_block() -> str:
    text = (REPO / "docs" / "estimators.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)
    assert blocks, "docs/estimators.md has no python block"
    return blocks[0]


def test_the_estimators_block_runs_as_written(tmp_path):
    from tests.helpers.chat_processors import processor, save_folder

    proc = processor(family="qwen2.5-vl")
    out_processor = save_folder(proc, tmp_path / "processor")
    # A checkpoint folder: the processor configs plus the model's config.json.
    ckpt = save_folder(proc, tmp_path / "Qwen2.5-VL-7B-Instruct")
    (ckpt / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    code = estimators_block()
    for placeholder, real in (("/ckpt/Qwen2.5-VL-7B-Instruct", ckpt), ("/out/processor", out_processor)):
        assert f'"{placeholder}"' in code
        code = code.replace(f'"{placeholder}"', repr(str(real)))
    names = {"processor": proc, "ws": np.array([1920, 64]), "hs": np.array([1080, 48]),
             "num_frames": 8, "w": 640, "h": 480, "fps": 2.0}
    exec(compile(code, "docs/estimators.md", "exec"), names)   # a NameError here: the block is wrong
    # The first line's estimator gives the number the block's comment states.
    assert names["get_estimator"]("qwen2.5-vl").image_tokens(1920, 1080) == 2691
    assert names["get_estimator"]("qwen2.5-vl").wrapper_tokens == 2
