"""Argument rules of sparse delta weight sync (``--update-weight-mode delta`` with our sparse encodings).

Kept free of torch/megatron imports at module level: ``slime.utils.arguments`` imports it at parse time. Every flag
the patched parser adds has its default in :data:`DELTA_ARG_DEFAULTS`: slime and its callers also build argument
namespaces without the parser (tests, role overrides), and those must run as they do upstream.
"""

import argparse

SPARSE_DELTA_ENCODINGS = ("indices", "deltas", "deltas_zstd", "planes_zstd", "xor_zstd", "xor_ctx")
NCCL_ENCODINGS = ("indices", "deltas")

# what the patched parser adds (and the encoding, whose upstream default 'xor' becomes "unset" here)
DELTA_ARG_DEFAULTS = {
    "update_weight_delta_encoding": None,
    "update_weight_delta_fingerprint_interval": 10,
    "update_weight_delta_zstd_level": None,
    "update_weight_delta_sharded": None,
    "update_weight_delta_shard_chunk_bytes": None,
    "update_weight_pause_mode": "abort",
    "update_weight_delta_stage_timeout": 300.0,
    "update_weight_store": None,
    "update_weight_store_key_file": None,
    "update_weight_store_anchor_every": 0,
    "update_weight_store_head_refresh_s": 60.0,
}


def with_delta_defaults(args):
    """``args`` with every attribute of :data:`DELTA_ARG_DEFAULTS` it lacks set to its default."""
    for name, default in DELTA_ARG_DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, default)
    return args


def runs_sparse_delta(args) -> bool:
    """Whether our sparse delta updater runs (``--update-weight-mode delta``, a sparse encoding)."""
    return (args.update_weight_mode == "delta"
            and getattr(args, "update_weight_delta_encoding", None) in SPARSE_DELTA_ENCODINGS)


def resolve_delta_args(args) -> None:
    """Before slime's own delta checks: our defaults on any namespace, and an unset ``--update-weight-delta-encoding``
    over nccl becomes 'deltas' (slime's own delta cannot run there, so slime's checks are for xor|overwrite and an
    unset encoding over disk); unused in ``full`` mode, it becomes slime's 'xor'. An unset
    ``--update-weight-delta-sharded``: on wherever it runs (:func:`runs_sparse_delta`)."""
    with_delta_defaults(args)
    if args.update_weight_delta_encoding is None:
        if args.update_weight_mode == "delta" and args.update_weight_transport == "nccl":
            args.update_weight_delta_encoding = "deltas"
        elif args.update_weight_mode != "delta":
            args.update_weight_delta_encoding = "xor"  # slime's own default; no delta runs in this mode
    if args.update_weight_delta_sharded is None:
        args.update_weight_delta_sharded = runs_sparse_delta(args)


def store_replaces_disk_dir(args) -> bool:
    """Over disk a store takes the shared directory's place (the engines read its versions; nothing reads
    ``--update-weight-disk-dir``), so slime's check for the directory stands aside; where nothing would publish to the
    store, :func:`validate_delta_args` refuses it."""
    return bool(getattr(args, "update_weight_store", None))


def _compresses(args) -> bool:
    return runs_sparse_delta(args) and (args.update_weight_delta_encoding not in NCCL_ENCODINGS
                                        or bool(args.update_weight_store))


# a flag of ours set away from its default, and where it is used: anywhere else it is refused, not ignored (the pause
# modes retract|in_place need our updater: slime's own ones flush the cache, which fails under them)
_USED_WITH = (
    ("update_weight_store", runs_sparse_delta, "--update-weight-mode delta and a sparse encoding"),
    ("update_weight_pause_mode", runs_sparse_delta, "--update-weight-mode delta and a sparse encoding"),
    ("update_weight_delta_sharded", runs_sparse_delta, "--update-weight-mode delta and a sparse encoding"),
    ("update_weight_delta_fingerprint_interval", runs_sparse_delta, "--update-weight-mode delta and a sparse encoding"),
    ("update_weight_delta_stage_timeout", lambda a: runs_sparse_delta(a) and a.update_weight_transport == "disk",
     "a sparse encoding over --update-weight-transport disk (a directory or a store)"),
    ("update_weight_delta_shard_chunk_bytes", lambda a: bool(a.update_weight_delta_sharded),
     "the sharded sender (--update-weight-delta-sharded)"),
    ("update_weight_delta_zstd_level", _compresses,
     "a compressed encoding (deltas_zstd, planes_zstd, xor_zstd, xor_ctx) or --update-weight-store"),
    ("update_weight_store_key_file", store_replaces_disk_dir, "--update-weight-store"),
    ("update_weight_store_anchor_every", store_replaces_disk_dir, "--update-weight-store"),
    ("update_weight_store_head_refresh_s", store_replaces_disk_dir, "--update-weight-store"),
)


