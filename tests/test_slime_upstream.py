"""The patched ``slime_validate_args`` on namespaces built as slime's own tests build them (its helpers, loaded from the
checkouts): no attribute of ours is required, slime's checks run first with slime's messages, and with delta sync
off a patched tree leaves exactly what a pristine one leaves. Needs both checkouts (``make test-slime``)."""
import importlib.util
import os
import sys

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
    """Where slime accepts, our rules: an unset encoding over disk names both implementations; each flag of ours set
    where nothing would use it is refused with what uses it; a store over disk takes the shared directory's place."""
    helpers, module = slime

    def refused(match, **over):
        with pytest.raises(ValueError, match=match):
            module.slime_validate_args(helpers.make_slime_validate_args(**over))

    disk = dict(update_weight_mode="delta", update_weight_transport="disk", update_weight_disk_dir="/shared/delta")
    # slime's checks pass (a local checkpoint directory): an unset encoding is ours to refuse, naming both
    refused(r"^--update-weight-mode=delta over disk needs --update-weight-delta-encoding: xor_ctx or xor_zstd",
            **disk, update_weight_local_checkpoint_dir="/local/ckpt")
    refused(r"^--update-weight-delta-encoding=xor_zstd compresses files and is disk-only",
            update_weight_mode="delta", update_weight_delta_encoding="xor_zstd")
    sparse = "--update-weight-mode delta and a sparse encoding"
    full = "with --update-weight-mode full nothing would use it: drop it, or run what uses it"
    xor = "with slime's own --update-weight-delta-encoding xor nothing would use it"
    for over, flag, where, what in (
            ({"update_weight_store": "/store"}, "--update-weight-store=/store", sparse, full),
            ({"update_weight_pause_mode": "retract"}, "--update-weight-pause-mode=retract", sparse, full),
            ({"update_weight_delta_fingerprint_interval": 1}, "--update-weight-delta-fingerprint-interval=1", sparse,
             full),
            ({**disk, "update_weight_local_checkpoint_dir": "/ckpt", "update_weight_delta_encoding": "xor",
              "update_weight_delta_sharded": True}, "--update-weight-delta-sharded=True", sparse, xor),
            ({"update_weight_mode": "delta", "update_weight_delta_sharded": False,
              "update_weight_delta_shard_chunk_bytes": 1 << 20}, "--update-weight-delta-shard-chunk-bytes=1048576",
             r"the sharded sender \(--update-weight-delta-sharded\)",
             "with --update-weight-delta-encoding deltas over nccl nothing"),
            ({"update_weight_mode": "delta", "update_weight_delta_zstd_level": 3}, "--update-weight-delta-zstd-level=3",
             r"a compressed encoding \(deltas_zstd, planes_zstd, xor_zstd, xor_ctx\) or --update-weight-store",
             "with --update-weight-delta-encoding deltas over nccl nothing"),
            ({"update_weight_mode": "delta", "update_weight_store_key_file": "/k"}, "--update-weight-store-key-file=/k",
             "--update-weight-store", "with --update-weight-delta-encoding deltas over nccl nothing"),
            ({"update_weight_mode": "delta", "update_weight_store_anchor_every": 5},
             "--update-weight-store-anchor-every=5", "--update-weight-store", "with .* over nccl nothing"),
            ({"update_weight_mode": "delta", "update_weight_store_head_refresh_s": 5.0},
             "--update-weight-store-head-refresh-s=5.0", "--update-weight-store", "with .* over nccl nothing")):
        refused(rf"^{flag} is used only with {where}; {what}", **over)
    # where they are used, the same flags pass: over nccl with a store, and a store over disk with no shared directory
    for over in ({"update_weight_mode": "delta", "update_weight_store": "s3://w/run", "update_weight_delta_zstd_level": 3,
                  "update_weight_store_key_file": "/k", "update_weight_store_anchor_every": 5,
                  "update_weight_store_head_refresh_s": 5.0,
                  "update_weight_delta_fingerprint_interval": 1, "update_weight_pause_mode": "in_place",
                  "update_weight_delta_shard_chunk_bytes": 1 << 20},
                 {**disk, "update_weight_disk_dir": None, "update_weight_delta_encoding": "xor_ctx",
                  "update_weight_store": "s3://w/run"}):
        args = helpers.make_slime_validate_args(**over)
        module.slime_validate_args(args)
        assert args.update_weight_delta_sharded is True
    refused(r"^--update-weight-store-head-refresh-s=-1.0: give seconds", update_weight_mode="delta",
            update_weight_store="s3://w/run", update_weight_store_head_refresh_s=-1.0)
    # without a store, slime's own check for the shared directory stands, with its message
    refused(r"^--update-weight-transport=disk requires --update-weight-disk-dir",
            **{**disk, "update_weight_disk_dir": None}, update_weight_delta_encoding="xor_ctx")


