"""Old import path of :mod:`tokenbal.balance.sampler`: the same module object under this name, so imports,
attribute access (module-level settings included) and pickles made under either name keep working."""

import sys

from tokenbal.balance import sampler as _module

sys.modules[__name__] = _module
