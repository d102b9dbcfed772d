"""compose.yaml's `cpu` profile end to end: the image this checkout builds (from a locally made Debian base,
with the local torch wheel), a master and a worker container rendezvousing over the compose network, a 2-node
gloo MNIST run to completion, checkpoints and the final model in the `runs` volume.

Needs root (dockerd) or a running daemon, docker-compose and Debian's Fashion-MNIST. Slow: the first session on a
machine builds the image (~2-3 min on 2 cores); the run itself takes about a minute.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
from pathlib import Path

import imagetest as d
import pytest
from test_docker_files import ENV_FILE, compose_cli

pytestmark = [pytest.mark.root, pytest.mark.slow]

FASHION = Path("/usr/share/datasets/fashion-mnist")
# 2 nodes x 1 process, 2 epochs over 16,000 images at the global batch of 256: 62 steps an epoch.
EPOCHS, IMAGES, BATCH, EVERY = 2, 16_000, 256, 40
STEPS = EPOCHS * (IMAGES // BATCH)


def test_cpu_profile_trains_two_nodes_to_the_volume(train_image: str, tmp_path: Path) -> None:
    if not (FASHION / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("needs Debian's dataset-fashion-mnist (scripts/setup.sh installs it as root)")
    compose = compose_cli()
    project = f"dtraintest{secrets.token_hex(3)}"
    run_id = f"mnist-compose-{secrets.token_hex(3)}"
    env = {
        "PATH": f"{Path(d.DOCKER).parent}:/usr/local/bin:/usr/bin:/bin",
        "DTRAIN_IMAGE": train_image,
        "RUN_ID": run_id,
        "EPOCHS": str(EPOCHS),
        "TRAIN_SPLIT": f"train[:{IMAGES}]",
        "EVAL_SPLIT": "test[:2000]",
        "CHECKPOINT_EVERY": str(EVERY),
        "DATA_DIR": str(FASHION),
    }
    base = [*compose, "--env-file", str(ENV_FILE), "-p", project, "--profile", "cpu"]
    try:
        p = subprocess.run(
            [*base, "up", "--no-build", "--abort-on-container-exit", "--exit-code-from", "master"],
            cwd=d.REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        out = p.stdout + p.stderr
        assert p.returncode == 0, out[-5000:]
        assert "epoch 2/2: eval accuracy" in out, out[-3000:]
        workers = d.docker("ps", "-a", "--filter", f"label=com.docker.compose.project={project}",
                           "--format", "{{.Names}} {{.Status}}").stdout.split("\n")  # fmt: skip
        assert all("Exited (0)" in w for w in workers if w.strip()), workers
        volume = f"{project}_runs"
        mount = Path(d.docker("volume", "inspect", "--format", "{{.Mountpoint}}", volume).stdout.strip())
        run = mount / run_id
        status = json.loads((run / "status.json").read_text())
        assert status["state"] == "completed", status
        result = status["result"]
        assert result["world_size"] == 2 and result["steps"] == STEPS, result
        assert result["accuracy"] >= 0.80, result
        hosts = {peer["host"] for peer in status["peers"]}
        assert len(hosts) == 2, status["peers"]  # two containers, two hosts
        steps = sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))
        # The periodic ones (the oldest pruned by keep_checkpoints) and the last.
        assert STEPS in steps and len(steps) >= 2 and all(s % EVERY == 0 or s == STEPS for s in steps), steps
        assert (run / "checkpoints" / "LATEST").read_text().strip() == f"step-{STEPS:08d}"
        meta = json.loads((run / "checkpoints" / f"step-{STEPS:08d}" / "meta.json").read_text())
        for name, info in meta["files"].items():
            assert (run / "checkpoints" / f"step-{STEPS:08d}" / name).stat().st_size == info["size"], meta
        assert (run / "final" / "model.safetensors").stat().st_size > 10_000
        # The image's user (uid 1000), not root, wrote them.
        assert (run / "status.json").stat().st_uid == 1000
    finally:
        subprocess.run([*base, "down", "--volumes", "--remove-orphans"], cwd=d.REPO, env=env,
                       capture_output=True, timeout=120, check=False)  # fmt: skip
    assert shutil.which(compose[0])
