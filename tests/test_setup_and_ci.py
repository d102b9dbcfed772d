"""The README's two commands and what CI counts: the first command sets up training and nothing else;
the test command sets up everything the tests need and runs every test, the slow ones included, in one
session with a deadline; and a test that does not run (a skip for anything but a missing GPU or an absent
../shared, an xfail, a test left out) fails the run."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from gpu_check import GPU_SKIP_REASON, machine_has_gpu
from shared_data import SHARED_SKIP_REASON

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
    # one pytest session over everything (no -m: no time budget that drops the slow tests), with durations
    runs = re.findall(r"^\s*\.venv/bin/python -m pytest (.*)$", script, re.M)
    assert runs == ['--durations=50 "$@"'], runs
    assert "BUDGET" not in script


STRICT_PROBE = textwrap.dedent(
    """
    import pytest
    from gpu_check import GPU_SKIP_REASON
    from shared_data import SHARED_SKIP_REASON

    def test_runs():
        assert 1 + 1 == 2

    @pytest.mark.gpu
    def test_needs_a_gpu():
        pytest.skip(GPU_SKIP_REASON)

    def test_needs_shared():
        pytest.skip(SHARED_SKIP_REASON)

    def test_hidden():
        pytest.skip({reason!r})
    """
)
CI_ENV = ("DTRAIN_STRICT_SKIPS", "PYTEST_ADDOPTS")  # and every DTRAIN_INTERNAL_* and DTRAIN_TEST_* name


def _is_ci_setting(name: str) -> bool:
    return name in CI_ENV or name.startswith(("DTRAIN_INTERNAL_", "DTRAIN_TEST_"))


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without the settings of the CI run it may be part of (scripts/test.sh's)."""
    return {**{k: v for k, v in os.environ.items() if not _is_ci_setting(k)}, **extra}


def _copy_plugins(root: Path) -> None:
    for name in ("conftest.py", "gpu_check.py", "shared_data.py", "shards.py"):
        (root / name).write_text((REPO / "tests" / name).read_text())


def _probe(tmp_path: Path, reason: str, strict: str, path: str | None = None) -> subprocess.CompletedProcess:
    _copy_plugins(tmp_path)
    (tmp_path / "test_probe.py").write_text(STRICT_PROBE.format(reason=reason))
    env = _env(DTRAIN_STRICT_SKIPS=strict, PATH=path or os.environ["PATH"])
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_probe.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_skip_that_hides_a_test_fails_the_run(tmp_path):
    strict = _probe(tmp_path, "needs root (network namespaces)", "1")
    assert strict.returncode == 1, strict.stdout
    assert "test_probe.py::test_hidden: needs root (network namespaces)" in strict.stdout
    if not machine_has_gpu():
        assert "test_needs_a_gpu" not in strict.stdout.split("DTRAIN_STRICT_SKIPS")[-1]
    lenient = _probe(tmp_path, "needs root (network namespaces)", "0")
    assert lenient.returncode == 0, lenient.stdout


def test_allowed_skips_pass_the_strict_run_on_a_machine_without_a_gpu(tmp_path):
    # the canonical GPU reason passes only where there is no GPU; on a GPU machine the GPU tests must run
    r = _probe(tmp_path, SHARED_SKIP_REASON, "1")
    assert r.returncode == (1 if machine_has_gpu() else 0), r.stdout


def test_a_reason_that_only_mentions_shared_fails_the_strict_run(tmp_path):
    r = _probe(tmp_path, "needs root; the data in ../shared/data/mnist is there", "1")
    assert r.returncode == 1, r.stdout
    assert "test_probe.py::test_hidden: needs root; the data in ../shared/data/mnist is there" in r.stdout


def test_a_reason_that_starts_with_the_gpu_text_fails_the_strict_run(tmp_path):
    r = _probe(tmp_path, f"{GPU_SKIP_REASON}, and root", "1")
    assert r.returncode == 1, r.stdout
    assert f"test_probe.py::test_hidden: {GPU_SKIP_REASON}, and root" in r.stdout


