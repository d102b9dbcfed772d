"""The launcher takes every node's exit code before it judges the job, however the nodes' ends fall between its
looks. A Spot notice on one node (its processes SIGTERM'd: 143) beside a node whose ranks checkpointed (exit 3)
is a preempted job; judged on the first node's code alone, it was called a failure (CI, stop 34: the second node
ended after the loop's last look at it and before its condition's own poll)."""

from __future__ import annotations

import subprocess

from dtrain.common.errors import ExitCode
from dtrain.common.runrecord import job_outcome
from dtrain.control.cluster import Cluster, Node
from dtrain.control.events import Collector, Handle
from dtrain.control.remote import NodeAgents

# Each reads its spec first, as the node agent does.
SCRIPTS = {
    "n0": "read -r spec; echo checkpointed; exit 3",  # its ranks saw the stop, checkpointed and exited PREEMPTED
    "n1": "read -r spec; exec >&- 2>&-; sleep 0.5; exit 143",  # its output ends first, its processes die later
    "gone": "exit 255",  # ssh that could not connect: over before the launcher writes its spec
}


class LateLook(subprocess.Popen):
    """A real process whose end is seen one look late: the first poll after it ended still says "running". This
    is the interleaving where it ends just after the launcher looked, which a scheduler gives now and then."""

    seen_late = False

    def poll(self) -> int | None:
        code = super().poll()
        if code is not None and not self.seen_late:
            self.seen_late = True
            return None
        return code


class Shell:
    """NodeAgents' SSH, reduced to what it calls: each node's script runs here."""

    def popen(self, node: Node, command: str, **kw: object) -> subprocess.Popen:
        p = LateLook(["bash", "-c", SCRIPTS[node.name]], **kw)  # type: ignore[call-overload]
        if node.name == "gone":
            p.wait()  # it ended before the launcher could write to it (a refused connection, a node gone)
        return p


def agents(*names: str) -> NodeAgents:
    nodes = tuple(Node(name=n, address="127.0.0.1", master=i == 0) for i, n in enumerate(names))
    specs = {n.name: {"argv": ["unused"]} for n in nodes}
    return NodeAgents(Shell(), Cluster(name="c", backend="hosts", nodes=nodes), "r", specs, None,  # type: ignore[arg-type]
                      events=Collector(), handle=Handle(), echo=False)  # fmt: skip


def test_a_node_that_ends_after_the_last_look_still_gives_its_code() -> None:
    job = agents("n0", "n1")
    code = job.run()
    assert job.codes == {"n0": 3, "n1": 143}, job.codes
    assert code == ExitCode.PREEMPTED  # the first failure's code, kept
    assert job_outcome(code, job.codes.values(), asked=False) == ExitCode.PREEMPTED


def test_a_connection_over_before_its_spec_is_written_is_a_lost_node_not_a_crash() -> None:
    """Writing the spec to a connection that already ended raised BrokenPipeError out of the launcher (CI, the
    test above, where a node's script had exited before the write: a traceback, no run record). Now that node's
    code is taken like any other's, and the job fails on it."""
    job = agents("n0", "gone")
    code = job.run()
    assert job.codes == {"n0": 3, "gone": 255}, job.codes
    # A lost node beside one that exited 3 unasked: a failure, whichever of the two was seen first.
    assert job_outcome(code, job.codes.values(), asked=False) == ExitCode.FAILURE
