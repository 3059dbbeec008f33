"""What the GPT job shows (rank 0 only): the mesh and model at start, a progress bar, checkpoint
lines, peak memory per rank, a loss-curve PNG and a summary; the single-device comparison; a sample
of generated text."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ndweave_gpt.config import JobConfig

__all__ = ["compare", "describe_model", "device_peak_flops", "finish", "flops_per_token", "memory_check", "mfu",
           "model_flops", "peak_flops", "sample", "start"]


def start(mesh: Any, model: torch.nn.Module, config: JobConfig) -> None:
    """The run's whole config, then the mesh, the model and the layout in words."""
    print(f"config:\n{config.describe()}")
    count = sum(p.numel() for p in model.parameters())  # a tied weight once
    describe = mesh.describe().splitlines()
    print(describe[0].split(";")[0], "\n".join(describe[1:]), sep="\n")
    pp, dp, ep, tp = (mesh[d].size() for d in ("PP", "DP", "EP", "TP"))
    parallel = config.parallel
    print(f"{describe_model(model, config)}: {count / 1e6:.2f}M parameters, {config.model.dtype}"
          f"{', activation checkpointing per layer' if parallel.activation_checkpointing else ''}")
    experts = f", EP={ep} (experts divided, the batch split like DP)" if ep > 1 else ""
    cp = mesh["CP"].size()
    context = f", CP={cp} (each sequence split, attention across it)" if cp > 1 else ""
    print(f"PP={pp} ({parallel.schedule}, {parallel.micro_batches} micro-batches per data rank), "
          f"TP={tp}{'' if parallel.no_sp or tp == 1 else ' +SP'}, DP={dp}{experts}{context} with "
          f"ZeRO-{parallel.zero_stage} (DistributedOptimizer); "
          f"global batch {config.data.global_batch} x {config.model.block_size} tokens, {config.training.steps} steps")


def describe_model(model: torch.nn.Module, config: JobConfig) -> str:
    """One line: the model's kind and sizes (and where its weights come from)."""
    m, data = config.model, config.data
    source = f", weights from {m.init_from}" if m.init_from else ""
    tokens = f"tokenizer {data.tokenizer}" if data.data and data.tokenizer else "bytes"
    if m.hf_config is None:
        moe = f", MoE: {m.moe_experts} experts, top-{m.moe_top_k}" if m.moe_experts else ""
        return (f"GPT: {m.n_layer} layers, n_embd {m.n_embd}, {m.n_head} heads, block {m.block_size}, "
                f"vocab {m.vocab_size or 256} ({tokens}){moe}{source}")
    c = m.hf_config
    return (f"{type(model).__name__} ({m.name}): {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
            f"{c.num_attention_heads} heads, vocab {c.vocab_size} (trained on {tokens}), block {m.block_size}{source}")


#: dense peak FLOP/s of one GPU by the name CUDA reports (first match wins: PCIe before the SXM part),
#: from the vendors' datasheets; fp32 is the non-tensor-core rate (tf32: matmuls allowed TF32)
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12, "fp64": 51e12}),
    ("H100", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 67e12, "fp64": 67e12}),
    ("H200", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.7e12, "fp32": 67e12, "fp64": 67e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12, "fp64": 19.5e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("A10", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12, "fp64": 7.8e12}),
]
_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def flops_per_token(num_params: int, num_layers: int, width: int, seq_len: int) -> float:
    """Model FLOPs to train on one token: 6 per parameter (forward 2, backward 4) plus attention's
    scores and weighted sum, 12 x layers x width x sequence (PaLM, appendix B). Recomputation
    (activation checkpointing) is not counted: MFU counts the model's FLOPs, not the hardware's."""
    return 6 * num_params + 12 * num_layers * width * seq_len


def peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """One device's dense peak FLOP/s for ``dtype`` (fp32 at TF32 where torch lets matmuls use it),
    or None for a device this table does not know (a CPU)."""
    key = _DTYPE_KEYS.get(dtype)
    if key == "fp32" and torch.get_float32_matmul_precision() != "highest":
        key = "tf32"
    for name, peaks in PEAK_FLOPS:
        if name in device_name:
            return peaks.get(key)
    return None


def model_flops(model: torch.nn.Module, config: JobConfig) -> float:
    """Model FLOPs per trained token (:func:`flops_per_token`; a MoE counts every expert)."""
    m = config.model
    c = m.hf_config
    layers, width = (m.n_layer, m.n_embd) if c is None else (c.num_hidden_layers, c.hidden_size)
    return flops_per_token(sum(p.numel() for p in model.parameters()), layers, width, m.block_size)


def device_peak_flops(config: JobConfig) -> float | None:
    """This rank's device's peak FLOP/s at --dtype, where known (CUDA GPUs in :data:`PEAK_FLOPS`)."""
    if not config.parallel.device.startswith("cuda"):
        return None
    return peak_flops(torch.cuda.get_device_name(), config.model.torch_dtype)


def mfu(flops: float, tokens_per_s: float, peak_flops: float | None, devices: int) -> float | None:
    """Model FLOPs utilization: the model FLOPs per second achieved over the peak of ``devices``
    devices (None without a known peak)."""
    return None if not peak_flops else flops * tokens_per_s / (peak_flops * devices)


