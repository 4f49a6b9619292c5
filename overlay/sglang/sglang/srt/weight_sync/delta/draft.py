"""Speculative decoding: the draft model takes every request together with the target, as one model.

SGLang's EAGLE/MTP drafts (its NextN and MTP classes) load their own names from the target's checkpoint stream
(``mtp.*``, or the layer past the target's last) and hold the target's embedding and LM head as the same tensors
(``set_embed_and_head``). Once a draft is bound to its target (:func:`bind_draft`), the receiver serves
:class:`TargetAndDraft`: one module whose loader feeds every chunk to both models and whose parameters are both
models' (a shared tensor once). So a request is staged, written, read back, fingerprinted and committed once over
both, whole or not at all, and nothing is written twice. Bind before the engine's first full sync: the views a delta
writes through are recorded then.
"""

from __future__ import annotations

import torch

_PAIR = "_delta_target_and_draft"


class TargetAndDraft(torch.nn.Module):
    """A target and its draft as the receiver sees them: ``target.*`` and ``draft.*`` params, shared ones once."""

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module):
        super().__init__()
        self.target, self.draft = target, draft

    def load_weights(self, weights):
        weights = list(weights)  # each loader takes its own names of the same chunk
        self.target.load_weights(weights)
        self.draft.load_weights(weights)


def bind_draft(target: torch.nn.Module, draft: torch.nn.Module) -> TargetAndDraft:
    """From now on every entry point that is handed ``target`` (the runner's model) applies, reads back, reports and
    fingerprints it and ``draft`` together."""
    pair = TargetAndDraft(target, draft)
    object.__setattr__(target, _PAIR, pair)  # not a submodule of the target: the pair holds the target
    return pair


def resolve(model: torch.nn.Module) -> torch.nn.Module:
    """``model``, or the pair it was bound into."""
    return getattr(model, _PAIR, model)


def post_processed(model: torch.nn.Module) -> list:
    """The models of a bound pair whose loaders re-derive params after loading (``post_load_weights``: MLA's
    absorbed projections), which the pair cannot run yet."""
    if not isinstance(model, TargetAndDraft):
        return []
    return [type(m).__name__ for m in (model.target, model.draft) if hasattr(m, "post_load_weights")]
