"""Built-in examples hang off one registry (workloads.WORKLOADS) that an installed package can enter
through the `dtrain.workloads` entry-point group; nothing in the launch path names a workload."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from runs import CLI, isolated_env

REPO = Path(__file__).resolve().parents[2]


def write_plugin(site: Path) -> None:
    """A package installed the way pip leaves one: its module and a dist-info with an entry point."""
    (site / "toyplug.py").write_text(
        "import dataclasses\n"
        "from dtrain.common.config import RunConfig, opt\n"
        "from dtrain.control.workloads import Builtin\n\n"
        "@dataclasses.dataclass(kw_only=True)\n"
        "class ToyConfig:\n"
        '    """Train the toy."""\n'
        "    width: int = opt(8, 'hidden width of the toy')\n"
        "    run: RunConfig = dataclasses.field(default_factory=RunConfig)\n\n"
        "BUILTIN = Builtin(config='toyplug:ToyConfig', module='toyplug_train')\n"
    )
    info = site / "toyplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[dtrain.workloads]\ntoy = toyplug:BUILTIN\n")


def test_an_installed_package_adds_a_builtin_with_its_flags_and_section(tmp_path: Path):
    site = tmp_path / "site"
    site.mkdir()
    write_plugin(site)
    env = isolated_env(tmp_path, PYTHONPATH=str(site))
    r = subprocess.run([*CLI, "train", "toy", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "--width" in r.stdout and "hidden width of the toy" in r.stdout
    (tmp_path / "dtrain.toml").write_text("[toy]\nwidth = 32\n")
    r = subprocess.run([*CLI, "config", "show", "--json"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rows = {row["key"]: row for row in json.loads(r.stdout)}
    assert rows["toy.width"] == {"key": "toy.width", "value": 32, "source": "dtrain.toml"}
    # Without the package, the section is unknown again.
    r = subprocess.run([*CLI, "config", "show"], cwd=tmp_path, env=isolated_env(tmp_path), capture_output=True,
                       text=True)  # fmt: skip
    assert r.returncode == 2 and "unknown section [toy]" in r.stderr


def test_the_launch_path_names_no_workload():
    """No module name is made from a workload's name anywhere a job is started."""
    paths = [*sorted((REPO / "packages" / "control").rglob("*.py")), REPO / "packages" / "common" / "slurmstep.py"]
    offenders = []
    for path in paths:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            named = re.search(r'f"dtrain\.\{[a-z_.]+\}\.train"', line) or re.search(r"\b(mnist|lora)\.train\b", line)
            if named and path.name != "workloads.py":  # the registry itself names them
                offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert offenders == [], "\n".join(offenders)
