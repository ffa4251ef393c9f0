"""The README's Python Quick start, run as written: in one process, in a folder holding what the
block names -- ``data/.tokindex`` over tiny generated tar shards (built with the checkpoint's
tokenizer, as the bash Quick start says) and ``Qwen2-VL-2B-Instruct/``, a tiny random checkpoint in
the real one's file layout (so ``from_pretrained`` reads it locally, nothing is downloaded). Then
every commented alternative (the ``#   `` lines, uncommented) runs in the same namespace."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.corpus import good_sample, write_shard
from tests.helpers.paths import REPO

pytest.importorskip("transformers")

README = (REPO / "README.md").read_text()


def quickstart_python() -> str:
    """The first ```python block of the README's ``## Quick start`` section."""
    section = README.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```$", section, re.M | re.S)
    assert blocks, "the Quick start has no python block"
    return blocks[0]


def alternatives(code: str) -> list[str]:
    """Each run of consecutive ``#   `` comment lines, uncommented: the block's runnable variants."""
    runs, current = [], []
    for line in code.splitlines() + [""]:
        if line.startswith("#   "):
            current.append(line[4:])
        elif current:
            runs.append(textwrap.dedent("\n".join(current)))
            current = []
    return runs


def test_the_quickstart_has_what_it_claims():
    code = quickstart_python()
    assert "ProcessorDataset(" in code and "model(**batch)" in code and ".backward()" in code
    assert len(alternatives(code)) >= 2


def test_readme_quickstart_runs_verbatim(tmp_path, qwen2_vl_ckpt):
    from tokenbal.index import build_index

    rng = random.Random(0)
    kinds = ("caption", "chat", "messages", "text", "image")
    samples = [good_sample(f"s{s}/{i:03d}", rng, kinds[(s + i) % len(kinds)])
               for s in range(2) for i in range(6)]
    for smp in samples:   # keep the images small: the tiny model's CPU step stays quick
        smp.images = [(fmt, min(w, 96), min(h, 96)) for fmt, w, h in smp.images]
    os.makedirs(tmp_path / "data")
    shards = [write_shard(tmp_path / f"data/shard-{s:03d}.tar", samples[6 * s:6 * s + 6]) for s in range(2)]
    os.symlink(qwen2_vl_ckpt, tmp_path / "Qwen2-VL-2B-Instruct")   # the folder the block loads
    build_index(shards, tmp_path / "data/.tokindex", model="qwen2-vl", tokenizer=qwen2_vl_ckpt,
                progress=False)

    code = quickstart_python()
    # Each alternative must build a sampler over the whole index, as the block's own one does.
    checks = "\n".join(f"{alt}\nassert sorted(i for s in sampler for i in s) == list(range(len(index)))"
                       for alt in alternatives(code))
    script = (f"{code}\nprint('steps', len(sampler), 'loss', float(out.loss))\n"
              f"{checks}\nprint('alternatives ok')\n")
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-4000:]
    assert "alternatives ok" in r.stdout
    steps, loss = re.search(r"steps (\d+) loss (\S+)", r.stdout).groups()
    assert int(steps) >= 1 and float(loss) == float(loss)   # a real, finite forward ran
