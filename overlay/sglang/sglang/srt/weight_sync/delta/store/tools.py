"""``python -m sglang.srt.weight_sync.delta store compact|gc|log URL``: the store's housekeeping, off the trainer.

* ``compact`` makes a new anchor on any CPU: the newest anchor on ``HEAD``'s chain, then every version up to the
  target applied in HF space (each flush checked like an engine checks it: digest, checksum, xor base), the result's
  fingerprint compared with the one the trainer published for the target; the anchor's manifest, written last, is
  what commits it. Default target: the newest version with a published fingerprint.
* ``gc --keep-anchors N`` keeps the newest N anchors on the chain and every version from the oldest kept one to
  ``HEAD``; it deletes older versions and anchors, and the orphans of crashed or losing publishes at or below
  ``HEAD`` (a publish above ``HEAD`` may be in progress: left alone). It never deletes what ``HEAD`` needs.
* ``log`` lists the chain: versions, encodings, anchors, fingerprints.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional, Tuple

import torch

from sglang.srt.weight_sync.delta import fingerprint
from sglang.srt.weight_sync.delta.files import maybe_zstd_decompress, read_safetensors
from sglang.srt.weight_sync.delta.store import anchor as anchors
from sglang.srt.weight_sync.delta.store.catch_up import _anchor_record, _listed_anchors, _walk
from sglang.srt.weight_sync.delta.store.reads import read_object
from sglang.srt.weight_sync.delta.store.manifest import Head, StoreKey, anchor_dir, digest, read_head, seal
from sglang.srt.weight_sync.delta.store.objects import ObjectStore, StoreUnavailable, open_store
from sglang.srt.weight_sync.delta.tools import rebuilt, write_flush
from sglang.srt.weight_sync.delta.validate import validate_payload
from sglang.srt.weight_sync.delta.wire import DeltaError, Refusal, dtype_to_str

logger = logging.getLogger(__name__)

_MAX_OBJECT = 1 << 40  # the tools run where the user chose; an engine's model-size bound does not apply


def chain(store: ObjectStore, key: StoreKey):
    """HEAD, every version manifest on its chain (as far as the store holds them) and the anchors on it:
    ``(head, records, anchors)`` with ``anchors[v] = (manifest key, digest, record)``."""
    head, _ = read_head(store, key)
    if head is None:
        raise DeltaError(f"store {store.url_root} holds no version yet", Refusal.STORE_UNAVAILABLE)
    records: Dict[int, tuple] = {}
    top = head
    while True:  # through full versions too: gc and compaction see the whole chain
        try:
            part = _walk(store, key, top, -1)
        except StoreUnavailable:
            if not records:
                raise
            break  # collected below here
        records.update(part)
        low = records[min(part)]
        parent = low[2].get("parent")
        if not low[2]["full"] or not parent:
            break
        top = Head(parent[0], parent[1], parent[2], head.chain)
    found = {}
    for v, (_, sha, r) in records.items():
        if r.get("anchor"):
            found[v] = _anchor_record(store, key, head[3], r["anchor"], v)
    for v, entry in _listed_anchors(store, key, head[3], head[0]).items():
        if v in records and entry[2]["version_manifest"] == records[v][1] and v not in found:
            found[v] = entry
    return head, records, found


def compact(url: str, key: StoreKey, version: Optional[int] = None) -> Tuple[int, str]:
    """A new anchor at ``version``; returns ``(version, anchor manifest key)``."""
    store = open_store(url)
    head, records, found = chain(store, key)
    if version is None:
        with_fp = [v for v, (_, _, r) in records.items() if r.get("fingerprint")]
        if not with_fp:
            raise DeltaError("no version on the chain has a published fingerprint: name one with --version "
                             "(checked against its checksums only)")
        version = max(with_fp)
    if version not in records:
        raise DeltaError(f"version {version} is not on HEAD's chain in the store")
    if version in found:
        return version, found[version][0]
    start = max((v for v in found if v < version), default=None)
    if start is None:
        raise DeltaError(f"no anchor below version {version} on the chain")
    state, layout, extra = _load_anchor(store, found[start][2])
    for v in sorted(u for u in records if start < u <= version):
        _apply_version(store, state, records[v][2], records[v][0].rsplit("/", 1)[0])
    published = records[version][2].get("fingerprint")
    if published:
        got = {n: f"{s.total:016x}" for n, s in fingerprint.read_shares(
            {n: fingerprint.tensor_share(n, t) for n, t in state.items()}).items()}
        wrong = sorted(n for n in set(got) | set(published) if got.get(n) != published.get(n))
        if wrong:
            raise DeltaError(f"the compacted version {version} differs from the fingerprint the trainer published "
                             f"on {len(wrong)} tensor(s), e.g. {wrong[:3]}: nothing committed", Refusal.UNVERIFIED)
    else:
        logger.warning("version %d has no published fingerprint: the anchor is checked by the checksums only", version)
    return version, _write_anchor(store, key, head[3], version, records[version][1], state, layout, extra, published)


def _load_anchor(store: ObjectStore, record: dict):
    """An anchor's tensors (its digests checked), which shard each came from, and its other files."""
    state: Dict[str, torch.Tensor] = {}
    layout: Dict[str, List[str]] = {}
    extra: Dict[str, bytes] = {}
    for okey, _, sha in record["objects"]:
        name = okey.rsplit("/", 1)[1]
        data = read_object(store, okey, sha, _MAX_OBJECT)
        if name.endswith(".safetensors"):
            for p in anchors.read_hf_shard(data, okey, version=record["version"], first_flush=0):
                for q in p.spec.params:
                    state[q.name] = p.values[q.val_start:q.val_end].clone().view(q.shape)
                    layout.setdefault(name, []).append(q.name)
        elif name != anchors.INDEX:
            extra[name] = data
    return state, layout, extra


