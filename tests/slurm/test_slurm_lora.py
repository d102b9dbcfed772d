"""The LoRA built-in on the real Slurm of the test bed (tests/slurm/conftest.py), through the same path as a
user's program (launch.builtin_job, slurm.programs): two nodes under torchrun, its checkpoints written on each
node and copied to the run's ckpt/, `dtrain cancel` checkpoints and stops it, and `dtrain submit lora --resume`
puts the newest complete copy back and continues it to the end. Needs root, like the other Slurm tests."""

from __future__ import annotations

import json
import re
import sysconfig
import time
from pathlib import Path

import pytest

from .conftest import Env
from .test_slurm_bed import job_processes, latest, status

pytestmark = [pytest.mark.root, pytest.mark.slow]
pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

# tiny-llama (built from its config: no download), byte tokenizer, 40 steps of 8 blocks of 64 tokens on 2 nodes x 1
# process, checkpointed every 5 steps, evaluated at 0, 20 and 40.
ARGS = ["--model", "tiny-llama", "--seq-len", "64", "--batch-size", "8", "--lr", "2e-3", "--max-steps", "40",
        "--checkpoint-every", "5", "--eval-every", "20", "--nproc", "1", "--nodes", "2"]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(bed: Env) -> Path:
    """Text on the bed's shared filesystem, where every node reads it: some of the standard library's source."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = bed.sb.shared / "lora-corpus.txt"
    path.write_text("".join((stdlib / n).read_text(encoding="utf-8") for n in ("json/decoder.py", "textwrap.py")))
    return path


def test_lora_on_two_slurm_nodes_is_cancelled_then_resumed_to_its_end(bed: Env, corpus: Path) -> None:
    r = bed.dtrain("submit", "lora", "--cluster", "bed", *ARGS, "--data", str(corpus), "--output", str(bed.runs))
    assert r.returncode == 0, r.stdout + r.stderr
    job = r.stdout.strip()
    row = bed.wait(job, lambda j: j["state"] == "RUNNING", what="RUNNING")
    assert (row["workload"], row["kind"], row["nodes"]) == ("lora", "builtin", 2), row
    run = Path(row["url"])
    deadline = time.monotonic() + 300
    while latest(run) < 10:  # read through the run's ckpt/ copies (rundir.checkpoints), as dtrain reads it
        assert time.monotonic() < deadline, "no copy of a checkpoint at step 10"
        time.sleep(0.5)
    cancel = bed.dtrain("cancel", job, "--cluster", "bed")
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    kept = re.search(r"its last checkpoint step-(\d+) is kept", cancel.stdout)
    assert kept and int(kept.group(1)) >= 10, cancel.stdout
    assert status(run)["state"] == "preempted", status(run)
    assert not (run / "checkpoints").exists()  # written on the nodes, copied to ckpt/ (dtrain.common.mirror)
    stopped = latest(run)

    # The launch settings are the submission's, not the run's: the same 2 nodes x 1 process again.
    r = bed.dtrain("submit", "lora", "--cluster", "bed", "--resume", run.name, "--output", str(bed.runs),
                   "--nproc", "1", "--nodes", "2")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    again = r.stdout.strip()
    row = bed.wait(again, lambda j: j["state"] == "COMPLETED", what="COMPLETED")
    assert row["run_id"] == run.name
    out = bed.dtrain("logs", again, "--cluster", "bed").stdout
    assert "checkpoint restore: " in out, out[-3000:]
    resumed = [int(m) for m in re.findall(r"resuming from \S+ \(step (\d+)\)", out)]
    assert resumed and resumed[0] == stopped, out[-3000:]
    final = status(run)
    assert final["state"] == "completed" and final["result"]["steps"] == 40 and final["result"]["world_size"] == 2
    config = json.loads((run / "config.json").read_text())
    assert config["workload"] == "lora" and len(config.get("resumes", [])) == 1  # the built-in's own config
    assert (run / "final" / "adapter" / "adapter_model.safetensors").exists()
    ppl = {m["step"]: m["eval_perplexity"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
           if "eval_perplexity" in m}  # fmt: skip
    assert sorted(ppl) == [0, 20, 40] and ppl[40] < ppl[0], ppl
    print(f"lora on 2 Slurm nodes: job {job} cancelled with checkpoint step {stopped} kept; job {again} resumed at "
          f"step {resumed[0]} and completed 40 steps; eval perplexity {ppl[0]:.1f} -> {ppl[40]:.1f}")  # fmt: skip
    deadline = time.monotonic() + 30
    while any(job_processes(bed).values()):
        assert time.monotonic() < deadline, job_processes(bed)
        time.sleep(1)
