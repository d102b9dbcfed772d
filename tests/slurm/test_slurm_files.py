"""What dtrain writes for Slurm and how it reads Slurm, without a cluster: the batch script, the job spec's
placeholders as a node fills them in, slurm.conf from probed nodes, the cluster tables, and Slurm's own
output (lines captured from Debian 12's slurm-wlm 22.05 on the test bed) parsed into job states."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from dtrain.common import slurmstep
from dtrain.common.errors import UserError
from dtrain.control.backends import get
from dtrain.control.cluster import Cluster, Node
from dtrain.control.settings import ClusterConfig
from dtrain.control.slurm import commands, script, setup
from dtrain.control.slurm.spec import SlurmSpec

SCONTROL_JOB = (
    "JobId=1 JobName=j1 UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 Account=(null) "
    "QOS=(null) JobState=COMPLETED Reason=None Dependency=(null) Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 "
    "ExitCode=0:0 RunTime=00:00:30 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-11-24T00:40:50 "
    "EligibleTime=2026-11-24T00:41:01 AccrueTime=2026-11-24T00:41:01 StartTime=2026-11-24T00:42:16 "
    "EndTime=2026-11-24T00:42:46 Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-24T00:42:16 "
    "Scheduler=Main Partition=dtrain AllocNode:Sid=h0:14485 ReqNodeList=(null) ExcNodeList=(null) NodeList=h[0-1] "
    "BatchHost=h0 NumNodes=2 NumCPUs=4 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=4,node=2,billing=4 "
    "Socks/Node=* NtasksPerN:B:S:C=1:0:*:* CoreSpec=* Command=/tmp/shared/job.sh WorkDir=/tmp/shared "
    "StdErr=/tmp/shared/out-1.txt StdIn=/dev/null StdOut=/tmp/shared/out-1.txt Power="
)
PENDING_JOB = (
    "JobId=3 JobName=j3 JobState=PENDING Reason=Nodes_required_for_job_are_DOWN,_DRAINED_or_reserved Requeue=1 "
    "Restarts=0 ExitCode=0:0 RunTime=00:00:00 SubmitTime=2026-11-24T00:40:12 StartTime=Unknown EndTime=Unknown "
    "NodeList=(null) NumNodes=2-2"
)
# `sacct -c -P -n -o` COMPLETION_FIELDS: a job that ran, lost a node and ran again; one that failed.
COMPLETION = """1|j1|NODE_FAIL|0:0|2026-11-24T00:40:13|2026-11-24T00:40:50|2|h[0-1]
1|j1|COMPLETED|0:0|2026-11-24T00:42:16|2026-11-24T00:42:46|2|h[0-1]
4|mnist|FAILED|2:0|2026-11-24T01:05:13|2026-11-24T01:05:30|2|h[0-1]
"""
SINFO = "dtrain*|h0|2|(null)|idle\ndtrain*|h1|2|gpu:2|down*\ngpu|g0|64|gpu:a100:4(S:0-1)|mix\n"


def test_scontrol_job_line() -> None:
    job = commands.job_from_scontrol(commands.parse_kv(SCONTROL_JOB))
    assert (job.job_id, job.name, job.state, job.restarts, job.exit_code) == ("1", "j1", "COMPLETED", 1, 0)
    assert (job.started, job.ended, job.elapsed, job.nodes, job.nodelist) == (
        "2026-11-24T00:42:16", "2026-11-24T00:42:46", "00:00:30", 2, "h[0-1]"
    )  # fmt: skip
    assert job.settled and not job.active
    pending = commands.job_from_scontrol(commands.parse_kv(PENDING_JOB))
    assert pending.active and pending.reason.startswith("Nodes_required") and pending.started == ""
    assert pending.exit_code is None and pending.nodes == 2


def test_sacct_records_count_restarts_and_keep_the_last_ending() -> None:
    jobs = commands.jobs_from_sacct(COMPLETION, completion=True)
    assert jobs["1"].state == "COMPLETED" and jobs["1"].restarts == 1 and jobs["1"].elapsed == "00:00:30"
    assert jobs["4"].state == "FAILED" and jobs["4"].exit_code == 2 and jobs["4"].restarts == 0
    steps = "7|mnist|CANCELLED by 0|0:15|2026-11-24T01:00:00|2026-11-24T01:00:01|2026-11-24T01:00:09|00:00:08|1|h0\n"
    dbd = commands.jobs_from_sacct(steps + steps.replace("7|", "7.batch|"), completion=False)
    assert list(dbd) == ["7"] and dbd["7"].state == "CANCELLED" and dbd["7"].exit_code == 128 + 15


def test_sinfo_nodes_and_default_partition() -> None:
    rows, default = commands.parse_nodes(SINFO)
    assert default == "dtrain"
    assert [(n.name, n.partition, n.cpus, n.gpus, n.up) for n in rows] == [
        ("h0", "dtrain", 2, 0, True), ("h1", "dtrain", 2, 2, False), ("g0", "gpu", 64, 4, True)
    ]  # fmt: skip


def test_a_job_code_from_its_nodes() -> None:
    assert slurmstep.job_code({"h0": 0, "h1": 0}) == 0
    assert slurmstep.job_code({"h0": 3, "h1": 3}) == 3  # preempted: requeued
    assert slurmstep.job_code({"h0": 1, "h1": 3}) == 1  # a failure wins: not requeued
    assert slurmstep.job_code({"h0": 2, "h1": 0}) == 2
    assert slurmstep.job_code({"h0": 0, "h1": 137}) == 1  # killed: a failure


def cluster(tmp_path: Path, *, managed: bool, image: str = "") -> Cluster:
    nodes = (Node(name="n0", address="10.0.0.10", master=True, python="/opt/py/bin/python", gpus=1),
             Node(name="n1", address="10.0.0.11", python="/opt/py/bin/python", gpus=1))  # fmt: skip
    spec = SlurmSpec(login=nodes[0], managed=managed, partition="gpu", account="proj", time="1:00:00")
    return Cluster(name="c", backend="hosts", nodes=nodes, launcher="slurm", slurm=spec, image=image,
                   env={"NCCL_DEBUG": "WARN"}, known_hosts=tmp_path / "kh")  # fmt: skip


RUN_ID = "mnist-20260101-000000-abcd"


def files(c: Cluster, *, resumed: bool = False, nodes: int = 2, time: str = "", **plan: Any) -> script.BatchFiles:
    """A built-in's job (as launch.builtin_job makes it): its module under torchrun with its flags, no working
    directory, its own config.json, and its run on the cluster's shared filesystem."""
    from dtrain.common.storage import open_store
    from dtrain.control import launchers
    from dtrain.control.program import MODULE, Job, Program
    from dtrain.control.userjob import Target

    url = f"/shared/runs/{RUN_ID}"
    args = ("--resume", url, "--run-dir", url) if resumed else ("--run-id", RUN_ID, "--run-dir", url)
    job = Job(name="mnist", program=Program(kind=MODULE, target="dtrain.mnist.train", args=args))
    t = Target(RUN_ID, open_store(url), 2 if resumed else 0, resumed)
    p = launchers.Plan(job=job, target=t, cluster=c, nproc=0, own_config=True, **plan)
    return script.program_files(p, job_dir=f"/home/u/dtrain/runs/{RUN_ID}", name="lr-3e-3", nodes=nodes,
                                interactive=False, gpus_per_node=1, config=None, time=time)  # fmt: skip


