"""Distributed init in-process: a one-rank gloo group built from torchrun's variables, torn down on
errors too; and what is read from the environment."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from dtrain.common.config import Backend
from dtrain.common.dist import distributed, pick_backend
from dtrain.common.env import LaunchEnv
from dtrain.common.errors import UserError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_rank(monkeypatch):
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "GLOO_SOCKET_IFNAME": "lo",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def test_without_torchrun_it_is_one_process_with_no_group(monkeypatch):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with distributed() as d:
        assert (d.rank, d.world_size, d.backend, d.is_main) == (0, 1, None, True)
        assert d.any(True) and not d.any(False)
        assert d.gather({"a": 1}) == [{"a": 1}]
    assert not dist.is_initialized()


def test_under_torchrun_variables_it_joins_a_gloo_group_and_learns_its_peers(one_rank):
    with distributed(timeout_s=30) as d:
        assert dist.is_initialized() and d.backend == "gloo" and d.device.type == "cpu"
        assert [(p.rank, p.host) for p in d.peers] == [(0, socket.gethostname())]
        assert d.env.socket_ifnames == {"GLOO_SOCKET_IFNAME": "lo"}
        assert d.all_mean(torch.tensor([4.0])).item() == 4.0
        d.barrier("test")
    assert not dist.is_initialized()


def test_the_group_is_destroyed_when_training_raises(one_rank):
    with pytest.raises(RuntimeError, match="boom"), distributed(timeout_s=30):
        assert dist.is_initialized()
        raise RuntimeError("boom")
    assert not dist.is_initialized()


def test_backend_choice():
    cpu = torch.device("cpu")
    assert pick_backend(Backend.AUTO, cpu) == "gloo"
    assert pick_backend(Backend.GLOO, cpu) == "gloo"
    with pytest.raises(UserError, match="nccl needs CUDA GPUs"):
        pick_backend(Backend.NCCL, cpu)
    assert pick_backend(Backend.AUTO, torch.device("cuda", 0)) == "nccl"


def test_launch_env_reads_torchrun_variables():
    e = LaunchEnv.read(
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.2",
            "MASTER_PORT": "29400",
            "TORCHELASTIC_RUN_ID": "mnist-x",
            "NCCL_SOCKET_IFNAME": "ens4",
        }
    )
    assert (e.rank, e.local_rank, e.world_size, e.local_world_size) == (3, 1, 4, 2)
    assert (e.master_addr, e.master_port, e.run_id, e.under_launcher) == ("10.0.0.2", 29400, "mnist-x", True)
    assert e.socket_ifnames == {"NCCL_SOCKET_IFNAME": "ens4"}
    assert not LaunchEnv.read({}).under_launcher
