"""A stand-in for the one gcloud command dtrain runs: `gcloud compute start-iap-tunnel INSTANCE PORT
--listen-on-stdin --project=P --zone=Z`, ssh's ProxyCommand for nodes without external IPs.

What IAP does, done here: look the instance up in the Compute API dtrain talks to
(DTRAIN_GCP_COMPUTE_ENDPOINT, the tests' fake), connect to its internal IP on the port, and relay
the bytes between that connection and stdin/stdout. Every call is appended to $FAKE_GCLOUD_LOG (its
arguments, one line), and $FAKE_IAP_PORT stands in for the VM's port where its sshd cannot listen on
22 (a test without root). Anything else gcloud could be asked exits 2.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

SCRIPT = r"""
import json, os, select, socket, sys, urllib.error, urllib.request

args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as log:
    log.write(" ".join(args) + "\n")
if args[:2] != ["compute", "start-iap-tunnel"] or "--listen-on-stdin" not in args:
    sys.exit(f"fake gcloud: unsupported: {' '.join(args)}")
instance, port = args[2], int(os.environ.get("FAKE_IAP_PORT") or args[3])
opts = dict(a[2:].split("=", 1) for a in args[4:] if a.startswith("--") and "=" in a)
url = (os.environ["DTRAIN_GCP_COMPUTE_ENDPOINT"].rstrip("/")
       + f"/compute/v1/projects/{opts['project']}/zones/{opts['zone']}/instances/{instance}")
try:
    vm = json.loads(urllib.request.urlopen(url, timeout=10).read())
except urllib.error.HTTPError as e:  # what gcloud says for an instance IAP cannot find
    sys.exit(f"ERROR: (gcloud.compute.start-iap-tunnel) instance {instance} not found ({e.code})")
address = vm["networkInterfaces"][0]["networkIP"]
conn = socket.create_connection((address, port), timeout=10)
conn.settimeout(None)
STDIN, STDOUT = 0, 1
sources = [STDIN, conn]
while sources:
    ready, _, _ = select.select(sources, [], [])
    if STDIN in ready:
        data = os.read(STDIN, 65536)
        if data:
            conn.sendall(data)
        else:
            conn.shutdown(socket.SHUT_WR)
            sources.remove(STDIN)
    if conn in ready:
        data = conn.recv(65536)
        if not data:
            break
        while data:
            data = data[os.write(STDOUT, data):]
"""


def install(bin_dir: Path, log: Path) -> Path:
    """Write `gcloud` into `bin_dir` (put it first on PATH) logging to `log`; returns its path."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(f"#!{sys.executable}\n{SCRIPT}")
    gcloud.chmod(gcloud.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    log.touch()
    return gcloud


def env_with(bin_dir: Path, log: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) with the fake gcloud first on PATH and its log set."""
    env = dict(os.environ if env is None else env)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["FAKE_GCLOUD_LOG"] = str(log)
    return env
