"""Helpers for the index tests that kill builds with real signals.

``python -m tests.helpers.index_kill OUT HANG_AT SHARD...`` runs ``build_index`` over the shards (one
process, a checkpoint after every shard) and, when it reaches shard number ``HANG_AT`` (0-based),
writes its pid to ``OUT.ready`` and waits there forever: a deterministic point at which the test
sends SIGKILL / SIGTERM from outside (``--part I/N`` first: a part build). ``scan_or_hang`` is a
stand-in for the build's worker function (picklable by reference, so spawn-started pool workers run
it): it waits forever on a shard named ``hang*.tar``, after writing that worker's pid next to it.
``python -m tests.helpers.index_kill --pool OUT SHARD...`` runs the CLI build with two such workers
(``pool_main``).
"""

from __future__ import annotations

import os
import sys
import time


def _wait_forever() -> None:
    while True:
        time.sleep(3600)


def scan_or_hang(path: str):
    from tokenbal.index import build

    if os.path.basename(path).startswith("hang"):
        with open(path + ".pid", "w") as f:
            f.write(str(os.getpid()))
        _wait_forever()
    w = build._WORKER
    return build.index_shard(path, w["est"], w["counter"], w["image_root"], w["exif"])


def pool_main(argv: list[str]) -> None:
    """``--pool OUT SHARD...``: the CLI's ``index build --workers 2`` with ``scan_or_hang`` as the
    worker function; its own pid goes to ``OUT.ready`` first (the test SIGKILLs it)."""
    from tokenbal.cli import main as cli
    from tokenbal.index import build

    out, shards = argv[0], argv[1:]
    build._worker_index_shard = scan_or_hang
    with open(out + ".ready", "w") as f:
        f.write(str(os.getpid()))
    sys.exit(cli(["index", "build", *shards, "--out", out, "--workers", "2"]))


def main(argv: list[str]) -> None:
    from tokenbal.index import build

    if argv[0] == "--pool":
        return pool_main(argv[1:])
    part = None
    if argv[0] == "--part":     # --part I/N OUT HANG_AT SHARD...: a part build (build --part I/N)
        part, argv = tuple(int(x) for x in argv[1].split("/")), argv[2:]
    out, hang_at, shards = argv[0], int(argv[1]), argv[2:]
    real, calls = build.index_shard, []

    def index_shard(path, *args, **kwargs):
        if len(calls) == hang_at:
            with open(out + ".ready", "w") as f:
                f.write(str(os.getpid()))
            _wait_forever()
        calls.append(path)
        return real(path, *args, **kwargs)

    build.index_shard = index_shard
    build.build_index(shards, out, progress=False, checkpoint_seconds=0, part=part)


if __name__ == "__main__":
    main(sys.argv[1:])
