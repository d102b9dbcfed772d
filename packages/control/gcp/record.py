"""The cluster record: what `dtrain up` learned from Terraform about a gcp cluster, kept on disk for
the launcher, gpus, doctor, status, build and down.

    ~/.config/dtrain/clusters/<name>/record.json    the record (the shape below)
    ~/.config/dtrain/clusters/<name>/id_ed25519     the cluster's own SSH key (private, 0600)

The record is the `cluster` output of infra/ (`terraform output -json cluster`) plus what the CLI
adds (backend, project, the SSH key's path):

    {"name": "demo", "backend": "gcp", "project": "p", "region": "us-central1", "zone": "us-central1-a",
     "bucket": "gs://...", "registry": "us-central1-docker.pkg.dev/p/dtrain-demo", "ssh_user": "dtrain",
     "nodes": [{"name": "demo-master", "role": "master", "internal_ip": "10.0.0.2", "external_ip": "34.x.x.x",
                "gpus": 1, "accelerator": "nvidia-l4", "machine_type": "g2-standard-8"}, ...]}

A node without an external IP ("") is reached through IAP (dtrain.control.backends.gcp). With
"os_login": true, `ssh_user` is the POSIX name OS Login gave the user who ran `dtrain up`.

Nothing here touches the network.
"""

from __future__ import annotations

import ipaddress
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from dtrain.common.errors import UserError

NODE_FIELDS = {"name": str, "role": str, "internal_ip": str, "external_ip": str, "gpus": int}
RECORD_FIELDS = {"name": str, "zone": str, "bucket": str, "ssh_user": str, "nodes": list}


def cluster_dir(name: str) -> Path:
    from dtrain.control.cluster import config_dir

    return config_dir() / "clusters" / name


def record_path(name: str) -> Path:
    return cluster_dir(name) / "record.json"


def key_path(name: str) -> Path:
    return cluster_dir(name) / "id_ed25519"


def read_record(name: str) -> dict[str, Any] | None:
    """The record of cluster `name`, or None if `dtrain up` has not made it (or `down` removed it)."""
    path = record_path(name)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UserError(f"cluster record {path}: cannot read it: {e}") from None
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(
            f"cluster record {path} is not valid JSON ({e}): run dtrain up --cluster {name} again"
        ) from None
    return validate_record(rec, str(path))


def write_record(rec: dict[str, Any]) -> Path:
    """Write atomically (a reader never sees half a record)."""
    validate_record(rec, "the cluster record")
    path = record_path(rec["name"])
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".record-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as fp:
            json.dump(rec, fp, indent=2, sort_keys=True)
            fp.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def remove_record(name: str) -> None:
    record_path(name).unlink(missing_ok=True)


def validate_record(rec: Any, where: str) -> dict[str, Any]:
    """Check the shape the rest of the CLI relies on; one line naming what is wrong."""
    if not isinstance(rec, dict):
        raise UserError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    for key, tp in RECORD_FIELDS.items():
        if not isinstance(rec.get(key), tp):
            raise UserError(f"{where}: {key!r} is missing or not {_a(tp)}")
    if not rec["nodes"]:
        raise UserError(f"{where}: the cluster has no nodes")
    if not isinstance(rec.get("os_login", False), bool):  # optional: logins go through OS Login
        raise UserError(f"{where}: 'os_login' must be true or false")
    masters = 0
    for i, node in enumerate(rec["nodes"]):
        if not isinstance(node, dict):
            raise UserError(f"{where}: nodes[{i}] is not an object")
        for key, tp in NODE_FIELDS.items():
            value = node.get(key)
            if not isinstance(value, tp) or isinstance(value, bool):
                raise UserError(f"{where}: nodes[{i}].{key} is missing or not {_a(tp)}")
        for key in ("python", "workdir", "interface", "accelerator", "machine_type", "instance_id"):  # optional
            if key in node and not isinstance(node[key], str):
                raise UserError(f"{where}: nodes[{i}].{key} must be a string")
        if node["role"] not in ("master", "worker"):
            raise UserError(f"{where}: nodes[{i}].role must be master or worker, got {node['role']!r}")
        masters += node["role"] == "master"
        for key in ("internal_ip", "external_ip"):
            if node[key]:
                try:
                    ipaddress.ip_address(node[key])
                except ValueError:
                    raise UserError(f"{where}: nodes[{i}].{key} {node[key]!r} is not an IP address") from None
        if not node["internal_ip"]:
            raise UserError(f"{where}: nodes[{i}] ({node['name']}) has no internal_ip")
    if masters != 1:
        raise UserError(f"{where}: expected exactly one master node, found {masters}")
    return rec


def _a(tp: type) -> str:
    return {int: "an integer", str: "a string", list: "a list", dict: "an object"}.get(tp, tp.__name__)
