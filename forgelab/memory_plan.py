"""A memory planner: each process's peak memory for a run config, before anything is spawned.

    forgelab plan CONFIG.yaml [--gpus N --gpu-mem GiB] [--host-mem GiB]

Counted per process, from the model's ``config.json`` (no weights are read) and the
component configs a `Run` would spawn (`forgelab.engines.spawn.component_configs`):

- generator (vLLM): weights in the engine dtype, KV cache (``kv_cache_gib`` on CPU;
  ``gpu_memory_utilization`` x GPU memory on a GPU, which vLLM reserves whole),
  the sampler's logits for a full batch of sequences, and the runtime;
- trainer (each FSDP rank): fp32 parameters, gradients and AdamW's two moments
  (16 bytes a parameter, divided over the ranks), the largest gathered FSDP unit,
  activations kept for backward (one micro-batch of ``max_model_len`` tokens), the
  chunked logits (``logits_chunk`` rows x vocabulary, a few fp32 copies), the
  output-projection gradient buffer, the full copy FSDP gathers for a weight push, the runtime;
- reference: weights, one micro-batch's forward temporaries, chunked logits, the runtime;
- the shared-memory weights file (same-host weight sync): counted once, not per process.

With ``lora.enabled``: the trainer keeps the frozen base (no gradients, no AdamW state) plus the adapters
with theirs, no output-projection or embedding gradient, pushes the adapter alone, and (``lora.reference:
base``) runs one extra no-grad forward for the reference instead of a reference process; the generator adds
``max_loras`` adapter slots at vLLM's ``max_lora_rank`` and as many in its CPU adapter cache.

The per-token activation and runtime constants were fitted on CPU measurements
(`python -m forgelab.bench realmodel` reports planned vs measured); they are estimates:
the planner's job is to name the term that will not fit, not to be exact.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

GiB = 1024**3

#: Resident memory of an idle process, bytes: python + torch + monarch (trainer, reference), plus vLLM's engine.
RUNTIME_BYTES = {"trainer": 0.55 * GiB, "reference": 0.55 * GiB, "generator": 1.1 * GiB}
#: ``chunk x V`` fp32 blocks alive at once in the chunked logprobs/entropy pass (measured: ~7 in the forward
#: with entropy: logits, logsumexp's and log-softmax's temporaries, probabilities, their product).
LOGITS_COPIES = 7
#: The same with a frozen output projection (LoRA): no projection-gradient products per chunk (fitted on the
#: 2-layer Qwen3-0.6B LoRA loop of `python -m forgelab.bench lora --quick`: trainer peak PSS 1.75 GiB).
LOGITS_COPIES_FROZEN = 3
#: Activation values kept for backward per token and layer: ``a*D + b*(q+kv dims) + c*I`` (fp32 each).
ACT_D, ACT_QKV, ACT_I = 6, 4, 4


def _bytes(dtype: str) -> int:
    return 2 if str(dtype) in ("bfloat16", "float16", "bf16", "fp16") else 4


@dataclass
class ModelShape:
    """What the planner needs from a HF ``config.json``."""

    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "ModelShape":
        heads = int(hf["num_attention_heads"])
        return cls(vocab=int(hf["vocab_size"]), dim=int(hf["hidden_size"]), layers=int(hf["num_hidden_layers"]),
                   heads=heads, kv_heads=int(hf.get("num_key_value_heads") or heads),
                   head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
                   ffn=int(hf["intermediate_size"]), tied=bool(hf.get("tie_word_embeddings", False)),
                   qk_norm=hf.get("model_type") == "qwen3")

    @property
    def layer_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.dim * (q + 2 * kv) + q * self.dim + (2 * self.head_dim if self.qk_norm else 0)
        return attn + 3 * self.dim * self.ffn + 2 * self.dim

    def lora_params(self, targets: Any, rank: int) -> int:
        """Parameters of rank-``rank`` LoRA adapters on ``targets`` (HF projection names) in every layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        dims = {"q_proj": (self.dim, q), "k_proj": (self.dim, kv), "v_proj": (self.dim, kv), "o_proj": (q, self.dim),
                "gate_proj": (self.dim, self.ffn), "up_proj": (self.dim, self.ffn), "down_proj": (self.ffn, self.dim)}
        return self.layers * sum(rank * sum(dims[t]) for t in targets)

    @property
    def params(self) -> int:
        emb = self.vocab * self.dim
        return emb * (1 if self.tied else 2) + self.layers * self.layer_params + self.dim

    def act_bytes_per_token(self, value_bytes: int = 4, checkpointed: bool = False) -> int:
        """Activations autograd keeps for backward, per token, all layers (plus embedding and final norm).

        ``checkpointed`` (trainer.activation_checkpointing): each block keeps only its input, and one block's
        intermediates live while it is recomputed in backward."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = ACT_D * self.dim + ACT_QKV * (q + kv) + ACT_I * self.ffn
        if checkpointed:
            return value_bytes * (self.layers * self.dim + per_layer + 3 * self.dim)
        return value_bytes * (self.layers * per_layer + 3 * self.dim)


@dataclass
class ProcessPlan:
    """One process's peak, as named terms in bytes."""

    name: str
    count: int
    """Identical processes of this kind (replicas, ranks)."""
    terms: dict[str, float] = field(default_factory=dict)
    """The terms alive at the peak."""
    on_gpu: bool = False
    phase: str = ""
    """When the peak happens (the trainer's step has phases that do not overlap)."""

    @property
    def peak(self) -> float:
        return float(sum(self.terms.values()))

    @property
    def largest(self) -> tuple[str, float]:
        return max(self.terms.items(), key=lambda kv: kv[1])


