"""Deprecated old import path of :mod:`tokenbal.balance.sampler` (removed in tokenbal 0.3.0): the same module
object under this name, so imports, attribute access (module-level settings included) and pickles made
under either name keep working meanwhile. Import :mod:`tokenbal.balance.sampler` instead."""

import sys
import warnings

from tokenbal.balance import sampler as _module

# stacklevel=2: the warning names the importing line (the import system's own frames are skipped).
warnings.warn("tokenbal.sampler is deprecated and will be removed in tokenbal 0.3.0; "
              "import tokenbal.balance.sampler", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _module
