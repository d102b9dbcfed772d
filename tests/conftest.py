"""Shared fixtures (a real GCS emulator, gcp-storage-emulator, on loopback) and the plugins of CI's run
(scripts/test.sh): the default tests before the slow ones in one session, a deadline, and the strict-skip check."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import types
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import shards
from gpu_check import GPU_SKIP_REASON, machine_has_gpu
from shared_data import SHARED_SKIP_REASON

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
# CI's one run. scripts/test.sh runs pytest once over everything: one collection, and a test bed with session
# scope (tests/cluster, tests/slurm) is built once. The default tests run first, so a developer sees their
# failures early; the slow ones after. With DTRAIN_INTERNAL_TEST_DEADLINE_AT (epoch seconds; test.sh sets it from
# DTRAIN_TEST_DEADLINE_S) the run stops between tests once that time has come, fails, and prints the slowest
# tests so far; with DTRAIN_INTERNAL_TEST_DURATIONS_LOG each test's seconds are appended there as it ends (test.sh reads
# it if pytest itself must be stopped). With DTRAIN_INTERNAL_FULL_SUITE=1 (test.sh without arguments) the run must hold
# default and slow tests both: a part that vanished (a bad marker) is pytest's "no tests collected", exit 5.

DEADLINE_AT = "DTRAIN_INTERNAL_TEST_DEADLINE_AT"
DURATIONS_LOG = "DTRAIN_INTERNAL_TEST_DURATIONS_LOG"
FULL_SUITE = "DTRAIN_INTERNAL_FULL_SUITE"
SHARD = "DTRAIN_INTERNAL_SHARD"  # K/N: this session runs shard K of N (tests/shards.py)
SHARD_REPORT = "DTRAIN_INTERNAL_SHARD_REPORT"  # where it says what it kept
SLOWEST_SHOWN = 15


def _is_slow(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is not None


class _CiRun:
    def __init__(self) -> None:
        self.session: pytest.Session | None = None
        self.seconds: dict[str, float] = {}
        deadline = os.environ.get(DEADLINE_AT)
        self.deadline = float(deadline) if deadline else None
        self.log = os.environ.get(DURATIONS_LOG)
        self.parts = (0, 0)  # default tests, slow tests
        self.slow_ids: set[str] = set()
        self.in_slow_part = False
        self.stopped: str | None = None

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.session = session

    @pytest.hookimpl(trylast=True)  # after -m/-k selection and pytest's own ordering
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        if spec := os.environ.get(SHARD):
            # not a deselection: the other shards run the rest, and test.sh checks that together they ran it all
            items[:] = shards.keep(items, spec, os.environ.get(SHARD_REPORT))
        items.sort(key=_is_slow)  # stable: each part keeps the collection order

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.slow_ids = {item.nodeid for item in session.items if _is_slow(item)}
        self.parts = (len(session.items) - len(self.slow_ids), len(self.slow_ids))

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        if nodeid in self.slow_ids and not self.in_slow_part and self.session is not None:
            self.in_slow_part = True
            if self.parts[0] and (reporter := self.session.config.pluginmanager.get_plugin("terminalreporter")):
                failed = len(reporter.stats.get("failed", [])) + len(reporter.stats.get("error", []))
                reporter.write_line(f"dtrain: the {self.parts[0]} default tests are done ({failed} failed or in "
                                    f"error); now the {self.parts[1]} slow tests")  # fmt: skip

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        if report.when == "teardown" and self.log:
            with open(self.log, "a") as f:
                f.write(f"{self.seconds[report.nodeid]:.2f} {report.nodeid}\n")

    def pytest_runtest_logfinish(self) -> None:
        if self.deadline is not None and self.session is not None and time.time() >= self.deadline:
            left = len(self.session.items) - len(self.seconds)
            self.stopped = f"DTRAIN_TEST_DEADLINE_S reached: the run stops here, {left} test(s) not run"
            self.session.shouldstop = self.stopped

    def slowest(self) -> list[str]:
        ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])[:SLOWEST_SHOWN]
        return [f"  {secs:8.1f} s  {nodeid}" for nodeid, secs in ranked]

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.stopped:
            terminalreporter.write_line(f"{self.stopped}; the slowest tests so far:", red=True)
            for line in self.slowest():
                terminalreporter.write_line(line)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if os.environ.get(SHARD) and session.exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and session.items == []:
            session.exitstatus = pytest.ExitCode.OK  # a shard left with nothing: test.sh checks the shards cover all
        if self.stopped and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.INTERRUPTED
        whole_here = os.environ.get(FULL_SUITE) == "1" and not os.environ.get(SHARD)  # else: test.sh checks the shards
        if whole_here and not session.shouldstop and not all(self.parts):
            missing = "default" if not self.parts[0] else "slow"
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"dtrain: the whole suite collected no {missing} test (a marker or a conftest "
                                    "that hides them?): a failure, like pytest's exit 5", red=True)  # fmt: skip
            session.exitstatus = pytest.ExitCode.NO_TESTS_COLLECTED


# ---------------------------------------------------------------------------------------------
# CI fails on a test that does not run: with DTRAIN_STRICT_SKIPS=1 (scripts/test.sh sets it), a test may skip
# only with tests/shared_data.py's exact reason for an absent ../shared, or, on a machine that has no GPU, with
# tests/gpu_check.py's exact GPU reason when it is marked `gpu`. Skips at collection time count too: a
# module-level importorskip or a conftest.py that skips hides every test below it. On a machine with a GPU, a
# GPU skip fails: the GPU tests must run there. An xfail (marker or imperative) or an xpass fails too: a known
# failure is a failure. And in the whole suite (DTRAIN_INTERNAL_FULL_SUITE=1) nothing may be left out: a deselected test
# (-k, -m or --deselect, from PYTEST_ADDOPTS or the ini file), an --ignore, a conftest's collect_ignore.


def skip_is_allowed(reason: str, gpu_marked: bool, has_gpu: bool) -> bool:
    if reason == SHARED_SKIP_REASON:
        return True
    return reason == GPU_SKIP_REASON and gpu_marked and not has_gpu


class _StrictSkips:
    """A plugin, not conftest hooks: a conftest.py's hooks do not see the report of a directory whose own
    conftest.py skipped, and that is one of the skips this must count."""

    def __init__(self) -> None:
        self.skips: list[tuple[str, str, bool]] = []  # node, reason, whether it is marked gpu
        self.xfails: dict[str, str] = {}
        self.left_out: list[str] = []

    def _record(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        node = report.nodeid or "."
        if hasattr(report, "wasxfail"):
            self.xfails.setdefault(node, "xpassed" if report.passed else f"xfail: {report.wasxfail}".rstrip(": "))
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skips.append((node, reason.removeprefix("Skipped: "), "gpu" in getattr(report, "keywords", {})))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.left_out += [f"{item.nodeid}: deselected" for item in items]

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        option = session.config.option
        self.left_out += [f"{p}: --ignore" for p in getattr(option, "ignore", None) or []]
        self.left_out += [f"{p}: --ignore-glob" for p in getattr(option, "ignore_glob", None) or []]
        plugins = session.config.pluginmanager.get_plugins()
        conftests = [
            p for p in plugins if isinstance(p, types.ModuleType) and Path(p.__file__ or "").name == "conftest.py"
        ]
        for conftest, name in ((c, n) for c in conftests for n in ("collect_ignore", "collect_ignore_glob")):
            if getattr(conftest, name, None):
                self.left_out.append(f"{conftest.__file__}: {name} = {getattr(conftest, name)!r}")

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if os.environ.get("DTRAIN_STRICT_SKIPS") != "1":
            return
        needs_gpu = any(reason == GPU_SKIP_REASON and marked for _, reason, marked in self.skips)
        has_gpu = needs_gpu and machine_has_gpu()
        hidden = [(node, reason) for node, reason, marked in self.skips if not skip_is_allowed(reason, marked, has_gpu)]
        hidden += list(self.xfails.items())
        if os.environ.get(FULL_SUITE) == "1":
            hidden += [(entry, "left out of the whole suite") for entry in self.left_out]
        if hidden:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            lines = [f"  {node}: {reason}" for node, reason in hidden]
            why = "this machine has a GPU, so GPU tests must run; " if has_gpu else ""
            message = "\n".join([f"DTRAIN_STRICT_SKIPS: these did not run for a reason CI does not accept ({why}"
                                 "a module or conftest that skips counts too):", *lines])  # fmt: skip
            if reporter is not None:
                reporter.write_line(message, red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # a shard is a background job of test.sh, and a shell starts those with SIGINT ignored: Python then never
        # turns SIGINT into KeyboardInterrupt, and the deadline's SIGINT could not make pytest tear its beds down
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if not config.pluginmanager.has_plugin("dtrain-strict-skips"):
        config.pluginmanager.register(_StrictSkips(), "dtrain-strict-skips")
    if not config.pluginmanager.has_plugin("dtrain-ci-run"):
        config.pluginmanager.register(_CiRun(), "dtrain-ci-run")
