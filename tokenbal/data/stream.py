"""The streaming path: :func:`balanced_batches`, a webdataset pipeline stage for shards *without*
an index (the indexed path is :mod:`tokenbal.data.indexed`).

Each rank streams its own subset of shards; the stage keeps a shuffle buffer and cuts batches that
fill a per-rank token budget (``length_fn(sample)`` gives a sample's tokens), best-fit from the
buffer. Equal step counts — the thing plain webdataset gets wrong (ranks with more samples keep going
while the others wait in a collective forever) — come from a fixed ``steps``: every rank yields
exactly ``steps`` batches per epoch from a source that does not run dry (a resampled / repeated
shard stream), and ranks agree on ``steps`` with one collective per epoch
(:func:`agree_steps`) or from a number fixed in the config. Each rank's own figure can come from a
dry pass over its shards (``steps=None`` counts the batches the stage makes) or from its shards'
sample counts × mean tokens ÷ budget. Every rank therefore runs the same number of training steps
and so the same number of collectives (a rank with no samples at all is an error, not an epoch of 0
steps on every rank).

Trade-offs of the streaming path against the indexed one:

* Balance is per rank, not across ranks: each rank fills *its own* budget, so ranks differ by the
  budget's unfilled tail (small with a large buffer) instead of being planned jointly.
* An "epoch" is ``steps`` batches of a resampled stream, not each sample exactly once: some samples
  repeat and some are not seen in a given epoch. The indexed path uses every sample exactly once.
* Resume is approximate (webdataset's shard RNG state), where the indexed sampler resumes exactly.
* Shuffling is limited to the buffer and the shard order; the indexed plan shuffles globally.
* In exchange it needs no offline index and reads whole shards sequentially, which is what object
  stores serve best; the indexed path issues one small ranged read per member.
"""

from __future__ import annotations

import bisect
import operator
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tokenbal._checks import nonneg_int, positive_int

__all__ = ["BalancedBatches", "agree_steps", "balanced_batches"]


def agree_steps(local_steps: int, group: Any = None) -> int:
    """The smallest ``local_steps`` over all ranks: one collective (an ``all_gather`` of the counts);
    call it once per epoch on every rank. Without an initialised process group, ``local_steps``. The
    count travels on the group's own device (:func:`tokenbal.parallel.collective_device`), so an
    NCCL- or HCCL-only group works as a gloo one does.

    ``ValueError`` on every rank when some rank has 0 steps and another has more: a rank with no
    samples (fewer shards than ranks, an empty shard list) would make every rank train 0 steps this
    epoch, the other ranks' data skipped without a word."""
    import torch.distributed as dist

    from tokenbal.parallel import collective_device

    if not (dist.is_available() and dist.is_initialized()):
        return int(local_steps)
    t = torch.tensor([int(local_steps)], dtype=torch.int64, device=collective_device(group))
    counts = [torch.zeros_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, t, group=group)
    steps = [int(c.item()) for c in counts]
    if min(steps) == 0 and max(steps) > 0:
        empty = [r for r, n in enumerate(steps) if n == 0]
        raise ValueError(f"agree_steps: rank(s) {empty} of {len(steps)} have 0 steps (no samples: fewer "
                         f"shards than ranks, or an empty shard list?) while others have up to {max(steps)}; "
                         "every rank would train 0 steps this epoch. Give every rank shards (resample them: "
                         "wds.ResampledShards) or a steps count fixed in the config")
    return min(steps)


def _worker_share(steps: int) -> tuple[int, int, int]:
    """(steps for this DataLoader worker, worker id, worker count): the rank's ``steps`` split so that
    the workers' batches add up to exactly ``steps``."""
    info = torch.utils.data.get_worker_info()
    wid, n = (0, 1) if info is None else (info.id, info.num_workers)
    return steps // n + (1 if wid < steps % n else 0), wid, n


def _describe(sample: Any, arrival: int) -> str:
    """The sample as an error names it: its key and shard for a webdataset dict, else its position
    in the stream (a tuple from ``wds.to_tuple`` carries neither)."""
    if isinstance(sample, dict):
        return f"sample {sample.get('__key__')!r} from {sample.get('__url__')!r}"
    return f"sample #{arrival} of this stream (a {type(sample).__name__}: {repr(sample)[:60]})"