@dataclass
class MemoryPlan:
    processes: list[ProcessPlan]
    shared_bytes: float
    """The shared-memory weights file (host memory, counted once)."""
    gpus: int | None = None
    gpu_mem_gib: float | None = None
    host_mem_gib: float | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    def by_name(self) -> dict[str, ProcessPlan]:
        return {p.name: p for p in self.processes}

    def table(self) -> str:
        """The plan as text: one line per process with its terms, the shared file, the verdict."""
        lines = []
        for p in self.processes:
            where = "GPU" if p.on_gpu else "host"
            terms = ", ".join(f"{k} {v / GiB:.2f}" for k, v in sorted(p.terms.items(), key=lambda kv: -kv[1]) if v)
            when = f" during {p.phase}" if p.phase else ""
            lines.append(f"  {p.name:<10} x{p.count} [{where}] peak {p.peak / GiB:6.2f} GiB{when}  ({terms})")
        lines.append(f"  {'shared':<10} x1 [host] weights file {self.shared_bytes / GiB:.2f} GiB (counted once)")
        host = sum(p.peak * p.count for p in self.processes if not p.on_gpu) + self.shared_bytes
        lines.append(f"  host total {host / GiB:.2f} GiB" + (f" of {self.host_mem_gib:.1f}" if self.host_mem_gib else ""))
        if self.fits:
            lines.append("  fits: yes")
        else:
            lines += [f"  does NOT fit: {msg}" for msg in self.problems]
        return "\n".join(lines)


