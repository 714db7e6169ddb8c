"""``hf-lisa train``'s arguments: the option dataclasses (:mod:`.arguments`, :mod:`.data_arguments`), a YAML/JSON
file under the command line (:mod:`.config_file`), which options each ``--method`` uses (:mod:`.options`) and the
numeric bounds (:mod:`.bounds`). Resolved and checked once, before anything loads."""
