"""A gcp cluster's life: preflight, up, down, status. Called by the gcp backend; the CLI, a service or a
test reach them through `dtrain.control.backends.get("gcp")`.

    preflight  quota and zone checks, in seconds, before anything is spent
    up         config -> tfvars; preflight; the plan with $/hour (confirmed by the caller); state
               bucket; terraform init + apply; the `cluster` output -> the cluster record; wait until
               every node answers SSH and reports ready (and nvidia-smi works on GPU nodes)
    down       terraform destroy (the checkpoint bucket is kept unless delete_data), then a sweep of
               anything still labelled with the cluster's name, deleted unless keep
    status     the nodes' live state from the Compute API, uptime, and cost so far (estimated)

Every function reports to an `Events` and stops through a `Handle` (dtrain.control.events); none
prints or reads the terminal. `confirm(question)` is the caller's yes/no before anything is created
or deleted.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dtrain.common.errors import ExitCode, UserError
from dtrain.control.events import Events, Handle

if TYPE_CHECKING:
    from dtrain.control.cluster import Cluster
    from dtrain.control.gcp.api import Gcp, Leftover, PreflightReport
    from dtrain.control.gcp.spec import GcpSpec
    from dtrain.control.gcp.terraform import Terraform
    from dtrain.control.settings import ClusterConfig

READY_FILE = "/var/lib/dtrain/ready"
READY_POLL_S = 10
Confirm = Callable[[str], bool]

# The checkpoint bucket's Terraform addresses (infra/storage.tf): forgotten before a destroy that
# keeps the data, so Terraform neither deletes it nor fails on a non-empty bucket.
KEEP_ADDRESSES = ("google_storage_bucket.checkpoints",)
# What ends with the cluster under its config directory (the record goes through remove_record).
CLUSTER_FILES = ("id_ed25519", "id_ed25519.pub", "known_hosts", "terraform.tfvars.json", "munge.key")
# A well-formed key that nobody holds: the derivation needs some key, and never deploys it.
_PLACEHOLDER_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOCq6lYDCi2DbDjX7yU6Ac7nDnmrMYeBv3I2cLxGdGJk dtrain-plan"


@dataclasses.dataclass
class Context:
    spec: GcpSpec
    project: str
    api: Gcp
    source: str


def context(cfg: ClusterConfig) -> Context:
    """The gcp cluster's checked spec, its project, and API clients."""
    from dtrain.control.backends import where
    from dtrain.control.gcp.spec import gcp_spec

    spec = gcp_spec(cfg.name, cfg.spec, where(cfg))
    api = connect(spec.project, cfg.name)
    return Context(spec=spec, project=api.project, api=api, source=cfg.source or "dtrain.toml")


def connect(project: str, cluster: str) -> Gcp:
    """Compute and Storage clients for `project`, at the endpoints the environment names."""
    from dtrain.control.gcp.api import Gcp
    from dtrain.control.settings import gcp_endpoints

    compute, storage = gcp_endpoints()
    credentials = None
    if any(e and e.startswith("http://") for e in (compute, storage)):
        # A plain-http endpoint is a local emulator (the tests' Compute server, gcp-storage-emulator):
        # never send it a Google token, which would travel in clear text.
        from google.auth.credentials import AnonymousCredentials

        credentials = AnonymousCredentials()
    return Gcp.connect(
        project or None, endpoint=compute, storage_endpoint=storage, credentials=credentials, cluster=cluster
    )


def zone_of(spec: GcpSpec, record: dict[str, Any] | None = None) -> str:
    """The cluster's zone: where its record says it is, else the configured one, else the region's
    first zone (preflight and up then move to the first zone that offers the accelerator)."""
    return (record or {}).get("zone") or spec.zone or f"{spec.region}-a"


def derive(ctx: Context, zone: str) -> dict[str, Any]:
    """Machine type, GPUs and image per node, from Terraform's own derivation (infra/modules/plan),
    so a combination Terraform rejects is rejected here, before anything is created."""
    from dtrain.control.gcp.spec import tfvars
    from dtrain.control.gcp.terraform import derive as tf_derive

    return tf_derive(tfvars(ctx.spec, project=ctx.project, zone=zone, ssh_public_key=_PLACEHOLDER_KEY))


