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
    from dtrain.control.gcp.client import Gcp
    from dtrain.control.gcp.preflight import PreflightReport
    from dtrain.control.gcp.spec import GcpSpec
    from dtrain.control.gcp.sweep import Leftover
    from dtrain.control.gcp.terraform import Terraform
    from dtrain.control.settings import ClusterConfig

READY_FILE = "/var/lib/dtrain/ready"
READY_POLL_S = 10
# How long a node's sshd may refuse the cluster's key before `up` stops waiting: the guest agent
# installs a metadata key within seconds of sshd starting, so two minutes of refusals is not a slow
# boot. (dtrain.control.ssh.explain words a refusal so; KEY_REFUSED is what it says.)
KEY_REFUSED_S = 120.0
KEY_REFUSED = "the SSH login was refused"
HOST_KEY_CHANGED = "host key CHANGED"  # dtrain.control.ssh.explain's words for ssh's changed-key refusal
Confirm = Callable[[str], bool]

# The checkpoint bucket is infra/storage.tf's resource named `checkpoints`: forgotten before a destroy
# that keeps the data, so Terraform neither deletes it nor fails on a non-empty bucket (the next `up`
# adopts it again). Matched by name, whatever its type, so the tests' stand-in infra (terraform_data:
# no google provider can be had there) is kept the same way.
KEEP_NAME = "checkpoints"
# Which key `up` put on an OS Login profile (whose, and its fingerprint), for `down` to take off.
OS_LOGIN_FILE = "os_login.json"
# What ends with the cluster under its config directory (the record goes through remove_record).
CLUSTER_FILES = (
    "id_ed25519",
    "id_ed25519.pub",
    "known_hosts",
    "terraform.tfvars.json",
    OS_LOGIN_FILE,
    "munge.key",
)
# A well-formed key that nobody holds: the derivation needs some key, and never deploys it.
_PLACEHOLDER_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOCq6lYDCi2DbDjX7yU6Ac7nDnmrMYeBv3I2cLxGdGJk dtrain-plan"
# A zone letter no region has, for the derivation before the zone is known (see derive).
_PLACEHOLDER_ZONE_SUFFIX = "z"


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
    from dtrain.control.gcp.client import Gcp
    from dtrain.control.settings import gcp_api_endpoint, gcp_endpoints

    compute, storage = gcp_endpoints()
    apis = gcp_api_endpoint()
    credentials = None
    if any(e and e.startswith("http://") for e in (compute, storage, apis)):
        # A plain-http endpoint is a local emulator (the tests' Compute server, gcp-storage-emulator):
        # never send it a Google token, which would travel in clear text.
        from google.auth.credentials import AnonymousCredentials

        credentials = AnonymousCredentials()
    return Gcp.connect(
        project or None,
        endpoint=compute,
        storage_endpoint=storage,
        api_endpoint=apis,
        credentials=credentials,
        cluster=cluster,
    )


def zone_of(spec: GcpSpec, record: dict[str, Any] | None = None) -> str | None:
    """The cluster's zone: where its record says it is, else the configured one; None when neither
    names one. Zone names differ between regions (us-east1 has no -a), so no zone is guessed:
    preflight takes the first zone of the region's listing that qualifies, and status and down look
    for the cluster's VMs in every zone of the region."""
    return (record or {}).get("zone") or spec.zone or None


def derive(ctx: Context, zone: str | None) -> dict[str, Any]:
    """Machine type, GPUs and image per node, from Terraform's own derivation (infra/modules/plan),
    so a combination Terraform rejects is rejected here, before anything is created."""
    from dtrain.control.gcp.spec import tfvars
    from dtrain.control.gcp.terraform import derive as tf_derive

    # Nothing the plan module derives depends on the zone; its variable only has to be a zone name
    # of the region. Before preflight has chosen one, this stands in for it; no API ever sees it.
    zone = zone or f"{ctx.spec.region}-{_PLACEHOLDER_ZONE_SUFFIX}"
    return tf_derive(tfvars(ctx.spec, project=ctx.project, zone=zone, ssh_public_key=_PLACEHOLDER_KEY))


