r"""slime's own GLM-4.7-Flash delta example, run with this project's sparse delta sync instead of slime's ``xor``.

slime ships ``examples/delta_weight_sync/run-glm4.7-30B-A3B-delta.sh`` (GLM-4.7-Flash, 2 nodes x 8 GPUs,
non-colocated, slime's own disk delta: per-host checkpoint patch + reload). This launcher writes that script with
its ``WEIGHT_SYNC_ARGS`` block replaced by ours, next to it as ``run-glm4.7-30B-A3B-delta-sparse.sh``, and runs it
(same prerequisites: the Ray cluster, the model and its torch_dist conversion, the dataset; slime and the engines'
SGLang both patched, e.g. the image)::

    python /opt/delta-weight-sync/examples/glm47_flash_delta.py --slime-dir /root/slime              # nccl, deltas
    python /opt/delta-weight-sync/examples/glm47_flash_delta.py --slime-dir /root/slime --transport disk \
        --disk-dir /shared/fs/glm47-delta                                                       # xor_zstd files
    python ... --print                                        # only write the script and show the flags it changed

The flag changes, if you prefer to edit the script yourself (both keep the script's PP=2): over ``nccl``
``--update-weight-mode delta --update-weight-transport nccl --update-weight-delta-encoding deltas`` (drop the
disk/local-checkpoint/checksum flags); over ``disk`` ``--update-weight-mode delta --update-weight-transport disk
--update-weight-delta-encoding xor_zstd --update-weight-disk-dir DIR`` (each pipeline stage writes its own files,
stage 0 announces them together). slime's delta example leaves out ``--decoder-last-pipeline-num-layers 23``, which
slime's own ``scripts/run-glm4.7-30B-A3B.sh`` sets: without it Megatron refuses the 47 layers over PP=2 at start, so
the rewrite adds it. Not yet run on GPUs. GLM-4.7-Flash's MLA loader takes deltas
on the direct path (engine work proportional to the changed elements; ``w_kc``/``w_vc`` re-derived for the touched
layers), tested in-process on SGLang's class in bf16 and block FP8.
"""
import argparse
import os
import re
import subprocess
import sys

UPSTREAM = os.path.join("examples", "delta_weight_sync", "run-glm4.7-30B-A3B-delta.sh")
OURS = os.path.join("examples", "delta_weight_sync", "run-glm4.7-30B-A3B-delta-sparse.sh")
_BLOCK = re.compile(r"^WEIGHT_SYNC_ARGS=\(\n.*?^\)\n", re.M | re.S)


def weight_sync_args(transport: str, disk_dir: str) -> list:
    """Our weight-sync flags (everything else in the script stays slime's)."""
    if transport == "nccl":
        return ["--update-weight-mode delta", "--update-weight-transport nccl", "--update-weight-delta-encoding deltas"]
    return ["--update-weight-mode delta", "--update-weight-transport disk", "--update-weight-delta-encoding xor_zstd",
            f"--update-weight-disk-dir {disk_dir}"]


def rewrite(script: str, transport: str, disk_dir: str) -> str:
    """The upstream script with our weight-sync block; refuses a script it does not recognize."""
    if len(_BLOCK.findall(script)) != 1:
        raise SystemExit(f"{UPSTREAM} no longer has one WEIGHT_SYNC_ARGS block: apply the flag changes in this "
                         "file's docstring by hand")
    block = "WEIGHT_SYNC_ARGS=(\n" + "".join(f"   {a}\n" for a in weight_sync_args(transport, disk_dir)) + ")\n"
    out = _BLOCK.sub(lambda _: block, script)
    if "--decoder-last-pipeline-num-layers" not in out:  # 47 layers over PP=2: as slime's run-glm4.7-30B-A3B.sh
        out = out.replace("   --pipeline-model-parallel-size 2\n",
                          "   --pipeline-model-parallel-size 2\n   --decoder-last-pipeline-num-layers 23\n", 1)
    return out.replace("set -ex\n", "set -ex\n# Written by delta-weight-sync's examples/glm47_flash_delta.py from "
                       f"{os.path.basename(UPSTREAM)}: our sparse delta sync over {transport}.\n", 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slime-dir", required=True, help="the patched slime checkout whose example to run")
    ap.add_argument("--transport", choices=["nccl", "disk"], default="nccl")
    ap.add_argument("--disk-dir", default="/shared/fs/glm47-delta-updates", help="--transport disk: a shared directory")
    ap.add_argument("--print", action="store_true", help="write the script, print its weight-sync flags, do not run")
    args = ap.parse_args()
    with open(os.path.join(args.slime_dir, UPSTREAM)) as f:
        script = rewrite(f.read(), args.transport, args.disk_dir)
    path = os.path.join(args.slime_dir, OURS)
    with open(path, "w") as f:
        f.write(script)
    os.chmod(path, 0o755)
    print(f"{path}: " + " ".join(weight_sync_args(args.transport, args.disk_dir)))
    if not args.print:
        sys.exit(subprocess.call(["bash", path]))


if __name__ == "__main__":
    main()
