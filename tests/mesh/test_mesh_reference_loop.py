"""``train_one_process``: the one single-process loop parity is checked against is the seeds' loop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ndweave.mesh.testing import assert_close, train_one_process


def _data(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g, dtype=dtype), torch.randn(8, 2, generator=g, dtype=dtype))
            for _ in range(3)]


def _model(dtype=torch.float64):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dtype)


def test_it_is_the_seeds_loop():
    model, data = _model(), _data()
    run = train_one_process(model, data, optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.1), loss_fn=F.mse_loss,
                            clip=0.5, keep_grads=True, keep_params="every", copy_model=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        for n, p in model.named_parameters():
            assert_close(run.grads[step][n], p.grad, name=f"grad of {n}, step {step}")
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        assert run.losses[step] == loss.item()
        for n, p in model.named_parameters():
            assert_close(run.params[step][n], p, name=f"{n} after step {step}")
    assert run.final is run.params[-1]


def test_micro_batches_are_the_same_math_summed_otherwise():
    whole = train_one_process(_model(), _data(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), loss_fn=F.mse_loss)
    parts = train_one_process(_model(), _data(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), loss_fn=F.mse_loss,
                              micro_batches=4)
    for n, p in whole.final.items():
        assert_close(parts.final[n], p, name=n)
    losses = [torch.tensor(run.losses, dtype=torch.float64) for run in (parts, whole)]
    assert_close(*losses, name="losses")


class _TwoInputs(torch.nn.Module):
    """A model of keyword (or positional) inputs, as a pipeline stage of a packed batch takes them."""

    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, a, b):
        return self.net(a) * b


@pytest.mark.parametrize("form", ["dict", "tuple"])
def test_inputs_as_a_dict_or_tuple_are_split_alike(form):
    g = torch.Generator().manual_seed(1)
    data = [({"a": x, "b": torch.rand(8, 1, generator=g, dtype=torch.float64)}, y) for x, y in _data()]
    if form == "tuple":
        data = [((x["a"], x["b"]), y) for x, y in data]
    runs = [train_one_process(_TwoInputs(), data, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                              loss_fn=F.mse_loss, micro_batches=k) for k in (1, 4)]
    model = _TwoInputs()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(model(**x) if form == "dict" else model(*x), y).backward()
        opt.step()
    for run in runs:
        for n, p in model.named_parameters():
            assert_close(run.final[n], p, name=n)


def test_low_precision_params_get_fp32_masters():
    model = _model(torch.bfloat16)
    run = train_one_process(model, _data(torch.bfloat16), optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3),
                            loss_fn=F.mse_loss, fp32_masters=True)
    # steps of 1e-3 x grad are below bf16's resolution for most weights: with no masters they vanish
    plain = train_one_process(_model(torch.bfloat16), _data(torch.bfloat16),
                              optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3), loss_fn=F.mse_loss)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert any(not torch.equal(run.final[n], plain.final[n]) for n in run.final)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="loss_fn.*or model_loss"):
        train_one_process(_model(), _data(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    model = _model()
    with pytest.raises(ValueError, match="copy_model=True.*function of the params"):
        train_one_process(model, _data(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=F.mse_loss, copy_model=True)