def _apply_version(store: ObjectStore, state: Dict[str, torch.Tensor], record: dict, prefix: str) -> None:
    """Every flush of one version onto ``state``, each checked as an engine checks it before any write."""
    shapes = {n: (list(t.shape), dtype_to_str(t.dtype)) for n, t in state.items()}
    for request in record["requests"]:
        for name, _, sha in request:
            data = read_object(store, f"{prefix}/{name}", sha, _MAX_OBJECT)
            pl = rebuilt(read_safetensors(maybe_zstd_decompress(data, _MAX_OBJECT, name), name), state, shapes)
            write_flush(state, pl, validate_payload(pl, shapes))


def _write_anchor(store: ObjectStore, key: StoreKey, chain_id: str, version: int, manifest_digest: str,
                  state: Dict[str, torch.Tensor], layout: Dict[str, List[str]], extra: Dict[str, bytes],
                  published: Optional[dict]) -> str:
    import safetensors.torch

    akey = f"{anchor_dir(version)}-{os.urandom(4).hex()}"
    objects, weight_map, total = [], {}, 0
    for shard, names in sorted(layout.items()):
        data = safetensors.torch.save({n: state[n].contiguous() for n in names}, metadata={"format": "pt"})
        objects.append(_put(store, f"{akey}/{shard}", data))
        weight_map.update((n, shard) for n in names)
        total += sum(state[n].numel() * state[n].element_size() for n in names)
    objects.append(_put(store, f"{akey}/{anchors.INDEX}", anchors.index_json(weight_map, total)))
    for name, data in sorted(extra.items()):
        objects.append(_put(store, f"{akey}/{name}", data))
    record = {"kind": "anchor", "chain": chain_id, "version": version, "objects": objects,
              "version_manifest": manifest_digest, "fingerprint": published}
    store.put(f"{akey}/manifest.json", seal(record, key))  # written last: the anchor exists from here on
    return f"{akey}/manifest.json"


def _put(store: ObjectStore, okey: str, data: bytes) -> list:
    store.put(okey, data)
    return [okey, len(data), digest(data)]


def gc(url: str, key: StoreKey, keep_anchors: int) -> dict:
    """Delete what no kept anchor's chain to HEAD needs; returns what was kept and deleted."""
    if keep_anchors < 1:
        raise DeltaError("--keep-anchors must be at least 1: HEAD needs an anchor to be reached from scratch")
    store = open_store(url)
    head, records, found = chain(store, key)
    kept_anchors = sorted(found, reverse=True)[:keep_anchors]
    floor = min(kept_anchors) if kept_anchors else min(records)
    keep = {"HEAD"}
    for v, (mkey, _, r) in records.items():
        if v >= floor:
            keep.add(mkey.rsplit("/", 1)[0] + "/")
    for v in kept_anchors:
        keep.add(found[v][0].rsplit("/", 1)[0] + "/")
    doomed, skipped = [], set()
    for okey, _ in store.list(""):
        top = okey.split("/", 1)[0] + "/"
        if okey == "HEAD" or top in keep or not top.startswith(("weight_v", "anchor_v")):
            continue
        try:
            v = int(top[len("weight_v" if top.startswith("weight_v") else "anchor_v"):].split("-")[0].rstrip("/"))
        except ValueError:
            continue
        if v > head[0]:
            skipped.add(top)  # above HEAD: a publish may be in progress
            continue
        doomed.append(okey)
    store.delete(doomed)
    return {"head": head[0], "anchors": sorted(kept_anchors), "versions_from": floor, "deleted": len(doomed),
            "left_above_head": sorted(skipped)}


def log(url: str, key: StoreKey) -> List[str]:
    store = open_store(url)
    head, records, found = chain(store, key)
    lines = [f"HEAD {head[0]} (chain {head[3]})"]
    for v in sorted(records, reverse=True):
        r = records[v][2]
        lines.append(f"v{v:06d} {'full' if r['full'] else r['encoding']:<12} base {r['base_version']:<6} "
                     f"{sum(len(q) for q in r['requests'])} file(s){' fingerprint' if r.get('fingerprint') else ''}"
                     f"{' anchor' if v in found else ''}")
    return lines


def add_parser(sub) -> None:
    """The ``store`` subcommand of the delta CLI."""
    p = sub.add_parser("store", help="the version store's housekeeping: compact, gc, log")
    ops = p.add_subparsers(dest="store_cmd", required=True)
    for name, text in (("compact", "a new anchor from the chain, checked against the published fingerprint"),
                       ("gc", "delete what no kept anchor's chain to HEAD needs"), ("log", "list the chain")):
        q = ops.add_parser(name, help=text)
        q.add_argument("url", help="s3://bucket/prefix or a directory")
        q.add_argument("--key-file", help="the store's key (as --update-weight-store-key-file)")
        if name == "compact":
            q.add_argument("--version", type=int, help="default: the newest version with a published fingerprint")
        if name == "gc":
            q.add_argument("--keep-anchors", type=int, required=True)


def run(args) -> None:
    key = StoreKey.from_file(args.key_file)
    if args.store_cmd == "compact":
        version, where = compact(args.url, key, args.version)
        print(f"anchor of version {version}: {where}")
    elif args.store_cmd == "gc":
        out = gc(args.url, key, args.keep_anchors)
        print(f"HEAD {out['head']}: kept anchors {out['anchors']} and versions from {out['versions_from']}; "
              f"deleted {out['deleted']} object(s)"
              + (f"; left {len(out['left_above_head'])} publish(es) above HEAD" if out["left_above_head"] else ""))
    else:
        print("\n".join(log(args.url, key)))
