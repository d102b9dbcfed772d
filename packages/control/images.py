"""Training images: build Dockerfile.train(.gpu) with the Docker engine, tag it with the git commit and a
hash of what went into it, and push it to the cluster's registry (`dtrain build`).

    dtrain build --cluster demo             # Dockerfile.train -> <demo's Artifact Registry>/dtrain-train
    dtrain build --gpu --registry us-central1-docker.pkg.dev/proj/repo
    dtrain build --no-push --base-image dtrain-base:bookworm

Tags: `git-<commit>[-dirty]` and `src-<hash>`, where the hash covers every file of the build context
(what .dockerignore lets in), the Dockerfile and the build arguments: the same inputs give the same tag
on any machine, so a node that has `src-<hash>` has exactly this code. The registry is --registry, else
the `registry` of the cluster's record (`dtrain up` writes it) or of its [clusters.NAME] table. Pushes to
Google registries (*-docker.pkg.dev, gcr.io) authenticate with an access token from Application Default
Credentials; others use the Docker client's own login. The token is never printed.

The docker SDK and google-auth are imported inside the functions that use them (extras `docker` and `gcp`).
Progress is reported as events (dtrain.control.events): `build_step` (step, total, instruction), `output`
(a build line), `push_layer` (layer, current, total, status).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from dtrain.common.errors import ExitCode, UserError
from dtrain.control import backends
from dtrain.control.assets import build_context
from dtrain.control.events import Events, Handle

IMAGE_NAMES = {False: "dtrain-train", True: "dtrain-train-gpu"}
DOCKERFILES = {False: "Dockerfile.train", True: "Dockerfile.train.gpu"}
GOOGLE_REGISTRY_RE = re.compile(r"^([a-z0-9-]+-docker\.pkg\.dev|([a-z]+\.)?gcr\.io)$")
# HOST[:PORT]/PATH, lower case, no tag or scheme (what `docker push` accepts as a repository prefix).
REGISTRY_RE = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:\d{1,5})?(/[a-z0-9]+([._-][a-z0-9]+)*)*$")
DOCKER_TIMEOUT_S = 600  # one API call (a layer upload on a slow link) may take this long
HASH_CHUNK = 1 << 20
ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # the classic builder colours a step's stderr


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    root: Path  # the build context
    dockerfile: str  # relative to root
    name: str  # the image name without registry: dtrain-train[-gpu]
    buildargs: dict[str, str]
    tags: tuple[str, ...]  # git-<sha>[-dirty], src-<hash>
    registry: str | None  # HOST/PATH to push to; None: --no-push

    @property
    def local_ref(self) -> str:
        return f"{self.name}:{self.tags[-1]}"

    def remote_repo(self) -> str:
        assert self.registry is not None
        return f"{self.registry}/{self.name}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildRequest:
    gpu: bool = False  # Dockerfile.train.gpu (CUDA)
    push: bool = True
    registry: str | None = None  # HOST/PATH; None: the cluster's
    cluster: str | None = None
    config_path: Path | None = None
    base_image: str | None = None
    build_args: tuple[str, ...] = ()  # NAME=VALUE
    context: Path | None = None  # the dtrain checkout to build (default: this one)


@dataclasses.dataclass(frozen=True)
class BuildResult:
    plan: BuildPlan
    image_id: str
    ref: str  # what to run: REGISTRY/NAME@sha256:... when pushed, else NAME:src-<hash>
    pushed: bool
    cluster_default: bool  # the cluster now trains with it (dtrain train --cluster NAME)


def build(req: BuildRequest, *, events: Events, handle: Handle) -> BuildResult:
    """Build the training image, tag it with the git commit and a content hash, push it to the registry."""
    try:
        import docker
    except ImportError:
        raise UserError("dtrain build needs the docker SDK: pip install 'dtrain[docker]'") from None
    root = find_context(req.context)
    args = parse_build_args(req.build_args, req.base_image)
    args = {**default_build_args(root, req.gpu, args), **args}
    check_build_args(root / DOCKERFILES[req.gpu], args)
    target = resolve_registry(req.registry, req.cluster, req.config_path) if req.push else None
    plan = make_plan(root, req.gpu, args, target)
    auth = None if plan.registry is None else registry_auth(plan.registry)  # before a long build, not after
    client = connect(docker)
    image_id = run_build(client, plan, events, handle)
    events.info(f"built {plan.name} {image_id[7:19]}: tags {', '.join(plan.tags)}")
    if plan.registry is None:
        return BuildResult(plan, image_id, plan.local_ref, False, False)
    digest = run_push(client, plan, auth, events, handle)
    ref = f"{plan.remote_repo()}@{digest}" if digest else f"{plan.remote_repo()}:{plan.tags[-1]}"
    events.info(f"pushed {ref}")
    remembered = bool(req.cluster and req.registry is None and remember_image(req.cluster, ref, req.gpu, events))
    return BuildResult(plan, image_id, ref, True, remembered)


def remember_image(cluster: str, ref: str, gpu: bool, events: Events) -> bool:
    """For a gcp cluster `dtrain up` made: the image its nodes run by default (until the next build),
    unless [clusters.NAME] names one. Returns whether it was recorded."""
    from dtrain.control.gcp.record import cluster_dir, read_record

    rec = read_record(cluster)
    if rec is None:
        return False
    if bool(any(n.get("gpus") for n in rec["nodes"])) != gpu:
        kind = "GPU" if not gpu else "CPU"
        events.warning(
            f"cluster {cluster} has {kind} nodes: this image is not made its default "
            f"(build {'with' if kind == 'GPU' else 'without'} --gpu for that)"
        )
        return False
    (cluster_dir(cluster) / "image").write_text(ref + "\n")
    return True


# -- the plan ---------------------------------------------------------------------------------------


def find_context(given: Path | None) -> Path:
    """The dtrain checkout: --context, else the one this CLI runs from (an installed wheel's own copy of
    its build files), else the working directory."""
    candidates = [given] if given else [build_context(), Path.cwd()]
    for c in candidates:
        if c is not None and (c / DOCKERFILES[False]).is_file():
            return c.resolve()
    where = given or Path.cwd()
    raise UserError(f"no {DOCKERFILES[False]} in {where}: run dtrain build in a dtrain checkout, or pass --context DIR")


def parse_build_args(items: Iterable[str], base_image: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise UserError(f"--build-arg {item!r}: expected NAME=VALUE")
        out[name] = value
    if base_image:
        out["BASE_IMAGE"] = base_image
    return out


def default_build_args(root: Path, gpu: bool, given: dict[str, str]) -> dict[str, str]:
    """A CPU torch wheel in wheels/ (how this builds offline) is used instead of the PyTorch index."""
    if gpu or "TORCH_INDEX_URL" in given:
        return {}
    version = given.get("TORCH_VERSION") or dockerfile_args(root / DOCKERFILES[gpu]).get("TORCH_VERSION", "")
    if version and any((root / "wheels").glob(f"torch-{version}-*.whl")):
        return {"TORCH_INDEX_URL": ""}
    return {}


def dockerfile_args(path: Path) -> dict[str, str]:
    """ARG NAME[=default] of a Dockerfile, in order."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)(?:=(\S*))?", line)
        if m:
            out.setdefault(m.group(1), m.group(2) or "")
    return out


