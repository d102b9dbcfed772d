"""The CUDA image's three pins (torch's CUDA build, the index it comes from, the base image's CUDA
version) agree with each other in every file of the repository that names one of them; the build is
one that torch publishes; and the GPU nodes' driver is new enough for it. No daemon and no network:
the image cannot be built here, so this is what stops a pin that cannot be installed."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".git", ".venv", "node_modules", ".terraform", "__pycache__", "dtrain.egg-info", "runs"}
TEXT_SUFFIXES = {"", ".md", ".yaml", ".yml", ".env", ".gpu", ".sh", ".py", ".toml", ".tf", ".txt", ".hcl", ".json"}

TORCH_BUILD = re.compile(r"\b(\d+\.\d+\.\d+)\+cu(\d{3})\b")  # a version, "+cu" and three digits
INDEX_URL = re.compile(r"download\.pytorch\.org/whl/cu(\d{3})\b")
BASE_IMAGE = re.compile(r"nvidia/cuda:(\d+)\.(\d+)(?:\.\d+)?-")
DLVM_DRIVER = re.compile(r"common-cu\d+-ubuntu-\d+-nvidia-(\d{3})\b")  # the GPU nodes' image family

# The CUDA builds torch publishes, by release: 2.13 has CUDA 12.6 and 13.0 as stable builds, 13.2 as
# experimental, and no 12.8 (dropped from 2.12 on). pytorch/pytorch#187075 (RELEASE.md's 2.13 row),
# #179072 (12.8 removed), pytorch/FBGEMM#5976 (cu126 and cu130 wheels counted on the index, cu128 none).
PUBLISHED = {"2.13.0": {"126", "130"}}
# Oldest driver branch for each CUDA version (NVIDIA's CUDA toolkit release notes, table 3).
MIN_DRIVER = {"12.6": 560, "12.8": 570, "13.0": 580}
# Files that must name the pins: if the scan stops finding them, it checks nothing.
MUST_NAME = {"Dockerfile.train.gpu", "compose.yaml", "docker/compose.env", "docker/README.md"}


def cuda_of(label: str) -> str:
    """'130' -> '13.0', '126' -> '12.6'."""
    return f"{label[:-1]}.{label[-1]}"


def repo_files() -> list[Path]:
    out = []
    for p in REPO.rglob("*"):
        rel = p.relative_to(REPO)
        if any(part in SKIP_DIRS for part in rel.parts) or not p.is_file():
            continue
        if p.suffix in TEXT_SUFFIXES and p.stat().st_size < 1_000_000:
            out.append(p)
    return out


def pins() -> dict[str, list[tuple[str, str]]]:
    """For each file naming a pin: (what, CUDA version) for every occurrence."""
    found: dict[str, list[tuple[str, str]]] = {}
    for p in repo_files():
        text = p.read_text(errors="replace")
        rel = p.relative_to(REPO).as_posix()
        hits = [(f"torch {m.group(1)}+cu{m.group(2)}", cuda_of(m.group(2))) for m in TORCH_BUILD.finditer(text)]
        hits += [(f"index whl/cu{m.group(1)}", cuda_of(m.group(1))) for m in INDEX_URL.finditer(text)]
        hits += [(f"base image CUDA {v}", v) for v in (f"{m.group(1)}.{m.group(2)}" for m in BASE_IMAGE.finditer(text))]
        if hits:
            found[rel] = hits
    return found


def test_every_file_naming_a_cuda_pin_names_the_same_cuda_version():
    found = pins()
    assert set(found) >= MUST_NAME, f"the scan no longer finds the pins in {sorted(MUST_NAME - set(found))}"
    versions = {cuda for hits in found.values() for _, cuda in hits}
    assert len(versions) == 1, {f: hits for f, hits in found.items()}


def test_the_torch_build_is_one_torch_publishes_from_that_index():
    found = pins()
    builds = {m.group(0) for f in found for m in TORCH_BUILD.finditer((REPO / f).read_text())}
    cpu_version = re.search(r"ARG TORCH_VERSION=(\d+\.\d+\.\d+)\+cpu", (REPO / "Dockerfile.train").read_text())
    assert cpu_version, "Dockerfile.train no longer pins a +cpu torch"
    for build in builds:
        version, label = build.split("+cu")
        assert version == cpu_version.group(1), f"{build}: the CPU image has torch {cpu_version.group(1)}"
        assert version in PUBLISHED, f"torch {version}: add its published CUDA builds to PUBLISHED, with their source"
        builds_of = ", ".join(f"cu{b}" for b in sorted(PUBLISHED[version]))
        assert label in PUBLISHED[version], f"torch {build} is not published (torch {version} has {builds_of})"


def test_the_gpu_nodes_driver_runs_the_image_cuda():
    (cuda,) = {c for hits in pins().values() for _, c in hits}
    plan = (REPO / "infra/modules/plan/main.tf").read_text()
    drivers = {int(d) for d in DLVM_DRIVER.findall(plan)}
    assert drivers, "infra/modules/plan/main.tf no longer names a DLVM image family with its driver branch"
    assert cuda in MIN_DRIVER, f"CUDA {cuda}: add its minimum driver branch to MIN_DRIVER"
    assert min(drivers) >= MIN_DRIVER[cuda], f"driver {min(drivers)} is older than CUDA {cuda} needs"
