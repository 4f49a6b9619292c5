"""Delta weight sync: send only the weight elements whose bytes changed, overwrite them bit-exactly.

Modules: ``wire`` (the format both sides speak), ``receiver`` (hooked into SGLang's model runner).
"""
