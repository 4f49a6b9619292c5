"""Fleet soak (``make soak-fleet``): a trainer publishing every sync into a version store (SeaweedFS, and a POSIX
directory), one real server it pushes to and real servers that follow the store by themselves, joining, leaving and
restarting at random (seeded) through the syncs, with store faults and attacks mixed in and generation traffic on
the pushed engine. Every engine must hold, bit for bit, the trainer's state of whatever version it reports.

Per store kind one line:
``fleet: store s3; S syncs; joined J, left L, restarted R; catch-ups C (A from an anchor); trainer full syncs after
the first 0; upload per sync with E engines vs 1: X.XX; attacks refused K/K; drift 0``

Catch-ups count the sender's (a restarted pushed engine) and every advance of a follower seen between two checks;
from an anchor: every engine that started fresh. The upload ratio replays the same states into a fresh store with
one in-process engine.
"""
import json
import os
import random
import time

import pytest
import requests

from cpu_harness import Server, bf16_state, engine_mismatch, hf_config, hf_model, rl_steps, write_hf_checkpoint
from sglang.srt.weight_sync.delta.receiver import delta_status
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.store.manifest import StoreKey, seal
from sglang.srt.weight_sync.delta.store.publish import StoreTransport
from sglang.srt.weight_sync.delta.tools import main as cli
from sglang.srt.weight_sync.delta.transport import HttpEngine
from test_store import Engine, head_record, one_segment, raw_store
from traffic import Traffic

SYNCS = int(os.environ.get("FLEET_SYNCS", "40"))
MAX_FOLLOWERS = 2
ATTACKS = ("bit flip", "truncated", "forged manifest", "forged HEAD", "unsigned HEAD", "another key",
           "rolled-back HEAD")


def _version(server):
    for path in ("/model_info", "/get_model_info"):
        r = requests.get(server.url + path, timeout=30)
        if r.status_code == 200 and "weight_version" in r.json():
            return r.json()["weight_version"]
    return None


