"""Side environments for the heavier checks (`compat`: the transformers matrix, `frameworks`: the
training frameworks): a test asks for one by name and runs code in it with this checkout on
PYTHONPATH. Built by scripts/envs.py from tests/envs/NAME.txt, cached under $TOKENBAL_ENV_ROOT."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import REPO

sys.path.insert(0, str(REPO / "scripts"))
import envs as _envs  # noqa: E402  (scripts/ is not a package)

_TF_SPEC = re.compile(r"^tf-(\d+)\.(\d+)(-video(-smolvlm)?)?$")
_TF_KINDS = {"matrix": None, "video": "-video", "video-smolvlm": "-video-smolvlm"}


def transformers_specs(kind: str) -> list[str]:
    """The transformers side environments of one kind, oldest release first: ``"matrix"`` the
    ``tf-X.Y`` specs (the version matrix, no torchvision), ``"video"`` the ``tf-X.Y-video`` specs
    (torch + torchvision + PyAV: the real video processors' oracle), ``"video-smolvlm"`` their
    ``tf-X.Y-video-smolvlm`` overlays (+ num2words, which SmolVLM's processor needs)."""
    suffix = _TF_KINDS[kind]
    found = []
    for spec in (REPO / "tests" / "envs").glob("tf-*.txt"):
        m = _TF_SPEC.match(spec.stem)
        if m and m.group(3) == suffix:
            found.append(((int(m.group(1)), int(m.group(2))), spec.stem))
    return [name for _, name in sorted(found)]


def env_python(name: str) -> Path:
    """The python of environment ``name``, built on first use (minutes; pip from the registry)."""
    return _envs.build(name)


def run_in_env(name: str, args: list[str], *, cwd: Path | None = None, env: dict | None = None,
               timeout: float = 1800) -> subprocess.CompletedProcess:
    """``python ARGS`` in environment ``name`` with this checkout first on PYTHONPATH; output captured."""
    python = env_python(name)
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), full_env.get("PYTHONPATH", "")) if p)
    return subprocess.run([str(python), *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)

def oracle_in_env(name: str, module: str, *args: str, timeout: float = 1800) -> list[dict]:
    """``python -m MODULE ARGS`` in environment ``name`` (an oracle check that prints one JSON line per
    case): its JSON lines, after asserting it exited 0; skips the test under
    ``TOKENBAL_SKIP_SIDE_ENVS=1`` (machines without side environments)."""
    import json

    import pytest

    if os.environ.get("TOKENBAL_SKIP_SIDE_ENVS") == "1":
        pytest.skip("TOKENBAL_SKIP_SIDE_ENVS=1: no side environments on this machine")
    proc = run_in_env(name, ["-m", module, *args], cwd=REPO, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
