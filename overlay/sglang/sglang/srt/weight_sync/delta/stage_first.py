"""The trainer's side of stage-then-commit for published files: engines fetch a version while they serve, and the
pause covers only the commit.

A transport that publishes files (:class:`~transport.DiskTransport`, a version store) hands each publish to
:class:`StagedPublishes` instead of announcing it: every target engine is asked to fetch its files at once
(``engine.stage``: ``/weights_checker`` ``delta_stage``, see ``fetch``), and the publish is kept. At the end of the
sync (:meth:`StagedPublishes.commit`) each engine is told the last publish is out, the trainer waits until every
engine has fetched (its status' ``staged``), or refused, or the deadline passed, then calls the ``gate`` (the caller's
pause) and commits: one request per engine naming every publish of the version in order, which the engine takes whole
or not at all (``whole``), one engine per thread. An engine that could not fetch reads its files inside the pause, as
before; what it refused is refused again by the commit's own checks, before any write.

A sync whose engines are all idle when it begins (no request running or waiting: slime's ``train.py`` and
``train_async.py`` both finish a rollout before they sync, and the engines wait for the version anyway) does not stage:
the gate comes at once and each publish is announced as written, so staging never makes such a sync longer.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

__all__ = ["Pauses", "StagedPublishes"]

Commit = Callable[[int, List[dict]], Tuple[bool, str, float]]  # (engine, its publishes) -> (ok, message, seconds)


class Pauses:
    """Which of a sync's engines stand paused, and for how long, whoever carries the calls: ``pause(indices)`` pauses
    those engines and returns the ones it paused, ``resume(indices)`` resumes them (the sender's own engines, or
    slime's Ray actors). :meth:`gate` pauses every engine not paused yet, once per window; :meth:`release` resumes some
    (the engines a store sync pushed to, before its commit) or all; ``seconds``: each window, gate to first release."""

    def __init__(self, count: int, pause: Callable[[List[int]], List[int]], resume: Callable[[List[int]], None]):
        self.count, self._pause, self._resume = count, pause, resume
        self.paused: set = set()
        self.since: Optional[float] = None
        self.seconds: List[float] = []

    def gate(self) -> None:
        if self.since is not None:
            return
        self.since = time.perf_counter()
        self.paused.update(self._pause([i for i in range(self.count) if i not in self.paused]))

    def release(self, which: Optional[Sequence[int]] = None) -> None:
        engines = sorted(self.paused if which is None else self.paused & set(which))
        self._resume(engines)
        self.paused.difference_update(engines)
        if self.since is not None:
            self.seconds.append(time.perf_counter() - self.since)
            self.since = None


class StagedPublishes:
    """One sync's publishes, fetched by the engines first and committed whole under the gate."""

    def __init__(self, engines, pool: concurrent.futures.Executor, timeout: float, commit: Commit):
        self.engines, self.pool, self.timeout, self._commit = engines, pool, timeout, commit
        self.begin(0)

    def begin(self, version: int) -> None:
        self.version = version
        self.publishes: Dict[int, List[dict]] = {}  # each engine's publishes of this sync, in order
        self.asked: Dict[int, List[concurrent.futures.Future]] = {}
        self.unable: set = set()  # engines a stage request failed on (an older engine, unreachable): not waited for
        self.t0: Optional[float] = None
        self.figures: Dict[str, float] = {}
        self.staging = False  # this sync stages (:meth:`decide`, when it begins)

    def decide(self, gate: Callable[[], None]) -> None:
        """Whether this sync stages: when every engine reports itself idle, there is nothing to protect, so ``gate()``
        now and announce as written. An engine that does not say (an older patch set) or cannot be read counts as
        serving."""
        idle = bool(self.engines) and all(self.pool.map(self._idle, range(len(self.engines))))
        self.staging = not idle
        self.figures["staged"] = float(self.staging)
        if idle:
            gate()

    def _idle(self, i: int) -> bool:
        try:
            return all(r.idle is True for r in self.engines[i].status())
        except Exception:  # its stage request or its commit will tell
            return False

    def add(self, i: int, body: Optional[dict]) -> None:
        """One publish for engine ``i`` (``{"model_path", "files", "digests"?}``): fetched now, committed with the
        others of the sync at the end; None: nothing of it for the engine to take (an anchor being written)."""
        self.t0 = self.t0 if self.t0 is not None else time.perf_counter()
        self.publishes.setdefault(i, [])
        if body is not None:
            self.publishes[i].append(body)
            self.asked.setdefault(i, []).append(self.pool.submit(self._stage, i, dict(body, version=self.version,
                                                                                      hold_s=self._hold())))

    def _hold(self) -> float:
        """How long an engine keeps what it fetched with no further request of this sync: the wait for the fetches
        comes before the commit, so twice that is past any commit of a live trainer."""
        return 2 * self.timeout

    def _stage(self, i: int, body: dict) -> None:
        try:
            self.engines[i].stage(body)
        except Exception as e:  # an engine that cannot fetch reads its files at the commit
            self.unable.add(i)
            logger.warning("engine %d: delta_stage of version %d failed (%r); it reads at the commit", i,
                           self.version, e)

    def commit(self, gate: Callable[[], None], failed: Optional[str]) -> Dict[int, Tuple[bool, str, float]]:
        """Wait for the fetches (bounded), then ``gate()`` and every engine's commit; ``failed``: a publish failed, so
        nothing is committed (the engines' fetches are dropped by their next version, or their hold time)."""
        engines = sorted(self.publishes)
        for i in engines:
            self.asked.setdefault(i, []).append(self.pool.submit(
                self._stage, i, {"version": self.version, "files": [], "final": True, "hold_s": self._hold()}))
        for futs in self.asked.values():
            for fut in futs:
                fut.result()
        if failed is not None:
            return {}
        ready = self._wait(engines)
        t1 = time.perf_counter()
        self.figures["stage_s"] = t1 - (self.t0 or t1)
        self.figures["stage_ready_engines"] = float(len(ready))
        gate()
        out = dict(zip(engines, self.pool.map(self._commit_engine, engines)))
        self.figures["commit_s"] = time.perf_counter() - t1
        return out

    def _commit_engine(self, i: int) -> Tuple[bool, str, float]:
        return self._commit(i, self.publishes[i]) if self.publishes[i] else (True, "", 0.0)

    def _wait(self, engines: List[int]) -> List[int]:
        """Engines whose fetch of this version is done (or refused) before the deadline."""
        deadline, pause, waiting, ready = time.perf_counter() + self.timeout, 0.005, [
            i for i in engines if i not in self.unable], []
        while waiting:
            for i in list(waiting):
                try:
                    ranks = self.engines[i].status()
                except Exception:  # its commit will tell
                    waiting.remove(i)
                    continue
                if any(r.staged == self.version or r.stage_code is not None for r in ranks):
                    waiting.remove(i)
                    ready.append(i)
            if waiting and time.perf_counter() >= deadline:
                logger.warning("engines %s did not fetch version %d within %.0f s: they read inside the pause",
                               waiting, self.version, self.timeout)
                break
            if waiting:
                time.sleep(pause)
                pause = min(0.02, pause * 2)  # a status read is cheap; the sync waits on the last one
        return ready
