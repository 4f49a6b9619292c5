"""Delta weight sync: send only the weight elements whose bytes changed, overwrite them bit-exactly.

Modules, by side:

* both: ``wire`` (the contract: spec, status, refusal codes, checksum), ``positions`` (position codecs), ``files``
  (safetensors, zstd, planes, xor), ``ops`` (shared tensor ops), ``mix64`` (the checksum's and the fingerprint's
  sums), ``fingerprint``, ``collectives``;
* engine: ``receiver`` (hooked into SGLang's model runner) with ``validate``, ``ingest``, ``versions``, ``views``,
  ``engine_state``, ``write_guard``, ``quant``, ``prefix_cache``;
* trainer: ``sender`` with ``diff`` (the diff and a flush's encode) and ``transport``; ``tools`` (the command line).
"""
