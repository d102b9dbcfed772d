"""The `gcp` backend: a cluster dtrain makes on Google Cloud with Terraform (infra/). Its node list is the
cluster record `dtrain up` wrote from Terraform's `cluster` output; up, down, status and preflight are
dtrain.control.gcp.lifecycle."""

from __future__ import annotations

import shlex
import shutil
from typing import TYPE_CHECKING, Any

from dtrain.common.errors import UserError
from dtrain.control.backends import where
from dtrain.control.cluster import Cluster, Node, check_image

if TYPE_CHECKING:
    from dtrain.control.settings import ClusterConfig

# A record's node may also set these (an image whose Python is elsewhere, a second NIC for NCCL).
RECORD_NODE_OVERRIDES = ("python", "workdir", "interface")


def _built_image(name: str) -> str:
    """The image `dtrain build --cluster NAME` last pushed for this cluster, or ""."""
    from dtrain.control.gcp.record import cluster_dir

    try:
        return (cluster_dir(name) / "image").read_text().strip()
    except FileNotFoundError:
        return ""


# What a cluster without external IPs needs on this machine (preflight says it too, before `up`).
IAP_NEEDS_GCLOUD = (
    "dtrain reaches nodes without external IPs through IAP TCP forwarding, which needs the Google Cloud CLI: "
    "install gcloud (https://cloud.google.com/sdk/docs/install) and run gcloud auth login, or set external_ip = true"
)


def _reach(rec: dict[str, Any], node: dict[str, Any]) -> dict[str, str]:
    """How SSH reaches a node: its external IP; without one, IAP TCP forwarding through gcloud, to the
    node by name (which is also how its host key is remembered)."""
    if node["external_ip"]:
        return {"ssh_host": node["external_ip"]}
    gcloud = shutil.which("gcloud")
    if gcloud is None:
        raise UserError(f"cluster {rec['name']!r}: node {node['name']} has no external IP, and {IAP_NEEDS_GCLOUD}")
    return {"ssh_host": node["name"], "proxy_command": iap_proxy_command(gcloud, rec, node["name"])}


def iap_proxy_command(gcloud: str, rec: dict[str, Any], name: str) -> str:
    """ssh's ProxyCommand for a node without an external IP: gcloud's IAP tunnel to its port (ssh puts
    the port in for %p), on stdin and stdout (cloud.google.com/iap/docs/using-tcp-forwarding)."""
    return shlex.join(
        [
            gcloud,
            "compute",
            "start-iap-tunnel",
            name,
            "%p",
            "--listen-on-stdin",
            *([f"--project={rec['project']}"] if rec.get("project") else []),
            f"--zone={rec['zone']}",
            "--verbosity=warning",
        ]
    )


def node_prices(gs: Any, rec: dict[str, Any]) -> dict[str, float]:
    """Each recorded node's estimated USD per hour (dtrain.control.gcp.prices): its machine type and
    GPUs from the record, Spot as the table makes its role (the master on-demand unless master_spot).
    A node whose machine type the price table lacks is left out."""
    from dtrain.control.gcp.prices import node_price

    out = {}
    for n in rec["nodes"]:
        price = node_price(
            n.get("machine_type", ""), n.get("accelerator", ""), n.get("gpus", 0), gs.disk_size_gb,
            spot=gs.node_spot(n["role"]),
        )  # fmt: skip
        if price.known:
            out[n["name"]] = price.hourly
    return out


def _install_service(cfg: ClusterConfig, cluster: Cluster, events: Any) -> None:
    """The cluster service on the master (dtrain.control.gcp.service_setup), next to Slurm's job table."""
    from dtrain.control.gcp import service_setup
    from dtrain.control.gcp.record import read_record
    from dtrain.control.gcp.spec import gcp_spec
    from dtrain.control.ssh import SSH

    gs = gcp_spec(cfg.name, cfg.spec, where(cfg))
    rec = read_record(cfg.name) or {}
    with SSH(cluster) as ssh:
        w = shlex.quote(cluster.master.workdir)
        workdir = ssh.run(cluster.master, f"mkdir -p {w} && cd {w} && pwd").stdout.decode().strip()
        service_setup.install(
            ssh,
            cluster,
            rec,
            workdir,
            gs.autostop,
            gs.autostop_action,
            events,
            stall_after=gs.stall_after,
            capacity_wait=gs.capacity_wait,
        )


