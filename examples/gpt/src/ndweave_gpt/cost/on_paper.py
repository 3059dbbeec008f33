"""``--mesh auto`` on paper: the layout the planner would choose for a published training run, and
its estimates, beside the published layout and figures. Nothing runs and nothing is allocated: the
model is a transformers config on meta, priced by ``proxy.Pricer`` with a GPU's rates written down
(:data:`H100`, :data:`A100`) instead of measured.

    python -m ndweave_gpt.cost.on_paper        # the README's tables (minutes on 2 CPU cores)

* :data:`RUNS`: torchtitan's published H100 benchmarks (``benchmarks/llama3_h100_202412_torchtitan.md``
  in pytorch/torchtitan: Llama 3.1 8B on 128 GPUs, 70B on 256, 96 GB H100s), with their memory.
  ndweave's layouts are not torchtitan's: data parallel keeps the parameters and grads whole (ZeRO-1:
  optimizer state and masters sharded), where FSDP shards all three, and torchtitan's runs add
  Float8 and torch.compile. So the same mesh in ndweave terms is priced too, and what the planner
  picks within 96 GB.
* :data:`A100_RUNS`: torchtitan's earlier Llama 3 8B and 70B runs on 64 A100s of 80 GB (FSDP2 alone,
  global batch 64; ``docs/performance.md`` there), throughput only.
* :data:`MEGATRON_RUNS`: the Megatron-LM paper's GPT table (Narayanan et al., *Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM*, 2021, Table 1; the image
  ``images/cases_april2021.png`` in NVIDIA/Megatron-LM): GPT-3-style models of 1.7B to 1T parameters
  (vocabulary 51,200, sequence 2048) on 32 to 3072 80 GB A100s, with the achieved teraFLOP/s per GPU
  (no memory). The estimate is turned into the same figure by the paper's own count of a step's
  FLOPs (with full recompute), so the two columns compare like for like.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from ndweave.plan.calibrate import Machine
from ndweave_gpt import cost
from ndweave_gpt.config import parse_args

__all__ = ["A100", "A100_RUNS", "H100", "MEGATRON_RUNS", "RUNS", "megatron_flops", "plan_on_paper"]

#: The published runs' transformers configs (package data).
CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")

#: An H100 SXM as the planner sees it, from its data sheet: bf16 dense matmuls at 70% of the 989
#: TFLOP/s peak, HBM3 at 3.35 TB/s, one link of 50 GB/s per GPU to the network (400 Gb/s RDMA: what
#: DP and PP cross), NVLink 4 between a host's 8 GPUs (450 GB/s each way: TP, and any dim that fits
#: in a host), a microsecond-scale host cost per op (CUDA kernels launched asynchronously).
H100 = Machine(device_type="cuda", device_name="NVIDIA H100 80GB HBM3 (data sheet)",
               matmul_flops={"bfloat16": 0.7 * 989e12, "float32": 0.7 * 494e12},
               memory_bandwidth=3.35e12, op_overhead_s=5e-6, dtensor_op_overhead_s=20e-6,
               link_bandwidth=50e9, link_latency_s=10e-6, concurrent_ranks=8,
               host_link_bandwidth=450e9, host_link_latency_s=3e-6)
#: An A100 SXM 80GB as the Megatron-LM paper's Selene had them: bf16 (and fp16) dense matmuls at 70%
#: of the 312 TFLOP/s peak, HBM2e at 2.04 TB/s, 8 x 200 Gb/s HDR InfiniBand a host (25 GB/s per
#: GPU), NVLink 3 between a host's 8 GPUs (300 GB/s each way).
A100 = Machine(device_type="cuda", device_name="NVIDIA A100-SXM4-80GB (data sheet)",
               matmul_flops={"bfloat16": 0.7 * 312e12, "float32": 0.7 * 156e12},
               memory_bandwidth=2.04e12, op_overhead_s=5e-6, dtensor_op_overhead_s=20e-6,
               link_bandwidth=25e9, link_latency_s=10e-6, concurrent_ranks=8,
               host_link_bandwidth=300e9, host_link_latency_s=3e-6)

#: (name, config, ranks, global batch, sequence, published mesh in ndweave's terms, recompute,
#: published memory GiB, published layout)
RUNS = [
    ("Llama 3.1 8B", "llama3_8b.json", 128, 256, 8192, "dp=128", True, 67.0, "FSDP 128, local batch 2, selective AC"),
    ("Llama 3.1 70B", "llama3_70b.json", 256, 512, 8192, "dp=32,tp=8", True, 71.9,
     "FSDP 32 x TP 8, local batch 16, full AC, Float8"),
]
#: torchtitan's earlier Llama 3 runs on 64 A100s of 80 GB (``docs/performance.md`` in
#: pytorch/torchtitan: FSDP2 alone, local batch 1 so global batch 64, sequence 8192; throughput
#: published, memory not): (name, config, ranks, global batch, sequence, published mesh in ndweave's
#: terms, recompute, published layout, published tokens/s per GPU)
A100_RUNS = [
    ("Llama 3 8B", "llama3_8b.json", 64, 64, 8192, "dp=64", True, "FSDP 64, local batch 1, selective op AC", 2973),
    ("Llama 3 70B", "llama3_70b.json", 64, 64, 8192, "dp=64", True, "FSDP 64, local batch 1, full AC", 331),
]


#: The Megatron-LM paper's Table 1: (name, attention heads, hidden size, layers, model-parallel size
#: (TP 8 within a host, times PP beyond it), GPUs, global batch, published teraFLOP/s per GPU)
MEGATRON_RUNS = [
    ("GPT 1.7B", 24, 2304, 24, 1, 32, 512, 137),
    ("GPT 3.6B", 32, 3072, 30, 2, 64, 512, 138),
    ("GPT 7.5B", 32, 4096, 36, 4, 128, 512, 142),
    ("GPT 18B", 48, 6144, 40, 8, 256, 1024, 135),
    ("GPT 39B", 64, 8192, 48, 16, 512, 1536, 138),
    ("GPT 76B", 80, 10240, 60, 32, 1024, 1792, 140),
    ("GPT 145B", 96, 12288, 80, 64, 1536, 2304, 148),
    ("GPT 310B", 128, 16384, 96, 128, 1920, 2160, 155),
    ("GPT 530B", 128, 20480, 105, 280, 2520, 2520, 163),
    ("GPT 1T", 160, 25600, 128, 512, 3072, 3072, 163),
]
#: The paper's GPT models' vocabulary and sequence length
MEGATRON_VOCAB, MEGATRON_SEQUENCE = 51200, 2048


def megatron_flops(batch: int, sequence: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one step as the Megatron-LM paper counts them (its equation 3, with full activation
    recompute): ``96 B s l h^2 (1 + s / 6h + V / 16 l h)``."""
    return 96 * batch * sequence * layers * hidden ** 2 * (1 + sequence / (6 * hidden) + vocab / (16 * layers * hidden))


