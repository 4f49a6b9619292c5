"""How long generation stands still while an engine takes a version, as a streaming client sees it (``make
bench-pause``, root: network namespaces): its longest gap between tokens during a sync, less that gap without syncs,
against the sync's time and the engine's commit.

A real patched CPU SGLang server follows a version store (``--update-weight-store``): a local directory, and a real S3
server (SeaweedFS) in a network namespace whose interface a token bucket limits (``tc tbf``) at 200 and 20 Mbit/s.
The trainer's sender publishes versions while one client streams greedy tokens back to back. Pushed syncs run the
same way: the sender pauses the server itself (``retract``, so the stream goes on through the pause) and announces
each version's files, from a local directory or from the store across the same link. Every case runs twice in one
run: staging as shipped, and before staging (a follower with ``--update-weight-store-no-stage``: the catch-up reads
every object under the update lock; a pushed sync with ``stage_timeout=0``: paused first, each publish announced as
it is written). Pushed syncs also run with no client at all (``idle:`` lines): a sync that begins with every engine
idle pauses first whether staging is on or not, so its time must equal the time before staging. One ``pause:`` line
per case, and a section of docs/benchmarks.md. Over ``nccl`` nothing stages yet: not measured here.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

NETNS, HOST_IP, STORE_IP = "dws-pause", "10.77.0.2", "10.77.0.1"


def link_up(rate: str) -> None:
    """A namespace holding the store, joined to this one by a veth pair; the store's side sends at ``rate``."""
    link_down()
    for cmd in (["ip", "netns", "add", NETNS], ["ip", "link", "add", "dws-h", "type", "veth", "peer", "name", "dws-s"],
                ["ip", "link", "set", "dws-s", "netns", NETNS], ["ip", "addr", "add", f"{HOST_IP}/24", "dev", "dws-h"],
                ["ip", "-n", NETNS, "addr", "add", f"{STORE_IP}/24", "dev", "dws-s"],
                ["ip", "link", "set", "dws-h", "up"],
                ["ip", "-n", NETNS, "link", "set", "dws-s", "up"], ["ip", "-n", NETNS, "link", "set", "lo", "up"],
                ["ip", "netns", "exec", NETNS, "tc", "qdisc", "add", "dev", "dws-s", "root", "tbf", "rate", rate,
                 "burst", "32kb", "latency", "400ms"]):
        subprocess.run(cmd, check=True)


def link_down() -> None:
    subprocess.run(["ip", "netns", "del", NETNS], capture_output=True)
    subprocess.run(["ip", "link", "del", "dws-h"], capture_output=True)


class Stream(threading.Thread):
    """Greedy streamed requests back to back; ``times``: when each token arrived."""

    def __init__(self, url: str, tokens: int):
        super().__init__(daemon=True)
        self.url, self.tokens, self.times, self.stop = url, tokens, [], threading.Event()

    def run(self):
        import requests

        while not self.stop.is_set():
            body = {"input_ids": [5, 6, 7, 8], "stream": True,
                    "sampling_params": {"max_new_tokens": self.tokens, "temperature": 0, "ignore_eos": True}}
            try:
                with requests.post(self.url + "/generate", json=body, stream=True, timeout=600) as r:
                    for line in r.iter_lines():
                        if line.startswith(b"data: {"):
                            self.times.append(time.perf_counter())
            except requests.RequestException:
                if not self.stop.is_set():  # the server went away under the bench, not at its end
                    raise

    def longest_gap(self, t0: float, t1: float) -> float:
        """The longest gap between two tokens that ends after ``t0`` and starts before ``t1``."""
        ts = list(self.times)
        return max((b - a for a, b in zip(ts, ts[1:]) if b > t0 and a < t1), default=0.0)


def weight_version(url: str):
    import requests

    for path in ("/model_info", "/get_model_info"):
        r = requests.get(url + path, timeout=10)
        if r.status_code == 200 and "weight_version" in r.json():
            return r.json()["weight_version"]
    return requests.get(url + "/get_weight_version", timeout=10).json()


def run_case(store_url: str, boot: str, states, staged: bool, workdir: str, tokens: int) -> dict:
    """One server following ``store_url``; the sender publishes ``states`` (the first as an anchor)."""
    from cpu_harness import Server
    from sglang.srt.weight_sync.delta.sender import DeltaSender
    from sglang.srt.weight_sync.delta.store.publish import StoreTransport

    sender = DeltaSender(StoreTransport(store_url, [], zstd=3), [], encoding="xor_zstd")
    sender.update([lambda: [list(states[0].items())]])
    extra = ["--update-weight-store", store_url, "--update-weight-store-poll-s", "0.2"]
    if not staged:
        extra += ["--update-weight-store-no-stage"]
    server = Server(boot, os.path.join(workdir, f"server-{time.time():.0f}.log"), extra=extra).wait_healthy(600)

    def reach(v):  # the follower's own catch-up
        while weight_version(server.url) != str(v):
            time.sleep(0.02)

    try:
        return timed_syncs(server.url, tokens, sender, states[1:], reach)
    finally:
        server.stop()
        sender.transport.close()


