"""The cluster service's files on the master (dtrain.control.gcp.service_setup) and its keys in the cluster
table. The install script is checked as shell (sh -n) and by what it writes; it has not run on a real VM."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile

import pytest

from dtrain.common.errors import UserError
from dtrain.control.cluster import Cluster, Node
from dtrain.control.gcp import service_setup
from dtrain.control.gcp.spec import gcp_spec
from dtrain.service.daemon import ServiceConfig

TABLE = {"backend": "gcp", "ssh_source_ranges": ["203.0.113.7/32"]}


def cluster() -> Cluster:
    nodes = (Node("demo-master", "10.0.0.2", user="dtrain", master=True), Node("demo-worker-0", "10.0.0.3"),
             Node("demo-worker-1", "10.0.0.4"))  # fmt: skip
    return Cluster(name="demo", backend="gcp", nodes=nodes)


def test_config_unit_and_sudoers():
    rec = {"name": "demo", "project": "p-123456", "zone": "us-central1-a"}
    config = service_setup.service_config(cluster(), rec, "/home/dtrain/dtrain", "30m", "delete")
    files = service_setup.service_files(config)
    loaded = json.loads(files[service_setup.CONFIG])
    cfg = ServiceConfig(**loaded)  # what the service reads back
    assert (cfg.master, cfg.workers, cfg.autostop, cfg.autostop_action) == (
        "demo-master", ["demo-worker-0", "demo-worker-1"], "30m", "delete"
    )  # fmt: skip
    assert cfg.state_file == "/home/dtrain/dtrain/service/state.json"
    unit = files[service_setup.UNIT_PATH]
    assert "User=dtrain-service" in unit and "ProtectSystem=strict" in unit
    assert "ReadWritePaths=/home/dtrain/dtrain/service" in unit
    assert "ExecStart=/opt/dtrain-service/venv/bin/python -m dtrain.service --config /etc/dtrain/service.json" in unit
    sudoers = files[service_setup.SUDOERS_PATH]
    assert sudoers == "dtrain-service ALL=(root) NOPASSWD: /usr/bin/scontrol update nodename=* state=resume\n"
    script = service_setup.install_script(files, "dtrain", "/home/dtrain/dtrain", "0123456789ab")
    assert subprocess.run(["sh", "-n"], input=script, text=True, capture_output=True).returncode == 0
    assert "useradd --system" in script and "visudo -cf /etc/sudoers.d/dtrain-service" in script


def test_archive_holds_what_the_service_imports():
    with tarfile.open(fileobj=io.BytesIO(service_setup.service_archive())) as tar:
        names = set(tar.getnames())
    for module in ("service/__main__.py", "service/daemon.py", "service/logic.py", "control/gcp/instances.py",
                   "control/gcp/vmstates.py", "common/metrics.py", "common/storage.py"):  # fmt: skip
        assert f"dtrain/{module}" in names, module
    assert not any(n.startswith(("dtrain/cli/", "dtrain/mnist/")) for n in names)


def test_autostop_keys_in_the_table():
    s = gcp_spec("demo", TABLE, "[clusters.demo]")
    assert (s.autostop, s.autostop_action) == ("60m", "stop")
    assert gcp_spec("demo", {**TABLE, "autostop": "off"}, "x").autostop == "off"
    with pytest.raises(UserError, match="autostop must be a duration like \"30m\".*got 'soon'"):
        gcp_spec("demo", {**TABLE, "autostop": "soon"}, "[clusters.demo]")
    with pytest.raises(UserError, match='autostop_action must be "stop" or "delete", got \'pause\''):
        gcp_spec("demo", {**TABLE, "autostop_action": "pause"}, "[clusters.demo]")
