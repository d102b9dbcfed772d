"""A project's dependencies on a node (dtrain.common.deps): real venvs and real pip installs from this
machine's package index, built once per key, reused, and removed when a step fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.common import deps
from dtrain.common.deps import DepsError, Requirements, ensure_env, env_key, requirements_of
from dtrain.common.errors import ExitCode

# Small, pure Python, and in neither this venv nor the interpreter it was made from, so pip really installs it.
PACKAGE = "termcolor"
MISSING = "dtrain-no-such-package-xyz==1.0"
# The test venv: torch is installed here, and an env made on top of it must see it.
BASE_PYTHON = sys.executable


@pytest.fixture(scope="session")
def package_index(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Skips when pip cannot reach a package index from here (the one reason these tests cannot run)."""
    dest = tmp_path_factory.mktemp("pip-download")
    cmd = [BASE_PYTHON, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(dest), PACKAGE]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        last = (r.stdout + r.stderr).strip().splitlines()[-1:]
        pytest.skip(f"the package index is unreachable: pip download {PACKAGE} failed: {last}")


def project(path: Path, requirements: str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "train.py").write_text("print('hi')\n")
    if requirements is not None:
        (path / "requirements.txt").write_text(requirements)
    return path


def quiet(_msg: str) -> None:
    pass


def step_names(log_file: str) -> list[str]:
    """The steps a log shows, from their header lines: '==== <time> <step>: <argv>'."""
    lines = Path(log_file).read_text().splitlines()
    return [line.split(" ", 2)[2].split(": ", 1)[0] for line in lines if line.startswith("==== ")]


# --- what to install, and the key -----------------------------------------------------------------


def test_requirements_txt_drops_comments_and_inlines_includes(tmp_path: Path):
    code = project(tmp_path / "code", "# pinned\nrequests>=2  # http\n\n-r extra.txt\n")
    (code / "extra.txt").write_text("six==1.17.0\n")
    reqs = requirements_of(code)
    assert reqs.source == "requirements.txt"
    assert reqs.lines == ["requests>=2", "-r extra.txt", "six==1.17.0"]
    assert reqs.pip_args() == ["-r", "requirements.txt"]


def test_pyproject_dependencies_when_there_is_no_requirements_txt(tmp_path: Path):
    code = project(tmp_path / "code")
    (code / "pyproject.toml").write_text('[project]\nname = "x"\ndependencies = ["six", "tqdm[notebook]>=4"]\n')
    assert requirements_of(code) == Requirements(lines=["six", "tqdm[notebook]>=4"], source="pyproject.toml")
    (code / "requirements.txt").write_text("termcolor\n")
    assert requirements_of(code).lines == ["termcolor"]


def test_nothing_to_install(tmp_path: Path):
    assert not requirements_of(project(tmp_path / "a"))
    assert not requirements_of(project(tmp_path / "b", "# nothing yet\n\n"))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "pyproject.toml").write_text('[project]\nname = "x"\n[tool.x]\ndependencies = ["six"]\n')
    assert not requirements_of(tmp_path / "c")


def test_toml_fallback_reads_what_tomllib_reads():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    text = """
[build-system]
requires = ["setuptools"]

[project]  # the project
name = "x"
dependencies = [
  "torch>=2.4",  # a comment with "quotes" and ]
  'numpy; python_version < "3.12"',
  "tqdm[notebook]",
  '''triple''',
]

[project.optional-dependencies]
dev = ["pytest"]
"""
    assert deps._toml_dependencies_fallback(text) == tomllib.loads(text)["project"]["dependencies"]
    assert deps._toml_dependencies_fallback('[project]\nname = "x"\n') == []


