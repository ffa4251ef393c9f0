"""Balancing: from per-sample lengths and a cost spec to the epoch plan every rank reads.

Data flow, one file per step:

* :mod:`tokenbal.balance.cost` — what a sample costs: resolves lengths / a ``TokenIndex`` and a cost
  spec (``"tokens"``, ``"flops"``, a model, an array) into int64 arrays, once, for everything below.
* :mod:`tokenbal.balance.settings` — :class:`~tokenbal.balance.settings.PlanSettings`: ranks, batch
  size or token budget, window, grad_accum, ...; frozen, checked once when made, carried by
  everything that plans.
* :mod:`tokenbal.balance.partition` — the solvers: one partition problem (``solvers``), many windows
  of steps at once (``window``), and the refinement of steps made of synchronised stages
  (``stages``). Arrays in, arrays out.
* :mod:`tokenbal.balance.plan` — :func:`~tokenbal.balance.plan.plan_epoch`: which samples every rank
  reads at every step, from the resolved arrays and the settings; one module per planning mode
  (``plan.counts``, ``plan.stages``, ``plan.budget``, ``plan.padded``).
* :mod:`tokenbal.balance.simulate` — balance metrics and the comparison with DistributedSampler and
  per-step partitioning (``tokenbal plan simulate``).
* :mod:`tokenbal.balance.sampler` — the DataLoader facade (:class:`TokenBalancedBatchSampler`).

Imports only go down this list (sampler → plan → partition, settings, cost; simulate → plan); argument
checks shared by them live in :mod:`tokenbal._checks`. ``tokenbal.partition`` (the public
contract's path) is this package's ``partition`` under its old name; the deprecated ``tokenbal.plan``,
``tokenbal.cost`` and ``tokenbal.sampler`` warn and go in tokenbal 0.3.0.
"""