def _quota_check(ctx: Context, derived: dict[str, Any], zone: str, existing: int = 0) -> PreflightReport:
    """Quota for the nodes this run adds: `existing` nodes of the cluster already count in usage."""
    from dtrain.control.gcp.api import preflight as api_preflight
    from dtrain.control.gcp.prices import vcpus

    s = ctx.spec
    new = max(0, s.nodes - existing)
    per_node_cpus = vcpus(derived["machine_type"]) or 0
    return api_preflight(
        ctx.api,
        s.region,
        zone,
        s.accelerator if s.use_gpu else None,
        gpus_total=derived["gpus"] * new if s.use_gpu else 0,
        cpus_total=per_node_cpus * new,
        spot=s.spot,
        instances=new,
        gpus_per_instance=derived["gpus"] or None,
    )


def _report(report: PreflightReport, events: Events) -> None:
    for line in report.checked():
        events.check(str(line), True)
    for p in report.problems:
        events.check(p, False)
    if report.zones:
        events.info(f"zones in the region that offer it: {', '.join(report.zones)}")


def preflight(cfg: ClusterConfig, *, events: Events) -> PreflightReport:
    """Check quota and zone capacity, in seconds, before anything is created. Raises on a problem."""
    ctx = context(cfg)
    zone = zone_of(ctx.spec)
    derived = derive(ctx, zone)
    events.info(f"preflight for cluster {ctx.spec.name} in project {ctx.project}, zone {zone}:")
    report = _quota_check(ctx, derived, zone)
    _report(report, events)
    if not report.ok:
        raise UserError(report.problems[0], exit_code=ExitCode.FAILURE)
    return report


# ---------------------------------------------------------------------------------------------
# up


@dataclasses.dataclass(frozen=True)
class PlanRow:
    node: str
    machine_type: str
    gpus: int
    accelerator: str
    spot: bool
    disk_gb: int
    usd_per_hour: float | None  # None: not in the price table


@dataclasses.dataclass(frozen=True)
class CostPlan:
    """What `up` is about to create, with its estimated price (shown before the caller confirms)."""

    cluster: str
    project: str
    zone: str
    rows: tuple[PlanRow, ...]
    note: str

    @property
    def usd_per_hour(self) -> float:
        return sum(r.usd_per_hour or 0.0 for r in self.rows)

    @property
    def complete(self) -> bool:
        return all(r.usd_per_hour is not None for r in self.rows)


@dataclasses.dataclass(frozen=True)
class UpResult:
    record: dict[str, Any]
    record_path: Path
    zone: str


def cost_plan(s: GcpSpec, derived: dict[str, Any], project: str, zone: str) -> CostPlan:
    from dtrain.control.gcp.prices import estimate_note, node_price

    names = [f"{s.name}-master"] + [f"{s.name}-worker-{i}" for i in range(s.workers)]
    accel = derived.get("accelerator") or ""
    gpus = derived["gpus"] if s.use_gpu else 0
    rows = []
    for name in names:
        price = node_price(derived["machine_type"], accel, gpus, s.disk_size_gb, spot=s.spot)
        rows.append(
            PlanRow(
                name,
                derived["machine_type"],
                gpus,
                accel,
                s.spot,
                s.disk_size_gb,
                price.hourly if price.known else None,
            )
        )
    return CostPlan(s.name, project, zone, tuple(rows), estimate_note(s.spot))


