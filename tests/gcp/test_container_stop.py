"""Container mode on a Spot VM: at preemption systemd stops dockerd, which stops each container with SIGTERM
and SIGKILLs it after the container's stop timeout (10 s unless `docker run --stop-timeout` says otherwise,
docs.docker.com/reference/cli/docker/container/run/). The job's last checkpoint gets GCE's whole notice
(docs/preemption.md) only if the node agent's `docker run` line asks for it. The line the agent runs
(nodeagent.container_argv) is checked against the budget the docs state, and (slow, root) a real dockerd
stops a container started with it."""

from __future__ import annotations

import re
import secrets
import subprocess
import time
from pathlib import Path

import pytest

from dtrain.common.nodeagent import container_argv

REPO = Path(__file__).resolve().parents[2]
SPEC = {"docker": ["docker"], "name": "dtrain-x-n0", "image": "reg.example/p/img:1", "args": ["--nnodes", "1"]}


def notice_s() -> int:
    """The preemption notice docs/preemption.md budgets ("# Preemption: saving within GCE's 30 s notice")."""
    title = (REPO / "docs" / "preemption.md").read_text().splitlines()[0]
    m = re.search(r"(\d+) s notice", title)
    assert m, title
    return int(m[1])


def test_docker_run_gives_the_job_the_whole_preemption_notice(tmp_path: Path):
    argv = container_argv(SPEC, [], tmp_path, 1000, 1000)
    assert argv.count("--stop-timeout") == 1
    timeout = int(argv[argv.index("--stop-timeout") + 1])
    assert timeout == notice_s() == 30 and timeout > 10  # docker's default would SIGKILL at 10 s
    assert argv.index("--stop-timeout") < argv.index(SPEC["image"])  # an option of `docker run`, not of the job


def test_a_spec_may_ask_for_another_budget(tmp_path: Path):
    argv = container_argv({**SPEC, "stop_timeout_s": 120}, [], tmp_path, 1000, 1000)
    assert argv[argv.index("--stop-timeout") + 1] == "120"


@pytest.mark.slow  # a real dockerd and a 13 s shutdown
@pytest.mark.root
def test_dockerd_lets_the_job_finish_its_save_past_ten_seconds(tmp_path: Path):
    # The agent's own `docker run` line, a job that needs 13 s after SIGTERM (a checkpoint save), and a plain
    # `docker stop` (no -t: what dockerd does to every container when the VM shuts down): the job ends on its
    # own with 0, where docker's default 10 s would have SIGKILLed it (137).
    from tests.docker import imagetest as d

    daemon = d.Daemon()
    if reason := daemon.start():
        pytest.skip(reason)
    name = f"dtrain-stoptest-{secrets.token_hex(3)}"
    try:
        if reason := d.base_image():
            pytest.skip(reason)
        job = "trap 'sleep 13; exit 0' TERM; echo up; sleep 1000 & wait"
        spec = {
            **SPEC,
            "docker": [d.DOCKER],
            "name": name,
            "image": d.BASE_TAG,
            "entrypoint": "sh",
            "args": ["-c", job],
        }
        argv = container_argv(spec, [], tmp_path, 0, 0)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        start = time.monotonic()
        d.docker("stop", name, timeout=120)
        code = proc.wait(timeout=60)
        elapsed = time.monotonic() - start
        assert code == 0 and elapsed >= 12, (code, elapsed)
    finally:
        d.docker("rm", "--force", name, check=False)
        daemon.stop()
