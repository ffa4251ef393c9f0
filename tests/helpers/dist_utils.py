"""Tests reach local gloo ranks through tokenbal.launch; kept as a short import path."""

from tokenbal.launch import free_port, run_ranks

__all__ = ["free_port", "run_ranks"]