def up(
    cfg: ClusterConfig,
    *,
    events: Events,
    handle: Handle,
    confirm: Confirm,
    next_zone: bool = False,
    ready_timeout: int | None = None,
) -> UpResult:
    """Create (or update) the cluster with Terraform, and wait until every node is ready."""
    from dtrain.control.gcp.record import cluster_dir, read_record, write_record
    from dtrain.control.gcp.spec import tfvars, write_tfvars

    ctx = context(cfg)
    s = ctx.spec
    rec = read_record(s.name)  # an update of a cluster that is up: it stays in its zone
    zone = zone_of(s, rec)
    if rec and s.zone and s.zone != zone:
        events.warning(
            f"cluster {s.name} is up in {zone}, not {s.zone} (--next-zone moved it): it stays there; "
            f"to move it, dtrain down --cluster {s.name}, then dtrain up"
        )
    existing = len(rec["nodes"]) if rec else 0
    derived = derive(ctx, zone)
    events.info(f"preflight for cluster {s.name} in project {ctx.project}:")
    report = _quota_check(ctx, derived, zone, existing)
    if not s.zone and not rec and report.zones and zone not in report.zones:
        zone = report.zones[0]  # no zone chosen: the first that offers the accelerator
        report = _quota_check(ctx, derived, zone)
    _report(report, events)
    if not report.ok:
        raise UserError(report.problems[0], exit_code=ExitCode.FAILURE)
    zones = [zone] + [z for z in report.zones if z != zone]

    plan = cost_plan(s, derived, ctx.project, zone)
    events.emit("plan", f"cluster {s.name}: project {ctx.project}, zone {zone}", plan=plan)
    if not confirm("create these resources?"):
        raise UserError("nothing created", exit_code=ExitCode.FAILURE)

    key = ensure_ssh_key(s.name)
    _ensure_state_bucket(ctx, events)
    tf = _terraform(ctx, zone, events, handle)
    tf.init(backend_config=_backend_config(ctx))
    var_file = cluster_dir(s.name) / "terraform.tfvars.json"
    for attempt, z in enumerate(zones):
        tf.context["zone"] = z
        write_tfvars(
            tfvars(s, project=ctx.project, zone=z, ssh_public_key=key.with_suffix(".pub").read_text()), var_file
        )
        try:
            _apply(tf, var_file, "apply", events)
            break
        except UserError as e:
            if getattr(e, "kind", "") != "zone_exhausted":
                raise
            rest = zones[attempt + 1 :]
            if not next_zone or not rest:
                hint = f"; zones that offer it: {', '.join(rest)}" if rest else ""
                raise UserError(f"{e}{hint}", exit_code=ExitCode.FAILURE) from None
            events.warning(f"{z} is out of capacity; trying {rest[0]}")
            zone = rest[0]

    rec = {**tf.output("cluster"), "backend": "gcp", "project": ctx.project}
    path = write_record(rec)
    events.info(f"cluster record: {path}")
    from dtrain.control.backends import get

    wait_ready(get("gcp").cluster(cfg), timeout=ready_timeout or s.ready_timeout, events=events, handle=handle)
    return UpResult(record=rec, record_path=path, zone=zone)


def ensure_ssh_key(name: str) -> Path:
    """The cluster's own SSH key (ed25519, 0600), made once; dies with the cluster."""
    from dtrain.control.gcp.record import key_path

    key = key_path(name)
    if key.is_file() and key.with_suffix(".pub").is_file():
        return key
    key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if shutil.which("ssh-keygen") is None:
        raise UserError("ssh-keygen not found: install OpenSSH's client (apt-get install openssh-client)")
    for p in (key, key.with_suffix(".pub")):
        p.unlink(missing_ok=True)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"dtrain-{name}", "-f", str(key)],
        check=True,
        stdin=subprocess.DEVNULL,
    )
    key.chmod(0o600)
    return key


def _terraform(ctx: Context, zone: str, events: Events, handle: Handle) -> Terraform:
    from dtrain.control.gcp.record import cluster_dir
    from dtrain.control.gcp.terraform import Terraform, infra_dir

    return Terraform(
        infra_dir(),
        cluster_dir(ctx.spec.name) / "terraform",
        context={"project": ctx.project, "region": ctx.spec.region, "zone": zone},
        env=_terraform_env(ctx),
        handle=handle,
    )