def _sample_tokens(sample: Any, arrival: int, length_fn: Callable[[Any], Any], max_tokens: int) -> int:
    """``length_fn(sample)`` as a whole number of tokens within the budget, else ``ValueError`` naming
    the sample: a fraction is not floored (a batch of 10.9-token samples would pass a budget it
    exceeds), and a value that is no number is not int()'s bare complaint; nor is what ``length_fn``
    raises (a sample missing the field it reads) a bare ``KeyError`` from inside a DataLoader worker."""
    try:
        value = length_fn(sample)
    except Exception as e:
        raise ValueError(f"{_describe(sample, arrival)}: length_fn raised {type(e).__name__}: {e}") from e
    try:
        n = operator.index(value)
    except TypeError:
        n = None
        if not isinstance(value, (str, bytes)):   # a float 12.0, a float tensor or numpy scalar too
            try:
                whole = float(value)
            except (TypeError, ValueError):
                whole = None
            if whole is not None and whole.is_integer():
                n = int(whole)
    if n is None:
        raise ValueError(f"{_describe(sample, arrival)}: length_fn returned {value!r}, not a whole number "
                         "of tokens")
    if n < 0:
        raise ValueError(f"{_describe(sample, arrival)}: length_fn returned {n} tokens (a count is >= 0)")
    if n > max_tokens:
        raise ValueError(f"{_describe(sample, arrival)} has {n} tokens; the budget is "
                         f"max_tokens={max_tokens}")
    return n


def _balanced_batches(data: Iterable[dict], max_tokens: int, length_fn: Callable[[dict], int],
                      steps: int | None = None, bufsize: int = 1000, seed: int = 0, epoch: int = 0,
                      rank: int | None = None, collation_fn: Callable[[list[dict]], Any] | None = None
                      ) -> Iterator[Any]:
    max_tokens, bufsize = positive_int("max_tokens", max_tokens), positive_int("bufsize", bufsize)
    steps = None if steps is None else nonneg_int("steps", steps)
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    want, wid, nworkers = _worker_share(steps) if steps is not None else (None, 0, 1)
    # Seeded from (seed, epoch, rank, worker): reproducible, and different for every stream.
    rng = random.Random(f"tokenbal.balanced_batches:{seed}:{epoch}:{rank}:{wid}")
    lens: list[tuple[int, int]] = []     # sorted (tokens, arrival number), parallel to items
    items: list[dict] = []
    arrival = 0
    made = 0

    def take(j: int) -> tuple[int, dict]:
        return lens.pop(j)[0], items.pop(j)

    def cut() -> list[dict]:
        # A random first sample keeps the order shuffled; then best fit: the largest buffered
        # sample that still fits, until none does. Largest-first fills the budget tightly.
        n, first = take(rng.randrange(len(lens)))
        batch, room = [first], max_tokens - n
        while lens and room > 0:
            j = bisect.bisect_right(lens, (room, float("inf"))) - 1
            if j < 0:
                break
            n, s = take(j)
            batch.append(s)
            room -= n
        return batch

    def emit(batch: list[dict]) -> Any:
        return collation_fn(batch) if collation_fn is not None else batch

    source = iter(data)
    exhausted = False
    while want is None or made < want:
        while not exhausted and len(lens) < bufsize:
            try:
                sample = next(source)
            except StopIteration:
                exhausted = True
                break
            n = _sample_tokens(sample, arrival, length_fn, max_tokens)
            bisect.insort(lens, (n, arrival))
            items.insert(bisect.bisect_left(lens, (n, arrival)), sample)
            arrival += 1
        if not lens:
            break
        yield emit(cut())
        made += 1
    if want is not None and made < want:
        raise RuntimeError(f"balanced_batches: rank {rank} worker {wid}/{nworkers} ran out of samples "
                           f"after {made} of its {want} batches (steps={steps}); feed it a source that does "
                           f"not run dry (webdataset ResampledShards / .repeat()) or agree on fewer steps")


