"""``--mesh auto`` on paper: the layout the planner would choose for a published training run, and
its memory estimate, beside the published layout and memory. Nothing runs and nothing is allocated:
the model is a transformers config on meta, priced by ``proxy.Pricer`` with a GPU's rates written
down (:data:`H100`) instead of measured.

    python examples/gpt/on_paper.py        # the README's table (a minute or two on 2 CPU cores)

Each run is one of torchtitan's published H100 benchmarks (``benchmarks/llama3_h100_202412_torchtitan.md``
in pytorch/torchtitan: Llama 3.1 8B on 128 GPUs, 70B on 256, 96 GB H100s). ndweave's layouts are not
torchtitan's: data parallel keeps the parameters and grads whole (ZeRO-1: optimizer state and masters
sharded), where FSDP shards all three, and torchtitan's runs add Float8 and torch.compile. So the
same mesh in ndweave terms is priced too, and what the planner picks within 96 GB.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import auto_mesh  # noqa: E402
import proxy  # noqa: E402
import train  # noqa: E402
from ndweave.ddp import DEFAULT_BUCKET_SIZE  # noqa: E402
from ndweave.mesh import resolve_spec  # noqa: E402
from ndweave.mesh.calibrate import Machine  # noqa: E402

__all__ = ["H100", "RUNS", "plan_on_paper"]

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")

#: An H100 SXM as the planner sees it, from its data sheet: bf16 dense matmuls at 70% of the 989
#: TFLOP/s peak, HBM3 at 3.35 TB/s, one link of 50 GB/s per GPU (400 Gb/s RDMA: what DP and PP cross;
#: ndweave models one link, so tensor parallel inside a node's NVLink is priced as slow as that), a
#: microsecond-scale host cost per op (CUDA kernels launched asynchronously) and 8 GPUs a host.
H100 = Machine(device_type="cuda", device_name="NVIDIA H100 80GB HBM3 (data sheet)",
               matmul_flops={"bfloat16": 0.7 * 989e12, "float32": 0.7 * 494e12},
               memory_bandwidth=3.35e12, op_overhead_s=5e-6, dtensor_op_overhead_s=20e-6,
               link_bandwidth=50e9, link_latency_s=10e-6, concurrent_ranks=8)

#: (name, config, ranks, global batch, sequence, published mesh in ndweave's terms, recompute,
#: published memory GiB, published layout)
RUNS = [
    ("Llama 3.1 8B", "llama3_8b.json", 128, 256, 8192, "dp=128", True, 67.0, "FSDP 128, local batch 2, selective AC"),
    ("Llama 3.1 70B", "llama3_70b.json", 256, 512, 8192, "dp=32,tp=8", True, 71.9,
     "FSDP 32 x TP 8, local batch 16, full AC, Float8"),
]


def plan_on_paper(config: str, ranks: int, global_batch: int, sequence: int, mesh: str, recompute: bool,
                  memory_gib: float = 96.0, machine: Machine = H100) -> dict:
    """The planner's choice for the run and the estimate of the published mesh in ndweave's terms."""
    args = train.parse_args(["--model", "hf:llama", "--config", os.path.join(CONFIGS, config), "--block-size",
                             str(sequence), "--global-batch", str(global_batch), "--dtype", "bf16", "--mesh", mesh,
                             "--micro-batches", "1"] + (["--activation-checkpointing"] if recompute else []))
    args.device = "cuda"  # a GPU's memory: the dataset stays on the host (nothing runs)
    pricer = proxy.Pricer(args, machine, train.build_model, lambda model, sizes: train.sharding_plan(model, args, sizes),
                          train.loss_fn, DEFAULT_BUCKET_SIZE, train.adamw_kwargs(args))
    planned = auto_mesh.choose_layout(
        args, auto_mesh.model_shape(pricer.model, args, 0), ranks, int(memory_gib * 2**30),
        peak_bytes=pricer.peak_bytes, step_seconds=pricer.step_seconds,
        job_rule=lambda a: train.mesh_problem(a, resolve_spec(a.mesh, None, dims=train.DIMS)))
    return {"published_mesh_peak": pricer.peak_bytes(args), "published_mesh_step": pricer.step_seconds(args),
            "planned": planned}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    torch.overrides.get_overridable_functions()  # see tests/integration/test_integration_estimate.py
    for name, config, ranks, batch, sequence, mesh, recompute, published, layout in RUNS:
        out = plan_on_paper(config, ranks, batch, sequence, mesh, recompute)
        best = out["planned"].ranked[0] if out["planned"].ranked else None
        tokens = batch * sequence
        print(f"{name}, {ranks} GPUs, global batch {batch} x {sequence}: published {layout}: {published} GiB")
        print(f"  the same mesh in ndweave ({mesh}, ZeRO-1, recompute): {out['published_mesh_peak'] / 2**30:.1f} GiB, "
              f"{tokens / out['published_mesh_step'] / ranks:,.0f} tokens/s/GPU estimated")
        if best is not None:
            print(f"  chosen: {best.layout.describe().strip()}: {best.peak_bytes / 2**30:.1f} GiB, "
                  f"{tokens / best.step_seconds / ranks:,.0f} tokens/s/GPU estimated")
        print(out["planned"].table(top=5))


if __name__ == "__main__":
    main()