def test_the_gpu_reason_without_the_gpu_marker_fails_the_strict_run(tmp_path):
    r = _probe(tmp_path, GPU_SKIP_REASON, "1")  # test_hidden: the exact reason, but no `gpu` marker
    assert r.returncode == 1, r.stdout
    assert f"test_probe.py::test_hidden: {GPU_SKIP_REASON}" in r.stdout
    assert "test_probe.py::test_needs_a_gpu" not in r.stdout.split("DTRAIN_STRICT_SKIPS")[-1] or machine_has_gpu()


XFAILS = """
    import pytest

    def test_runs():
        assert 1 + 1 == 2

    def test_known_broken():
        pytest.xfail("known to fail")

    @pytest.mark.xfail(reason="flaky")
    def test_marked():
        assert False

    @pytest.mark.xfail(reason="fixed since")
    def test_passes_anyway():
        assert True
"""


def test_an_xfail_or_an_xpass_fails_the_strict_run(tmp_path):
    strict = _collect_probe(tmp_path, {"test_x.py": XFAILS}, "1")
    assert strict.returncode == 1, strict.stdout
    tail = strict.stdout.split("DTRAIN_STRICT_SKIPS")[-1]
    assert "test_x.py::test_known_broken: xfail: known to fail" in tail, tail
    assert "test_x.py::test_marked: xfail: flaky" in tail and "test_x.py::test_passes_anyway: xpassed" in tail, tail
    assert _collect_probe(tmp_path, {"test_x.py": XFAILS}, "0").returncode == 0


def test_a_reason_that_only_mentions_a_gpu_fails_the_strict_run(tmp_path):
    r = _probe(tmp_path, "no GPU on this machine, and no root either", "1")
    assert r.returncode == 1, r.stdout
    assert "test_probe.py::test_hidden: no GPU on this machine" in r.stdout


def test_a_gpu_skip_fails_the_strict_run_where_nvidia_smi_lists_a_gpu(tmp_path):
    # a stand-in nvidia-smi that answers as one on an H100 machine does: the detection, not the GPU, is tested
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text('#!/bin/sh\n[ "$1" = -L ] && echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    fake.chmod(0o755)
    r = _probe(tmp_path, "needs ../shared/data/imagenet", "1", path=f"{bin_dir}:{os.environ['PATH']}")
    assert r.returncode == 1, r.stdout
    assert "this machine has a GPU" in r.stdout and "test_probe.py::test_needs_a_gpu: needs a CUDA GPU" in r.stdout


def _collect_probe(tmp_path: Path, files: dict[str, str], strict: str) -> subprocess.CompletedProcess:
    _copy_plugins(tmp_path)
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / "tests" / "shards.py").write_text((REPO / "tests" / "shards.py").read_text())  # test.sh's check
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "."],
        cwd=tmp_path, env=_env(DTRAIN_STRICT_SKIPS=strict), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


PASSING = "def test_runs():\n    assert 1 + 1 == 2\n"


def test_a_module_level_importorskip_fails_the_strict_run(tmp_path):
    files = {
        "test_ok.py": PASSING,
        "test_extra.py": "import pytest\npytest.importorskip('dtrain_no_such_extra', reason='needs the nope extra')\n"
        + PASSING.replace("test_runs", "test_hidden_by_the_import"),
    }
    strict = _collect_probe(tmp_path, files, "1")
    assert strict.returncode == 1, strict.stdout
    assert "test_extra.py: needs the nope extra" in strict.stdout
    assert _collect_probe(tmp_path, files, "0").returncode == 0


def test_a_conftest_that_skips_and_a_module_level_skip_fail_the_strict_run(tmp_path):
    files = {
        "test_ok.py": PASSING,
        "gcp/conftest.py": "import pytest\npytest.importorskip('dtrain_no_such_sdk', reason='needs the gcp extra')\n",
        "gcp/test_preemption.py": PASSING,
        "test_module_skip.py": "import pytest\npytest.skip('needs root', allow_module_level=True)\n" + PASSING,
    }
    strict = _collect_probe(tmp_path, files, "1")
    assert strict.returncode == 1, strict.stdout
    assert "gcp: needs the gcp extra" in strict.stdout and "test_module_skip.py: needs root" in strict.stdout


