"""``python -m sglang.srt.weight_sync.delta diff|apply|inspect|density|store``: delta files outside a training run.

``diff`` turns two HF safetensors checkpoints into delta files in exactly the wire format the
engines take (adjacent-checkpoint deltas, as hosted fine-tuning services ship them); ``apply``
rebuilds the new checkpoint from a base and those files with the engine's own validation, and
refuses a base whose fingerprint differs from the one ``diff`` recorded; ``inspect`` shows what a
delta file or directory holds; ``density`` reports how sparse the step between two checkpoints is; ``store``
compacts, collects and lists a version store (:mod:`store.tools`).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
from typing import Dict, List

import torch

from sglang.srt.weight_sync.delta import fingerprint
from sglang.srt.weight_sync.delta.bucket import DeltaBucket
from sglang.srt.weight_sync.delta.diff import changed_positions, encode_flush
from sglang.srt.weight_sync.delta.files import flush_file, maybe_zstd_decompress, read_safetensors
from sglang.srt.weight_sync.delta.positions import encode_positions
from sglang.srt.weight_sync.delta.validate import check_coded, check_structure, uncode, unxor, validate_payload
from sglang.srt.weight_sync.delta.wire import DeltaEncoding, DeltaError, dtype_to_str, sparse_allowed, zstd_level

MANIFEST = "delta.json"
_MAX_FILE = 1 << 40  # the tools read local files the user named; the engine's model-size bound does not apply


# ---------------------------------------------------------------- checkpoints


class Checkpoint:
    """An HF safetensors checkpoint directory (sharded or not), read tensor by tensor."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise DeltaError(f"{path}: no *.safetensors files (not an HF checkpoint directory)")
        self._where: Dict[str, str] = {}
        self._open = {}
        for f in files:
            h = safe_open(f, framework="pt")
            self._open[f] = h
            for name in h.keys():
                if name in self._where:
                    raise DeltaError(f"{path}: tensor {name!r} appears in two files")
                self._where[name] = f

    def names(self) -> List[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        return self._open[self._where[name]].get_tensor(name)

    def fingerprint(self) -> Dict[str, str]:
        return _fingerprints((n, self.get(n)) for n in self.names())


def _fingerprints(named) -> Dict[str, str]:
    """Per-name fingerprint totals of ``(name, tensor)`` pairs: what ``delta.json`` records of a checkpoint."""
    shares = fingerprint.read_shares({n: fingerprint.tensor_share(n, t) for n, t in named})  # one tensor held at once
    return {n: f"{s.total:016x}" for n, s in shares.items()}


def _progress(items, desc):
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="tensor", file=sys.stderr, disable=not sys.stderr.isatty())


def _read_flush(path: str):
    with open(path, "rb") as f:
        data = f.read()
    return read_safetensors(maybe_zstd_decompress(data, _MAX_FILE, os.path.basename(path)), os.path.basename(path))


def _flush_files(path: str) -> List[str]:
    if os.path.isfile(path):
        return [path]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise DeltaError(f"{path}: no delta files (*.safetensors)")
    return files


# ---------------------------------------------------------------- diff