def run_pushed(where: str, boot: str, states, staged: bool, workdir: str, tokens: int) -> dict:
    """A server the sender pushes ``states`` to (the first a full sync, not measured) through ``where``: a directory
    or a store's URL; ``tokens`` 0: no client (the server idle)."""
    from cpu_harness import Server
    from sglang.srt.weight_sync.delta.sender import DeltaSender
    from sglang.srt.weight_sync.delta.store.publish import StoreTransport
    from sglang.srt.weight_sync.delta.transport import DiskTransport, HttpEngine

    server = Server(boot, os.path.join(workdir, f"server-{time.time():.0f}.log")).wait_healthy(600)
    engine = HttpEngine(server.url, pause_mode="retract")
    timeout = 600 if staged else 0
    transport = StoreTransport(where, [engine], zstd=3, stage_timeout=timeout) if "://" in where else \
        DiskTransport(where, [engine], zstd=3, stage_timeout=timeout)
    sender = DeltaSender(transport, [engine], encoding="xor_zstd")
    try:
        assert sender.update([lambda: [list(states[0].items())]])[0][0]
        sender.pop_metrics()
        return timed_syncs(server.url, tokens, sender, states[1:], lambda v: None)  # update returns committed
    finally:
        server.stop()
        transport.close()


def timed_syncs(url: str, tokens: int, sender, states, reach) -> dict:
    """A stream's longest gap without syncs, then per sync of ``states`` (``reach(v)`` returns once the engine holds
    version ``v``): its time, the stream's longest gap across it, the engine's commit and what the deltas were
    (``tokens`` 0: no stream, no gaps)."""
    from sglang.srt.weight_sync.delta.transport import HttpEngine

    stream = Stream(url, tokens)
    try:
        baseline = 0.0
        if tokens:
            stream.start()
            time.sleep(3)
            t0 = time.perf_counter()
            time.sleep(8)
            baseline = stream.longest_gap(t0, time.perf_counter())
        rows = []
        for state in states:
            t0 = time.perf_counter()
            results = sender.update([lambda state=state: [list(state.items())]])
            assert all(ok for ok, _ in results.values()), results
            sent = encoding_sent(sender.pop_metrics())
            reach(sender.version)
            t1 = time.perf_counter()
            time.sleep(1.0)  # the stream's next token after the commit
            timing = HttpEngine(url).status()[0].timing
            rows.append({"sync_s": t1 - t0, "gap_s": stream.longest_gap(t0, t1 + 0.5), "commit_s": timing["commit_s"],
                         "staged_bytes": timing["staged_bytes"], "in_pause_bytes": timing["in_pause_bytes"],
                         "encoding": sent})
        return {"baseline_gap_s": baseline, "syncs": rows}
    finally:
        stream.stop.set()


def encoding_sent(metrics: dict) -> str:
    """What the sender's deltas were: ``xor_zstd`` asked for falls back to ``planes_zstd`` where no engine it pushes to
    is known at the base (a store alone: its followers may be anywhere behind)."""
    return "xor_ctx" if metrics["perf/update_weights_ctx"] else "xor_zstd" if metrics["perf/update_weights_xor"] \
        else "planes_zstd"


