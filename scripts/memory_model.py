"""docs/memory.md's tables: the peak extra memory of each step of a sync at slime's published layouts of three large
MoE models, multiplied out from the formulas ``make bench-memory`` asserts at small scale (its budgets, imported
here: one source for both). What a setting bounds is budget x its reference; what grows with the change is the
bench's bytes per changed element x the changed elements at the layout's density.

``python scripts/memory_model.py`` rewrites the page's marked section; ``tests/test_docs.py`` checks it is current.
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_memory import BUDGETS, PER_CHANGE  # noqa: E402  (beside this script)
from md_pages import write_page  # noqa: E402

from sglang.srt.weight_sync.delta.fingerprint import _BLOCK as FP_BLOCK  # noqa: E402  (elements hashed at once)
from sglang.srt.weight_sync.delta.commit import DEFAULT_CHUNK_BYTES as ENGINE_CHUNK  # noqa: E402

GiB = 1 << 30
DENSITY = 0.0423  # the largest share of bf16 elements one AdamW step at lr 1e-6 changed in `make bench`
MARK = ("<!-- memory-model:begin -->", "<!-- memory-model:end -->")


def _moe_layer(h, heads, kv_heads, head_dim, experts, moe_ffn, shared, mla=None):
    """Elements of one MoE decoder layer: attention (GQA, or MLA's ranks), router, routed and shared experts."""
    if mla:
        q_lora, kv_lora, nope, rope, v = mla
        attn = h * q_lora + q_lora * heads * (nope + rope) + h * (kv_lora + rope) + kv_lora * heads * (nope + v) \
            + heads * v * h
    else:
        attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    return attn, h * experts + (experts + shared) * 3 * h * moe_ffn


# name -> architecture and slime's published layout (scripts/run-*.sh at the pin)
MODELS = {
    "Qwen3-235B-A22B": dict(
        h=4096, layers=94, dense=0, vocab=151936, heads=64, kv_heads=4, head_dim=128, experts=128, moe_ffn=1536,
        shared=0, ffn=0, mla=None, tp=4, pp=4, cp=2, ep=16, gpus=64, last=22, buffer=4 * GiB, engine_gpus=32,
        script="run-qwen3-235B-A22B.sh"),
    "DeepSeek-V3 671B": dict(
        h=7168, layers=61, dense=3, vocab=129280, heads=128, kv_heads=128, head_dim=128, experts=256, moe_ffn=2048,
        shared=1, ffn=18432, mla=(1536, 512, 128, 64, 128), tp=8, pp=4, cp=4, ep=32, gpus=128, last=13,
        buffer=512 << 20, engine_gpus=64, script="run-deepseek-r1.sh"),
    "Kimi-K2 1T": dict(
        h=7168, layers=61, dense=1, vocab=163840, heads=64, kv_heads=64, head_dim=128, experts=384, moe_ffn=2048,
        shared=1, ffn=18432, mla=(1536, 512, 128, 64, 128), tp=8, pp=8, cp=4, ep=32, gpus=256, last=5,
        buffer=2 * GiB, engine_gpus=16, script="run-kimi-k2-Instruct.sh"),
}


def shape(m: dict) -> dict:
    """Elements of the largest pipeline stage, of the model, of the largest param slime gathers whole (the
    embedding), and the ranks of a stage."""
    attn, moe = _moe_layer(m["h"], m["heads"], m["kv_heads"], m["head_dim"], m["experts"], m["moe_ffn"], m["shared"],
                           m["mla"])
    dense_mlp = 3 * m["h"] * m["ffn"]
    layer = [attn + (dense_mlp if i < m["dense"] else moe) for i in range(m["layers"])]
    emb = m["vocab"] * m["h"]
    per = (m["layers"] - m["last"]) // (m["pp"] - 1)
    cuts = [0] + [per * (s + 1) for s in range(m["pp"] - 1)] + [m["layers"]]
    stages = [sum(layer[a:b]) for a, b in zip(cuts, cuts[1:])]
    stages[0] += emb
    stages[-1] += emb  # lm_head (untied)
    return dict(model=sum(layer) + 2 * emb, stage=max(stages), largest=emb, ranks=m["gpus"] // m["pp"])


CHUNK = 512 << 20  # the tables' second column: --update-weight-delta-shard-chunk-bytes at this, the buffer as is
SHARD_CHUNK = "`--update-weight-delta-shard-chunk-bytes`"


def rows(m: dict, chunk: int = 0) -> list:
    """(step, where, what bounds it, formula, bytes) of one sync, in order; ``chunk``: the sharded sender's
    (0: unset, the buffer)."""
    s = shape(m)
    buf, g2 = m["buffer"], 2 * s["largest"]  # slime's own bf16 gather of the largest param
    part = chunk or buf
    owned = s["stage"] / s["ranks"]
    per_rank = DENSITY * owned
    c_diff = PER_CHANGE["sharded diff per change"][0]
    engine = max(buf, ENGINE_CHUNK)  # an engine holds a received flush (the sender's buffer) and writes in chunks

    def b(name):
        return BUDGETS[name][0]

    return [
        ("snapshot of its owned slices", "trainer host (pinned)", "the model", "2 B x stage / ranks", 2 * owned),
        ("shard map build (after a full sync)", "trainer GPU", "slime's gather", f"{b('shard map build'):g} x 2 B x "
         "largest param", b("shard map build") * g2),
        ("sharded diff, chunks", "trainer GPU", SHARD_CHUNK, f"{b('sharded diff'):g} x chunk",
         b("sharded diff") * part),
        ("sharded diff, the rank's changes until sent", "trainer host (pinned)", "the change (none)",
         f"{c_diff} B x density x stage / ranks", c_diff * per_rank),
        ("the stage's changes merged on its source, a round at a time", "source trainer GPU",
         SHARD_CHUNK, f"{b('sharded source round'):g} x chunk", b("sharded source round") * part),
        ("`xor_ctx` facts", "trainer GPU", SHARD_CHUNK,
         f"{b('sharded xor_ctx facts'):g} x chunk", b("sharded xor_ctx facts") * part),
        ("source flush (encode)", "source trainer GPU", "`--update-weight-buffer-size`",
         f"{b('sender flush'):g} x max(buffer, 2 B x largest param)", b("sender flush") * max(buf, g2)),
        ("engine apply / `xor_zstd` rebuild / `xor_ctx` decode / full sync", "engine GPU",
         "buffer, `--update-weight-delta-chunk-bytes`", f"{b('engine apply'):g} x max(buffer, engine chunk)",
         b("engine apply") * engine),
        ("fingerprint (every 10th sync)", "engine GPU", "its block", f"{b('fingerprint'):g} x 8 B x 2**22",
         b("fingerprint") * 8 * FP_BLOCK),
    ]


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB" if x >= 1e8 else f"{x / 1e6:,.0f} MB"


def section() -> str:
    out = [MARK[0]]
    for name, m in MODELS.items():
        s = shape(m)
        out += ["", f"### {name}", "",
                f"slime's `{m['script']}`: TP {m['tp']}, PP {m['pp']} (last stage {m['last']} layers), CP {m['cp']}, "
                f"EP {m['ep']} on {m['gpus']} trainer GPUs, {s['ranks']} ranks per stage; engines of "
                f"{m['engine_gpus']} GPUs; `--update-weight-buffer-size` {m['buffer'] / GiB:g} GiB. Counted here: "
                f"{s['model'] / 1e9:,.0f} B params, the largest stage {s['stage'] / 1e9:,.1f} B, the embedding "
                f"{s['largest'] / 1e9:,.2f} B elements; density {DENSITY:.2%}.", "",
                f"| step | where | bounded by | formula | peak extra | at a {CHUNK >> 20} MiB chunk |",
                "|---|---|---|---|---:|---:|"]
        out += [f"| {step} | {where} | {by} | {formula} | {_gb(x)} | {_gb(y[4])} |"
                for (step, where, by, formula, x), y in zip(rows(m), rows(m, CHUNK))]
    out.append(MARK[1])
    return "\n".join(out)


def main() -> int:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "memory.md")
    doc = open(path).read()
    pattern = re.compile(re.escape(MARK[0]) + ".*?" + re.escape(MARK[1]), re.S)
    write_page(path, pattern.sub(lambda _: section(), doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