class Fleet:
    def __init__(self, root, url, key_file, seed):
        self.root, self.url, self.key_file = root, url, key_file
        self.key = StoreKey.from_file(key_file)
        self.rng = random.Random(seed)
        self.cfg = hf_config("llama", vocab=300)
        self.trainer = hf_model(self.cfg)
        self.boot = write_hf_checkpoint(str(root / "boot"), self.cfg, bf16_state(hf_model(self.cfg, seed=2)))
        self.states = {}
        self.n = dict(joined=0, left=0, restarted=0, catch_ups=0, anchors=0, attacks=0, refused=0, drift=0)
        self.full_after_first = 0
        self.starts = 0
        self.pushed = self._server("pushed", follow=False)
        self.transport = StoreTransport(url, [HttpEngine(self.pushed.url)], zstd=3, key=self.key)
        self.sender = DeltaSender(self.transport, [HttpEngine(self.pushed.url)], encoding="xor_zstd",
                                  fingerprint_every=5)
        self.followers = {}  # server -> last version seen (None: not yet healthy)
        self.probe = Engine(self.cfg, key_file=key_file)  # the attacks' target: an engine kept one version behind
        self.uploads = {}

    def _server(self, name, follow=True):
        self.starts += 1
        extra = ["--update-weight-store-key-file", self.key_file]
        if follow:
            extra += ["--update-weight-store", self.url, "--update-weight-store-max-lag", "3",
                      "--update-weight-store-poll-s", "0.5"]
        return Server(self.boot, str(self.root / f"{name}-{self.starts}.log"), extra=extra)

    # -- events -----------------------------------------------------------------

    def join(self):
        self.followers[self._server("follower")] = None
        self.n["joined"] += 1

    def leave(self, s):
        s.stop()
        self.followers.pop(s)
        self.n["left"] += 1

    def restart_follower(self, s):
        s.stop()
        self.followers.pop(s)
        self.followers[self._server("follower")] = None
        self.n["restarted"] += 1

    def restart_pushed(self):
        self.pushed.stop()
        self.pushed = self._server("pushed", follow=False).wait_healthy()
        self.transport.close()
        self.transport = StoreTransport(self.url, [HttpEngine(self.pushed.url)], zstd=3, key=self.key)
        self.sender.attach(self.transport, [HttpEngine(self.pushed.url)])  # as slime re-connects its engines
        self.n["restarted"] += 1

    def attack(self):
        """One attack with write access to the store against the probe engine one version behind: refused with a
        code, its weights untouched; then undone."""
        raw = raw_store(self.url)
        head = max(self.states)
        ok, msg = self.probe.catch_up(self.url, str(head - 1))
        assert ok, msg
        newest = next(k.rsplit("/", 1)[0] for k in raw.keys(f"weight_v{head:06d}") if k.endswith("manifest.json"))
        files = [k for k in raw.keys(newest) if k.endswith(".safetensors")]
        kind = ATTACKS[self.n["attacks"] % len(ATTACKS)]  # every kind in turn
        undo = []

        def rewrite(key, data):
            undo.append((key, raw.get(key)))
            raw.put(key, data)

        if kind == "bit flip":
            data = raw.get(files[0])
            rewrite(files[0], data[:-1] + bytes([data[-1] ^ 4]))
        elif kind == "truncated":
            rewrite(files[0], raw.get(files[0])[:100])
        elif kind == "forged manifest":
            m = json.loads(raw.get(f"{newest}/manifest.json"))
            m["base_version"] = 0
            rewrite(f"{newest}/manifest.json", json.dumps(m).encode())
        elif kind == "forged HEAD":
            h = head_record(raw)
            h["version"] += 1
            rewrite("HEAD", json.dumps(h).encode())
        elif kind == "unsigned HEAD":
            rewrite("HEAD", json.dumps({k: v for k, v in head_record(raw).items() if k not in ("mac",
                                                                                                "key_id")}).encode())
        elif kind == "another key":
            other = self.root / "other.key"
            other.write_bytes(os.urandom(32).hex().encode())
            h = {k: v for k, v in head_record(raw).items() if k not in ("mac", "key_id", "format")}
            rewrite("HEAD", seal(h, StoreKey.from_file(str(other))))
        else:  # a HEAD signed by the key, of a version below the probe's
            rewrite("HEAD", self._old_head)
        self.n["attacks"] += 1
        before = delta_status(self.probe.host.model).version
        ok, msg = self.probe.catch_up(self.url)
        status = delta_status(self.probe.host.model)
        if not ok and status.code in ("unverified", "off_chain") and status.version == before:
            self.n["refused"] += 1
        for key, data in reversed(undo):
            raw.put(key, data)
        self._same(self.probe, before)

    def fault(self):
        """An object of the newest version deleted (availability): the followers stay where they are until it is
        back."""
        raw = raw_store(self.url)
        head = max(self.states)
        newest = next(k.rsplit("/", 1)[0] for k in raw.keys(f"weight_v{head:06d}") if k.endswith("manifest.json"))
        victim = next(k for k in raw.keys(newest) if k.endswith(".safetensors"))
        data = raw.get(victim)
        from sglang.srt.weight_sync.delta.store.objects import open_store

        open_store(self.url).delete([victim])
        time.sleep(1.5)  # the followers' watches try (and fail) meanwhile
        self.check()
        raw.put(victim, data)

    # -- checks ----------------------------------------------------------------

    def _same(self, engine, version):
        from delta_helpers import assert_params_equal
        from test_store import reference

        assert_params_equal(engine.host.model, reference(self.cfg, self.states[version]))

    def _holds(self, server) -> bool:
        """The server holds the trainer's state of the version it reports (read again if it moved meanwhile)."""
        for _ in range(5):
            v = _version(server)
            if v is None or not v.isdigit():
                return True  # not yet at any version of this store: it serves nothing (503)
            bad = engine_mismatch(server, self.states[int(v)])
            if _version(server) == v:
                return bad is None
        return False

    def check(self):
        if not self._holds(self.pushed):
            self.n["drift"] += 1
        for s, seen in list(self.followers.items()):
            if requests.get(s.url + "/health", timeout=30).status_code != 200:
                continue
            v = _version(s)
            if seen is None:
                self.n["anchors"] += 1  # a fresh engine's first catch-up loads an anchor
            if v != seen:
                self.n["catch_ups"] += 1
                self.followers[s] = v
            if not self._holds(s):
                self.n["drift"] += 1
            r = requests.post(s.url + "/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": {
                "max_new_tokens": 2, "temperature": 0}}, timeout=60)
            stale = requests.get(s.url + "/health", timeout=30).status_code != 200  # it fell behind meanwhile
            assert r.status_code == 200 or (stale and "stale" in r.text), r.text

    def sync(self, state):
        v = self.sender.version + 1
        self.states[v] = state
        results = self.sender.update(one_segment(state))
        m = self.sender.pop_metrics()
        assert all(ok for ok, _ in results.values()), results
        if v > 1:
            self.full_after_first += m["perf/update_weights_full_sync_engines"]
            self.uploads[v] = self.transport.upload_bytes
        self.n["catch_ups"] += int(m["perf/update_weights_catch_ups"])
        self.n["anchors"] += int(m["perf/update_weights_catch_ups"])  # a restarted pushed engine starts fresh
        if v == 2:
            self._old_head = raw_store(self.url).get("HEAD")

    def stop(self):
        for s in [self.pushed, *self.followers]:
            s.stop()
        self.transport.close()


