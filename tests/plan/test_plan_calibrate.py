"""``ndweave.plan.calibrate``: the machine's rates, measured once, saved and reused; and the counter of
what a program asks of them.

Nothing here depends on how fast this machine is: the measurement gives positive, finite numbers and
lands in the cache, a second call reads the cache instead of measuring, ``refresh=True`` measures
again, a dtype not measured yet is added; the counter's FLOPs are the textbook ones, per rank under
tensor parallelism, and it sees the collectives DTensor issues.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from ndweave.plan import calibrate as calibration
from ndweave.plan.calibrate import Machine, calibrate, collective_seconds
from ndweave.plan.work import Work, WorkCounter
from ndweave.mesh import fake_world


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[Machine, object]:
    """One real measurement (a few seconds), shared by the tests that need it."""
    path = tmp_path_factory.mktemp("cache") / "machine.json"
    return calibrate("cpu", path=path), path


def test_a_measurement_is_sane_and_saved(measured):
    machine, path = measured
    numbers = [machine.matmul_flops["float32"], machine.memory_bandwidth, machine.op_overhead_s,
               machine.dtensor_op_overhead_s, machine.link_bandwidth, machine.link_latency_s]
    print(machine)
    assert all(math.isfinite(x) and x > 0 for x in numbers), machine
    assert machine.concurrent_ranks >= 1 and machine.device_type == "cpu" and machine.torch_version == torch.__version__
    saved = json.loads(path.read_text())
    assert list(saved) == [f"cpu: {machine.device_name}"]
    assert Machine.from_json(saved[f"cpu: {machine.device_name}"]) == machine


def test_a_second_call_reuses_the_saved_measurement(measured, monkeypatch):
    machine, path = measured
    monkeypatch.setattr(calibration, "_measure", _never)
    assert calibrate("cpu", path=path) == machine


def test_refresh_measures_again_and_replaces_only_this_device(tmp_path, monkeypatch):
    path = tmp_path / "machine.json"
    other = {"cuda: Some GPU": {"kept": True}}
    path.write_text(json.dumps(other))
    monkeypatch.setattr(calibration, "_measure", lambda device, name, dtypes: _fake(name, 1.0))
    first = calibrate("cpu", path=path)
    monkeypatch.setattr(calibration, "_measure", _never)
    assert calibrate("cpu", path=path) == first
    monkeypatch.setattr(calibration, "_measure", lambda device, name, dtypes: _fake(name, 2.0))
    again = calibrate("cpu", path=path, refresh=True)
    assert again.matmul_flops["float32"] == 2.0 and calibrate("cpu", path=path) == again
    saved = json.loads(path.read_text())
    assert saved["cuda: Some GPU"] == {"kept": True} and len(saved) == 2


def test_a_dtype_not_measured_yet_is_measured_and_added(tmp_path, monkeypatch):
    path = tmp_path / "machine.json"
    monkeypatch.setattr(calibration, "_measure", lambda device, name, dtypes: _fake(name, 1.0))
    calibrate("cpu", path=path)
    asked = []
    monkeypatch.setattr(calibration, "_measure", _never)
    monkeypatch.setattr(calibration, "_matmul_rates",
                        lambda device, dtypes: asked.append(dtypes) or {d: 3.0 for d in dtypes})
    machine = calibrate("cpu", dtypes=[torch.float32, torch.float64], path=path)
    assert asked == [["float64"]] and machine.matmul_flops == {"float32": 1.0, "float64": 3.0}
    assert calibrate("cpu", dtypes=[torch.float64], path=path) == machine
    with pytest.raises(KeyError, match=r"no matmul rate for bfloat16 .*calibrate\(\.\.\., dtypes=\[torch.bfloat16\]\)"):
        machine.matmul_seconds(1.0, torch.bfloat16)


def test_a_missing_or_unreadable_cache_is_measured_into_place(tmp_path, monkeypatch):
    path = tmp_path / "deeper" / "machine.json"
    monkeypatch.setattr(calibration, "_measure", lambda device, name, dtypes: _fake(name, 1.0))
    calibrate("cpu", path=path)
    path.write_text("{ not json")
    assert calibrate("cpu", path=path).matmul_flops == {"float32": 1.0}
    with pytest.raises(ValueError, match="device_type must be 'cpu' or 'cuda'"):
        calibrate("tpu", path=path)


def test_collectives_cost_what_their_algorithms_move():
    bw, lat = 1e9, 1e-5
    assert collective_seconds("all_reduce", 8e6, 1, bw, lat) == 0.0
    assert collective_seconds("all_gather", 8e6, 4, bw, lat) == pytest.approx(3 / 4 * 8e6 / bw + 3 * lat)  # a ring
    # halving-doubling: the ring's bytes twice (reduce-scatter, all-gather), log2(n) rounds each
    assert collective_seconds("all_reduce", 8e6, 8, bw, 0.0) == pytest.approx(
        collective_seconds("reduce_scatter", 8e6, 8, bw, 0.0) + collective_seconds("all_gather", 8e6, 8, bw, 0.0))
    assert collective_seconds("all_reduce", 0, 8, bw, lat) == pytest.approx(2 * 3 * lat)
    assert collective_seconds("all_reduce", 0, 5, bw, lat) == pytest.approx(2 * 3 * lat)  # rounds up
    assert collective_seconds("broadcast", 8e6, 4, bw, lat) == pytest.approx(2 * (lat + 8e6 / bw))
    assert collective_seconds("send", 8e6, 2, bw, lat) == pytest.approx(8e6 / bw + lat)
    with pytest.raises(ValueError, match="unknown collective 'gossip'"):
        collective_seconds("gossip", 1, 2, bw, lat)


def test_a_machine_turns_work_into_seconds():
    machine = _fake("cpu", 1e9)
    work = Work(ops=10, dtensor_ops=2, flops=2e9, bytes=1e9, collectives=[("all_reduce", 1e6, "tp")])
    plain = 2 + 1e9 / machine.memory_bandwidth + 10 * machine.op_overhead_s
    assert machine.compute_seconds(work, torch.float32) == pytest.approx(plain)
    # a tensor-parallel program's every op also pays DTensor's overhead
    assert machine.compute_seconds(work, "float32", tensor_parallel=True) == pytest.approx(
        plain + 10 * machine.dtensor_op_overhead_s)
    # a GPU's kernels run while the host launches the next: the slower of the two
    gpu = dataclasses.replace(machine, device_type="cuda")
    assert gpu.compute_seconds(work, torch.float32) == pytest.approx(2 + 1e9 / machine.memory_bandwidth)
    assert gpu.compute_seconds(Work(ops=10), torch.float32) == pytest.approx(10 * machine.op_overhead_s)
    assert machine.communication_seconds(work, {"tp": 2}) == pytest.approx(
        machine.collective_seconds("all_reduce", 1e6, 2))
    with pytest.raises(KeyError, match="group 'tp', whose size was not given"):
        machine.communication_seconds(work, {})
    assert (work + work).ops == 20 and (work + work).collectives == work.collectives * 2


def test_a_group_within_one_host_crosses_the_hosts_link():
    network = dataclasses.replace(_fake("cuda", 1.0), concurrent_ranks=8)
    machine = dataclasses.replace(network, host_link_bandwidth=network.link_bandwidth * 10,
                                  host_link_latency_s=network.link_latency_s / 10)
    assert machine.within_host({"PP": 4, "DP": 2, "TP": 8}) == {"TP"}
    assert machine.within_host({"PP": 4, "DP": 2, "TP": 4}) == {"DP", "TP"}
    assert machine.within_host({"PP": 1, "DP": 3, "TP": 1}) == {"TP"}  # 3 ranks straddle hosts of 8
    work = Work(collectives=[("all_gather", 8e6, "TP"), ("reduce_scatter", 8e6, "DP")])
    assert machine.communication_seconds(work, {"TP": 8, "DP": 2}, within_host={"TP"}) == pytest.approx(
        collective_seconds("all_gather", 8e6, 8, machine.link_bandwidth * 10, machine.link_latency_s / 10)
        + collective_seconds("reduce_scatter", 8e6, 2, machine.link_bandwidth, machine.link_latency_s))
    # without a host link of its own (what calibrate measures), the same link either way
    assert network.communication_seconds(work, {"TP": 8, "DP": 2}, within_host={"TP", "DP"}) == \
        network.communication_seconds(work, {"TP": 8, "DP": 2})


def test_the_counter_counts_a_linear_layers_flops_forward_and_backward_on_meta():
    m, k, n = 16, 32, 64
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(k, n, bias=False), nn.ReLU())
        x = torch.zeros(m, k, requires_grad=True)
    with WorkCounter() as counter:
        counter.region("block")
        model(x).sum().backward()
    work = counter.work["block"]
    assert work.forward.flops == 2 * m * k * n and work.backward.flops == 2 * (2 * m * k * n)  # dX and dW
    assert work.forward.ops > 0 and work.backward.ops > 0 and work.forward.bytes > 0
    assert work.forward.dtensor_ops == 0 and not work.forward.collectives


def test_the_counter_counts_each_ranks_share_under_tensor_parallelism():
    """A column- then row-parallel MLP over a fake world of 2 on meta: half the FLOPs per rank, the
    ops counted as DTensor ops too, and the row-parallel output's all-reduce, forward and backward
    (the column-parallel input's grad)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from ndweave.mesh import init_device_mesh

    m, width = 8, 16
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("TPcalibrate",))["TPcalibrate"]
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(width, 4 * width, bias=False), nn.Linear(4 * width, width, bias=False))
            x = torch.zeros(m, width, requires_grad=True)
        model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
        with WorkCounter() as counter:
            model(x).sum().backward()
        group = mesh.get_group().group_name
    work = counter.work["all"]
    whole = 2 * (2 * m * width * 4 * width)  # both layers' forward FLOPs on one process
    assert work.forward.flops == whole / 2 and work.backward.flops == whole  # the backward's dX and dW, halved
    assert work.forward.dtensor_ops > 0
    assert [(kind, nbytes, g) for kind, nbytes, g in work.forward.collectives] == [("all_reduce", m * width * 4, group)]
    assert ("all_reduce", m * width * 4, group) in work.backward.collectives


def _fake(name: str, rate: float) -> Machine:
    return Machine("cpu", name, {"float32": rate}, 1e10, 1e-5, 5e-5, 1e9, 1e-4, 2, torch.__version__, "now")


def _never(*args, **kwargs):
    raise AssertionError("measured again: the cache was not used")


def test_a_machine_is_a_frozen_dataclass_with_a_docstring_per_field():
    import ast
    import inspect

    source = ast.parse(inspect.getsource(Machine))
    documented = {node.target.id for body in [source.body[0].body] for node, after in zip(body, body[1:])
                  if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)}
    assert documented == {f.name for f in dataclasses.fields(Machine)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        _fake("cpu", 1.0).link_bandwidth = 2.0
