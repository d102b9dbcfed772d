"""Shared fixtures: a real GCS emulator (gcp-storage-emulator) on loopback."""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
from gpu_check import GPU_SKIP_REASON, machine_has_gpu

EMULATOR_START_TIMEOUT_S = 15.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gcp-storage-emulator server (in memory) for the whole session; yields its http://host:port."""
    if importlib.util.find_spec("gcp_storage_emulator") is None:
        pytest.skip("needs gcp-storage-emulator (pip install 'dtrain[dev]')")
    port = _free_port()
    workdir = tmp_path_factory.mktemp("gcs-emulator")
    # The emulator reads HOST, PORT and STORAGE_BASE from the environment itself, and must not
    # see an emulator variable meant for its clients.
    env = {k: v for k, v in os.environ.items() if k not in ("STORAGE_EMULATOR_HOST", "HOST", "PORT")}
    env["STORAGE_BASE"] = str(workdir)
    log = open(workdir / "emulator.log", "wb")  # noqa: SIM115 - closed at teardown
    cmd = [sys.executable, "-m", "gcp_storage_emulator", "start",
           "--host", "127.0.0.1", "--port", str(port), "--in-memory", "--quiet"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + EMULATOR_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                log_text = (workdir / "emulator.log").read_text()
                pytest.fail(f"gcs emulator exited with {proc.returncode}: {log_text}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"gcs emulator not listening on :{port} after {EMULATOR_START_TIMEOUT_S}s")
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()
        log.close()


@pytest.fixture(autouse=True)
def _no_storage_emulator_leaks() -> Iterator[None]:
    """STORAGE_EMULATOR_HOST as it was before each test: a test that points this process at its emulator
    (some set os.environ for the runs they read in-process) must not point the next module's commands at an
    emulator that has since stopped, where every gs:// read is retried for minutes."""
    saved = os.environ.get("STORAGE_EMULATOR_HOST")
    yield
    if saved is None:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = saved


@pytest.fixture
def gcs_bucket(gcs_emulator: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the emulator, with STORAGE_EMULATOR_HOST pointing at it; yields gs://<bucket>/some/prefix."""
    storage = pytest.importorskip("google.cloud.storage", reason="needs google-cloud-storage")
    from google.auth.credentials import AnonymousCredentials

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator)
    name = f"dtrain-test-{uuid.uuid4().hex[:12]}"
    storage.Client(project="dtrain-test", credentials=AnonymousCredentials()).create_bucket(name)
    return f"gs://{name}/some/prefix"


# ---------------------------------------------------------------------------------------------
# CI fails on a skip that hides a test: with DTRAIN_STRICT_SKIPS=1 (scripts/test.sh sets it), a test may
# skip only for an absent ../shared, or with the canonical GPU reason on a machine that has no GPU. Skips
# at collection time count too: a module-level importorskip or a conftest.py that skips hides every test
# below it. On a machine with a GPU, a GPU skip fails: the GPU tests must run there.

SHARED_SKIP_RE = re.compile(r"\.\./shared")


def skip_is_allowed(reason: str, has_gpu: bool) -> bool:
    if SHARED_SKIP_RE.search(reason):
        return True
    return reason.startswith(GPU_SKIP_REASON) and not has_gpu


class _StrictSkips:
    """A plugin, not conftest hooks: a conftest.py's hooks do not see the report of a directory whose own
    conftest.py skipped, and that is one of the skips this must count."""

    def __init__(self) -> None:
        self.skips: list[tuple[str, str]] = []

    def _record(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skips.append((report.nodeid or ".", reason.removeprefix("Skipped: ")))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if os.environ.get("DTRAIN_STRICT_SKIPS") != "1" or not self.skips:
            return
        needs_gpu = any(reason.startswith(GPU_SKIP_REASON) for _, reason in self.skips)
        has_gpu = needs_gpu and machine_has_gpu()
        hidden = [(node, reason) for node, reason in self.skips if not skip_is_allowed(reason, has_gpu)]
        if hidden:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            lines = [f"  {node}: {reason}" for node, reason in hidden]
            why = "this machine has a GPU, so GPU tests must run; " if has_gpu else ""
            message = "\n".join([f"DTRAIN_STRICT_SKIPS: these skipped for a reason CI does not accept ({why}"
                                 "a module or conftest that skips counts too):", *lines])  # fmt: skip
            if reporter is not None:
                reporter.write_line(message, red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("dtrain-strict-skips"):
        config.pluginmanager.register(_StrictSkips(), "dtrain-strict-skips")
