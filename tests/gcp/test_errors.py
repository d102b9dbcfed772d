"""Credentials, project resolution and the API error mapping: each a one-line UserError."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import pytest

from dtrain.common.errors import ExitCode, UserError
from dtrain.control.gcp.client import Gcp
from dtrain.control.gcp.errors import api_error
from dtrain.control.gcp.preflight import preflight
from dtrain.control.gcp.sweep import find_leftovers
from dtrain.control.gcp.vmstates import node_states

from .compute_fake import error_body, permission_denied, service_disabled
from .conftest import PROJECT, REGION


def anonymous():
    from google.auth.credentials import AnonymousCredentials

    return AnonymousCredentials()


def raised(fn, *args, **kwargs) -> UserError:
    with pytest.raises(UserError) as e:
        fn(*args, **kwargs)
    return e.value


def test_compute_api_disabled(gcp, world):
    world.fail("GET", r".*", service_disabled(PROJECT))
    err = raised(preflight, gcp, REGION, f"{REGION}-a", "nvidia-l4", 1, 4, False, 1)
    assert str(err) == (
        "Compute Engine API is not enabled in project dtrain-test: "
        "gcloud services enable compute.googleapis.com --project dtrain-test"
    )
    assert err.exit_code == ExitCode.USAGE
    # The same line from every entry point.
    assert str(raised(node_states, gcp, f"{REGION}-a", "demo")) == str(err)
    assert str(raised(find_leftovers, gcp, REGION, "demo", include_buckets=False)) == str(err)


def test_api_disabled_without_error_info_details(gcp, world):
    """Older answers carry only errors[].reason accessNotConfigured and the message."""
    body = service_disabled(PROJECT)
    del body["error"]["details"]
    world.fail("GET", r"/regions/", body)
    assert "gcloud services enable compute.googleapis.com --project dtrain-test" in str(
        raised(preflight, gcp, REGION, f"{REGION}-a", None, 0, 4, False, 1)
    )


def test_permission_denied_names_the_permission_and_a_role(gcp, world):
    world.fail(
        "GET",
        r"/regions/us-central1$",
        permission_denied("compute.regions.get", "projects/dtrain-test/regions/us-central1"),
    )
    err = raised(preflight, gcp, REGION, f"{REGION}-a", None, 0, 4, False, 1)
    assert str(err) == (
        "reading quotas of region us-central1: permission compute.regions.get denied in project dtrain-test: "
        "ask for roles/compute.viewer (gcloud projects add-iam-policy-binding dtrain-test --member=user:YOU "
        "--role=roles/compute.viewer)"
    )
    assert err.exit_code == ExitCode.USAGE


def test_permission_denied_without_a_permission_in_the_message(gcp, world):
    world.fail("GET", r"/instances$", error_body(403, "Forbidden", "forbidden", "PERMISSION_DENIED"))
    err = raised(node_states, gcp, f"{REGION}-a", "demo")
    assert str(err) == (
        "listing the VMs of cluster demo in us-central1-a: permission denied in project dtrain-test (Forbidden): "
        "check your IAM roles"
    )


def test_unknown_project(server):
    g = Gcp.connect("no-such-project", endpoint=server.endpoint, credentials=anonymous())
    err = raised(preflight, g, REGION, f"{REGION}-a", None, 0, 4, False, 1)
    assert str(err) == (
        "reading quotas of region us-central1: project no-such-project not found, or you cannot see it: "
        "check project = in dtrain.toml (gcloud projects list shows yours)"
    )
    assert err.exit_code == ExitCode.USAGE


def test_rate_limit_is_a_runtime_failure(gcp, world):
    world.fail(
        "GET",
        r"/regions/",
        error_body(429, "Quota exceeded for quota metric 'Read requests'", "rateLimitExceeded", "RESOURCE_EXHAUSTED"),
    )
    err = raised(preflight, gcp, REGION, f"{REGION}-a", None, 0, 4, False, 1)
    assert err.exit_code == ExitCode.FAILURE
    assert str(err).startswith("reading quotas of region us-central1: API rate limit reached in project dtrain-test")
    assert str(err).endswith("wait a minute and run it again (still failing after 0.5s of retries)")


def test_a_passing_server_error_is_retried(gcp, world):
    world.fail("GET", r"/zones$", error_body(503, "Backend Error", "backendError", "UNAVAILABLE"), times=1)
    assert preflight(gcp, REGION, f"{REGION}-a", None, 0, 4, False, 1).ok
    assert world.called("GET", r"/zones$") == 3  # the refused one, then its two pages


def test_a_lasting_server_error_is_a_runtime_failure(gcp, world):
    world.fail("GET", r"/zones$", error_body(503, "Backend Error", "backendError", "UNAVAILABLE"))
    err = raised(preflight, gcp, REGION, f"{REGION}-a", None, 0, 4, False, 1)
    assert err.exit_code == ExitCode.FAILURE
    assert str(err) == (
        "listing the zones of us-central1: Google Cloud answered 503 (Backend Error): run it again in a minute "
        "(still failing after 0.5s of retries)"
    )
    world.faults.clear()
    world.fail("GET", r"/zones$", error_body(500, "Internal Error", "internalError", "INTERNAL"))
    err = raised(preflight, gcp, REGION, f"{REGION}-a", None, 0, 4, False, 1)
    assert (
        str(err)
        == "listing the zones of us-central1: Google Cloud answered 500 (Internal Error): run it again in a minute"
    )


def test_endpoint_unreachable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    g = Gcp.connect(PROJECT, endpoint=f"http://127.0.0.1:{port}", credentials=anonymous())
    err = raised(preflight, g, REGION, f"{REGION}-a", None, 0, 4, False, 1)
    assert err.exit_code == ExitCode.FAILURE
    assert str(err).startswith(f"reading quotas of region us-central1: cannot reach http://127.0.0.1:{port} (")
    assert "\n" not in str(err)


def test_unknown_exceptions_are_not_swallowed():
    assert api_error(KeyError("x"), project=PROJECT, doing="x") is None


def test_explicit_project_wins(monkeypatch):
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "from-env")
    assert Gcp.connect("explicit", credentials=anonymous()).project == "explicit"
    assert Gcp.connect(None, credentials=anonymous()).project == "from-env"


def test_missing_project(monkeypatch):
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
    monkeypatch.delenv("CLOUDSDK_CORE_PROJECT", raising=False)
    err = raised(Gcp.connect, None, credentials=anonymous(), cluster="demo")
    assert str(err) == (
        'no Google Cloud project: set project = "..." under [clusters.demo] in dtrain.toml, '
        "or export GOOGLE_CLOUD_PROJECT=..."
    )
    assert err.exit_code == ExitCode.USAGE


def _adc_env(tmp_path, monkeypatch, adc: dict | None) -> None:
    """Application Default Credentials as gcloud leaves them, in a config dir of our own."""
    config = tmp_path / "gcloud"
    config.mkdir()
    if adc is not None:
        (config / "application_default_credentials.json").write_text(json.dumps(adc))
    for var in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT", "GCLOUD_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(config))
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcloud to ask for a default project
    monkeypatch.setenv("NO_GCE_CHECK", "true")


USER_ADC = {
    "type": "authorized_user",
    "client_id": "id.apps.googleusercontent.com",
    "client_secret": "not-a-secret",
    "refresh_token": "not-a-token",
}


def test_adc_without_a_project(tmp_path, monkeypatch):
    _adc_env(tmp_path, monkeypatch, USER_ADC)
    err = raised(Gcp.connect, None)
    assert str(err).startswith("no Google Cloud project: set project = ")
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "adc-project")
    g = Gcp.connect(None)
    assert g.project == "adc-project"
    assert type(g.credentials).__name__ == "Credentials"  # google.oauth2.credentials: the user's ADC


def _connect_in_subprocess(env: dict) -> subprocess.CompletedProcess:
    # A child process, because google-auth reads NO_GCE_CHECK once, at import.
    code = textwrap.dedent("""
        from dtrain.control.gcp.client import Gcp
        from dtrain.common.errors import UserError
        try:
            Gcp.connect("p")
        except UserError as e:
            print(f"{int(e.exit_code)} {e}")
    """)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_no_credentials_at_all(tmp_path, monkeypatch):
    _adc_env(tmp_path, monkeypatch, None)
    import os

    r = _connect_in_subprocess(dict(os.environ))
    assert r.stdout.strip() == (
        "2 no Google credentials: run gcloud auth application-default login "
        "(or set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file)"
    ), r.stderr


def test_a_bad_key_file_is_named_but_never_printed(tmp_path, monkeypatch):
    _adc_env(tmp_path, monkeypatch, None)
    key = tmp_path / "key.json"
    key.write_text(json.dumps({"type": "service_account", "private_key": "-----BEGIN PRIVATE KEY----- SECRET"}))
    import os

    r = _connect_in_subprocess({**os.environ, "GOOGLE_APPLICATION_CREDENTIALS": str(key)})
    out = r.stdout.strip()
    assert out.startswith(f"2 GOOGLE_APPLICATION_CREDENTIALS={key} is not a usable credentials file ("), r.stderr
    assert out.endswith(
        "point it at a service-account key file, or unset it and run gcloud auth application-default login"
    )
    assert "SECRET" not in r.stdout + r.stderr


def test_missing_libraries_give_the_install_hint(monkeypatch):
    """Every google import goes through dtrain.control.gcp.auth; without the libraries it is one line."""
    import sys

    from dtrain.control.gcp import auth

    for name in [m for m in sys.modules if m == "google" or m.startswith("google.")]:
        monkeypatch.delitem(sys.modules, name)
    for name in auth.MODULES.values():
        monkeypatch.setitem(sys.modules, name, None)  # what an import of a missing package raises on
    err = raised(Gcp.connect, "p")
    assert str(err) == (
        "the gcp backend needs the Google Cloud libraries (google.auth is missing): pip install 'dtrain[gcp]'"
    )
    assert auth.INSTALL_HINT == "pip install 'dtrain[gcp]'"


def test_storage_errors_use_the_same_mapping():
    """Cloud Storage raises the same google.api_core exceptions; the mapping is shared."""
    from google.api_core import exceptions as gexc

    denied = gexc.Forbidden(
        "GET https://storage.googleapis.com/storage/v1/b?project=p: ci@p.iam.gserviceaccount.com does not have "
        "storage.buckets.list access to the Google Cloud project.",
        errors=[{"reason": "forbidden"}],
    )
    assert str(api_error(denied, project="p", doing="listing buckets")) == (
        "listing buckets: permission storage.buckets.list denied in project p: ask for roles/storage.admin "
        "(gcloud projects add-iam-policy-binding p --member=user:YOU --role=roles/storage.admin)"
    )
    disabled = gexc.Forbidden(
        "Cloud Storage JSON API has not been used in project 42 before or it is disabled.",
        error_info={"reason": "SERVICE_DISABLED", "metadata": {"service": "storage-api.googleapis.com"}},
    )
    assert str(api_error(disabled, project="p", doing="x")) == (
        "Cloud Storage API is not enabled in project p: gcloud services enable storage-api.googleapis.com --project p"
    )


def test_refused_credentials():
    from google.auth import exceptions as auth_exc

    err = api_error(
        auth_exc.RefreshError("Reauthentication is needed. Please run `gcloud auth application-default login`."),
        project="p",
        doing="listing VMs",
    )
    assert str(err) == (
        "listing VMs: Google credentials were refused (Reauthentication is needed. Please run "
        "`gcloud auth application-default login`.): run gcloud auth application-default login"
    )
    assert err.exit_code == ExitCode.USAGE