def _test_sh(tmp_path: Path, files: dict[str, str], *args: str, **env: str) -> subprocess.CompletedProcess:
    """The real scripts/test.sh in a copy of the repository's layout, around a small test directory;
    setup (scripts/setup.sh) is replaced by a no-op: it is not what this checks."""
    tmp_path = tmp_path / f"repo{len(list(tmp_path.iterdir()))}"
    tmp_path.mkdir()
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "test.sh").write_text((REPO / "scripts" / "test.sh").read_text())
    (tmp_path / "scripts" / "setup.sh").write_text("exit 0\n")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (tmp_path / ".venv" / "bin" / "python").chmod(0o755)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: a slow test\naddopts = -p no:cacheprovider\n")
    _copy_plugins(tmp_path)
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / "tests" / "shards.py").write_text((REPO / "tests" / "shards.py").read_text())  # test.sh's check
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    return subprocess.run(["bash", "scripts/test.sh", *args], cwd=tmp_path, env=_env(**env), capture_output=True,
                          text=True, timeout=120)  # fmt: skip


SLOW = "import pytest\n\n@pytest.mark.slow\ndef test_slow():\n    assert 2 * 2 == 4\n"


def test_test_sh_fails_when_a_part_collects_nothing(tmp_path):
    both = _test_sh(tmp_path, {"test_fast.py": PASSING, "test_slow.py": SLOW})
    assert both.returncode == 0, both.stdout + both.stderr
    no_slow = _test_sh(tmp_path, {"test_fast.py": PASSING})
    assert no_slow.returncode == 5, no_slow.stdout + no_slow.stderr
    assert "the whole suite collected no slow test" in no_slow.stdout
    no_default = _test_sh(tmp_path, {"test_slow.py": SLOW})
    assert no_default.returncode == 5 and "the whole suite collected no default test" in no_default.stdout


# A session fixture (a test bed) that counts its builds, a slow test first in the file, a default test after it.
ONE_SESSION = {
    "test_order.py": """
        import pytest
        from pathlib import Path

        @pytest.fixture(scope="session")
        def bed():
            with open(Path(__file__).parent / "builds.txt", "a") as f:
                f.write("built\\n")

        @pytest.mark.slow
        def test_slow_one(bed):
            print("ran: slow")

        def test_default_one(bed):
            print("ran: default")
    """,
}


def test_test_sh_runs_one_session_default_tests_first_with_durations_of_both(tmp_path):
    r = _test_sh(tmp_path, ONE_SESSION, "-s", "--durations-min=0")
    assert r.returncode == 0, r.stdout + r.stderr
    (root,) = [p for p in tmp_path.iterdir() if (p / "builds.txt").exists()]
    assert (root / "builds.txt").read_text() == "built\n"  # one session: the bed is built once
    assert r.stdout.index("ran: default") < r.stdout.index("ran: slow"), r.stdout
    durations = r.stdout.split("slowest 50 durations")[-1]
    assert "test_order.py::test_slow_one" in durations and "test_order.py::test_default_one" in durations, r.stdout
    assert "now the 1 slow tests" in r.stdout


SLEEPY = """
    import time

    def test_one():
        time.sleep(3)

    def test_two():
        time.sleep(3)

    def test_three():
        time.sleep(3)
"""


def test_test_sh_stops_at_its_deadline_fails_and_names_the_slowest_tests(tmp_path):
    files = {"test_sleepy.py": SLEEPY, "test_slow.py": SLOW}
    # the deadline counts from test.sh's start: it comes during test_one or test_two, never after test_three
    r = _test_sh(tmp_path, files, DTRAIN_TEST_DEADLINE_S="4")
    assert r.returncode != 0, r.stdout + r.stderr
    assert "DTRAIN_TEST_DEADLINE_S reached: the run stops here" in r.stdout, r.stdout
    slowest = r.stdout.split("the slowest tests so far:")[-1]
    assert "test_sleepy.py::test_one" in slowest, r.stdout
    # (each session stops at the deadline: the one that runs test_sleepy.py leaves a test not run)
    assert max(int(n) for n in re.findall(r"here, (\d+) test\(s\) not run", r.stdout)) >= 1, r.stdout


