"""infra/node-startup.sh's Slurm part, run against the stub commands of tests/infra/test_startup_script.py:
with metadata dtrain-slurm = 1 it installs slurm-wlm and munge where they are missing and configures
nothing (dtrain does, over SSH); without it, nothing about Slurm happens."""

from __future__ import annotations

from pathlib import Path

from infra.test_startup_script import Node

SLURM_STUBS = {"slurmd": "exit 0\n", "munged": "exit 0\n"}


def node(tmp_path: Path, slurm: str | None, installed: bool = False) -> Node:
    n = Node(tmp_path, gpus_wanted=0, gpus_present=0)
    if slurm is not None:
        (tmp_path / "md" / "dtrain-slurm").write_text(slurm)
    if installed:
        for name, body in SLURM_STUBS.items():
            n._write(n.bin / name, body)
    return n


def installs(n: Node) -> list[str]:
    return [c for c in n.calls if c.startswith("apt-get") and " install " in c]


def test_slurm_packages_are_installed_when_asked(tmp_path: Path) -> None:
    n = node(tmp_path, "1")
    r = n.run()
    assert r.returncode == 0, r.stderr
    assert len(installs(n)) == 1 and installs(n)[0].endswith("install -y -qq --no-install-recommends slurm-wlm munge")
    assert n.ready()["ok"] is True
    assert not [
        c for c in n.calls if c.startswith("systemctl") and ("slurm" in c or "munge" in c)
    ]  # dtrain starts them


def test_nothing_is_installed_where_slurm_is(tmp_path: Path) -> None:
    n = node(tmp_path, "1", installed=True)
    assert n.run().returncode == 0
    assert installs(n) == []


def test_no_slurm_without_the_metadata(tmp_path: Path) -> None:
    for value in (None, "0"):
        n = node(tmp_path / str(value), value)
        assert n.run().returncode == 0
        assert not any("slurm" in c for c in installs(n))


def test_a_failed_install_is_reported(tmp_path: Path) -> None:
    n = node(tmp_path, "1")
    r = n.run(FAKE_APT_RC="100")
    assert r.returncode == 1
    assert n.ready() == {"ok": False, "error": "apt-get install slurm-wlm munge failed", "boot_id": "test-boot-id"}