def test_batch_script(tmp_path: Path) -> None:
    text = files(cluster(tmp_path, managed=False)).script
    options = [ln.removeprefix("#SBATCH ") for ln in text.splitlines() if ln.startswith("#SBATCH ")]
    assert options == [
        "--job-name=lr-3e-3", "--nodes=2", "--ntasks-per-node=1", "--exclusive", "--requeue", "--open-mode=append",
        "--chdir=/home/u/dtrain/runs/mnist-20260101-000000-abcd",
        "--output=/home/u/dtrain/runs/mnist-20260101-000000-abcd/slurm-%j.out",
        "--partition=gpu", "--account=proj", "--time=1:00:00", "--signal=B:USR1@120", "--gres=gpu:1",
    ]  # fmt: skip
    assert text.rstrip().endswith("exec /opt/py/bin/python -m dtrain.common.slurmstep batch job.json")


NODE_VALUES = {"__dtrain_master_addr__": "10.0.0.10", "__dtrain_addr__": "10.0.0.11", "__dtrain_is_host__": "0",
               "__dtrain_nproc__": "1", "__dtrain_threads__": "8", "__dtrain_node__": "n1", "__dtrain_nnodes__": "2",
               "__dtrain_node_rank__": "1"}  # fmt: skip


@pytest.mark.parametrize("image", ["", "registry.example/p/dtrain-train:src-0123456789ab"])
def test_a_node_fills_in_the_allocation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, image: str) -> None:
    """A built-in is a job like a user's script: the spec a node runs, once its placeholders are filled in, is
    the SSH launcher's torchrun line with the built-in's module and flags; nothing is installed (no working
    directory), the node's Python runs it (the image's in an image), its checkpoints go to the job's
    checkpoints/ and are copied to the run, and the batch step writes no config.json (the built-in does)."""
    c = cluster(tmp_path, managed=True, image=image)
    job = files(c, resumed=True).job
    assert set(job["specs"]) == {"n0", "n1"}  # dtrain's own cluster: each node as the inventory says
    assert job["program"]["workdir"] is False and job["program"]["config"] is None and job["resume"] is True
    spec = slurmstep.fill(job["specs"]["n1"], NODE_VALUES, [])
    assert "__dtrain" not in json.dumps(spec)
    assert spec["argv"][:3] == ["/opt/py/bin/python", "-m", "dtrain.common.launch"]
    assert spec["argv"][3:19] == [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.10:29400",
        "--rdzv-id", RUN_ID, "--rdzv-conf", "is_host=0,join_timeout=120", "--local-addr", "10.0.0.11",
        "--max-restarts", "0",
    ]  # fmt: skip
    assert spec["argv"][-6:] == ["-m", "dtrain.mnist.train", "--resume", f"/shared/runs/{RUN_ID}", "--run-dir",
                                 f"/shared/runs/{RUN_ID}"]  # fmt: skip
    assert spec["env"]["OMP_NUM_THREADS"] == "8" and spec["env"]["NCCL_DEBUG"] == "WARN"
    assert spec["ifname_for"] == "10.0.0.11"
    monkeypatch.chdir(tmp_path)  # the job's directory on the node: no work/ and nothing to install
    monkeypatch.setenv(slurmstep.RESTARTS_ENV, "1")
    lines: list[str] = []
    node = slurmstep.node_program_spec(job, spec, key="n1", name="n1", rank=1, resume=True, emit=lines.append)
    assert lines == [] and not (tmp_path / "work").exists()
    assert node["argv"][0] == ("python3" if image else "/opt/py/bin/python")
    assert node["cwd"] == "." and node["files"]["checkpoint_dir"] == "checkpoints"
    assert node["env"]["DTRAIN_CHECKPOINT_DIR"] == "checkpoints" and node["env"]["DTRAIN_RESTART_COUNT"] == "3"
    assert node["files"]["mirror"] == {**node["files"]["mirror"], "node": 1, "restore": True,
                                       "store": f"/shared/runs/{RUN_ID}/ckpt"}  # fmt: skip
    user = files(cluster(tmp_path, managed=False)).job
    assert set(user["specs"]) == {"*"}  # a user's cluster: nodes Slurm picks, one spec for all
    assert user["resume"] is False and user["specs"]["*"]["argv"][-4:] == ["--run-id", RUN_ID, "--run-dir",
                                                                          f"/shared/runs/{RUN_ID}"]  # fmt: skip


