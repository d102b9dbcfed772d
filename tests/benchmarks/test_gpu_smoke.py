"""benchmarks/gpu_smoke.py, so the script that checks the GPU paths does not rot. On a machine without a
GPU it runs in its CPU form: the checks with a CPU form pass, the GPU-only ones say why they skip, and the
exit code is 0. On a machine with a GPU the same tests run it on the GPU, and no check may skip for want
of one (docs/gpu.md): hiding the GPU there would leave every GPU path untested."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gpu_check import GPU_SKIP_REASON, machine_has_gpu

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_smoke.py"
LINE = re.compile(r"^(PASS|FAIL|SKIP) ([a-z0-9-]+): (.+) \[\d+ s\]$")
ON_CPU = {"mnist-fp32", "lora-fp32", "allreduce", "lora-benchmark", "sdpa-gqa", "fused-linear"}
GPU_ONLY = {"mnist-fp16-step-syncs", "mnist-cudnn-benchmark", "tf32", "lora-eval-syncs", "resume-bf16-to-fp16",
            "load-to-device", "fork-rng", "activation-checkpointing", "qlora", "lora-qlora-run",
            "lora-fsdp"}  # fmt: skip
ON_GPU = machine_has_gpu()


def no_check_wanted_a_gpu(results: dict[str, tuple[str, str]]) -> None:
    missed = {name: r for name, r in results.items() if r[0] == "FAIL" or r[1] == GPU_SKIP_REASON}
    assert not missed, missed


def smoke(*args: str, timeout: float) -> tuple[int, dict[str, tuple[str, str]], str]:
    env = {**os.environ, "DTRAIN_OFFLINE": "1"}
    if not ON_GPU:
        env["CUDA_VISIBLE_DEVICES"] = ""
        args = ("--cpu", *args)
    p = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                       env=env)  # fmt: skip
    lines = p.stdout.splitlines()
    on_cpu = bool(lines) and lines[0].startswith("gpu_smoke on CPU")
    assert lines and lines[0].startswith("gpu_smoke on ") and on_cpu is not ON_GPU, p.stdout + p.stderr
    results = {}
    for line in lines[1:]:
        m = LINE.match(line)
        assert m, line
        results[m.group(2)] = (m.group(1), m.group(3))
    return p.returncode, results, p.stdout + p.stderr[-3000:]


def test_the_in_process_checks_pass_or_skip_on_a_cpu():
    code, results, out = smoke("--only", "sdpa-gqa,fused-linear,tf32,mnist-fp16-step-syncs", timeout=300)
    assert code == 0, out
    if ON_GPU:
        no_check_wanted_a_gpu(results)
        assert results["tf32"][0] == results["mnist-fp16-step-syncs"][0] == "PASS", out
        return
    assert results["sdpa-gqa"] == ("PASS", results["sdpa-gqa"][1]) and "FLASH_ATTENTION" in results["sdpa-gqa"][1]
    assert results["fused-linear"][0] == "PASS" and "used on cpu" in results["fused-linear"][1]
    assert results["tf32"] == ("SKIP", "needs a CUDA GPU")
    assert results["mnist-fp16-step-syncs"] == ("SKIP", "needs a CUDA GPU")


def test_an_unknown_check_is_refused():
    p = subprocess.run([sys.executable, str(SCRIPT), "--only", "nope"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown check(s) nope" in p.stderr


@pytest.mark.slow  # 1.5 to 4 minutes on 2 cores: a MNIST run, a LoRA run, torchrun, the LoRA benchmark
def test_every_check_in_the_cpu_form():
    code, results, out = smoke(timeout=1200)
    assert code == 0, out
    if ON_GPU:
        no_check_wanted_a_gpu(results)
        assert {name for name, (status, _) in results.items() if status == "PASS"} >= ON_CPU, out
        return
    assert {name for name, (status, _) in results.items() if status == "PASS"} == ON_CPU, out
    for name in GPU_ONLY:
        assert results[name] == ("SKIP", "needs a CUDA GPU"), (name, results[name])
    for name in ("mnist-bf16", "mnist-fp16", "lora-bf16", "lora-fp16"):
        assert results[name][0] == "SKIP", (name, results[name])
    assert "gloo, 2 rank(s)" in results["allreduce"][1]
