"""``tokenbal.partition``: the public-contract path (DESIGN.md: ``from tokenbal.partition import
partition``) of :mod:`tokenbal.balance.partition`, kept without a deprecation warning. It is the same
package object under this name, so attribute access and pickles work under either name; the
project's own code imports :mod:`tokenbal.balance.partition`."""

import sys

from tokenbal.balance import partition as _module

sys.modules[__name__] = _module