def test_the_batch_step_writes_no_config_for_a_built_in_and_keeps_its_completed_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch step records a built-in's starts and ends in status.json as a program's; config.json is the
    built-in's own (its resolved config). A stop that reaches a built-in after it recorded its completion (its
    teardown) leaves the run completed, and the job is not requeued to continue it."""
    from dtrain.common.rundir import read_json
    from dtrain.common.storage import open_store

    job = files(cluster(tmp_path, managed=True)).job
    job["run_url"] = str(tmp_path / "runs" / RUN_ID)
    run = open_store(job["run_url"])
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    slurmstep.program_started(job, restarts=0, nodes=["n0", "n1"], resume=False)
    assert not run.exists("config.json")
    assert read_json(run, "status.json")["state"] == "running" and read_json(run, "status.json")["starts"] == 1
    assert slurmstep.run_completed(job) is False
    run.write_bytes("status.json", json.dumps({"state": "completed", "exit_code": 0, "starts": 1}).encode())
    assert slurmstep.run_completed(job) is True  # a node step then reports its exit 3 as 0: done, not requeued
    slurmstep.program_ended(job, slurmstep.EXIT_PREEMPTED, requeued=False)
    assert read_json(run, "status.json")["state"] == "completed"
    slurmstep.program_ended(job, 1, requeued=False)  # a failure after it is one
    assert (read_json(run, "status.json")["state"], read_json(run, "status.json")["exit_code"]) == ("failed", 1)


def test_a_requeued_batch_step_reads_the_run_with_the_jobs_environment(
    tmp_path: Path, gcs_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether a requeued job resumes is asked of its run's store by the batch step, whose environment is
    Slurm's: it uses the one dtrain gave the job (here STORAGE_EMULATOR_HOST, forwarded at submit), as the
    ranks that write the run do, and leaves its own as it was. So does each node's step keeping its log."""
    from dtrain.common.storage import open_store

    emulator = os.environ["STORAGE_EMULATOR_HOST"]
    job = files(cluster(tmp_path, managed=True)).job
    assert job["specs"]["n0"]["env"]["STORAGE_EMULATOR_HOST"] == emulator  # forwarded into the job
    job["run_url"] = f"{gcs_bucket}/mnist-20260101-000000-abcd"
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")  # as under slurmd
    assert slurmstep.run_exists(job) is False
    with monkeypatch.context() as m:
        m.setenv("STORAGE_EMULATOR_HOST", emulator)
        open_store(job["run_url"]).write_bytes("config.json", b"{}")
    assert slurmstep.run_exists(job) is True
    log = tmp_path / "n0.log"
    log.write_text("a line\n")
    slurmstep._keep_log(job, log)  # a node's log, kept under the run, is written the same way
    assert "STORAGE_EMULATOR_HOST" not in os.environ
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator)
    assert open_store(job["run_url"]).read_bytes("logs/n0.log") == b"a line\n"


