"""The tar member walk at its old path; it lives in :mod:`tokenbal.data.tar` (one tar parser for
the index scan and the reader)."""

from __future__ import annotations

from tokenbal.data.tar import BLOCK, TarMember, header_stamp, walk_members

__all__ = ["BLOCK", "TarMember", "header_stamp", "walk_members"]
