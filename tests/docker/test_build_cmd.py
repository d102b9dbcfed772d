"""`dtrain build`: its plan (tags from the commit and a content hash) and every error path, each one line with
the fix: no daemon, a bad build argument, a base image that cannot be pulled, missing Google credentials, a
registry that cannot be reached. Then a real build, and a real push to a registry (Debian's docker-registry)
that the pushed tags are read back from.

The tests without a daemon run everywhere; the rest need root (to start dockerd) or a running daemon.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

import imagetest as d
import pytest
from runs import isolated_env

from dtrain.common.errors import ExitCode
from dtrain.control import images as build_cmd

REPO = d.REPO


def dtrain_build(*args: str, env: dict[str, str] | None = None, timeout: float = 1500) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*d.CLI, "build", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"},
        check=False,
    )


def error_line(p: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in p.stderr, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, p.stdout[-3000:] + p.stderr
    return " ".join(lines[0].split())


# -- the plan, without a daemon ----------------------------------------------------------------------


@pytest.fixture
def context(tmp_path: Path) -> Path:
    """A copy of what the image is built from."""
    for rel in ("Dockerfile.train", "Dockerfile.train.gpu", ".dockerignore"):
        shutil.copy2(REPO / rel, tmp_path / rel)
    for rel in ("docker", "packages/common", "packages/mnist", "packages/lora"):
        shutil.copytree(REPO / rel, tmp_path / rel, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "wheels").mkdir()
    (tmp_path / "README.md").write_text("not in the image\n")
    return tmp_path


def test_content_hash_follows_what_goes_into_the_image(context: Path) -> None:
    args = {"BASE_IMAGE": "dtrain-base:bookworm"}
    first = build_cmd.content_hash(context, "Dockerfile.train", args)
    assert len(first) == 12 and first == build_cmd.content_hash(context, "Dockerfile.train", dict(args))
    files = build_cmd.context_files(context, "Dockerfile.train")
    assert "packages/mnist/train.py" in files and "docker/entrypoint.sh" in files
    assert "README.md" not in files and not any("__pycache__" in f for f in files)
    # A file outside the context changes nothing; the code, the build arguments and the Dockerfile do.
    (context / "README.md").write_text("changed\n")
    assert build_cmd.content_hash(context, "Dockerfile.train", args) == first
    assert build_cmd.content_hash(context, "Dockerfile.train", {"BASE_IMAGE": "other:1"}) != first
    assert build_cmd.content_hash(context, "Dockerfile.train.gpu", args) != first
    with (context / "packages/mnist/train.py").open("a") as f:
        f.write("# a change\n")
    assert build_cmd.content_hash(context, "Dockerfile.train", args) != first


def test_plan_tags_and_names(context: Path) -> None:
    plan = build_cmd.make_plan(context, False, {}, "127.0.0.1:5000/dtrain")
    assert plan.name == "dtrain-train" and plan.tags[-1].startswith("src-")
    assert plan.remote_repo() == "127.0.0.1:5000/dtrain/dtrain-train"
    assert build_cmd.make_plan(context, True, {}, None).name == "dtrain-train-gpu"
    # This checkout is a git repository: the commit is a tag too, marked dirty when the image's files changed.
    tags = build_cmd.make_plan(REPO, False, {}, None).tags
    assert len(tags) == 2 and tags[0].startswith("git-") and len(tags[0].split("-")[1]) == 12, tags


def test_a_torch_wheel_in_wheels_replaces_the_index(context: Path) -> None:
    assert build_cmd.default_build_args(context, False, {}) == {}
    (context / "wheels" / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    assert build_cmd.default_build_args(context, False, {}) == {"TORCH_INDEX_URL": ""}
    assert build_cmd.default_build_args(context, True, {}) == {}  # the GPU image needs the CUDA index


def test_no_daemon(tmp_path: Path) -> None:
    env = isolated_env(tmp_path, DOCKER_HOST=f"unix://{tmp_path}/no-docker.sock")
    p = dtrain_build("--no-push", "--base-image", "dtrain-base:bookworm", env=env)
    assert p.returncode == ExitCode.FAILURE
    assert error_line(p) == (
        f"error: cannot reach a Docker daemon at unix://{tmp_path}/no-docker.sock: start it (sudo systemctl start "
        "docker, or Docker Desktop), or point DOCKER_HOST at one"
    )


def test_unknown_build_arg_is_refused_before_building(tmp_path: Path) -> None:
    p = dtrain_build("--no-push", "--build-arg", "TORCH_VERISON=2.4.0", env=isolated_env(tmp_path))
    assert p.returncode == ExitCode.USAGE
    assert error_line(p) == (
        "error: --build-arg TORCH_VERISON: Dockerfile.train has no ARG TORCH_VERISON "
        "(it takes: BASE_IMAGE, TORCH_VERSION, TORCH_INDEX_URL, UID)"
    )
    p = dtrain_build("--no-push", "--build-arg", "oops", env=isolated_env(tmp_path))
    assert p.returncode == ExitCode.USAGE and "expected NAME=VALUE" in error_line(p)


def test_registry_needed_and_checked(tmp_path: Path) -> None:
    p = dtrain_build(env=isolated_env(tmp_path))
    assert p.returncode == ExitCode.USAGE
    assert error_line(p) == (
        "error: no registry to push to: pass --registry HOST/PATH or --cluster NAME (a cluster `dtrain up` made), "
        "or build with --no-push"
    )
    p = dtrain_build("--registry", "https://Example.com/x", env=isolated_env(tmp_path))
    assert p.returncode == ExitCode.USAGE and "is not a registry path" in error_line(p)


def test_registry_from_the_cluster_record(tmp_path: Path) -> None:
    from dtrain.control.gcp.record import write_record

    env = isolated_env(tmp_path, XDG_CONFIG_HOME=str(tmp_path / "config"))
    os.environ["XDG_CONFIG_HOME"], old = str(tmp_path / "config"), os.environ.get("XDG_CONFIG_HOME")
    try:
        write_record(
            {
                "name": "demo",
                "backend": "gcp",
                "zone": "us-central1-a",
                "bucket": "gs://b",
                "ssh_user": "dtrain",
                "registry": "us-central1-docker.pkg.dev/proj/dtrain-demo",
                "nodes": [
                    {"name": "demo-master", "role": "master", "internal_ip": "10.0.0.2", "external_ip": "", "gpus": 0}
                ],
            }  # fmt: skip
        )
    finally:
        if old is None:
            del os.environ["XDG_CONFIG_HOME"]
        else:
            os.environ["XDG_CONFIG_HOME"] = old
    (tmp_path / "dtrain.toml").write_text('[clusters.demo]\nbackend = "gcp"\nproject = "proj-123456"\n')
    # No Google credentials here: the registry came from the record, and the push is refused before any build.
    env["GOOGLE_APPLICATION_CREDENTIALS"] = str(tmp_path / "missing-key.json")
    p = subprocess.run(
        [*d.CLI, "build", "--cluster", "demo"], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    assert p.returncode == ExitCode.USAGE, p.stdout + p.stderr
    key = tmp_path / "missing-key.json"
    assert error_line(p).startswith(
        f"error: GOOGLE_APPLICATION_CREDENTIALS={key} is not a usable credentials file to push to "
        "us-central1-docker.pkg.dev ("
    )


def test_google_registry_without_credentials(tmp_path: Path) -> None:
    env = isolated_env(tmp_path, GOOGLE_APPLICATION_CREDENTIALS=str(tmp_path / "missing-key.json"))
    p = dtrain_build("--registry", "europe-west4-docker.pkg.dev/proj/repo", env=env)
    assert p.returncode == ExitCode.USAGE
    assert error_line(p) == (
        f"error: GOOGLE_APPLICATION_CREDENTIALS={tmp_path / 'missing-key.json'} is not a usable credentials file to "
        "push to europe-west4-docker.pkg.dev (DefaultCredentialsError): point it at a service-account key file, or "
        "unset it and run gcloud auth application-default login, or build with --no-push"
    )
    no_adc = isolated_env(
        tmp_path, HOME=str(tmp_path), CLOUDSDK_CONFIG=str(tmp_path / "gcloud"), GCE_METADATA_HOST="127.0.0.1:9"
    )
    p = dtrain_build("--registry", "europe-west4-docker.pkg.dev/proj/repo", env=no_adc)
    assert p.returncode == ExitCode.USAGE
    assert error_line(p) == (
        "error: no Google credentials to push to europe-west4-docker.pkg.dev: run gcloud auth application-default "
        "login (or set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file), or build with --no-push"
    )


def test_google_auth_gives_the_token_to_docker_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The push authenticates as oauth2accesstoken with the refreshed token (a fake credential here)."""
    import google.auth

    class Creds:
        token = None

        def refresh(self, _request: object) -> None:
            self.token = "ya29.secret-token"

    seen = {}

    def default(scopes: list[str]) -> tuple[Creds, str]:
        seen["scopes"] = scopes
        return Creds(), "proj"

    monkeypatch.setattr(google.auth, "default", default)
    auth = build_cmd.registry_auth("us-central1-docker.pkg.dev/proj/repo")
    assert auth == {"username": "oauth2accesstoken", "password": "ya29.secret-token"}
    assert seen["scopes"] == ["https://www.googleapis.com/auth/cloud-platform"]
    assert build_cmd.registry_auth("127.0.0.1:5000/dtrain") is None  # not Google's: docker's own login


