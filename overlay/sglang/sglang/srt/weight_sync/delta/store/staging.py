"""A follower's next version fetched and digest-checked while the engine serves, so the catch-up that commits it
(under the server's update lock) reads nothing from the store.

``/weights_checker`` action ``delta_stage`` starts a thread on the engine's first TP rank (the rank a catch-up reads
on) that plans the catch-up to the ``HEAD`` of the store it last caught up from, exactly as the catch-up will, and
reads each object of its delta versions, checked against the digest its MAC'd manifest names, into host memory: at
most ``--update-weight-delta-stage-bytes``, the rest left to the commit. Nothing here touches a weight, the engine's
state or the TP group (the thread runs beside the scheduler's own collectives). The catch-up then takes an object
from the stage only under the same key *and* digest its own plan names, so a stage can never put anything in a
version that the commit's own verified walk does not; a stage that a commit or a newer stage supersedes is dropped.
An anchor is never staged: an engine that needs one does not serve yet.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from typing import Dict, Optional, Tuple

import torch

from sglang.srt.weight_sync.delta.collectives import tp_group
from sglang.srt.weight_sync.delta.engine_state import host_model, receiver_state, server_arg
from sglang.srt.weight_sync.delta.ingest import max_request_bytes
from sglang.srt.weight_sync.delta.wire import DeltaError, Refusal

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_STAGE_BYTES", "StoreStage", "count_read", "holds", "keep", "remember", "report", "stage_bytes",
           "stage_of", "start", "take"]

DEFAULT_STAGE_BYTES = 4 << 30


def stage_bytes(host) -> int:
    """The most object bytes an engine holds staged in host memory (``--update-weight-delta-stage-bytes``)."""
    return int(server_arg(host, "update_weight_delta_stage_bytes", DEFAULT_STAGE_BYTES))


@dataclasses.dataclass
class StoreStage:
    """What the engine has staged from its store: verified object bytes by (key, digest), and how it went."""

    objects: Dict[Tuple[str, str], bytes] = dataclasses.field(default_factory=dict)
    version: Optional[int] = None  # the target whose objects are all here (None: none, or still fetching)
    fetching: Optional[int] = None  # the target being fetched now
    staged_bytes: int = 0
    stage_s: float = 0.0
    error: Optional[str] = None  # the last stage's failure (a refusal of the commit's own walk will say it again)
    source: Optional[tuple] = None  # (url, key, bound, max object bytes) of the engine's last catch-up
    kept: set = dataclasses.field(default_factory=set)  # objects the commit itself read and keeps (not staged)
    taken_bytes: int = 0  # the current catch-up's objects taken from the stage
    read_bytes: int = 0  # and read from the store inside it
    thread: Optional[threading.Thread] = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def drop(self) -> None:
        with self.lock:
            self.objects, self.kept, self.version, self.staged_bytes = {}, set(), None, 0


_STAGES: "weakref.WeakKeyDictionary[torch.nn.Module, StoreStage]" = weakref.WeakKeyDictionary()


def stage_of(model: torch.nn.Module) -> StoreStage:
    return _STAGES.setdefault(model, StoreStage())


def start(model: torch.nn.Module) -> dict:
    """Start staging ``HEAD`` of the store the engine last caught up from, unless a stage is under way; this rank's
    report. Ranks but the first stage nothing (a catch-up reads on the first and broadcasts)."""
    stage = stage_of(model)
    if stage.source is None:
        raise DeltaError("delta_stage: this engine has not caught up from a version store yet (its first catch-up "
                         "loads an anchor, before it serves)", Refusal.UNSUPPORTED)
    group = tp_group()
    held = dataclasses.replace(receiver_state(model))  # the plan reads these fields; the state moves on apart
    if (group is None or group.rank_in_group == 0) and (stage.thread is None or not stage.thread.is_alive()) and \
            held.version is not None:
        stage.fetching = held.version + 1  # under way from here: the thread names the target once it has planned
        stage.error = None  # the last stage's failure is this one's, from here
        stage.thread = threading.Thread(target=_run, args=(stage, held, *stage.source), name="delta-store-stage",
                                        daemon=True)
        stage.thread.start()
    return report(model)


def remember(host, url: str) -> None:
    """Where a catch-up read, and its settings: what a later stage of this engine reads from."""
    from sglang.srt.weight_sync.delta.store.catch_up import store_key

    model = host_model(host)
    stage = stage_of(model)
    stage.source = (url, store_key(host), stage_bytes(host), max_request_bytes(model))
    with stage.lock:
        stage.taken_bytes = stage.read_bytes = 0


def report(model: torch.nn.Module) -> dict:
    stage = stage_of(model)
    return {"staged": stage.version, "fetching": stage.fetching, "staged_bytes": stage.staged_bytes,
            "stage_s": round(stage.stage_s, 6), "error": stage.error}


def take(model: torch.nn.Module, key: str, sha: str) -> Optional[bytes]:
    """The staged bytes of ``key`` if they were staged under digest ``sha`` (checked against it as they were read;
    ``bytes`` do not change after), else None: the caller reads the store, inside the commit."""
    stage = _STAGES.get(model)
    if stage is None:
        return None
    with stage.lock:
        data = stage.objects.get((key, sha))
        if data is not None and (key, sha) not in stage.kept:
            stage.taken_bytes += len(data)
    return data


def holds(model: torch.nn.Module, key: str, sha: str) -> bool:
    stage = _STAGES.get(model)
    return stage is not None and (key, sha) in stage.objects


def keep(model: torch.nn.Module, key: str, sha: str, data: bytes) -> None:
    """An object a commit read and digest-checked: held for the same commit to take, where the bound allows."""
    stage = stage_of(model)
    bound = stage.source[2] if stage.source else 0
    with stage.lock:
        if stage.staged_bytes + len(data) <= bound:
            stage.objects[(key, sha)] = data
            stage.kept.add((key, sha))
            stage.staged_bytes += len(data)


def count_read(model: torch.nn.Module, nbytes: int) -> None:
    """Bytes a commit read from the store itself (not staged)."""
    stage = stage_of(model)
    with stage.lock:
        stage.read_bytes += nbytes


def _run(stage: StoreStage, held, url: str, key, bound: int, max_bytes: int) -> None:
    from sglang.srt.weight_sync.delta.store import catch_up
    from sglang.srt.weight_sync.delta.store.objects import open_store
    from sglang.srt.weight_sync.delta.store.reads import read_object

    t0 = time.perf_counter()
    try:
        store = open_store(url)
        plan = catch_up.plan_catch_up(store, key, held, None)
        steps = plan["steps"]
        if not steps or steps[0]["kind"] == "anchor":
            return  # nothing to do, or an anchor: the engine does not serve until it loaded one
        stage.fetching = plan["target"]
        if stage.version is not None and stage.version >= plan["target"]:
            return
        stage.drop()  # a newer target supersedes what is staged
        objects, size = {}, 0
        for step in steps:
            for entries in step["requests"]:
                for name, nbytes, sha in entries:
                    okey = f"{step['dir']}/{name}"
                    if size + int(nbytes) > bound:  # past the bound: the commit reads the rest
                        raise _Bounded()
                    objects[(okey, sha)] = read_object(store, okey, sha, max_bytes)
                    size += len(objects[(okey, sha)])
        complete = True
    except _Bounded:
        complete = False
    except Exception as e:  # the commit's own walk reads and refuses it again, with its code
        stage.error = f"{e}"
        logger.warning("delta stage from %s: %s", url, e)
        return
    finally:
        stage.fetching = None
    with stage.lock:
        stage.objects, stage.kept, stage.staged_bytes = objects, set(), size
        stage.version = plan["target"] if complete else None
        stage.stage_s, stage.error = time.perf_counter() - t0, None
    logger.info("delta stage: version %s, %d bytes in %.3f s%s", plan["target"], size, stage.stage_s,
                "" if complete else " (the rest past --update-weight-delta-stage-bytes is read at the commit)")


class _Bounded(Exception):
    """The stage reached its bound: what it holds is kept, the rest is read at the commit."""
