"""`dtrain up`, `dtrain down`, `dtrain status` and `dtrain preflight`: a gcp cluster's life.

    up         config -> tfvars; preflight (quota, zones); plan summary with $/hour; state bucket;
               terraform init + apply; the `cluster` output -> the cluster record; wait until every
               node answers SSH and reports ready (and nvidia-smi works on GPU nodes)
    down       terraform destroy (the checkpoint bucket is kept unless --delete-data), then a sweep
               of anything still labelled with the cluster's name, deleted unless --keep
    status     the nodes' live state from the Compute API, uptime, and cost so far (estimated)
    preflight  quota and zone checks, in seconds, before anything is spent

Terraform runs through cli/terraform.py; the Compute and Storage APIs through cli/gcp.py.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from dtrain.cli import console
from dtrain.cli import options as o
from dtrain.common.errors import ExitCode, UserError

READY_FILE = "/var/lib/dtrain/ready"
READY_POLL_S = 10
NextZone = Annotated[
    bool,
    typer.Option("--next-zone", help="on ZONE_RESOURCE_POOL_EXHAUSTED, try the next zone that offers the GPU"),
]
Yes = Annotated[bool, typer.Option("--yes", "-y", help="do not ask before creating or deleting")]


# ---------------------------------------------------------------------------------------------
# Shared plumbing


@dataclasses.dataclass
class Context:
    spec: Any  # gcp_config.GcpSpec
    project: str
    api: Any  # gcp.Gcp
    source: str


def gcp_context(cluster: str | None) -> Context:
    """The named gcp cluster's spec, its project, and API clients."""
    from dtrain.cli.gcp_config import gcp_spec
    from dtrain.cli.settings import ClusterBackend, get_cluster, load_settings

    settings = load_settings(console.state.config_path, {"run.cluster": cluster})
    cfg = get_cluster(settings)
    if cfg.backend != ClusterBackend.GCP:
        which = f"cluster {cfg.name!r} uses the {cfg.backend.value} backend" if cfg.name else "no cluster was named"
        raise UserError(
            f"{which}: up/down/status/preflight manage gcp clusters; pass --cluster NAME of a "
            '[clusters.NAME] with backend = "gcp" in dtrain.toml'
        )
    src = cfg.source or "dtrain.toml"
    spec = gcp_spec(cfg.name, cfg.spec, f"{src} [clusters.{cfg.name}]")
    api = _api(spec.project, cfg.name)
    return Context(spec=spec, project=api.project, api=api, source=src)


def _api(project: str, cluster: str) -> Any:
    from dtrain.cli.gcp import Gcp
    from dtrain.cli.settings import gcp_endpoints

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


def _derive(ctx: Context, zone: str) -> dict[str, Any]:
    """Machine type, GPUs and image per node, from Terraform's own derivation (infra/modules/plan),
    so a combination Terraform rejects is rejected here, before anything is created."""
    from dtrain.cli.gcp_config import tfvars
    from dtrain.cli.terraform import derive

    return derive(tfvars(ctx.spec, project=ctx.project, zone=zone, ssh_public_key=_PLACEHOLDER_KEY))


_PLACEHOLDER_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOCq6lYDCi2DbDjX7yU6Ac7nDnmrMYeBv3I2cLxGdGJk dtrain-plan"


