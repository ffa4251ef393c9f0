"""The transformers version matrix (docs/compat.md): the transformers-facing tests, run in one side
environment per supported version (tests/envs/tf-*.txt, built by scripts/envs.py, this checkout
on PYTHONPATH).

- ``test_matrix[tf-X]`` (marker ``compat``, ``make test-compat``): every transformers-facing test
  module, non-slow, in environment ``tf-X``; fails listing the failing test ids.
- ``test_oldest_smoke`` (in ``make test``): a few model-patch and position tests on the oldest
  supported version (4.57), so CI covers both ends of the range: its default venv runs the
  suite on the newest release. Building the environment is a pip install from the registry
  (cached under ``$TOKENBAL_ENV_ROOT``); ``TOKENBAL_SKIP_SIDE_ENVS=1`` skips it (offline machines).
"""

from __future__ import annotations

import os
import re

import pytest

from tests.helpers.envs import run_in_env, transformers_specs
from tests.helpers.paths import REPO

# Every spec of the matrix, oldest first.
VERSIONS = transformers_specs("matrix")
OLDEST = VERSIONS[0]

# The test modules that touch transformers (model patches, positions, estimators against the
# processors, the index with processors, the Trainer / accelerate integrations).
TRANSFORMERS_FACING = [
    "tests/collate/models", "tests/collate/test_positions.py", "tests/collate/test_positions_props.py",
    "tests/collate/test_positions_families.py",
    "tests/collate/test_packing.py", "tests/collate/test_vision.py", "tests/collate/test_sp_models.py",
    "tests/collate/train", "tests/tokenbal/estimate", "tests/tokenbal/index", "tests/tokenbal/data",
    "tests/tokenbal/balance", "tests/tokenbal/integrations",
]

# The smoke of the oldest version: packed loss and gradients against transformers' own per-sample
# forward (Qwen2-VL, Qwen3-VL, GLM-4.1V, InternVL), the collator's positions against its
# get_rope_index.
SMOKE = [
    "tests/collate/models/test_qwen2_vl.py::test_packed_loss_and_grads_match_per_sample",
    "tests/collate/models/test_qwen2_vl.py::test_collator_positions_equal_hf_get_rope_index",
    "tests/collate/models/test_qwen3_vl.py::test_collator_positions_equal_hf_get_rope_index",
    "tests/collate/models/test_glm4v.py::test_packed_loss_and_grads_match_per_sample",
    "tests/collate/models/test_internvl.py::test_packed_loss_and_grads_match_per_sample",
]

_OUTCOME = re.compile(r"^(FAILED|ERROR) (\S+)", re.MULTILINE)


def _pytest_in(env: str, targets: list[str], timeout: float) -> tuple[int, str, list[str]]:
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider",
            "-m", "not slow and not compat and not frameworks", *targets]
    proc = run_in_env(env, args, cwd=REPO, timeout=timeout)
    out = proc.stdout + proc.stderr
    return proc.returncode, out, sorted(set(m.group(2) for m in _OUTCOME.finditer(out)))


def _skip_offline() -> None:
    if os.environ.get("TOKENBAL_SKIP_SIDE_ENVS") == "1":
        pytest.skip("TOKENBAL_SKIP_SIDE_ENVS=1: no side environments on this machine")


def test_oldest_smoke():
    _skip_offline()
    rc, out, failed = _pytest_in(OLDEST, SMOKE, timeout=900)
    assert rc == 0, f"{OLDEST}: {len(failed)} failed: {failed}\n{out[-3000:]}"


@pytest.mark.compat
@pytest.mark.parametrize("env", VERSIONS)
def test_matrix(env):
    _skip_offline()
    rc, out, failed = _pytest_in(env, TRANSFORMERS_FACING, timeout=3 * 3600)
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    assert rc == 0, f"{env}: {summary}; failing: {failed}"