def check_build_args(dockerfile: Path, args: dict[str, str]) -> None:
    known = dockerfile_args(dockerfile)
    for name in args:
        if name not in known:
            raise UserError(f"--build-arg {name}: {dockerfile.name} has no ARG {name} (it takes: {', '.join(known)})")


def resolve_registry(given: str | None, cluster: str | None, config_path: Path | None = None) -> str:
    """--registry, else the cluster's: its record's (gcp, written by `dtrain up`), or its table's `registry`."""
    if given:
        return check_registry(given, "--registry")
    from dtrain.control.settings import cluster_config

    cfg = cluster_config(config_path, cluster)
    if not cfg.name:
        raise UserError(
            "no registry to push to: pass --registry HOST/PATH or --cluster NAME (a cluster `dtrain up` made), "
            "or build with --no-push"
        )
    from dtrain.control.gcp.record import read_record

    rec = read_record(cfg.name)
    if rec is not None and rec.get("registry"):
        return check_registry(str(rec["registry"]), f"the record of cluster {cfg.name!r}")
    if cfg.spec.get("registry"):
        return check_registry(str(cfg.spec["registry"]), f"{cfg.source} [clusters.{cfg.name}] registry")
    hint = (
        f"run `dtrain up --cluster {cfg.name}` first" if backends.get(cfg.backend).provisions else "set registry = ..."
    )
    raise UserError(f"cluster {cfg.name!r} has no registry: {hint}, or pass --registry HOST/PATH, or use --no-push")


