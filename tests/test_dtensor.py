"""Optimizers over DTensor parameters (torch's FSDP2, ``distribute_tensor``), on one gloo
rank of the CPU. Their history is a DTensor, whose own dispatch opttree cannot tell zeroes
exactly: a reset in place is refused, and ``release=True``, which deletes the entries for
the optimizer to build anew, trains as a fresh optimizer."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import opttree
from opttree.testing._megatron import ensure_process_group


@pytest.fixture(scope="module")
def mesh() -> DeviceMesh:
    ensure_process_group()
    return init_device_mesh("cpu", (1,))


def sharded_linear(mesh: DeviceMesh) -> torch.nn.Linear:
    net = torch.nn.Linear(4, 4)
    with torch.no_grad():
        net.weight.copy_(torch.linspace(-1, 1, 16).view(4, 4))
        net.bias.copy_(torch.linspace(-0.5, 0.5, 4))
    for name in ("weight", "bias"):
        setattr(net, name, torch.nn.Parameter(distribute_tensor(getattr(net, name).detach(), mesh, [Shard(0)])))
    return net


def train(net: torch.nn.Linear, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, start: int, steps: int) -> None:
    for seed in range(start, start + steps):
        batch = distribute_tensor(torch.randn(2, 4, generator=torch.Generator().manual_seed(seed)), mesh, [Replicate()])
        optimizer.zero_grad()
        torch.autograd.backward(net(batch).pow(2).sum())
        optimizer.step()


def local_weights(net: torch.nn.Module) -> list[torch.Tensor]:
    return [param.to_local() if isinstance(param, DTensor) else param for param in net.parameters()]


def trains_as_fresh(net: torch.nn.Linear, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, start: int) -> bool:
    twin = sharded_linear(mesh)
    with torch.no_grad():
        for mine, theirs in zip(local_weights(twin), local_weights(net), strict=True):
            mine.copy_(theirs)
    train(net, optimizer, mesh, start, 3)
    train(twin, torch.optim.AdamW(twin.parameters(), lr=0.1), mesh, start, 3)
    return all(map(torch.equal, local_weights(net), local_weights(twin)))


def test_dtensor_history_is_refused_in_place_and_released_exactly(mesh: DeviceMesh) -> None:
    """FSDP2's state: the refusal names ``release=True``, which is exact."""
    net = sharded_linear(mesh)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    train(net, optimizer, mesh, 0, 2)
    before = [value.to_local().clone() for entry in optimizer.state.values() for value in entry.values() if isinstance(value, DTensor)]

    with pytest.raises(opttree.UnsupportedOptimizerState, match=r"a DTensor \(a tensor subclass with its own dispatch.*a reset with release=True"):
        opttree.reset(optimizer)
    after = [value.to_local() for entry in optimizer.state.values() for value in entry.values() if isinstance(value, DTensor)]
    assert len(after) == len(before) == 4 and all(map(torch.equal, after, before))

    assert opttree.reset(optimizer, release=True).entries_released == 2
    assert trains_as_fresh(net, optimizer, mesh, 2)


def test_plain_history_of_dtensor_parameters_is_refused(mesh: DeviceMesh) -> None:
    """A plain checkpoint loaded into a sharded stack leaves plain history under DTensor
    parameters, on which the next step fails: such a reset was reported done, and the
    step after it failed where a fresh optimizer trains. Refused, naming the way out,
    which trains as a fresh optimizer."""
    plain = torch.nn.Linear(4, 4)
    source = torch.optim.AdamW(plain.parameters(), lr=0.1)
    torch.autograd.backward(plain(torch.randn(2, 4)).sum())
    source.step()
    net = sharded_linear(mesh)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    optimizer.load_state_dict(copy.deepcopy(source.state_dict()))

    problems = opttree.validate(optimizer)

    assert [(p.kind, p.key) for p in problems] == [(opttree.ProblemKind.UNSUPPORTED_STATE, "exp_avg"), (opttree.ProblemKind.UNSUPPORTED_STATE, "exp_avg_sq")]
    assert "history of 2 DTensor parameter(s) is a plain tensor, where the optimizer builds it as a DTensor" in problems[0].message
    with pytest.raises(opttree.UnsupportedOptimizerState, match="reset with release=True"):
        opttree.reset(optimizer)
    opttree.reset(optimizer, release=True)
    assert trains_as_fresh(net, optimizer, mesh, 0)


def test_describe_counts_the_bytes_this_rank_holds_of_dtensor_history(mesh: DeviceMesh) -> None:
    """A DTensor's ``nbytes`` is its global size: ``describe`` counted a shard of 256 KiB
    as 512 KiB on each of two ranks, where ``release`` reported 256 KiB. It counts the local
    shard, here a half of a global shape this rank is told of (one rank stands for two)."""
    net = sharded_linear(mesh)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    train(net, optimizer, mesh, 0, 1)
    for entry in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            local = torch.zeros(256, 64)
            entry[key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((512, 64)), stride=(64, 1))
            assert entry[key].nbytes == 2 * local.nbytes

    text = opttree.describe(optimizer)

    assert "state=256.0 KiB [float32@cpu 256.0 KiB]" in text, text  # 4 shards of 64 KiB; steps are plain 0-d tensors of 4 B each, too few to show
