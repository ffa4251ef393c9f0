#!/usr/bin/env python3
"""Build and reuse the side environments of the heavier checks (version matrix, frameworks).

Each environment is a plain venv described by one requirements file, ``tests/envs/NAME.txt``. Its
``torch`` / ``torchvision`` lines are installed first, on their own, so pip takes the CPU wheel (or
the torch + torchvision pair) from local disk instead of resolving a multi-GB CUDA build through
another package; the rest of the file is installed after. tokenbal itself is *not* installed: the
checks put the checkout on ``PYTHONPATH``, so one environment serves every checkout and branch.

A spec may start from another environment instead of a bare venv: a line ``base: NAME`` makes the
new venv see NAME's packages (a ``.pth`` file adds NAME's site-packages after its own) and install
only its own lines over them, e.g. another transformers release over the torch + torchvision of
NAME (a few hundred MB instead of a second multi-GB torch). pip never touches the base: what a
spec line replaces is installed in the new venv, which comes first on ``sys.path``.

Environments live under ``$TOKENBAL_ENV_ROOT`` (default ``~/.cache/tokenbal/envs``), one folder per
name, and are rebuilt only when their requirements file changes (its sha256 is stored beside the
venv). A lock per environment lets several test processes ask for the same one at once.

    python scripts/envs.py build tf-4.57        # prints the environment's python
    python scripts/envs.py list                 # every spec, built or not
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPECS = REPO / "tests" / "envs"
_TORCH_LINE = re.compile(r"^\s*(torch|torchvision|torchaudio)\s*(==|>=|<=|~=|$)")
_BASE_LINE = re.compile(r"^base:\s*(\S+)$")


def env_root() -> Path:
    return Path(os.environ.get("TOKENBAL_ENV_ROOT", Path.home() / ".cache" / "tokenbal" / "envs"))


def spec_path(name: str) -> Path:
    path = SPECS / f"{name}.txt"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SPECS.glob("*.txt"))) or "none"
        raise SystemExit(f"envs: error: no spec {path} (known: {known})")
    return path


def _requirements(path: Path) -> tuple[str | None, list[str], list[str]]:
    """(base environment or None, torch lines, other lines) of a spec, comments and blanks dropped."""
    base, torch_lines, other = None, [], []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if m := _BASE_LINE.match(line):
            base = m.group(1)
        elif line:
            (torch_lines if _TORCH_LINE.match(line) else other).append(line)
    if base is not None and torch_lines:
        raise SystemExit(f"envs: error: {path} has a base ({base}) and torch lines (torch is the base's)")
    return base, torch_lines, other


def _site_packages(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def _run(cmd: list[str], log) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` exited {rc}; see {log.name}")


def build(name: str, *, quiet: bool = False) -> Path:
    """The python of environment ``name``, built first if missing or stale. Returns its path."""
    spec = spec_path(name)
    base, torch_lines, other = _requirements(spec)
    base_python = build(base, quiet=quiet) if base else None
    digest = _digest(name)
    root = env_root()
    root.mkdir(parents=True, exist_ok=True)
    venv = root / name
    python = venv / "bin" / "python"
    stamp = venv / ".tokenbal-spec-sha256"
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # a second builder waits, then finds it built
        if stamp.is_file() and stamp.read_text().strip() == digest and python.exists():
            return python
        if venv.exists():
            shutil.rmtree(venv)
        log_path = root / f"{name}.log"
        start = time.monotonic()
        if not quiet:
            print(f"envs: building {name} from {spec.relative_to(REPO)} (log: {log_path})", file=sys.stderr)
        with open(log_path, "w") as log:
            _run([sys.executable, "-m", "venv", str(venv)], log)
            pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
            _run(pip + ["--upgrade", "pip"], log)
            if base_python is not None:
                # the base's packages after the venv's own (addsitedir also runs the base's .pth files)
                (Path(_site_packages(python)) / "_tokenbal_base.pth").write_text(
                    f"import site; site.addsitedir({_site_packages(base_python)!r})\n")
            if torch_lines:
                _run(pip + torch_lines, log)
            if other:
                _run(pip + torch_lines + other, log)   # the torch lines again: already satisfied
            _run([str(python), "-m", "pip", "freeze"], log)
        stamp.write_text(digest + "\n")
        if not quiet:
            print(f"envs: built {name} in {time.monotonic() - start:.0f} s", file=sys.stderr)
        return python


def _digest(name: str) -> str:
    """What an environment is built from: its spec and, for a spec with a base, the base's digest."""
    spec = spec_path(name)
    base = _requirements(spec)[0]
    text = spec.read_bytes() + (f"\nbase {_digest(base)}".encode() if base else b"")
    return hashlib.sha256(text).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or reuse) environments; print each one's python")
    b.add_argument("names", nargs="+")
    sub.add_parser("list", help="every spec under tests/envs/, and whether it is built")
    args = parser.parse_args(argv)
    if args.cmd == "list":
        for spec in sorted(SPECS.glob("*.txt")):
            stamp = env_root() / spec.stem / ".tokenbal-spec-sha256"
            digest = _digest(spec.stem)
            fresh = stamp.is_file() and stamp.read_text().strip() == digest
            print(f"{spec.stem:24s} {'built' if fresh else '-'}")
        return 0
    for name in args.names:
        print(build(name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
