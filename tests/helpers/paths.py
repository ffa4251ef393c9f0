"""Where the repository is, for tests that run its scripts and examples (independent of how deep a
test module sits in tests/)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