def test_key_follows_content_setup_and_interpreter(tmp_path: Path):
    code = project(tmp_path / "code", "six\n-r more.txt\n")
    (code / "more.txt").write_text("termcolor==3.3.0\n")
    key = env_key(requirements_of(code), [], BASE_PYTHON)
    assert len(key) == 16 and int(key, 16) >= 0
    assert env_key(requirements_of(code), [], BASE_PYTHON) == key
    assert env_key(requirements_of(code), ["make data"], BASE_PYTHON) != key
    other_python = str(Path(sys.base_prefix) / "bin" / Path(BASE_PYTHON).name)
    if Path(other_python).exists():  # a venv's python is a link to this one: the prefix still tells them apart
        assert env_key(requirements_of(code), [], other_python) != key
    (code / "more.txt").write_text("termcolor==3.2.0\n")  # an included file counts too
    assert env_key(requirements_of(code), [], BASE_PYTHON) != key


def test_pip_failures_name_the_requirement():
    cases = {
        "ERROR: Could not find a version that satisfies the requirement foo==9 (from versions: none)": "foo==9",
        "ERROR: No matching distribution found for foo==9": "foo==9",
        "ERROR: Invalid requirement: 'foo bar': Expected end or semicolon": "foo bar",
        "  ERROR: Failed building wheel for pycairo\nFailed to build pycairo": "pycairo",
        "ERROR: Failed to build installable wheels for some pyproject.toml based projects (pycairo)": "pycairo",
    }
    for output, name in cases.items():
        assert deps._pip_failure(output)[0] == name, output
    assert deps._pip_failure("ERROR: some other trouble") is None


# --- building environments ------------------------------------------------------------------------


def test_no_requirements_means_the_base_interpreter(tmp_path: Path):
    result = ensure_env(project(tmp_path / "code"), tmp_path / "envs", base_python=BASE_PYTHON, log=quiet)
    assert result == deps.EnvResult(python=BASE_PYTHON, key="", created=False, log_file=None)
    assert not (tmp_path / "envs").exists()


@pytest.mark.slow
def test_installed_once_then_reused(tmp_path: Path, package_index: None):
    code = project(tmp_path / "code", f"{PACKAGE}\n")
    envs = tmp_path / "envs"
    first = ensure_env(code, envs, base_python=BASE_PYTHON, log=quiet)
    assert first.created and first.key and first.python == str(envs / first.key / "bin" / "python")
    assert (envs / first.key / ".dtrain-ready").exists()
    second = ensure_env(code, envs, base_python=BASE_PYTHON, log=quiet)
    assert (second.key, second.python, second.created) == (first.key, first.python, False)
    assert second.seconds < first.seconds
    assert step_names(first.log_file) == ["python -m venv", "pip install (requirements.txt)"]

    # The package comes from the new env; torch from the base venv it was made on (the node's torch).
    probe = f"import {PACKAGE}, torch, sys; print({PACKAGE}.__file__); print(torch.__file__); print(sys.prefix)"
    out = subprocess.run([first.python, "-c", probe], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0].startswith(str(envs / first.key)), out
    assert not out[1].startswith(str(envs / first.key)), out
    assert out[2] == str(envs / first.key)


@pytest.mark.slow
def test_missing_package_names_it_and_leaves_no_env(tmp_path: Path, package_index: None):
    code = project(tmp_path / "code", f"{PACKAGE}\n{MISSING}\n")
    envs = tmp_path / "envs"
    with pytest.raises(DepsError) as e:
        ensure_env(code, envs, base_python=BASE_PYTHON, node="worker-3", log=quiet)
    msg = str(e.value)
    key = env_key(requirements_of(code), [], BASE_PYTHON)
    assert "\n" not in msg
    assert MISSING in msg and "worker-3" in msg and str(envs / f"{key}.log") in msg, msg
    assert e.value.exit_code == ExitCode.USAGE
    assert not (envs / key).exists()
    assert MISSING in (envs / f"{key}.log").read_text()  # pip's own words are in the log