class Gcp:
    name = "gcp"
    provisions = True

    @property
    def keys(self) -> frozenset[str]:
        from dtrain.control.gcp.spec import GCP_KEYS

        return frozenset(GCP_KEYS)

    def check(self, cfg: ClusterConfig) -> None:
        """The whole table, as up/status/preflight read it (values too, not only key names)."""
        from dtrain.control.gcp.spec import gcp_spec

        gcp_spec(cfg.name, cfg.spec, where(cfg))

    def cluster(self, cfg: ClusterConfig) -> Cluster:
        """The nodes `dtrain up` recorded from Terraform's `cluster` output."""
        from dtrain.control.gcp.record import cluster_dir, key_path, read_record
        from dtrain.control.gcp.spec import gcp_spec

        name = cfg.name
        gs = gcp_spec(name, cfg.spec, where(cfg))
        rec = read_record(name)
        if rec is None:
            raise UserError(
                f"cluster {name!r} is not up (no record of it on this machine): run dtrain up --cluster {name}"
            )
        key = key_path(name)
        if not key.is_file():
            raise UserError(f"cluster {name!r}: its SSH key {key} is missing: run dtrain up --cluster {name} again")
        # OS Login users get sudo (roles/compute.osAdminLogin) but no place in the docker group, which
        # the startup script gives only the local ssh_user.
        docker = {"docker": "sudo docker"} if rec.get("os_login") else {}
        nodes = tuple(
            Node(
                name=n["name"],
                address=n["internal_ip"],
                user=rec["ssh_user"],
                key=str(key),
                gpus=n["gpus"],
                master=n["role"] == "master",
                **_reach(rec, n),
                **docker,
                **{k: n[k] for k in RECORD_NODE_OVERRIDES if n.get(k)},
            )
            for n in sorted(rec["nodes"], key=lambda n: n["role"] != "master")
        )
        image = check_image(gs.image, where(cfg)) if gs.image else _built_image(name)
        slurm = None
        if rec.get("slurm"):  # infra/ installed Slurm (var.slurm); `dtrain up` configured it
            from dtrain.control.cluster import duration
            from dtrain.control.slurm.spec import SlurmSpec

            stall_after = duration(gs.stall_after, "stall_after", where(cfg))
            slurm = SlurmSpec(login=nodes[0], managed=True, stall_after=stall_after)
        return Cluster(
            name=name,
            backend="gcp",
            image=image,
            nodes=nodes,
            rdzv_port=gs.rdzv_port,
            rdzv_timeout=gs.rdzv_timeout,
            known_hosts=cluster_dir(name) / "known_hosts",
            env=dict(gs.env),
            default_output=f"{rec['bucket'].rstrip('/')}/runs",
            # infra/'s images have Docker but no torch: jobs run from an image, unless the record names
            # a Python for the nodes (nodes prepared by hand, or the tests' stand-in).
            needs_image=not any(n.get("python") for n in rec["nodes"]),
            launcher="slurm" if slurm else "ssh",
            slurm=slurm,
            node_usd_per_hour=node_prices(gs, rec),
        )

    # Lifecycle: dtrain.control.gcp.lifecycle, imported when used (it pulls in the Google libraries).

    def preflight(self, cfg: ClusterConfig, **kw: Any) -> Any:
        from dtrain.control.gcp import lifecycle

        return lifecycle.preflight(cfg, **kw)

    def up(self, cfg: ClusterConfig, **kw: Any) -> Any:
        from dtrain.control.gcp import lifecycle

        # A stopped cluster (autostop): Terraform leaves stopped VMs stopped, so start them first.
        lifecycle.ensure_running(cfg, events=kw["events"], handle=kw["handle"], missing_ok=True)
        result = lifecycle.up(cfg, **kw)
        cluster = self.cluster(cfg)
        if cluster.slurm is not None:  # (re)configure Slurm for the nodes the cluster now has
            from dtrain.control.slurm.setup import setup

            setup(cluster, events=kw["events"], handle=kw["handle"])
            _install_service(cfg, cluster, kw["events"])
        return result

    def ensure_running(self, cfg: ClusterConfig, *, events: Any, handle: Any) -> bool:
        """Start a stopped cluster before a job runs on it (dtrain.control.gcp.lifecycle; called through
        backends.start_if_stopped); whether anything was started."""
        from dtrain.control.gcp import lifecycle

        return lifecycle.ensure_running(cfg, events=events, handle=handle)

    def down(self, cfg: ClusterConfig, **kw: Any) -> Any:
        from dtrain.control.gcp import lifecycle

        return lifecycle.down(cfg, **kw)

    def status(self, cfg: ClusterConfig, **kw: Any) -> Any:
        from dtrain.control.gcp import lifecycle

        return lifecycle.status(cfg, **kw)


BACKEND = Gcp()
