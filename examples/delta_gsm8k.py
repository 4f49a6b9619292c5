r"""GRPO on GSM8K with Qwen3.5-0.8B, non-colocated (1 actor GPU, 3 rollout GPUs), weights synced with delta sync.

Run inside the image (``make image``) on a 4-GPU host::

    python /opt/delta-weight-sync/examples/delta_gsm8k.py --transport disk   # xor_zstd files on a shared dir
    python /opt/delta-weight-sync/examples/delta_gsm8k.py --transport nccl   # deltas over slime's NCCL group

or on one GPU, with the rollout engine launched by hand beside the trainer (slime's external engines; disk only,
since two processes on one GPU cannot form an NCCL group)::

    python -m sglang.launch_server --model-path /root/models/Qwen3.5-0.8B --trust-remote-code \
        --port 30000 --mem-fraction-static 0.4 &                         # the image's patched SGLang
    python /opt/delta-weight-sync/examples/delta_gsm8k.py --external-engine 127.0.0.1:30000

The setup is that of slime's ``tests/test_full_disk_weight_update.py`` with ``--update-weight-mode delta`` and
a few more rollouts, so that the log shows a full sync and then deltas. Uses slime's own launch helpers
(``slime.utils.external_utils.command_utils``), so it must run where slime is installed.
"""
import argparse
import tempfile

MODEL = "Qwen3.5-0.8B"
MODEL_TYPE = "qwen3.5-0.8B"
DIST_CKPT = f"/dev/shm/{MODEL}_torch_dist"


def gpus(external_engine) -> int:
    return 1 if external_engine else 4


def delta_args(transport: str, disk_dir: str, fingerprint_every: int = 1) -> str:
    """The flags this project adds (everything else is a stock slime GRPO run)."""
    common = f"--update-weight-mode delta --update-weight-delta-fingerprint-interval {fingerprint_every} "
    if transport == "disk":
        return common + (f"--update-weight-transport disk --update-weight-delta-encoding xor_zstd "
                         f"--update-weight-disk-dir {disk_dir} ")
    return common + "--update-weight-transport nccl --update-weight-delta-encoding deltas "


def rollout_args(external_engine) -> str:
    """slime launches 3 one-GPU engines, or attaches to the one already serving at ``external_engine``."""
    if external_engine:
        return f"--rollout-external-engine-addrs {external_engine}"
    return "--rollout-num-gpus-per-engine 1 --rollout-num-gpus 3 --sglang-mem-fraction-static 0.7"


def train_args(transport: str, disk_dir: str, rollouts: int, external_engine=None) -> str:
    if external_engine and transport != "disk":
        raise SystemExit("--external-engine shares the trainer's GPU: use --transport disk")
    return " ".join([
        f"--hf-checkpoint /root/models/{MODEL}/ --ref-load {DIST_CKPT}",
        "--prompt-data /root/datasets/gsm8k/train.parquet --input-key messages --label-key label",
        "--apply-chat-template --rollout-shuffle --rm-type math",
        f"--num-rollout {rollouts} --rollout-batch-size 4 --n-samples-per-prompt 4 --rollout-max-response-len 1024",
        "--rollout-temperature 0.8 --global-batch-size 16",
        "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --context-parallel-size 1",
        "--expert-model-parallel-size 1 --expert-tensor-parallel-size 1 --use-dynamic-batch-size",
        "--max-tokens-per-gpu 9216",
        "--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl",
        "--entropy-coef 0.01 --eps-clip 0.2 --eps-clip-high 0.28",
        "--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98",
        rollout_args(external_engine),
        "--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32",
        "--attention-softmax-in-fp32 --attention-backend flash --loss-mask-type qwen3_5",
        "--actor-num-nodes 1 --actor-num-gpus-per-node 1",
        delta_args(transport, disk_dir),
    ])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", choices=["disk", "nccl"], default="disk")
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--disk-dir", default=None, help="shared directory for --transport disk (default: a temp dir)")
    ap.add_argument("--skip-prepare", action="store_true", help="model, dataset and Megatron checkpoint exist")
    ap.add_argument("--external-engine", metavar="HOST:PORT",
                    help="one GPU: attach to a patched SGLang server already serving the model (disk transport)")
    args = ap.parse_args()

    import slime.utils.external_utils.command_utils as U

    if not args.skip_prepare:
        U.exec_command("mkdir -p /root/models /root/datasets")
        U.exec_command(f"hf download Qwen/{MODEL} --local-dir /root/models/{MODEL}")
        U.hf_download_dataset("zhuzilin/gsm8k")
        U.convert_checkpoint(model_name=MODEL, megatron_model_type=MODEL_TYPE,
                             num_gpus_per_node=gpus(args.external_engine), dir_dst="/dev/shm")
    with tempfile.TemporaryDirectory(prefix="delta_gsm8k_") as tmp:
        U.execute_train(train_args=train_args(args.transport, args.disk_dir or tmp, args.rollouts,
                                              args.external_engine),
                        num_gpus_per_node=gpus(args.external_engine), megatron_model_type=MODEL_TYPE)


if __name__ == "__main__":
    main()
