"""Package conventions: --version, --model listing the valid families, the tokenbal logger, py.typed
shipped as package data, a LICENSE matching pyproject, lazy framework imports, and the Trainer
example running end to end (tiny sizes, one process)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.paths import REPO
from tokenbal import __version__
from tokenbal.cli import main

ROOT = REPO
tomllib = pytest.importorskip("tomllib")   # Python >= 3.11


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"tokenbal {__version__}"
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == __version__


def test_model_lists_valid_families(capsys, tmp_path):
    from tokenbal.estimate.vision import estimator_names

    assert main(["index", "build", "x.tar", "--out", str(tmp_path), "--model", "no-such-vlm"]) == 2
    err = capsys.readouterr().err
    assert "no-such-vlm" in err and all(name in err for name in estimator_names())
    with pytest.raises(SystemExit):
        main(["index", "build", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "qwen2.5-vl" in out and "phi-4-multimodal" in out


def test_logger_reports_skipped_samples(caplog):
    from tokenbal import TokenBalancedBatchSampler

    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("tokenbal").handlers)
    sampler = TokenBalancedBatchSampler(np.array([10, 10, 500, 10]), num_replicas=1, rank=0,
                                        max_tokens_per_rank=100, oversize="skip")
    with caplog.at_level(logging.INFO, logger="tokenbal"):
        batches = list(sampler)
    assert sorted(i for b in batches for i in b) == [0, 1, 3]
    assert any("1 sample(s) over max_tokens_per_rank" in r.message and "[2]" in r.message
               for r in caplog.records)


def test_packaging_files():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"          # SPDX string, not the deprecated table
    assert meta["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    for pkg in ("tokenbal", "collate"):
        assert (ROOT / pkg / "py.typed").is_file()
        assert meta["tool"]["setuptools"]["package-data"][pkg] == ["py.typed"]
    assert any(d.startswith("accelerate") for d in meta["project"]["optional-dependencies"]["test"])


def test_integrations_import_lazily():
    code = ("import sys, tokenbal.integrations, tokenbal.integrations.hf, tokenbal.integrations.accelerate, "
            "tokenbal.parallel; bad = [m for m in ('transformers', 'accelerate') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_trainer_example_help():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "train_hf_trainer.py"), "--help"],
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--max-tokens-per-rank" in r.stdout


@pytest.mark.slow   # two runs of the example, each importing transformers (~1 min on the loaded VM)
def test_trainer_example_runs(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    cmd = [sys.executable, str(ROOT / "examples" / "train_hf_trainer.py"), "--output-dir", str(tmp_path),
           "--samples", "12", "--epochs", "1", "--per-device-batch", "3", "--save-steps", "2"]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "at step 4 (4 trained by this run), 4 per epoch" in r.stdout
    assert (tmp_path / "checkpoint-2" / "tokenbal_sampler.json").is_file()
    # and resuming from its last checkpoint (the end of the epoch) trains nothing more, and says so
    r = subprocess.run(cmd + ["--resume"], env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "at step 4 (0 trained by this run)" in r.stdout and "nothing left to train" in r.stdout
    # the packed recipe: raw chat rows through the processor, one row per step under the budget
    packed = [sys.executable, str(ROOT / "examples" / "train_hf_trainer.py"), "--output-dir",
              str(tmp_path / "packed"), "--samples", "12", "--epochs", "1", "--packed",
              "--max-tokens-per-rank", "400", "--save-steps", "100"]
    r = subprocess.run(packed, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tokenbal: 12 samples" in r.stderr and "packed rows" in r.stderr    # the plan line is visible
    assert "trained by this run" in r.stdout


# Each snippet imports in a different order, then checks that a package attribute named like one of
# its submodules *is* that submodule (the name must not mean a function after one order and a module
# after another).
_IMPORT_ORDERS = [
    "import tokenbal",
    "import tokenbal.partition; import tokenbal",
    "from tokenbal.partition import partition; import tokenbal",
    "from tokenbal import partition",
    "import tokenbal.balance.partition; import tokenbal",
    "import tokenbal.profile.analysis as a; import tokenbal.profile",
]
_CHECK = """
import sys, types, tokenbal, tokenbal.profile
assert isinstance(tokenbal.partition, types.ModuleType), tokenbal.partition
assert tokenbal.partition is sys.modules["tokenbal.partition"]
assert len(tokenbal.partition.partition([3, 2, 1], 2)) == 3
from tokenbal.partition import partition
assert callable(partition) and not isinstance(partition, types.ModuleType)
for pkg in (tokenbal, tokenbal.profile):
    for name in getattr(pkg, "__all__", ()):
        sub = sys.modules.get(pkg.__name__ + "." + name)
        if sub is not None:
            assert getattr(pkg, name) is sub, (pkg.__name__, name, getattr(pkg, name))
"""


@pytest.mark.parametrize("first", _IMPORT_ORDERS)
def test_submodule_names_mean_the_module_in_every_import_order(first):
    r = subprocess.run([sys.executable, "-c", f"{first}\n{_CHECK}"], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def _shadowed(pkg) -> list[str]:
    """Public names of ``pkg`` that are also the names of its submodules (unless declared modules)."""
    import pkgutil

    subs = {m.name for m in pkgutil.iter_modules(pkg.__path__)}
    names = set(getattr(pkg, "__all__", ())) | set(getattr(pkg, "_LAZY", {}))
    return [f"{pkg.__name__}.{n}" for n in sorted(subs & names) if n not in getattr(pkg, "_SUBMODULES", {})]


def test_no_public_name_shadows_a_submodule():
    # A public name equal to a submodule's name is the clash above waiting to happen: list them all.
    import importlib
    import pkgutil

    clashes = []
    for top in ("tokenbal", "collate"):
        clashes += _shadowed(importlib.import_module(top))
        for info in pkgutil.walk_packages([str(ROOT / top)], prefix=top + "."):
            if info.ispkg:
                clashes += _shadowed(importlib.import_module(info.name))
    assert not clashes, f"public names that are also submodules: {clashes}"