HANGING = "import time\n\ndef test_finished():\n    pass\n\ndef test_hangs():\n    time.sleep(60)\n"


def test_test_sh_interrupts_a_test_that_runs_past_the_deadline(tmp_path):
    # test_finished ends well before the deadline (5 s), test_hangs runs past it and its grace (5 s)
    r = _test_sh(tmp_path, {"test_hang.py": HANGING, "test_slow.py": SLOW}, DTRAIN_TEST_DEADLINE_S="5",
                 DTRAIN_TEST_DEADLINE_GRACE_S="5")  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert "test.sh: a test was still running 5 s after the deadline" in r.stderr, r.stderr
    assert "test_hang.py::test_finished" in r.stderr.split("the slowest finished tests:")[-1], r.stderr


def test_test_sh_fails_when_the_whole_suite_leaves_a_test_out(tmp_path):
    files = {"test_fast.py": PASSING, "test_slow.py": SLOW, "test_left.py": PASSING.replace("runs", "left_out")}
    deselected = _test_sh(tmp_path, files, PYTEST_ADDOPTS="--deselect test_left.py::test_left_out")
    assert deselected.returncode == 1, deselected.stdout + deselected.stderr
    assert "test_left.py::test_left_out: deselected: left out of the whole suite" in deselected.stdout
    ignored = _test_sh(tmp_path, files, PYTEST_ADDOPTS="--ignore=test_left.py")
    assert ignored.returncode == 1 and "test_left.py: --ignore: left out of the whole suite" in ignored.stdout
    for name in ("collect_ignore", "collect_ignore_glob"):
        sub = {**files, "sub/conftest.py": f"{name} = ['test_sub.py']\n", "sub/test_sub.py": PASSING}
        r = _test_sh(tmp_path, sub)
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"{name} = ['test_sub.py']: left out of the whole suite" in r.stdout, r.stdout
    # a selection of your own (arguments to test.sh) may leave tests out
    assert _test_sh(tmp_path, files, "--deselect", "test_left.py::test_left_out").returncode == 0


def test_test_sh_with_a_selection_needs_one_of_the_runs_to_find_tests(tmp_path):
    files = {"test_fast.py": PASSING}
    selected = _test_sh(tmp_path, files, "-k", "runs")
    assert selected.returncode == 0, selected.stdout + selected.stderr
    nothing = _test_sh(tmp_path, files, "-k", "no_such_test")
    assert nothing.returncode == 5, nothing.stdout + nothing.stderr


def test_test_sh_fails_when_a_module_skips_at_collection(tmp_path):
    skipping = "import pytest\npytest.importorskip('dtrain_no_such_extra', reason='needs an extra')\n"
    files = {"test_fast.py": PASSING, "test_slow.py": SLOW, "test_extra.py": skipping}
    r = _test_sh(tmp_path, files)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "test_extra.py: needs an extra" in r.stdout


