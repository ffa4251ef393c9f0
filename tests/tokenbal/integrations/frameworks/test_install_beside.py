"""Installing tokenbal into a training framework's environment never changes the framework's pins.

For each framework environment (the framework as its users install it from the registry), pip
resolves ``tokenbal`` / ``tokenbal[hf]`` from this checkout without installing anything
(``--dry-run --report``) and no package already in the environment would change version — no
transformers, torch, accelerate, trl, huggingface_hub or datasets upgrade or downgrade. Packages the
environment lacks (accelerate beside VeOmni) may be added.

Two commands, both documented in docs/integrations.md ("Installing beside a framework"):
- the plain ``pip install tokenbal[hf]``, where the framework has installed transformers (pip
  then keeps it, since the ``hf`` range contains every framework's pin);
- ``pip install tokenbal[hf] -c PINS`` with the environment's own versions as constraints, which
  holds everywhere — also beside torchtitan, which has no transformers: there the plain command
  would add the newest transformers and move huggingface_hub past what ``datasets`` accepts (pip
  does not weigh the requirements of packages it is not installing).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers.envs import env_python
from tests.helpers.paths import REPO

pytestmark = pytest.mark.frameworks

# tf-4.57: transformers 4.57.x, the release MindSpeed-MM pins (MindSpeed-MM is not on the registry).
ENVIRONMENTS = ["llamafactory", "swift", "verl", "veomni", "torchtitan", "tf-4.57"]


def _installed(python) -> dict[str, str]:
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format", "json"],
                            capture_output=True, text=True, timeout=300, check=True)
    return {_canonical(p["name"]): p["version"] for p in json.loads(listed.stdout)}


def _would_install(python, requirement: str, tmp_path, *extra_args: str) -> dict[str, str]:
    report = tmp_path / "report.json"
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
         *extra_args, requirement],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {_canonical(item["metadata"]["name"]): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _changed(installed: dict[str, str], would_install: dict[str, str]) -> dict[str, str]:
    return {n: f"{installed[n]} -> {v}" for n, v in would_install.items()
            if n in installed and installed[n] != v}


@pytest.mark.parametrize("extra", ["", "[hf]"])
@pytest.mark.parametrize("name", ENVIRONMENTS)
def test_plain_install_changes_nothing_the_framework_pinned(name, extra, tmp_path):
    python = env_python(name)
    installed = _installed(python)
    if extra and "transformers" not in installed:
        pytest.skip(f"{name} has no transformers: the [hf] extra would add the newest; "
                    "the documented command with the environment's pins covers it")
    would_install = _would_install(python, f"{REPO}{extra}", tmp_path)
    assert "tokenbal" in would_install
    changed = _changed(installed, would_install)
    assert not changed, f"pip install tokenbal{extra} beside {name} would change {changed}"


@pytest.mark.parametrize("name", ENVIRONMENTS)
def test_install_with_the_environment_pins_as_constraints(name, tmp_path):
    python = env_python(name)
    installed = _installed(python)
    pins = tmp_path / "pins.txt"
    pins.write_text("".join(f"{n}=={v}\n" for n, v in installed.items()))
    would_install = _would_install(python, f"{REPO}[hf]", tmp_path, "-c", str(pins))
    assert "tokenbal" in would_install
    assert not _changed(installed, would_install)
    assert "transformers" in installed or "transformers" in would_install
