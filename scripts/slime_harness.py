"""slime on CPU for tests: a CPU accelerator, a tiny Llama-shaped Megatron GPTModel, engines over HTTP.

Only what slime's weight-update path reads is set up: gloo stands in for NCCL through slime's own
``set_accelerator`` hook; the model has Transformer-Engine-style norm names (what slime's HF
converters expect) built from plain Megatron layers; engines are slime's real ``SGLangEngine`` Ray
actor class pointed at an already running patched server.
"""
import argparse
import dataclasses
import datetime
import functools
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

HIDDEN, LAYERS, HEADS, GROUPS, FFN, VOCAB = 64, 2, 4, 2, 128, 300


def configure(hidden: int, layers: int, heads: int, groups: int, ffn: int, vocab: int) -> None:
    """Another model size for everything below (the tests use the tiny default; ``make bench-slime`` a larger one)."""
    global HIDDEN, LAYERS, HEADS, GROUPS, FFN, VOCAB
    HIDDEN, LAYERS, HEADS, GROUPS, FFN, VOCAB = hidden, layers, heads, groups, ffn, vocab


def install_cpu_accelerator():
    from slime.utils import accelerator as acc

    class CPUAccelerator(acc.Accelerator):
        name = device_type = "cpu"
        communication_backend_name = "gloo"

        def is_available(self): return True
        def device(self, index=None): return torch.device("cpu")
        def device_name(self, index=None): return "cpu"
        def set_device(self, index): pass
        def current_device(self): return "cpu"
        def device_count(self): return 1
        def synchronize(self, device=None): pass
        def current_stream(self, device=None): return type("S", (), {"synchronize": lambda self: None})()
        def empty_cache(self): pass
        def mem_get_info(self, device=None): return (0, 0)
        def memory_allocated(self, device=None): return 0
        def memory_reserved(self, device=None): return 0

    acc.set_accelerator(CPUAccelerator())
    torch.cuda.current_device = lambda: torch.device("cpu")  # Megatron uses it as a device


def init_world(port: int, rank: int = 0, pp: int = 1, tp: int = 1, dp: int = 1, ep: int = 1, cp: int = 1,
               timeout_s: Optional[float] = None, backend: str = "gloo"):
    """One process per rank of a TP x CP x PP x DP world (experts: EP x expert-TP (= TP) x expert-DP over the same
    ranks); ``timeout_s`` bounds every collective's wait (torch's default otherwise). ``backend`` "nccl": one GPU per
    rank and slime's own CUDA accelerator (gpu-check); gloo: the CPU one."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    from slime.utils.distributed_utils import init_gloo_group

    if backend == "gloo":
        install_cpu_accelerator()
    else:
        torch.cuda.set_device(rank)
    extra = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", world_size=pp * tp * dp * cp, rank=rank,
                            **extra)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp, expert_model_parallel_size=ep)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    init_gloo_group()


def _norm_linear_cls():
    """ColumnParallelLinear with a preceding RMSNorm named ``layer_norm_weight`` (TE's naming)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class NormColumnParallelLinear(ColumnParallelLinear):
        def __init__(self, input_size, output_size, *, config, **kw):
            super().__init__(input_size, output_size, config=config, **kw)
            self.eps = config.layernorm_epsilon
            self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))
            self.layer_norm_weight.tensor_model_parallel = False

        def forward(self, x, *a, **k):
            return super().forward(F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps), *a, **k)

    return NormColumnParallelLinear


class DDPLike(torch.nn.Module):
    """Megatron's DDP wrapper as slime sees it: ``module.module.`` names and ``.config``."""

    def __init__(self, module):
        super().__init__()
        self.module, self.config = module, module.config

    def forward(self, *a, **k):
        return self.module(*a, **k)