# what a documented flag set leaves out: a tiny model (its architecture as Megatron flags), data and the cluster
_TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --group-query-attention "
         "--num-query-groups 2 --swiglu --normalization RMSNorm --disable-bias-linear "
         "--untie-embeddings-and-output-weights --vocab-size 256 --seq-length 128 --max-position-embeddings 128")
_RUN = ("--prompt-data /data/train.parquet --num-rollout 2 --rollout-batch-size 4 --n-samples-per-prompt 4 "
        "--global-batch-size 16 --actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 3 "
        "--rollout-num-gpus-per-engine 1")


@pytest.fixture
def slimes_parse_args(tmp_path, monkeypatch):
    """slime's own ``parse_args`` (Megatron's parser and checks, slime's, SGLang's) on a command line, with a tiny
    real HF config at ``--hf-checkpoint``."""
    import shlex
    import typing

    import transformers
    import typing_extensions

    monkeypatch.setattr(typing, "override", typing_extensions.override, raising=False)  # megatron-core, Python 3.11
    hf = str(tmp_path / "hf")
    transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=128, vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-5,
                             tie_word_embeddings=False).save_pretrained(hf)

    def parse(argv: list[str]):
        from slime.utils.arguments import parse_args

        if "--hf-checkpoint" in argv:  # a whole command line: its paths, here
            argv = list(argv)
            argv[argv.index("--hf-checkpoint") + 1] = hf
            if "--ref-load" in argv:
                argv[argv.index("--ref-load") + 1] = str(tmp_path)
        else:
            argv = ["--hf-checkpoint", hf, *shlex.split(_RUN), *argv]
        monkeypatch.setattr(sys, "argv", ["train.py", *shlex.split(_TINY), *argv])
        return parse_args()

    return parse


def test_every_documented_slime_flag_set_passes_slimes_own_parse_args(slimes_parse_args):
    """Each slime flag set of the docs' ``bash`` blocks, and the example's command lines, through slime's own
    ``parse_args`` at the pin: accepted, and our sparse updater is what runs."""
    import shlex

    from doc_commands import documented_commands
    from slime.utils.delta_sync_args import runs_sparse_delta

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from delta_gsm8k import train_args

    lines = [(where, argv) for where, kind, argv in documented_commands() if kind == "slime"]
    lines += [(f"examples/delta_gsm8k.py --transport {t}", shlex.split(train_args(t, "/shared", 4)))
              for t in ("disk", "nccl")]
    assert len(lines) >= 5, lines
    for where, argv in lines:
        try:
            args = slimes_parse_args(argv)
        except (ValueError, AssertionError, SystemExit) as e:
            raise AssertionError(f"{where}: {' '.join(argv)}: {e}") from e
        assert runs_sparse_delta(args), where


