"""dtrain.common.launch.torchrun_argv: the one torchrun command line every launcher runs (this machine, SSH
nodes, a Slurm allocation), read back by torchrun's own parser."""

from __future__ import annotations

from dtrain.common.launch import torchrun_argv

HEAD = ["py", "-m", "dtrain.common.launch"]


def test_one_node_on_this_machine() -> None:
    argv = torchrun_argv("py", ["train.py", "--lr", "3"], nproc=2, run_id="r1")
    assert argv == [*HEAD, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", "localhost:0", "--rdzv-id", "r1", "--max-restarts", "0",
                    "train.py", "--lr", "3"]  # fmt: skip


def test_max_restarts() -> None:
    argv = torchrun_argv("py", ["-m", "m"], nproc=1, run_id="r", max_restarts=3)
    assert argv[argv.index("--max-restarts") + 1] == "3" and argv[-2:] == ["-m", "m"]


def test_n_nodes_first_and_other() -> None:
    kw = {"nproc": 4, "run_id": "r2", "nnodes": 3, "master": "10.0.0.1:29400", "join_timeout": 120}
    first = torchrun_argv("py", ["-m", "pkg.train"], is_host=True, local_addr="10.0.0.1", **kw)
    other = torchrun_argv("py", ["-m", "pkg.train"], local_addr="10.0.0.2", **kw)
    assert first == [*HEAD, "--nnodes", "3", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", "10.0.0.1:29400", "--rdzv-id", "r2",
                     "--rdzv-conf", "is_host=1,join_timeout=120", "--local-addr", "10.0.0.1",
                     "--max-restarts", "0", "-m", "pkg.train"]  # fmt: skip
    assert [a for a in other if a not in first] == ["is_host=0,join_timeout=120", "10.0.0.2"]


def test_placeholders_a_slurm_node_fills_in() -> None:
    argv = torchrun_argv("py", [], nproc="__n__", nnodes="__nn__", run_id="r", master="m:1", local_addr="a")
    assert argv[4] == "__nn__" and argv[6] == "__n__"


def test_torchrun_reads_it_as_meant() -> None:
    """torch's own parser (torch is on the node side, as on every node) takes each form as intended."""
    from torch.distributed.run import parse_args

    argv = torchrun_argv("py", ["-m", "pkg.train", "--x"], nproc=2, run_id="r", max_restarts=2, nnodes=2,
                         master="h:5", is_host=True, join_timeout=60, local_addr="h")  # fmt: skip
    args = parse_args(argv[3:])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_endpoint, args.rdzv_id) == ("2", "2", "h:5", "r")
    assert (args.rdzv_conf, args.local_addr, args.max_restarts) == ("is_host=1,join_timeout=60", "h", 2)
    assert args.module and args.training_script == "pkg.train" and args.training_script_args == ["--x"]
    local = parse_args(torchrun_argv("py", ["t.py"], nproc=1, run_id="r")[3:])
    assert local.rdzv_endpoint == "localhost:0" and local.local_addr is None and local.training_script == "t.py"