def _quota_check(ctx: Context, derived: dict[str, Any], zone: str | None, existing: int = 0) -> PreflightReport:
    """Quota for the nodes this run adds: `existing` nodes of the cluster already count in usage."""
    from dtrain.control.gcp.preflight import preflight as quota_preflight
    from dtrain.control.gcp.prices import vcpus

    s = ctx.spec
    new = max(0, s.nodes - existing)
    per_node_cpus = vcpus(derived["machine_type"]) or 0
    return quota_preflight(
        ctx.api,
        s.region,
        zone,
        s.accelerator if s.use_gpu else None,
        gpus_total=derived["gpus"] * new if s.use_gpu else 0,
        cpus_total=per_node_cpus * new,
        spot=s.spot,
        instances=new,
        gpus_per_instance=derived["gpus"] or None,
        machine_family=derived["machine_family"],
        disk_gb_total=s.disk_size_gb * new,
        external_ips=s.external_ip,
        # the master is among the new nodes only when nothing exists yet; it is on-demand unless master_spot
        on_demand_instances=1 if new and not existing and s.spot and not s.node_spot("master") else 0,
    )


@dataclasses.dataclass(frozen=True)
class Access:
    """How dtrain reaches the nodes: logging in through OS Login or with the cluster's key in instance
    metadata; through IAP TCP forwarding (no external IPs) or directly."""

    os_login: bool
    iap: bool


@dataclasses.dataclass(frozen=True)
class Checked:
    """What preflight found: the report, the derivation, what `up` must do about the bucket, and how
    it will reach the nodes."""

    report: PreflightReport
    derived: dict[str, Any]
    adopt_bucket: bool
    access: Access


def _preflight(ctx: Context, events: Events, rec: dict[str, Any] | None = None) -> Checked:
    """Every check that can fail before anything is created; raises with the first problem."""
    s = ctx.spec
    zone = zone_of(s, rec)
    where = f", zone {zone}" if zone else f", region {s.region}"
    events.info(f"preflight for cluster {s.name} in project {ctx.project}{where}:")
    _services_check(ctx, events)
    derived = derive(ctx, zone)
    report = _quota_check(ctx, derived, zone, len(rec["nodes"]) if rec else 0)
    adopt_bucket = _checkpoint_bucket(ctx, report)
    access = _access_check(ctx, report, derived) if report.zone else Access(os_login=False, iap=not s.external_ip)
    _shielded_vm_check(ctx, report, derived)
    _report(report, events)
    if not report.ok:
        first = report.problems[0]
        code = ExitCode.USAGE if first in report.config_problems else ExitCode.FAILURE
        raise UserError(first, exit_code=code)
    if zone is None:
        events.info(f"zone {report.zone}: the first zone of {s.region} that qualifies (set zone = to choose)")
    return Checked(report, derived, adopt_bucket, access)