def plan_memory(cfg: Any, *, gpus: int | None = None, gpu_mem_gib: float | None = None,
                host_mem_gib: float | None = None, seq_len: int | None = None,
                hf_config: dict[str, Any] | None = None) -> MemoryPlan:
    """Each process's planned peak for `RunConfig` ``cfg``.

    Args:
        gpus: place every generator replica, trainer rank and reference replica on its own GPU, this many
            GPUs of ``gpu_mem_gib`` each (``placement.with_gpus``); None: the config's own placement, on the host.
        gpu_mem_gib: the memory of each GPU (with ``gpus``).
        host_mem_gib: host memory to check against (default: this machine's MemTotal).
        seq_len: tokens per training sequence (default ``model.max_model_len``, the worst case).
        hf_config: the model's ``config.json`` dict (default: read from ``model.path``).
    """
    from forgelab.engines.spawn import component_configs
    from forgelab.engines.titan import read_hf_config

    cc = component_configs(cfg)
    gen, tr, ref = cc["generator"], cc["trainer"], cc["reference"]
    hf = hf_config or read_hf_config(cfg.model.path)
    shape = ModelShape.from_hf(hf)
    ckpt_bytes = _bytes(hf.get("torch_dtype") or hf.get("dtype") or "float32")  # the checkpoint files' dtype
    pl = cfg.placement
    on_gpu = gpus is not None or bool(pl.with_gpus)
    P, V, D = shape.params, shape.vocab, shape.dim
    L = int(seq_len or cfg.model.max_model_len)
    T = max(1, L - 1)
    world = int(pl.trainer_procs) * int(getattr(cfg.hosts, "trainer_hosts", 1) or 1)
    from forgelab.algos.logprobs import DEFAULT_LOGITS_CHUNK

    chunk = int(getattr(tr, "logits_chunk", None) or DEFAULT_LOGITS_CHUNK)

    # generator
    wb = _bytes(gen.dtype)
    # rollout.concurrency 0: the agent door alone, whose calls may fill the engine
    native = cfg.rollout.group_size * cfg.rollout.prompts_per_rollout * cfg.rollout.concurrency
    seqs = min(int(gen.max_num_seqs), native) if native else int(gen.max_num_seqs)
    g_terms = {"weights": P * wb, "runtime": RUNTIME_BYTES["generator"], "sampler logits": seqs * V * 4 * 2}
    lora = cfg.lora if cfg.lora.enabled else None
    A = shape.lora_params(lora.targets, lora.rank) if lora else 0  # trainable adapter parameters
    if lora:
        from forgelab.config.components import vllm_lora_rank

        # vLLM keeps max_loras adapter slots at max_lora_rank, and as many adapters in its CPU cache
        slots = int(gen.max_loras) * shape.lora_params(lora.targets, vllm_lora_rank(lora.rank)) * wb
        g_terms["LoRA slots + adapter cache"] = 2 * slots
    if on_gpu and gpu_mem_gib:
        g_terms = {"vLLM reservation (weights + KV + activations)": gen.gpu_memory_utilization * gpu_mem_gib * GiB,
                   "runtime": 0.0}
    else:
        g_terms["KV cache"] = float(gen.kv_cache_gib) * GiB
        # vLLM's CPU GEMMs keep a packed copy of the output projection (the embedding, when tied, is
        # kept as well); a reload re-packs it while the old copy is still alive
        g_terms["packed output projection"] = 2 * V * D * wb
    generator = ProcessPlan("generator", int(pl.generator_replicas), g_terms, on_gpu)

    # trainer (one rank)
    rows_local = math.ceil(cfg.train.batch_size / world)
    rows = min(int(tr.micro_batch_size or rows_local), rows_local)
    tokens = rows * T
    emb_bytes = V * D * 4
    # compute dtype: FSDP2 mixed precision gathers and computes in bf16 on CUDA, fp32 on CPU
    cb = _bytes(tr.dtype) if on_gpu else 4
    largest_unit = (V * D * cb * (1 if shape.tied else 2) if world > 1 else 0)
    act = tokens * shape.act_bytes_per_token(cb, checkpointed=tr.checkpoints_activations())
    trained = A if lora else P  # LoRA: the base is frozen (no gradients, no optimizer state), the adapters train
    static = {"parameters": 4 * (P + A) / world, "optimizer (AdamW)": 8 * trained / world,
              "gathered FSDP unit": largest_unit, "runtime": RUNTIME_BYTES["trainer"]}
    proj_grad = 0.0 if lora else emb_bytes  # a frozen output projection / embedding gets no gradient
    # The rest is not alive all at once: the peak is the largest of the step's phases.
    phases = {
        # the output projection's gradient is built chunk by chunk while the layers' activations wait
        "backward through the logits": {"activations": act, "projection grad": proj_grad,
                                        "logits chunks": min(chunk, tokens) * V * 4 * (
                                            LOGITS_COPIES_FROZEN if lora else LOGITS_COPIES)},
        # the layers' gradients accumulate; the embedding's own dense gradient is added last
        "backward through the layers": {"activations": act, "gradients": 4 * trained / world,
                                        "embedding grad (temporary)": proj_grad},
        "optimizer step": {"gradients": 4 * trained / world, "optimizer temporaries": 4 * trained / world},
        # one rank's HF export gathers every DTensor (a full fp32 copy); a single process exports views;
        # LoRA pushes the adapter alone
        "weight push": {"weight export": 4 * (A if lora else P) if world > 1 else 0.0},
    }
    if not on_gpu:
        # building the model: every rank reads the whole HF checkpoint (host memory) and copies it into its
        # parameters: the largest phase of a LoRA trainer with small batches (the base twice, nothing trained
        # yet; the AdamW state counted in `static` does not exist yet: 8 bytes per trained parameter too many)
        phases["model load"] = {"checkpoint tensors (load)": ckpt_bytes * P}
    if lora and tr.lora.reference == "base":
        # the reference from the base: one no-grad forward per micro-batch before the step's own (transient)
        phases["reference forward (adapters off)"] = {
            "forward temporaries": tokens * 4 * (4 * D + 3 * shape.ffn),
            "logits chunks": min(chunk, tokens) * V * 4 * 2}
    phase = max(phases, key=lambda k: sum(phases[k].values()))
    t_terms = {**static, **phases[phase]}
    trainer = ProcessPlan("trainer", world, t_terms, on_gpu, phase=phase)
    processes = [generator, trainer]

    from forgelab.engines.spawn import reference_process

    if reference_process(cfg):  # not with LoRA taking the reference from the base
        rrows = int(ref.micro_batch_size or cfg.train.batch_size)
        rtok = rrows * T
        r_terms = {
            "weights": 4 * P if _bytes(ref.dtype) == 4 else 2 * P,
            "forward temporaries": rtok * 4 * (4 * D + 3 * shape.ffn),
            "logits chunks": min(chunk, rtok) * V * 4 * 2,  # no grad, no entropy: logits + logsumexp temporary
            "runtime": RUNTIME_BYTES["reference"],
        }
        processes.append(ProcessPlan("reference", int(pl.reference_replicas), r_terms, on_gpu))

    transport = getattr(tr, "weight_transport", "auto")
    shared = 0.0 if (on_gpu or transport == "message") else 4.0 * (A if lora else P)
    plan = MemoryPlan(processes, shared, gpus=gpus, gpu_mem_gib=gpu_mem_gib,
                      host_mem_gib=host_mem_gib if host_mem_gib is not None else _host_mem_gib())
    _check(plan)
    return plan


