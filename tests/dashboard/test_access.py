"""A dashboard bound to an address other than loopback: every request needs the token, which is made
once, kept 0600 and printed only when made; it never shows up in what the server logs."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import httpx

from dtrain.dashboard.auth import COOKIE

from .tools import dashboard_env


def test_a_non_local_bind_refuses_requests_without_the_token(dashboard, finished_runs: Path, tmp_path: Path) -> None:
    server = dashboard(finished_runs, "--host", "0.0.0.0")
    token_file = tmp_path / "config" / "dtrain" / "dashboard-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32
    url = server.url.replace("0.0.0.0", "127.0.0.1")
    run_id = sorted(p.name for p in finished_runs.iterdir())[0]

    with httpx.Client(base_url=url, timeout=60, follow_redirects=False) as c:
        for path in ("/api/v1/runs", f"/api/v1/runs/{run_id}/metrics", f"/api/v1/runs/{run_id}/stream", "/",
                     f"/runs/{run_id}", "/docs", "/api/v1/openapi.json", "/static/charts.js"):  # fmt: skip
            assert c.get(path).status_code == 401, path
        assert c.get("/api/v1/runs", headers={"Authorization": "Bearer " + "x" * len(token)}).status_code == 401
        assert c.get("/api/v1/runs", headers={"Authorization": f"Bearer {token}"}).status_code == 200
        assert c.get("/", params={"token": token[:-1]}).status_code == 401

        # The one-time link: a cookie, and the browser sent on to the page without the token.
        login = c.get(f"/runs/{run_id}", params={"token": token})
        assert login.status_code == 303 and login.headers["location"] == f"/runs/{run_id}"
        cookie = login.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and token not in cookie
        session = login.cookies[COOKIE]
        assert c.get(f"/runs/{run_id}", headers={"Cookie": f"{COOKIE}={session}"}).status_code == 200
        assert c.get("/api/v1/runs", headers={"Cookie": f"{COOKIE}={session}"}).status_code == 200
        forged = session[:-1] + ("1" if session.endswith("0") else "0")
        assert c.get("/api/v1/runs", headers={"Cookie": f"{COOKIE}={forged}"}).status_code == 401

        # The state-changing endpoints: refused without the token like the pages, before they act (no
        # evaluation starts: nothing is written under the runs).
        c.cookies.clear()  # the jar holds the session the sign-in above set
        before = sorted(p.relative_to(finished_runs) for p in finished_runs.rglob("*"))
        writes = [("POST", "/api/v1/evals", {"run": run_id}),
                  ("POST", "/api/v1/jobs", {"workload": "mnist", "settings": {"mnist.epochs": 1}}),
                  ("DELETE", "/api/v1/jobs/7", None)]  # fmt: skip
        wrong = {"Authorization": "Bearer " + "x" * len(token)}
        for method, path, body in writes:
            for headers in ({}, wrong, {"Cookie": f"{COOKIE}={forged}"}):
                r = c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401 and r.json() == {"detail": "this dashboard needs its token"}, (method, r)
            # a signed-in browser's cookie does not let another site's page make it act
            cross = c.request(method, path, json=body, headers={"Cookie": f"{COOKIE}={session}",
                                                                "Origin": "http://attacker.example"})  # fmt: skip
            assert cross.status_code == 403, (method, path, cross.text)
        time.sleep(0.5)
        assert sorted(p.relative_to(finished_runs) for p in finished_runs.rglob("*")) == before
        # With the token they pass the guard and answer for themselves: no such run, no Slurm here.
        bearer = {"Authorization": f"Bearer {token}"}
        assert c.post("/api/v1/evals", json={"run": "no-such-run"}, headers=bearer).status_code == 404
        for method, path, body in writes[1:]:
            answer = c.request(method, path, json=body, headers=bearer)
            assert answer.status_code == 400 and "lacks a job queue" in answer.json()["detail"], answer.text

    assert server.stop() == 0
    logged = server.output
    # Printed once, in the sign-in link, when it was made; the access log has paths only.
    assert logged.count(token) == 1 and f"?token={token}" in logged, logged
    assert f"GET /runs/{run_id} 303" in logged and "GET /api/v1/runs 401" in logged

    # A second start uses the same token and does not print it.
    again = dashboard(finished_runs, "--host", "0.0.0.0", env=dashboard_env(tmp_path))
    with httpx.Client(base_url=again.url.replace("0.0.0.0", "127.0.0.1"), timeout=60) as c:
        assert c.get("/api/v1/runs", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    assert again.stop() == 0
    assert token not in again.output and str(token_file) in again.output


def test_a_token_readable_by_others_is_refused(dashboard, finished_runs: Path, tmp_path: Path) -> None:
    token_file = tmp_path / "config" / "dtrain" / "dashboard-token"
    token_file.parent.mkdir(parents=True)
    token_file.write_text("t" * 43 + "\n")
    token_file.chmod(0o644)
    server = dashboard(finished_runs, "--host", "0.0.0.0", ready=False)
    assert server.wait(120) == 2
    errors = [ln for ln in server.lines if ln.startswith("error:")]
    assert errors == [f"error: {token_file} is readable by other users (mode 644): chmod 600 it, or pass "
                      "--new-token to replace it\n"], server.output  # fmt: skip
