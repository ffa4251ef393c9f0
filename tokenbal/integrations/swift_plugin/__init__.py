"""The folder of ms-swift's ``--external_plugins`` file for tokenbal (``tokenbal_plugin.py``). ms-swift
puts a plugin file's folder first on ``sys.path``; this folder holds nothing else, so no module of
``tokenbal/integrations`` (``accelerate.py``, ``swift.py``) can shadow a package of the same name."""