def test_a_module_job_runs_one_process_and_keeps_its_log(tmp_path: Path) -> None:
    """dtrain eval --queue's job: one node, `python -m dtrain.evaluate eval ...` through the node agent (no
    torchrun), the same line on a requeue; its node log is not copied over the run's training logs."""
    argv = ["eval", "/shared/runs/mnist-x", "--eval-id", "eval-20261124-040000-abcd"]
    for managed, keys in ((True, {"n0", "n1"}), (False, {"*"})):
        f = script.module_files(
            cluster(tmp_path, managed=managed), module="dtrain.evaluate", argv=argv, label="eval-20261124-040000-abcd",
            workload="eval:mnist", run_id="mnist-x", run_url="/shared/runs/mnist-x",
            job_dir="/w/runs/eval-20261124-040000-abcd", gpus_per_node=1,
        )  # fmt: skip
        assert set(f.job["specs"]) == keys and f.job["keep_log"] is False
        values = {t: "1" for t in slurmstep.TOKENS}
        for mode in ("argv_new", "argv_resume"):
            spec = slurmstep.fill(next(iter(f.job["specs"].values())), values, f.job[mode])
            assert spec["argv"] == ["/opt/py/bin/python", "-m", "dtrain.evaluate", *argv]
        assert "--nodes=1" in f.script and "--job-name=eval:mnist" in f.script
    log = tmp_path / "logs" / "n0.log"
    log.parent.mkdir()
    log.write_text("evaluating\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    slurmstep._keep_log({"run_url": str(run), "keep_log": False}, log)
    assert not (run / "logs").exists()
    slurmstep._keep_log({"run_url": str(run)}, log)  # a training job's: kept under the run
    assert (run / "logs" / "n0.log").read_text() == "evaluating\n"


def test_slurm_conf_from_probed_nodes(tmp_path: Path) -> None:
    c = cluster(tmp_path, managed=True)
    hw = {"CPUs": "8", "Boards": "1", "SocketsPerBoard": "1", "CoresPerSocket": "4", "ThreadsPerCore": "2",
          "RealMemory": "32000"}  # fmt: skip
    facts = [setup.NodeFacts(n, f"host-{n.name}", hw, n.gpus, True, True, True, ()) for n in c.nodes]
    conf = setup.slurm_conf(c, facts)
    lines = conf.splitlines()
    assert "SlurmctldHost=host-n0(10.0.0.10)" in lines
    assert f"SlurmdTimeout={setup.SLURMD_TIMEOUT_S}" in lines and f"AuthInfo=cred_expire={setup.CRED_EXPIRE_S}" in lines
    assert (
        "NodeName=n1 NodeHostname=host-n1 NodeAddr=10.0.0.11 CPUs=8 Boards=1 SocketsPerBoard=1 CoresPerSocket=4 "
        "ThreadsPerCore=2 RealMemory=32000 Gres=gpu:1 State=UNKNOWN"
    ) in lines
    assert "PartitionName=dtrain Nodes=n0,n1 Default=YES MaxTime=INFINITE State=UP OverSubscribe=EXCLUSIVE" in lines
    assert (
        setup.gres_conf(facts)
        == "NodeName=n0 Name=gpu File=/dev/nvidia[0-0]\nNodeName=n1 Name=gpu File=/dev/nvidia[0-0]\n"
    )
    hybrid = [dataclasses.replace(f, cgroup2=False) for f in facts]
    assert setup.cgroup_conf(hybrid) == "CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n"


def slurm_table(tmp_path: Path, **spec) -> ClusterConfig:
    key = tmp_path / "key"
    key.write_text("k")
    login = {"host": "login.example.org", "user": "me", "key": str(key)}
    return ClusterConfig(backend="slurm", name="hpc", spec={"login": login, **spec}, source=str(tmp_path / "t.toml"))


def test_slurm_backend_table(tmp_path: Path) -> None:
    cfg = slurm_table(tmp_path, partition="gpu", gpus_per_node=4, time="2-00:00:00", python="/sw/bin/python")
    get("slurm").check(cfg)
    c = get("slurm").cluster(cfg)
    assert c.launcher == "slurm" and c.backend == "slurm" and [n.name for n in c.nodes] == ["login"]
    assert c.slurm.login.destination == "me@login.example.org" and c.slurm.login.python == "/sw/bin/python"
    assert (c.slurm.partition, c.slurm.gpus_per_node, c.slurm.time, c.slurm.managed) == ("gpu", 4, "2-00:00:00", False)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"partiton": "gpu"}, "unknown key 'partiton' (did you mean partition?)"),
        ({"time": "forever"}, "time 'forever' is not a Slurm time limit"),
        ({"partition": "gpu queue"}, "partition 'gpu queue' is not a Slurm partition name"),
        ({"gpus_per_node": -1}, "gpus_per_node must be >= 0, got -1"),
        ({"constraint": "a100 && ib"}, "constraint 'a100 && ib' is not a node feature expression"),
    ],
)
def test_slurm_backend_refuses_a_bad_table_in_one_line(tmp_path: Path, spec: dict, message: str) -> None:
    with pytest.raises(UserError) as e:
        get("slurm").check(slurm_table(tmp_path, **spec))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_hosts_with_slurm_need_one_workdir(tmp_path: Path) -> None:
    nodes = [{"name": "a", "address": "10.0.0.1"}, {"name": "b", "address": "10.0.0.2", "workdir": "/scratch"}]
    cfg = ClusterConfig(backend="hosts", name="lab", spec={"slurm": True, "nodes": nodes}, source=str(tmp_path / "t"))
    with pytest.raises(UserError, match="with slurm = true every node needs the same workdir: node b has '/scratch'"):
        get("hosts").cluster(cfg)
    nodes[1].pop("workdir")
    c = get("hosts").cluster(cfg)
    assert c.launcher == "slurm" and c.slurm.managed and c.slurm.login.name == "a"