@pytest.mark.slow
def test_incomplete_env_is_rebuilt(tmp_path: Path):
    code = project(tmp_path / "code")
    envs = tmp_path / "envs"
    setup = ["echo built > built.txt"]
    key = env_key(requirements_of(code), setup, BASE_PYTHON)
    (envs / key / "bin").mkdir(parents=True)  # what an interrupted build leaves: no marker
    (envs / key / "half-done").write_text("")
    result = ensure_env(code, envs, setup=setup, base_python=BASE_PYTHON, log=quiet)
    assert result.created and result.key == key
    assert not (envs / key / "half-done").exists()
    assert (code / "built.txt").read_text() == "built\n"  # setup commands run in the project's directory


def cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [BASE_PYTHON, "-m", "dtrain.common.deps", "ensure", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_failing_setup_command_is_named_with_its_exit_code(tmp_path: Path):
    code = project(tmp_path / "code")
    envs = tmp_path / "envs"
    proc = cli("--code-dir", str(code), "--envs", str(envs), "--setup", "true", "--setup", "make data || exit 3")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.USAGE, err
    assert out == ""
    last = err.strip().splitlines()[-1]
    assert 'setup command 2 "make data || exit 3" exited 3' in last, err
    assert not [p for p in envs.iterdir() if p.is_dir()]


@pytest.mark.slow
def test_concurrent_callers_build_once(tmp_path: Path, package_index: None):
    code = project(tmp_path / "code", f"{PACKAGE}\n")
    envs = tmp_path / "envs"
    procs = [cli("--code-dir", str(code), "--envs", str(envs), "--node", f"n{i}") for i in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    assert sorted(r["created"] for r in results) == [False, True]
    assert len({r["python"] for r in results}) == 1
    assert step_names(results[0]["log_file"]) == ["python -m venv", "pip install (requirements.txt)"]


# --- a launch's one process per node: code sync, environment, node info ---------------------------


def test_one_process_syncs_the_code_checks_the_env_and_reports_the_node(tmp_path: Path):
    """What a launch runs on each node (dtrain.control.remote_program.deps_command): codesync's node half, then
    `ensure`, then, with nothing to install, `nodeagent info --cached`'s line, all in one process."""
    from dtrain.common import codesync

    code = project(tmp_path / "here")
    run = tmp_path / "node" / "runs" / "r1"
    run.mkdir(parents=True)
    argv = [BASE_PYTHON, "-m", "dtrain.common.deps", "ensure", "--code-dir", str(run / "work"),
            "--envs", str(tmp_path / "node" / "envs"), "--sync-dest", str(tmp_path / "node" / "code" / "p"),
            "--sync-snapshot", str(run / "work"),
            "--info-addr", "127.0.0.1", "--info-workdir", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stats = codesync.send(codesync.scan(code), proc.stdout, proc.stdin)
    proc.stdin.close()
    rest, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert stats.files_sent == 1 and (run / "work" / "train.py").read_text() == "print('hi')\n"
    env, info = (json.loads(line) for line in rest.strip().splitlines())
    assert env == {"python": BASE_PYTHON, "key": "", "created": False, "log_file": None, "seconds": 0.0}
    assert info["python"] == ".".join(map(str, sys.version_info[:3])) and info["cpus"] >= 1
    assert info["torch"], info  # this venv has torch, and the launch checks it from this line


def test_a_node_that_cannot_sync_installs_nothing(tmp_path: Path):
    """The sync's failure ends the process: one line on stderr, no environment step after it."""
    from dtrain.common import codesync

    code = project(tmp_path / "here", f"{PACKAGE}\n")
    (tmp_path / "blocked").write_text("a file where the code's folder should be\n")
    argv = [BASE_PYTHON, "-m", "dtrain.common.deps", "ensure", "--code-dir", str(tmp_path / "blocked" / "work"),
            "--envs", str(tmp_path / "envs"), "--sync-dest", str(tmp_path / "blocked" / "p")]  # fmt: skip
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with pytest.raises(Exception, match="code sync failed"):
        codesync.send(codesync.scan(code), proc.stdout, proc.stdin)
    proc.stdin.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert err.startswith("dtrain code sync: "), err
    assert not (tmp_path / "envs").exists()
