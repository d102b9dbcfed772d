"""The SIGTERM flag agreed on every few steps (PreemptionPoll) by two real processes that step at
different speeds: both poll at the same steps (a rank polling alone would hang in the all-reduce),
far fewer times than they step, and both stop at the same step soon after one of them is signalled."""

from __future__ import annotations

from runs import run_ranks

POLL_SCRIPT = """
import json, os, signal, sys, time
from dtrain.common.dist import distributed
from dtrain.common.preempt import PreemptionPoll, PreemptionWatch

rank = int(os.environ["RANK"])
step_s = (0.001, 0.004)[rank]  # rank 1's steps take four times as long
polled = []
with distributed(timeout_s=30) as d:
    agree = d.max_of
    d.max_of = lambda *v: polled.append(step) or agree(*v)
    watch = PreemptionWatch()
    poll = PreemptionPoll(d, watch, interval_s=0.05)  # 50 ms between agreements
    with watch:
        for step in range(1, 2000):
            time.sleep(step_s)
            if rank == 1 and step == 150:
                os.kill(os.getpid(), signal.SIGTERM)  # only rank 1 is told
            if poll(step):
                break
print(json.dumps({"polled": polled, "stopped": step}))
"""


def test_ranks_of_different_speeds_poll_together_and_stop_together(tmp_path):
    script = tmp_path / "poll.py"
    script.write_text(POLL_SCRIPT)
    r0, r1 = run_ranks(script, [{}, {}])
    assert r0["polled"] == r1["polled"] and r0["stopped"] == r1["stopped"]
    polled = r0["polled"]
    # The first agreement is after step 1; then about 50 ms apart: 12 steps of rank 1's 4 ms.
    assert polled[:2] == [1, 2] and len(polled) < r0["stopped"] / 5, polled
    # Rank 1 was signalled after step 150: within one interval (12 steps) and the steps measured
    # before the next agreement.
    assert 150 < r0["stopped"] <= 150 + 2 * 13, r0["stopped"]