def build_model(seed: int = 1, mtp_layers: int = 0):
    """The tiny Llama-shaped GPTModel; ``mtp_layers``: with Megatron's MTP block (``mtp.layers.N``, as slime builds it
    for ``--mtp-num-layers``) on the same layer spec."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                            ffn_hidden_size=FFN, use_cpu_initialization=True, gated_linear_unit=True,
                            activation_func=F.silu, normalization="RMSNorm", add_bias_linear=False,
                            add_qkv_bias=False, bf16=True, params_dtype=torch.bfloat16,
                            hidden_dropout=0.0, attention_dropout=0.0, pipeline_dtype=torch.bfloat16,
                            pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
                            mtp_num_layers=mtp_layers or None)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    norm_linear, sm = _norm_linear_cls(), spec.submodules
    sm.input_layernorm = sm.pre_mlp_layernorm = IdentityOp
    sm.self_attention.submodules.linear_qkv = norm_linear
    mlp = sm.mlp
    if isinstance(mlp, functools.partial):
        sub = dataclasses.replace(mlp.keywords["submodules"], linear_fc1=norm_linear)
        sm.mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": sub})
    else:
        mlp.submodules.linear_fc1 = norm_linear
    mtp = dict(mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)) if mtp_layers else {}
    torch.manual_seed(seed)
    model = DDPLike(GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=128,
                             position_embedding_type="rope", share_embeddings_and_output_weights=False,
                             pre_process=parallel_state.is_pipeline_first_stage(),
                             post_process=parallel_state.is_pipeline_last_stage(), **mtp))
    for layer in model.module.mtp.layers if mtp_layers else ():  # named as slime's pinned Megatron names it
        if "mtp_model_layer" in layer._modules:
            layer.transformer_layer = layer._modules.pop("mtp_model_layer")
    model.bfloat16()  # what Megatron's Float16Module does to a bf16 model
    for p in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    return model


EXPERTS, MOE_FFN = 4, 32


def _param(shape, g, **attrs):
    p = torch.nn.Parameter((torch.randn(shape, generator=g) * 0.02).bfloat16())
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


class _MoE(torch.nn.Module):
    """A Qwen3-MoE layer's MLP as slime's converter names it: ``router.weight`` and the experts this EP rank holds as
    Transformer Engine's grouped linears (``experts.linear_fc1.weight{i}``), split over expert-TP like Megatron's."""

    def __init__(self, layer: int):
        super().__init__()
        from megatron.core import parallel_state as ps

        ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
        g = torch.Generator().manual_seed(1000 * layer + 10 * ps.get_expert_model_parallel_rank()
                                          + ps.get_expert_tensor_parallel_rank())
        self.router = torch.nn.Module()
        self.router.weight = _param((EXPERTS, HIDDEN), torch.Generator().manual_seed(layer),
                                    tensor_model_parallel=False)
        self.experts = torch.nn.Module()
        self.experts.linear_fc1, self.experts.linear_fc2 = torch.nn.Module(), torch.nn.Module()
        for i in range(EXPERTS // ep):
            setattr(self.experts.linear_fc1, f"weight{i}", _param((2 * MOE_FFN // etp, HIDDEN), g, allreduce=False,
                    tensor_model_parallel=True, partition_dim=0, partition_stride=1))
            setattr(self.experts.linear_fc2, f"weight{i}", _param((HIDDEN, MOE_FFN // etp), g, allreduce=False,
                    tensor_model_parallel=True, partition_dim=1, partition_stride=1))


def build_moe_model(seed: int = 1):
    """:func:`build_model` with every layer's MLP a MoE (``_MoE``) and its norm ``pre_mlp_layernorm`` (Qwen3-MoE's
    layout for slime's ``qwen3moe`` converter). Its params are what weight sync reads; it is stepped with seeded
    gradients (:class:`StageTrainer`), not run."""
    model = build_model(seed)
    for k, layer in enumerate(model.module.decoder.layers):
        layer.mlp = _MoE(k)
        layer.pre_mlp_layernorm = torch.nn.Module()
        layer.pre_mlp_layernorm.weight = _param((HIDDEN,), torch.Generator().manual_seed(k), tensor_model_parallel=False)
    return model


class Trainer:
    """bf16 model params, fp32 master weights, AdamW at an RL learning rate (what Megatron's optimizer does)."""

    def __init__(self, model, lr: float = 1e-6, seed: int = 0):
        self.model = model
        self.params = [p for p in model.parameters()]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=lr, weight_decay=0.0)
        self.g = torch.Generator().manual_seed(seed)

    def step(self):
        ids = torch.randint(0, VOCAB, (2, 16), generator=self.g)
        pos = torch.arange(16)[None].expand(2, 16)
        mask = torch.tril(torch.ones(16, 16, dtype=torch.bool))[None, None].logical_not()
        logits = self.model(input_ids=ids, position_ids=pos, attention_mask=mask)
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        for p in self.params:
            p.grad = None
        loss.backward()
        for p, m in zip(self.params, self.master):
            m.grad = p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m.to(p.dtype))


class StageTrainer(Trainer):
    """A pipeline stage's AdamW step on its own params, with seeded gradients (no pipeline schedule on CPU): the
    same optimizer arithmetic, so the same sparse byte changes per step. A param TP does not split gets its gradient
    from ``shared_seed`` (the same on every TP rank of the stage, as Megatron's all-reduced gradients are)."""

    def __init__(self, model, lr: float = 1e-6, seed: int = 0, shared_seed: int = None):
        super().__init__(model, lr, seed)
        self.shared = torch.Generator().manual_seed(seed if shared_seed is None else shared_seed)

    def step(self):
        for p, m in zip(self.params, self.master):
            g = self.g if getattr(p, "tensor_model_parallel", False) else self.shared
            m.grad = (torch.randn(m.shape, generator=g) * 1e-2).to(m.device)
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m.to(p.dtype))


