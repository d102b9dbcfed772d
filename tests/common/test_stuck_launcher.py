"""A launcher that never exits after its ranks did (issue 31: torchrun frozen on one node held a Slurm job's two
nodes for minutes after its ranks had finished and the run was recorded completed). The node agent, which every
backend runs on every node (the SSH launcher's nodes, each Slurm node step), stops it RANKS_ENDED_WAIT_S after the
last of its ranks exited 0, and the node's exit code is theirs. Real torchrun, frozen with SIGSTOP."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from dtrain.common.nodeagent import CONTROL_PREFIX, HANG_GRACE_S

# Each rank says it is up, works a little and exits with the code given on the command line.
SCRIPT = """\
import os, sys, time
print(f"rank {os.environ['RANK']} up", flush=True)
time.sleep(3)
sys.exit(int(sys.argv[1]))
"""
WAIT_S = 2.0


def _agent(tmp_path: Path, code: int) -> tuple[subprocess.Popen, list[str], int]:
    """The agent running torchrun (2 ranks exiting `code`), with torchrun frozen once both ranks are up:
    (the agent, its lines so far, torchrun's pid)."""
    (tmp_path / "job.py").write_text(SCRIPT)
    spec = {
        "argv": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 str(tmp_path / "job.py"), str(code)],
        "env": {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
        "grace_s": 5,
        "hang": {"timeout_s": 0},
        "ranks_ended_wait_s": WAIT_S,
    }  # fmt: skip
    argv = [sys.executable, "-m", "dtrain.common.nodeagent", "run"]
    agent = subprocess.Popen(argv, cwd=tmp_path, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
    assert agent.stdin and agent.stdout
    agent.stdin.write(json.dumps(spec) + "\n")
    agent.stdin.flush()  # and kept open: a closed stdin means the launcher is gone
    lines, root, up = [], 0, 0
    for line in agent.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith(CONTROL_PREFIX) and '"started"' in line:
            root = json.loads(line[len(CONTROL_PREFIX) :])["pid"]
        up = len(re.findall(r"rank \d up", "".join(lines)))  # the two ranks' lines may come interleaved
        if up == 2:
            break
    assert root and up == 2, lines
    os.kill(root, signal.SIGSTOP)  # torchrun frozen: its ranks go on, end, and are never reaped
    return agent, lines, root


def test_a_frozen_torchrun_whose_ranks_exited_0_is_stopped_and_the_node_ends_0(tmp_path: Path) -> None:
    agent, lines, root = _agent(tmp_path, 0)
    try:
        frozen_at = time.monotonic()
        agent.wait(timeout=60)  # not communicate(): stdin stays open (closing it stops the job)
        rest = agent.stdout.read()
    finally:
        if agent.poll() is None:
            os.kill(root, signal.SIGKILL)
            agent.kill()
            agent.wait()
    took = time.monotonic() - frozen_at
    text = "\n".join(lines) + "\n" + rest
    assert agent.returncode == 0, text
    assert "all exited 0 2 s ago, but their launcher has not ended: stopping it" in text, text
    # The ranks end 3 s after they are up; then WAIT_S, then SIGTERM, and SIGKILL HANG_GRACE_S later (a stopped
    # process answers only that), with the agent's half-second polls on top.
    assert took <= 3 + WAIT_S + HANG_GRACE_S + 5, took


def test_ranks_that_failed_are_left_to_their_launcher(tmp_path: Path) -> None:
    """The rule claims only a success: ranks that exited 1 under a frozen torchrun are not taken for one (a live
    torchrun would restart them or fail the node); the agent waits on (here until the test ends it)."""
    agent, lines, root = _agent(tmp_path, 1)
    try:
        time.sleep(3 + WAIT_S + 3)  # the ranks have ended, and WAIT_S has passed
        assert agent.poll() is None, lines
    finally:
        os.kill(root, signal.SIGKILL)
        agent.wait(timeout=30)
    rest = agent.stdout.read()
    assert "stopping it" not in rest, rest
    assert agent.returncode != 0