def check_registry(value: str, where: str) -> str:
    value = value.strip().rstrip("/")
    if value.startswith(("http://", "https://")) or not REGISTRY_RE.match(value):
        raise UserError(
            f"{where}: {value!r} is not a registry path: expected HOST[:PORT]/PATH in lower case, e.g. "
            "us-central1-docker.pkg.dev/my-project/dtrain (no scheme, no tag)"
        )
    return value


def make_plan(root: Path, gpu: bool, buildargs: dict[str, str], registry: str | None) -> BuildPlan:
    dockerfile = DOCKERFILES[gpu]
    if not (root / dockerfile).is_file():
        raise UserError(f"{root / dockerfile} not found")
    # wheels/ (git-ignored) holds wheels for offline builds; the Dockerfiles copy it, so it must exist.
    (root / "wheels").mkdir(exist_ok=True)
    (root / "wheels" / ".keep").touch()
    digest = content_hash(root, dockerfile, buildargs)
    tags = [t for t in (git_tag(root), f"src-{digest}") if t]
    return BuildPlan(root, dockerfile, IMAGE_NAMES[gpu], buildargs, tuple(tags), registry)


def context_files(root: Path, dockerfile: str) -> list[str]:
    """The files Docker receives as the build context (.dockerignore applied, as the docker SDK does)."""
    from docker.utils.build import exclude_paths

    ignore = root / ".dockerignore"
    patterns = []
    if ignore.is_file():
        patterns = [ln.strip() for ln in ignore.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return sorted(p for p in exclude_paths(str(root), patterns, dockerfile=dockerfile) if (root / p).is_file())


def content_hash(root: Path, dockerfile: str, buildargs: dict[str, str]) -> str:
    """12 hex digits over the context's files (names, modes and contents), the Dockerfile and the build
    arguments: the tag says what is inside, whoever builds it."""
    h = hashlib.sha256()
    h.update(json.dumps({"dockerfile": dockerfile, "args": buildargs}, sort_keys=True).encode())
    for rel in [*context_files(root, dockerfile), dockerfile]:
        path = root / rel
        h.update(f"\0{rel}\0{path.stat().st_mode & 0o111:o}\0".encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(HASH_CHUNK), b""):
                h.update(chunk)
    return h.hexdigest()[:12]


def git_tag(root: Path) -> str | None:
    """git-<commit>, with -dirty when the files the image is built from differ from the commit."""

    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return p.stdout.strip() if p.returncode == 0 else None

    sha = git("rev-parse", "--short=12", "HEAD")
    if not sha:
        return None
    paths = ["Dockerfile.train", "Dockerfile.train.gpu", ".dockerignore", "docker", "packages"]
    dirty = git("status", "--porcelain", "--untracked-files=all", "--", *paths)
    return f"git-{sha}{'-dirty' if dirty else ''}"


# -- Docker -----------------------------------------------------------------------------------------


def connect(docker: Any) -> Any:
    """A client for the engine DOCKER_HOST (or the default socket) names; one line with the fix if there is none."""
    where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    try:
        client = docker.from_env(timeout=DOCKER_TIMEOUT_S)
        client.ping()
    except docker.errors.DockerException as e:
        text = str(e)
        if "Permission denied" in text:
            raise UserError(
                f"cannot use the Docker daemon at {where}: permission denied: add yourself to the docker group "
                "(sudo usermod -aG docker $USER, then log in again) or run as root",
                exit_code=ExitCode.FAILURE,
            ) from None
        raise UserError(
            f"cannot reach a Docker daemon at {where}: start it (sudo systemctl start docker, or Docker Desktop), "
            "or point DOCKER_HOST at one",
            exit_code=ExitCode.FAILURE,
        ) from None
    return client


def stream(chunks: Iterable[Any]) -> Iterator[dict[str, Any]]:
    """The engine's JSON messages (the SDK decodes them; a message split across chunks is joined here)."""
    for chunk in chunks:
        if isinstance(chunk, dict):
            yield chunk


def run_build(client: Any, plan: BuildPlan, events: Events, handle: Handle) -> str:
    """Build, reporting each step and line; returns the image id. A failed step is one line naming it.
    A stop request ends the wait between messages (the engine finishes or drops the build itself)."""
    repo_tags = [f"{plan.name}:{t}" for t in plan.tags] + [f"{plan.name}:latest"]
    if plan.registry:
        repo_tags += [f"{plan.remote_repo()}:{t}" for t in plan.tags]
    shown = {k: ("''" if v == "" else v) for k, v in plan.buildargs.items()}
    events.info(
        f"building {plan.name} from {plan.dockerfile} in {plan.root}"
        + (f" ({', '.join(f'{k}={v}' for k, v in shown.items())})" if shown else "")
    )
    image_id = ""
    step, last_step = "", ""
    recent: list[str] = []
    t0 = time.monotonic()
    try:
        for msg in stream(
            client.api.build(
                path=str(plan.root),
                dockerfile=plan.dockerfile,
                tag=repo_tags[0],
                buildargs=plan.buildargs,
                rm=True,
                forcerm=True,
                decode=True,
            )
        ):
            _check_stop(handle, "the build")
            if "error" in msg:
                raise UserError(build_error(msg["error"], step, recent, plan), exit_code=ExitCode.FAILURE)
            text = msg.get("stream", "")
            if "aux" in msg and isinstance(msg["aux"], dict) and "ID" in msg["aux"]:
                image_id = msg["aux"]["ID"]
            for line in ANSI_RE.sub("", text).splitlines():
                line = line.rstrip()
                if not line:
                    continue
                m = re.match(r"^Step (\d+)/(\d+) : (.*)$", line)
                if m:
                    step, last_step = line, m.group(3)
                    events.emit(
                        "build_step", line, step=int(m.group(1)), total=int(m.group(2)), status=_short(m.group(3))
                    )
                    recent.clear()
                else:
                    recent[:] = [*recent[-19:], line]
                m = re.match(r"^Successfully built ([0-9a-f]+)$", line)
                if m and not image_id:
                    image_id = "sha256:" + m.group(1)
                events.emit("output", line, node="build")
    except UserError:
        raise
    except Exception as e:  # the SDK's own failures (context upload, a daemon that went away)
        raise UserError(
            f"the Docker build failed talking to the daemon: {_short(str(e), 300)}", exit_code=ExitCode.FAILURE
        ) from None
    if not image_id:
        raise UserError(
            f"the Docker build ended without an image (last step: {last_step or 'none'})", exit_code=ExitCode.FAILURE
        )
    image = client.images.get(image_id)
    for ref in repo_tags[1:]:
        repo, _, tag = ref.rpartition(":")
        image.tag(repo, tag)
    size = image.attrs.get("Size", 0)
    events.info(f"built in {time.monotonic() - t0:.0f} s, {size / 1e6:.0f} MB: {', '.join(repo_tags)}")
    return image_id


def _check_stop(handle: Handle, what: str) -> None:
    if handle.stopped:
        raise UserError(f"interrupted: {what} was stopped", exit_code=ExitCode.INTERRUPTED)


def build_error(error: str, step: str, recent: list[str], plan: BuildPlan) -> str:
    """The engine's build error as one line with what to do."""
    error = " ".join(error.split())
    low = error.lower()
    where = f"{plan.dockerfile} {step.split(' : ', 1)[0].lower()}" if step else plan.dockerfile
    if step.split(" : ", 1)[-1].startswith("FROM") and any(
        s in low for s in ("pull access denied", "manifest unknown", "not found", "no such host", "dial tcp", "timeout")
    ):
        base = plan.buildargs.get("BASE_IMAGE") or dockerfile_args(plan.root / plan.dockerfile).get("BASE_IMAGE")
        return (
            f"{where}: the base image {base} could not be pulled ({_short(error, 160)}): pass --base-image with one "
            "this daemon has or can pull (offline: sudo scripts/docker-base.sh makes dtrain-base:bookworm)"
        )
    cause = next((ln for ln in reversed(recent) if re.search(r"\b(ERROR|Error|error)\b", ln)), "")
    if "no matching distribution" in cause.lower() or "could not find a version" in cause.lower():
        return (
            f"{where} failed: {_short(cause, 200)}: check the pinned versions and build arguments "
            "(TORCH_VERSION must exist on TORCH_INDEX_URL, or as a wheel in wheels/)"
        )
    if cause:
        return f"{where} failed: {_short(cause, 240)} (the step's output is above)"
    return f"{where} failed: {_short(error, 240)} (the step's output is above)"


def registry_auth(registry: str) -> dict[str, str] | None:
    """Credentials for pushing to `registry`: an OAuth access token for Google's registries, else None
    (the Docker client's own login, ~/.docker/config.json, applies)."""
    host = registry.split("/", 1)[0]
    if not GOOGLE_REGISTRY_RE.match(host):
        return None
    from dtrain.control.gcp.auth import access_token, default_credentials

    purpose = f"to push to {host}"
    try:
        creds, _project = default_credentials(purpose=purpose)
    except UserError as e:
        raise UserError(f"{e}, or build with --no-push") from None
    return {"username": "oauth2accesstoken", "password": access_token(creds, needed_for=f"pushing to {host}")}


def run_push(client: Any, plan: BuildPlan, auth: dict[str, str] | None, events: Events, handle: Handle) -> str:
    """Push every tag, reporting each layer's progress; returns the manifest digest (sha256:...)."""
    repo = plan.remote_repo()
    host = repo.split("/", 1)[0]
    digest = ""
    t0 = time.monotonic()
    for tag in plan.tags:
        try:
            for msg in stream(client.api.push(repo, tag=tag, stream=True, decode=True, auth_config=auth)):
                _check_stop(handle, "the push")
                if "error" in msg:
                    raise UserError(push_error(msg["error"], repo, host), exit_code=ExitCode.FAILURE)
                aux = msg.get("aux")
                if isinstance(aux, dict) and aux.get("Digest"):
                    digest = aux["Digest"]
                layer, status = msg.get("id", ""), msg.get("status", "")
                if not layer or layer == tag:
                    continue
                detail = msg.get("progressDetail") or {}
                done = status in ("Pushed", "Layer already exists", "Mounted from")
                events.emit(
                    "push_layer",
                    layer=layer[:12],
                    status=status,
                    current=1 if done else detail.get("current"),
                    total=1 if done else detail.get("total"),
                )
        except UserError:
            raise
        except Exception as e:
            raise UserError(push_error(str(e), repo, host), exit_code=ExitCode.FAILURE) from None
    events.info(f"pushed {len(plan.tags)} tag(s) in {time.monotonic() - t0:.0f} s")
    return digest


def push_error(error: str, repo: str, host: str) -> str:
    error = " ".join(error.split())
    low = error.lower()
    if any(s in low for s in ("unauthorized", "denied", "authentication required", "forbidden", "401", "403")):
        google = bool(GOOGLE_REGISTRY_RE.match(host))
        fix = (
            "give your account roles/artifactregistry.writer on the repository (and check the project/repository "
            "in the path)"
            if google
            else f"log in first: docker login {host}"
        )
        return f"the registry {host} refused the push of {repo} ({_short(error, 160)}): {fix}"
    if any(
        s in low
        for s in ("connection refused", "no such host", "i/o timeout", "dial tcp", "network is unreachable", "timeout")
    ):
        return (
            f"cannot reach the registry {host} ({_short(error, 160)}): check the address and this machine's network, "
            "or build with --no-push"
        )
    if "server gave http response to https client" in low:
        return f"{host} speaks plain HTTP: add it to the Docker daemon's insecure-registries, or use a TLS registry"
    return f"pushing {repo} failed: {_short(error, 240)}"


def _short(text: str, n: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


__all__ = ["build", "BuildPlan", "BuildRequest", "BuildResult", "make_plan", "content_hash", "resolve_registry"]
