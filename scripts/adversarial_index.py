"""Random faults against the index build, merge and verify (issue 33, docs/RELIABILITY.md): each trial
injects one fault and checks that the outcome is an index equal to a clean build, or an error / a
verify problem that names what failed, never a silently different index.

Kinds (``--kinds``):

* ``kill``: ``tokenbal index build --workers 2`` SIGKILLed at a random moment; no scan worker may
  outlive it (the parent-death watch) and the next build must give the clean index.
* ``remote``: a build over HTTP with a random share of reads answered 503 (some shards run out of
  retries); the index must equal the clean one, or ``verify`` must report the failed shards; then a
  rebuild against the healthy store must equal the clean index and ``verify`` be clean.
* ``merge``: ``--part i/n`` builds with a shard added, removed or rewritten between the parts at
  random (or not); the merge must equal the clean index or raise naming the shards.
* ``damage``: one random bit flipped in one random ``.npy`` column of a copy of the index; it must be
  refused at open, reported by ``verify``, or caught by reading every sample, or leave every value
  the same (a flip in a header's padding); anything else is counted as missed.

Run: ``python scripts/adversarial_index.py --trials 10`` (trials per kind). Prints, per kind, the
trials run, what happened, and how many survived (ended in one of the allowed outcomes).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from tests.helpers.corpus import make_corpus  # noqa: E402
from tests.helpers.servers import serve  # noqa: E402
from tokenbal.index import RemoteOptions, TokenIndex, build_index, merge_indexes, verify_index  # noqa: E402
from tokenbal.index.store import IndexDamagedError  # noqa: E402

FAST = RemoteOptions(backoff_s=0.01, retries=2, timeout=10, total_timeout=60)


def content(idx: TokenIndex, rename=lambda p: p) -> dict:
    """What an index says, independent of build ids and shard order: per key its shard, counts,
    members and image sizes; the errors; the shard statuses."""
    rows = {}
    for i in range(len(idx)):
        rows[idx.keys[i]] = (rename(idx.shard(i)), int(idx.vision_tokens[i]), int(idx.text_tokens[i]),
                             idx.image_sizes(i), [(m.name, m.offset, m.size) for m in idx.members(i)])
    errors = sorted((rename(e["shard"]), str(e["key"]), e["reason"].replace(e["shard"], rename(e["shard"])))
                    for e in idx.errors)
    shards = sorted((rename(s["path"]), s["status"], s["n_samples"]) for s in idx.manifest["shards"])
    return {"rows": rows, "errors": errors, "shards": shards}


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def trial_kill(rng: random.Random, work: str, corpus, clean: dict) -> str:
    out = os.path.join(work, "idx")
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tokenbal.cli", "index", "build", *corpus.shards, "--out", out,
           "--workers", "2", "-q"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + rng.uniform(1.5, 6.0)
    workers: set[int] = set()
    while time.monotonic() < deadline and proc.poll() is None:
        workers.update(c for c in _children(proc.pid))
        time.sleep(0.05)
    if proc.poll() is not None:
        outcome = "finished before the kill"
    else:
        workers.update(_children(proc.pid))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # children: the scan workers and multiprocessing's resource tracker, once the pool started
        outcome = (f"killed with {len(workers)} child process(es)" if workers
                   else "killed before the pool started")
        end = time.monotonic() + 30
        while any(_alive(p) for p in workers) and time.monotonic() < end:
            time.sleep(0.1)
        left = [p for p in workers if _alive(p)]
        if left:
            for p in left:
                with contextlib.suppress(OSError):
                    os.kill(p, signal.SIGKILL)
            return f"MISSED: {len(left)} scan worker(s) outlived the killed build"
    build_index(corpus.shards, out, progress=False, workers=2)
    if content(TokenIndex.open(out)) != clean:
        return "MISSED: the resumed index differs from a clean build"
    return f"{outcome}; resumed index equals the clean one"


def trial_remote(rng: random.Random, work: str, corpus, clean: dict) -> str:
    rate = rng.choice([0.02, 0.1, 0.3, 0.6])
    lock = threading.Lock()
    state = {"on": True}
    draw = random.Random(rng.random())

    def flaky(path, header):
        with lock:
            return state["on"] and draw.random() < rate

    with serve(corpus.root, fail_if=flaky) as (base, _):
        names = [os.path.basename(p) for p in corpus.shards]
        urls = [f"{base}/{n}" for n in names]
        rename = lambda p: p.replace(base, corpus.root)  # noqa: E731
        out = os.path.join(work, "ridx")
        try:
            build_index(urls, out, progress=False, remote=FAST)
        except OSError as e:          # the source listing itself ran out of retries: named
            if base not in str(e):
                return f"MISSED: an error that names no URL: {e}"
            first = "build refused (listing failed, URL named)"
        else:
            same = content(TokenIndex.open(out), rename) == clean
            problems = verify_index(out, remote=FAST)
            if same:
                first = "equal to clean"
            elif any(p.startswith(("shard failed", "shard partly failed")) for p in problems):
                first = "failed shards reported by verify"
            else:
                return "MISSED: the index differs from a clean build and verify says nothing"
        state["on"] = False
        build_index(urls, out, progress=False, remote=FAST)
        if content(TokenIndex.open(out), rename) != clean or verify_index(out, remote=FAST):
            return "MISSED: the rebuild against the healthy store is not the clean index"
    return f"{first}; healthy rebuild equals the clean one (503 rate {rate})"


def trial_merge(rng: random.Random, work: str, corpus, clean: dict) -> str:
    src = os.path.join(work, "shards")
    shutil.copytree(corpus.root, src)
    pattern = os.path.join(src, "data-*.tar")
    n = rng.choice([2, 3])
    fault_at = rng.randrange(n) if rng.random() < 0.75 else None
    fault = rng.choice(["add", "remove", "rewrite"])
    parts = []
    for i in range(n):
        if i == fault_at and i > 0:
            shards = sorted(os.listdir(src))
            if fault == "add":
                shutil.copy(os.path.join(src, shards[0]), os.path.join(src, "data-0005.tar"))
            elif fault == "remove":
                os.remove(os.path.join(src, shards[rng.randrange(len(shards))]))
            else:
                victim = os.path.join(src, shards[rng.randrange(len(shards))])
                with open(victim, "ab") as f:
                    f.write(b"\0" * 512)
        out = os.path.join(work, f"part{i}")
        build_index([pattern], out, progress=False, part=(i, n))
        parts.append(out)
    try:
        merge_indexes(os.path.join(work, "merged"), parts)
    except ValueError as e:
        if fault_at is None or fault_at == 0:
            return f"MISSED: a merge of unchanged parts was refused: {e}"
        return f"{n} parts, {fault} before part {fault_at}: refused ({str(e).split(':')[1][:40].strip()}...)"
    merged = content(TokenIndex.open(os.path.join(work, "merged")), lambda p: p.replace(src, corpus.root))
    if merged != clean:
        return f"MISSED: {n} parts, fault {fault} at {fault_at}: merged without error but differs from clean"
    return f"{n} parts, no fault between the parts: equals the clean index"


def trial_damage(rng: random.Random, work: str, index: str, clean: dict, shards_root: str) -> str:
    from tokenbal.data import IndexedShardDataset, SampleReadError

    copy = os.path.join(work, "damaged")
    shutil.copytree(index, copy)
    columns = sorted(f for f in os.listdir(copy) if f.endswith(".npy"))
    victim = os.path.join(copy, rng.choice(columns))
    size = os.path.getsize(victim)
    at = rng.randrange(size)
    with open(victim, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ (1 << rng.randrange(8))]))
    where = f"{os.path.basename(victim)} byte {at}/{size}"
    try:
        idx = TokenIndex.open(copy)
    except (IndexDamagedError, ValueError) as e:
        named = os.path.basename(victim) in str(e)
        return f"{where}: refused at open" + ("" if named else " (file not named)")
    problems = verify_index(copy)
    if problems:
        return f"{where}: verify reports it"
    try:
        ds = IndexedShardDataset(idx)   # decodes images: each one's size is checked against the index
        for i in range(len(idx)):
            ds[i]
        now = content(idx)
    except (SampleReadError, IndexDamagedError) as e:
        return f"{where}: caught by the reader ({type(e).__name__})"
    if now == clean and all(np.array_equal(np.load(os.path.join(copy, c)), np.load(os.path.join(index, c)))
                            for c in columns):
        return f"{where}: no value changed (header padding)"
    return f"MISSED: {where}: a changed value passes open, verify and the reader"


TRIALS = {"kill": lambda rng, work, corpus, clean, _: trial_kill(rng, work, corpus, clean),
          "remote": lambda rng, work, corpus, clean, _: trial_remote(rng, work, corpus, clean),
          "merge": lambda rng, work, corpus, clean, _: trial_merge(rng, work, corpus, clean),
          "damage": lambda rng, work, corpus, clean, index: trial_damage(rng, work, index, clean,
                                                                         corpus.root)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10, help="trials per kind")
    ap.add_argument("--kinds", default="kill,remote,merge,damage")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tally: dict[str, collections.Counter] = {}
    with tempfile.TemporaryDirectory(prefix="tokenbal-adversarial-") as tmp:
        corpus = make_corpus(os.path.join(tmp, "corpus"), n_shards=10, samples_per_shard=12, seed=args.seed)
        clean_out = os.path.join(tmp, "clean")
        build_index(corpus.shards, clean_out, progress=False)
        clean = content(TokenIndex.open(clean_out))
        for kind in args.kinds.split(","):
            tally[kind] = collections.Counter()
            for t in range(args.trials):
                work = tempfile.mkdtemp(dir=tmp, prefix=f"{kind}-{t}-")
                t0 = time.monotonic()
                if kind not in TRIALS:
                    raise SystemExit(f"unknown kind {kind!r}")
                try:
                    outcome = TRIALS[kind](rng, work, corpus, clean, clean_out)
                except Exception as e:  # noqa: BLE001 - an error no check expected is a finding
                    outcome = f"MISSED: unexpected {type(e).__name__}: {e}"
                shutil.rmtree(work, ignore_errors=True)
                print(f"{kind} {t}: {outcome} ({time.monotonic() - t0:.1f}s)", flush=True)
                tally[kind]["missed" if outcome.startswith("MISSED") else "survived"] += 1
                tally[kind][_category(outcome)] += 1
    for kind, counts in tally.items():
        n = counts["survived"] + counts["missed"]
        kinds = "; ".join(f"{k}: {c}" for k, c in sorted(counts.items()) if k not in ("survived", "missed"))
        print(f"{kind}: {n} trials, {counts['survived']} survived, {counts['missed']} missed ({kinds})")
    print(json.dumps({k: dict(v) for k, v in tally.items()}))


def _category(outcome: str) -> str:
    """An outcome without its numbers and paths, for the summary."""
    import re

    head = re.sub(r" byte \d+/\d+", "", outcome.split(" (")[0])
    head = re.sub(r"/\S+", "", head)
    return re.sub(r"\d+(\.\d+)?", "N", head).strip()


if __name__ == "__main__":
    main()