def _host_mem_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    return None


def _check(plan: MemoryPlan) -> None:
    gpu_procs = [p for p in plan.processes if p.on_gpu]
    if gpu_procs and plan.gpus is not None:
        need = sum(p.count for p in gpu_procs)
        if need > plan.gpus:
            plan.problems.append(f"{need} processes each need their own GPU ({', '.join(f'{p.name} x{p.count}' for p in gpu_procs)}), "
                                 f"only {plan.gpus} GPUs: lower replicas/procs or add GPUs")
    if gpu_procs and plan.gpu_mem_gib:
        for p in gpu_procs:
            if p.peak > plan.gpu_mem_gib * GiB:
                name, value = p.largest
                plan.problems.append(f"{p.name} needs {p.peak / GiB:.1f} GiB on a {plan.gpu_mem_gib:g} GiB GPU; "
                                     f"largest term: {name} {value / GiB:.1f} GiB")
    host = sum(p.peak * p.count for p in plan.processes if not p.on_gpu) + plan.shared_bytes
    if plan.host_mem_gib and host > plan.host_mem_gib * GiB:
        terms = [(f"{p.name} {k}", v * p.count) for p in plan.processes if not p.on_gpu for k, v in p.terms.items()]
        terms.append(("shared weights file", plan.shared_bytes))
        name, value = max(terms, key=lambda kv: kv[1])
        plan.problems.append(f"host processes need {host / GiB:.1f} GiB, the host has {plan.host_mem_gib:.1f} GiB; "
                             f"largest term: {name} {value / GiB:.1f} GiB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="forgelab plan", description="each process's planned peak memory for a config")
    ap.add_argument("config")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs available (each process on its own)")
    ap.add_argument("--gpu-mem", type=float, default=None, help="memory per GPU, GiB")
    ap.add_argument("--host-mem", type=float, default=None, help="host memory, GiB (default: this machine's)")
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args(argv)
    from forgelab.config import RunConfig

    cfg = RunConfig.from_yaml(args.config, overrides=args.set)
    plan = plan_memory(cfg, gpus=args.gpus, gpu_mem_gib=args.gpu_mem, host_mem_gib=args.host_mem)
    print(f"memory plan for {cfg.name} ({os.path.basename(cfg.model.path.rstrip('/'))}):")
    print(plan.table())
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