def upload_with_one_engine(states, url):
    """The same states published into a fresh store with one (in-process) engine: bytes per delta sync."""
    cfg = hf_config("llama", vocab=300)
    e = Engine(cfg)
    transport = StoreTransport(url, [e], zstd=3)
    sender = DeltaSender(transport, [e], encoding="xor_zstd", fingerprint_every=5)
    out = {}
    for v in sorted(states):
        sender.update(one_segment(states[v]))
        if v > 1:
            out[v] = transport.upload_bytes
    return out


@pytest.mark.parametrize("kind", ["s3", "posix"])
def test_fleet(tmp_path, kind):
    from store_server import SeaweedS3

    s3 = SeaweedS3(str(tmp_path / "seaweed")) if kind == "s3" else None
    url = s3.url() if s3 else str(tmp_path / "store")
    if not s3:
        os.makedirs(url)
    key_file = tmp_path / "store.key"
    key_file.write_bytes(os.urandom(32).hex().encode())
    fleet = Fleet(tmp_path, url, str(key_file), seed=f"fleet-{kind}")
    rng = fleet.rng
    try:
        fleet.pushed.wait_healthy()
        steps = rl_steps(fleet.trainer, SYNCS)
        fleet.sync(bf16_state(fleet.trainer))
        fleet.join()
        with Traffic(lambda: fleet.pushed.url, streams=2, tokens=4):
            for k in range(2, SYNCS + 1):
                fleet.sync(next(steps))
                event = rng.choice(["none", "none", "join", "leave", "restart", "fault", "attack", "attack"])
                if k == 3 or (event == "join" and len(fleet.followers) < MAX_FOLLOWERS):
                    fleet.join()
                elif event == "leave" and len(fleet.followers) > 1:
                    fleet.leave(rng.choice(list(fleet.followers)))
                elif event == "restart":
                    if rng.random() < 0.3:
                        fleet.restart_pushed()
                    elif fleet.followers:
                        fleet.restart_follower(rng.choice(list(fleet.followers)))
                elif event == "fault" and k > 3:
                    fleet.fault()
                elif event == "attack" and k > 3:
                    fleet.attack()
                if k % 10 == 0:
                    assert cli(["store", "compact", url, "--key-file", str(key_file)]) == 0
                if k % 15 == 0:
                    assert cli(["store", "gc", url, "--keep-anchors", "2", "--key-file", str(key_file)]) == 0
                for s, seen in fleet.followers.items():
                    if seen is None:
                        s.wait_healthy()  # a fresh follower serves once it holds HEAD (its /health says so)
                fleet.check()
        deadline = time.time() + 120  # at the end every follower reaches HEAD
        while time.time() < deadline and any(_version(s) != str(max(fleet.states)) for s in fleet.followers):
            time.sleep(0.5)
        fleet.check()
        if not s3:
            os.makedirs(tmp_path / "one")
        one = upload_with_one_engine(fleet.states, (s3.url() if s3 else str(tmp_path / "one")))
        ratio = sum(fleet.uploads.values()) / sum(one[v] for v in fleet.uploads)
        n = fleet.n
        engines = 1 + MAX_FOLLOWERS
        print(f"\nfleet: store {kind}; {SYNCS} syncs; joined {n['joined']}, left {n['left']}, restarted "
              f"{n['restarted']}; catch-ups {n['catch_ups']} ({n['anchors']} from an anchor); trainer full syncs after "
              f"the first {int(fleet.full_after_first)}; upload per sync with {engines} engines vs 1: {ratio:.2f}; "
              f"attacks refused {n['refused']}/{n['attacks']}; drift {n['drift']}")
        assert n["drift"] == 0 and fleet.full_after_first == 0 and n["refused"] == n["attacks"]
        assert ratio <= 1.10 and n["joined"] >= 2 and n["catch_ups"] >= 3 and n["anchors"] >= 1
    finally:
        fleet.stop()
        if s3:
            s3.stop()
