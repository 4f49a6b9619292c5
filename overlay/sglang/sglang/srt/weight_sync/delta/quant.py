"""Which quantized engines take weight syncs: those that compute with the very bytes their loader stored.

Every sync — full or delta — writes what the trainer sent through the model's ``load_weights``. SGLang runs each
layer's ``process_weights_after_loading`` once, at startup, and not after a weight update. So an engine whose
after-loading step re-quantizes or re-lays-out its weights computes with a layout no update writes: it is refused
before the first write, with the transform named. Accepted: FP8 checkpoints with block scales (``weight_block_size``,
slime's FP8 rollout: e4m3 weights + fp32 ``weight_scale_inv``) on the paths whose after-loading step keeps bytes and
layout (CUDA without UE8M0 scales: Hopper; CPU without AMX). The verdict is read from what the startup left on
the layers (scale formats, the quant method's flags, SGLang's platform switches), once per model.
"""

from __future__ import annotations

import sys
import weakref
from typing import Optional

import torch

from sglang.srt.weight_sync.delta.wire import DeltaError, Refusal

_UNQUANTIZED = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod"}
_FP8 = {"Fp8LinearMethod": ("weight",), "Fp8MoEMethod": ("w13_weight", "w2_weight")}
_VERDICTS: "weakref.WeakKeyDictionary[torch.nn.Module, Optional[str]]" = weakref.WeakKeyDictionary()


def check_quantization(model: torch.nn.Module) -> None:
    """Raise ``DeltaError(UNSUPPORTED)`` naming the first layer whose after-loading step transforms its weights."""
    if model not in _VERDICTS:
        _VERDICTS[model] = _verdict(model)
    if _VERDICTS[model] is not None:
        raise DeltaError(_VERDICTS[model], Refusal.UNSUPPORTED)


KV_SCALES = (".k_scale", ".v_scale")  # name suffixes of the KV-cache scales an FP8 engine holds as params


def check_names(names) -> None:
    """KV-cache scales (``*.k_scale``/``*.v_scale``) are read into floats once at startup: a sync cannot move them
    (slime's FP8 conversion does not emit them)."""
    for name in names:
        if name.endswith(KV_SCALES):
            raise DeltaError(f"param {name!r}: KV-cache scales are read once at engine startup; a weight sync cannot "
                             "change them (leave them out of the synced state)", Refusal.UNSUPPORTED)


def _verdict(model: torch.nn.Module) -> Optional[str]:
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kind = type(method).__name__
        if method is None:
            continue
        if getattr(module, "use_intel_amx_backend", False):
            why = "AMX weight packing (CPU)"
        elif kind in _UNQUANTIZED or any(c.__name__ == "BaseKVCacheMethod" for c in type(method).__mro__):
            continue  # KV-cache scales: no weight of the trainer's (a sync naming one is refused, check_names)
        else:
            why = _fp8_transform(method, module) if kind in _FP8 else \
                "a quantization method weight sync does not know (supported: FP8 checkpoints with block scales)"
        if why:
            return (f"layer {name!r} ({kind}): {why}; a weight sync writes the checkpoint's bytes, which this "
                    "engine no longer computes with")
    return None


def _fp8_transform(method, module) -> Optional[str]:
    """What this FP8 layer's after-loading step did to its weights, or None when it kept them as loaded."""
    config = getattr(method, "quant_config", None)
    platform = vars(sys.modules[type(method).__module__])
    if not getattr(config, "is_checkpoint_fp8_serialized", False):
        return "online FP8 quantization of a bf16 checkpoint (the engine quantizes after loading)"
    if not getattr(method, "block_quant", False):
        return ("per-tensor FP8 scales (after loading SGLang converts them per channel for CUTLASS/Marlin or "
                "re-quantizes fused shards to their largest scale)")
    if getattr(method, "use_mxfp8", False) or getattr(config, "use_mxfp8", False):
        return "MXFP8 (scales swizzled, or converted to block FP8, after loading)"
    if getattr(method, "block_fp8_as_mxfp8", False):
        return "block FP8 served as MXFP8 (derived weights built after loading)"
    if getattr(method, "is_fp4_expert", False):
        return "FP4 experts (re-laid-out after loading)"
    if platform.get("_is_fp8_fnuz") or platform.get("_use_aiter"):
        return "e4m3fnuz normalization / aiter weight shuffling (ROCm)"
    if platform.get("_is_npu"):
        return "NPU re-layout"
    if platform.get("_is_cpu"):
        return "AMX weight packing (CPU)"
    for weight in _FP8[type(method).__name__]:
        w, scale = getattr(module, weight, None), getattr(module, f"{weight}_scale_inv", None)
        if w is None or scale is None:
            return f"no {weight}/{weight}_scale_inv pair after loading"
        if w.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
            return f"{weight} stored as {w.dtype} with {scale.dtype} scales (re-laid-out after loading)"
        if getattr(scale, "format_ue8m0", False):
            return "block scales re-quantized to UE8M0 for DeepGEMM (Blackwell)"
    return None