def validate_delta_args(args) -> None:
    """After slime's own checks (they keep their messages): over disk an unset encoding is refused with both
    implementations named (a patched tree never picks one silently); the sparse encodings' rules; a flag of ours set
    where nothing would use it is refused, naming what uses it."""
    if args.update_weight_delta_encoding is None:
        raise ValueError(
            "--update-weight-mode=delta over disk needs --update-weight-delta-encoding: xor_ctx or xor_zstd (this "
            "project: sparse delta files a delta-patched SGLang applies in place; xor_ctx the fewest bytes, or "
            "deltas_zstd, planes_zstd) or xor (slime's own delta: a per-host checkpoint patch, then a reload)."
        )
    if runs_sparse_delta(args):
        validate_sparse_delta_args(args)
    for name, used, where in _USED_WITH:
        value = getattr(args, name)
        if value not in (DELTA_ARG_DEFAULTS[name], False) and not used(args):
            raise ValueError(f"--{name.replace('_', '-')}={value} is used only with {where}; with "
                             f"{_what_runs(args)} nothing would use it: drop it, or run what uses it.")
    if args.update_weight_delta_stage_timeout < 0:
        raise ValueError(f"--update-weight-delta-stage-timeout={args.update_weight_delta_stage_timeout}: give seconds "
                         "(0: announce each publish as it is written, inside the pause)")
    if args.update_weight_store_head_refresh_s < 0:
        raise ValueError(f"--update-weight-store-head-refresh-s={args.update_weight_store_head_refresh_s}: give "
                         "seconds (0: HEAD is written only by a sync's commit)")
    chunk = args.update_weight_delta_shard_chunk_bytes
    if chunk is not None and chunk <= 0:
        raise ValueError(f"--update-weight-delta-shard-chunk-bytes={chunk}: give a positive number of bytes "
                         "(unset: --update-weight-buffer-size)")


def _what_runs(args) -> str:
    if args.update_weight_mode != "delta":
        return f"--update-weight-mode {args.update_weight_mode}"
    if not runs_sparse_delta(args):
        return f"slime's own --update-weight-delta-encoding {args.update_weight_delta_encoding}"
    return (f"--update-weight-delta-encoding {args.update_weight_delta_encoding} over "
            f"{args.update_weight_transport}{' with a store' if args.update_weight_store else ''}")


def shard_chunk_bytes(args) -> int:
    """What the sharded sender holds on a trainer GPU per step beside the flush (``--update-weight-delta-shard-
    chunk-bytes``, unset: ``--update-weight-buffer-size``): the diff's snapshot chunks, the source's rounds, the
    ``xor_ctx`` facts' batches, the shard map build's working blocks. Apart from the buffer, because slime's scripts
    raise the buffer for gather throughput, which the sharded steps do not need."""
    return getattr(args, "update_weight_delta_shard_chunk_bytes", None) or args.update_weight_buffer_size


