"""An engine's side of the version store: catch-up from what the engine holds to a target version.

Catch-up (``/update_weights_from_disk`` with ``load_format: delta``, ``model_path``: the store's URL,
``store: {"catch_up": true}``, ``weight_version``: the target or none for ``HEAD``):

1. ``HEAD`` is read and verified; the manifests are walked from it through their ``parent`` links, each checked
   against the digest its child (or ``HEAD``) names, so every record below ``HEAD`` is as authentic as ``HEAD``.
2. Refused before any write (a status code, weights untouched): a ``HEAD`` below the engine's version (rolled back),
   a target below it (never backwards), another chain than the one the engine follows, a chain whose record of the
   engine's version differs from the one the engine applied (grafted), any record or object that fails its MAC or
   digest.
3. The path: deltas from the engine's version where the chain allows (a version applies to an engine at any version
   in ``[base_version, version)``; ``xor_zstd`` only at exactly ``base_version``), else the newest anchor at or
   below the target (a full version of the trainer's, or one made by compaction), loaded as a full sync through
   the model's own loader, then the chain. Each publish of a version is applied as the request it was.
4. A version is taken whole or not at all (``whole``): every request of it (every anchor shard) is staged (read,
   digest-checked, checked, rebuilt, decoded) before the first is committed; one broken object leaves the engine at
   the last whole version of the walk. Past ``--update-weight-delta-chunk-bytes`` of decoded requests
   every object of the rest is digest-checked before that first write too, then applied request by request. Objects
   a follower fetched while it served (``staging``) are not read again.

With tensor parallelism the first rank plans and reads; the plan and each request's blobs reach the other ranks
over the TP group, and every rank applies through the same receiver path as a pushed request.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional, Tuple

from sglang.srt.weight_sync.delta.collectives import broadcast_json, tp_group
from sglang.srt.weight_sync.delta.commit import refused
from sglang.srt.weight_sync.delta.engine_state import host_model, receiver_state, server_arg
from sglang.srt.weight_sync.delta.ingest import max_request_bytes, read_files_once
from sglang.srt.weight_sync.delta.store import staging
from sglang.srt.weight_sync.delta.store.anchor import read_hf_shard
from sglang.srt.weight_sync.delta.store.manifest import RECORD_CAP, StoreKey, digest, open_record, read_head
from sglang.srt.weight_sync.delta.store.objects import ObjectStore, StoreUnavailable, open_store
from sglang.srt.weight_sync.delta.store.reads import check_objects, read_flushes, read_object
from sglang.srt.weight_sync.delta.whole import take_version
from sglang.srt.weight_sync.delta.wire import DeltaError, Refusal

logger = logging.getLogger(__name__)


def store_key(host) -> StoreKey:
    return StoreKey.from_file(server_arg(host, "update_weight_store_key_file", None))


# ---------------------------------------------------------------- catch-up


def catch_up(host, url: str, weight_version: Optional[str]) -> Tuple[bool, str]:
    """Bring this engine to ``weight_version`` (None: ``HEAD``) from the store at ``url``; see the module docstring.
    A chain collected under it (an object gone mid-way), or a version that failed part-way, is planned again once:
    from a newer anchor, which replaces every weight."""
    model = host_model(host)
    t0 = time.perf_counter()
    staging.remember(host, url)
    ok, msg = _catch_up(host, url, weight_version)
    state = receiver_state(model)
    if not ok and (state.last[1] in (Refusal.STORE_UNAVAILABLE.value, Refusal.REPLICATING.value) or state.dirty):
        # an object gone (collected under it, or not there yet), or dirty: it stopped part-way
        logger.warning("catch-up from %s: %s; planning again", url, msg)
        ok, msg = _catch_up(host, url, weight_version)
    stage = staging.stage_of(model)
    if ok:
        state.timing = {"stage_s": stage.stage_s if stage.taken_bytes else 0.0,
                        "commit_s": round(time.perf_counter() - t0, 6), "staged_bytes": stage.taken_bytes,
                        "in_pause_bytes": stage.read_bytes}
    stage.drop()  # committed, or refused: a stage is for one commit
    return ok, msg


def _catch_up(host, url: str, weight_version: Optional[str]) -> Tuple[bool, str]:
    state = receiver_state(host_model(host))
    group = tp_group()
    plan, error, store = None, None, None  # the first TP rank plans and reads; the others take what it sends
    if group is None or group.rank_in_group == 0:
        try:
            store = open_store(url)
            plan = plan_catch_up(store, store_key(host), state, weight_version)
        except DeltaError as e:
            error = e
        except Exception as e:  # a store that cannot answer is an availability fault, never a weight change
            error = StoreUnavailable(f"store {url}: {e!r}")
        if group is not None:
            broadcast_json(group, {"error": [str(error), error.code.value]} if error else {"plan": plan})
    else:
        shared = broadcast_json(group)
        if "error" in shared:
            error = DeltaError(shared["error"][0], Refusal(shared["error"][1]))
        plan = shared.get("plan")
    if error is not None:
        return refused(state, error)
    if not plan["steps"]:
        return True, f"already at version {state.version}"
    for step in plan["steps"]:
        ok, msg = _take_version(host, store, step)
        if not ok:
            return False, f"catch-up to version {plan['target']} stopped at version {step['version']}: {msg}"
        state.store_chain, state.store_manifest = plan["chain"], (step["version"], step["digest"])
    return True, (f"caught up to version {plan['target']} from the store ({plan['how']}, "
                  f"{len(plan['steps'])} step(s))")


def _take_version(host, store: Optional[ObjectStore], step: dict) -> Tuple[bool, str]:
    """One version of a catch-up, whole or not at all (``whole.take_version``); past the bound, every object of the
    rest is digest-checked before the first write (kept in the host stage where ``--update-weight-delta-stage-bytes``
    allows, else read again)."""
    counts: dict = {}  # the requests of each anchor shard read so far
    return take_version(host, f"version {step['version']} in the store", step["version"],
                        lambda skip: _requests(host, store, step, skip=skip, counts=counts),
                        lambda rest: check_objects(host, store, _objects_from(step, rest, counts)),
                        replaces=step["kind"] == "anchor")


def _objects_from(step: dict, first: int, counts: dict) -> List[Tuple[str, str]]:
    """(key, digest) of every object holding a request of ``step`` from the ``first``-th on (``counts``: the requests
    of each anchor shard read so far; a shard not read yet holds later ones)."""
    if step["kind"] != "anchor":
        return [(f"{step['dir']}/{name}", sha) for entries in step["requests"][first:] for name, _, sha in entries]
    out, index = [], 0
    for j, (okey, _, sha) in enumerate(o for o in step["objects"] if o[0].endswith(".safetensors")):
        n = counts.get(j)
        if n is None or index + n > first:
            out.append((okey, sha))
        index += n or 0
    return out


def _requests(host, store: Optional[ObjectStore], step: dict, skip: int = 0, counts: Optional[dict] = None):
    """Each request of one step as the receiver takes it, from the ``skip``-th on: its payloads, or the error that
    refuses it. An anchor's shards are read from the first holding a request from ``skip`` on (``counts``: the
    requests of each shard, as a first pass found them)."""
    if step["kind"] == "anchor":  # each shard's dense flushes, the last of all marked final (held back one)
        held, flush, index = None, 0, 0
        shards = [(okey, sha) for okey, _, sha in step["objects"] if okey.endswith(".safetensors")]
        for j, (okey, sha) in enumerate(shards):
            n = (counts or {}).get(j)
            if n is not None and index + n <= skip:  # every request of this shard is before ``skip``: not read
                flush, index = flush + n, index + n
                continue

            def reader(okey=okey, sha=sha, first=flush):
                data = read_object(store, okey, sha, max_request_bytes(host_model(host)))
                staging.count_read(host_model(host), len(data))
                return read_hf_shard(data, okey, version=step["version"], first_flush=first)

            try:
                payloads = read_files_once(host, okey, [okey], reader=reader)
            except DeltaError as e:
                yield {"payloads": [], "error": e}
                return
            if counts is not None:
                counts[j] = len(payloads)
            flush += len(payloads)
            for p in payloads:
                if index >= skip:
                    if held is not None:
                        yield {"payloads": [held]}
                    held = p
                index += 1
        if held is None:
            yield {"payloads": [], "error": DeltaError(f"the anchor of version {step['version']} holds no weights",
                                                       Refusal.UNVERIFIED)}
            return
        held.spec.final = True
        held.seal(spec_only=True)
        yield {"payloads": [held]}
        return
    for entries in step["requests"][skip:]:
        try:
            payloads = read_files_once(host, step["dir"], [e[0] for e in entries],
                                       reader=lambda entries=entries: read_flushes(host, store, step["dir"], entries))
        except DeltaError as e:
            yield {"payloads": [], "error": e}
            return
        yield {"payloads": payloads}


def plan_catch_up(store: ObjectStore, key: StoreKey, state, weight_version: Optional[str]) -> dict:
    head, _ = read_head(store, key)
    if head is None:
        raise StoreUnavailable(f"store {store.url_root} holds no version yet")
    top, chain = head.version, head.chain
    target = top if weight_version in (None, "", "None") else int(weight_version)
    have = None if state.version is None or state.dirty or state.outside_load or state.manifest is None \
        else state.version
    if state.store_chain is not None and state.store_chain != chain:
        raise DeltaError(f"the store's chain {chain} is not the one this engine follows ({state.store_chain}): "
                         "grafted or another run's store", Refusal.OFF_CHAIN)
    if state.version is not None and top < state.version:
        raise DeltaError(f"the store's HEAD is at version {top}, below this engine's version {state.version} "
                         "(rolled back?)", Refusal.OFF_CHAIN)
    if target > top:
        raise DeltaError(f"version {target} is not in the store (HEAD at {top})", Refusal.OFF_CHAIN)
    if state.version is not None and target < state.version:
        raise DeltaError(f"version {target} is below this engine's version {state.version}: an engine never moves "
                         "backwards", Refusal.OFF_CHAIN)
    if have is not None:  # the chain from what the engine holds, where the store still has it: nothing listed
        records = _walk(store, key, head, have)
        _check_held(state, records)
        steps = [] if target == have else _deltas(records, have, target)
        if steps is not None:
            return {"steps": steps, "target": target, "chain": chain, "how": "deltas" if steps else "nothing to do"}
    anchors = _listed_anchors(store, key, chain, target)
    records = _walk(store, key, head, max(anchors, default=0))
    _check_held(state, records)
    candidates = {}  # anchors on HEAD's chain at or below the target (one request: no forward pass sees it)
    for v, (_, sha, r) in records.items():
        if v > target:
            continue
        if r.get("anchor"):  # written by the trainer (a full version, or one every K)
            candidates[v] = _anchor_record(store, key, chain, r["anchor"], v)
        elif v in anchors and anchors[v][2]["version_manifest"] == sha:
            candidates[v] = anchors[v]
    start = max(candidates, default=None)
    rest = _deltas(records, start, target) if start is not None else None
    if rest is None:
        raise StoreUnavailable(f"the store holds no anchor at or below version {target} with a chain to it "
                               f"(engine at {state.version})")
    objects = candidates[start][2]["objects"]
    if not any(o[0].endswith(".safetensors") for o in objects):
        raise DeltaError(f"the anchor of version {start} lists no weights", Refusal.UNVERIFIED)
    steps = [{"kind": "anchor", "version": start, "objects": objects, "digest": records[start][1]}] + rest
    return {"steps": steps, "target": target, "chain": chain, "how": f"anchor {start}"}


def _walk(store: ObjectStore, key: StoreKey, head, floor: int) -> Dict[int, tuple]:
    """Version -> (manifest key, digest, record), from ``HEAD`` down through ``parent`` links to ``floor``, a full
    version, or the first manifest the store no longer holds (collected)."""
    version, mkey, sha, chain = head[:4]
    out, child = {}, None
    while True:
        try:
            data = store.get(mkey, RECORD_CAP)
        except StoreUnavailable:
            if child is None:
                raise
            break  # collected below here: the path must start above
        if digest(data) != sha:
            raise DeltaError(f"the manifest of version {version} does not match the digest "
                             f"{'HEAD' if child is None else f'version {child}'} names", Refusal.UNVERIFIED)
        r = open_record(data, key, f"manifest of version {version}", "version")
        if r.get("chain") != chain or r.get("version") != version:
            raise DeltaError(f"the manifest at {mkey} says chain {r.get('chain')} version {r.get('version')}, its "
                             f"link says {chain} {version}", Refusal.UNVERIFIED)
        out[version] = (mkey, sha, r)
        parent = r.get("parent")
        if version <= floor or r["full"] or not parent:
            return out
        child = version
        if not (isinstance(parent, list) and len(parent) == 3 and isinstance(parent[0], int) and parent[0] < version):
            raise DeltaError(f"the manifest of version {version} names a malformed parent", Refusal.UNVERIFIED)
        version, mkey, sha = parent
    return out


def _check_held(state, records: Dict[int, tuple]) -> None:
    """The engine's own record of the version it holds, where it came from this store, must be the chain's."""
    held = state.store_manifest
    if held is not None and held[0] in records and records[held[0]][1] != held[1]:
        raise DeltaError(f"the store's record of version {held[0]} differs from the one this engine applied: "
                         "the chain was rewritten (grafted)", Refusal.OFF_CHAIN)


def _deltas(records: Dict[int, tuple], have: int, target: int) -> Optional[List[dict]]:
    """The fewest delta versions from ``have`` to ``target`` (greedy: the highest version that applies), or None."""
    steps, at = [], have
    while at < target:
        fits = [v for v, (_, _, r) in records.items() if at < v <= target and not r["full"]
                and r["base_version"] <= at and (r["encoding"] not in ("xor_zstd", "xor_ctx") or r["base_version"] == at)]
        if not fits:
            return None
        at = max(fits)
        mkey, sha, r = records[at]
        steps.append({"kind": "delta", "version": at, "requests": r["requests"], "dir": mkey.rsplit("/", 1)[0],
                      "digest": sha})
    return steps


def _anchor_record(store: ObjectStore, key: StoreKey, chain: str, link, version: int) -> tuple:
    akey, sha = link
    data = store.get(akey, RECORD_CAP)
    if digest(data) != sha:
        raise DeltaError(f"the anchor manifest of version {version} does not match the digest its version "
                         "names", Refusal.UNVERIFIED)
    r = open_record(data, key, f"anchor manifest of version {version}", "anchor")
    if r.get("chain") != chain or r.get("version") != version:
        raise DeltaError(f"the anchor at {akey} is not version {version} of chain {chain}", Refusal.UNVERIFIED)
    return akey, sha, r


def _listed_anchors(store: ObjectStore, key: StoreKey, chain: str, target: int) -> Dict[int, tuple]:
    """Compacted anchors the store lists (verified; each is tied to HEAD's chain by its version manifest's digest,
    checked by the caller against the walk)."""
    out = {}
    for okey, _ in store.list("anchor_v"):
        if not okey.endswith("/manifest.json"):
            continue
        try:
            v = int(okey.split("/")[0][len("anchor_v"):].split("-")[0])
        except ValueError:
            continue
        if v > target or (v in out):
            continue
        try:
            data = store.get(okey, RECORD_CAP)
            r = open_record(data, key, f"anchor manifest {okey}", "anchor")
        except DeltaError as e:
            logger.warning("skipping anchor %s: %s", okey, e)
            continue
        if r.get("chain") == chain and r.get("version") == v and r.get("version_manifest"):
            out[v] = (okey, digest(data), r)
    return out
