"""checkov over infra/: no failed check, and exactly the reviewed inline skips.

checkov lives in its own virtualenv (.venv-tools, made by scripts/infra-tools.sh) because it pins
dozens of packages that would clash with the project's own."""

from __future__ import annotations

import json
import subprocess

import pytest

from .hcl import INFRA, REPO

CHECKOV = REPO / ".venv-tools" / "bin" / "checkov"
CHECKOV_TIMEOUT_S = 180

# Each skip is inline in the .tf with its reason (#checkov:skip=ID:reason); a new one must be
# reviewed here too.
EXPECTED_SKIPS = {
    ("CKV_GCP_34", "google_compute_instance.node"),  # enable-oslogin FALSE: the per-cluster key is the access method
    ("CKV_GCP_38", "google_compute_instance.node"),  # no customer-supplied disk keys
    ("CKV_GCP_40", "google_compute_instance.node"),  # external IP by default, SSH limited by firewall
    ("CKV_GCP_62", "google_storage_bucket.checkpoints"),  # no access-log bucket; audit logs instead
    ("CKV_GCP_84", "google_artifact_registry_repository.images"),  # Google-managed keys for images
}


@pytest.fixture(scope="module")
def report() -> dict:
    if not CHECKOV.exists():
        pytest.skip(f"needs checkov in {CHECKOV} (run scripts/infra-tools.sh)")
    cmd = [str(CHECKOV), "-d", str(INFRA), "--framework", "terraform", "-o", "json", "--skip-download"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=CHECKOV_TIMEOUT_S, check=False)
    assert r.returncode in (0, 1), f"checkov crashed ({r.returncode}): {r.stderr[-2000:]}"
    data = json.loads(r.stdout)
    assert isinstance(data, dict), "expected one terraform report"
    return data


def test_no_failed_checks(report: dict):
    summary = report["summary"]
    failed = [(c["check_id"], c["resource"], c["file_path"]) for c in report["results"]["failed_checks"]]
    assert summary["failed"] == 0 and not failed, f"checkov failures: {failed}"
    assert summary["parsing_errors"] == 0
    assert summary["passed"] >= 30, f"too few checks ran ({summary['passed']}): did checkov read infra/?"


def test_skips_are_the_reviewed_ones(report: dict):
    skipped = report["results"]["skipped_checks"]
    assert {(c["check_id"], c["resource"]) for c in skipped} == EXPECTED_SKIPS
    for c in skipped:
        reason = c["check_result"].get("suppress_comment", "")
        assert len(reason) > 20, f"{c['check_id']} on {c['resource']} is skipped without a reason"
