"""What the framework integrations share: a sampler that follows the framework's epoch on resume.

verl, VeOmni and torchtitan compute the epoch to resume from the global step
(``start_epoch = step // steps_per_epoch``), call ``set_epoch(start_epoch)`` and only then iterate
the ``StatefulDataLoader``, which restores the saved sampler state at that first iteration. A
checkpoint taken after an epoch's last step holds (epoch e, cursor = end); restored as it is, the
sampler would re-select epoch e with nothing left, and the epoch the framework asked for (e + 1)
would yield no batch at all. :class:`EpochFollowingSampler` restores such a finished earlier epoch as
the start of the epoch the framework has set (the checkpoint is still checked against this plan).
"""

from __future__ import annotations

from typing import Any

from tokenbal.balance.sampler import TokenBalancedBatchSampler

__all__ = ["EpochFollowingSampler"]


class EpochFollowingSampler(TokenBalancedBatchSampler):
    """:class:`~tokenbal.TokenBalancedBatchSampler` whose ``load_state_dict`` of a finished epoch
    that is older than the last ``set_epoch`` starts that newer epoch at step 0 instead."""

    _asked_epoch: int | None = None
    framework = "framework"   # named in the message of a refused resume (set by the integration)

    def set_epoch(self, epoch: int) -> None:
        self._asked_epoch = int(epoch)
        super().set_epoch(epoch)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            super().load_state_dict(state)
        except ValueError as e:
            # The sampler's hint (elastic=True re-plans for a new world) is no option of these
            # integrations: say what the user of the framework can do instead.
            text = getattr(e, "problem", str(e))   # SetupChangedError: without elastic=True's hint
            raise ValueError(f"{text}\n(tokenbal's {self.framework} loader resumes only with the "
                             "checkpoint's data-parallel size, batch size, gradient accumulation and data: "
                             "restart with those, or start a new run)") from None
        asked = self._asked_epoch
        if asked is not None and self.epoch < asked and self.cursor >= len(self):
            super().set_epoch(asked)
