"""An engine that follows a version store by itself (``--update-weight-store URL``, or a model path that is one of
the store's anchors), in its HTTP server's process.

A task polls the store's ``HEAD`` every ``--update-weight-store-poll-s`` seconds and, whenever the engine is behind,
first has it fetch and digest-check the next version while it serves (``/weights_checker`` action ``delta_stage``,
``store.staging``), then asks it to catch up through the ordinary update path (``/update_weights_from_disk`` with
``store: catch_up``: the tokenizer manager's writer lock keeps generation off the model while the catch-up commits
what was staged). Until its first
catch-up succeeds, and whenever it is more than ``--update-weight-store-max-lag`` versions behind ``HEAD`` (-1: no
bound), the engine is *stale*: ``/health`` answers 503 with the lag (a router takes it out), and new generation
requests are refused; so is an engine a failed catch-up left holding a mix of versions (its status: dirty). An RL
run bounds how off-policy its rollouts get with that flag.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Optional

from sglang.srt.weight_sync.delta.store.manifest import RECORD_CAP, StoreKey, open_record, read_head
from sglang.srt.weight_sync.delta.store.objects import open_store

logger = logging.getLogger(__name__)


class StoreWatch:
    """What the server process knows of its engine against the store: ``HEAD``, the engine's version, the lag."""

    def __init__(self, tokenizer_manager, url: str, key: StoreKey, max_lag: int, poll_s: float, stage: bool = True):
        self.tm, self.url, self.max_lag, self.poll_s, self.stage = tokenizer_manager, url, max_lag, poll_s, stage
        self.store, self.key = open_store(url), key
        self.head: Optional[int] = None
        self.caught_up = False  # the first catch-up succeeded: the engine holds a version of this store
        self.error = ""

    @property
    def version(self) -> Optional[int]:
        """The engine's weight version as its server reports it (v0.5.23 keeps it in its config context)."""
        read = getattr(self.tm, "config_value", None)
        v = read("weight_version") if read is not None else getattr(self.tm.server_args, "weight_version", None)
        return int(v) if isinstance(v, str) and v.isdigit() else None

    @property
    def lag(self) -> Optional[int]:
        if self.head is None or self.version is None:
            return None
        return self.head - self.version

    def stale(self) -> bool:
        if not self.caught_up:
            return True
        lag = self.lag
        return self.max_lag >= 0 and (lag is None or lag > self.max_lag)

    def report(self) -> dict:
        return {"stale": self.stale(), "version": self.version, "head": self.head, "max_lag": self.max_lag,
                "store": self.url, "error": self.error}

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception as e:  # the store unreachable, a record refused: stay as we are, try again
                self.error = f"{e}"
                logger.error("version store watch: %s", e)
            await asyncio.sleep(self.poll_s)

    async def step(self) -> None:
        head, _ = await asyncio.to_thread(read_head, self.store, self.key)
        if head is None:
            self.error = "the store holds no version yet"
            return
        self.head = head[0]
        if self.caught_up and self.version is not None and self.version >= self.head:
            return
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        if self.caught_up and self.stage:  # serving: the next version is fetched while it does; the lock: the commit
            await self._stage()
        req = UpdateWeightFromDiskReqInput(model_path=self.url, load_format="delta", files=[],
                                           weight_version=str(self.head), store={"catch_up": True})
        out = await self.tm.update_weights_from_disk(req, None)
        ok, msg = out[0], out[1]
        if ok:
            self.caught_up, self.error = True, ""
            logger.info("version store watch: at version %s (%s)", self.head, msg)
        else:
            self.error = msg
            logger.error("version store watch: catch-up to version %s refused: %s", self.head, msg)
            if await self._needs_full():  # it stopped part-way: a mix of versions is nothing to serve
                self.caught_up = False

    async def _stage(self) -> None:
        """Have the engine fetch and digest-check ``HEAD``'s version (``store.staging``) and wait until it has,
        serving all along; whatever it could not stage, the commit reads itself."""
        from sglang.srt.managers.io_struct import CheckWeightsReqInput
        from sglang.srt.weight_sync.delta.wire import DeltaStatus

        action = "delta_stage"
        while True:
            out = await self.tm.check_weights(CheckWeightsReqInput(action=action), None)
            if not out[0]:
                logger.warning("version store watch: the engine did not stage: %s", out[1])
                return
            if all(r.staging is None for r in DeltaStatus.from_checker(out[2] or [])):
                return
            action = "delta_status"
            await asyncio.sleep(min(self.poll_s, 0.05))

    async def _needs_full(self) -> bool:
        """Whether any rank of the engine holds weights no version explains (dirty, or never synced)."""
        from sglang.srt.managers.io_struct import CheckWeightsReqInput
        from sglang.srt.weight_sync.delta.wire import DeltaStatus

        out = await self.tm.check_weights(CheckWeightsReqInput(action="delta_status"), None)
        return any(r.needs_full for r in DeltaStatus.from_checker(out[2] or []))


_WATCH: Optional[StoreWatch] = None
_ANCHOR_DIR = re.compile(r"anchor_v\d{6}-[0-9a-f]+")  # an anchor's directory: ``manifest.anchor_dir`` + a publish id


def anchor_store(model_path: str, key: StoreKey) -> Optional[str]:
    """The store whose anchor ``model_path`` is (a directory or ``s3://`` prefix named ``anchor_v<N>-<id>`` holding
    an anchor record that verifies under ``key``), else None."""
    root, _, leaf = str(model_path).rstrip("/").rpartition("/")
    if not root or not _ANCHOR_DIR.fullmatch(leaf):
        return None
    try:
        open_record(open_store(root).get(f"{leaf}/manifest.json", RECORD_CAP), key, f"anchor {model_path}", "anchor")
    except Exception as e:  # not an anchor of a store: a model path like any other
        logger.warning("model path %s looks like a store's anchor, but its record does not verify: %s", model_path, e)
        return None
    return root


def start(tokenizer_manager, server_args) -> None:
    """Hooked at the HTTP server's start: follow ``--update-weight-store`` if it is set, or the store whose anchor
    the model path is. Its first catch-up reads that anchor again through the checked path: SGLang's own load of
    the model path checks no digest."""
    global _WATCH
    url = getattr(server_args, "update_weight_store", None)
    model_path = str(getattr(server_args, "model_path", ""))
    if not url and not _ANCHOR_DIR.fullmatch(model_path.rstrip("/").rpartition("/")[2]):
        return  # no store to follow: the key file is not read
    key = StoreKey.from_file(getattr(server_args, "update_weight_store_key_file", None))
    url = url or anchor_store(model_path, key)
    if not url:
        return
    _WATCH = StoreWatch(tokenizer_manager, url, key,
                        int(getattr(server_args, "update_weight_store_max_lag", -1)),
                        float(getattr(server_args, "update_weight_store_poll_s", 5.0)),
                        not getattr(server_args, "update_weight_store_no_stage", False))
    _WATCH.task = asyncio.get_event_loop().create_task(_WATCH.run())


def health():
    """Hooked in ``/health``: a 503 with the lag while the engine is stale, else None (upstream decides)."""
    if _WATCH is None or not _WATCH.stale():
        return None
    from fastapi import Response

    return Response(content=json.dumps(_WATCH.report()), status_code=503, media_type="application/json")


def check_serving() -> None:
    """Hooked where generation requests enter: a stale engine takes none."""
    if _WATCH is not None and _WATCH.stale():
        r = _WATCH.report()
        raise ValueError(f"this engine is stale (version {r['version']}, the store's HEAD {r['head']}, at most "
                         f"{r['max_lag']} behind allowed): it serves again once it has caught up")