def diff(old_dir: str, new_dir: str, out: str, encoding: str = "deltas_zstd", buffer_bytes: int = 512 << 20,
         version: int = 1, level: int = None) -> dict:
    old, new = Checkpoint(old_dir), Checkpoint(new_dir)
    if old.names() != new.names():
        extra = sorted(set(old.names()) ^ set(new.names()))
        raise DeltaError(f"the checkpoints hold different tensors, e.g. {extra[:3]}")
    enc = DeltaEncoding(encoding)
    os.makedirs(out, exist_ok=True)
    if glob.glob(os.path.join(out, "*.safetensors")):
        raise DeltaError(f"{out}: already holds delta files")
    bucket = DeltaBucket(enc.value, buffer_bytes)  # groups by dtype: one flush file per dtype
    files, stats, flush = [], {"elements": 0, "changed": 0}, [0]

    held = []  # the newest flush waits: only at the end is it known to be the final one

    def write(pl):
        pl.spec.flush = flush[0]
        pl.seal(spec_only=True)
        data = flush_file(pl, zstd_level(enc.value, level))
        name = f"rank0000_flush{flush[0]:06d}.safetensors"
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
        files.append(name)
        flush[0] += 1

    def emit(payloads):
        held.extend(payloads)
        while len(held) > 1:
            write(held.pop(0))

    spec = dict(version=version, base_version=version - 1, full=False, final=False)
    for name in _progress(new.names(), "diff"):
        a, b = old.get(name), new.get(name)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise DeltaError(f"tensor {name!r}: {dtype_to_str(a.dtype)} {list(a.shape)} in the old checkpoint, "
                             f"{dtype_to_str(b.dtype)} {list(b.shape)} in the new one")
        idx = changed_positions(a, b)
        stats["elements"] += b.numel()
        stats["changed"] += idx.numel()
        if not idx.numel():
            continue
        sparse = sparse_allowed(b.dtype)
        base = (a.reshape(-1)[idx] if sparse else a.reshape(-1)) if enc is DeltaEncoding.XOR_ZSTD else None
        whole = a.reshape(-1) if enc is DeltaEncoding.XOR_CTX else None
        if bucket.should_flush(name):
            emit(bucket.take(**spec))
        bucket.add(name, b, idx if sparse else None, base, whole=whole)
    if len(bucket):
        emit(bucket.take(**spec))
    if not held:  # identical checkpoints: one empty flush still carries the versions
        held.append(encode_flush([], enc.value, bases=[], **spec))
    held[0].spec.final = True  # write() seals the spec again
    write(held.pop())
    manifest = {"format": "delta-weight-sync/1", "encoding": enc.value, "files": files,
                "base_fingerprint": old.fingerprint(), "new_fingerprint": new.fingerprint(),
                "elements": stats["elements"], "changed": stats["changed"]}
    with open(os.path.join(out, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


# ---------------------------------------------------------------- apply


def apply(base_dir: str, delta_dir: str, out: str) -> None:
    with open(os.path.join(delta_dir, MANIFEST)) as f:
        manifest = json.load(f)
    base = Checkpoint(base_dir)
    state = {n: base.get(n).clone() for n in _progress(base.names(), "load base")}
    got = _fingerprints(state.items())
    wrong = sorted(n for n in set(got) | set(manifest["base_fingerprint"])
                   if got.get(n) != manifest["base_fingerprint"].get(n))
    if wrong:
        raise DeltaError(f"{base_dir} is not the base these deltas were made from ({len(wrong)} tensor(s) differ, "
                         f"e.g. {wrong[:3]})")
    shapes = {n: (list(t.shape), dtype_to_str(t.dtype)) for n, t in state.items()}
    payloads = [_read_flush(os.path.join(delta_dir, name)) for name in manifest["files"]]
    if not payloads or not payloads[-1].spec.final or [p.spec.flush for p in payloads] != list(range(len(payloads))):
        raise DeltaError(f"{delta_dir}: flushes are incomplete or out of order")
    # xor_zstd values and xor_ctx blobs are rebuilt against the base (each param appears once per version), then
    # checked like any
    payloads = [rebuilt(pl, state, shapes) for pl in payloads]
    decoded = [validate_payload(pl, shapes) for pl in payloads]  # everything checked before any write
    for pl, positions in zip(payloads, decoded):
        write_flush(state, pl, positions)
    if _fingerprints(state.items()) != manifest["new_fingerprint"]:
        raise DeltaError("the rebuilt checkpoint's fingerprint differs from the one recorded by diff")
    _save_like(base_dir, state, out)


def rebuilt(pl, state: Dict[str, torch.Tensor], shapes: dict):
    """A flush with its ``xor_zstd`` values or ``xor_ctx`` blobs rebuilt against ``state`` (its base); any other
    flush as it is."""
    if pl.coded:
        names = [p.name for p in pl.spec.params]
        return uncode(pl, shapes, lambda pieces: torch.cat(
            [state[names[k]].reshape(-1)[a:a + n] for k, a, n in pieces]))
    if not pl.xored:
        return pl
    return unxor(pl, shapes, lambda ps, ix: torch.cat(
        [state[p.name].reshape(-1) if i is None else state[p.name].reshape(-1)[i] for p, i in zip(ps, ix)]
        or [pl.values[:0]]))


def write_flush(state: Dict[str, torch.Tensor], pl, positions) -> None:
    """A validated flush's values into ``state`` (HF tensors), at its decoded positions."""
    for p in pl.spec.params:
        idx, vals = positions.of(p), pl.values[p.val_start:p.val_end]
        flat = state[p.name].view(-1)
        if idx is None:
            flat.copy_(vals)
        else:
            flat[idx] = vals


def _save_like(base_dir: str, state: Dict[str, torch.Tensor], out: str) -> None:
    """Write ``state`` with the base checkpoint's sharding and its other files (config, tokenizer)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    for f in sorted(os.listdir(base_dir)):
        src = os.path.join(base_dir, f)
        if f.endswith(".safetensors"):
            with safe_open(src, framework="pt") as h:
                names, meta = list(h.keys()), h.metadata()
            save_file({n: state[n].contiguous() for n in names}, os.path.join(out, f), metadata=meta)
        elif os.path.isfile(src):
            shutil.copy2(src, os.path.join(out, f))


# ---------------------------------------------------------------- inspect


def inspect(path: str) -> dict:
    files = _flush_files(path)
    out = {"files": []}
    for f in files:
        try:
            pl = _read_flush(f)
            if pl.xored or pl.coded:  # the checksum covers the new values, which need the base: `apply` checks them
                check_structure(pl) if pl.xored else check_coded(pl)
                status = "unverified"
            else:
                validate_payload(pl, None)
                status = "ok"
        except DeltaError as e:
            out["files"].append({"file": os.path.basename(f), "status": f"refused: {e}"})
            continue
        s = pl.spec
        out["files"].append({
            "file": os.path.basename(f), "status": status, "version": s.version, "base_version": s.base_version,
            "flush": s.flush, "final": s.final, "full": s.full, "encoding": s.encoding, "checksum": s.checksum,
            "bytes": os.path.getsize(f), "params": [
                {"name": p.name, "dtype": p.dtype, "shape": p.shape, "nnz": p.nnz,
                 "density": p.nnz / max(p.numel, 1), "dense": p.dense} for p in s.params]})
    return out


# ---------------------------------------------------------------- density

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def density(old_dir: str, new_dir: str) -> dict:
    old, new = Checkpoint(old_dir), Checkpoint(new_dir)
    params, total, changed = [], 0, 0
    wire = {"full": 0, "indices": 0, "deltas": 0}
    for name in _progress(new.names(), "density"):
        if name not in old:
            raise DeltaError(f"tensor {name!r} is missing from {old_dir}")
        a, b = old.get(name), new.get(name)
        idx = changed_positions(a, b)
        n, k, size = b.numel(), idx.numel(), b.element_size()
        total, changed = total + n, changed + k
        wire["full"] += n * size
        if not sparse_allowed(b.dtype) or not k:
            wire["indices"] += (n * size if k else 0)
            wire["deltas"] += (n * size if k else 0)
        else:
            wire["indices"] += encode_positions(idx, "indices")[0].numel() + k * size
            wire["deltas"] += encode_positions(idx, "deltas")[0].numel() + k * size
        m = _LAYER.search(name)
        params.append({"name": name, "layer": int(m.group(1)) if m else None,
                       "kind": _LAYER.sub(".", name).rsplit(".", 1)[0].split(".")[-1] if m else name,
                       "numel": n, "changed": k, "density": k / max(n, 1)})
    layers: Dict[int, List[int]] = {}
    for p in params:
        if p["layer"] is not None:
            acc = layers.setdefault(p["layer"], [0, 0])
            acc[0] += p["changed"]
            acc[1] += p["numel"]
    return {"density": changed / max(total, 1), "elements": total, "changed": changed, "wire_bytes": wire,
            "layers": {str(k): v[0] / max(v[1], 1) for k, v in sorted(layers.items())}, "params": params}


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds: Dict[str, Dict[int, float]] = {}
    for p in report["params"]:
        if p["layer"] is not None:
            kinds.setdefault(p["kind"], {})[p["layer"]] = 100 * p["density"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for kind, by_layer in sorted(kinds.items()):
        xs = sorted(by_layer)
        ax.plot(xs, [by_layer[x] for x in xs], marker="o", label=kind)
    ax.set_xlabel("layer")
    ax.set_ylabel("changed elements (%)")
    ax.set_title(f"density by layer and parameter kind (overall {100 * report['density']:.2f}%)")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------- CLI


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def parser() -> argparse.ArgumentParser:
    """The command line's parser (the docs' command lines are tested against it)."""
    ap = argparse.ArgumentParser(prog="python -m sglang.srt.weight_sync.delta", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("diff", help="two HF checkpoints -> delta files")
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--out", required=True)
    p.add_argument("--encoding", default="deltas_zstd", choices=[e.value for e in DeltaEncoding])
    p.add_argument("--buffer-size", type=int, default=512 << 20, help="encoded bytes per flush file")
    p.add_argument("--zstd-level", type=int, default=None, help="zstd level of *_zstd files (default: measured per encoding)")
    p = sub.add_parser("apply", help="base checkpoint + delta files -> new checkpoint")
    p.add_argument("base")
    p.add_argument("delta_dir")
    p.add_argument("--out", required=True)
    p = sub.add_parser("inspect", help="manifest of a delta file or directory")
    p.add_argument("path")
    p = sub.add_parser("density", help="per-parameter and per-layer density between two checkpoints")
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--plot")
    p.add_argument("--json", action="store_true")
    from sglang.srt.weight_sync.delta.store import tools as store_tools  # it builds on this module's apply

    store_tools.add_parser(sub)
    return ap


def main(argv=None) -> int:
    from sglang.srt.weight_sync.delta.store import tools as store_tools  # it builds on this module's apply

    args = parser().parse_args(argv)
    try:
        if args.cmd == "store":
            store_tools.run(args)
        elif args.cmd == "diff":
            m = diff(args.old, args.new, args.out, args.encoding, args.buffer_size, level=args.zstd_level)
            size = sum(os.path.getsize(os.path.join(args.out, f)) for f in m["files"])
            print(f"{len(m['files'])} file(s), {_mb(size)}, {m['changed']}/{m['elements']} elements changed "
                  f"({100 * m['changed'] / max(m['elements'], 1):.2f}%) -> {args.out}")
        elif args.cmd == "apply":
            apply(args.base, args.delta_dir, args.out)
            print(f"{args.out}: rebuilt, fingerprint equals the new checkpoint's")
        elif args.cmd == "inspect":
            report = inspect(args.path)
            for f in report["files"]:
                if f["status"] not in ("ok", "unverified"):
                    print(f"{f['file']}: {f['status']}")
                    continue
                nnz, enc = sum(p["nnz"] for p in f["params"]), f["encoding"]
                print(f"{f['file']}: version {f['version']} (base {f['base_version']}), flush {f['flush']}"
                      f"{' final' if f['final'] else ''}{' full' if f['full'] else ''}, {f['encoding']}, "
                      f"{len(f['params'])} params, {nnz} values, {_mb(f['bytes'])}, checksum {f['checksum']} "
                      f"{'ok' if f['status'] == 'ok' else f'unverified ({enc}: apply checks it against the base)'}")
                for q in f["params"]:
                    print(f"  {q['name']:<60} {q['dtype']:<9} {str(q['shape']):<16} nnz {q['nnz']:>10} "
                          f"({100 * q['density']:.2f}%){' dense' if q['dense'] else ''}")
            if any(f["status"] not in ("ok", "unverified") for f in report["files"]):
                return 1
        else:
            report = density(args.old, args.new)
            if args.plot:
                _plot(report, args.plot)
            if args.json:
                print(json.dumps(report, indent=1))
            else:
                w = report["wire_bytes"]
                print(f"density {100 * report['density']:.3f}% ({report['changed']}/{report['elements']} elements)")
                for k in ("indices", "deltas"):
                    print(f"  {k:<8} {_mb(w[k]):>12}  {w['full'] / max(w[k], 1):6.1f}x smaller than full "
                          f"({_mb(w['full'])})")
                for layer, d in report["layers"].items():
                    print(f"  layer {layer:>3}: {100 * d:.3f}%")
    except (DeltaError, OSError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
