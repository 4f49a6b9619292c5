"""A version store written from docs/store.md alone (a writer of its own: JSON, sha256, HMAC, plain file and S3
writes, no code of this project), followed by an engine: what the page states is enough to publish to a fleet, and
a record that departs from it in one stated detail is refused."""
import hashlib
import hmac
import json
import os

from safetensors.torch import save_file

from cpu_harness import bf16_state, hf_config, hf_model, rl_steps
from delta_helpers import assert_params_equal
from sglang.srt.weight_sync.delta.receiver import delta_status
from test_store import Engine, reference


class DocWriter:
    """docs/store.md's records and keys, written as the page says."""

    def __init__(self, url: str, key: bytes):
        self.url, self.key, self.chain = url, key, os.urandom(16).hex()

    def put(self, key: str, data: bytes) -> None:
        if self.url.startswith("s3://"):  # the URL's prefix, then "/", then the key
            import boto3

            bucket, prefix = self.url[len("s3://"):].split("/", 1)
            boto3.client("s3").put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=data)
        else:
            path = os.path.join(self.url, key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)

    def record(self, fields: dict, *, upper_mac=False, key=None) -> bytes:
        key = self.key if key is None else key
        body = dict(fields, format=1, chain=self.chain, key_id=hashlib.sha256(key).hexdigest()[:16])
        canon = lambda r: json.dumps(r, sort_keys=True, separators=(",", ":")).encode()  # noqa: E731
        mac = hmac.new(key, canon(body), hashlib.sha256).hexdigest()
        return canon(dict(body, mac=mac.upper() if upper_mac else mac))

    def anchor_version(self, version: int, state: dict, parent, **lie) -> list:
        """An anchor-only version: its HF shard, the anchor's manifest, the version's manifest, then ``HEAD``;
        returns ``[version, manifest key, digest]`` (the next one's ``parent``)."""
        akey, vkey = f"anchor_v{version:06d}-doc", f"weight_v{version:06d}-doc"
        shard = f"{akey}/model-00001-of-00001.safetensors"
        path = os.path.join(self.scratch, f"v{version}.safetensors")
        save_file(state, path)
        with open(path, "rb") as f:
            data = f.read()
        self.put(shard, data)
        anchor = self.record({"kind": "anchor", "version": version, "version_manifest": None, "fingerprint": None,
                              "objects": [[shard, len(data), hashlib.sha256(data).hexdigest()]]}, **lie)
        self.put(f"{akey}/manifest.json", anchor)
        manifest = self.record({"kind": "version", "version": version, "base_version": version, "parent": parent,
                                "encoding": None, "requests": [], "full": True, "fingerprint": None,
                                "anchor": [f"{akey}/manifest.json", hashlib.sha256(anchor).hexdigest()]}, **lie)
        mkey = f"{vkey}/manifest.json"
        self.put(mkey, manifest)
        self.put("HEAD", self.record({"kind": "head", "version": version, "manifest_key": mkey,
                                      "manifest": hashlib.sha256(manifest).hexdigest()}, **lie))
        return [version, mkey, hashlib.sha256(manifest).hexdigest()]


def test_a_store_written_from_the_docs_alone_is_followed_and_a_departure_refused(store_url, tmp_path):
    """A key file as the page makes it (hex text), two anchor-only versions chained by ``parent``: a fresh engine
    and one at the first version both reach the second, bit-identical to a plain load. Then one stated detail wrong
    at a time (the MAC in upper case; the key taken as the bytes its hex encodes): refused ``unverified``, the
    engine untouched."""
    key_file = tmp_path / "store.key"
    key_file.write_text(os.urandom(32).hex() + "\n")
    key = key_file.read_bytes().strip()  # "the file's bytes with surrounding whitespace stripped, used as they are"
    cfg = hf_config("qwen2")
    trainer = hf_model(cfg)
    states = [bf16_state(trainer)]
    states.append(next(rl_steps(trainer, 1)))
    w = DocWriter(store_url, key)
    w.scratch = str(tmp_path)
    parent = w.anchor_version(1, states[0], None)
    behind = Engine(cfg, key_file=str(key_file))
    ok, msg = behind.catch_up(store_url)
    assert ok, msg
    assert delta_status(behind.host.model).version == 1
    assert_params_equal(behind.host.model, reference(cfg, states[0]))
    parent = w.anchor_version(2, states[1], parent)
    fresh = Engine(cfg, key_file=str(key_file))
    for engine in (behind, fresh):
        ok, msg = engine.catch_up(store_url)
        assert ok, msg
        assert delta_status(engine.host.model).version == 2
        assert_params_equal(engine.host.model, reference(cfg, states[1]))
    for lie, words in (({"upper_mac": True}, "MAC mismatch"),
                       ({"key": bytes.fromhex(key.decode())}, "is signed with another key")):
        w.anchor_version(3, next(rl_steps(trainer, 1)), parent, **lie)
        ok, msg = behind.catch_up(store_url)
        status = delta_status(behind.host.model)
        assert not ok and words in msg and status.code == "unverified", (msg, status)
        assert status.version == 2
        assert_params_equal(behind.host.model, reference(cfg, states[1]))
