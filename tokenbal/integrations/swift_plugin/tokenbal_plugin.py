"""ms-swift ``--external_plugins`` file: ``swift sft`` trains on tokenbal's sampler with the default
options (:func:`tokenbal.integrations.swift.register`).
Its path: ``python -m tokenbal.integrations.swift``."""

from tokenbal.integrations.swift import register

register()
