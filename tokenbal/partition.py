"""Old import path of :mod:`tokenbal.balance.partition`: the same package object under this name, so
``from tokenbal.partition import partition`` and attribute access keep working."""

import sys

from tokenbal.balance import partition as _module

sys.modules[__name__] = _module
