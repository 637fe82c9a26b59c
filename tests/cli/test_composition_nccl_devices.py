"""NCCL's device rule on every composition smoke set, checked on CPU with gloo.

NCCL takes CUDA tensors only: a host tensor (a flag, a loss or token sum, a digest buffer) handed
to a collective fails on the first GPU run. tests/comm_device_check.py follows each tensor's
would-be device under `pretend_nccl()` and wraps torch.distributed's tensor calls; here every
smoke set of tests/cli/test_composition.py is built and trained for 2 iterations under it (~1 min
on 2 loaded cores), and a deliberately wrong call proves the checker catches a host scalar.
"""
import pytest
import torch
import torch.distributed as dist

from megatron.core.comm_device import comm_device, comm_tensor, to_comm
from tests.cli.composition_checks import train_groups, write_multitask_data
from tests.cli.test_composition import SMOKE_GROUPS, SMOKE_IDS, SMOKE_WORLD
from tests.cli.test_composition_t5 import SMOKE_GROUPS as T5_GROUPS, SMOKE_IDS as T5_IDS
from tests.comm_device_check import nccl_device_rule
from tests.dist_harness import run_distributed


def _calls(rank, world):
    """A host scalar on a (pretend) NCCL group is caught, in each way code makes one; tensors made
    with comm_device / comm_tensor / to_comm, and model-derived ones, pass."""
    found = {}
    model = torch.nn.Linear(3, 3)
    for name, call in [
        ("host_scalar", lambda: dist.all_reduce(torch.tensor([1.0]))),
        ("cpu_copy", lambda: dist.all_reduce(model.weight.detach().sum().cpu())),
        ("from_host", lambda: dist.all_reduce(torch.tensor([2.0]).double() * 3)),
        ("host_broadcast", lambda: dist.broadcast(torch.zeros(2, dtype=torch.int64), 0)),
        ("host_p2p", lambda: dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, torch.ones(2), (rank + 1) % world),
             dist.P2POp(dist.irecv, torch.empty(2), (rank - 1) % world)])),
        ("comm_tensor", lambda: dist.all_reduce(comm_tensor([1.0]))),
        ("comm_device", lambda: dist.all_reduce(torch.zeros(2, device=comm_device()))),
        ("to_comm", lambda: dist.all_reduce(to_comm(torch.tensor([1.0])))),
        ("model_grad", lambda: dist.all_reduce(model(torch.ones(2, 3, device=comm_device())).sum().reshape(1))),
    ]:
        v = []
        with nccl_device_rule(v):
            out = call()
            for w in (out if isinstance(out, list) else []):
                w.wait()
        found[name] = v
    return found


def test_checker_catches_a_host_tensor_on_an_nccl_group():
    found = run_distributed(_calls, 2)[0]
    for bad in ("host_scalar", "cpu_copy", "from_host", "host_broadcast", "host_p2p"):
        assert found[bad], f"{bad}: not caught"
        assert "host tensor" in found[bad][0] and "test_composition_nccl_devices.py" in found[bad][0], found[bad]
    for good in ("comm_tensor", "comm_device", "to_comm", "model_grad"):
        assert found[good] == [], (good, found[good])


def _runs(tmp_path_factory, model, groups):
    import json

    from megatron.cli import composition as C
    d = tmp_path_factory.mktemp(f"nccl_rule_{model}")
    with open(d / f"aceso_{model}.json", "w") as f:
        json.dump(C.aceso_config(SMOKE_WORLD, model), f)
    data = write_multitask_data(d)
    return run_distributed(train_groups, SMOKE_WORLD, groups, str(d), data, model, nccl_rule=True, timeout_s=400.0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _runs(tmp_path_factory, "gpt", SMOKE_GROUPS)


@pytest.fixture(scope="module")
def t5_runs(tmp_path_factory):
    return _runs(tmp_path_factory, "t5", T5_GROUPS)


def _check(group, runs):
    bad = [f"rank {r}: {v}" for r, o in enumerate(runs) for v in o[group]]
    assert not bad, f"{group}: host tensors handed to torch.distributed:\n" + "\n".join(bad)


@pytest.mark.parametrize("group", SMOKE_GROUPS, ids=SMOKE_IDS)
def test_smoke_set_keeps_the_nccl_device_rule(group, runs):
    _check(group, runs)


@pytest.mark.parametrize("group", T5_GROUPS, ids=T5_IDS)
def test_t5_smoke_set_keeps_the_nccl_device_rule(group, t5_runs):
    _check(group, t5_runs)