def _access_check(ctx: Context, report: PreflightReport, derived: dict[str, Any]) -> Access:
    """How dtrain will log in to the nodes and reach them, and whether it can: the organisation's
    policies (OS Login required, external IPs denied), gcloud for IAP, the caller's permissions, the
    OS Login API. Each problem is one line in the report, found before anything is created."""
    from dtrain.control.gcp import permissions
    from dtrain.control.gcp.errors import enable_hint
    from dtrain.control.gcp.orgpolicy import EXTERNAL_IP_ACCESS, REQUIRE_OS_LOGIN, enforced, external_ip_denied
    from dtrain.control.gcp.preflight import disabled_services

    s = ctx.spec
    where = f"[clusters.{s.name}]"
    required = _org_policy(ctx, report, REQUIRE_OS_LOGIN, "if it requires OS Login, set os_login = true")
    os_login_required = required is not None and enforced(required)
    if s.os_login is False and os_login_required:
        _config_problem(
            report,
            f"the organisation policy {REQUIRE_OS_LOGIN} is enforced on project {ctx.project}: its VMs refuse "
            f"SSH keys in instance metadata, which os_login = false asks for: remove os_login = false under {where} "
            "(dtrain then adds the cluster's key to your OS Login profile)",
        )
    os_login = s.os_login is True or (s.os_login == "auto" and os_login_required)
    why = f" ({REQUIRE_OS_LOGIN} is enforced)" if os_login_required else ""
    report.passed.append(
        f"login: OS Login{why}, the cluster's key on your profile"
        if os_login
        else "login: the cluster's own key, in instance metadata"
    )

    if s.external_ip:
        hint = "if it denies external IPs, set external_ip = false"
        policy = _org_policy(ctx, report, EXTERNAL_IP_ACCESS, hint)
        denied = external_ip_denied(policy or {}, ctx.project, report.zone, derived["node_names"])
        if denied:
            _config_problem(
                report,
                f"the organisation policy {EXTERNAL_IP_ACCESS} denies an external IP to {', '.join(denied)} in "
                f"project {ctx.project}: set external_ip = false under {where} (dtrain then reaches the nodes "
                "through IAP, with gcloud)",
            )
    else:
        from dtrain.control.backends.gcp import IAP_NEEDS_GCLOUD

        gcloud = shutil.which("gcloud")
        if gcloud is None:
            _config_problem(report, f"external_ip = false under {where}: {IAP_NEEDS_GCLOUD}")
        else:
            report.passed.append(f"reach: IAP TCP forwarding, through {gcloud}")

    nat = bool(derived.get("nat", not s.external_ip))
    groups = permissions.up_permissions(nat=nat, external_ip=s.external_ip, os_login=os_login)
    wanted = list(dict.fromkeys(p for g in groups for p in g.permissions))
    try:
        missing = permissions.missing_permissions(ctx.api, wanted)
    except UserError as e:
        missing = []
        report.notes.append(f"could not check your permissions ({e})")
    if missing:
        _config_problem(report, permissions.missing_permissions_line(ctx.project, groups, missing))
    else:
        report.passed.append(f"permissions: all {len(wanted)} that dtrain up needs")
    if os_login:
        off = disabled_services(ctx.api, ["oslogin.googleapis.com"])
        if off:
            _config_problem(report, enable_hint(ctx.project, off))
    return Access(os_login=os_login, iap=not s.external_ip)


def _shielded_vm_check(ctx: Context, report: PreflightReport, derived: dict[str, Any]) -> None:
    """GPU nodes boot with Secure Boot off (infra/modules/plan: secure_boot): Secure Boot loads only kernel
    modules signed by a key the firmware trusts, and Google documents such signed NVIDIA drivers only for
    the images and steps of https://cloud.google.com/compute/docs/gpus/install-drivers-gpu#secure-boot, not
    for the Deep Learning VM family the GPU nodes boot (Compute leaves Secure Boot off by default because
    unsigned drivers may not load: https://cloud.google.com/compute/shielded-vm/docs/modifying-shielded-vm).
    An organisation that enforces constraints/compute.requireShieldedVm refuses such VMs, mid-apply: say so
    here, in one line, before anything is created."""
    from dtrain.control.gcp.orgpolicy import REQUIRE_SHIELDED_VM, enforced

    if derived.get("secure_boot", True):
        return  # vTPM and integrity monitoring are always on: the policy has nothing to refuse
    policy = _org_policy(ctx, report, REQUIRE_SHIELDED_VM, "if it requires Shielded VMs, GPU nodes are refused")
    if policy is not None and enforced(policy):
        _config_problem(
            report,
            f"the organisation policy {REQUIRE_SHIELDED_VM} is enforced on project {ctx.project}: it refuses "
            "VMs without Secure Boot, and GPU nodes run with Secure Boot off (the NVIDIA driver of their Deep "
            "Learning VM image is not signed for it): ask your organisation's administrator to exempt the project "
            f"from {REQUIRE_SHIELDED_VM}, or use another project, or CPU nodes (use_gpu = false under "
            f"[clusters.{ctx.spec.name}])",
        )