def corrupt_stage1_file(args, version_dir, rollout_engines):
    """A post-write hook (``--custom-update-weight-post-write-path``): once ``args.corrupt_marker`` exists, flip one
    value bit of stage 1's first file of the publish (stage 0 runs the hook, after every stage wrote)."""
    import os

    from cpu_harness import flip_a_value_bit

    if os.path.exists(args.corrupt_marker):
        os.remove(args.corrupt_marker)
        flip_a_value_bit(version_dir, "rank0001_")
    return None


def make_args(**over):
    from slime.utils.delta_sync_args import runs_sparse_delta

    a = argparse.Namespace(
        num_experts=None, vocab_size=VOCAB, q_lora_rank=None, kv_channels=None, hidden_size=HIDDEN,
        num_attention_heads=HEADS, num_query_groups=GROUPS, update_weight_buffer_size=32 << 10,
        rollout_num_gpus_per_engine=1, update_weight_mode="delta", update_weight_transport="nccl",
        update_weight_delta_encoding="indices", update_weight_disk_dir=None, update_weight_disk_keep_files=False,
        custom_update_weight_post_write_path=None, colocate=False, pipeline_model_parallel_size=1,
        update_weight_delta_fingerprint_interval=1, update_weight_pause_mode="abort", update_weight_delta_sharded=None,
        num_layers=LAYERS)
    for k, v in over.items():
        setattr(a, k, v)
    if a.update_weight_delta_sharded is None and a.update_weight_delta_encoding is not None:
        a.update_weight_delta_sharded = runs_sparse_delta(a)  # slime's default, as its argument check resolves it
    return a


def hf_state(args, model, model_name: str = "llama"):
    """What the engine must hold: slime's own gather + HF conversion of the Megatron params (bf16); with expert
    parallelism every EP rank's experts (gathered as slime's updater does)."""
    from slime.backends.megatron_utils.megatron_to_hf import convert_to_hf
    from slime.backends.megatron_utils.update_weight.common import all_gather_param, named_params_and_buffers

    from megatron.core import mpu

    gathered, experts = [], []
    for name, param in named_params_and_buffers(args, [model]):
        (experts if ".experts." in name else gathered).append((name, all_gather_param(name, param).detach().clone()))
    if experts and mpu.get_expert_model_parallel_world_size() > 1:
        every = [None] * mpu.get_expert_model_parallel_world_size()
        dist.all_gather_object(every, experts, group=mpu.get_expert_model_parallel_group())
        experts = [item for rank in every for item in rank]
    out = {}
    for name, full in gathered + experts:
        for hf_name, t in convert_to_hf(args, model_name, name, full, None):
            out[hf_name] = t.detach().clone()
    return out


def engine_actor_cls():
    """slime's real SGLangEngine actor class, attached to a server that is already running."""
    import ray

    from slime.backends.sglang_utils.sglang_engine import SGLangEngine

    class AttachedSGLangEngine(SGLangEngine):
        def __init__(self, url: str, args=None):
            host, port = url.removeprefix("http://").rsplit(":", 1)
            self.node_rank, self.server_host, self.server_port, self.args = 0, host, int(port), args

    return ray.remote(num_cpus=0)(AttachedSGLangEngine)


def run_ranks(target, n: int, *args, timeout: float = 900) -> dict:
    """``target(rank, *args, out)`` in one spawned process per rank: {rank: what it put on ``out``}; a rank that puts
    a string (its traceback) fails the call, every such rank named."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, out)) for r in range(n)]
    try:
        for p in procs:
            p.start()
        got = dict(out.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(60)
    failed = {r: v for r, v in got.items() if isinstance(v, str)}
    if failed:
        raise AssertionError("\n".join(f"rank {r}:\n{v}" for r, v in sorted(failed.items())))
    return got


def engine_holds(url: str, state) -> bool:
    """Whether the engine at ``url`` holds ``state`` bit for bit: read back over HTTP where SGLang can name the param,
    and every name through the engine's weight fingerprint (a MoE engine's fused experts and router have no name to
    read)."""
    import requests

    from sglang.srt.weight_sync.delta import fingerprint
    from sglang.srt.weight_sync.delta.transport import HttpEngine

    for n, want in state.items():
        got = requests.post(url + "/get_weights_by_name", json={"name": n, "truncate_size": 1 << 30}, timeout=60).json()
        if not isinstance(got, list):
            continue
        got = torch.tensor(got, dtype=torch.float32).to(want.dtype)[: want.shape[0]]  # the engine pads vocab rows
        if got.shape != want.shape or not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            return False
    ranks = [{n: fingerprint.NameSum.from_str(v) for n, v in r["checksums"].items() if n != fingerprint.VERSION_KEY}
             for r in HttpEngine(url).fingerprint()]
    differ, uncovered = fingerprint.compare(state, fingerprint.merge_ranks(ranks))
    return not differ and not uncovered
