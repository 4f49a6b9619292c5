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

A lag counted against the ``HEAD`` the engine sees cannot tell a live store from a frozen one: a ``HEAD`` held at an
old, validly signed version (an adversary with write access, a stalled replication, a trainer that stopped). So
``HEAD`` carries the time the trainer wrote it, under its MAC, and the trainer writes it again while it idles. With
``--update-weight-store-max-age SECONDS`` the engine is stale too once the newest ``HEAD`` it has verified is older
than that by its own clock, beyond ``--update-weight-store-clock-skew-s``; a ``HEAD`` written further than that
allowance in the future (a clock off) makes it stale as well, naming the setting.

A replica copies objects in no set order, so a ``HEAD`` may name a manifest or objects that are not there yet. The
catch-up writes nothing then (a version is taken whole) and says ``replicating``; the engine serves its version, its
``/health`` report says how long it has waited, and it tries again every poll. Past
``--update-weight-store-replication-timeout-s`` the report names the wait as an error; whether the engine still serves
is what ``max-lag`` and ``max-age`` say.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from typing import Optional

from sglang.srt.weight_sync.delta.store.manifest import RECORD_CAP, StoreKey, open_record, read_head
from sglang.srt.weight_sync.delta.store.objects import open_store
from sglang.srt.weight_sync.delta.wire import Refusal

logger = logging.getLogger(__name__)

DEFAULT_SKEW_S = 5.0
DEFAULT_REPLICATION_TIMEOUT_S = 300.0


def check_freshness_settings(max_age: float, poll_s: float, skew_s: float) -> None:
    """Refused at start, naming the setting: a max-age the poll cannot keep (the engine would be stale between two
    reads of a live store), and a negative skew allowance."""
    if skew_s < 0:
        raise ValueError(f"--update-weight-store-clock-skew-s={skew_s:g}: give the seconds the trainer's and the "
                         "engines' clocks may differ by (>= 0)")
    if 0 <= max_age <= poll_s:
        raise ValueError(f"--update-weight-store-max-age={max_age:g} is not above --update-weight-store-poll-s="
                         f"{poll_s:g}: a follower would be stale between two reads of a live store (-1: no bound)")


class StoreWatch:
    """What the server process knows of its engine against the store: ``HEAD``, the engine's version, the lag."""

    def __init__(self, tokenizer_manager, url: str, key: StoreKey, max_lag: int, poll_s: float, stage: bool = True,
                 max_age: float = -1.0, skew_s: float = DEFAULT_SKEW_S,
                 replication_timeout_s: float = DEFAULT_REPLICATION_TIMEOUT_S):
        check_freshness_settings(max_age, poll_s, skew_s)
        self.tm, self.url, self.max_lag, self.poll_s, self.stage = tokenizer_manager, url, max_lag, poll_s, stage
        self.max_age, self.skew_s = max_age, skew_s
        self.store, self.key = open_store(url), key
        self.head: Optional[int] = None
        self.head_time: Optional[float] = None  # the newest time a verified HEAD carried (the trainer's clock)
        self.clock: str = ""  # why the HEAD's time cannot be believed against this engine's clock
        self.replication_timeout_s = replication_timeout_s
        self.replicating_since: Optional[float] = None  # monotonic: the first catch-up that found an object not there
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

    @property
    def age(self) -> Optional[float]:
        """Seconds since the trainer wrote the newest ``HEAD`` this engine verified, by this engine's clock."""
        return None if self.head_time is None else time.time() - self.head_time

    def stale(self) -> bool:
        if not self.caught_up:
            return True
        lag = self.lag
        if self.max_lag >= 0 and (lag is None or lag > self.max_lag):
            return True
        return self.max_age >= 0 and (bool(self.clock) or self.age is None or self.age > self.max_age + self.skew_s)

    def report(self) -> dict:
        age = self.age
        waited = None if self.replicating_since is None else round(time.monotonic() - self.replicating_since, 3)
        return {"stale": self.stale(), "version": self.version, "head": self.head, "max_lag": self.max_lag,
                "age_s": None if age is None else round(age, 3), "max_age_s": self.max_age,
                "replicating_s": waited, "store": self.url, "error": self.clock or self.error}

    def _saw(self, head) -> None:
        """A verified ``HEAD``: its time, checked against this engine's clock (the newest one counts)."""
        self.head = head.version
        if head.time is None:
            self.clock = "the store's HEAD carries no time (a trainer without freshness): --update-weight-store-max-age " \
                         "cannot hold" if self.max_age >= 0 else ""
            return
        ahead = head.time - time.time()
        if ahead > self.skew_s:
            self.clock = (f"the store's HEAD was written {ahead:.1f} s ahead of this engine's clock, more than "
                          f"--update-weight-store-clock-skew-s={self.skew_s:g} allows: set the clocks right (NTP)")
            return
        self.clock = ""
        self.head_time = head.time if self.head_time is None else max(self.head_time, head.time)

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
        self._saw(head)
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
            self.caught_up, self.error, self.replicating_since = True, "", None
            logger.info("version store watch: at version %s (%s)", self.head, msg)
            return
        ranks = await self._status()
        if any(r.needs_full for r in ranks):  # it stopped part-way: a mix of versions is nothing to serve
            self.caught_up = False
        if ranks and all(r.code == Refusal.REPLICATING.value for r in ranks):  # not there yet: nothing written
            self.replicating_since = self.replicating_since or time.monotonic()
            waited = time.monotonic() - self.replicating_since
            if waited <= self.replication_timeout_s:
                self.error = ""
                logger.info("version store watch: version %s is not all in the store yet (%.0f s): %s", self.head,
                            waited, msg)
                return
            msg = (f"objects of version {self.head} did not reach this store within "
                   f"--update-weight-store-replication-timeout-s={self.replication_timeout_s:g}: {msg}")
        else:
            self.replicating_since = None
        self.error = msg
        logger.error("version store watch: catch-up to version %s refused: %s", self.head, msg)

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

    async def _status(self) -> list:
        """Every rank's delta status: whether one holds weights no version explains (dirty, never synced), and why
        the last catch-up was refused."""
        from sglang.srt.managers.io_struct import CheckWeightsReqInput
        from sglang.srt.weight_sync.delta.wire import DeltaStatus

        out = await self.tm.check_weights(CheckWeightsReqInput(action="delta_status"), None)
        return DeltaStatus.from_checker(out[2] or [])


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
                        not getattr(server_args, "update_weight_store_no_stage", False),
                        float(getattr(server_args, "update_weight_store_max_age", -1.0)),
                        float(getattr(server_args, "update_weight_store_clock_skew_s", DEFAULT_SKEW_S)),
                        float(getattr(server_args, "update_weight_store_replication_timeout_s",
                                      DEFAULT_REPLICATION_TIMEOUT_S)))
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
                         f"{r['max_lag']} behind allowed; HEAD written {r['age_s']} s ago, at most {r['max_age_s']} "
                         f"allowed{'; ' + r['error'] if r['error'] else ''}): it serves again once it has caught up "
                         "with a live store")
