"""The patched ``slime_validate_args`` on namespaces built as slime's own tests build them (its helpers, loaded from the
checkouts): no attribute of ours is required, slime's checks run first with slime's messages, and with delta sync
off a patched tree leaves exactly what a pristine one leaves. Needs both checkouts (``make test-slime``)."""
import importlib.util
import os

import pytest

SLIME = os.environ.get("SLIME_PATCHED_DIR")
PRISTINE = os.environ.get("SLIME_PRISTINE_DIR")
pytestmark = pytest.mark.skipif(
    not (SLIME and PRISTINE),
    reason="needs the pristine and the patched slime checkouts: run `make test-slime SLIME_DIR=/path/to/slime`")


def _slimes_helpers(tree: str, name: str):
    """slime's ``tests/test_megatron_argument_validation.py`` from ``tree``: its namespace builder, and its loader of
    that tree's ``slime/utils/arguments.py``."""
    path = os.path.join(tree, "tests", "test_megatron_argument_validation.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def slime(monkeypatch):
    helpers = _slimes_helpers(SLIME, "slime_helpers_patched")
    return helpers, helpers.load_slime_arguments_module(monkeypatch)


@pytest.fixture
def pristine(monkeypatch):
    helpers = _slimes_helpers(PRISTINE, "slime_helpers_pristine")
    return helpers, helpers.load_slime_arguments_module(monkeypatch)


def _validated(module, helpers, **over):
    args = helpers.make_slime_validate_args(**over)
    try:
        module.slime_validate_args(args)
    except (ValueError, AssertionError) as e:
        return type(e).__name__, str(e)
    return vars(args)


# slime's own weight sync flag sets, as its tests spell them, where delta sync (ours) is off
_SLIMES_OWN = [
    {},
    {"update_weight_transport": "disk", "update_weight_disk_dir": "/shared/full"},
    {"update_weight_transport": "disk", "update_weight_disk_dir": None},
    {"update_weight_mode": "delta", "update_weight_transport": "disk", "update_weight_disk_dir": "/shared/delta",
     "update_weight_local_checkpoint_dir": "/local/ckpt", "update_weight_delta_encoding": "xor"},
    {"update_weight_mode": "delta", "update_weight_transport": "disk", "update_weight_disk_dir": "/shared/delta",
     "update_weight_local_checkpoint_dir": "/local/ckpt", "update_weight_delta_encoding": "overwrite"},
    {"update_weight_mode": "delta", "update_weight_transport": "disk", "update_weight_disk_dir": "/shared/delta",
     "update_weight_local_checkpoint_dir": None, "update_weight_delta_encoding": "xor"},
    {"update_weight_mode": "delta", "update_weight_transport": "disk", "update_weight_disk_dir": "/shared/delta",
     "update_weight_local_checkpoint_dir": "/local/ckpt", "colocate": True},
    {"update_weight_mode": "delta", "update_weight_transport": "disk", "update_weight_disk_dir": "/shared/delta",
     "update_weight_local_checkpoint_dir": None},
    {"start_rollout_id": 100, "megatron_to_hf_mode": "bridge"},
    {"colocate": True, "rollout_num_gpus": 0},
]


@pytest.mark.parametrize("over", _SLIMES_OWN, ids=range(len(_SLIMES_OWN)))
def test_slimes_own_flag_sets_validate_as_on_a_pristine_tree(slime, pristine, over):
    """The same namespace through both trees' ``slime_validate_args``: the same refusal (type and message), or the
    same namespace but for the attributes the patched parser adds, at their defaults."""
    from slime.utils.delta_sync_args import DELTA_ARG_DEFAULTS

    before = _validated(pristine[1], pristine[0], **over)
    after = _validated(slime[1], slime[0], **over)
    if isinstance(before, tuple):
        assert after == before
        return
    ours = {k: after.pop(k) for k in DELTA_ARG_DEFAULTS if k not in before}
    assert after == before
    assert ours == {**{k: v for k, v in DELTA_ARG_DEFAULTS.items() if k in ours},
                    **({"update_weight_delta_encoding": "xor"} if "update_weight_delta_encoding" in ours else {}),
                    "update_weight_delta_sharded": False}


def test_delta_over_nccl_with_no_encoding_is_our_sparse_delta(slime):
    """slime refuses ``--update-weight-mode delta`` over nccl (its delta is a per-host checkpoint patch); on a patched
    tree it is this project's sparse delta with the 'deltas' encoding and the sharded sender, and the rules of the
    sparse encodings apply (``--colocate`` is still refused, with slime's words)."""
    from slime.utils.delta_sync_args import runs_sparse_delta

    helpers, module = slime
    args = helpers.make_slime_validate_args(update_weight_mode="delta", update_weight_transport="nccl",
                                            update_weight_local_checkpoint_dir="/local/ckpt")
    module.slime_validate_args(args)
    assert (args.update_weight_delta_encoding, args.update_weight_delta_sharded, runs_sparse_delta(args)) == \
        ("deltas", True, True)
    args = helpers.make_slime_validate_args(update_weight_mode="delta", update_weight_transport="nccl", colocate=True)
    with pytest.raises(ValueError, match="^--update-weight-mode=delta is not supported with --colocate"):
        module.slime_validate_args(args)


def test_our_rules_come_after_slimes_and_refuse_what_would_silently_do_nothing(slime):
    helpers, module = slime

    def refused(match, **over):
        with pytest.raises(ValueError, match=match):
            module.slime_validate_args(helpers.make_slime_validate_args(**over))

    disk = dict(update_weight_mode="delta", update_weight_transport="disk", update_weight_disk_dir="/shared/delta")
    # slime's checks pass (a local checkpoint directory): an unset encoding is ours to refuse, naming both
    refused(r"^--update-weight-mode=delta over disk needs --update-weight-delta-encoding: xor_ctx or xor_zstd",
            **disk, update_weight_local_checkpoint_dir="/local/ckpt")
    refused(r"^--update-weight-store publishes with --update-weight-mode=delta and a sparse encoding .* with "
            r"--update-weight-mode=full \(encoding xor\) nothing would be published", update_weight_store="/store")
    refused(r"^--update-weight-pause-mode=retract runs with --update-weight-mode=delta and a sparse encoding",
            update_weight_pause_mode="retract")
    refused(r"^--update-weight-delta-encoding=xor_zstd compresses files and is disk-only",
            update_weight_mode="delta", update_weight_delta_encoding="xor_zstd")
    args = helpers.make_slime_validate_args(**disk, update_weight_delta_encoding="xor_ctx")  # no local checkpoint
    module.slime_validate_args(args)
    assert args.update_weight_delta_sharded is True