def test_the_cli_accepts_the_variables_ci_sets(tmp_path):
    """The dtrain commands that tests run inherit test.sh's environment, and dtrain refuses a DTRAIN_* name that
    is not a setting unless it is listed as none (dtrain.common.env) or is an internal one."""
    scripts = (REPO / "scripts" / "test.sh").read_text() + (REPO / ".ci" / "run").read_text()
    names = set(re.findall(r"\b(DTRAIN_[A-Z_]+[A-Z])\b", scripts))
    assert {"DTRAIN_TEST_DEADLINE_S", "DTRAIN_TEST_DEADLINE_GRACE_S", "DTRAIN_STRICT_SKIPS"} <= names, names
    env = _env(**dict.fromkeys(names, "1"))
    p = subprocess.run([sys.executable, "-c", "from dtrain.cli.main import main; main()", "config", "show"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr


def _setup_copy(tmp_path: Path) -> Path:
    """scripts/setup.sh, pyproject.toml and setup.py in an otherwise empty checkout."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "setup.sh").write_text((REPO / "scripts" / "setup.sh").read_text())
    for name in ("pyproject.toml", "setup.py"):
        (tmp_path / name).write_text((REPO / name).read_text())
    return tmp_path


def test_setup_prints_one_line_per_step_and_the_log_when_one_fails(tmp_path):
    root = _setup_copy(tmp_path)
    log = tmp_path / "setup.log"
    env = {**os.environ, "PYTHON": "false", "DTRAIN_SETUP_LOG": str(log)}  # `false -m venv .venv` fails
    p = subprocess.run(["bash", "scripts/setup.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stdout.splitlines()[-1] == "setup: creating .venv ... FAILED (exit 1)", p.stdout
    assert f"setup: the last lines of {log}:" in p.stderr


def test_setup_with_everything_in_place_prints_one_line(tmp_path):
    root = _setup_copy(tmp_path)
    (root / ".venv" / "bin").mkdir(parents=True)
    # nothing to install: the venv's python must not even run
    (root / ".venv" / "bin" / "python").write_text('#!/bin/sh\necho "unexpected: python $*" >&2; exit 97\n')
    (root / ".venv" / "bin" / "python").chmod(0o755)
    inputs = (REPO / "pyproject.toml").read_bytes() + (REPO / "setup.py").read_bytes()  # what the stamp hashes
    digest = hashlib.sha256(inputs).hexdigest()[:12]
    (root / ".venv" / f".dtrain-setup-train-{digest}-torch==2.13.0_").touch()  # the spec and its newline
    env = {**os.environ, "DTRAIN_SETUP_LOG": str(tmp_path / "setup.log")}
    env.pop("DTRAIN_TORCH", None)
    p = subprocess.run(["bash", "scripts/setup.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.splitlines() == [f"setup: done (details in {tmp_path / 'setup.log'}). Train with: .venv/bin/dtrain "
                                     "train mnist --dataset fashion-mnist"], p.stdout  # fmt: skip


def test_the_wheel_builds_without_setuptools_warnings_and_carries_the_bundle(tmp_path):
    """The packaging names every directory it takes files from (no "absent from the packages configuration"
    warnings, 40 lines of them on a fresh machine), and the wheel holds what `dtrain up`/`build` and the
    dashboard read."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("cli", "packages", "infra", "docker"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", ".terraform*"))
    for name in (
        "Dockerfile.train",
        "Dockerfile.train.gpu",
        ".dockerignore",
        "pyproject.toml",
        "setup.py",
        "README.md",
    ):
        shutil.copy(REPO / name, src / name)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert "absent from the" not in p.stdout + p.stderr and "Warning" not in p.stdout + p.stderr, p.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = ["bundle/infra/main.tf", "bundle/infra/modules/plan/rules.json", "bundle/infra/node-startup.sh",
              "bundle/docker/entrypoint.sh", "bundle/docker/requirements.txt", "bundle/Dockerfile.train",
              "bundle/.dockerignore", "dashboard/templates/base.html", "dashboard/static/charts.js",
              "service/daemon.py"]  # fmt: skip
    for path in (f"dtrain/{w}" for w in wanted):
        assert path in names, path


# Two sessions side by side (DTRAIN_TEST_SHARDS, tests/shards.py): a bed's tests stay in one session (built once),
# the groups are balanced by tests/durations.json, the sessions overlap in time, and every test runs exactly once.
SHARDED = {
    "beds/conftest.py": """
        import pytest
        from pathlib import Path

        @pytest.fixture(scope="session")
        def bed():
            with open(Path(__file__).parent / "builds.txt", "a") as f:
                f.write("built\\n")
    """,
    "beds/test_a.py": "def test_a1(bed):\n    print('ran: a1')\n\ndef test_a2(bed):\n    print('ran: a2')\n",
    "beds/test_b.py": "def test_b1(bed):\n    print('ran: b1')\n",
    "test_heavy.py": """
        import time
        from pathlib import Path

        def test_heavy():
            print("ran: heavy")
            with open(Path(__file__).parent / "times.txt", "a") as f:
                f.write(f"heavy {time.time()} ")
                time.sleep(3)
                f.write(f"{time.time()}\\n")
    """,
    "test_light.py": """
        import time
        from pathlib import Path
        import pytest

        @pytest.mark.slow
        def test_light():
            print("ran: light")
            with open(Path(__file__).parent / "times.txt", "a") as f:
                f.write(f"light {time.time()} ")
                time.sleep(3)
                f.write(f"{time.time()}\\n")
    """,
    # the heavy file alone weighs more than the bed's tests and the light file together
    "durations.json": json.dumps(
        {"test_heavy.py::test_heavy": 100, "beds/test_a.py::test_a1": 30, "test_light.py::test_light": 20}
    ),
}


