"""Deprecated old import path of :mod:`tokenbal.balance.cost` (removed in tokenbal 0.3.0): the same module
object under this name, so imports, attribute access (module-level settings included) and pickles made
under either name keep working meanwhile. Import :mod:`tokenbal.balance.cost` instead."""

import sys
import warnings

from tokenbal.balance import cost as _module

# stacklevel=2: the warning names the importing line (the import system's own frames are skipped).
warnings.warn("tokenbal.cost is deprecated and will be removed in tokenbal 0.3.0; "
              "import tokenbal.balance.cost", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
