"""CPU-only test venvs: make SGLang's import path work on a CPU torch build.

Loaded from a ``.pth`` so it reaches SGLang's spawned scheduler processes too. It only
touches module attributes after import (no SGLang source is changed):

* ``sglang.srt.layers.rotary_embedding.base._is_cpu = True`` — native torch RoPE instead of
  the CUDA custom ops. ``SGLANG_USE_CPU_ENGINE=1`` is not an option: it hard-imports sgl_kernel.
* PyPI's torchvision links CUDA libraries; defining its two op schemas before it imports lets
  ``import torchvision`` (pulled in by transformers) succeed.

Set ``SGL_CPU_SHIM=0`` to disable. Never installed into an image.
"""
import importlib.abc
import os
import sys

_AFTER_IMPORT = {}


def _after(modname):
    def deco(fn):
        _AFTER_IMPORT[modname] = fn
        return fn

    return deco


@_after("sglang.srt.layers.rotary_embedding.base")
def _native_rope(module):
    module._is_cpu = True


def _define_torchvision_ops():
    if "_TV_LIB" in globals():  # find_spec may be asked about torchvision more than once
        return
    import torch

    try:
        if torch._C._dispatch_has_kernel_for_dispatch_key("torchvision::nms", "CPU"):
            return
    except RuntimeError:
        pass
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    globals()["_TV_LIB"] = lib  # keep the library alive


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, name):
        self.inner, self.name = inner, name

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _AFTER_IMPORT[self.name](module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            _define_torchvision_ops()
            return None
        if name not in _AFTER_IMPORT:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, name)
                return spec
        return None


if os.environ.get("SGL_CPU_SHIM", "1") != "0" and not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