def test_the_node_side_needs_only_the_standard_library() -> None:
    """dtrain.common.slurmstep runs on nodes whose Python may lack everything but the standard library
    (container mode) until it opens the run's storage."""
    import subprocess

    code = "import sys, dtrain.common.slurmstep; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('torch', 'google', 'numpy')))"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_host_lists_have_one_reading_with_suffixes_and_odd_ranges() -> None:
    """One expansion of Slurm's host lists for `dtrain jobs`' cost and the cluster service (whose own copy
    dropped suffixes and crashed on a range that is not numbers)."""
    from dtrain.control.slurm import joblist
    from dtrain.service import daemon

    assert joblist.expand_nodelist is commands.expand_hostlist and daemon.expand_hostlist is commands.expand_hostlist
    e = commands.expand_hostlist
    assert e("demo-master,demo-worker-[0-2,5]") == ["demo-master", "demo-worker-0", "demo-worker-1",
                                                    "demo-worker-2", "demo-worker-5"]  # fmt: skip
    assert e("gpu[08-10]-ib") == ["gpu08-ib", "gpu09-ib", "gpu10-ib"]  # a suffix after the brackets
    assert e("rack[1-2]-n[01-02]") == ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]
    assert e("n[a-c],h[1-2]") == ["na-c", "h1", "h2"]  # not numbers: kept as written, no crash
    assert e("n[3-1],x") == ["n3-1", "x"] and e("h[0-1") == ["h[0-1"] and e("") == [] and e("h0") == ["h0"]


