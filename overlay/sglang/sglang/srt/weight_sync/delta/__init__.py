"""Delta weight sync: send only the weight elements whose bytes changed, overwrite them bit-exactly.

Modules: ``wire`` (the format both sides speak); the engine side ``receiver`` (hooked into SGLang's model
runner) with ``ingest``, ``versions``, ``views``, ``engine_state``, ``write_guard``; the trainer side
``sender`` and ``transport``; ``fingerprint`` and ``collectives`` serve both.
"""
