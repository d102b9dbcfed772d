"""Distributed init in-process: a one-rank gloo group built from torchrun's variables, torn down on
errors too; and what is read from the environment."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from runs import free_port, rank_env, run_ranks

from dtrain.common.config import Backend
from dtrain.common.dist import distributed, pick_backend
from dtrain.common.env import LaunchEnv
from dtrain.common.errors import UserError


@pytest.fixture
def one_rank(monkeypatch):
    for k, v in rank_env(0, 1, free_port()).items():
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


NODE_FIRST_SCRIPT = """
import json, os, sys, time
from pathlib import Path
from dtrain.common.dist import distributed
from dtrain.common.errors import UserError

cache = Path(sys.argv[1]) / os.environ["NODE"]  # one cache per node, as HF_HOME is

def fetch():
    if os.environ["LOCAL_RANK"] == "0":  # the node's first rank downloads, slowly
        time.sleep(float(os.environ["DOWNLOAD_S"]))
        if os.environ.get("FAIL"):
            raise UserError("model 'x/y' is not on the hub")
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "weights").write_text(f"written by rank {os.environ['RANK']}")
    return (cache / "weights").read_text()  # the others only read the node's cache

try:
    with distributed(timeout_s=3) as d:  # a 3 s collective timeout
        got = d.node_first("model download", fetch, timeout=60)
        d.barrier("after")  # and the group still works
    print(json.dumps({"got": got}))
except UserError as e:
    print(json.dumps({"error": str(e), "code": int(e.exit_code)}))
"""


def node_first_job(tmp_path, ranks: list[dict[str, str]]) -> list[dict]:
    script = tmp_path / "job.py"
    script.write_text(NODE_FIRST_SCRIPT)
    return run_ranks(script, ranks, str(tmp_path / "cache"))


def test_a_slow_download_on_one_node_does_not_time_the_others_out(tmp_path):
    """Two nodes of one rank each: node b's download takes 5 s, node a's none; node a waits past the
    3 s collective timeout, at the download's own barrier (with a 3 s one there, this job fails), and
    both read their own node's files."""
    got = node_first_job(tmp_path, [dict(NODE="a", LOCAL_RANK="0", DOWNLOAD_S="0"),
                                    dict(NODE="b", LOCAL_RANK="0", DOWNLOAD_S="5")])  # fmt: skip
    assert got == [{"got": "written by rank 0"}, {"got": "written by rank 1"}]


def test_the_other_ranks_of_a_node_read_what_its_first_rank_downloaded(tmp_path):
    got = node_first_job(tmp_path, [dict(NODE="a", LOCAL_RANK="0", DOWNLOAD_S="2"),
                                    dict(NODE="a", LOCAL_RANK="1", DOWNLOAD_S="0")])  # fmt: skip
    assert got == [{"got": "written by rank 0"}] * 2  # rank 1 downloaded nothing, and waited for it


def test_a_failed_download_fails_every_rank_with_its_message(tmp_path):
    got = node_first_job(tmp_path, [dict(NODE="a", LOCAL_RANK="0", DOWNLOAD_S="0"),
                                    dict(NODE="b", LOCAL_RANK="0", DOWNLOAD_S="0", FAIL="1")])  # fmt: skip
    assert got == [{"error": "model 'x/y' is not on the hub", "code": 2}] * 2
