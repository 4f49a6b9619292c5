"""The version store's objects: one small interface over a POSIX directory and an S3-compatible bucket.

Objects are immutable once written (``put`` is create-only: a second writer of a key fails, never overwrites),
except ``HEAD``, which moves only by compare-and-swap on its tag (S3: ``If-Match`` on the ETag, ``If-None-Match: *``
for the first; POSIX: an ``flock``-ed compare of its bytes' digest, then ``os.replace``). So a crashed writer leaves
orphans, never a half object, and a second or stale trainer cannot move ``HEAD``.

S3 is reached the way boto3 and SGLang's ``s3://`` connector reach it: credentials and endpoint from the
environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``AWS_REGION``), with a
deadline per call and bounded retries (``DELTA_STORE_TIMEOUT_S``, ``DELTA_STORE_RETRIES``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from typing import Iterator, List, Optional, Tuple

from sglang.srt.weight_sync.delta.wire import DeltaError, Refusal

HEAD = "HEAD"


class StoreUnavailable(DeltaError):
    """An object the store should hold cannot be read (missing, unreachable, denied): availability, not integrity."""

    def __init__(self, message: str):
        super().__init__(message, Refusal.STORE_UNAVAILABLE)


class ObjectAbsent(StoreUnavailable):
    """An object the store does not hold (no such key or file) while a verified record names it: not replicated yet
    (a replica behind its primary, which copies objects in no set order) or deleted. Nothing is written for it."""

    def __init__(self, message: str):
        DeltaError.__init__(self, message, Refusal.REPLICATING)


class HeadMoved(DeltaError):
    """``HEAD`` is not what this writer last saw: another (or a stale) trainer publishes to this store."""

    def __init__(self, message: str):
        super().__init__(message, Refusal.OFF_CHAIN)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ObjectStore:
    """Keys are relative ``/``-separated paths under the store's root; ``url(key)`` names one for a reader."""

    url_root: str

    def url(self, key: str = "") -> str:
        return self.url_root.rstrip("/") + ("/" + key if key else "")

    def put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def get(self, key: str, max_bytes: int) -> bytes:
        raise NotImplementedError

    def read_head(self) -> Tuple[Optional[bytes], Optional[str]]:
        """``HEAD``'s bytes and the tag a compare-and-swap must name (``(None, None)``: no version yet)."""
        raise NotImplementedError

    def swap_head(self, data: bytes, tag: Optional[str]) -> str:
        """Write ``HEAD`` iff it still carries ``tag`` (None: iff there is none); returns the new tag."""
        raise NotImplementedError

    def list(self, prefix: str) -> List[Tuple[str, int]]:
        """``(key, size)`` of every object under ``prefix``, sorted by key."""
        raise NotImplementedError

    def delete(self, keys: List[str]) -> None:
        raise NotImplementedError


