"""docker/Dockerfile without a Docker engine: every path it names exists, every version matches the pins."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dockerfile():
    with open(os.path.join(ROOT, "docker", "Dockerfile")) as f:
        return f.read()


def args():
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile(), re.M))


def test_copied_paths_exist_and_the_build_context_excludes_build_outputs():
    sources = [src for line in re.findall(r"^COPY (.+)$", dockerfile(), re.M) for src in line.split()[:-1]]
    assert sources, "no COPY lines"
    for src in sources:
        assert os.path.exists(os.path.join(ROOT, src)), f"COPY {src}: not in the repo"
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        assert "build" in f.read().split()  # the CPU venvs must not enter the build context


def test_pins_match_the_patch_sets():
    a = args()
    slime = [d for d in os.listdir(os.path.join(ROOT, "patches", "slime")) if a["SLIME_COMMIT"].startswith(d)]
    assert len(a["SLIME_COMMIT"]) == 40 and slime, f"no patches/slime/ set for slime {a['SLIME_COMMIT']}"
    assert os.path.isdir(os.path.join(ROOT, "patches", "sglang", "v" + a["SGLANG_VERSION"]))
    image = a["SLIME_IMAGE"]
    assert image.startswith("slimerl/slime:") and not image.endswith(":latest"), "pin the base image's tag"
    with open(os.path.join(ROOT, "scripts", "check_image_tree.sh")) as f:
        assert f"PIN={a['SGLANG_VERSION']}" in f.read()  # the image-tree check rebuilds the same SGLang
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert image in readme and a["SLIME_COMMIT"][:8] in readme


def test_the_build_patches_both_trees_and_ends_with_the_self_check():
    text = dockerfile()
    run = text[text.index("apply_patches.sh /sgl-workspace/sglang /root/slime"):]
    assert "self_check.sh /sgl-workspace/sglang /root/slime" in run
    with open(os.path.join(ROOT, "docker", "self_check.sh")) as f:
        check = f.read()
    assert "--check" in check and "everything applied" in check
    assert os.access(os.path.join(ROOT, "docker", "self_check.sh"), os.X_OK)