def _apply(tf: Terraform, var_file: Path, verb: str, events: Events, *, destroy: bool = False) -> Any:
    events.emit("terraform_start", verb=verb)
    tf.on_event = lambda ev: events.emit("terraform", verb=verb, event=ev)
    try:
        return tf.apply(var_file, destroy=destroy)
    finally:
        tf.on_event = None
        events.emit("terraform_end", verb=verb)


def _backend_config(ctx: Context) -> dict[str, str]:
    """Terraform's gcs backend: state (with its lock) in the state bucket, one prefix per cluster."""
    config = {"bucket": ctx.spec.state_bucket_name(ctx.project), "prefix": f"dtrain/{ctx.spec.name}"}
    if ctx.api.storage_endpoint:
        config["storage_custom_endpoint"] = ctx.api.storage_endpoint.rstrip("/") + "/storage/v1/"
    return config


def _terraform_env(ctx: Context) -> dict[str, str]:
    if ctx.api.storage_endpoint and ctx.api.storage_endpoint.startswith("http://"):
        # The gcs backend insists on a credential; a local emulator takes any (see connect).
        return {"GOOGLE_OAUTH_ACCESS_TOKEN": "local-emulator"}
    return {}


def _ensure_state_bucket(ctx: Context, events: Events) -> None:
    """The bucket that holds every cluster's Terraform state: made on first use, versioned (so a
    bad state write can be rolled back), uniform access, public access prevented."""
    name = ctx.spec.state_bucket_name(ctx.project)
    client = ctx.api.storage()
    with ctx.api.errors(f"checking the state bucket gs://{name}"):
        bucket = client.lookup_bucket(name)
        if bucket is not None:
            return
        bucket = client.bucket(name)
        bucket.versioning_enabled = True
        bucket.iam_configuration.uniform_bucket_level_access_enabled = True
        bucket.iam_configuration.public_access_prevention = "enforced"
        bucket.labels = {"dtrain": "tfstate"}
        client.create_bucket(bucket, location=ctx.spec.region)
    events.info(f"created the Terraform state bucket gs://{name} (versioned)")


def _has_state(ctx: Context) -> bool:
    """Whether Terraform has state for this cluster (an `up` ran, from any machine)."""
    name = ctx.spec.state_bucket_name(ctx.project)
    client = ctx.api.storage()
    with ctx.api.errors(f"reading the state bucket gs://{name}"):
        if client.lookup_bucket(name) is None:
            return False
        return any(True for _ in client.list_blobs(name, prefix=f"dtrain/{ctx.spec.name}/", max_results=1))


def _empty_bucket(ctx: Context, name: str) -> int:
    """Delete every object version in the bucket (a versioned bucket keeps deleted objects as
    noncurrent versions, and Terraform refuses to delete a non-empty bucket)."""
    client = ctx.api.storage()
    removed = 0
    with ctx.api.errors(f"emptying gs://{name}"):
        if client.lookup_bucket(name) is None:
            return 0
        for blob in client.list_blobs(name, versions=True):
            blob.delete()
            removed += 1
    return removed


def wait_ready(cluster: Cluster, *, timeout: float, events: Events, handle: Handle) -> None:
    """Until every node answers SSH and its startup script has written READY_FILE with ok, and
    nvidia-smi lists the GPUs on GPU nodes; at most `timeout` seconds, then one line per late node."""
    from dtrain.control.ssh import SSH

    deadline = time.monotonic() + timeout
    pending = {n.name: "not checked yet" for n in cluster.nodes}
    # First contact: the VMs are new, their host keys unknown; accept-new still refuses a changed key.
    with SSH(cluster, accept_new_host_keys=True) as ssh:
        while pending:
            for node in [n for n in cluster.nodes if n.name in pending]:
                pending_reason = _node_ready(ssh, node)
                if pending_reason is None:
                    del pending[node.name]
                    events.check(f"ready {node.name}", True)
                else:
                    pending[node.name] = pending_reason
            if not pending:
                break
            if time.monotonic() > deadline:
                late = "; ".join(f"{k}: {v}" for k, v in pending.items())
                raise UserError(
                    f"nodes not ready after {timeout:.0f} s ({late}); see the boot log with "
                    "gcloud compute instances get-serial-port-output NODE, then run dtrain up again",
                    exit_code=ExitCode.FAILURE,
                )
            events.emit("stage", f"waiting for {len(pending)} node(s): {', '.join(pending)}")
            _sleep(READY_POLL_S, handle, "waiting for the nodes")


