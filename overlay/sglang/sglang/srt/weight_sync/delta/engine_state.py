"""What an engine knows about its own weights, and how the receiver reaches the model behind a hook site."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from sglang.srt.weight_sync.delta import draft, fingerprint
from sglang.srt.weight_sync.delta.views import WritePlan


@dataclasses.dataclass
class ReceiverState:
    """What an engine knows about its own weights; lives beside the model, not on the runner.

    (v0.5.23's ``WeightUpdater`` is a frozen slots dataclass and cannot hold new attributes.)
    """

    version: Optional[int] = None  # committed version; None until the first full sync
    pending: Optional[int] = None  # version whose flushes are being applied
    pending_key: tuple = ()  # (base_version, full, encoding, sources) every request of it shares
    next_flush: Dict[int, int] = dataclasses.field(default_factory=dict)  # per source of the pending version
    finals: set = dataclasses.field(default_factory=set)  # sources whose final request arrived
    dirty: bool = False
    outside_load: Optional[str] = None  # a plain weight load since the last sync broke the chain
    released: bool = False  # weight memory released without a host copy: no generation until a full sync
    draft_unwritten: int = 0  # a bound draft's own params the last full sync wrote nothing into
    draft_names: List[str] = dataclasses.field(default_factory=list)  # names only a bound draft's params hold
    manifest: Optional[Dict[str, Tuple[List[int], str]]] = None
    pending_manifest: Dict[str, Tuple[List[int], str]] = dataclasses.field(default_factory=dict)
    max_payload_bytes: int = 0  # bound on one decompressed flush, from the model's size (see _max_file_bytes)
    recorder: Optional[fingerprint.FingerprintRecorder] = None  # watching the full sync being applied
    copies: Optional[dict] = None  # where the last full sync's HF tensors landed (fingerprint.engine_shares)
    direct: Optional[dict] = None  # name -> [Direct]: params a delta writes through those views, no loader call
    plan: Optional[WritePlan] = None  # ``direct`` as rows of integers: a run's writes in one pass per storage
    unheld: frozenset = frozenset()  # names the full sync's loader took without writing anything (other ranks' experts)
    last: tuple = (None, None, None)  # ([version, flush], refusal code or None, received) of the last request
    xor_ready: bool = False  # every param this rank loaded has direct views of its own dtype (xor_zstd bases)
    xor_raw: List[str] = dataclasses.field(default_factory=list)  # names this rank's loader never stored
    dense: List[str] = dataclasses.field(default_factory=list)  # byte-sparse names without recorded views
    changed: set = dataclasses.field(default_factory=set)  # names changed so far in the pending version
    post_pending: set = dataclasses.field(default_factory=set)  # written directly, not yet post-processed
    applied: Dict[str, int] = dataclasses.field(default_factory=dict)  # versions committed, by kind (full, delta)
    store_chain: Optional[str] = None  # the version store's chain id this engine follows (once it caught up from one)
    store_manifest: Optional[Tuple[int, str]] = None  # (version, manifest digest) it last applied from the store
    timing: Dict[str, float] = dataclasses.field(default_factory=dict)  # the last catch-up's stage and commit


_STATES: "weakref.WeakKeyDictionary[torch.nn.Module, ReceiverState]" = weakref.WeakKeyDictionary()


def receiver_state(model: torch.nn.Module) -> ReceiverState:
    return _STATES.setdefault(model, ReceiverState())


def host_runner(host):
    """The ModelRunner behind a hook site (v0.5.23 hooks sit on its WeightUpdater)."""
    get = getattr(host, "get_model_runner", None)
    return get() if get is not None else host


def host_model(host) -> torch.nn.Module:
    """The model a request is applied to: the runner's, or it and its bound draft as one (``draft.bind_draft``)."""
    get = getattr(host, "get_model", None)
    return draft.resolve(get() if get is not None else host.model)


def host_device(host) -> torch.device:
    return torch.device(host.device) if isinstance(host.device, str) else host.device


def server_arg(host, name: str, default):
    args = getattr(host_runner(host), "server_args", None)
    value = getattr(args, name, None)
    return default if value is None else value