def plan_on_paper(config: str, ranks: int, global_batch: int, sequence: int, mesh: str, recompute: bool,
                  memory_gib: float = 96.0, machine: Machine = H100, model: str = "hf:llama",
                  micro_batches: int = 1) -> dict:
    """The planner's choice for the run and the estimate of the published mesh in ndweave's terms
    (``micro_batches`` per DP rank through its pipeline)."""
    args = parse_args(["--model", model, "--config", config if os.path.isabs(config) else
                       os.path.join(CONFIGS, config), "--block-size", str(sequence), "--global-batch",
                       str(global_batch), "--dtype", "bf16", "--mesh", mesh, "--micro-batches", str(micro_batches)]
                      + (["--activation-checkpointing"] if recompute else []))
    args = args.replace(device="cuda")  # a GPU's memory: the dataset stays on the host (nothing runs)
    pricer = cost.pricer(args, machine)
    planned = cost.choose_layout(args, pricer, ranks, int(memory_gib * 2**30), experts=0)
    return {"published_mesh_peak": pricer.peak_bytes(args), "published_mesh_step": pricer.step_seconds(args),
            "planned": planned}


def megatron_on_paper(run: tuple, folder: str) -> dict:
    """One row of :data:`MEGATRON_RUNS` planned on :data:`A100` s of 80 GB: its GPT-2-style config
    written to ``folder``; the published mesh with 1F1B, one row per micro-batch."""
    name, heads, hidden, layers, model_parallel, gpus, batch, _ = run
    config = os.path.join(folder, f"{name.replace(' ', '_')}.json")
    with open(config, "w") as f:
        json.dump({"model_type": "gpt2", "n_embd": hidden, "n_layer": layers, "n_head": heads,
                   "n_inner": 4 * hidden, "vocab_size": MEGATRON_VOCAB, "n_positions": MEGATRON_SEQUENCE,
                   "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "use_cache": False}, f)
    tp = min(model_parallel, 8)
    pp, dp = model_parallel // tp, gpus // model_parallel
    mesh = f"pp={pp},dp={dp},tp={tp}"
    return plan_on_paper(config, gpus, batch, MEGATRON_SEQUENCE, mesh, True, memory_gib=80.0, machine=A100,
                         model="hf:gpt2", micro_batches=batch // dp) | {"mesh": mesh}


def _print_run(title: str, out: dict, same_mesh: str, rate: Callable[[float], str], top: int = 5) -> None:
    """One run's lines: the published mesh's estimate and the planner's choice, each step's seconds
    as ``rate`` puts them (tokens/s or TFLOP/s per GPU), then the planner's table."""
    best = out["planned"].ranked[0] if out["planned"].ranked else None
    print(title)
    print(f"  the same mesh in ndweave ({same_mesh}): {out['published_mesh_peak'] / 2**30:.1f} GiB, "
          f"{rate(out['published_mesh_step'])} estimated")
    if best is not None:
        print(f"  chosen: {best.layout.describe().strip()}: {best.peak_bytes / 2**30:.1f} GiB, "
              f"{rate(best.step_seconds)} estimated")
    print(out["planned"].table(top=top), flush=True)


def _tokens_per_gpu(tokens: int, ranks: int) -> Callable[[float], str]:
    return lambda seconds: f"{tokens / seconds / ranks:,.0f} tokens/s/GPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", choices=["torchtitan", "megatron", "all"], default="all")
    chosen = parser.parse_args().runs
    for name, config, ranks, batch, sequence, mesh, recompute, published, layout in RUNS * (chosen != "megatron"):
        out = plan_on_paper(config, ranks, batch, sequence, mesh, recompute)
        _print_run(f"{name}, {ranks} GPUs, global batch {batch} x {sequence}: published {layout}: {published} GiB",
                   out, f"{mesh}, ZeRO-1, recompute", _tokens_per_gpu(batch * sequence, ranks))
    for name, config, ranks, batch, sequence, mesh, recompute, layout, published in A100_RUNS * (chosen != "megatron"):
        out = plan_on_paper(config, ranks, batch, sequence, mesh, recompute, memory_gib=80.0, machine=A100)
        _print_run(f"{name}, {ranks} A100s, global batch {batch} x {sequence}: published {layout}: "
                   f"{published:,} tokens/s/GPU", out, f"{mesh}, ZeRO-1, recompute",
                   _tokens_per_gpu(batch * sequence, ranks))
    with tempfile.TemporaryDirectory() as folder:
        for run in MEGATRON_RUNS * (chosen != "torchtitan"):
            name, heads, hidden, layers, _, gpus, batch, published = run
            out = megatron_on_paper(run, folder)
            flops = megatron_flops(batch, MEGATRON_SEQUENCE, layers, hidden, MEGATRON_VOCAB)
            _print_run(f"{name}, {gpus} GPUs, global batch {batch}: published {out['mesh']}, {published} TFLOP/s/GPU",
                       out, "1F1B, recompute", lambda seconds: f"{flops / seconds / gpus / 1e12:.0f} TFLOP/s/GPU",
                       top=3)


if __name__ == "__main__":
    main()