def _sleep(seconds: float, handle: Handle, doing: str) -> None:
    """Sleep, but give up at once when the caller asks the operation to stop."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if handle.stopped:
            raise UserError(f"interrupted while {doing}", exit_code=ExitCode.INTERRUPTED)
        time.sleep(min(0.2, max(0.0, end - time.monotonic())))


def _node_ready(ssh: Any, node: Any) -> str | None:
    """None when ready, else why not (for the timeout message)."""
    from dtrain.control.ssh import NodeError

    check = f"cat {READY_FILE} 2>/dev/null || echo '{{\"pending\": true}}'"
    if node.gpus:
        check += "; nvidia-smi -L >/dev/null 2>&1 && echo GPU_OK || echo GPU_MISSING"
    try:
        p = ssh.run(node, check, timeout=30, check=False)
    except NodeError as e:
        return f"SSH not answering ({str(e).split(': ', 1)[-1]})"
    lines = p.stdout.decode(errors="replace").strip().splitlines()
    try:
        state = json.loads(lines[0]) if lines else {"pending": True}
    except json.JSONDecodeError:
        return f"unreadable {READY_FILE}"
    if state.get("pending"):
        return "startup script still running"
    if not state.get("ok"):
        raise UserError(
            f"node {node.name}: the startup script failed: {state.get('error', 'no reason given')}",
            exit_code=ExitCode.FAILURE,
        )
    if node.gpus and (len(lines) < 2 or lines[1] != "GPU_OK"):
        return "nvidia-smi does not work yet"
    return None


# ---------------------------------------------------------------------------------------------
# down


@dataclasses.dataclass(frozen=True)
class DownResult:
    bucket: str
    data_deleted: bool
    leftovers: tuple[Leftover, ...]  # still labelled after the destroy
    failed: tuple[str, ...]  # leftovers that could not be deleted, as lines
    kept: bool  # leftovers were only listed (keep=True)

    @property
    def clean(self) -> bool:
        return not self.failed and not (self.kept and self.leftovers)


def down(
    cfg: ClusterConfig,
    *,
    events: Events,
    handle: Handle,
    confirm: Confirm,
    keep: bool = False,
    delete_data: bool = False,
    force_unlock: str | None = None,
) -> DownResult:
    """Destroy the cluster, then sweep for anything still labelled with its name."""
    from dtrain.control.gcp.api import delete_leftovers, find_leftovers
    from dtrain.control.gcp.record import cluster_dir, read_record, remove_record
    from dtrain.control.gcp.spec import tfvars, write_tfvars

    ctx = context(cfg)
    s = ctx.spec
    rec = read_record(s.name)
    bucket = s.bucket_name(ctx.project)
    what = "every VM, disk, network, firewall, service account and the image registry"
    data = f"; the checkpoint bucket gs://{bucket} is {'DELETED' if delete_data else 'kept'}"
    events.info(f"cluster {s.name} (project {ctx.project}): deleting {what}{data}")
    if not confirm("go ahead?"):
        raise UserError("nothing deleted", exit_code=ExitCode.FAILURE)

    zone = zone_of(s, rec)
    var_file = cluster_dir(s.name) / "terraform.tfvars.json"
    if not var_file.is_file():  # another machine made it, or the file was lost: render it again
        key = ensure_ssh_key(s.name)
        write_tfvars(
            tfvars(s, project=ctx.project, zone=zone, ssh_public_key=key.with_suffix(".pub").read_text()), var_file
        )
    if _has_state(ctx):
        tf = _terraform(ctx, zone, events, handle)
        tf.init(backend_config=_backend_config(ctx))
        if force_unlock:
            tf.force_unlock(force_unlock)
        if delete_data:
            n = _empty_bucket(ctx, bucket)
            events.info(f"emptied gs://{bucket} ({n} object versions); Terraform deletes it")
        else:
            kept = tf.forget(KEEP_ADDRESSES)
            if kept:
                events.info(f"keeping gs://{bucket}: removed from Terraform's state ({len(kept)} entries)")
        _apply(tf, var_file, "destroy", events, destroy=True)
    else:
        state = f"gs://{ctx.spec.state_bucket_name(ctx.project)}/dtrain/{s.name}"
        events.info(f"no Terraform state at {state}: nothing for Terraform to destroy; sweeping")

    leftovers = find_leftovers(ctx.api, s.region, s.name, include_buckets=delete_data)
    failed: list[str] = []
    if leftovers:
        events.warning(f"still labelled dtrain-cluster={s.name}:")
        for item in leftovers:
            events.info(f"  {item}")
        if keep:
            events.info("left in place (--keep)")
        else:
            for r in delete_leftovers(ctx.api, leftovers):
                events.check(str(r), r.ok)
                if not r.ok:
                    failed.append(str(r))
            if failed:
                raise UserError(
                    f"{len(failed)} resource(s) could not be deleted and may still bill: see above, or the console "
                    f"(filter by label dtrain-cluster={s.name})",
                    exit_code=ExitCode.FAILURE,
                )
    else:
        events.info(f"sweep: nothing else is labelled dtrain-cluster={s.name}")
    remove_record(s.name)
    for name in CLUSTER_FILES:
        (cluster_dir(s.name) / name).unlink(missing_ok=True)
    return DownResult(bucket, delete_data, tuple(leftovers), tuple(failed), keep)


# ---------------------------------------------------------------------------------------------
# status


@dataclasses.dataclass(frozen=True)
class NodeStatus:
    name: str
    state: str  # the instance status, PREEMPTED, or MISSING
    machine_type: str
    gpus: int
    spot: bool
    uptime_s: int
    usd_per_hour: float
    usd_so_far: float
    internal_ip: str
    external_ip: str


@dataclasses.dataclass(frozen=True)
class StatusResult:
    cluster: str
    project: str
    zone: str
    nodes: tuple[NodeStatus, ...]
    recorded: bool  # dtrain up's record exists on this machine
    note: str

    @property
    def usd_per_hour(self) -> float:
        return sum(n.usd_per_hour for n in self.nodes)

    @property
    def usd_so_far(self) -> float:
        return sum(n.usd_so_far for n in self.nodes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "zone": self.zone,
            "nodes": [dataclasses.asdict(n) for n in self.nodes],
            "usd_per_hour": round(self.usd_per_hour, 4),
        }


def status(cfg: ClusterConfig) -> StatusResult:
    """The cluster's nodes as the Compute API sees them now, their uptime and the cost so far."""
    from dtrain.control.gcp.api import node_states
    from dtrain.control.gcp.prices import estimate_note, node_price
    from dtrain.control.gcp.record import read_record

    ctx = context(cfg)
    s = ctx.spec
    rec = read_record(s.name)
    zone = zone_of(s, rec)
    expected = [n["name"] for n in rec["nodes"]] if rec else []
    rows = []
    for st in node_states(ctx.api, zone, s.name, expected=expected):
        uptime = st.uptime_s or 0.0
        price = node_price(st.machine_type, st.accelerator, st.gpus, s.disk_size_gb, spot=st.spot)
        running = st.status in ("RUNNING", "PROVISIONING", "STAGING")
        rate = price.hourly if running else (price.disk if st.status != "MISSING" else 0.0)
        rows.append(
            NodeStatus(
                name=st.name,
                state="PREEMPTED" if st.preempted else st.status,
                machine_type=st.machine_type,
                gpus=st.gpus,
                spot=st.spot,
                uptime_s=int(uptime),
                usd_per_hour=round(rate, 4),
                usd_so_far=round(price.hourly * uptime / 3600, 4),
                internal_ip=st.internal_ip,
                external_ip=st.external_ip,
            )
        )
    return StatusResult(s.name, ctx.project, zone, tuple(rows), rec is not None, estimate_note(s.spot))
