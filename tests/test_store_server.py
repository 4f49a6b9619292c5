"""A real patched SGLang server following a version store on a real S3 server (SeaweedFS), both pins: it reaches HEAD
before it serves, catches up whenever HEAD moves (waiting, serving, for an object HEAD names that has not arrived
yet), answers 503 on /health and refuses generation while it is more versions behind than allowed or the newest HEAD
it verified is older than allowed (a frozen store) or written ahead of its clock, and takes pushed deltas whose files
it checks against the announced digests."""
import os
import time

import requests

from cpu_harness import Server, bf16_state, engine_mismatch, hf_config, hf_model, write_hf_checkpoint
from sglang.srt.weight_sync.delta.sender import DeltaSender
from sglang.srt.weight_sync.delta.store.manifest import StoreKey, head_record, read_head, seal
from sglang.srt.weight_sync.delta.store.objects import open_store
from sglang.srt.weight_sync.delta.store.publish import StoreTransport
from sglang.srt.weight_sync.delta.transport import HttpEngine
from test_store import nudged, one_segment, raw_store


def weight_version(server):
    for path in ("/model_info", "/get_model_info"):
        r = requests.get(server.url + path, timeout=10)
        if r.status_code == 200 and "weight_version" in r.json():
            return r.json()["weight_version"]
    return requests.get(server.url + "/get_weight_version", timeout=10).json()


def wait_for(predicate, timeout=120, what=""):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if predicate():
            return
        time.sleep(0.5)
    raise TimeoutError(what)


def test_a_server_follows_the_store_and_is_unhealthy_while_stale(tmp_path):
    from store_server import SeaweedS3

    s3 = SeaweedS3(str(tmp_path / "seaweed"))
    server = None
    try:
        url = s3.url()
        key_file = tmp_path / "store.key"
        key_file.write_bytes(os.urandom(32).hex().encode())
        key = StoreKey.from_file(str(key_file))
        cfg = hf_config("llama", vocab=300)
        state = bf16_state(hf_model(cfg))
        boot = write_hf_checkpoint(str(tmp_path / "boot"), cfg, bf16_state(hf_model(cfg, seed=2)))
        sender = DeltaSender(StoreTransport(url, [], zstd=3, key=key, head_refresh_s=1), [], encoding="xor_zstd")
        for v in (1, 2):
            state = nudged(state, v) if v > 1 else state
            sender.update(one_segment(state))
        server = Server(boot, str(tmp_path / "server.log"), extra=[
            "--update-weight-store", url, "--update-weight-store-key-file", str(key_file),
            "--update-weight-store-max-lag", "1", "--update-weight-store-poll-s", "0.5",
            "--update-weight-store-max-age", "4", "--update-weight-store-clock-skew-s", "1"])
        server.wait_healthy()
        assert weight_version(server) == "2"  # healthy only once it holds HEAD
        assert engine_mismatch(server, state) is None
        for v in (3, 4):
            state = nudged(state, v)
            sender.update(one_segment(state))
        wait_for(lambda: weight_version(server) == "4", what="the server did not follow HEAD to 4")
        assert engine_mismatch(server, state) is None
        timing = HttpEngine(server.url).status()[0].timing  # fetched while it served: the commit read nothing
        assert timing["staged_bytes"] > 0 and timing["in_pause_bytes"] == 0, timing
        at4 = state

        raw, kept = raw_store(url), {}

        def corrupt(vdir):  # version 5's files flipped after they are written, before HEAD names them
            prefix = vdir.split("/")[-1]
            for k in raw.keys(prefix):
                if k.endswith(".safetensors"):
                    kept[k] = data = raw.get(k)
                    raw.put(k, data[:-1] + bytes([data[-1] ^ 1]))

        sender.transport.hook = corrupt
        state = nudged(state, 5)
        sender.update(one_segment(state))
        sender.transport.hook = None
        for v in (6, 7):
            state = nudged(state, v)
            sender.update(one_segment(state))

        def stale():
            r = requests.get(server.url + "/health", timeout=10)
            return r.status_code == 503 and r.json()["head"] == 7

        wait_for(stale, what="the server did not report itself stale")
        report = requests.get(server.url + "/health", timeout=10).json()
        assert report["stale"] and report["version"] == 4 and report["max_lag"] == 1
        r = server.post("/generate", {"text": "the quick", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code != 200 and "stale" in r.text
        assert engine_mismatch(server, at4) is None  # the refused version touched nothing
        for k, data in kept.items():
            raw.put(k, data)
        wait_for(lambda: requests.get(server.url + "/health", timeout=10).status_code == 200,
                 what="the server did not come back once the store was repaired")
        assert weight_version(server) == "7" and engine_mismatch(server, state) is None
        at7, held = state, {}

        def hold_back(vdir):  # HEAD ahead of an object, as a replica copies them in no set order
            k = sorted(k for k in raw.keys(vdir.split("/")[-1]) if k.endswith(".safetensors"))[-1]
            held[k] = raw.get(k)
            raw.delete(k)

        sender.transport.hook = hold_back
        state = nudged(state, 8)
        sender.update(one_segment(state))
        sender.transport.hook = None
        wait_for(lambda: HttpEngine(server.url).status()[0].code == "replicating",
                 what="the server did not say it waits for an object HEAD names")
        assert requests.get(server.url + "/health", timeout=10).status_code == 200  # it serves version 7 meanwhile
        assert weight_version(server) == "7" and engine_mismatch(server, at7) is None
        for k, data in held.items():
            raw.put(k, data)
        wait_for(lambda: weight_version(server) == "8", what="the server did not take the version once it arrived")
        assert engine_mismatch(server, state) is None

        engine = HttpEngine(server.url)  # the trainer pushes to it as well: files checked against their digests
        sender.attach(StoreTransport(url, [engine], zstd=3, key=key), [engine])
        state = nudged(state, 9)
        results = sender.update(one_segment(state))
        assert results[0][0], results
        m = sender.pop_metrics()
        assert m["perf/update_weights_full_sync_engines"] == 0 and m["perf/update_weights_catch_ups"] == 0
        assert engine_mismatch(server, state) is None

        def health():
            r = requests.get(server.url + "/health", timeout=10)
            return r.status_code, r.json() if r.status_code == 503 else None

        # a frozen store: this trainer writes HEAD only at a sync now (the refreshing one was replaced), and none comes
        wait_for(lambda: health()[0] == 503, what="a HEAD older than --update-weight-store-max-age went unnoticed")
        code, report = health()
        assert report["age_s"] > 4 + 1 and report["version"] == report["head"] == 9 and not report["error"], report
        r = server.post("/generate", {"text": "the quick", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code != 200 and "stale" in r.text
        sender.transport.refresh_head()  # the trainer is alive: HEAD signed again, nothing else changed
        wait_for(lambda: health()[0] == 200, what="a HEAD signed again did not make the server fresh")
        head, _ = read_head(open_store(url), key)  # a trainer whose clock runs 30 s ahead writes HEAD
        raw.put("HEAD", seal(head_record(head._replace(time=time.time() + 30)), key))
        wait_for(lambda: health()[0] == 503, what="a HEAD from the future went unnoticed")
        assert "--update-weight-store-clock-skew-s" in health()[1]["error"]
        raw.put("HEAD", seal(head_record(head._replace(time=time.time())), key))  # the clocks set right
        wait_for(lambda: health()[0] == 200, what="the server did not come back once HEAD's time was right")
        assert weight_version(server) == "9" and engine_mismatch(server, state) is None
    finally:
        if server is not None:
            server.stop()
        s3.stop()
