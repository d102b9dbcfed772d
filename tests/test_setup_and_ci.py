"""The README's two commands and what CI counts: the first command sets up training and nothing else;
the test command sets up everything the tests need and runs every test, the slow ones included; and a
test that skips for anything but a missing GPU or an absent ../shared fails the run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def plan(*args: str) -> dict[str, str]:
    p = subprocess.run(
        ["bash", str(REPO / "scripts" / "setup.sh"), *args],
        env={**os.environ, "DTRAIN_SETUP_DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    return dict(line.split(": ", 1) for line in p.stdout.splitlines())


def test_the_first_command_sets_up_training_only():
    readme = (REPO / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)\n```", readme, re.S).group(1)
    assert first == "scripts/setup.sh && .venv/bin/dtrain train mnist --dataset fashion-mnist"
    default = plan()
    # what a fresh Debian needs to make a venv and train offline, and nothing for the tests
    assert default["apt"].split() == ["python3-venv", "git", "dataset-fashion-mnist"]
    assert default["pip"] == "torch==2.13.0 -e .[train]"
    assert "tools" not in default


def test_the_test_command_sets_up_the_rest_and_runs_every_test():
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    assert blocks[1] == "scripts/test.sh"
    dev = plan("--dev")
    assert set(plan()["apt"].split()) < set(dev["apt"].split())
    assert {"openssh-server", "docker.io", "iproute2"} <= set(dev["apt"].split())
    assert "dev" in dev["pip"] and dev.get("tools") == "checkov (.venv-tools)"
    script = (REPO / "scripts" / "test.sh").read_text()
    assert "bash scripts/setup.sh --dev" in script
    # both suites run unconditionally (no time budget that drops the slow tests)
    runs = re.findall(r"^\.venv/bin/python -m pytest (.*)$", script, re.M)
    assert [r.split(" ")[:2] for r in runs] == [["-m", '"not'], ["-m", "slow"]], runs
    assert "BUDGET" not in script


STRICT_PROBE = textwrap.dedent(
    """
    import pytest

    def test_runs():
        assert 1 + 1 == 2

    def test_needs_a_gpu():
        pytest.skip("needs a CUDA GPU")

    def test_needs_shared():
        pytest.skip("needs ../shared/data/mnist")

    def test_hidden():
        pytest.skip({reason!r})
    """
)


def _probe(tmp_path: Path, reason: str, strict: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "test_probe.py").write_text(STRICT_PROBE.format(reason=reason))
    env = {**os.environ, "DTRAIN_STRICT_SKIPS": strict}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_probe.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_skip_that_hides_a_test_fails_the_run(tmp_path):
    strict = _probe(tmp_path, "needs root (network namespaces)", "1")
    assert strict.returncode == 1, strict.stdout
    assert "test_probe.py::test_hidden: needs root (network namespaces)" in strict.stdout
    assert "test_needs_a_gpu" not in strict.stdout.split("DTRAIN_STRICT_SKIPS")[-1]
    lenient = _probe(tmp_path, "needs root (network namespaces)", "0")
    assert lenient.returncode == 0, lenient.stdout


def test_allowed_skips_pass_the_strict_run(tmp_path):
    r = _probe(tmp_path, "no GPU on this machine", "1")
    assert r.returncode == 0, r.stdout