class PosixStore(ObjectStore):
    """A directory both sides mount (the ``disk`` transport's directory is one)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.url_root = self.root
        self._lock = threading.Lock()

    def _path(self, key: str) -> str:
        path = os.path.normpath(os.path.join(self.root, key))
        if key.startswith("/") or not path.startswith(self.root + os.sep) and path != self.root:
            raise DeltaError(f"store key {key!r} leaves the store's directory")
        return path

    def check(self) -> None:
        if not os.path.isdir(self.root):
            raise StoreUnavailable(f"store directory {self.root!r} does not exist")

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # create-only: an existing object is never replaced
        except FileExistsError:
            raise HeadMoved(f"store object {key!r} exists already: another writer published it") from None
        finally:
            os.unlink(tmp)

    def get(self, key: str, max_bytes: int) -> bytes:
        path = self._path(key)
        try:
            size = os.path.getsize(path)
            if size > max_bytes:
                raise DeltaError(f"store object {key!r}: {size} bytes exceeds the {max_bytes}-byte bound")
            with open(path, "rb") as f:
                return f.read(size + 1)
        except FileNotFoundError:
            raise ObjectAbsent(f"store object {key!r} is not in the store (not replicated yet, or deleted)") from None
        except OSError as e:
            raise StoreUnavailable(f"store object {key!r}: cannot read ({e.strerror})") from None

    @contextlib.contextmanager
    def _head_lock(self) -> Iterator[None]:
        import fcntl

        with self._lock, open(self._path(".HEAD.lock"), "a+") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def read_head(self) -> Tuple[Optional[bytes], Optional[str]]:
        try:
            with open(self._path(HEAD), "rb") as f:
                data = f.read(1 << 20)
        except FileNotFoundError:
            return None, None
        except OSError as e:
            raise StoreUnavailable(f"store HEAD: cannot read ({e.strerror})") from None
        return data, _digest(data)

    def swap_head(self, data: bytes, tag: Optional[str]) -> str:
        path = self._path(HEAD)
        with self._head_lock():
            _, now = self.read_head()
            if now != tag:
                raise HeadMoved(f"store HEAD moved (expected {tag}, found {now}): another trainer publishes here")
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        return _digest(data)

    def list(self, prefix: str) -> List[Tuple[str, int]]:
        out = []
        for dirpath, _, files in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            for name in files:
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix) and not name.startswith(".HEAD.lock"):
                    with contextlib.suppress(OSError):
                        out.append((key, os.path.getsize(os.path.join(dirpath, name))))
        return sorted(out)

    def delete(self, keys: List[str]) -> None:
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(key))
        for key in keys:  # directories a deletion emptied
            with contextlib.suppress(OSError):
                os.removedirs(os.path.dirname(self._path(key)))


class S3Store(ObjectStore):
    """``s3://bucket/prefix``: conditional writes as AWS S3 and SeaweedFS honour them."""

    def __init__(self, bucket: str, prefix: str, client=None):
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url_root = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.client = client if client is not None else s3_client()

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn, *args, missing_ok: bool = False, absent: bool = False, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(*args, **kwargs)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if missing_ok and code in ("NoSuchKey", "404"):
                return None
            if absent and code == "NoSuchKey":
                raise ObjectAbsent(f"store {what} on {self.url_root}: no such key (not replicated yet, or deleted)") \
                    from None
            if code in ("PreconditionFailed", "412"):
                raise HeadMoved(f"store {what}: a conditional write failed (another writer got there first)") from None
            why = {"403": "access denied (wrong credentials?)", "404": "no such bucket or key"}.get(code, code)
            raise StoreUnavailable(f"store {what} on {self.url_root}: {why} "
                                   f"({e.response.get('Error', {}).get('Message', e)})") from None
        except BotoCoreError as e:
            raise StoreUnavailable(f"store {what} on {self.url_root}: {e}") from None

    def check(self) -> None:
        self._call("bucket check", self.client.head_bucket, Bucket=self.bucket)

    def put(self, key: str, data: bytes) -> None:
        self._call(f"write of {key!r}", self.client.put_object, Bucket=self.bucket, Key=self._key(key), Body=data,
                   IfNoneMatch="*")

    def get(self, key: str, max_bytes: int) -> bytes:
        reply = self._call(f"read of {key!r}", self.client.get_object, Bucket=self.bucket, Key=self._key(key),
                           absent=True)
        if reply["ContentLength"] > max_bytes:
            reply["Body"].close()
            raise DeltaError(f"store object {key!r}: {reply['ContentLength']} bytes exceeds the {max_bytes}-byte bound")
        return self._call(f"read of {key!r}", reply["Body"].read)

    def read_head(self) -> Tuple[Optional[bytes], Optional[str]]:
        reply = self._call("read of HEAD", self.client.get_object, Bucket=self.bucket, Key=self._key(HEAD),
                           missing_ok=True)
        if reply is None:
            return None, None
        return self._call("read of HEAD", reply["Body"].read), reply["ETag"]

    def swap_head(self, data: bytes, tag: Optional[str]) -> str:
        cond = {"IfMatch": tag} if tag is not None else {"IfNoneMatch": "*"}
        reply = self._call("HEAD swap", self.client.put_object, Bucket=self.bucket, Key=self._key(HEAD), Body=data,
                           **cond)
        return reply["ETag"]

    def list(self, prefix: str) -> List[Tuple[str, int]]:
        out, token = [], None
        strip = len(self._key(""))
        while True:
            kwargs = {"ContinuationToken": token} if token else {}
            reply = self._call("listing", self.client.list_objects_v2, Bucket=self.bucket, Prefix=self._key(prefix),
                               **kwargs)
            out += [(o["Key"][strip:], o["Size"]) for o in reply.get("Contents", [])]
            if not reply.get("IsTruncated"):
                return sorted(out)
            token = reply["NextContinuationToken"]

    def delete(self, keys: List[str]) -> None:
        for k in range(0, len(keys), 1000):
            batch = [{"Key": self._key(key)} for key in keys[k:k + 1000]]
            self._call("delete", self.client.delete_objects, Bucket=self.bucket, Delete={"Objects": batch})


def s3_client():
    """boto3's S3 client as SGLang's connector makes it (environment credentials and endpoint), bounded in time."""
    import boto3
    from botocore.config import Config

    timeout = float(os.environ.get("DELTA_STORE_TIMEOUT_S", "30"))
    retries = int(os.environ.get("DELTA_STORE_RETRIES", "3"))
    # a session of its own: credentials are read from the environment now, not cached from an earlier client
    return boto3.session.Session().client("s3", config=Config(connect_timeout=timeout, read_timeout=timeout,
                                                              retries={"max_attempts": retries, "mode": "standard"}))


def open_store(url: str) -> ObjectStore:
    """``s3://bucket/prefix`` or a directory."""
    if not isinstance(url, str) or not url:
        raise DeltaError(f"store URL {url!r}: expected s3://bucket/prefix or a directory")
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise DeltaError(f"store URL {url!r}: no bucket")
        return S3Store(bucket, prefix)
    if "://" in url:
        raise DeltaError(f"store URL {url!r}: only s3:// and directories are stores")
    return PosixStore(url)
