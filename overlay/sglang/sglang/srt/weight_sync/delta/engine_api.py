"""The one interface the trainer's side calls on a rollout engine, whatever carries the calls.

A sender and its transports see every engine through :class:`DeltaEngine`: a patched server over HTTP
(``transport.HttpEngine``), slime's ``SGLangEngine`` Ray actor (its delta updater's ``_RayEngine``), a model in this
process (the CPU harness), a model across a pipe (the GPU check). The sender decides on :meth:`DeltaEngine.status`
alone; an exception from any call counts as that engine's failure. Pausing is not part of it: a caller that pauses the
engines itself (slime) hands the sender a gate and a release; an engine that also has ``pause_generation`` and
``continue_generation`` is paused by the sender around a sync.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

from sglang.srt.weight_sync.delta.wire import DeltaStatus

__all__ = ["DeltaEngine"]


class DeltaEngine:
    """Status, stage, commit and catch up on one engine (all its TP ranks). An implementation that cannot carry a
    call leaves it to this base, which raises ``NotImplementedError`` naming it."""

    def status(self) -> List[DeltaStatus]:
        """Every rank's structured delta status (``/weights_checker`` ``delta_status``)."""
        raise self._cannot("status")

    def fingerprint(self) -> List[dict]:
        """Every rank's share of the weight fingerprint (``/weights_checker`` ``delta_fingerprint``)."""
        raise self._cannot("fingerprint")

    def stage(self, request: dict) -> List[DeltaStatus]:
        """Fetch one publish's files while serving (``/weights_checker`` ``delta_stage``); the status after."""
        raise self._cannot("stage")

    def update_weights_from_disk(self, model_path: str, files: List[str], weight_version: str,
                                 store: Optional[dict] = None) -> Tuple[bool, str]:
        """Commit one published request (``/update_weights_from_disk``, load format ``delta``), or with ``store``'s
        ``requests`` every publish of a version the engine fetched, taken whole: ``(ok, message)``."""
        raise self._cannot("update_weights_from_disk")

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name: str, delta: dict,
                                        weight_version: str) -> Tuple[bool, str]:
        """Receive one broadcast flush from the weight-update group and commit it: ``(ok, message)``."""
        raise self._cannot("update_weights_from_distributed")

    def catch_up(self, store_url: str, weight_version: Optional[str] = None) -> Tuple[bool, str]:
        """Bring the engine to ``weight_version`` (None: the store's ``HEAD``) from a version store by itself: a
        commit request that names the store and no files."""
        return self.update_weights_from_disk(store_url, [], weight_version, store={"catch_up": True})

    def _cannot(self, call: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__} cannot carry {call}")
