"""Generation traffic against a real server while syncs run: several streams of short greedy requests, each request's
outcome and latency, and which syncs it spanned.

A request *completed* when it returned all its tokens, was *aborted* when the engine returned it early with an abort
(a sync's ``abort`` pause does that), and *failed* otherwise (an HTTP error, a dropped connection, a wrong length).
Stale KV is probed apart from the traffic: :meth:`Traffic.probe` sends a prompt no stream uses, so a prefix-cache hit
on it can only be KV its own earlier probe left, computed by the weights of that time.
"""
import dataclasses
import random
import threading
import time
from typing import Callable, List

import numpy as np

PROBE = [251 - k for k in range(24)]  # a prompt no stream sends (stream prompts count up from small ids)


@dataclasses.dataclass
class Request:
    start: float
    end: float = 0.0
    outcome: str = ""  # completed | aborted | failed
    detail: str = ""


@dataclasses.dataclass
class Window:
    start: float
    end: float
    kind: str  # "plain" | "fingerprint": whether the sender checked the engines' fingerprints in this sync's pause


class Traffic:
    """``streams`` threads, each sending greedy requests of ``tokens`` new tokens back to back to ``url()`` (read per
    request: a restarted server moves) until :meth:`stop`. Prompts share prefixes, so the radix cache is in use."""

    def __init__(self, url: Callable[[], str], streams: int = 3, tokens: int = 8, seed: int = 0):
        self.url, self.tokens = url, tokens
        self.requests: List[Request] = []
        self.windows: List[Window] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._prompts = [[3 + 7 * (i % 4) + j for j in range(16)] + [100 + i] * 4 for i in range(8)]
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(streams)]

    def __enter__(self) -> "Traffic":
        for t in self._threads:
            t.start()
        deadline = time.time() + 300
        while not self.done() and time.time() < deadline:  # the streams are serving before anything is measured
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(600)

    def _run(self) -> None:
        import requests

        session = requests.Session()
        while not self._stop.is_set():
            with self._lock:
                prompt = self._rng.choice(self._prompts)
            req = Request(time.perf_counter())
            try:
                r = session.post(self.url() + "/generate", timeout=600, json={"input_ids": prompt, "sampling_params": {
                    "max_new_tokens": self.tokens, "temperature": 0, "ignore_eos": True}})
                meta = r.json().get("meta_info", {}) if r.status_code == 200 else {}
                reason = (meta.get("finish_reason") or {}).get("type")
                if reason == "length" and meta.get("completion_tokens") == self.tokens:
                    req.outcome = "completed"
                elif reason == "abort":
                    req.outcome = "aborted"
                else:
                    req.outcome, req.detail = "failed", f"HTTP {r.status_code}: {r.text[:300]}"
            except Exception as e:  # a refused or dropped connection
                req.outcome, req.detail = "failed", repr(e)
                time.sleep(0.2)  # a dead server: do not spin
            req.end = time.perf_counter()
            with self._lock:
                self.requests.append(req)

    def done(self) -> List[Request]:
        with self._lock:
            return [r for r in self.requests if r.outcome]

    def mark(self) -> int:
        """How many requests have finished; :meth:`since` returns those finished after."""
        with self._lock:
            return len(self.requests)

    def since(self, mark: int) -> List[Request]:
        with self._lock:
            return self.requests[mark:]

    def wait_completed(self, timeout: float = 300) -> None:
        """Until as many requests as there are streams, sent from now on, have completed."""
        t0, deadline = time.perf_counter(), time.time() + timeout
        while sum(r.outcome == "completed" and r.start > t0 for r in self.done()) < len(self._threads):
            assert time.time() < deadline, f"no request completed in {timeout:.0f}s"
            time.sleep(0.02)

    def window(self, start: float, kind: str = "plain") -> None:
        """Record a sync that ran from ``start`` (``time.perf_counter``) until now."""
        self.windows.append(Window(start, time.perf_counter(), kind))

    def probe(self) -> int:
        """Prefix-cache hits of one request on :data:`PROBE` (``cached_tokens``)."""
        import requests

        r = requests.post(self.url() + "/generate", timeout=600, json={"input_ids": PROBE, "sampling_params": {
            "max_new_tokens": 1, "temperature": 0}})
        assert r.status_code == 200, r.text
        return int(r.json()["meta_info"]["cached_tokens"])

    def summary(self, first: int = 0) -> str:
        """``requests N completed, N aborted, N failed`` and p50/p99 latency (ms) of the requests from ``first`` on,
        split by the syncs they overlapped: none, a plain sync, a fingerprint sync."""
        reqs = self.since(first)
        counts = {k: sum(r.outcome == k for r in reqs) for k in ("completed", "aborted", "failed")}
        groups = {"no sync": [], "plain sync": [], "fingerprint sync": []}
        for r in reqs:
            kinds = {w.kind for w in self.windows if w.start < r.end and r.start < w.end}
            key = "fingerprint sync" if "fingerprint" in kinds else "plain sync" if kinds else "no sync"
            groups[key].append(1e3 * (r.end - r.start))
        lat = ", ".join(f"{k} {_pct(v)}" for k, v in groups.items())
        return f"requests {counts['completed']} completed, {counts['aborted']} aborted, {counts['failed']} failed; " \
               f"latency p50/p99 ms (n): {lat}"

    def failures(self, first: int = 0) -> List[Request]:
        return [r for r in self.since(first) if r.outcome == "failed"]


def _pct(ms: List[float]) -> str:
    if not ms:
        return "-/- (0)"
    p50, p99 = np.percentile(np.asarray(ms), [50, 99])
    return f"{p50:.0f}/{p99:.0f} ({len(ms)})"

