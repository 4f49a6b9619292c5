"""Speculative decoding: the draft model takes every request together with the target, as one model.

SGLang's EAGLE/MTP drafts (its NextN and MTP classes) load their own names from the target's checkpoint stream
(``mtp.*``, or the layer past the target's last) and hold the target's embedding and LM head as the same tensors
(``set_embed_and_head``). Once a draft is bound to its target (:func:`bind_draft`), the receiver serves
:class:`TargetAndDraft`: one module whose loader feeds every chunk to both models and whose parameters are both
models' (a shared tensor once). So a request is staged, written, read back, fingerprinted and committed once over
both, whole or not at all, and nothing is written twice. The scheduler binds at startup (:func:`bind_engine`),
before the first full sync records the views a delta writes through; an engine whose draft cannot be bound keeps
the reason, and every request to it is refused with it (:func:`refusal`).
"""

from __future__ import annotations

import inspect
import logging
from typing import List, Optional, Tuple

import torch

from sglang.srt.weight_sync.delta.quant import KV_SCALES

logger = logging.getLogger(__name__)

_PAIR = "_delta_target_and_draft"
_WHY = "_delta_draft_unsupported"
_NO_DRAFT_MODEL = ""  # an algorithm that drafts without a model (NGRAM): nothing of it can go stale


class TargetAndDraft(torch.nn.Module):
    """A target and its draft as the receiver sees them: ``target.*`` and ``draft.*`` params, shared ones once."""

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module):
        super().__init__()
        self.target, self.draft = target, draft

    def load_weights(self, weights):
        weights = list(weights)  # each loader takes its own names of the same chunk
        self.target.load_weights(weights)
        self.draft.load_weights(weights)

    def post_load_weights(self, weight_names=None):
        """Both models' re-derivations after direct writes (MLA's absorbed ``w_kc``/``w_vc``): each takes the names
        where its own takes them, and filters them as it does when it loads (DeepSeek's target keeps its layers,
        its NextN always re-derives its one layer)."""
        for m in members(self):
            post = getattr(m, "post_load_weights", None)
            if post is None:
                continue
            if weight_names is not None and "weight_names" in inspect.signature(post).parameters:
                post(weight_names=weight_names)
            else:
                post()


def members(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The models whose own loaders a request runs: the pair's two, or ``model``."""
    return [model.target, model.draft] if isinstance(model, TargetAndDraft) else [model]


def bind_draft(target: torch.nn.Module, draft: torch.nn.Module) -> TargetAndDraft:
    """From now on every entry point that is handed ``target`` or ``draft`` (a runner's model) applies, reads back,
    reports and fingerprints both together; a plain load into either breaks the pair's delta chain."""
    pair = TargetAndDraft(target, draft)
    for m in (target, draft):
        object.__setattr__(m, _PAIR, pair)  # not a submodule: the pair holds them
    return pair


def resolve(model: torch.nn.Module) -> torch.nn.Module:
    """``model``, or the pair it was bound into."""
    return getattr(model, _PAIR, model)


def draft_facts(model: torch.nn.Module, copies: dict, wrote_only_copies: bool) -> Tuple[List[str], List[str]]:
    """What a full sync did to a bound pair's own draft params (not the target's): the HF names it wrote only into
    them (the MTP/NextN layer), and the params no recorded copy wrote (not KV-cache scales, which no trainer sends),
    which keep what the draft loaded at startup. Those are known only where the loader wrote nothing but recorded
    copies (``wrote_only_copies``); else none are named. ``copies``: the full sync's recorded view copies, by name."""
    if not isinstance(model, TargetAndDraft):
        return [], []
    target = {id(p) for p in model.target.parameters()}
    own = sorted(n for n, cs in copies.items() if cs and all(id(c.param) not in target for c in cs))
    if not wrote_only_copies:
        return own, []
    skip = target | {id(c.param) for cs in copies.values() for c in cs}
    return own, [n for n, p in model.draft.named_parameters()
                 if p.numel() and id(p) not in skip and not n.endswith(KV_SCALES)]


def bind_engine(target_worker, spec_worker, server_args) -> Optional[TargetAndDraft]:
    """Hooked where the scheduler creates its speculative worker: bind its draft to the target, or keep on the
    target why it cannot be served (:func:`refusal` names it to every request)."""
    try:  # a hook in every engine's startup: whatever it meets, the engine starts (and upstream's modes run)
        target = target_worker.model_runner.model
        runners = draft_runners(spec_worker)
        why = _unsupported(target_worker.model_runner, runners, spec_worker, server_args)
        if why is None and runners:
            return bind_draft(target, runners[0].model)
        object.__setattr__(target, _WHY, _NO_DRAFT_MODEL if why is None else why)
    except Exception as e:  # the engine then refuses every delta, naming its draft as not bound
        logger.warning("delta: the speculative draft of %s could not be bound: %r", type(spec_worker).__name__, e)
    return None


def draft_runners(spec_worker) -> list:
    """The draft model runners of an SGLang speculative worker (both pins' shapes); none for NGRAM."""
    inner = getattr(spec_worker, "draft_worker", None)
    if inner is None:
        return []
    runners = getattr(inner, "draft_runners", None) or getattr(inner, "draft_runner_list", None)
    if runners is None:
        runners = [getattr(inner, "draft_runner", None) or getattr(inner, "draft_model_runner", None)]
    return [r for r in runners if r is not None]


def _unsupported(target_runner, runners: list, spec_worker, args) -> Optional[str]:
    """Why this engine's draft cannot take deltas with its target, or None."""
    name = type(spec_worker).__name__
    path = getattr(args, "speculative_draft_model_path", None)
    if path not in (None, getattr(args, "model_path", None)):
        return (f"{name}: the draft loads its own checkpoint ({path}), whose params are not in the trainer's "
                "weights (supported: drafts from the target's checkpoint, its MTP/NextN layers)")
    if getattr(args, "speculative_token_map", None):
        return (f"{name}: --speculative-token-map gives the draft an LM head gathered from the target's rows, "
                "a copy no delta reaches")
    if getattr(spec_worker, "draft_worker", None) is None:
        return None
    if len(runners) != 1:
        return (f"{name}: {len(runners)} draft model runners (one per draft step); a delta reaches one draft "
                "model")
    for what in ("dtype", "quantization"):
        mine, theirs = (getattr(getattr(r, "model_config", None), what, None) for r in (target_runner, runners[0]))
        if mine != theirs:
            return (f"{name}: the draft runs {what} {theirs}, the target {mine}; one weight sync carries one "
                    f"{what}")
    return None


def refusal(model: torch.nn.Module, algorithm: Optional[str]) -> Optional[str]:
    """Why a request to this engine is refused because of its speculative decoding, or None."""
    if not algorithm or isinstance(model, TargetAndDraft):
        return None
    why = getattr(model, _WHY, None)
    if why == _NO_DRAFT_MODEL:
        return None
    return f"speculative decoding ({algorithm}): " + (why or (
        "this engine's draft model is not bound to delta weight sync (draft.bind_draft), so it would keep its old "
        "weights while the target moves on"))


def selector_refusal(selector: Optional[str], algorithm: Optional[str]) -> Optional[str]:
    """A delta names a version of the whole engine: one that would leave out the draft (``selector``, v0.5.23's
    choice of runners) is refused, not applied to part of it."""
    if selector in (None, "all") or (selector == "target" and not algorithm):
        return None
    return (f"selector {selector!r}: a delta reaches the draft model only together with its target (selector "
            "'all')")