def test_slurm_nodes_count_processes_with_the_one_rule() -> None:
    """The batch step's node tasks apply dtrain.common.nproc's rule, per-core ceiling included."""
    assert slurmstep.processes({"nproc": 0}, cpus=8, gpus=0) == 2 and slurmstep.processes({}, cpus=8, gpus=4) == 4
    with pytest.raises(UserError, match=r"^--nproc 3 is more processes than node n1's 2 CPU core\(s\)"):
        slurmstep.processes({"nproc": 3}, cpus=2, gpus=0, where="node n1")
    assert slurmstep.processes({"nproc": 3, "oversubscribe": True}, cpus=2, gpus=0) == 3
    with pytest.raises(UserError, match=r"more than 4 processes per core even with --oversubscribe"):
        slurmstep.processes({"nproc": 9, "oversubscribe": True}, cpus=2, gpus=0)
    assert slurmstep.processes({"nproc": 4, "program": {"torchrun": False}}, cpus=2, gpus=0) == 1  # a command


@pytest.mark.parametrize("managed", [True, False])
def test_a_users_program_as_a_slurm_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, managed: bool) -> None:
    """A user's script: job.json holds the SSH launcher's program spec with the allocation's placeholders; each
    node fills them in and takes its own part: the rank, the copy of the checkpoint directory (every node's own
    on node-local disks, the first node's alone on a shared job directory), the forwarded metrics (first node),
    DTRAIN_RESTART_COUNT (starts before the job + Slurm's requeues)."""
    from dtrain.common.storage import open_store
    from dtrain.control import launchers
    from dtrain.control.program import Job, Program
    from dtrain.control.userjob import Target, program_config

    c = cluster(tmp_path, managed=managed)
    c = dataclasses.replace(c, slurm=dataclasses.replace(c.slurm, shared_workdir=not managed))
    job = Job(name="train", program=Program(kind="script", target="train.py", args=("--lr", "3")),
              workdir=tmp_path, checkpoint_dir="ckpts")  # fmt: skip
    t = Target("train-20260101-000000-abcd", open_store(str(tmp_path / "runs" / "train-20260101-000000-abcd")), 1, True)
    plan = launchers.Plan(job=job, target=t, cluster=c, nproc=1)
    config = program_config(t, job, cluster="c", nodes=2, nproc=None)
    f = script.program_files(plan, job_dir="/w/runs/x", name="lr-3", nodes=2, interactive=False, gpus_per_node=0,
                             config=config)  # fmt: skip
    assert set(f.job["specs"]) == ({"n0", "n1"} if managed else {"*"})
    assert f.job["resume"] is True and f.job["program"]["restarts"] == 1 and f.job["program"]["shared"] is not managed
    assert "--job-name=lr-3" in f.script and "--nodes=2" in f.script
    values = {"__dtrain_master_addr__": "10.0.0.10", "__dtrain_addr__": "10.0.0.11", "__dtrain_is_host__": "0",
              "__dtrain_nproc__": "1", "__dtrain_threads__": "8", "__dtrain_node__": "n1", "__dtrain_nnodes__": "2",
              "__dtrain_node_rank__": "1"}  # fmt: skip
    key = "n1" if managed else "*"
    spec = slurmstep.fill(f.job["specs"][key], values, [])
    assert "__dtrain" not in json.dumps(spec)
    assert spec["argv"][3:21] == [
        "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.10:29400",
        "--rdzv-id", t.run_id, "--rdzv-conf", "is_host=0,join_timeout=120", "--local-addr", "10.0.0.11",
        "--max-restarts", "0", "train.py", "--lr",
    ]  # fmt: skip
    assert (spec["env"]["DTRAIN_NODE_RANK"], spec["env"]["DTRAIN_NNODES"]) == ("1", "2")
    (tmp_path / "node" / "work").mkdir(parents=True)  # the job's directory on the node: no requirements
    monkeypatch.chdir(tmp_path / "node")
    monkeypatch.setenv(slurmstep.RESTARTS_ENV, "2")
    lines: list[str] = []
    for rank in (1, 0):
        node = slurmstep.node_program_spec(f.job, json.loads(json.dumps(spec)), key=key, name="n1", rank=rank,
                                      resume=True, emit=lines.append)  # fmt: skip
        assert node["argv"][0] == "/opt/py/bin/python" and node["env"]["DTRAIN_RESTART_COUNT"] == "3"
        assert node["files"]["checkpoint_dir"] == "work/ckpts"
        assert bool(node["files"]["forward"]) is (rank == 0)
        if managed:  # every node its own copy, put back before it starts
            assert node["files"]["mirror"]["node"] == rank and node["files"]["mirror"]["restore"] is True
        elif rank == 0:  # one directory for the job: the batch step put it back; the first node copies it
            assert node["files"]["mirror"]["node"] == 0 and node["files"]["mirror"]["restore"] is False
        else:
            assert "mirror" not in node["files"]
    assert lines == []  # nothing to install