def summary(case: dict) -> dict:
    rows = case["syncs"]
    mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    return {"sync_s": mean("sync_s"), "pause_s": max(0.0, mean("gap_s") - case["baseline_gap_s"]),
            "commit_s": mean("commit_s"), "staged_bytes": mean("staged_bytes"),
            "in_pause_bytes": mean("in_pause_bytes"),
            "encoding": "/".join(sorted({r["encoding"] for r in rows}))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="build/bench-pause")
    ap.add_argument("--doc", default="docs/benchmarks.md")
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--density", type=float, default=0.3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--links", default="local,200mbit,20mbit")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("make bench-pause: needs root (a network namespace and tc for the emulated link)")
        return 2
    import torch

    from cpu_harness import bf16_state, hf_config, hf_model, write_hf_checkpoint
    from store_server import SeaweedS3
    from test_store import nudged

    os.makedirs(args.workdir, exist_ok=True)
    torch.manual_seed(0)
    cfg = hf_config("qwen3", vocab=8192, hidden=256, layers=4)
    first = bf16_state(hf_model(cfg))
    states = [first]
    for k in range(args.syncs):
        states.append(nudged(states[-1], 100 + k, density=args.density))
    boot = write_hf_checkpoint(os.path.join(args.workdir, "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
    params = sum(t.numel() for t in first.values())
    results = {}
    for link in args.links.split(","):
        s3 = None
        try:
            if link != "local":
                link_up(link)
                s3 = SeaweedS3(os.path.join(args.workdir, f"seaweed-{link}"), ip=STORE_IP, netns=NETNS)
            for kind in ("follower", "pushed", "idle"):
                for staged in (False, True):
                    url = s3.url() if s3 else \
                        os.path.join(args.workdir, f"store-{link}-{int(staged)}-{time.time():.0f}")
                    if not s3:
                        os.makedirs(url)
                    case = run_case(url, boot, states, staged, args.workdir, args.tokens) if kind == "follower" else \
                        run_pushed(url, boot, states, staged, args.workdir, args.tokens if kind == "pushed" else 0)
                    results[(kind, link, staged)] = case
                    print(json.dumps({"case": kind, "link": link, "staged": staged, **summary(case)}), flush=True)
        finally:
            if s3 is not None:
                s3.stop()
            link_down()
    lines = []
    for kind in ("follower", "pushed"):
        for link in args.links.split(","):
            before, after = summary(results[(kind, link, False)]), summary(results[(kind, link, True)])
            where = ("store" if kind == "follower" else "disk" if link == "local" else "disk+store")
            line = (f"pause: {where} {after['encoding']} {link}: sync {after['sync_s']:.2f} s, "
                    f"pause {after['pause_s']:.2f} s "
                    f"(before staging {before['pause_s']:.2f} s), commit {after['commit_s']:.2f} s")
            lines.append((kind, link, before, after))
            print(line)
    for link in args.links.split(","):
        before, after = summary(results[("idle", link, False)]), summary(results[("idle", link, True)])
        where = "disk" if link == "local" else "disk+store"
        lines.append(("idle", link, before, after))
        print(f"idle: {where} {after['encoding']} {link}: sync {after['sync_s']:.2f} s (before staging "
              f"{before['sync_s']:.2f} s), commit {after['commit_s']:.2f} s")
    write_section(args.doc, lines, params, args)
    return 0


def write_section(path: str, lines, params: int, args) -> None:
    from bench_store import with_section

    begin, end = "<!-- bench-pause:begin -->", "<!-- bench-pause:end -->"
    local = {kind: a["pause_s"] for kind, link, _, a in lines if link == "local"}
    text = [begin, "## Generation during a sync (`make bench-pause`)", "",
            f"Written by `make bench-pause` (`scripts/bench_pause.py`, root): a real patched CPU SGLang server "
            f"({params / 1e6:.1f}M-param Qwen3 shape) serves one client streaming greedy tokens back to back while the "
            f"trainer publishes {args.syncs} versions, `xor_zstd` asked for (about {args.density:.0%} of the elements "
            "changed each; a store alone gets `planes_zstd`: its followers may be anywhere behind). A follower "
            "follows a version store; a pushed sync is announced by the sender, which pauses the "
            "server itself (`retract`: the stream goes on through it), its files in a local directory, or in the store "
            "across the link. The pause is the client's longest gap between tokens during a sync, less that gap "
            "without syncs; the sync, from the trainer's publish to the engine at the version; the commit, the "
            "engine's own (a catch-up under its update lock, or a pushed version's requests). Before staging: the same "
            "run with `--update-weight-store-no-stage` (a follower reads every object under the lock), or paused first "
            "(a pushed sync announced as it is written). One run, this machine; means over the syncs.", "",
            "| sync, link | sent | sync | pause | pause before staging | commit | read inside the commit | vs local |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for kind, link, before, after in lines:
        if kind == "idle":
            continue
        ratio = f"{after['pause_s'] / local[kind]:.2f}x" if local.get(kind) else "—"
        where = {"follower": "follower, ", "pushed": "pushed, "}[kind] + (
            "directory" if link == "local" else "S3 over " + link)
        text.append(f"| {where} | `{after['encoding']}` | {after['sync_s']:.2f} s | "
                    f"{after['pause_s']:.2f} s | {before['pause_s']:.2f} s | {after['commit_s']:.2f} s | "
                    f"{after['in_pause_bytes'] / 1e6:.2f} MB (before: {before['in_pause_bytes'] / 1e6:.2f} MB) | "
                    f"{ratio} |")
    text += ["", "With no client (every engine idle as the sync begins, as in slime's `train.py` and "
             "`train_async.py`) a pushed sync pauses first whether staging is on or not; its time, staging on "
             "against before staging:", "",
             "| sync, link | sync | before staging | ratio |", "|---|---:|---:|---:|"]
    for kind, link, before, after in lines:
        if kind == "idle":
            where = "pushed, " + ("directory" if link == "local" else "S3 over " + link)
            text.append(f"| {where} | {after['sync_s']:.2f} s | {before['sync_s']:.2f} s | "
                        f"{after['sync_s'] / before['sync_s']:.2f}x |")
    text += ["", "Over `nccl` nothing stages yet: the broadcast is in the pause there.", end]
    with_section(path, "\n".join(text), begin, end)


if __name__ == "__main__":
    sys.exit(main())
