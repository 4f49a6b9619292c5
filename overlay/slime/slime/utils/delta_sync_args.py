"""Argument rules of sparse delta weight sync (``--update-weight-mode delta`` with our sparse encodings).

Kept free of torch/megatron imports at module level: ``slime.utils.arguments`` imports it at parse time.
"""

SPARSE_DELTA_ENCODINGS = ("indices", "deltas", "deltas_zstd", "planes_zstd", "xor_zstd", "xor_ctx")
NCCL_ENCODINGS = ("indices", "deltas")


def resolve_delta_args(args) -> None:
    """Unset flags take their defaults here. ``--update-weight-delta-encoding``: 'deltas' over nccl (slime's own
    delta cannot run there); over disk two implementations answer to ``--update-weight-mode delta``, so an unset
    encoding is refused with both named (a patched tree never picks one silently); unused in ``full`` mode.
    ``--update-weight-delta-sharded``: on wherever it runs (:func:`runs_sparse_delta`); set where it cannot, it is
    refused."""
    if getattr(args, "update_weight_delta_encoding", None) is None:
        if args.update_weight_mode == "delta" and args.update_weight_transport == "nccl":
            args.update_weight_delta_encoding = "deltas"
        elif args.update_weight_mode == "delta":
            raise ValueError(
                "--update-weight-mode=delta over disk needs --update-weight-delta-encoding: xor_zstd (this project: "
                "sparse delta files a delta-patched SGLang applies in place, fewest bytes; or deltas_zstd, "
                "planes_zstd) or xor (slime's own delta: a per-host checkpoint patch, then a reload)."
            )
        else:
            args.update_weight_delta_encoding = "xor"  # slime's own default; no delta runs in this mode
    if getattr(args, "update_weight_delta_sharded", None) is None:
        args.update_weight_delta_sharded = runs_sparse_delta(args)
    _check_sharded(args)
    chunk = getattr(args, "update_weight_delta_shard_chunk_bytes", None)
    if chunk is not None and chunk <= 0:
        raise ValueError(f"--update-weight-delta-shard-chunk-bytes={chunk}: give a positive number of bytes "
                         "(unset: --update-weight-buffer-size)")


def shard_chunk_bytes(args) -> int:
    """What the sharded sender holds on a trainer GPU per step beside the flush (``--update-weight-delta-shard-
    chunk-bytes``, unset: ``--update-weight-buffer-size``): the diff's snapshot chunks, the source's rounds, the
    ``xor_ctx`` facts' batches, the shard map build's working blocks. Apart from the buffer, because slime's scripts
    raise the buffer for gather throughput, which the sharded steps do not need."""
    return getattr(args, "update_weight_delta_shard_chunk_bytes", None) or args.update_weight_buffer_size


def runs_sparse_delta(args) -> bool:
    """Whether our sparse delta updater runs (``--update-weight-mode delta``, a sparse encoding): where the pause
    modes other than 'abort' and the sharded sender run."""
    return args.update_weight_mode == "delta" and args.update_weight_delta_encoding in SPARSE_DELTA_ENCODINGS


def _check_sharded(args) -> None:
    if getattr(args, "update_weight_delta_sharded", False) and not runs_sparse_delta(args):
        raise ValueError("--update-weight-delta-sharded runs with --update-weight-mode=delta and a sparse encoding "
                         f"({', '.join(SPARSE_DELTA_ENCODINGS)}); slime's own updaters gather every param")


def add_store_arguments(parser) -> None:
    """The version store's flags (``sglang.srt.weight_sync.delta.store``)."""
    parser.add_argument(
        "--update-weight-store",
        default=None,
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
        default=None,
        help="a shared secret (>= 16 bytes) both sides read: every manifest and HEAD carries its HMAC-SHA256.",
    )
    parser.add_argument(
        "--update-weight-store-anchor-every",
        type=int,
        default=0,
        help=(
            "also write a full anchor (an HF checkpoint) every K versions from the trainer (0, the default: only "
            "the first; later anchors come from `python -m sglang.srt.weight_sync.delta store compact` off the "
            "trainer, which keeps the trainer's upload O(changed))."
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


def validate_pause_mode(args) -> None:
    """``retract``/``in_place`` need our updater (slime's own ones flush the cache, which fails under them) and a
    delta-patched engine (whose cache rule after an update is ``sglang.srt.weight_sync.delta.prefix_cache``)."""
    mode = args.update_weight_pause_mode
    if mode != "abort" and not runs_sparse_delta(args):
        raise ValueError(
            f"--update-weight-pause-mode={mode} runs with --update-weight-mode=delta and a sparse encoding "
            f"({', '.join(SPARSE_DELTA_ENCODINGS)}); slime's own updaters pause with 'abort'."
        )


def sparse_delta_updater_cls(args):
    """The updater class for the sparse encodings, or None so slime's own selection (full, xor|overwrite) stands."""
    _check_sharded(args)
    if not runs_sparse_delta(args):
        return None
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
        UpdateWeightFromDistributedDelta,
    )

    return UpdateWeightFromDistributedDelta
