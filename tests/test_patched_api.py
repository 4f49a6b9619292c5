"""What the patch set adds to SGLang's public surface: names, request fields, server flags."""
from sglang.srt.managers.io_struct import (
    DeltaEncoding,
    DeltaParam,
    DeltaSpec,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
)
from sglang.srt.server_args import prepare_server_args
from sglang.srt.weight_sync.delta import wire


def test_wire_names_are_importable_from_io_struct():
    assert (DeltaEncoding, DeltaParam, DeltaSpec) == (wire.DeltaEncoding, wire.DeltaParam, wire.DeltaSpec)


def test_request_fields():
    disk = UpdateWeightFromDiskReqInput(model_path="/w/weight_v000002", load_format="delta",
                                        files=["rank0000_flush000000.safetensors"], weight_version="2")
    assert disk.files == ["rank0000_flush000000.safetensors"]
    dist = UpdateWeightsFromDistributedReqInput(names=["__positions__", "__values__"], dtypes=["uint8", "bfloat16"],
                                                shapes=[[8], [4]], load_format="delta", delta="{}")
    assert dist.delta == "{}"
    assert UpdateWeightFromDiskReqInput(model_path="m").files is None


def test_server_flags():
    args = prepare_server_args(["--model-path", "dummy", "--update-weight-delta-chunk-bytes", "1048576",
                                "--update-weight-delta-read-workers", "2", "--update-weight-group-timeout", "30"])
    assert (args.update_weight_delta_chunk_bytes, args.update_weight_delta_read_workers,
            args.update_weight_group_timeout) == (1048576, 2, 30.0)
    defaults = prepare_server_args(["--model-path", "dummy"])
    assert (defaults.update_weight_delta_chunk_bytes, defaults.update_weight_delta_read_workers) == (512 << 20, 4)