def _shard_of(out: str, name: str) -> set[str]:
    return {m for m in re.findall(rf"^\[(\d)\] .*?ran: {name}$", out, re.M)}


def test_test_sh_runs_two_sessions_side_by_side_each_bed_in_one_and_every_test_once(tmp_path):
    r = _test_sh(tmp_path, SHARDED, DTRAIN_TEST_SHARDS="2", PYTEST_ADDOPTS="-s")
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    (root,) = [p for p in tmp_path.iterdir() if (p / "beds" / "builds.txt").exists()]
    assert (root / "beds" / "builds.txt").read_text() == "built\n"  # the bed: once, in one session
    for name in ("a1", "a2", "b1", "heavy", "light"):
        assert len(re.findall(rf"^\[\d\] .*?ran: {name}$", out, re.M)) == 1, (name, out)  # every test exactly once
    heavy, bed = _shard_of(out, "heavy"), _shard_of(out, "a1") | _shard_of(out, "a2") | _shard_of(out, "b1")
    assert len(bed) == 1 and heavy != bed and _shard_of(out, "light") == bed, out  # the durations' balance
    rows = [line.split() for line in (root / "times.txt").read_text().splitlines()]
    spans = {name: (float(t0), float(t1)) for name, t0, t1 in rows}
    assert spans["heavy"][0] < spans["light"][1] and spans["light"][0] < spans["heavy"][1], spans  # they overlapped
    assert "test.sh: the slowest tests of all 2 sessions:" in out


def test_the_shard_check_fails_when_the_sessions_do_not_cover_the_collection(tmp_path):
    from shards import check

    def report(shard: int, kept: int, slow: int, collected: int = 5) -> Path:
        path = tmp_path / f"shard-{shard}.json"
        path.write_text(json.dumps({"shard": shard, "shards": 2, "collected": collected, "kept": kept,
                                    "default": kept - slow, "slow": slow}))  # fmt: skip
        return path

    assert check([report(0, 3, 1), report(1, 2, 0)], 2, True) == 0
    assert check([report(0, 3, 1), report(1, 1, 0)], 2, True) == 1  # a test in neither session
    assert check([report(0, 3, 1)], 2, True) == 1  # a session that never reported
    assert check([report(0, 3, 1), report(1, 2, 0, collected=6)], 2, True) == 1  # different collections
    assert check([report(0, 3, 0), report(1, 2, 0)], 2, True) == pytest.ExitCode.NO_TESTS_COLLECTED  # no slow test
    assert check([report(0, 3, 0), report(1, 2, 0)], 2, False) == 0  # a selection of your own may hold no slow test


MANY = """
    import pytest

    @pytest.mark.parametrize("n", range(1500))
    def test_one_of_many_with_a_name_long_enough_to_fill_a_pipe_buffer_in_the_durations_log(n):
        pass
"""


def test_test_sh_lists_the_slowest_of_a_long_run_and_still_exits_with_its_own_status(tmp_path):
    # 1,500 durations lines (~150 KB): more than a pipe holds, so `sort | head` would end in SIGPIPE (141)
    r = _test_sh(tmp_path, {"test_many.py": MANY, "test_slow.py": SLOW}, DTRAIN_TEST_SHARDS="2")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    assert "test.sh: exit 0 in" in r.stdout
    slowest = r.stdout.split("the slowest tests of all 2 sessions:")[-1].splitlines()[1:16]
    assert len(slowest) == 15 and all("::" in line for line in slowest), slowest