@dataclass(frozen=True)
class BalancedBatches:
    """The stage :func:`balanced_batches` returns: a picklable callable ``samples -> batches`` (spawned
    DataLoader workers pickle the pipeline, so ``length_fn`` must be picklable too)."""
    max_tokens: int
    length_fn: Callable[[dict], int]
    steps: int | None = None
    bufsize: int = 1000
    seed: int = 0
    epoch: int = 0
    rank: int | None = None
    collation_fn: Callable[[list[dict]], Any] | None = None

    def __call__(self, src: Iterable[dict]) -> Iterator[Any]:
        return _balanced_batches(src, self.max_tokens, self.length_fn, steps=self.steps,
                                 bufsize=self.bufsize, seed=self.seed, epoch=self.epoch, rank=self.rank,
                                 collation_fn=self.collation_fn)


def balanced_batches(max_tokens: int, length_fn: Callable[[dict], int], steps: int | None = None,
                     bufsize: int = 1000, seed: int = 0, epoch: int = 0, rank: int | None = None,
                     collation_fn: Callable[[list[dict]], Any] | None = None, *, dp_group: Any = None,
                     device_mesh: Any = None) -> BalancedBatches:
    """A webdataset pipeline stage: samples in, batches (lists of samples, or ``collation_fn`` of
    them) out, each batch's ``length_fn`` sum at most ``max_tokens``.

    ``steps``: the number of batches this rank yields (split over DataLoader workers so that the
    workers' batches add up to exactly ``steps``; use ``batch_size=None`` in the DataLoader). Give
    every rank the same ``steps`` — fixed in the config or from :func:`agree_steps` — and a source
    that does not run dry; a source that does anyway raises a clear error rather than letting ranks
    fall out of step. ``steps=None`` batches until the source ends (one process, or ranks that are
    kept in step some other way). ``bufsize``: samples held for shuffling and fitting. Randomness is
    seeded from ``(seed, epoch, rank, worker)``; ``rank`` defaults to ``torch.distributed``'s, taken
    when the stage is built, so spawned DataLoader workers (which have no process group) keep it
    (a stage built before ``init_process_group`` takes it at its first batch instead). Each DataLoader
    worker batches what its own source yields, so give workers disjoint or resampled shard streams
    (``wds.ResampledShards(..., deterministic=True)`` seeds per rank and worker). A sample over the
    budget raises, naming its key and shard. Under tensor / sequence parallelism pass ``dp_group=`` or
    ``device_mesh=`` (:mod:`tokenbal.parallel`): the seed then uses the data-parallel rank, so the peers
    of one SP/TP group cut the same batches; give them the same shard stream too (seed it with the DP
    rank).

    Recipe (every rank)::

        steps = agree_steps(my_estimate)          # one collective per epoch, or a config value
        pipe = wds.DataPipeline(wds.ResampledShards(my_shards, seed=rank, deterministic=True),
                                wds.tarfile_to_samples(), wds.decode("pil"),
                                balanced_batches(max_tokens, length_fn, steps=steps, epoch=epoch))
        loader = DataLoader(pipe, batch_size=None, num_workers=4)   # exactly `steps` batches
    """
    # Checked here, where the pipeline is built, not at its first batch (often inside a DataLoader worker).
    max_tokens, bufsize = positive_int("max_tokens", max_tokens), positive_int("bufsize", bufsize)
    steps = None if steps is None else nonneg_int("steps", steps)
    seed, epoch = nonneg_int("seed", seed), nonneg_int("epoch", epoch)
    if rank is not None:
        rank = nonneg_int("rank", rank)
    if not callable(length_fn):
        raise ValueError(f"length_fn must be callable (sample -> tokens), got {type(length_fn).__name__}")
    if collation_fn is not None and not callable(collation_fn):
        raise ValueError(f"collation_fn must be callable (list of samples -> batch) or None, got "
                         f"{type(collation_fn).__name__}")
    if dp_group is not None or device_mesh is not None:
        from tokenbal.parallel import resolve_dp

        _, rank = resolve_dp(None, rank, dp_group, device_mesh)
    elif rank is None:
        import torch.distributed as dist

        # Resolved here, in the training process: a spawned DataLoader worker has no process group,
        # and resolving there would seed every rank's workers as rank 0.
        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
    return BalancedBatches(max_tokens, length_fn, steps, bufsize, seed, epoch, rank, collation_fn)
