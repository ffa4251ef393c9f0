"""``TokenBalancedBatchSampler``: the torch ``Sampler`` facade over :func:`tokenbal.balance.plan.plan_epoch`.

Every rank builds the same sampler from the same lengths; each plans the whole epoch locally (no
communication) and yields only its own slice::

    sampler = TokenBalancedBatchSampler(index, global_batch_size=256)   # rank/world from torch.distributed
                                                                        # (1 process: world 1, rank 0)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=...)
    for epoch in range(start_epoch, num_epochs):
        sampler.set_epoch(epoch)
        for batch in loader: ...
        # checkpoint: sampler.state_dict() -> {seed, epoch, cursor, fingerprint, ...}

Options: ``cost=`` (what to balance, :mod:`tokenbal.balance.cost`), ``stages=`` (also balance the vision
tower and the language model separately, since FSDP synchronises the ranks in each),
``grad_accum=k`` (each step is k batches — micro-batches — on every rank, all balanced; ``len``
and ``cursor`` count batches),
``oversize=`` (token-budget mode: ``"error"``, ``"skip"``, ``"alone"``).
Works as ``DataLoader(batch_sampler=...)`` and with torchdata's ``StatefulDataLoader``.

Cross-rank check (``verify``): the first iteration of each epoch, and the first after a
``load_state_dict``, all-gathers a hash of the plan and its inputs together with the resume cursor,
and raises on every rank, naming the ranks and what differs, if any rank disagrees — one small
collective instead of samples trained twice or never, or a hang when ranks resume at different
steps. ``verify=None`` (default) does this whenever torch.distributed is initialised and the
sampler's ranks are the process group's (``num_replicas`` / ``rank`` taken from it or equal to
it); ``verify=True`` requires it; ``verify=False`` turns it off (e.g. when only some processes of
the group iterate a sampler: every rank of the group must iterate it, or the collective waits).

Resume: ``load_state_dict`` restores (seed, epoch, cursor) and the next iteration continues at
step ``cursor`` of that epoch's plan — exactly the steps an uninterrupted run would have yielded.
``set_epoch`` of the same epoch keeps that position; moving to another epoch before a batch of it was
handed out drops it, and warns (a loop counting epochs from 0 instead of ``state['epoch']``).
``set_epoch`` belongs before the loader is iterated: a DataLoader with workers asks for its first batches
when its iterator is made, so after ``it = iter(loader); sampler.set_epoch(e)`` (another epoch) reading ``it``
raises ``RuntimeError`` before its first batch instead of letting those batches of the old epoch end the pass.
(An iterator made and never read trains nothing: a new iteration of the loader starts epoch ``e``.)
``cursor`` counts steps this sampler has *handed out*. A DataLoader with workers asks for batches
ahead of the training loop (``prefetch_factor × num_workers``), so iterate the loader through
:meth:`TokenBalancedBatchSampler.track`: ``for batch in sampler.track(loader): ...`` — then
``state_dict()`` counts the batches the loop has *received*, and a resume from it neither skips
nor repeats a sample, whatever the DataLoader prefetched. (torchdata's ``StatefulDataLoader``
does this bookkeeping itself: checkpoint ``loader.state_dict()`` instead — or, with a
``collate.DevicePrefetcher`` around it, the prefetcher's ``state_dict()``, since the loader's counts the
batches the prefetcher holds.)

``load_state_dict`` inside a running loop (a rollback after a loss spike): the next batch the loop
receives is the loaded one. With ``num_workers=0`` that holds as is; under ``track`` (or
``prepare_loader``) the batches fetched before the load that were still on their way are dropped;
a plain DataLoader that had read ahead (workers) cannot be told to drop them, so the load raises
``RuntimeError`` (with persistent workers or a torchdata ``StatefulDataLoader``, whose
iterators outlive the loop, at the next batch) and says what to do: break out of the
loop, load, iterate the loader again — or use ``track``. (Persistent workers are caught also after the
sampler handed out the epoch's last batch: ``iter(sampler)`` keeps checking at every ``next()`` after its
end, which the DataLoader still calls as it gives the loop each batch.) A load made after the sampler
handed out the epoch's last batch (workers ask for them all before the loop receives the last ones)
leaves the DataLoader nothing more to ask for, so its pass ends; under ``track`` (or ``prepare_loader``),
and through a ``collate.DevicePrefetcher``, the loop's pass goes on at the loaded batch (a new pass of
the loader, as with ``num_workers=0``). A plain DataLoader with workers cannot go on: the load raises
``RuntimeError`` there too (with persistent workers, whose iterator outlives the loop, the load stands
and ``set_epoch`` to another epoch raises until the loader was iterated again: the next pass starts at
the loaded batch), rather than end the loop's epoch without the loaded batches.

Re-iterating mid-epoch (a ``break`` for an eval or an OOM retry, then ``for batch in loader`` again,
no ``set_epoch`` / ``load_state_dict`` in between): under ``track`` (or
``tokenbal.integrations.accelerate.prepare_loader``) the new iteration continues at the first batch
the loop did not receive. A plain DataLoader cannot say what the loop received, so the new
iteration continues after the last batch *handed out* and warns (``RuntimeWarning``): with
``num_workers=0`` that is the same batch; with workers, the batches they had prefetched are
skipped for the rest of the epoch. A ``collate.DevicePrefetcher`` iterated directly over the DataLoader says
it when the loop abandons it (:meth:`TokenBalancedBatchSampler.reader_stopped`): the batches the
DataLoader gave it, less those it held, so the new iteration continues at the first batch not received.

One live iteration at a time: one sampler has one cursor, so an iteration becomes the sampler's when
it hands out its first batch, and an earlier one asked for another batch after that raises
``RuntimeError`` rather than skip or repeat the newer one's batches (two DataLoaders over one
sampler: build one sampler each). A DataLoader never does this: at each ``iter()`` (persistent
workers too) it replaces its sampler iterator and never asks the old one again.

Elastic resume (``elastic=True``): a checkpoint made with another world size (or global batch
size, token budget, ``grad_accum``, window) resumes mid-epoch too. The samples the checkpointed
steps consumed are replayed from the old setup's plan, and the rest of the epoch is planned afresh
for the new one, still without communication: every sample is used once in the epoch across the
change, and later epochs are planned for the new setup as usual. The resumed epoch then starts at
cursor 0 of that remainder (``len`` counts its batches). Every rank must load a state saved at the
same step (they are in lockstep, so any rank's state will do). The data and the rest of the setup
(lengths, cost, stages, shuffle, drop_last, oversize) must match, as without ``elastic``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from tokenbal._checks import nonneg_int, positive_int
from tokenbal.balance.cost import COST_NAMES, Resolved, resolve
from tokenbal.balance.plan import PLAN_VERSION, EpochPlan, pad_steps, plan_epoch
from tokenbal.balance.settings import PlanSettings, plan_settings

__all__ = ["SetupChangedError", "TokenBalancedBatchSampler"]

_STATE_VERSION = 1
# Fingerprint keys newer than some checkpoints, with the value an older sampler implied.
_ADDED_LATER = {"stages": 0, "epoch_steps": None}
# Fingerprint keys compared only when both the checkpoint and the sampler have them: which samples
# the rows are (a sampler over a TokenIndex has it; one over a plain lengths array cannot know).
_WHEN_BOTH_HAVE = ("samples_sha256",)
# What a digest in a refused resume's message stands for (the others are settings, named as given).
_CHANGED_HINTS = {
    "samples_sha256": " (the index's sample keys: a checkpoint of other samples, e.g. another index)",
    "lengths_sha256": " (the samples' token counts or costs: e.g. an index rebuilt with another processor, "
                      "tokenizer or max_pixels, or lengths computed otherwise)",
}
# What an elastic resume may change: how the remaining samples are cut into steps, not which ones.
_ELASTIC_KEYS = ("num_replicas", "global_batch_size", "max_tokens_per_rank", "grad_accum", "window")


class SetupChangedError(ValueError):
    """``load_state_dict`` of a checkpoint made with another plan setup. ``problem`` is what differs;
    the message adds the sampler's own remedy (``elastic=True``), which integrations that do not take
    that option replace with theirs."""

    def __init__(self, problem: str, hint: str = "") -> None:
        super().__init__(problem + hint)
        self.problem = problem


class TokenBalancedBatchSampler(Sampler[list[int]]):
    """Yields, per optimizer step, this rank's list of dataset indices.

    ``lengths_or_index``: 1-D non-negative integer token counts, or any object with a
    ``.lengths`` attribute (e.g. :class:`tokenbal.TokenIndex`). ``num_replicas`` / ``rank``
    default to ``torch.distributed``'s world size / rank, or to ``1`` / ``0`` (one process) when no
    process group is initialised; under tensor / sequence parallelism pass
    ``dp_group=`` (a ProcessGroup), ``device_mesh=`` (see :mod:`tokenbal.parallel` for which mesh
    dimension is used) or ``layout=`` (a :class:`tokenbal.parallel.ParallelLayout`) so that the ranks
    of one SP/TP group get the same batches. Exactly one of
    ``global_batch_size`` (samples per step over all ranks, >= num_replicas) and
    ``max_tokens_per_rank``.

    Every rank yields ``len(self)`` steps; each sample is used once per epoch (see
    :mod:`tokenbal.balance.plan` for ``drop_last`` and the empty-rank rule). A rank's list can be empty
    only when there are fewer samples than ranks (or the token budget forces it); the collate
    function must then produce a dummy batch so the rank still joins the collectives.

    ``plan_ahead=True``: when an epoch's iteration starts, the next epoch's plan is made in a
    background thread (a daemon), so ``set_epoch(e + 1)`` finds it ready instead of stalling every rank
    while it plans (stage plans of large epochs take seconds). The plan is the same as the one planned
    in the foreground (``plan_epoch`` is a pure function of its inputs), so nothing about resume or
    the cross-rank check changes; the thread only hides the time.

    ``epoch_steps=S`` (or :meth:`fix_epoch_steps`): every epoch planned into exactly ``S`` steps, for
    training loops that take every epoch's length from the first one (the HF Trainer, which the
    integration sets it for): token-budget plans differ by a step or two from epoch to epoch, and a
    shorter one gets light steps at its end (:func:`tokenbal.balance.plan.pad_steps`); an epoch that
    needs more raises. It is part of the resume fingerprint; not with ``elastic=True``.

    ``settings=``: a :class:`~tokenbal.balance.settings.PlanSettings` instead of the planning keywords
    (``num_replicas``, ``global_batch_size`` / ``max_tokens_per_rank``, ``window``, ``grad_accum``,
    ``shuffle``, ``drop_last``, ``oversize``; one given next to it must agree). Either way the
    sampler holds one checked ``settings`` and one :class:`~tokenbal.balance.cost.Resolved`
    (``resolved``: lengths, costs, stage costs, checked once here), and every epoch's plan is made
    from those two without checking the data again.
    """

    def __init__(self, lengths_or_index: Any, num_replicas: int | None = None, rank: int | None = None,
                 global_batch_size: int | None = None, max_tokens_per_rank: int | None = None,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 window: int | None = None, *, cost: Any = None, grad_accum: int = 1,
                 oversize: str = "error", verify: bool | None = None, stages: Any = None,
                 elastic: bool = False, dp_group: Any = None, device_mesh: Any = None,
                 settings: PlanSettings | None = None, layout: Any = None, plan_ahead: bool = False,
                 epoch_steps: int | None = None) -> None:
        # The planner balances ``costs`` (tokens unless ``cost`` says otherwise).
        # stages: balance K synchronised stages (vision tower, language model) on top of the cost.
        # Resolved (and checked) once: every epoch's replan takes these arrays as they are.
        self.resolved: Resolved = resolve(lengths_or_index, cost, stages)
        # Which samples the rows are (an index's keys and shards), digested at the first fingerprint:
        # lengths alone cannot tell two indexes of equal token counts apart.
        self._samples_source: Any = lengths_or_index if _has_sample_keys(lengths_or_index) else None
        self._samples_digest: str | None = None
        if settings is not None and num_replicas is None:
            num_replicas = settings.num_replicas
            if rank is None and dp_group is None and device_mesh is None and layout is None \
                    and not _distributed():
                # The world size came with the settings, not from the caller: one process is rank 0 of
                # a world of 1, and a larger world needs its rank named.
                if num_replicas != 1:
                    raise ValueError(f"settings has num_replicas={num_replicas}, and no rank was given while "
                                     "torch.distributed is not initialised: pass rank=")
                rank = 0
        if dp_group is not None or device_mesh is not None or layout is not None:
            # SP/TP peers share a batch: plan over the data-parallel dimension (tokenbal.parallel).
            from tokenbal.parallel import resolve_dp

            num_replicas, rank = resolve_dp(num_replicas, rank, dp_group, device_mesh, layout)
        num_replicas, self.rank = _resolve_world(num_replicas, rank)
        # Fail fast on bad settings (N < R, a sample over the budget, ...) without planning yet.
        self.settings: PlanSettings = plan_settings(
            settings, num_replicas=num_replicas, global_batch_size=global_batch_size,
            max_tokens_per_rank=max_tokens_per_rank, window=window, grad_accum=grad_accum,
            shuffle=shuffle, drop_last=drop_last, oversize=oversize)
        self.settings.check_against(self.resolved.costs)
        if self.resolved.cost_name == "padded":
            # What cost="padded" supports, refused here rather than at the first iteration's plan.
            from tokenbal.balance.partition.padded import check_padded

            check_padded(self.settings.global_batch_size, stages)
        # None: check across ranks whenever a process group holds this sampler's ranks.
        self.verify = None if verify is None else bool(verify)
        self.elastic = bool(elastic)
        # plan_ahead: the next epoch's plan is made in a background thread once an epoch starts.
        self.plan_ahead = bool(plan_ahead)
        self._ahead: dict[tuple, tuple[threading.Thread, list]] = {}
        self._ahead_lock = threading.Lock()
        self._verified: set[tuple[int, int]] = set()
        self.seed = nonneg_int("seed", seed)
        self.epoch = 0
        self.cursor = 0
        self._finished_here = False
        self._plans: dict[tuple, EpochPlan] = {}
        # Earlier setups of the current epoch (elastic resume): their fingerprints and how many
        # batches each consumed, oldest first. Empty unless an elastic resume happened this epoch.
        self._segments: list[dict[str, Any]] = []
        # track(): (epoch, cursor) of the batches the training loop has received; the cursor at
        # which the current iteration started (track() counts from there).
        self._consumed: tuple[int, int] | None = None
        self._iter_start = (0, 0)
        # An iteration has started handing out this epoch's batches and not reached its end (so a
        # new one after it may follow a DataLoader that read ahead: see __iter__).
        self._handing_out = False
        # Counts the iterations that have started handing out batches: only the latest may hand out
        # more (they share one cursor); an earlier one still referenced raises instead (see __iter__).
        self._iterations = 0
        # The live iteration: batches it handed out, how many of those were handed out before the latest
        # load_state_dict made while it ran (still to reach the loop when a DataLoader read ahead: track()
        # drops them), whether the loop reports what it received (track / mark_received), and the
        # DataLoader iterator driving it (a weakref; None when not a DataLoader), which knows what the
        # loop received when nothing else does.
        self._loaded_position: str | None = None   # see load_state_dict / set_epoch
        # A load into the plan of an iteration that had handed out its last batch to a DataLoader with workers
        # whose iterator outlives the loop (persistent workers): that DataLoader ended its pass without the
        # loaded batches; set_epoch to another epoch before they are handed out raises (see load_state_dict).
        self._loaded_past_pass_end: str | None = None
        self._handed = 0
        self._handed_at_load = 0
        self._tracked = False
        self._driver: Any = None
        # accelerate's DataLoaderShard reading that DataLoader iterator (a weakref; None when there is none):
        # it fetches each batch one step before it yields it, so the loop is a batch further behind.
        self._reader: Any = None
        # Loads that moved the sampler (not a reload of where it is): a reader holding batches it fetched
        # (DevicePrefetcher) notes this per batch, to drop those fetched before a later load.
        self._loads = 0
        # epoch_steps: every epoch planned into exactly this many steps (pad_steps), for loops that fix
        # an epoch's length from the first (the HF Trainer); set by fix_epoch_steps.
        self.epoch_steps: int | None = None
        if epoch_steps is not None:
            self._set_epoch_steps(positive_int("epoch_steps", epoch_steps))

    # The sampler's view of its two inputs, under the names it has always had.
    lengths = property(lambda self: self.resolved.lengths, doc="int64 tokens per sample")
    costs = property(lambda self: self.resolved.costs, doc="int64 cost per sample (what is balanced)")
    stages = property(lambda self: self.resolved.stages, doc="(n, K) int64 stage costs, or None")
    cost_name = property(lambda self: self.resolved.cost_name, doc="the cost's name (fingerprint 'cost')")
    num_replicas = property(lambda self: self.settings.num_replicas, doc="data-parallel ranks planned for")
    global_batch_size = property(lambda self: self.settings.global_batch_size)
    max_tokens_per_rank = property(lambda self: self.settings.max_tokens_per_rank)
    window = property(lambda self: self.settings.window)
    grad_accum = property(lambda self: self.settings.grad_accum)
    shuffle = property(lambda self: self.settings.shuffle)
    drop_last = property(lambda self: self.settings.drop_last)
    oversize = property(lambda self: self.settings.oversize)

    # -- planning -------------------------------------------------------------------------------

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """The whole epoch's plan (all ranks), cached for the current (seed, epoch). After an
        elastic resume, the current epoch's plan covers only the samples its earlier setups left."""
        epoch = self.epoch if epoch is None else _epoch_number(epoch)
        segments = self._segments if epoch == self.epoch else []
        key = (self.seed, epoch, json.dumps(segments, sort_keys=True))
        if key not in self._plans:
            plan = self._take_ahead(key)
            if len(self._plans) >= 2:   # the current epoch and one more (e.g. a look-ahead) is plenty
                del self._plans[next(iter(self._plans))]
            try:
                plan = self._replan(segments, self.settings, epoch) if plan is None else plan
                if self.epoch_steps is not None:
                    plan = pad_steps(plan, self.epoch_steps, self.costs)
            except ValueError as e:
                # pad_steps and the planner say "this epoch": the loop may be past it (a look-ahead, a
                # set_epoch far ahead, a resume), so the error names the epoch that failed.
                raise ValueError(f"epoch {epoch} (seed {self.seed}): {e}") from e
            self._plans[key] = plan
        return self._plans[key]

    def _start_ahead(self) -> None:
        """``plan_ahead``: start planning the epoch after the current one (no elastic segments: a new
        epoch has none) in a daemon thread, unless it is planned or being planned already."""
        key = (self.seed, self.epoch + 1, json.dumps([], sort_keys=True))
        with self._ahead_lock:
            if key in self._plans or key in self._ahead:
                return
            out: list = []
            settings, seed, epoch = self.settings, self.seed, self.epoch + 1

            def work() -> None:
                try:
                    out.append(plan_epoch(self.resolved, settings=settings, seed=seed, epoch=epoch))
                except BaseException as e:  # noqa: BLE001 - handed to the foreground, which re-plans
                    out.append(e)

            thread = threading.Thread(target=work, name=f"tokenbal-plan-epoch-{epoch}", daemon=True)
            self._ahead = {key: (thread, out)}    # one look-ahead at a time
            thread.start()

    def _take_ahead(self, key: tuple) -> EpochPlan | None:
        """The background plan for ``key`` (waiting for it to finish), or None when there is none or
        it failed (the foreground then plans, and raises what planning raises)."""
        with self._ahead_lock:
            entry = self._ahead.pop(key, None)
        if entry is None:
            return None
        thread, out = entry
        thread.join()
        if out and isinstance(out[0], EpochPlan):
            return out[0]
        if out:
            # Said on the training thread: a failure in the background is not silent, even when the
            # foreground plan (which follows) succeeds; when it fails too, it raises itself.
            warnings.warn(f"TokenBalancedBatchSampler(plan_ahead=True): planning epoch {key[1]} in the "
                          f"background failed ({type(out[0]).__name__}: {out[0]}); planning it again here",
                          RuntimeWarning, stacklevel=3)
        return None

    def __getstate__(self) -> dict[str, Any]:
        # Threads and locks do not pickle (a sampler may be copied, e.g. into a checkpointed loader):
        # the copy plans in the foreground until its next epoch starts.
        self._samples_sha256()   # the digest travels, not the index it was made from
        state = dict(self.__dict__)
        state["_ahead"], state["_ahead_lock"], state["_driver"] = {}, None, None   # (a weakref either)
        state["_reader"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (A sampler pickled before plan_ahead existed has neither attribute: it plans in the foreground.)
        self.__dict__.update({"plan_ahead": False, "_ahead": {}, "_iterations": 0, "_handed": 0,
                              "_handed_at_load": 0, "_tracked": False, "_driver": None, "_reader": None,
                              "_loads": 0,
                              "_samples_source": None, "_samples_digest": None, "_loaded_position": None,
                              "_loaded_past_pass_end": None,
                              **state})
        self._ahead_lock = threading.Lock()

    def _setup_of(self, fingerprint: dict[str, Any]) -> PlanSettings:
        """The settings of an earlier setup of this epoch (a checkpoint's fingerprint): its step
        settings, the rest this sampler's (a resume checked that they match)."""
        return dataclasses.replace(self.settings, **{k: fingerprint[k] for k in _ELASTIC_KEYS})

    def _replan(self, segments: list[dict[str, Any]], settings: PlanSettings, epoch: int) -> EpochPlan:
        """``epoch`` planned under ``settings`` for the samples that ``segments`` — earlier setups
        of the epoch with the batches each consumed, oldest first — left over."""
        if not segments:
            return self._plan_subset(None, settings, epoch)
        remaining = np.arange(len(self.costs))
        for seg in segments:
            old = self._plan_subset(remaining, self._setup_of(seg["fingerprint"]), epoch)
            remaining = np.setdiff1d(remaining, _consumed(old, seg["cursor"]), assume_unique=True)
        return self._plan_subset(remaining, settings, epoch)

    def _plan_subset(self, subset: np.ndarray | None, settings: PlanSettings, epoch: int) -> EpochPlan:
        """Plan ``subset`` (dataset indices, ascending; None: all) under ``settings`` with this
        sampler's seed: the resolved arrays as they are, nothing checked again."""
        R, k = settings.num_replicas, settings.grad_accum
        if subset is not None and subset.size == 0:
            return EpochPlan(R, np.zeros(0, np.int64), np.zeros(1, np.int64), grad_accum=k)
        data = self.resolved if subset is None else self.resolved.subset(subset)
        plan = plan_epoch(data, settings=settings, seed=self.seed, epoch=epoch)
        if subset is None:
            return plan
        # Positions in the subset -> dataset indices; ascending, so every list stays sorted.
        return EpochPlan(R, subset[plan.indices], plan.offsets, dropped=subset[plan.dropped],
                         grad_accum=k, skipped=subset[plan.skipped])

    def plan_hash(self, epoch: int | None = None) -> str:
        """sha256 of the epoch's whole plan (all ranks) and of the inputs it came from (the
        fingerprint: lengths that differ by one token can give the same plan this epoch but not
        the next). Equal on every rank iff the ranks agree."""
        plan = self.plan(epoch)
        h = hashlib.sha256(json.dumps(self.fingerprint(), sort_keys=True).encode())
        for a in (plan.indices, plan.offsets, plan.dropped, plan.skipped):
            h.update(np.ascontiguousarray(a, "<i8").tobytes())
        h.update(f"{plan.num_replicas}/{plan.grad_accum}".encode())
        return h.hexdigest()

    def _verify_plan(self) -> None:
        """All-gather the plan hash and the cursor (once per epoch, and again after a load) and
        raise on every rank if any differs."""
        key = (self.seed, self.epoch)
        if self.verify is False or key in self._verified:
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            if self.verify:
                raise RuntimeError("verify=True needs an initialised torch.distributed process group")
            return
        if self.verify is None and (self.num_replicas, self.rank) != (dist.get_world_size(), dist.get_rank()):
            return   # not the group's ranks (e.g. a sampler for another rank): nothing to compare with
        mine = {"hash": self.plan_hash(), "rank": self.rank, "fingerprint": self.fingerprint(),
                "seed": self.seed, "epoch": self.epoch, "cursor": self.cursor,
                "segments": self._segments}
        views: list[Any] = [None] * dist.get_world_size()
        # Every rank reaches this collective at the same point (first iteration of each epoch or
        # after a load), and every rank raises after it, so a mismatch is an error everywhere.
        dist.all_gather_object(views, mine)
        problems = _disagreements(views)
        if problems:
            raise RuntimeError("TokenBalancedBatchSampler ranks disagree (each rank must build the sampler "
                               "from the same lengths and settings, and resume from the same checkpoint "
                               "step):\n  " + "\n  ".join(problems))
        self._verified.add(key)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate. A new epoch starts at step 0; re-selecting the current one
        keeps the cursor, so ``load_state_dict`` followed by ``set_epoch(same)`` still resumes."""
        epoch = _epoch_number(epoch)
        if epoch != self.epoch:
            if self._loaded_past_pass_end is not None:
                raise RuntimeError(_pass_ended_message(self._loaded_past_pass_end, epoch))
            loaded, self._loaded_position = self._loaded_position, None
            if loaded is not None:
                # Nothing handed out since a load that restored the middle of an epoch: leaving that epoch
                # now throws the resume away (a loop counting its epochs from 0, not the checkpoint's).
                warnings.warn(
                    f"TokenBalancedBatchSampler.set_epoch({epoch}) drops the position load_state_dict "
                    f"restored ({loaded}) before any batch of it was handed "
                    "out: the rest of that epoch is not trained. If the training loop counts its epochs from "
                    "0, start it at the checkpoint's: for epoch in range(state['epoch'], num_epochs)",
                    RuntimeWarning, stacklevel=2)
            self.epoch = epoch
            self.cursor = 0
            self._finished_here = False
            self._segments = []
            self._consumed = None
            self._handing_out = False

    def _refuse_moved_before_received(self, planned: tuple) -> None:
        """``it = iter(loader); sampler.set_epoch(e); next(it)``: a DataLoader with workers asks its sampler
        for ``prefetch_factor x num_workers`` batches as soon as its iterator is made, so they are of the
        epoch before (a replay of a finished one). The move to another plan then ends the iteration after
        them: the pass would train those few batches of the old epoch and stop (4 of 10 batches per pass),
        where ``num_workers=0`` (which asks nothing before the first ``next``) trains the new epoch. Raised
        when that iterator, which has given the loop nothing yet, is about to give it the first of them (the
        DataLoader asks its sampler iterator for the next batch as it gives one); not at ``set_epoch``, since
        an iterator made and never read (or the one persistent workers keep, which the next
        ``iter(loader)`` resets, dropping what it had fetched) trains nothing of the old epoch."""
        if self._plan_key() == planned or self._tracked or self._driver is None or not self._handed:
            return
        driver = self._driver()
        if driver is None or getattr(driver, "_num_yielded", None) != 0:
            return
        raise RuntimeError(
            f"TokenBalancedBatchSampler.set_epoch({self.epoch}) was called after the DataLoader's iterator "
            f"was made, and that iterator is being read: its workers had already fetched {self._handed} "
            f"batches of epoch {planned[1]} (prefetch_factor x num_workers), which would reach the loop, and "
            "then the pass would end without the new epoch's batches. Call set_epoch before iterating the "
            "loader (before iter(loader) or the for loop), as torch's DistributedSampler requires too; a new "
            "iteration of the loader (for batch in loader) starts the new epoch")

    def __len__(self) -> int:
        """Batches in the current epoch: steps × grad_accum (all of them, also after a resume)."""
        return self.plan().num_steps * self.grad_accum

    def __iter__(self) -> Iterator[list[int]]:
        return _Iteration(self)

    def _hand_out(self, iteration: _Iteration) -> Iterator[list[int]]:
        """The batches of one iteration (the body of :meth:`__iter__`, run from its first ``next()``)."""
        plan = self.plan()
        self._verify_plan()
        if self.plan_ahead:
            self._start_ahead()
        total = plan.num_steps * self.grad_accum
        self._continue_where_the_loop_stopped(total)
        if self.cursor >= total and self._finished_here:
            # An epoch this sampler finished, iterated again without set_epoch: replay it, like
            # DistributedSampler. (After load_state_dict at the end of an epoch nothing is left.)
            self.cursor = 0
        self._finished_here = False
        self._iter_start, self._consumed = (self.epoch, self.cursor), None
        self._handing_out = True
        self._loaded_position = self._loaded_past_pass_end = None   # the loaded position is being trained
        # This iteration is now the sampler's: any earlier one is retired (the cursor is this one's).
        self._iterations += 1
        mine = iteration.number = self._iterations
        # The first next() runs this body (through _Iteration.__next__): its caller is the DataLoader
        # iterator asking, if it is one.
        self._handed, self._handed_at_load, self._tracked = 0, 0, False
        self._driver = _dataloader_iterator(_caller_frame(2), self)
        self._reader = None if self._driver is None else _look_ahead_reader(_caller_frame(2), self)
        planned = iteration.planned = self._plan_key()
        k = self.grad_accum
        while self.cursor < total:
            # With grad_accum=k each batch is one micro-batch: k consecutive batches make a step.
            step, j = divmod(self.cursor, k)
            batch = (plan.slot(step, self.rank) if k == 1 else plan.micro(step, self.rank, j)).tolist()
            self.cursor += 1   # before yielding: state_dict() taken after this batch counts it
            self._handed += 1
            # a load inside the live iteration: its position is being trained
            self._loaded_position = self._loaded_past_pass_end = None
            yield batch
            if self._iterations != mine:
                # A newer iteration of this sampler started while this one was live (two DataLoaders over
                # one sampler, list(sampler) inside a loop over it, an old iterator kept and advanced
                # again). They share one cursor, which the newer one has moved: handing out more here
                # would skip or repeat its batches, and ending here would cut this loop's epoch short.
                # A DataLoader never does this: it replaces its sampler iterator at each iter().
                raise RuntimeError(
                    f"this iteration of TokenBalancedBatchSampler (epoch {self.epoch}) was asked for a batch "
                    "after a newer iteration of the same sampler had started: one sampler has one cursor, "
                    "so only its latest iteration may hand out batches (state_dict() and a resume follow "
                    "that one). Build one sampler per DataLoader, or finish (or abandon) an iteration "
                    "before starting another")
            self._refuse_stale_batches()
            if self._plan_key() != planned:
                self._refuse_moved_before_received(planned)
                # While this iteration was live, set_epoch / load_state_dict moved the sampler to another
                # plan (e.g. set_epoch(e + 1) inside epoch e's last step, before a DataLoader asks for
                # the batch after it): `plan` is no longer the sampler's and the cursor belongs to the
                # new position, so this one ends here instead of handing out the old plan's batches at
                # the new cursor. (epoch_steps cannot re-cut an epoch once batches are handed out.)
                return
        self._finished_here = True
        self._handing_out = False

    def _untracked_in_flight(self) -> tuple[int, Any]:
        """Batches the live iteration handed out that its DataLoader has not yet given the loop, and that
        DataLoader iterator — (0, None) when the loop reports what it received (track / mark_received,
        which drop such batches after a load) or the iteration is not driven by a DataLoader."""
        driver = self._untracked_driver()
        if driver is None:
            return 0, None
        yielded = int(getattr(driver, "_num_yielded", self._handed))
        return max(self._handed - yielded + self._look_ahead_held(), 0), driver

    def _look_ahead_held(self) -> int:
        """1 while accelerate's ``DataLoaderShard`` reading the live iteration's DataLoader holds the batch it
        fetched one step before yielding it (not once it has met the DataLoader's end), else 0."""
        reader = self._look_ahead_reader()
        return 0 if reader is None or getattr(reader, "end_of_dataloader", True) else 1

    def _look_ahead_reader(self) -> Any:
        """accelerate's ``DataLoaderShard`` reading the live iteration's DataLoader, while it exists."""
        return None if self._reader is None else self._reader()

    def _reading_workers(self) -> Any:
        """The DataLoader iterator driving the live iteration when something reads ahead of the loop (workers,
        or accelerate's prepared loader around it) and the loop does not report what it received (track /
        mark_received), else None."""
        driver = self._untracked_driver()
        if driver is None:
            return None
        return driver if getattr(driver, "_num_workers", 0) or self._look_ahead_reader() is not None else None

    def _untracked_driver(self) -> Any:
        """The DataLoader iterator driving the live iteration while it is still reading this sampler, unless
        the loop reports what it received (track / mark_received); else None."""
        driver = None if self._tracked or self._driver is None else self._driver()
        return None if driver is None or getattr(driver, "_sampler_iter", None) is None else driver

    def _refuse_stale_batches(self) -> None:
        """A DataLoader asks for the next batch as it gives the loop one (workers: ``_try_put_index``);
        after a load inside a loop it cannot be told about (persistent workers, where a live loop and one
        broken out of look the same at the load), the batch it gives now may be one handed out before the
        load: raise rather than let the loop train it as the loaded position's."""
        if not self._handed_at_load or self._tracked or self._driver is None:
            return
        driver = self._driver()
        given = getattr(driver, "_rcvd_idx", None)   # batches of this pass given to the loop, this one too
        if given is not None and given <= self._handed_at_load:
            raise RuntimeError(_stale_batches_message(self._handed_at_load - given + 1, self._handed_at_load,
                                                      loaded=True))

    def loads(self) -> int:
        """How many ``load_state_dict`` calls have moved this sampler (a reload of the position it is at
        does not count). A reader that holds batches it fetched from a DataLoader over this sampler
        (``collate.DevicePrefetcher``) notes it per batch and asks :meth:`fetched_before_load`."""
        return self._loads

    def fetched_before_load(self, loads: int) -> bool:
        """A batch fetched when :meth:`loads` was ``loads`` was handed out before a later load, so it is
        not the loaded position's: the reader holding it drops it, and the next batch the loop receives is
        the loaded one. False under :meth:`track` / :meth:`mark_received`, which count what the loop
        receives and drop such batches themselves (so a reader inside ``track`` must pass them on)."""
        return loads != self._loads and not self._tracked

    def pass_token(self) -> tuple[int, int]:
        """Which iteration is live and how many loads have moved the sampler: a reader notes it once its
        first batch is fetched and passes it to :meth:`reader_stopped`, which ignores a report about
        another iteration (a reader closed late, by the garbage collector, while a newer pass runs)."""
        return self._iterations, self._loads

    def rollback_mark(self) -> tuple[int, tuple]:
        """Where a pass stands, for :meth:`rolled_back_since`: the loads so far and the plan handed out."""
        return self._loads, self._plan_key()

    def rolled_back_since(self, mark: tuple[int, tuple]) -> bool:
        """A load made since ``mark`` (:meth:`rollback_mark` at a pass's first batch) moved this sampler to a
        batch before the end of the same plan (a rollback): the loop's pass goes on there, as with
        ``num_workers=0``. A DataLoader with workers (or a reader holding batches) has then often ended its
        pass already, having asked for every batch before the loop received the last ones: :meth:`track` and
        ``collate.DevicePrefetcher`` start a new pass of it, which begins at the loaded batch."""
        loads, planned = mark
        return self._loads != loads and self._plan_key() == planned and self.cursor < len(self)

    def reader_stopped(self, driver: Any, held: int, token: tuple[int, int]) -> None:
        """A reader between a DataLoader over this sampler and the loop (``collate.DevicePrefetcher``) was
        abandoned (a ``break``) holding ``held`` batches the loop never received; ``driver`` is the
        DataLoader iterator it read, ``token`` :meth:`pass_token` after its first batch. Records what the
        loop received (what the DataLoader gave the reader, less those held), so that a new iteration
        continues at the first batch the loop did not receive instead of skipping the held ones and the
        workers' prefetch. Nothing when that is not known exactly (or the report is about another
        iteration): under :meth:`track` (which counts itself), after a load in the pass, another DataLoader,
        or torchdata's ``StatefulDataLoader`` (its own bookkeeping)."""
        live = None if self._driver is None else self._driver()
        yielded = getattr(driver, "_num_yielded", None)
        if self._tracked or tuple(token) != self.pass_token() or live is None or live is not driver \
                or yielded is None \
                or callable(getattr(driver, "state_dict", None)) or self._iter_start[0] != self.epoch:
            return
        received = self._iter_start[1] + int(yielded) - int(held)
        if self._iter_start[1] <= received < self.cursor:
            self.mark_received(self.epoch, received)

    def _plan_key(self) -> tuple:
        """What selects the current plan: an iteration hands out batches only while it is unchanged."""
        return self.seed, self.epoch, self._segments

    def _continue_where_the_loop_stopped(self, total: int) -> None:
        """A new iteration after one that stopped early (a ``break`` for an eval or an OOM retry)
        starts at the first batch the training loop did not receive, when that is known.

        A DataLoader with workers asks the sampler for ``prefetch_factor x num_workers`` batches
        ahead of the loop, and drops them when its iterator is abandoned; continuing at the cursor
        (batches handed out) would skip them for the rest of the epoch. Under :meth:`track` (or
        ``tokenbal.integrations.accelerate.prepare_loader``) the received count is known, and the
        cursor goes back to it. Without it the sampler cannot tell what was received (with
        ``num_workers=0`` the two are equal): it continues at the cursor and warns."""
        consumed = self._consumed
        if consumed is not None and consumed[0] == self.epoch:
            # The loop stopped before the end of its pass (track() clears `_consumed` when the loop sees
            # the end): continue at the first batch it did not receive, which is none when it received
            # them all (a break at the last step). Never a replay, even when this sampler's iteration
            # had reached its end: a DataLoader with workers asks for every batch before the loop
            # receives the last ones, so that end says nothing about where the loop stopped.
            self.cursor = min(self.cursor, consumed[1])
            self._finished_here = False
        elif consumed is None and self._handing_out and self._iter_start[0] == self.epoch \
                and self._iter_start[1] < self.cursor < total:
            warnings.warn(
                f"TokenBalancedBatchSampler: a new iteration of epoch {self.epoch} continues at batch "
                f"{self.cursor} of {total}, after the last batch the previous iteration handed out "
                "before it stopped early. If that was a DataLoader with workers, the batches they had "
                "prefetched but the loop never received (up to prefetch_factor x num_workers) are "
                "skipped this epoch, and so are those a DevicePrefetcher held (depth - 1); iterate through "
                "sampler.track(loader) (outermost: sampler.track(DevicePrefetcher(loader))) to continue at "
                "the first batch not received (with num_workers=0 and nothing reading ahead of the loop, "
                "nothing is skipped)",
                RuntimeWarning, stacklevel=3)
        self._handing_out = False

    def track(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Iterate ``loader`` (a DataLoader over this sampler, or anything yielding its batches in
        order, e.g. a ``DevicePrefetcher`` around one) and count the batches it hands to the
        training loop, so that :meth:`state_dict` saves the step the loop reached rather than the
        one the DataLoader's workers (or a prefetcher) have read ahead to::

            for batch in sampler.track(DevicePrefetcher(loader)):   # track outermost
                train_step(batch)
                if time_to_checkpoint:
                    save(sampler.state_dict())   # resumes right after this batch

        A DataLoader yields its batches in the sampler's order (``in_order=True``, the default), so
        the n-th batch received is the n-th the sampler handed out in this iteration.
        """
        if hasattr(loader, "batch_sampler") and loader.batch_sampler is not self:
            raise ValueError("track() needs a DataLoader built with batch_sampler=this sampler")
        if getattr(loader, "in_order", True) is False and getattr(loader, "num_workers", 0) > 0:
            raise ValueError("track() needs DataLoader(in_order=True): with in_order=False the batches "
                             "arrive in any order, so a count cannot say which ones were trained")
        while True:
            received, planned, loads = 0, None, self._loads
            for batch in loader:
                # By now the sampler's iteration has started, so _iter_start and _handed_at_load are this
                # iteration's: after a load_state_dict inside the loop (a rollback), _iter_start is the loaded
                # batch and the first _handed_at_load batches of the pass were handed out before the load.
                received += 1
                if planned is None:
                    planned = self._plan_key()   # the plan this pass hands out (a load may move it later)
                if received <= self._handed_at_load:
                    # Still on its way at the load (a DataLoader's workers, a prefetcher): not the loaded
                    # position's, so the loop never sees it, as with num_workers=0 (the next batch after the
                    # load is the loaded one).
                    continue
                epoch, start = self._iter_start
                self.mark_received(epoch, start + received - self._handed_at_load)
                yield batch
            if planned is not None and self.rolled_back_since((loads, planned)):
                # A load of this pass's plan after the sampler had handed out its last batch (a DataLoader
                # with workers asks for them all before the loop receives the last ones): the DataLoader
                # has nothing more to ask for and ended the pass, where with num_workers=0 the loop goes on
                # at the loaded batch. Go on the same way: a new pass of the loader starts there.
                continue
            break
        # The loop saw the end of the pass: it received every batch handed out, so nothing is pending,
        # and an iteration after it replays a finished epoch (like DistributedSampler), as without track.
        self._consumed = None

    def mark_received(self, epoch: int, batches: int) -> None:
        """Record that the training loop has received the first ``batches`` batches of ``epoch``
        (what :meth:`track` does per batch; for a wrapper that counts batches itself, such as
        ``tokenbal.integrations.accelerate.TokenBalancedLoader``). :meth:`state_dict` then saves
        that position, and a new iteration after an early stop continues from it."""
        self._consumed = (_epoch_number(epoch), nonneg_int("batches", batches))
        self._tracked = True

    # -- checkpointing --------------------------------------------------------------------------

    def fingerprint(self) -> dict[str, Any]:
        """What the plan depends on besides (seed, epoch); a resume must match all of it."""
        # The data's part (sample count, digest, cost, stages) and the settings' part: the same keys
        # and values checkpoints have stored since before either was an object.
        # epoch_steps only where set: the keys of a checkpoint without it stay what they were.
        fixed = {} if self.epoch_steps is None else {"epoch_steps": self.epoch_steps}
        samples = self._samples_sha256()
        which = {} if samples is None else {"samples_sha256": samples}
        return {"plan_version": PLAN_VERSION, **self.resolved.fingerprint(), **which,
                **self.settings.fingerprint(), **fixed}

    def _samples_sha256(self) -> str | None:
        """Digest of the index's sample keys and shard names (not their folders: a moved dataset is the
        same one), computed once; None for plain lengths."""
        if self._samples_digest is None and self._samples_source is not None:
            self._samples_digest = _sample_keys_digest(self._samples_source)
            self._samples_source = None   # the index's mmaps are not kept (or pickled) for it
        return self._samples_digest

    def natural_steps(self, epoch: int) -> int:
        """Steps epoch ``epoch`` needs, before any ``epoch_steps`` (planned, not cached)."""
        return plan_epoch(self.resolved, settings=self.settings, seed=self.seed,
                          epoch=_epoch_number(epoch)).num_steps

    def fix_epoch_steps(self, epochs: int, at_least: int = 0) -> int:
        """Plan every epoch into the same number of steps, the most any of epochs ``0 .. epochs - 1``
        needs (or ``at_least``), and return it. For loops that fix an epoch's steps from the first one,
        as the HF Trainer does: token-budget plans differ by a step or two from epoch to epoch, and the
        Trainer would stop an epoch early (a sample never trained) or resume at the wrong place. The
        shorter epochs get light steps at their end (:func:`tokenbal.balance.plan.pad_steps`)."""
        steps = max([int(at_least)] + [self.natural_steps(e) for e in range(positive_int("epochs", epochs))])
        self._set_epoch_steps(steps)
        return steps

    def _set_epoch_steps(self, steps: int) -> None:
        """``epoch_steps = steps``; the plans made without it are dropped."""
        if self.elastic:
            raise ValueError("epoch_steps and elastic=True do not go together: an elastic resume re-plans "
                             "the rest of an epoch into as many steps as it needs")
        if steps != self.epoch_steps:
            self._keep_position_under(steps)
            self.epoch_steps = steps
            self._plans.clear()
            with self._ahead_lock:
                self._ahead.clear()

    def _keep_position_under(self, steps: int) -> None:
        """Before ``epoch_steps`` becomes ``steps``: the current epoch's position must mean the same under
        the new cut. ``pad_steps`` moves samples out of earlier steps into the added ones, so a cursor in
        the middle of the epoch (a ``load_state_dict`` or batches already handed out) would continue on a
        plan whose first steps are not the ones trained: samples twice or never. That is refused; at an
        epoch's start nothing is lost, and a finished epoch stays finished."""
        if self.cursor == 0:
            return   # nothing handed out (or loaded) this epoch: the new cut is the epoch's from its start
        position = self.cursor
        if self._consumed is not None and self._consumed[0] == self.epoch:
            position = min(position, self._consumed[1])   # under track(): the batches the loop received
        current = self.plan()
        if current.num_steps == steps:
            return   # the same plan (pad_steps of the same natural plan into as many steps)
        total = current.num_steps * self.grad_accum
        if position < total:
            raise ValueError(
                f"epoch_steps cannot change from {self.epoch_steps} to {steps} at batch {position} of epoch "
                f"{self.epoch}'s {total}: the rest of the epoch would be cut differently from the batches "
                "already trained (samples twice or never). Set it before load_state_dict, or before the "
                "epoch's first batch")
        # A finished epoch stays finished under the new cut (all of its batches handed out / received).
        self.cursor = steps * self.grad_accum
        if self._consumed is not None and self._consumed[0] == self.epoch:
            self._consumed = (self.epoch, self.cursor)

    def state_dict(self) -> dict[str, Any]:
        cursor = self.cursor
        if self._consumed is not None and self._consumed[0] == self.epoch:
            cursor = self._consumed[1]   # under track(): what the loop received, not what was prefetched
        state = {"version": _STATE_VERSION, "seed": self.seed, "epoch": self.epoch,
                 "cursor": cursor, "fingerprint": self.fingerprint()}
        if self._segments:
            state["segments"] = [dict(seg) for seg in self._segments]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore seed, epoch and cursor. Raises ``ValueError`` naming every setting that differs
        from the checkpoint (world size, lengths, batch size, ...), since any of them changes the
        plan — except, with ``elastic=True``, the step settings (world size, batch size, token
        budget, grad_accum, window): the rest of the epoch is then re-planned for this setup."""
        _check_state(state)
        in_flight, driver = self._untracked_in_flight()
        reload = _same_position(state, self)
        if in_flight and not reload and not _outlives_its_loop(driver):
            # A loop over a plain DataLoader that read ahead is running (its iterator lives only as long as
            # the loop): its next batches were handed out before this load, and nothing can take them back.
            raise RuntimeError(_stale_batches_message(in_flight, self._handed, loaded=False))
        saved, mine = {**_ADDED_LATER, **state["fingerprint"]}, {**_ADDED_LATER, **self.fingerprint()}
        changed = [k for k in mine if saved.get(k, "<missing>") != mine[k]
                   and (k not in _WHEN_BOTH_HAVE or k in saved)
                   and not (k == "cost" and _user_costs(saved[k]) and _user_costs(mine[k]))]
        elastic = bool(changed) and self.elastic and set(changed) <= set(_ELASTIC_KEYS)
        if changed and not elastic:
            diffs = [f"{k}: checkpoint has {saved.get(k, '<missing>')!r}, this sampler has {mine[k]!r}"
                     + _CHANGED_HINTS.get(k, "") for k in changed]
            hint = ""
            if set(changed) <= set(_ELASTIC_KEYS):
                hint = ("\n(only the step settings differ: TokenBalancedBatchSampler(..., elastic=True) "
                        "re-plans the rest of the epoch for this setup)")
            raise SetupChangedError("cannot resume: the checkpoint was made with a different plan setup "
                                    "(the remaining steps would not match):\n  " + "\n  ".join(diffs), hint)
        segments = [{"fingerprint": {**_ADDED_LATER, **seg["fingerprint"]}, "cursor": int(seg["cursor"])}
                    for seg in state.get("segments", [])]
        cursor = int(state["cursor"])
        if elastic:
            segments.append({"fingerprint": saved, "cursor": cursor})
        if elastic:
            cursor = 0
        # The plan of a live iteration that has handed out its last batch (see the end of this method).
        ended_plan = self._plan_key() if self._finished_here else None
        previous = (self.seed, self.epoch, self._segments)
        self.seed, self.epoch, self._segments = int(state["seed"]), int(state["epoch"]), segments
        try:
            # Every setup's cursor must lie inside its own plan, or the replay is meaningless.
            for n, seg in enumerate(segments):
                batches = self._replan(segments[:n], self._setup_of(seg["fingerprint"]),
                                       self.epoch).num_steps * int(seg["fingerprint"]["grad_accum"])
                if not 0 <= seg["cursor"] <= batches:
                    raise ValueError(f"cursor {seg['cursor']} is outside epoch {self.epoch}'s {batches} "
                                     f"batches (setup {n} of the checkpoint)")
            steps = self.plan().num_steps * self.grad_accum
            if not 0 <= cursor <= steps:
                raise ValueError(f"cursor {cursor} is outside epoch {self.epoch}'s {steps} batches")
        except ValueError:
            self.seed, self.epoch, self._segments = previous   # a failed load changes nothing
            raise
        # A load into the plan the live iteration handed out to its end, at a batch before that end: with
        # num_workers=0 (and under track / prepare_loader) the loop's pass goes on at the loaded batch. A
        # DataLoader with workers asked for every batch before the loop received the last ones, has nothing
        # more to ask for, and ends its pass after them: the loaded batches would come only in a next pass,
        # which a loop takes for the next epoch (its set_epoch(e + 1) dropped them, with a warning).
        workers = self._reading_workers()
        past_end = None
        if not reload and workers is not None and ended_plan == self._plan_key() and cursor < steps:
            past_end = f"epoch {self.epoch}, batch {cursor} of {steps}"
            running = self._look_ahead_reader() is not None or not getattr(workers, "_shutdown", False)
            if not _outlives_its_loop(workers) and running:
                # Its iterator lives only as long as the loop, which is running (accelerate's prepared loader
                # holds it until its pass ends; else it is not shut down yet): refused, as a load there before
                # the sampler's end is (the batches its workers fetched ahead would reach the loop first).
                self.seed, self.epoch, self._segments = previous
                raise RuntimeError(_pass_ended_message(past_end, None))
        self._verified.clear()   # the loaded plan is checked again, even for an epoch seen before
        # A live iteration of the same plan goes on from the loaded batch; the batches it handed out before
        # the load and the loop has not received (a DataLoader's workers) are dropped by track(). (A reload
        # of the position the sampler is at leaves them: they come before it in any run.)
        if not reload:
            self._handed_at_load = self._handed
            self._loads += 1
        self._iter_start = (self.epoch, cursor)
        self.cursor = cursor
        # The middle of an epoch (a plain cursor, or an elastic history), for set_epoch to tell the loop
        # that moving to another epoch before iterating would drop it.
        self._loaded_position = None
        if (cursor > 0 or segments) and cursor < steps:
            self._loaded_position = (f"epoch {self.epoch}, batch {cursor} of {steps}" + (
                f", after {len(segments)} earlier setup(s) of the epoch" if segments else ""))
        self._finished_here = False
        self._consumed = None
        self._handing_out = False
        # Persistent workers: a live loop and one that has ended look the same here, so the load stands, and
        # set_epoch to another epoch before the loaded batches are handed out raises instead of dropping them.
        self._loaded_past_pass_end = past_end


class _Iteration:
    """One iteration of a sampler (what ``iter(sampler)`` returns): the plan's batches, handed out by
    :meth:`TokenBalancedBatchSampler._hand_out`, and, once they are all out, the stale-batch check at
    every further ``next()``. A DataLoader with workers asks its sampler iterator for one more batch as
    it gives the loop each batch, also after the iterator's end; with persistent workers a load made in
    the loop after the last batch was handed out is caught only there (a generator, once finished, runs
    no code again), before a batch fetched ahead of the load reaches the loop."""

    __slots__ = ("_batches", "_ended", "_sampler", "number", "planned")

    def __init__(self, sampler: TokenBalancedBatchSampler) -> None:
        self._sampler = sampler
        self._batches = sampler._hand_out(self)
        self._ended = False
        self.number = 0   # the sampler's count of iterations when this one started handing out (0: not yet)
        self.planned: tuple = ()   # the plan (seed, epoch, segments) it hands out, once it has started

    def __iter__(self) -> _Iteration:
        return self

    def __next__(self) -> list[int]:
        if not self._ended:
            try:
                return next(self._batches)
            except StopIteration:
                self._ended = True
                raise
        if self.number and self._sampler._iterations == self.number:
            self._sampler._refuse_stale_batches()   # still the sampler's live iteration
            self._sampler._refuse_moved_before_received(self.planned)
        raise StopIteration


def _check_state(state: Any) -> None:
    """A state dict as :meth:`TokenBalancedBatchSampler.state_dict` writes it, else ``ValueError``
    naming the key that is missing or of the wrong type (a checkpoint of something else, or damaged)."""
    if not isinstance(state, dict):
        raise ValueError(f"not a TokenBalancedBatchSampler state: a {type(state).__name__}, not a dict")
    missing = [k for k in ("seed", "epoch", "cursor", "fingerprint") if k not in state]
    if missing:
        raise ValueError(f"not a TokenBalancedBatchSampler state: missing {', '.join(missing)}")

    def integer(where: str, v: Any, low: int | None = 0) -> None:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or (low is not None and v < low):
            raise ValueError(f"not a TokenBalancedBatchSampler state: {where} is {v!r}, not an integer"
                             + (f" >= {low}" if low is not None else ""))

    version = state.get("version", _STATE_VERSION)   # states from before the field were version 1
    if isinstance(version, bool) or version != _STATE_VERSION:
        raise ValueError(f"not a state this tokenbal can read: state['version'] is {version!r}, this "
                         f"sampler reads version {_STATE_VERSION} (a newer tokenbal's checkpoint, or "
                         "damaged): resume with the tokenbal that saved it")
    integer("state['seed']", state["seed"], low=None)
    for key in ("epoch", "cursor"):
        integer(f"state[{key!r}]", state[key])
    if not isinstance(state["fingerprint"], dict):
        raise ValueError(f"not a TokenBalancedBatchSampler state: state['fingerprint'] is "
                         f"{state['fingerprint']!r}, not a dict")
    segments = state.get("segments", [])
    if not isinstance(segments, list):
        raise ValueError(f"not a TokenBalancedBatchSampler state: state['segments'] is {segments!r}, "
                         "not a list")
    for n, seg in enumerate(segments):
        if not isinstance(seg, dict) or not isinstance(seg.get("fingerprint"), dict) or "cursor" not in seg:
            raise ValueError(f"not a TokenBalancedBatchSampler state: state['segments'][{n}] is {seg!r}, not "
                             "{'fingerprint': dict, 'cursor': int}")
        integer(f"state['segments'][{n}]['cursor']", seg["cursor"])
        # An earlier setup is re-planned from its step settings (the rest are this sampler's).
        missing = [k for k in _ELASTIC_KEYS if k not in seg["fingerprint"]]
        if missing:
            raise ValueError(f"not a TokenBalancedBatchSampler state: state['segments'][{n}]['fingerprint'] "
                             f"has no {', '.join(missing)}")


def _same_position(state: dict[str, Any], sampler: TokenBalancedBatchSampler) -> bool:
    """``state`` is where ``sampler`` already is (a reload of its own state): the batches in flight are
    then the ones before that position, and come first in an uninterrupted run too."""
    return (state["seed"], state["epoch"], state["cursor"]) == (sampler.seed, sampler.epoch, sampler.cursor) \
        and not state.get("segments") and not sampler._segments


def _user_costs(name: Any) -> bool:
    """A fingerprint's ``cost`` that is the type name of costs the user gave (an ndarray, a Tensor, a
    list, a function): the type says nothing about the costs, whose digest (``lengths_sha256``) is
    compared instead. The named costs and the cost models are compared by name."""
    return isinstance(name, str) and name not in (*COST_NAMES, "FlopsModel", "StageCostModel")


def _has_sample_keys(data: Any) -> bool:
    """A :class:`tokenbal.TokenIndex` (or alike): per-sample keys and shard ids, and its shard paths."""
    return all(hasattr(data, a) for a in ("keys", "shard_ids", "shard_paths")) and not isinstance(data, dict)


def _sample_keys_digest(index: Any) -> str:
    """sha256 (16 hex digits) of every sample's key and shard file name, in row order."""
    h = hashlib.sha256()
    names = [os.path.basename(str(p)) for p in index.shard_paths]
    h.update(json.dumps(names).encode())
    h.update(np.ascontiguousarray(index.shard_ids, "<i8").tobytes())
    keys = index.keys
    blob, offsets = getattr(keys, "_blob", None), getattr(keys, "_off", None)
    if blob is not None and offsets is not None:   # a KeyList: its bytes as stored, in one pass
        h.update(np.ascontiguousarray(offsets, "<i8").tobytes())
        h.update(memoryview(np.ascontiguousarray(blob)).cast("B"))
    else:
        for key in keys:
            h.update(str(key).encode() + b"\0")
    return h.hexdigest()[:16]


def _outlives_its_loop(driver: Any) -> bool:
    """A DataLoader iterator its DataLoader keeps after a loop over it has ended: torch's with persistent
    workers, and every torchdata ``StatefulDataLoader``'s (kept for its ``state_dict``). At a load, a live
    loop and one broken out of look the same, so the stale-batch check waits for the next batch (see
    ``_refuse_stale_batches``) instead of refusing a load made after a ``break``."""
    kept_for_state = callable(getattr(driver, "state_dict", None))
    return bool(getattr(driver, "_persistent_workers", False)) or kept_for_state


def _stale_batches_message(in_flight: int, handed: int, loaded: bool) -> str:
    """Why a load inside a loop over a DataLoader that read ahead is refused, and what to do; ``loaded``:
    said at the next batch after a load that took effect (persistent workers), not at the load itself."""
    if loaded:
        after = ("With persistent_workers=True this is caught only at the next batch, and the load has "
                 "taken effect: iterating the loader again starts at the loaded batch. To roll back inside "
                 "the loop, iterate through sampler.track(loader) (with accelerate: "
                 "tokenbal.integrations.accelerate.prepare_loader), which drops the batches fetched "
                 "before a load")
    else:
        after = ("Either break out of the loop, load_state_dict, then iterate the loader again (the new "
                 "iteration starts at the loaded batch), or iterate through sampler.track(loader) (with "
                 "accelerate: tokenbal.integrations.accelerate.prepare_loader), which drops the batches "
                 "fetched before a load")
    return ("TokenBalancedBatchSampler.load_state_dict inside a loop over a DataLoader that has read ahead: "
            f"{in_flight} batches it fetched before the load (workers prefetch prefetch_factor x "
            f"num_workers, accelerate's prepared loader one more; the sampler had handed out {handed} "
            "batches of this pass) would reach the loop "
            "before the loaded ones, and be trained as if they were. " + after)


def _pass_ended_message(position: str, epoch: int | None) -> str:
    """Why a load after the sampler handed out its pass's last batch to a DataLoader that reads ahead of the
    loop is refused (``epoch`` None: at the load, inside the loop) or, with persistent workers, the
    ``set_epoch(epoch)`` after it; and what to do."""
    reader = "a DataLoader that reads ahead of the loop (workers, or accelerate's prepared loader around it)"
    if epoch is not None:
        what = (f"TokenBalancedBatchSampler.set_epoch({epoch}) after a load_state_dict of {position} made "
                f"once the sampler had handed out every batch of its pass to {reader}")
    else:
        what = (f"TokenBalancedBatchSampler.load_state_dict of {position} inside a loop over {reader}, after "
                "the sampler handed out the last batch of this pass")
    never = ", and moving to another epoch now would never train them" if epoch is not None else ""
    return (what + ": that DataLoader has nothing more to ask the sampler for, so its pass ends without the "
            "loaded batches" + never
            + " (with num_workers=0, or under sampler.track(loader) or prepare_loader, the loop goes on at "
            "the loaded batch in the same pass). " + (
                "Iterate the loader again first (it starts at the loaded batch; accelerate's prepared loader "
                "counts its passes as epochs: its set_epoch of the loaded epoch first), or iterate through "
                "sampler.track(loader) (with accelerate: prepare_loader); to leave that position, load a "
                "state of the epoch you want"
                if epoch is not None else
                "Either break out of the loop, load_state_dict, then iterate the loader again (the new "
                "iteration starts at the loaded batch), or iterate through sampler.track(loader) (with "
                "accelerate: tokenbal.integrations.accelerate.prepare_loader)"))


def _caller_frame(depth: int) -> Any:
    """The frame ``depth`` levels above the caller, or None when the stack is not that deep."""
    try:
        return sys._getframe(depth + 1)
    except ValueError:
        return None


def _dataloader_iterator(frame: Any, sampler: TokenBalancedBatchSampler) -> Any:
    """A weakref to the torch DataLoader iterator whose ``_next_index`` asked ``sampler`` for a batch from
    ``frame`` (the caller of the sampler's first ``next()``), or None when that is not a DataLoader
    iterating ``sampler`` itself: one whose batch sampler wraps it (groups its micro-batches into steps,
    as the VeOmni integration does) counts other batches than the sampler hands out."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    for _ in range(2):   # _next_index, or a subclass's (torchdata's StatefulDataLoader) calling it
        if frame is None:
            break
        caller = frame.f_locals.get("self")
        if isinstance(caller, _BaseDataLoaderIter):
            mine = _hands_on(getattr(caller, "_index_sampler", None), sampler)
            return weakref.ref(caller) if mine else None
        frame = frame.f_back
    return None


def _hands_on(batch_sampler: Any, sampler: TokenBalancedBatchSampler) -> bool:
    """``batch_sampler`` yields exactly ``sampler``'s batches: it is the sampler, or accelerate's
    ``BatchSamplerShard`` made a pass-through around it (``tokenbal.integrations.accelerate.neutralise``: one
    process, so every batch), which a DataLoader of a multi-process accelerate job iterates."""
    return batch_sampler is sampler or (getattr(batch_sampler, "batch_sampler", None) is sampler
                                        and getattr(batch_sampler, "num_processes", None) == 1)


def _look_ahead_reader(frame: Any, sampler: TokenBalancedBatchSampler) -> Any:
    """A weakref to accelerate's ``DataLoaderShard`` whose pass, on the stack above ``frame``, made the
    DataLoader iterator ask ``sampler`` for its first batch (its ``__iter__`` fetches each batch one step
    before it yields it, to mark the last one), or None."""
    for _ in range(16):   # the DataLoader iterator's own frames, then (workers) its construction
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        base = getattr(owner, "base_dataloader", None) if type(owner).__name__ == "DataLoaderShard" else None
        if base is not None:
            return weakref.ref(owner) if _hands_on(getattr(base, "batch_sampler", None), sampler) else None
        frame = frame.f_back
    return None


def _disagreements(views: list[dict[str, Any]]) -> list[str]:
    """One line per rank whose plan or cursor differs from rank 0's, naming what differs."""
    ref = views[0]
    lines = []
    for v in views[1:]:
        if (v["hash"], v["cursor"]) == (ref["hash"], ref["cursor"]):
            continue
        diff = [f"{k} (rank {ref['rank']}: {ref[k]!r}, rank {v['rank']}: {v[k]!r})"
                for k in ("seed", "epoch", "cursor") if v[k] != ref[k]]
        diff += [k for k in ref["fingerprint"] if v["fingerprint"].get(k) != ref["fingerprint"][k]]
        if v["segments"] != ref["segments"]:
            diff.append("segments (the elastic resume history of the checkpoint)")
        lines.append(f"rank {v['rank']} differs from rank {ref['rank']}"
                     + (f" in: {', '.join(diff)}" if diff else " (same settings: a planner bug)"))
    return lines


def _consumed(plan: EpochPlan, cursor: int) -> np.ndarray:
    """Dataset indices every rank was handed in the first ``cursor`` batches of ``plan`` (ranks move
    in lockstep: batch ``i`` is micro-batch ``i % k`` of step ``i // k`` on every rank)."""
    k, R = plan.grad_accum, plan.num_replicas
    steps, micro = divmod(int(cursor), k)
    parts = [plan.indices[:plan.offsets[steps * R * k]]]
    if micro and steps < plan.num_steps:
        parts += [plan.micro(steps, r, j) for r in range(R) for j in range(micro)]
    return np.concatenate(parts)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _resolve_world(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        elif num_replicas is None and rank is None:
            # One process (a notebook, a single-device run): the whole epoch is this rank's.
            num_replicas, rank = 1, 0
        else:
            # Half a pair would silently make this process rank 0 of N (or a rank of a world of 1).
            given, missing = ("num_replicas", "rank") if rank is None else ("rank", "num_replicas")
            raise ValueError(f"{given} given without {missing} and torch.distributed is not initialised: "
                             f"pass both, or neither for one process (num_replicas=1, rank=0)")
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, (int, np.integer)) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive integer, got {num_replicas!r}")
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be an integer in [0, {num_replicas}), got {rank!r}")
    return int(num_replicas), int(rank)


def _epoch_number(epoch: object) -> int:
    """An epoch as an int >= 0: integers, or a float that is one (a training loop's ``1.0``); a
    fractional, negative or non-number epoch is an error naming it, never truncated to another epoch."""
    if isinstance(epoch, float | np.floating) and float(epoch).is_integer():
        epoch = int(epoch)
    return nonneg_int("epoch", epoch)