def _preflight(ctx: Context, derived: dict[str, Any], zone: str, existing: int = 0) -> Any:
    """Quota for the nodes this run adds: `existing` nodes of the cluster already count in usage."""
    from dtrain.cli.gcp import preflight
    from dtrain.cli.prices import vcpus

    s = ctx.spec
    new = max(0, s.nodes - existing)
    per_node_cpus = vcpus(derived["machine_type"]) or 0
    return preflight(
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


def _print_preflight(report: Any) -> None:
    for line in report.checked():
        console.out.print(f"  [green]ok[/] {console.escape(str(line))}", highlight=False)
    for p in report.problems:
        console.out.print(f"  [red]x[/] {console.escape(p)}", highlight=False)
    if report.zones:
        console.out.print(f"  zones in the region that offer it: {', '.join(report.zones)}", highlight=False)


# ---------------------------------------------------------------------------------------------
# dtrain preflight


def preflight_cmd(cluster: o.Cluster = None) -> None:
    """Check quota and zone capacity for a gcp cluster, in seconds, before anything is created."""
    ctx = gcp_context(cluster)
    zone = ctx.spec.zone or f"{ctx.spec.region}-a"
    derived = _derive(ctx, zone)
    console.out.print(f"preflight for cluster {ctx.spec.name} in project {ctx.project}, zone {zone}:")
    report = _preflight(ctx, derived, zone)
    _print_preflight(report)
    if not report.ok:
        raise UserError(report.problems[0], exit_code=ExitCode.FAILURE)
    console.out.print("[green]preflight passed[/]")


# ---------------------------------------------------------------------------------------------
# dtrain up


def up(
    cluster: o.Cluster = None,
    yes: Yes = False,
    next_zone: NextZone = False,
    ready_timeout: Annotated[
        int | None, typer.Option("--ready-timeout", help="seconds to wait for the nodes", show_default=False)
    ] = None,
) -> None:
    """Create (or update) a gcp cluster with Terraform, and wait until every node is ready."""
    from dtrain.cli.gcp_config import tfvars, write_tfvars
    from dtrain.cli.record import cluster_dir, read_record, write_record

    ctx = gcp_context(cluster)
    s = ctx.spec
    rec = read_record(s.name)  # an update of a cluster that is up: it stays in its zone
    zone = rec["zone"] if rec else (s.zone or f"{s.region}-a")
    if rec and s.zone and s.zone != zone:
        console.out.print(
            f"[yellow]cluster {s.name} is up in {zone}, not {s.zone} (--next-zone moved it): it stays there; "
            f"to move it, dtrain down --cluster {s.name}, then dtrain up[/]"
        )
    existing = len(rec["nodes"]) if rec else 0
    derived = _derive(ctx, zone)
    console.out.print(f"preflight for cluster {s.name} in project {ctx.project}:")
    report = _preflight(ctx, derived, zone, existing)
    if not s.zone and not rec and report.zones and zone not in report.zones:
        zone = report.zones[0]  # no zone chosen: the first that offers the accelerator
        report = _preflight(ctx, derived, zone)
    _print_preflight(report)
    if not report.ok:
        raise UserError(report.problems[0], exit_code=ExitCode.FAILURE)
    zones = [zone] + [z for z in report.zones if z != zone]

    show_plan(s, derived, ctx.project, zone)
    if not yes and not typer.confirm("create these resources?", default=False):
        raise UserError("nothing created", exit_code=ExitCode.FAILURE)

    key = ensure_ssh_key(s.name)
    _ensure_state_bucket(ctx)
    tf = _terraform(ctx, zone)
    tf.init(backend_config=_backend_config(ctx))
    var_file = cluster_dir(s.name) / "terraform.tfvars.json"
    for attempt, z in enumerate(zones):
        tf.context["zone"] = z
        write_tfvars(
            tfvars(s, project=ctx.project, zone=z, ssh_public_key=key.with_suffix(".pub").read_text()), var_file
        )
        try:
            _apply(tf, var_file, "apply")
            break
        except UserError as e:
            if getattr(e, "kind", "") != "zone_exhausted":
                raise
            rest = zones[attempt + 1 :]
            if not next_zone or not rest:
                hint = f"; zones that offer it: {', '.join(rest)}" if rest else ""
                raise UserError(f"{e}{hint}", exit_code=ExitCode.FAILURE) from None
            console.out.print(f"[yellow]{z} is out of capacity; trying {rest[0]}[/]")

    rec = {**tf.output("cluster"), "backend": "gcp", "project": ctx.project}
    path = write_record(rec)
    console.out.print(f"cluster record: {path}")
    wait_ready(s.name, timeout=ready_timeout or s.ready_timeout)
    console.out.print(
        f"[green]cluster {s.name} is ready[/]: {len(rec['nodes'])} nodes. Next: "
        f"dtrain train mnist --cluster {s.name}   (dtrain down --cluster {s.name} when done)"
    )


def show_plan(s: Any, derived: dict[str, Any], project: str, zone: str) -> None:
    from rich.table import Table

    from dtrain.cli.prices import estimate_note, node_price

    table = Table(title=f"cluster {s.name}: project {project}, zone {zone}", title_justify="left")
    for col in ("node", "machine type", "GPUs", "spot", "disk", "$/hour"):
        table.add_column(col, justify="right" if col in ("GPUs", "disk", "$/hour") else "left")
    total, known = 0.0, True
    names = [f"{s.name}-master"] + [f"{s.name}-worker-{i}" for i in range(s.workers)]
    accel = derived.get("accelerator") or ""
    gpus = derived["gpus"] if s.use_gpu else 0
    for name in names:
        price = node_price(derived["machine_type"], accel, gpus, s.disk_size_gb, spot=s.spot)
        total += price.hourly
        known = known and price.known
        table.add_row(
            name,
            derived["machine_type"],
            f"{gpus} x {accel}" if gpus else "-",
            "yes" if s.spot else "no",
            f"{s.disk_size_gb} GB",
            f"{price.hourly:.3f}" if price.known else "?",
        )
    console.out.print(table)
    figure = f"${total:.2f}/hour" + ("" if known else " (some prices unknown: not counted)")
    console.out.print(f"estimated cost: {figure} for {len(names)} nodes; plus the bucket's storage")
    console.out.print(f"[dim]{estimate_note(s.spot)}[/]")


def ensure_ssh_key(name: str) -> Path:
    """The cluster's own SSH key (ed25519, 0600), made once; dies with the cluster."""
    from dtrain.cli.record import key_path

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


def _public_key(key: Path) -> str:
    return key.with_suffix(".pub").read_text().strip()


def _terraform(ctx: Context, zone: str) -> Any:
    from dtrain.cli.record import cluster_dir
    from dtrain.cli.terraform import Terraform, infra_dir

    return Terraform(
        infra_dir(),
        cluster_dir(ctx.spec.name) / "terraform",
        context={"project": ctx.project, "region": ctx.spec.region, "zone": zone},
        env=_terraform_env(ctx),
    )


def _apply(tf: Any, var_file: Path, verb: str, *, destroy: bool = False) -> Any:
    from dtrain.cli.terraform import Progress

    with Progress(console.out, verb) as progress:
        tf.on_event = progress
        try:
            return tf.apply(var_file, destroy=destroy)
        finally:
            tf.on_event = None


def _backend_config(ctx: Context) -> dict[str, str]:
    """Terraform's gcs backend: state (with its lock) in the state bucket, one prefix per cluster."""
    config = {"bucket": ctx.spec.state_bucket_name(ctx.project), "prefix": f"dtrain/{ctx.spec.name}"}
    if ctx.api.storage_endpoint:
        config["storage_custom_endpoint"] = ctx.api.storage_endpoint.rstrip("/") + "/storage/v1/"
    return config


def _terraform_env(ctx: Context) -> dict[str, str]:
    if ctx.api.storage_endpoint and ctx.api.storage_endpoint.startswith("http://"):
        # The gcs backend insists on a credential; a local emulator takes any (see _api).
        return {"GOOGLE_OAUTH_ACCESS_TOKEN": "local-emulator"}
    return {}


def _ensure_state_bucket(ctx: Context) -> None:
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
    console.out.print(f"created the Terraform state bucket gs://{name} (versioned)")


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


def wait_ready(name: str, *, timeout: float) -> None:
    """Until every node answers SSH and its startup script has written READY_FILE with ok, and
    nvidia-smi lists the GPUs on GPU nodes; at most `timeout` seconds, then one line per late node."""
    from dtrain.cli.cluster import resolve
    from dtrain.cli.settings import ClusterConfig, get_cluster, load_settings
    from dtrain.cli.ssh import SSH

    settings = load_settings(console.state.config_path, {"run.cluster": name})
    cfg: ClusterConfig = get_cluster(settings)
    cluster = resolve(cfg)
    deadline = time.monotonic() + timeout
    pending = {n.name: "not checked yet" for n in cluster.nodes}
    # First contact: the VMs are new, their host keys unknown; accept-new still refuses a changed key.
    with SSH(cluster, accept_new_host_keys=True) as ssh, console.out.status("waiting for the nodes") as status:
        while pending:
            for node in [n for n in cluster.nodes if n.name in pending]:
                pending_reason = _node_ready(ssh, node)
                if pending_reason is None:
                    del pending[node.name]
                    console.out.print(f"  [green]ready[/] {node.name}")
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
            status.update(f"waiting for {len(pending)} node(s): {', '.join(pending)}")
            time.sleep(READY_POLL_S)


def _node_ready(ssh: Any, node: Any) -> str | None:
    """None when ready, else why not (for the timeout message)."""
    from dtrain.cli.ssh import NodeError

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
# dtrain down


def down(
    cluster: o.Cluster = None,
    yes: Yes = False,
    keep: Annotated[bool, typer.Option("--keep", help="list what the sweep finds, delete nothing")] = False,
    delete_data: Annotated[
        bool, typer.Option("--delete-data", help="also delete the checkpoint bucket and everything in it")
    ] = False,
    force_unlock: Annotated[
        str | None, typer.Option("--force-unlock", help="release a stale Terraform state lock ID first")
    ] = None,
) -> None:
    """Destroy a gcp cluster, then sweep for anything still labelled with its name."""
    from dtrain.cli.gcp import delete_leftovers, find_leftovers
    from dtrain.cli.gcp_config import tfvars, write_tfvars
    from dtrain.cli.record import cluster_dir, read_record, remove_record

    ctx = gcp_context(cluster)
    s = ctx.spec
    rec = read_record(s.name)
    bucket = s.bucket_name(ctx.project)
    what = "every VM, disk, network, firewall, service account and the image registry"
    data = f"; the checkpoint bucket gs://{bucket} is {'DELETED' if delete_data else 'kept'}"
    console.out.print(f"cluster {s.name} (project {ctx.project}): deleting {what}{data}")
    if not yes and not typer.confirm("go ahead?", default=False):
        raise UserError("nothing deleted", exit_code=ExitCode.FAILURE)

    zone = (rec or {}).get("zone") or s.zone or f"{s.region}-a"
    var_file = cluster_dir(s.name) / "terraform.tfvars.json"
    if not var_file.is_file():  # another machine made it, or the file was lost: render it again
        key = ensure_ssh_key(s.name)
        write_tfvars(
            tfvars(s, project=ctx.project, zone=zone, ssh_public_key=key.with_suffix(".pub").read_text()), var_file
        )
    if _has_state(ctx):
        tf = _terraform(ctx, zone)
        tf.init(backend_config=_backend_config(ctx))
        if force_unlock:
            tf.force_unlock(force_unlock)
        if delete_data:
            n = _empty_bucket(ctx, bucket)
            console.out.print(f"emptied gs://{bucket} ({n} object versions); Terraform deletes it")
        else:
            kept = tf.forget(KEEP_ADDRESSES)
            if kept:
                console.out.print(f"keeping gs://{bucket}: removed from Terraform's state ({len(kept)} entries)")
        _apply(tf, var_file, "destroy", destroy=True)
    else:
        state = f"gs://{ctx.spec.state_bucket_name(ctx.project)}/dtrain/{s.name}"
        console.out.print(f"no Terraform state at {state}: nothing for Terraform to destroy; sweeping")

    leftovers = find_leftovers(ctx.api, s.region, s.name, include_buckets=delete_data)
    if leftovers:
        console.out.print(f"[yellow]still labelled dtrain-cluster={s.name}:[/]")
        for item in leftovers:
            console.out.print(f"  {item}", highlight=False)
        if keep:
            console.out.print("left in place (--keep)")
            console.state.exit_code = int(ExitCode.FAILURE)
        else:
            results = delete_leftovers(ctx.api, leftovers)
            failed = [r for r in results if not r.ok]
            for r in results:
                mark = "[green]ok[/]" if r.ok else "[red]failed[/]"
                console.out.print(f"  {mark} {console.escape(str(r))}", highlight=False)
            if failed:
                raise UserError(
                    f"{len(failed)} resource(s) could not be deleted and may still bill: see above, or the console "
                    f"(filter by label dtrain-cluster={s.name})",
                    exit_code=ExitCode.FAILURE,
                )
    else:
        console.out.print(f"sweep: nothing else is labelled dtrain-cluster={s.name}")
    remove_record(s.name)
    for name in ("id_ed25519", "id_ed25519.pub", "known_hosts", "terraform.tfvars.json"):
        (cluster_dir(s.name) / name).unlink(missing_ok=True)
    kept_note = "" if delete_data else f"; checkpoints kept in gs://{bucket} (dtrain down --delete-data removes them)"
    console.out.print(f"[green]cluster {s.name} is down[/]{kept_note}")


# The checkpoint bucket's Terraform addresses (infra/storage.tf): forgotten before a destroy that
# keeps the data, so Terraform neither deletes it nor fails on a non-empty bucket.
KEEP_ADDRESSES = ("google_storage_bucket.checkpoints",)


# ---------------------------------------------------------------------------------------------
# dtrain status


def status(cluster: o.Cluster = None, json_out: o.Json = False) -> None:
    """The cluster's nodes as the Compute API sees them now, their uptime and the cost so far."""
    from dtrain.cli.gcp import node_states
    from dtrain.cli.prices import estimate_note, node_price
    from dtrain.cli.record import read_record

    ctx = gcp_context(cluster)
    s = ctx.spec
    rec = read_record(s.name)
    zone = (rec or {}).get("zone") or s.zone or f"{s.region}-a"
    expected = [n["name"] for n in rec["nodes"]] if rec else []
    states = node_states(ctx.api, zone, s.name, expected=expected)
    rows, total_cost, total_rate = [], 0.0, 0.0
    for st in states:
        uptime = st.uptime_s or 0.0
        price = node_price(st.machine_type, st.accelerator, st.gpus, s.disk_size_gb, spot=st.spot)
        running = st.status in ("RUNNING", "PROVISIONING", "STAGING")
        rate = price.hourly if running else (price.disk if st.status != "MISSING" else 0.0)
        total_rate += rate
        so_far = price.hourly * uptime / 3600
        total_cost += so_far
        rows.append(
            {
                "name": st.name,
                "state": "PREEMPTED" if st.preempted else st.status,
                "machine_type": st.machine_type,
                "gpus": st.gpus,
                "spot": st.spot,
                "uptime_s": int(uptime),
                "usd_per_hour": round(rate, 4),
                "usd_so_far": round(so_far, 4),
                "internal_ip": st.internal_ip,
                "external_ip": st.external_ip,
            }
        )
    if json_out:
        print(json.dumps({"cluster": s.name, "zone": zone, "nodes": rows, "usd_per_hour": round(total_rate, 4)}))
        return
    if not rows:
        up_hint = "it is down" if rec is None else "the record says it is up: its VMs are gone (run dtrain down)"
        console.out.print(f"cluster {s.name}: no instances in {zone} ({up_hint})")
        return
    from rich.table import Table

    table = Table(title=f"cluster {s.name} ({ctx.project}, {zone})", title_justify="left")
    for col in ("node", "state", "machine", "GPUs", "uptime", "$/hour", "$ so far"):
        table.add_column(col)
    for r in rows:
        style = {"RUNNING": "green", "PREEMPTED": "red", "TERMINATED": "red"}.get(r["state"], "yellow")
        table.add_row(
            r["name"],
            f"[{style}]{r['state']}[/]",
            r["machine_type"],
            str(r["gpus"]),
            _duration(r["uptime_s"]),
            f"{r['usd_per_hour']:.3f}",
            f"{r['usd_so_far']:.2f}",
        )
    console.out.print(table)
    console.out.print(f"now ${total_rate:.2f}/hour; ${total_cost:.2f} since the running nodes last started")
    console.out.print(f"[dim]{estimate_note(s.spot)}[/]")


def _duration(seconds: int) -> str:
    if seconds <= 0:
        return "-"
    h, rem = divmod(seconds, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"