def _org_policy(ctx: Context, report: PreflightReport, constraint: str, hint: str) -> dict[str, Any] | None:
    """The organisation policy for `constraint`, or None with a note when it cannot be read (reading
    needs orgpolicy.policy.get, which many users lack): dtrain then proceeds as if it were not set."""
    from dtrain.control.gcp.orgpolicy import effective_policy

    try:
        return effective_policy(ctx.api, constraint)
    except UserError as e:
        report.notes.append(f"could not read {constraint} ({e}); if your organisation sets it: {hint}")
        return None


def _config_problem(report: PreflightReport, problem: str) -> None:
    """A problem the user fixes in dtrain.toml or the project (exit 2), not one that may pass (exit 1)."""
    report.problems.append(problem)
    report.config_problems.append(problem)


def _services_check(ctx: Context, events: Events) -> None:
    """The APIs the cluster needs are enabled, or one line that names the `gcloud services enable`
    command: before anything is created, not as a Terraform error halfway through."""
    from dtrain.control.gcp.errors import enable_hint
    from dtrain.control.gcp.preflight import REQUIRED_SERVICES, disabled_services

    wanted = list(REQUIRED_SERVICES)
    off = disabled_services(ctx.api, wanted)
    if off:
        raise UserError(enable_hint(ctx.project, off))
    events.check(f"APIs enabled: {', '.join(s.removesuffix('.googleapis.com') for s in wanted)}", True)


def _report(report: PreflightReport, events: Events) -> None:
    for line in report.checked():
        events.check(str(line), True)
    for p in report.problems:
        events.check(p, False)
    if report.zones:
        events.info(f"zones in the region that offer it: {', '.join(report.zones)}")