def _job_argv(tmp_path, script: str, name: str):
    """A slime launch script run by bash as written up to its job submission, from a checkout's layout (it sources
    its model's flags from ``scripts/models``): stand-ins record ``ray``'s command line and runtime environment and
    make ``pkill``, ``sleep`` and ``nvidia-smi`` do nothing (``name``: where it is written, not under ``scripts``).
    Returns what ``train.py`` would get, and the job's
    environment."""
    import json
    import subprocess

    os.symlink(os.path.join(SLIME, "scripts"), tmp_path / "scripts")
    os.makedirs(tmp_path / os.path.dirname(name))
    os.symlink(os.path.join(SLIME, "scripts", "models"), tmp_path / os.path.dirname(name) / "models")
    (tmp_path / name).write_text(script)
    os.makedirs(tmp_path / "bin", exist_ok=True)
    (tmp_path / "bin" / "ray").write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$RAY_ARGV"\n')
    for tool in ("pkill", "sleep", "nvidia-smi"):
        (tmp_path / "bin" / tool).write_text("#!/bin/bash\n")
    for tool in ("ray", "pkill", "sleep", "nvidia-smi"):
        os.chmod(tmp_path / "bin" / tool, 0o755)
    subprocess.run(["bash", str(tmp_path / name)], check=True, capture_output=True,
                   env={"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "RAY_ARGV": str(tmp_path / "argv")})
    raw = (tmp_path / "argv").read_text().split("\0")[:-1]
    job_env = json.loads(next(a.split("=", 1)[1] for a in raw if a.startswith("--runtime-env-json=")))["env_vars"] \
        if any(a.startswith("--runtime-env-json=") for a in raw) else \
        json.loads(raw[raw.index("--runtime-env-json") + 1])["env_vars"]
    argv = raw[raw.index("--") + 1:]
    assert argv[:2] == ["python3", "train.py"], argv[:3]
    return argv[2:], job_env


def _parse_job(tmp_path, monkeypatch, argv, job_env):
    """slime's own ``parse_args`` with Megatron's checks on a job's command line: an HF config with its model sizes
    (DeepSeek-V3's shape), its environment, and the compute capability of the GPUs it is for (an H100's: Megatron
    asks the device)."""
    import types
    import typing

    import torch
    import transformers
    import typing_extensions

    monkeypatch.setattr(typing, "override", typing_extensions.override, raising=False)  # megatron-core, Python 3.11
    from slime.utils.arguments import parse_args

    argv = list(argv)
    flag = lambda name: argv[argv.index(name) + 1]  # noqa: E731
    hf = str(tmp_path / "hf")
    transformers.DeepseekV3Config(
        hidden_size=int(flag("--hidden-size")), num_attention_heads=int(flag("--num-attention-heads")),
        num_hidden_layers=int(flag("--num-layers")), intermediate_size=int(flag("--ffn-hidden-size")),
        moe_intermediate_size=int(flag("--moe-ffn-hidden-size")), vocab_size=int(flag("--vocab-size")),
        rope_theta=float(flag("--rotary-base")), tie_word_embeddings=False,
        rms_norm_eps=float(flag("--norm-epsilon")) if "--norm-epsilon" in argv else 1e-5).save_pretrained(hf)
    argv[argv.index("--hf-checkpoint") + 1] = hf
    argv[argv.index("--ref-load") + 1] = str(tmp_path)
    for k, v in job_env.items():
        if k != "PYTHONPATH":
            monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(major=9, minor=0))
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    return parse_args()


@pytest.mark.parametrize("transport", ["nccl", "disk"])
def test_slimes_glm_example_as_rewritten_passes_slimes_own_parse_args(tmp_path, monkeypatch, transport):
    """examples/glm47_flash_delta.py's script, run by bash as written up to its job submission: the command line
    slime's ``train.py`` would get goes through slime's own ``parse_args`` with Megatron's checks."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from glm47_flash_delta import OURS, UPSTREAM, rewrite
    from slime.utils.delta_sync_args import runs_sparse_delta

    with open(os.path.join(SLIME, UPSTREAM)) as f:
        script = rewrite(f.read(), transport, "/shared/fs/glm47-delta")
    args = _parse_job(tmp_path, monkeypatch, *_job_argv(tmp_path, script, OURS))
    assert (args.update_weight_mode, args.update_weight_transport, args.pipeline_model_parallel_size) == \
        ("delta", transport, 2)
    assert runs_sparse_delta(args) and args.update_weight_delta_sharded


@pytest.mark.parametrize("recipe", ["scripts/run-deepseek-r1.sh", "scripts/run-glm4.7-30B-A3B.sh"])
def test_slimes_speculative_recipes_with_delta_sync_pass_slimes_own_parse_args(tmp_path, monkeypatch, recipe):
    """slime's largest recipes run EAGLE on their engines (R1: the NextN draft; GLM-4.7: the MTP layer it trains).
    Their command lines as the scripts build them, with delta sync on and the engines on GPUs of their own (slime's
    own delta modes refuse ``--colocate`` too): accepted by slime's ``parse_args`` with Megatron's checks, the
    speculative flags passed to the engines as written, and our sparse updater the one that runs."""
    from slime.utils.delta_sync_args import runs_sparse_delta

    with open(os.path.join(SLIME, recipe)) as f:
        argv, job_env = _job_argv(tmp_path, f.read(), os.path.join("recipes", os.path.basename(recipe)))
    assert "--sglang-speculative-algorithm" in argv and "--colocate" in argv
    argv.remove("--colocate")
    engines = argv[argv.index("--rollout-num-gpus-per-engine") + 1]
    argv += ["--rollout-num-gpus", engines, "--update-weight-mode", "delta", "--update-weight-transport", "nccl"]
    args = _parse_job(tmp_path, monkeypatch, argv, job_env)
    assert (args.sglang_speculative_algorithm, args.sglang_speculative_num_steps) == ("EAGLE", 3)
    assert args.update_weight_mode == "delta" and runs_sparse_delta(args) and args.update_weight_delta_sharded
