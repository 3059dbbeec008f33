"""A tiny language model written for one device, and the pipeline-vs-one-process training loop the
pipeline tests share."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ndweave.mesh.contracts import DataParallelWrapper
from ndweave.mesh.testing import assert_close, measured_tolerance, train_one_process, train_one_process
from ndweave.pipeline import PipeEngine, construct_pipeline_stage

VOCAB, WIDTH, SEQ = 16, 8, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.proj = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(self.norm(x))))


class TinyLM(nn.Module):
    """Token ids -> logits; a stage after the first is handed hidden states (floating point) instead."""

    def __init__(self, num_layers: int = 6, tie: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.drop = nn.Dropout(0.0)
        self.layers = nn.ModuleList([Block() for _ in range(num_layers)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tie:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx if idx.is_floating_point() else self.drop(self.wte(idx))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(num_steps: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, VOCAB, (batch, SEQ), generator=g))
            for _ in range(num_steps)]


def train_reference(model: nn.Module, data, loss=loss_fn, lr: float = 0.05, micro_batches: int = 1):
    """One process, the usual loop: per step the loss and {fqn: grad}; then the final {fqn: param}.
    ``micro_batches > 1``: the same math summed in another order (each step's mean loss and its grads
    accumulated over that many equal micro-batches)."""
    run = train_one_process(model, data, optimizer=lambda params: torch.optim.AdamW(params, lr=lr), loss_fn=loss,
                            micro_batches=micro_batches, keep_grads=True, copy_model=True)
    return [torch.tensor(value) for value in run.losses], run.grads, run.final


def one_process_run(num_layers: int, steps: int, batch: int = 8):
    """float64 (strict parity): a seeded TinyLM with tied embedding / head, its data, and what one
    process makes of them (:func:`train_reference`)."""
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = TinyLM(num_layers=num_layers)
    data = batches(steps, batch)
    return model, data, train_reference(model, data)


def fp32_one_process_run(num_layers: int, steps: int, num_microbatches: int, batch: int = 8):
    """fp32: what :func:`one_process_run` returns, plus the parity bounds (loss, grad, param) measured
    on this machine's kernels from the same training summed in other orders: accumulated over the
    pipeline's ``num_microbatches`` micro-batches and over another count
    (:func:`ndweave.mesh.testing.measured_tolerance`)."""
    torch.manual_seed(0)
    model = TinyLM(num_layers=num_layers)
    data = batches(steps, batch)
    expected = train_reference(model, data)
    others = [train_reference(model, data, micro_batches=k) for k in (num_microbatches, 2 * num_microbatches)]
    flat = [_flat_grads(run[1]) for run in (expected, *others)]
    tols = (measured_tolerance(expected[0], *(run[0] for run in others)),
            measured_tolerance(flat[0], *flat[1:]),
            measured_tolerance(expected[2], *(run[2] for run in others)))
    return model, data, expected, tols


def _flat_grads(grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"{fqn} step {step}": g for step, step_grads in enumerate(grads) for fqn, g in step_grads.items()}


def train_pipeline(model: nn.Module, plan, mesh, data, *, wrap=None, loss=loss_fn, lr: float = 0.05,
                   data_parallel=None, example_inputs=None):
    """The same loop through ``PipeEngine``; ``wrap(chunk)`` wraps each chunk (e.g. for DP) and
    ``data_parallel`` (the DP ``DeviceMesh``) picks this DP rank's slice of every batch;
    ``example_inputs``: trace the model (see ``construct_pipeline_stage``). Returns what
    :func:`train_reference` does (the loss averaged over DP; grads and params of this rank's chunks)."""
    module = construct_pipeline_stage(copy.deepcopy(model), plan, mesh,  # chunks share the model's layers
                                      example_inputs=example_inputs)
    for i in range(len(module)):
        module[i] = wrap(module[i]) if wrap else module[i]
    engine = PipeEngine(module, mesh, loss, plan)
    opt = torch.optim.AdamW(module.parameters(), lr=lr)
    rank, size = (data_parallel.get_local_rank(), data_parallel.size()) if data_parallel is not None else (0, 1)
    losses, grads = [], []
    for x, y in data:
        opt.zero_grad()
        for chunk in module:
            if isinstance(chunk, DataParallelWrapper):
                chunk.zero_grad_buffer()
        n = x.shape[0] // size
        value = engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        if size > 1:
            dist.all_reduce(value, group=data_parallel.get_group())
            value /= size
        losses.append(value)
        grads.append({_fqn(n): p.grad.clone() for n, p in module.named_parameters(remove_duplicate=False)})
        opt.step()
    return losses, grads, {_fqn(n): p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}


def _fqn(name: str) -> str:
    return name.removeprefix("module.")  # ReferenceDataParallel's names (ndweave's DDP keeps the model's)


def assert_same_training(actual, expected, what: str, tols=(None, None, None)) -> None:
    """Every loss, every grad of every step and every final parameter this rank holds, vs one process
    (float64 strict, or fp32 within the (loss, grad, param) bounds of :func:`fp32_one_process_run`)."""
    losses, grads, params = actual
    ref_losses, ref_grads, ref_params = expected
    loss_tol, grad_tol, param_tol = tols
    assert params, f"{what}: this rank holds no parameters"
    for step, (loss, ref_loss) in enumerate(zip(losses, ref_losses, strict=True)):
        assert_close(loss, ref_loss, name=f"{what}: loss of step {step}", tol=loss_tol)
        for fqn, grad in grads[step].items():
            assert_close(grad, ref_grads[step][fqn], name=f"{what}: grad {fqn} step {step}", tol=grad_tol)
    for fqn, param in params.items():
        assert_close(param, ref_params[fqn], name=f"{what}: param {fqn}", tol=param_tol)