def preflight(cfg: ClusterConfig, *, events: Events) -> PreflightReport:
    """Check quota, zones, APIs and the bucket, in seconds, before anything is created. Raises on a
    problem."""
    return _preflight(context(cfg), events).report


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
        spot = s.node_spot("master" if name == names[0] else "worker")
        price = node_price(derived["machine_type"], accel, gpus, s.disk_size_gb, spot=spot)
        rows.append(
            PlanRow(
                name,
                derived["machine_type"],
                gpus,
                accel,
                spot,
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
    checked = _preflight(ctx, events, rec)
    report, derived, adopt_bucket, access = checked.report, checked.derived, checked.adopt_bucket, checked.access
    zone = report.zone  # no zone chosen: the first that qualifies
    zones = [zone] + [z for z in report.zones if z != zone]

    plan = cost_plan(s, derived, ctx.project, zone)
    events.emit("plan", f"cluster {s.name}: project {ctx.project}, zone {zone}", plan=plan)
    if not confirm("create these resources?"):
        raise UserError("nothing created", exit_code=ExitCode.FAILURE)

    key = ensure_ssh_key(s.name)
    login = _os_login_key(ctx, key, events) if access.os_login else None
    _ensure_state_bucket(ctx, events)
    tf = _terraform(ctx, zone, events, handle)
    tf.init(backend_config=_backend_config(ctx))
    var_file = cluster_dir(s.name) / "terraform.tfvars.json"
    for attempt, z in enumerate(zones):
        tf.context["zone"] = z
        public_key = key.with_suffix(".pub").read_text()
        values = tfvars(
            s,
            project=ctx.project,
            zone=z,
            ssh_public_key=public_key,
            adopt_bucket=adopt_bucket,
            os_login=access.os_login,
        )
        write_tfvars(values, var_file)
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

    before = rec
    rec = {**tf.output("cluster"), "backend": "gcp", "project": ctx.project}
    forgotten = forget_replaced_host_keys(cluster_dir(s.name) / "known_hosts", before, rec)
    if forgotten:
        events.info(f"new VM(s) {', '.join(forgotten)}: old host keys forgotten, new ones trusted on first contact")
    if login is not None:  # the nodes know the user by the POSIX name OS Login gave, not infra's ssh_user
        rec.update(ssh_user=login.username, os_login=True)
    path = write_record(rec)
    events.info(f"cluster record: {path}")
    from dtrain.control.backends import get
    from dtrain.control.gcp.orgpolicy import REQUIRE_OS_LOGIN

    if login is not None:
        refused = (
            f"check that you hold roles/compute.osAdminLogin on project {ctx.project} (OS Login user {login.username})"
        )
    else:
        refused = (
            f"if your organisation enforces OS Login ({REQUIRE_OS_LOGIN}), set os_login = true under "
            f"[clusters.{s.name}] and run dtrain up again"
        )
    timeout = ready_timeout or s.ready_timeout
    wait_ready(get("gcp").cluster(cfg), timeout=timeout, events=events, handle=handle, refused_hint=refused)
    return UpResult(record=rec, record_path=path, zone=zone)


def _os_login_key(ctx: Context, key: Path, events: Events) -> Any:
    """Put the cluster's public key on the caller's OS Login profile, and remember which key it was, so
    that `down` takes it off again (the key dies with the cluster, as in instance metadata)."""
    from dtrain.control.gcp.oslogin import import_os_login_key
    from dtrain.control.gcp.record import cluster_dir

    login = import_os_login_key(ctx.api, key.with_suffix(".pub").read_text())
    saved = cluster_dir(ctx.spec.name) / OS_LOGIN_FILE
    saved.write_text(json.dumps(dataclasses.asdict(login), indent=2) + "\n")
    saved.chmod(0o600)
    # The fingerprint names the key; the key itself is never shown or logged.
    events.info(
        f"OS Login: the cluster's key (SHA-256 {login.fingerprint[:16]}...) is on the profile of {login.user}; "
        f"the nodes know you as {login.username}"
    )
    return login


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


def _remove_os_login_key(ctx: Context, events: Events) -> None:
    """Take the key `up` put on an OS Login profile off it again (it dies with the cluster)."""
    from dtrain.control.gcp.oslogin import remove_os_login_key
    from dtrain.control.gcp.record import cluster_dir

    saved = cluster_dir(ctx.spec.name) / OS_LOGIN_FILE
    if not saved.is_file():
        return
    login = json.loads(saved.read_text())
    removed = remove_os_login_key(ctx.api, login["user"], login["fingerprint"])
    state = "removed from" if removed else "already gone from"
    events.check(f"OS Login: the cluster's key (SHA-256 {login['fingerprint'][:16]}...) {state} {login['user']}", True)


def _find_zone(ctx: Context, rec: dict[str, Any] | None) -> str:
    """The cluster's zone for `down` when nothing on this machine says it: where its VMs are, else
    the region's first zone that is up (destroy works from the state; the variable must be valid)."""
    from dtrain.control.gcp.preflight import region_zones
    from dtrain.control.gcp.vmstates import cluster_zones

    s = ctx.spec
    zone = zone_of(s, rec) or next(iter(cluster_zones(ctx.api, s.region, s.name)), None)
    zone = zone or next(iter(region_zones(ctx.api, s.region)), None)
    if zone is None:
        raise UserError(f"no zone of region {s.region} is up: set zone = under [clusters.{s.name}]")
    return zone


def _kept(addresses: list[str]) -> list[str]:
    """The state addresses of the root module's `checkpoints` resource (see KEEP_NAME)."""
    return [a for a in addresses if a.split("[", 1)[0].split(".")[1:] == [KEEP_NAME]]


def _checkpoint_bucket(ctx: Context, report: PreflightReport) -> bool:
    """Whether the checkpoint bucket exists and is this cluster's, kept by `dtrain down`: Terraform then
    adopts it (infra's adopt_bucket) instead of creating it, which GCS would answer with 409. A bucket
    of that name that is not the cluster's is a problem now rather than mid-apply."""
    from dtrain.control.gcp.auth import google_module
    from dtrain.control.gcp.labels import CLUSTER_LABEL

    gexc = google_module("api_core.exceptions")

    s = ctx.spec
    name = s.bucket_name(ctx.project)
    other = f'set bucket = "..." under [clusters.{s.name}] to another name'
    with ctx.api.errors(f"looking up the checkpoint bucket gs://{name}"):
        try:
            bucket = ctx.api.storage().lookup_bucket(name)
        except gexc.Forbidden:  # bucket names are global: another project has this one
            _config_problem(report, f"the bucket name gs://{name} belongs to someone else: {other}")
            return False
    if bucket is None:
        report.passed.append(f"checkpoint bucket gs://{name}: to be created")
        return False
    owner = (bucket.labels or {}).get(CLUSTER_LABEL)
    if owner != s.name:
        _config_problem(
            report,
            f"gs://{name} exists but is not cluster {s.name}'s (label {CLUSTER_LABEL}={owner or '(none)'}): {other}",
        )
        return False
    report.passed.append(f"checkpoint bucket gs://{name}: kept by an earlier dtrain down, adopted with its data")
    return True


def forget_replaced_host_keys(known_hosts: Path, before: dict[str, Any] | None, after: dict[str, Any]) -> list[str]:
    """Drop the known_hosts lines of the nodes Terraform made anew, and return their names.

    A VM that Compute recreates (autostop's "delete" then `dtrain up`, a change of `spot`) boots with a new
    SSH host key under the same name, and a node without an external IP is reached through IAP by that name:
    wait_ready's accept-new would refuse the new key as a changed one. A node counts as new when its
    instance id (Compute's, new for every VM it creates: infra/outputs.tf) differs from the record's before
    the apply. Only that node's aliases go (its name, and its external IPs before and after); every other
    line stays, and nothing is dropped when the old record has no instance id to compare (a record from
    before dtrain kept one). The new key is then trusted on first contact, as a new VM's is."""
    if not before or not known_hosts.exists():
        return []
    old = {n["name"]: n for n in before.get("nodes", [])}
    aliases: set[str] = set()
    replaced = []
    for node in after.get("nodes", []):
        prev = old.get(node["name"])
        if not prev or not prev.get("instance_id") or prev["instance_id"] == node.get("instance_id"):
            continue
        replaced.append(node["name"])
        aliases |= {node["name"], prev.get("external_ip", ""), node.get("external_ip", "")} - {""}
    if not aliases:
        return []
    # ssh writes "host[,host...] keytype key" (HashKnownHosts=no, dtrain.control.ssh), "[host]:port" off 22.
    kept = [
        line
        for line in known_hosts.read_text().splitlines(keepends=True)
        if not {h.split("]:")[0].lstrip("[") for h in (line.split(None, 1) or [""])[0].split(",")} & aliases
    ]
    known_hosts.write_text("".join(kept))
    return replaced


def wait_ready(cluster: Cluster, *, timeout: float, events: Events, handle: Handle, refused_hint: str = "") -> None:
    """Until every node answers SSH and its startup script has written READY_FILE with ok, and
    nvidia-smi lists the GPUs on GPU nodes; at most `timeout` seconds, then one line per late node.
    A node whose sshd refuses the cluster's key for KEY_REFUSED_S ends the wait at once, with
    `refused_hint` (a node that answers but refuses will not change its mind: an organisation's OS
    Login policy, a key that did not reach it)."""
    from dtrain.control.ssh import SSH

    deadline = time.monotonic() + timeout
    pending = {n.name: "not checked yet" for n in cluster.nodes}
    refused_since: dict[str, float] = {}
    # First contact: the VMs are new, their host keys unknown; accept-new still refuses a changed key.
    with SSH(cluster, accept_new_host_keys=True) as ssh:
        while pending:
            for node in [n for n in cluster.nodes if n.name in pending]:
                pending_reason = _node_ready(ssh, node)
                if pending_reason is None:
                    del pending[node.name]
                    events.check(f"ready {node.name}", True)
                    continue
                pending[node.name] = pending_reason
                if HOST_KEY_CHANGED in pending_reason:  # it will not change back: no point waiting it out
                    raise UserError(f"node {node.name}: {pending_reason}", exit_code=ExitCode.FAILURE)
                if KEY_REFUSED in pending_reason:
                    since = refused_since.setdefault(node.name, time.monotonic())
                    if time.monotonic() - since >= KEY_REFUSED_S:
                        hint = f": {refused_hint}" if refused_hint else ""
                        raise UserError(
                            f"node {node.name} answers SSH but has refused the cluster's key for "
                            f"{KEY_REFUSED_S:.0f} s (user {node.user or 'default'}){hint}",
                            exit_code=ExitCode.FAILURE,
                        )
                else:
                    refused_since.pop(node.name, None)
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
    from dtrain.control.gcp.record import cluster_dir, read_record, remove_record
    from dtrain.control.gcp.spec import tfvars, write_tfvars
    from dtrain.control.gcp.sweep import delete_leftovers, find_leftovers

    ctx = context(cfg)
    s = ctx.spec
    rec = read_record(s.name)
    bucket = s.bucket_name(ctx.project)
    what = "every VM, disk, network, firewall, service account and the image registry"
    data = f"; the checkpoint bucket gs://{bucket} is {'DELETED' if delete_data else 'kept'}"
    events.info(f"cluster {s.name} (project {ctx.project}): deleting {what}{data}")
    if not confirm("go ahead?"):
        raise UserError("nothing deleted", exit_code=ExitCode.FAILURE)

    var_file = cluster_dir(s.name) / "terraform.tfvars.json"
    if var_file.is_file():
        zone = json.loads(var_file.read_text()).get("zone") or _find_zone(ctx, rec)
    else:  # another machine made it, or the file was lost: render it again
        zone = _find_zone(ctx, rec)
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
            kept = tf.forget(_kept(tf.state_list()))
            if kept:
                events.info(f"keeping gs://{bucket}: removed from Terraform's state ({len(kept)} entries)")
        _apply(tf, var_file, "destroy", events, destroy=True)
    else:
        state = f"gs://{ctx.spec.state_bucket_name(ctx.project)}/dtrain/{s.name}"
        events.info(f"no Terraform state at {state}: nothing for Terraform to destroy; sweeping")

    _remove_os_login_key(ctx, events)
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
    state: str  # the instance status (TERMINATED as STOPPED, as the console shows it), PREEMPTED or MISSING
    machine_type: str
    gpus: int
    spot: bool
    uptime_s: int
    usd_per_hour: float
    usd_so_far: float  # node_hours x the node's hourly price: an estimate from dtrain's price table
    internal_ip: str
    external_ip: str
    node_hours: float = 0.0  # hours it ran since its last start (to now, or to its last stop)
    started: str = ""  # its last start (Compute's lastStartTimestamp, else creationTimestamp)


@dataclasses.dataclass(frozen=True)
class StatusResult:
    cluster: str
    project: str
    zone: str
    nodes: tuple[NodeStatus, ...]
    recorded: bool  # dtrain up's record exists on this machine
    note: str
    region: str = ""

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
            "usd_so_far": round(self.usd_so_far, 4),
            "estimate": self.note,
        }


def status(cfg: ClusterConfig, *, now: Any = None) -> StatusResult:
    """The cluster's nodes as the Compute API sees them now (`now`: a datetime, for tests), their
    uptime and the cost so far: each node's hours since its last start (up to now while it runs, up
    to its last stop once stopped) at its hourly price from dtrain's price table (prices.py; Spot or
    on-demand as the VM is)."""
    from dtrain.control.gcp.prices import estimate_note, node_price
    from dtrain.control.gcp.record import read_record
    from dtrain.control.gcp.vmstates import cluster_zones, node_states

    ctx = context(cfg)
    s = ctx.spec
    rec = read_record(s.name)
    zone = zone_of(s, rec) or next(iter(cluster_zones(ctx.api, s.region, s.name)), None)
    expected = [n["name"] for n in rec["nodes"]] if rec else []
    rows = []
    for st in node_states(ctx.api, zone, s.name, expected=expected, now=now) if zone else ():
        uptime = st.uptime_s or 0.0
        price = node_price(st.machine_type, st.accelerator, st.gpus, s.disk_size_gb, spot=st.spot)
        running = st.status in ("RUNNING", "PROVISIONING", "STAGING")
        rate = price.hourly if running else (price.disk if st.status != "MISSING" else 0.0)
        rows.append(
            NodeStatus(
                name=st.name,
                state="PREEMPTED" if st.preempted else ("STOPPED" if st.status == "TERMINATED" else st.status),
                machine_type=st.machine_type,
                gpus=st.gpus,
                spot=st.spot,
                uptime_s=int(uptime),
                usd_per_hour=round(rate, 4),
                usd_so_far=round(price.hourly * st.run_s / 3600, 4),
                internal_ip=st.internal_ip,
                external_ip=st.external_ip,
                node_hours=round(st.run_s / 3600, 4),
                started=st.last_start or st.created,
            )
        )
    note = estimate_note(any(r.spot for r in rows) if rows else s.spot)
    return StatusResult(s.name, ctx.project, zone or "", tuple(rows), rec is not None, note, region=s.region)


# ---------------------------------------------------------------------------------------------
# a stopped cluster (autostop, or stopped by hand)


def ensure_running(cfg: ClusterConfig, *, events: Events, handle: Handle, missing_ok: bool = False) -> bool:
    """Start the cluster's stopped VMs (the master first), wait until they are ready, and refresh the
    record's addresses (a VM without a static address gets a new external IP at each start). What
    `dtrain train`, `submit` and `up` do first. Returns whether anything was started. `missing_ok`: deleted
    VMs are left to Terraform (`dtrain up` recreates them) instead of being an error."""
    from dtrain.control.gcp.instances import RUNNING, start_cluster
    from dtrain.control.gcp.record import read_record, write_record
    from dtrain.control.gcp.vmstates import node_states

    rec = read_record(cfg.name)
    if rec is None:
        return False
    ctx = context(cfg)
    zone = rec["zone"]
    names = [n["name"] for n in sorted(rec["nodes"], key=lambda n: n["role"] != "master")]
    states = {s.name: s for s in node_states(ctx.api, zone, cfg.name, expected=names)}
    if all(states[n].status in RUNNING for n in names):
        return False
    gone = [n for n in names if states[n].status == "MISSING"]
    if missing_ok and gone:
        names = [n for n in names if n not in gone]
        if not names:
            return False
    stopped = [n for n in names if states[n].status not in RUNNING]
    events.emit("stage", f"cluster {cfg.name} is stopped ({', '.join(stopped)}): starting it")
    start_cluster(ctx.api, zone, cfg.name, names, events=events, handle=handle)
    fresh = {s.name: s for s in node_states(ctx.api, zone, cfg.name, expected=names)}
    for node in rec["nodes"]:
        s = fresh.get(node["name"])
        if s is not None and s.status == "RUNNING":
            node["internal_ip"] = s.internal_ip or node["internal_ip"]
            if node.get("external_ip"):
                node["external_ip"] = s.external_ip or node["external_ip"]
    write_record(rec)
    if missing_ok and gone:
        return True  # `dtrain up` makes the missing VMs again and waits for every node itself
    from dtrain.control.backends import get

    cluster = get("gcp").cluster(cfg)
    wait_ready(cluster, timeout=ctx.spec.ready_timeout, events=events, handle=handle)
    return True