def memory_check(measured: list[int], estimated: list[Any]) -> None:
    """--memory-check: each rank's measured peak of live tensor bytes beside the estimate's."""
    print("rank  measured MiB  estimated MiB  estimate/measured")
    for rank, (got, guess) in enumerate(zip(measured, estimated)):
        print(f"{rank:>4}  {got / 2**20:>12.2f}  {guess.peak / 2**20:>13.2f}  {guess.peak / max(got, 1):>17.3f}")


def finish(result: Any, config: JobConfig) -> None:
    """The run's summary: peak memory per rank, the loss-curve PNG (``--plot``), the ``done:`` line."""
    if config.metrics.quiet:
        return
    mib = [m / 2**20 for m in result.peak_memory]
    kind = "host RSS" if config.parallel.device == "cpu" else "max allocated"
    print(f"peak memory per rank ({kind}, MiB): " + " ".join(f"{m:.0f}" for m in mib))
    if config.metrics.plot and result.losses:
        _plot(result.history or result.losses, result.val_losses, min(result.losses), config)
        print(f"loss curve: {config.metrics.plot}")
    steps = sorted(result.losses)
    final = result.losses[steps[-1]] if steps else float("nan")
    val = f", validation loss {result.val_losses[max(result.val_losses)]:.4f}" if result.val_losses else ""
    mfu = "" if result.mfu is None else f" (MFU {result.mfu:.1%}, estimated)"
    print(f"done: mesh {result.mesh}, steps {steps[0] if steps else '-'}..{steps[-1] if steps else '-'}, "
          f"final loss {final:.4f}{val}, {result.seconds:.1f}s, {result.tokens_per_s:,.0f} tokens/s{mfu}, "
          f"peak memory {max(mib):.0f} MiB/rank")


def _plot(losses: dict[int, float], val_losses: dict[int, float], first: int, config: JobConfig) -> None:
    """The loss curve from step 1 (earlier runs' steps from the checkpoint) and the validation loss
    beside it; a resumed run marks where this run began."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(list(losses), list(losses.values()), label=f"training, mesh {config.parallel.mesh}")
    if val_losses:
        ax.plot(list(val_losses), list(val_losses.values()), "o-", label="validation (held-out text, through the pipeline)")
    if first > 1:
        ax.axvline(first, color="tab:orange", linestyle="--", label=f"resumed at step {first - 1}")
    ax.axhline(math.log(256), color="grey", linestyle=":", label="uniform over bytes (ln 256)")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title="GPT on Shakespeare, ndweave")
    ax.legend()
    fig.tight_layout()
    fig.savefig(config.metrics.plot, dpi=120)
    plt.close(fig)


def compare(result: Any, config: JobConfig, single_device: Callable[[int, int, str], Any],
            float64_parallel: Any | None = None) -> bool:
    """Train the same steps on this process in float64 (``single_device(micro_batches, last_step,
    dtype)``) and decide, within the float64 strict tolerance: for a float64 run, on the run itself;
    for a run in another dtype, on the same run again in float64 (``float64_parallel``, the ranks'
    :func:`~ndweave_gpt.reference.float64_rerun`), the run's own difference printed beside it. A
    parallel run in fp32 differs from one process by rounding that the trajectory amplifies (a loss
    spike: 1e-4 and more), while in float64 a correct one matches to ~1e-12 and a wrong one does not:
    the float64 pair tells a bug from rounding, which no bound on the fp32 difference does."""
    from ndweave.mesh.testing import STRICT, max_difference

    if not result.losses:
        print("nothing to compare: this run trained no steps")
        return True
    last, dtype = max(result.losses), config.model.dtype
    judged = result if dtype == "float64" else float64_parallel
    if judged is None:
        raise ValueError(f"compare: a {dtype} run is judged by its float64 rerun; pass float64_parallel")
    print(f"single-device reference: {last} steps on one process in float64 ...", flush=True)
    exact = single_device(1, last, "float64")
    steps = sorted(judged.losses)

    def gaps(run, at):
        return [abs(run.losses[s] - exact.losses[s]) for s in at]

    gap, param_gap = gaps(judged, steps), max_difference(judged.params, exact.params)
    bound = STRICT.atol + STRICT.rtol * max(abs(exact.losses[s]) for s in steps)
    again = "" if judged is result else "  the run again in float64"
    for s, g in zip(steps, gap):
        if s == steps[0] or s == steps[-1] or s % max(1, len(steps) // 10) == 0:
            own = f"loss {result.losses[s]:.6f}  " if s in result.losses else " " * 18
            print(f"  step {s:>5}: {own}{again and 'float64 '}{judged.losses[s]:.9f}  one process (float64) "
                  f"{exact.losses[s]:.9f}  |diff| {g:.2e}")
    ok = max(gap) <= bound and param_gap <= bound
    print(f"max |loss difference| {max(gap):.2e}, max |parameter difference| {param_gap:.2e} "
          f"(bound {bound:.1e}, the float64 strict tolerance){'; the run in float64' if again else ''}")
    if judged is not result:
        own = max(gaps(result, sorted(result.losses)))
        print(f"this {dtype} run differs from one process in float64 by {own:.2e} at most: {dtype} rounding, "
              "amplified along the trajectory (not judged)")
    print("PASS: the parallel run matches single-device training" if ok else "FAIL: the runs differ")
    return ok


def sample(text: str) -> None:
    """Print what the trained model wrote (``--sample``)."""
    print("sample:\n" + text)
