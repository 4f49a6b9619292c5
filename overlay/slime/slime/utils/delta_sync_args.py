"""Argument rules of sparse delta weight sync (``--update-weight-mode delta`` with indices|deltas|deltas_zstd).

Kept free of torch/megatron imports at module level: ``slime.utils.arguments`` imports it at parse time.
"""

SPARSE_DELTA_ENCODINGS = ("indices", "deltas", "deltas_zstd")
NCCL_ENCODINGS = ("indices", "deltas")


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
            "with --update-weight-transport=nccl use --update-weight-delta-encoding=indices (or deltas)."
        )
    if args.update_weight_transport == "disk" and getattr(args, "pipeline_model_parallel_size", 1) > 1:
        raise ValueError(
            "sparse delta sync over disk does not support pipeline parallelism yet "
            "(use --update-weight-transport=nccl, or PP=1)."
        )


def sparse_delta_updater_cls(args):
    """The updater class for the sparse encodings, or None so slime's own selection (full, xor|overwrite) stands."""
    if args.update_weight_mode != "delta" or args.update_weight_delta_encoding not in SPARSE_DELTA_ENCODINGS:
        return None
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed_delta import (
        UpdateWeightFromDistributedDelta,
    )

    return UpdateWeightFromDistributedDelta