def test_a_users_program_in_an_image_as_a_slurm_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a Slurm cluster whose jobs run in an image (dtrain up's clusters), job.json keeps the synced-mode spec
    with the image and each node's docker command beside it: each node's step fills in the allocation, has the
    image's Python make the environment (none here: nothing to install, so no container for it), and wraps the
    spec in the job's container (nodeagent.program_container), whose agent runs it."""
    from dtrain.common.nodeagent import INNER_SPEC_ENV, program_container
    from dtrain.common.storage import open_store
    from dtrain.control import launchers
    from dtrain.control.program import Job, Program
    from dtrain.control.userjob import Target, program_config

    image = "registry.example/p/dtrain-train:src-0123456789ab"
    c = cluster(tmp_path, managed=True, image=image)
    c = dataclasses.replace(c, nodes=tuple(dataclasses.replace(n, docker="sudo docker") for n in c.nodes))
    job = Job(name="train", program=Program(kind="script", target="train.py"), workdir=tmp_path,
              checkpoint_dir="ckpts")  # fmt: skip
    t = Target(
        "train-20260101-000000-abcd", open_store(str(tmp_path / "runs" / "train-20260101-000000-abcd")), 0, False
    )
    plan = launchers.Plan(job=job, target=t, cluster=c, nproc=1)
    config = program_config(t, job, cluster="c", nodes=2, nproc=None)
    f = script.program_files(plan, job_dir="/w/runs/x", name="train", nodes=2, interactive=False, gpus_per_node=1,
                             config=config)  # fmt: skip
    assert f.job["image"] == image and f.job["program"]["docker"] == {"n0": "sudo docker", "n1": "sudo docker"}
    assert all("container" not in s and s["argv"][0] == "/opt/py/bin/python" for s in f.job["specs"].values())
    values = {"__dtrain_master_addr__": "10.0.0.10", "__dtrain_addr__": "10.0.0.11", "__dtrain_is_host__": "0",
              "__dtrain_nproc__": "1", "__dtrain_threads__": "8", "__dtrain_node__": "n1", "__dtrain_nnodes__": "2",
              "__dtrain_node_rank__": "1"}  # fmt: skip
    spec = slurmstep.fill(f.job["specs"]["n1"], values, [])
    (tmp_path / "node" / "work").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "node")
    node = slurmstep.node_program_spec(f.job, spec, key="n1", name="n1", rank=1, resume=True, emit=lambda _: None)
    assert node["argv"][0] == "python3"  # the image's own: nothing to install
    assert slurmstep._docker(f.job, "n1") == ["sudo", "docker"]
    boxed = program_container(node, image=image, run_id=t.run_id, node="n1", docker=["sudo", "docker"], gpus=True)
    inner = json.loads(boxed["env"][INNER_SPEC_ENV])
    assert inner["argv"][0] == "python3" and inner["files"]["checkpoint_dir"] == "work/ckpts"
    assert inner["files"]["mirror"]["restore"] is True and inner["files"]["mirror"]["node"] == 1
    assert boxed["container"]["name"] == "dtrain-train-20260101-000000-abcd-n1" and boxed["container"]["gpus"] is True
    assert boxed["env"]["DTRAIN_NODE_RANK"] == "1" and boxed["grace_s"] == inner["grace_s"] + 30.0
