"""A real sshd on 127.0.0.1 for tests that need a node to answer SSH but no network namespaces: it
takes logins as the user running the tests, with the keys in a file the test controls."""

from __future__ import annotations

import contextlib
import getpass
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SSHD = "/usr/sbin/sshd"
START_TIMEOUT_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def loopback_sshd(root: Path, authorized_keys: Path) -> Iterator[int]:
    """sshd on 127.0.0.1:<free port> accepting the keys listed in `authorized_keys` for this user;
    yields the port. Stopped (by its own pid) at the end."""
    if not Path(SSHD).is_file():
        pytest.skip("needs sshd (Debian's openssh-server; scripts/setup.sh --dev installs it)")
    root.mkdir(parents=True, exist_ok=True)
    hostkey = root / "host_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hostkey)], check=True)
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # the privilege separation directory
    authorized_keys.touch()
    port = _free_port()
    config = {
        "ListenAddress": f"127.0.0.1:{port}",
        "HostKey": hostkey,
        "PidFile": root / "sshd.pid",
        "AuthorizedKeysFile": authorized_keys,
        "AllowUsers": getpass.getuser(),
        "PermitRootLogin": "prohibit-password",
        "PasswordAuthentication": "no",
        "KbdInteractiveAuthentication": "no",
        "UsePAM": "no",
        "StrictModes": "no",
    }
    (root / "sshd_config").write_text("".join(f"{k} {v}\n" for k, v in config.items()))
    log = open(root / "sshd.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(root / "sshd_config")], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"sshd exited with {proc.returncode}: {(root / 'sshd.log').read_text()}")
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            if time.monotonic() > deadline:
                pytest.fail(f"sshd not listening on :{port} after {START_TIMEOUT_S}s")
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