def add_delta_arguments(parser) -> None:
    """The flags sparse delta sync adds beside slime's own ``--update-weight-*`` (defaults: :data:`DELTA_ARG_DEFAULTS`)."""
    d = DELTA_ARG_DEFAULTS
    parser.add_argument(
        "--update-weight-delta-fingerprint-interval",
        type=int,
        default=d["update_weight_delta_fingerprint_interval"],
        help=(
            "the sparse encodings: every K syncs (default 10), compare each engine's weight fingerprint "
            "with the trainer's; a mismatch gives that engine a full sync. 0 never checks."
        ),
    )
    parser.add_argument(
        "--update-weight-delta-zstd-level",
        type=int,
        default=d["update_weight_delta_zstd_level"],
        help=(
            "zstd level of the sparse delta files (deltas_zstd|planes_zstd|xor_zstd|xor_ctx); unset: the measured "
            "default, 1 (sglang.srt.weight_sync.delta.wire.ZSTD_LEVELS)."
        ),
    )
    parser.add_argument(
        "--update-weight-delta-sharded",
        action=argparse.BooleanOptionalAction,
        default=d["update_weight_delta_sharded"],
        help=(
            "the sparse encodings (on by default with them): every trainer rank diffs the slice of its own "
            "Megatron shard it owns and sends its stage's source rank only what changed (no rank keeps or "
            "scans a snapshot of the whole stage); params whose HF conversion is not a permutation "
            "(trainer-side FP8) keep the gather path. --no-update-weight-delta-sharded: the source rank "
            "diffs the gathered HF params of its whole stage."
        ),
    )
    parser.add_argument(
        "--update-weight-delta-shard-chunk-bytes",
        type=int,
        default=d["update_weight_delta_shard_chunk_bytes"],
        help=(
            "the sharded sender: what it holds on a trainer GPU per step beside the flush (default: "
            "--update-weight-buffer-size): the snapshot chunks the diff moves to the device, the rounds "
            "the stage's source merges (this / 64 B changes; a name with more is split by position), "
            "the xor_ctx facts' batches and the shard map build's working blocks. Lower it when the "
            "buffer is raised for gather throughput (docs/memory.md)."
        ),
    )
    parser.add_argument(
        "--update-weight-pause-mode",
        choices=["abort", "retract", "in_place"],
        default=d["update_weight_pause_mode"],
        help=(
            "What a weight sync does to requests in flight on the engines. 'abort' (default): they return "
            "and the cache is flushed before the sync. The sparse encodings also take 'retract': they wait "
            "without KV and are recomputed on the new weights; 'in_place': they keep their KV (computed by "
            "the old weights) and continue, while every later request starts from the new weights."
        ),
    )
    parser.add_argument(
        "--update-weight-delta-stage-timeout",
        type=float,
        default=d["update_weight_delta_stage_timeout"],
        help=(
            "the sparse encodings over disk: the engines fetch each publish's files while they keep generating, and "
            "are paused only to commit, once every engine fetched the version or after this many seconds (default "
            "300); an engine that has not reads the rest inside the pause. 0: pause first, announce each publish "
            "as it is written."
        ),
    )
    parser.add_argument(
        "--update-weight-store",
        default=d["update_weight_store"],
        help=(
            "the sparse encodings: publish every sync as a version of this store (s3://bucket/prefix, credentials "
            "and endpoint from the environment as boto3 reads them, or a directory); over disk instead of "
            "--update-weight-disk-dir, over nccl beside the broadcast. Engines that start late, restart or fall "
            "behind catch up from it by themselves (over nccl nothing crosses the group for them); the trainer "
            "writes the whole model once (the first anchor)."
        ),
    )
    parser.add_argument(
        "--update-weight-store-key-file",
        default=d["update_weight_store_key_file"],
        help="a shared secret (>= 16 bytes) both sides read: every manifest and HEAD carries its HMAC-SHA256.",
    )
    parser.add_argument(
        "--update-weight-store-anchor-every",
        type=int,
        default=d["update_weight_store_anchor_every"],
        help=(
            "also write a full anchor (an HF checkpoint) every K versions from the trainer (0, the default: only "
            "the first; later anchors come from `python -m sglang.srt.weight_sync.delta store compact` off the "
            "trainer, which keeps the trainer's upload O(changed))."
        ),
    )
    parser.add_argument(
        "--update-weight-store-head-refresh-s",
        type=float,
        default=d["update_weight_store_head_refresh_s"],
        help=(
            "write the store's HEAD again, with the time of now, whenever no sync wrote it for this many seconds "
            "(default 60; 0: only syncs write it): engines with --update-weight-store-max-age tell a trainer that "
            "evaluates or checkpoints from a frozen store. Keep it below their max-age less their poll interval."
        ),
    )


def validate_sparse_delta_args(args) -> None:
    """Refuse combinations that cannot work, with the fix in the message."""
    if args.colocate:
        raise ValueError(
            "--update-weight-mode=delta is not supported with --colocate: colocated engines receive CUDA IPC "
            "handles (~64 B per tensor), so there are no bytes to save and the snapshot+diff is pure overhead."
        )
    if args.update_weight_transport == "nccl" and args.update_weight_delta_encoding not in NCCL_ENCODINGS:
        raise ValueError(
            f"--update-weight-delta-encoding={args.update_weight_delta_encoding} compresses files and is disk-only; "
            "with --update-weight-transport=nccl use --update-weight-delta-encoding=deltas (or indices)."
        )


def sparse_delta_updater_cls(args):
    """The updater class for the sparse encodings, or None so slime's own selection (full, xor|overwrite) stands."""
    with_delta_defaults(args)
    if not runs_sparse_delta(args):
        return None
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
        UpdateWeightFromDistributedDelta,
    )

    return UpdateWeightFromDistributedDelta