# -- against the real daemon -------------------------------------------------------------------------


@pytest.mark.root
def test_base_image_that_cannot_be_pulled(dockerd: d.Daemon) -> None:
    p = dtrain_build("--no-push", "--base-image", "dtrain-test/no-such-base:1", timeout=300)
    assert p.returncode == ExitCode.FAILURE, p.stdout[-2000:] + p.stderr
    line = error_line(p)
    assert line.startswith("error: Dockerfile.train step 2/"), line
    assert "the base image dtrain-test/no-such-base:1 could not be pulled (" in line
    assert line.endswith(
        "pass --base-image with one this daemon has or can pull (offline: sudo scripts/docker-base.sh makes "
        "dtrain-base:bookworm)"
    )


@pytest.mark.root
@pytest.mark.slow
def test_bad_torch_version_fails_at_its_step(train_image: str) -> None:
    p = dtrain_build("--no-push", "--base-image", d.BASE_TAG, "--build-arg", "TORCH_VERSION=0.0.1+cpu", timeout=600)
    assert p.returncode == ExitCode.FAILURE, p.stdout[-2000:] + p.stderr
    line = error_line(p)
    assert line.startswith("error: Dockerfile.train step "), line
    assert "No matching distribution found for torch==0.0.1+cpu" in line
    assert "TORCH_VERSION must exist on TORCH_INDEX_URL, or as a wheel in wheels/" in line


