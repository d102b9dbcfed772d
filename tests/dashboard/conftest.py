"""Fixtures for the dashboard's tests (tools.py drives the processes): dashboard servers stopped at the
end of each test, MNIST data and two finished runs made once per session, and Debian's chromium
through Playwright."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import write_dataset
from runs import isolated_env

from .tools import (
    CHROMIUM,
    CHROMIUM_ARGS,
    TEST_IMAGES,
    TRAIN_IMAGES,
    Server,
    dashboard_env,
    start_dashboard,
    train_argv,
)


@pytest.fixture
def dashboard(tmp_path: Path) -> Iterator:
    """start(output, *args, env=None) -> a ready Server; every one started is stopped at the end."""
    started: list[Server] = []

    def start(output: str | Path, *args: str, env: dict[str, str] | None = None, ready: bool = True) -> Server:
        server = start_dashboard(tmp_path, output, *args, env=env or dashboard_env(tmp_path))
        started.append(server)
        return server.wait_ready() if ready else server

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def mnist_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("dashboard-data"), TRAIN_IMAGES, TEST_IMAGES)


@pytest.fixture(scope="session")
def finished_runs(mnist_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An output directory holding two completed MNIST runs (2 epochs each, different seeds)."""
    out = tmp_path_factory.mktemp("finished") / "runs"
    for seed in ("0", "1"):
        p = subprocess.run(
            [*train_argv(mnist_data, out, 2), "--seed", seed],
            cwd=out.parent,
            env=isolated_env(out.parent),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert p.returncode == 0, p.stdout + p.stderr
    return out


@pytest.fixture(scope="session")
def browser() -> Iterator:
    """Debian's chromium, headless, through Playwright (whose own browser download is not used)."""
    if not Path(CHROMIUM).exists():
        pytest.skip("needs Debian's chromium (scripts/setup.sh --dev installs it)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (the dev extra)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, tmp_path: Path) -> Iterator:
    """A fresh browser context and page; its console errors fail the test."""
    context = browser.new_context(viewport={"width": 1280, "height": 1600})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    context.close()
    assert not errors, errors
