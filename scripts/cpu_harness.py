"""CPU harness shared by the demo, the benchmarks and the tests: small HF models trained at RL learning rates,
in-process SGLang model classes, checkpoints, a server.

Real parts only: transformers models, AdamW steps, safetensors files, ``python -m sglang.launch_server``.
``delta_flushes`` / ``full_flushes`` encode a sync with the wire module (one flush per dtype and batch).
"""
from __future__ import annotations

import copy
import json
import os
import re
import socket
import threading
from typing import Dict, Iterator, List, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang.srt.weight_sync.delta.diff import changed_positions, encode_flush
from sglang.srt.weight_sync.delta.engine_api import DeltaEngine
from sglang.srt.weight_sync.delta.wire import DeltaPayload


def free_port(below: int = 65536) -> int:
    """A free TCP port on loopback (below ``below``)."""
    while True:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        if port < below:
            return port


# ---------------------------------------------------------------- models and training


def hf_config(arch: str, vocab: int = 256, hidden: int = 64, layers: int = 2):
    """Tiny configs of the architectures the tests cover: qwen2, qwen3(-tied), llama, qwen2-moe, qwen3-moe,
    glm4-moe, deepseek-v3 and glm4.7-flash (MLA with q LoRA, one dense layer then MoE with a shared expert)."""
    import transformers

    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=2 * hidden, vocab_size=vocab, max_position_embeddings=256,
                  tie_word_embeddings=arch.endswith("-tied"))
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch in ("qwen3", "qwen3-tied"):
        return transformers.Qwen3Config(head_dim=hidden // 4, **common)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen2-moe":
        return transformers.Qwen2MoeConfig(shared_expert_intermediate_size=hidden, **moe, **common)
    if arch == "qwen3-moe":
        return transformers.Qwen3MoeConfig(head_dim=hidden // 4, **moe, **common)
    if arch == "glm4-moe":  # GLM-4.5/4.6/4.7: GQA, one dense layer then MoE with a shared expert
        return transformers.Glm4MoeConfig(head_dim=hidden // 4, moe_intermediate_size=hidden // 2, n_routed_experts=4,
                                          n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                                          n_group=1, topk_group=1, architectures=["Glm4MoeForCausalLM"], **common)
    mla = dict(num_key_value_heads=4, moe_intermediate_size=hidden // 2, n_routed_experts=4, n_shared_experts=1,
               num_experts_per_tok=2, q_lora_rank=hidden // 2, kv_lora_rank=hidden // 4, qk_rope_head_dim=hidden // 8,
               qk_nope_head_dim=hidden // 4, v_head_dim=hidden // 4, n_group=1, topk_group=1)
    if arch == "deepseek-v3":
        return transformers.DeepseekV3Config(**{**common, **mla}, first_k_dense_replace=1)
    if arch == "glm4.7-flash":
        return transformers.Glm4MoeLiteConfig(**{**common, **mla},
                                              mlp_layer_types=["dense"] + ["sparse"] * (layers - 1))
    raise ValueError(arch)


def _engine_config(cfg, arch: str):
    """What SGLang's DeepSeek-V2/V3-loader classes read from a real ``config.json`` that transformers' config lacks
    (the trainer side builds without ``rope_scaling``: transformers' rotary init does not know ``deepseek_yarn``)."""
    cfg = copy.deepcopy(cfg)
    cfg.architectures = [arch]
    if arch == "DeepseekV3ForCausalLM":
        cfg.rope_scaling = dict(getattr(cfg, "rope_parameters", None) or {}, type="yarn", rope_type="yarn", factor=4.0,
                                original_max_position_embeddings=64, beta_fast=32, beta_slow=1, mscale=1.0,
                                mscale_all_dim=1.0)
    extra = dict(moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True, ep_size=1)
    if arch == "Glm4MoeLiteForCausalLM":  # transformers 5 spells the first dense layers as mlp_layer_types
        extra["first_k_dense_replace"] = cfg.mlp_layer_types.index("sparse")
    else:
        extra["routed_scaling_factor"] = 2.5
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


def checkpoint_items(items):
    """transformers 5.x holds experts fused (``mlp.experts.gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I));
    checkpoints, Megatron->HF conversion and SGLang's MoE loaders use per-expert names — which we emit."""
    for k, v in items:
        if k.endswith("mlp.experts.gate_up_proj"):
            base, inter = k[: -len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                yield f"{base}{e}.gate_proj.weight", v[e, :inter]
                yield f"{base}{e}.up_proj.weight", v[e, inter:]
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                yield f"{k[: -len('down_proj')]}{e}.down_proj.weight", v[e]
        else:
            yield k, v


def hf_model(cfg, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def bf16_state(model) -> Dict[str, torch.Tensor]:
    """What the trainer ships: HF checkpoint names, bf16, contiguous copies (never views of live params)."""
    return {n: t.detach().to(torch.bfloat16).contiguous().clone() for n, t in checkpoint_items(model.state_dict().items())}


def segments(state: Dict[str, torch.Tensor], subpasses: int = 4, chunk_params: int = 8):
    """slime's send order: non-expert params, then experts in ``subpasses`` segments; each a callable of chunks."""
    import re

    expert = lambda n: re.search(r"\.experts\.(\d+)\.", n)  # noqa: E731
    dense = [n for n in state if not expert(n)]
    experts = sorted({int(expert(n).group(1)) for n in state if expert(n)})
    groups = [dense] + [[n for n in state if expert(n) and int(expert(n).group(1)) in experts[k::subpasses]]
                        for k in range(min(subpasses, len(experts)))]

    def chunks(names):
        return lambda: ([(n, state[n]) for n in names[i:i + chunk_params]] for i in range(0, len(names), chunk_params))

    return [chunks(g) for g in groups]


def with_nextn(state: Dict[str, torch.Tensor], layer: int, seed: int) -> Dict[str, torch.Tensor]:
    """``state`` plus a NextN draft layer's own projection and norms, as DeepSeek-V3 and GLM-4.x checkpoints name them
    (``model.layers.<layer>.eh_proj``, ``enorm``, ``hnorm``, ``shared_head.norm``; its decoder layer is the trainer's
    layer ``layer``), seeded so that they move from one step to the next."""
    g = torch.Generator().manual_seed(seed)
    out, h = dict(state), state["model.embed_tokens.weight"].shape[1]
    out[f"model.layers.{layer}.eh_proj.weight"] = (torch.randn(h, 2 * h, generator=g) * 0.02).to(torch.bfloat16)
    for n in ("enorm", "hnorm", "shared_head.norm"):
        out[f"model.layers.{layer}.{n}.weight"] = (1 + 1e-2 * torch.randn(h, generator=g)).to(torch.bfloat16)
    return out


def rl_steps(model, steps: int, lr: float = 1e-6, seed: int = 0, batch: int = 2, seq: int = 32) -> Iterator[Dict[str, torch.Tensor]]:
    """fp32 master weights + AdamW at an RL learning rate over real forward/backward on random tokens."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g).to(model.device)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        yield bf16_state(model)


def rl_states(cfg, steps: int, seed: int = 1, **step_kwargs) -> List[Dict[str, torch.Tensor]]:
    """The bf16 states the trainer ships at step 0..steps of a fresh model (seeded) under :func:`rl_steps`."""
    model = hf_model(cfg, seed=seed)
    return [bf16_state(model)] + list(rl_steps(model, steps, **step_kwargs))


def delta_flushes(old: Dict[str, torch.Tensor], new: Dict[str, torch.Tensor], encoding: str, *, version: int,
                  base_version: int, max_params: int = 1 << 30, raw: Sequence[str] = (),
                  dense: Sequence[str] = ()) -> List[DeltaPayload]:
    """The changed elements of ``new`` vs ``old`` as one sync's flushes (by dtype, at most max_params each);
    ``xor_zstd`` values XOR ``old`` and ``xor_ctx`` codes against it, except the ``raw`` names (an engine's
    ``xor_raw``: zero); ``dense`` names whole."""
    names = list(new)
    groups: Dict[torch.dtype, List[str]] = {}
    for n in names:
        groups.setdefault(new[n].dtype, []).append(n)
    batches = [g[i:i + max_params] for g in groups.values() for i in range(0, len(g), max_params)]
    out = []
    for k, batch in enumerate(batches):
        entries = [(n, new[n], changed_positions(old[n], new[n]) if new[n].is_floating_point() and n not in dense
                    else None) for n in batch]
        bases = [torch.zeros_like(t.reshape(-1) if i is None else t.reshape(-1)[i]) if n in raw else
                 old[n].reshape(-1) if i is None else old[n].reshape(-1)[i] for n, t, i in entries] \
            if encoding == "xor_zstd" else [torch.zeros_like(t.reshape(-1)) if n in raw else old[n].reshape(-1)
                                            for n, t, _ in entries] if encoding == "xor_ctx" else None
        out.append(encode_flush(entries, encoding, bases=bases, version=version, base_version=base_version, flush=k,
                                final=k == len(batches) - 1))
    return out


def full_flushes(state: Dict[str, torch.Tensor], *, version: int, max_params: int = 1 << 30) -> List[DeltaPayload]:
    names = list(state)
    batches = [names[i:i + max_params] for i in range(0, len(names), max_params)]
    by_dtype = []
    for b in batches:
        for dt in sorted({state[n].dtype for n in b}, key=str):
            by_dtype.append([n for n in b if state[n].dtype == dt])
    return [encode_flush([(n, state[n], None) for n in b], "indices", full=True, version=version,
                         base_version=version, flush=k, final=k == len(by_dtype) - 1)
            for k, b in enumerate(by_dtype)]


def publish_request(root: str, version: int, payloads, zstd: bool, name: str = "weight") -> str:
    """One disk request: every flush of a sync as a numbered part of one publish, as the disk transport writes
    them, under ``root/<name>_v<version>``."""
    from sglang.srt.weight_sync.delta.files import as_parts, flush_file

    vdir = os.path.join(root, f"{name}_v{version:06d}")
    os.makedirs(vdir)
    for pl in payloads:
        pl.spec.flush, pl.spec.final = 0, True
    for k, pl in enumerate(as_parts(payloads)):
        with open(os.path.join(vdir, f"rank0000_flush{k:06d}.safetensors"), "wb") as f:
            f.write(flush_file(pl, 1 if zstd else None))
    return vdir


# ---------------------------------------------------------------- in-process SGLang


_DIST_READY = False


def init_sglang_inprocess(tp_rank: int = 0, tp_size: int = 1, init_method: Optional[str] = None,
                          ep_size: int = 1, backend: str = "gloo", device: str = "cpu") -> None:
    """A TP world (``ep_size``: of it, the MoE layers' expert-parallel width; gloo on the CPU, nccl on GPUs) + the
    server-args/topology globals the model classes read (per SGLang era)."""
    global _DIST_READY
    if _DIST_READY:
        return
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.server_args import ServerArgs

    init_distributed_environment(world_size=tp_size, rank=tp_rank, local_rank=tp_rank, backend=backend,
                                 distributed_init_method=init_method or f"tcp://127.0.0.1:{free_port()}")
    args = ServerArgs(model_path="dummy", tp_size=tp_size, ep_size=ep_size, device=device)
    era_b = False
    try:
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context  # v0.5.23

        reset_context()
        publish(args, role="test", ranks=SpawnRanks(world_rank=tp_rank))
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
    except ImportError:
        from sglang.srt.server_args import set_global_server_args_for_scheduler  # v0.5.15

        set_global_server_args_for_scheduler(args)
        era_b = True
    if era_b:
        initialize_model_parallel(tensor_model_parallel_size=tp_size, expert_model_parallel_size=ep_size,
                                  backend=backend)
    else:  # v0.5.23 reads the widths from the published ServerArgs
        initialize_model_parallel(backend=backend)
    if era_b:  # v0.5.15: ModelRunner sets the dp-attention globals; only hidden_size/dtype are read
        import types

        from sglang.srt.layers.dp_attention import initialize_dp_attention

        initialize_dp_attention(args, types.SimpleNamespace(hf_config=types.SimpleNamespace(), hidden_size=64,
                                                            dtype=torch.get_default_dtype()))
    _DIST_READY = True


FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
_FP8_LINEAR = re.compile(r"^model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")  # decoder linears (experts, MLA), not the router


def fp8_block_quantize(state: Dict[str, torch.Tensor], block=(128, 128)) -> Dict[str, torch.Tensor]:
    """slime's FP8 rollout conversion (``quantize_params_fp8`` with block scales) on CPU: every decoder linear weight
    becomes e4m3 plus an fp32 ``weight_scale_inv`` per block, with the arithmetic of slime's Triton kernel
    (``amax = max(|x|, 1e-10)``, ``s = amax / 448``, ``q = clamp(x * (1 / s), ±448)``); other tensors as they are."""
    out = {}
    for name, x in state.items():
        if not _FP8_LINEAR.match(name):
            out[name] = x
            continue
        (m, n), (bm, bn) = x.shape, block
        mb, nb = -(-m // bm), -(-n // bn)
        padded = torch.zeros(mb * bm, nb * bn, dtype=torch.float32, device=x.device)
        padded[:m, :n] = x.float()
        blocks = padded.view(mb, bm, nb, bn)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-10) / 448.0
        q = (blocks * (1.0 / scale)[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        out[name] = q.view(mb * bm, nb * bn)[:m, :n].contiguous()
        out[name.removesuffix("weight") + "weight_scale_inv"] = scale.contiguous()
    return out


def sglang_model(cfg, quant=None):
    """An SGLang model class in-process; ``quant``: a checkpoint's ``quantization_config`` dict or an ``Fp8Config``
    (e.g. online quantization of a bf16 checkpoint)."""
    init_sglang_inprocess()
    arch = cfg.architectures[0] if cfg.architectures else type(cfg).__name__.replace("Config", "ForCausalLM")
    import importlib

    mod = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
           "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe",
           "DeepseekV3ForCausalLM": "deepseek_v2", "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
           "Glm4MoeForCausalLM": "glm4_moe"}[arch]
    if mod in ("deepseek_v2", "glm4_moe_lite"):
        cfg = _engine_config(cfg, arch)
    cls = getattr(importlib.import_module(f"sglang.srt.models.{mod}"), arch)
    if quant is None:
        with torch.device("cpu"):
            return cls(cfg).to(torch.bfloat16)
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    config = Fp8Config.from_config(quant) if isinstance(quant, dict) else quant
    cfg = copy.deepcopy(cfg)
    if isinstance(quant, dict):
        cfg.quantization_config = quant
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as the server builds it: scales stay fp32, fp8 weights e4m3
    try:
        with torch.device("cpu"):
            model = cls(cfg, quant_config=config)
    finally:
        torch.set_default_dtype(default)
    return model


def nan_filled(model):
    """Fill every param with NaN, so a name a loader silently skips shows up in the comparison (not an FP8
    engine's KV-cache scales: no checkpoint of the trainer's carries them)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.is_floating_point() and not n.endswith((".k_scale", ".v_scale")):
                p.fill_(float("nan"))
    return model


class Host:
    """The runner attributes the receiver reads: the model, its device, server args, update groups.

    The receiver functions are called through the *patched* upstream class (``receiver_method``),
    so the test also proves the patch bound them.
    """

    def __init__(self, model, chunk_bytes: Optional[int] = None, read_workers: int = 4):
        from sglang.srt.server_args import ServerArgs

        self.model = model
        self.device = "cpu"
        self.server_args = ServerArgs(model_path="dummy", device="cpu")
        if chunk_bytes is not None:
            self.server_args.update_weight_delta_chunk_bytes = chunk_bytes
        self.server_args.update_weight_delta_read_workers = read_workers
        self._model_update_group = {}
        self.model_config = None

    def call(self, name: str, *args, **kwargs):
        return getattr(receiver_class(), name)(self, *args, **kwargs)


class InProcessEngine(DeltaEngine):
    """An engine as the sender's transports call it, in-process: the receiver's entry points on a ``Host``, called
    directly (not through SGLang's runner classes, which a bare GPU host with an import stub cannot load)."""

    def __init__(self, host: Host):
        self.host = host

    def update_weights_from_disk(self, model_path, files, weight_version, store=None):
        from sglang.srt.weight_sync.delta import receiver

        return receiver._apply_delta(self.host, model_path, files, weight_version, store)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name, delta, weight_version):
        from sglang.srt.weight_sync.delta import receiver

        return receiver._apply_delta_from_distributed(self.host, delta, names, dtypes, shapes, group_name,
                                                      weight_version)

    def fingerprint(self):
        from sglang.srt.weight_sync.delta import receiver

        return [receiver.fingerprint_payload(self.host.model)]

    def status(self):
        from sglang.srt.weight_sync.delta import receiver

        return [receiver.delta_status(self.host.model)]

    def stage(self, request):
        from sglang.srt.weight_sync.delta import fetch
        from sglang.srt.weight_sync.delta.engine_state import host_model

        fetch.request(host_model(self.host), request)
        return self.status()


def receiver_class():
    """Where the patch set binds the receiver: ModelRunner (v0.5.15) or its WeightUpdater (v0.5.23)."""
    try:
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

        return WeightUpdater
    except ImportError:
        from sglang.srt.model_executor.model_runner import ModelRunner

        return ModelRunner


# ---------------------------------------------------------------- a real server on CPU


def write_hf_checkpoint(out_dir: str, cfg, state: Dict[str, torch.Tensor]) -> str:
    """A loadable HF model dir: config, an offline byte-level BPE tokenizer, bf16 safetensors."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(out_dir, exist_ok=True)
    if not os.path.exists(os.path.join(out_dir, "tokenizer.json")):
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size - 4, special_tokens=["<unk>", "<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "one two three four five"] * 20, trainer)
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>",
                                pad_token="<|endoftext|>").save_pretrained(out_dir)
    cfg = cfg.__class__.from_dict(cfg.to_dict())
    cfg.dtype = "bfloat16"
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    cfg.save_pretrained(out_dir)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})
    return out_dir


def _device_flags(device: str) -> List[str]:
    """CPU: SGLang's torch-native paths, one small TP rank (a later ``--tp`` overrides), and an idle scheduler that
    waits on its sockets (SGLang's ``--sleep-on-idle``) instead of polling a core at 100%: on a small machine the
    idle servers of a test would otherwise take the cores its work needs. CUDA: SGLang's defaults (CUDA graphs and
    the overlap scheduler on), a modest share of the memory."""
    if device == "cuda":
        return ["--mem-fraction-static", "0.3"]
    return ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--mem-fraction-static",
            "0.1", "--skip-server-warmup", "--tp", "1", "--max-total-tokens", "2048", "--sampling-backend", "pytorch",
            "--grammar-backend", "none", "--sleep-on-idle"]


class Server:
    """``python -m sglang.launch_server`` (on CPU unless ``device="cuda"``); stopped by PID (children included)."""

    def __init__(self, model_dir: str, log_path: str, extra: Optional[List[str]] = None,
                 env: Optional[Dict[str, str]] = None, api_key: Optional[str] = None, device: str = "cpu"):
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._args = [model_dir, log_path, (["--api-key", api_key] if api_key else []) + (extra or []),
                      dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(env or {})), device]
        self._launch()

    def _launch(self) -> None:
        import subprocess
        import sys

        model_dir, log_path, extra, env, device = self._args
        self.port = free_port(below=50000)  # SGLang derives further ports from it (e.g. +10000 for gRPC)
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", "127.0.0.1",
               "--port", str(self.port), "--log-level", "warning"] + _device_flags(device) + extra
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_healthy(self, timeout: float = 300, relaunches: int = 2) -> "Server":
        """Wait for ``/health``; a server that lost its port to another process between ``free_port`` and its bind
        (a race of the test machine, not of the product) is launched again on another port."""
        import time

        import requests

        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                self.log.close()
                with open(self.log.name) as f:
                    lost_port = "address already in use" in f.read()
                if lost_port and relaunches > 0:
                    relaunches -= 1
                    self._launch()
                    continue
                raise RuntimeError(f"server exited rc={self.proc.returncode}; see {self.log.name}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {timeout}s; see {self.log.name}")

    def post(self, path: str, body: dict, timeout: float = 120):
        import requests

        return requests.post(self.url + path, json=body, timeout=timeout, headers=self.headers)

    def stop(self) -> None:
        """Kill the server's whole process group at once: a graceful SIGTERM makes SGLang drain for ~6 s, which
        summed over the suite's server restarts is minutes, and nothing here needs it."""
        import signal

        import psutil

        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            kids = []
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # start_new_session: the group is the server's
        except ProcessLookupError:
            pass
        self.proc.wait()
        for k in kids:  # a child that left the group
            if k.is_running():
                k.kill()
        self.log.close()


class StreamedRequest(threading.Thread):
    """One streamed greedy ``/generate`` of ``tokens`` tokens with log-probs; ``started`` once it produced a few (it
    then holds KV in the running batch); ``meta``: the last ``meta_info`` (None: it failed)."""

    def __init__(self, server: Server, input_ids: List[int], tokens: int):
        super().__init__(daemon=True)
        self.server, self.input_ids, self.tokens = server, input_ids, tokens
        self.started, self.meta = threading.Event(), None

    def run(self):
        try:
            self._stream()
        finally:  # an error shows as no result
            self.started.set()

    def _stream(self):
        import requests

        with requests.post(self.server.url + "/generate", stream=True, timeout=600, headers=self.server.headers, json={
                "input_ids": self.input_ids, "return_logprob": True, "stream": True,
                "sampling_params": {"max_new_tokens": self.tokens, "temperature": 0, "ignore_eos": True}}) as r:
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    self.meta = json.loads(line[len(b"data: "):]).get("meta_info")
                    if self.meta is None or self.meta["completion_tokens"] >= 5:
                        self.started.set()


def flip_a_value_bit(version_dir: str, prefix: str) -> str:
    """Corrupt one published flush in place, as a faulty disk or link would: the sign bit of the first value of the
    first file named ``prefix*`` (any kind's directory), written back uncompressed. Returns its path."""
    import glob

    from sglang.srt.weight_sync.delta.files import maybe_zstd_decompress, read_safetensors, write_safetensors

    path = sorted(glob.glob(os.path.join(version_dir, "**", prefix + "*.safetensors"), recursive=True))[0]
    with open(path, "rb") as f:
        pl = read_safetensors(maybe_zstd_decompress(f.read(), 1 << 30, path), path)
    values = pl.values.clone()  # a view of the file's bytes: flip a bit in a copy
    values.view(torch.uint8)[values.element_size() - 1] ^= 0x80
    with open(path, "wb") as f:
        f.write(write_safetensors(pl.spec, pl.positions, values))
    return path


def join_update_group(server: Server, group_name: str, tp: int = 1):
    """This process becomes rank 0 of a gloo weight-update group the server's ``tp`` ranks join (the trainer's
    role)."""
    import threading

    from sglang.srt.utils.common import init_custom_process_group

    port, box = free_port(), {}
    t = threading.Thread(target=lambda: box.setdefault("pg", init_custom_process_group(
        backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1 + tp, rank=0, group_name=group_name)))
    t.start()
    r = server.post("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                   "rank_offset": 1, "world_size": 1 + tp, "group_name": group_name,
                                                   "backend": "gloo"})
    t.join(60)
    if r.status_code != 200 or "pg" not in box:
        raise RuntimeError(f"init_weights_update_group failed: {r.text}")
    return box["pg"]


def engine_mismatch(server: Server, state: Dict[str, torch.Tensor]) -> Optional[str]:
    """The first HF param whose bytes differ on the engine (None: all equal), read with /get_weights_by_name.

    Values come back as float lists (exact for bf16); the engine pads vocab rows, so rows past ours are ignored.
    """
    for n, want in state.items():
        r = server.post("/get_weights_by_name", {"name": n, "truncate_size": 1 << 30})
        got = torch.tensor(r.json(), dtype=torch.float32).to(want.dtype)[: want.shape[0]]
        if got.shape != want.shape or not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            return n
    return None


# ---------------------------------------------------------------- counting host synchronizations

aten = torch.ops.aten
_ALWAYS = {aten.nonzero, aten._local_scalar_dense, aten.is_nonzero, aten.unique_consecutive, aten._unique2,
           aten.unique_dim, aten.masked_select, aten.equal}


class SyncCounter(TorchDispatchMode):
    """Counts the ops that would wait for the device: value reads, data-dependent shapes, copies to the host."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        syncs = packet in _ALWAYS
        syncs |= packet is aten._to_copy and str(kwargs.get("device")) == "cpu"  # an explicit copy to the host
        syncs |= packet is aten.index and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                              for i in (args[1] if len(args) > 1 else []))
        syncs |= packet is aten.repeat_interleave and kwargs.get("output_size") is None and func is not \
            aten.repeat_interleave.self_int
        if syncs:
            self.ops.append(str(func))
        return func(*args, **kwargs)


# ---------------------------------------------------------------- measuring live tensor memory


class LiveBytes(TorchDispatchMode):
    """The peak bytes of tensor storage created while it is on (this thread's ops) and alive at once: each new
    storage counted once, until it is freed (views share their base's). Storage that existed before is not counted:
    the peak is what a phase adds."""

    def __init__(self):
        super().__init__()
        self.live: Dict[int, int] = {}
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        from torch.utils._pytree import tree_flatten

        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                 if isinstance(t, torch.Tensor) and t.device.type != "meta"}  # in place, views, out=: not new
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                key = s.data_ptr()
                if s.nbytes() and key not in self.live and key not in given:
                    self.live[key] = s.nbytes()
                    self.now += s.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(s, self._free, key)
        return out


class PeakMemory:
    """The peak bytes a phase adds on ``device``: the CUDA allocator's statistics there (every thread's), else
    :class:`LiveBytes` (this thread's tensors)."""

    def __init__(self, device):
        self.device, self.peak = torch.device(device), 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._live = LiveBytes().__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._live.__exit__(*exc)
            self.peak = self._live.peak
        return False