@pytest.mark.root
@pytest.mark.slow
def test_build_is_tagged_and_runs(train_image: str) -> None:
    """The image the session built: tagged by commit and content, non-root, torchrun as the entry point."""
    tags = json.loads(d.docker("image", "inspect", "--format", "{{json .RepoTags}}", train_image).stdout)
    assert train_image in tags and "dtrain-train:latest" in tags
    assert any(t.startswith("dtrain-train:git-") for t in tags), tags
    cfg = json.loads(d.docker("image", "inspect", "--format", "{{json .Config}}", train_image).stdout)
    assert cfg["User"] == "1000:1000" and cfg["Entrypoint"] == ["/usr/local/lib/dtrain/entrypoint.sh"]
    assert cfg["Healthcheck"]["Test"][-1] == "/usr/local/lib/dtrain/healthcheck.py"
    help_text = d.docker("run", "--rm", train_image, "--help").stdout
    assert "--nproc-per-node" in help_text and "--rdzv-endpoint" in help_text
    p = d.docker("run", "--rm", "--entrypoint", "python3", train_image, "-c",
                 "import dtrain.cli", check=False)  # fmt: skip
    assert p.returncode == 1 and "No module named 'dtrain.cli'" in p.stderr  # the CLI is not in the image
    p = d.docker("run", "--rm", "--entrypoint", "python3", train_image, "-c",
                 "import google.cloud.compute", check=False)  # fmt: skip
    assert p.returncode == 1  # nor the CLI's cloud SDKs
    # A second build of the same sources is a cache hit with the same content tag.
    tag, out = d.build_train_image()
    assert tag == train_image and "Using cache" in out


@pytest.mark.root
@pytest.mark.slow
def test_push_to_an_unreachable_registry(train_image: str) -> None:
    p = dtrain_build("--registry", f"127.0.0.1:{d.free_port()}/dtrain", "--base-image", d.BASE_TAG, timeout=600)
    assert p.returncode == ExitCode.FAILURE, p.stdout[-2000:] + p.stderr
    line = error_line(p)
    assert line.startswith("error: cannot reach the registry 127.0.0.1:"), line
    assert line.endswith("check the address and this machine's network, or build with --no-push")


@pytest.mark.root
@pytest.mark.slow
def test_push_to_a_real_registry(train_image: str, registry: str) -> None:
    p = dtrain_build("--registry", f"{registry}/dtrain", "--base-image", d.BASE_TAG, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr
    pushed = [ln for ln in p.stdout.splitlines() if ln.startswith("pushed ") and "@sha256:" in ln]
    assert pushed == [f"pushed {registry}/dtrain/dtrain-train@{pushed[0].rsplit('@', 1)[1]}"], p.stdout[-2000:]
    with urllib.request.urlopen(f"http://{registry}/v2/dtrain/dtrain-train/tags/list", timeout=10) as r:
        tags = set(json.load(r)["tags"])
    src = train_image.split(":", 1)[1]
    assert src in tags and any(t.startswith("git-") for t in tags), tags
