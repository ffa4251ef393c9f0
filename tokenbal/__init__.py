"""tokenbal: token-balanced sampling for multimodal LLM training.

Everything here knows about *samples*: how many tokens each one costs (``tokenbal.estimate``),
the on-disk token index (``tokenbal.index``), how to split work evenly and the DataLoader facade
(``tokenbal.balance``: cost, partition, plan, simulate, sampler). Heavy submodules load on
first use so that ``import tokenbal`` stays cheap in every DataLoader worker.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The library logs to the "tokenbal" logger and leaves handlers to the application (the CLI sets one).
logging.getLogger("tokenbal").addHandler(logging.NullHandler())

_LAZY = {
    "TokenIndex": "tokenbal.index",
    "TokenBalancedBatchSampler": "tokenbal.balance.sampler",
    "get_estimator": "tokenbal.estimate",
    "load_estimator": "tokenbal.estimate",
}
# Names that are modules: ``tokenbal.partition`` is the module whatever the import order, never the
# function inside it (``from tokenbal.partition import partition`` is the contract's spelling).
_SUBMODULES = {"partition": "tokenbal.partition"}

if TYPE_CHECKING:
    from tokenbal import partition
    from tokenbal.balance.sampler import TokenBalancedBatchSampler
    from tokenbal.estimate import get_estimator, load_estimator
    from tokenbal.index import TokenIndex

__all__ = ["TokenBalancedBatchSampler", "TokenIndex", "__version__", "get_estimator", "load_estimator",
           "partition"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    raise AttributeError(f"module 'tokenbal' has no attribute {name!r}")
