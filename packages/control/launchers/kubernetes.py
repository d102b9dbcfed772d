"""A Kubernetes cluster with the Kubeflow training operator: the job rendered as a PyTorchJob (kubeflow.org/v1, one
Master and nodes - 1 Workers) and written into the run, for the user's kubectl to apply. dtrain reaches no API
server: it applies nothing, watches nothing and queues nothing, and its run record says so (status.json state
"not-started", an events.jsonl row); `dtrain train` ends with exit 2, as a refusal does (docs/cluster.md,
"Kubernetes (manifests only)"; the reasons in docs/decisions.md, "Kubernetes: PyTorchJob").

Each pod runs the same node agent, spec and environment contract as container mode over SSH
(remote_program.program_spec, remote.node_spec, common.launch.torchrun_argv): `python3 -m dtrain.common.nodeagent run
--spec-env ...` in the cluster's image, torchrun under it with a c10d rendezvous hosted by the Master pod at the name
and port the operator gives it (MASTER_ADDR = <job>-master-0, MASTER_PORT = the pytorchjob-port), the checkpoint
directory in the pod copied to the run's bucket and put back on a restart or --resume. The operator tells each pod
its node rank in PET_NODE_RANK, appended after the template's own variables, where only the container's command
line can name it (kubelet's $(NAME) expansion): the agent's spec travels there, `$` escaped but for that name and the
pod's own (DTRAIN_POD_NAME, from the downward API). The image's working directory is the program's `work` (a user's
program must be built into it: nothing is synced, no requirements installed). Secrets (jobenv.SECRET_ENV, HF_TOKEN)
never reach the manifest, which is a file in the run: a Kubernetes Secret is the place for them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import TYPE_CHECKING, Any

from dtrain.common.errors import ExitCode, UserError
from dtrain.common.jobenv import SECRET_ENV
from dtrain.common.storage import is_remote
from dtrain.control.events import Events, Handle
from dtrain.control.launch_result import LaunchResult
from dtrain.control.launchers import Feature, Plan

if TYPE_CHECKING:
    from dtrain.control.cluster import Cluster

API_VERSION, KIND = "kubeflow.org/v1", "PyTorchJob"
CONTAINER = "pytorch"  # the operator's default container name, which it reads the port from
PORT_NAME = "pytorchjob-port"  # the port it sets MASTER_PORT from
FOLDER = "kubernetes"  # in the run: pytorchjob.yaml, then pytorchjob-r<N>.yaml for the Nth --resume
NOT_STARTED = "not-started"  # status.json's state: the manifests are written, nothing was applied
SCRATCH = "/dtrain"  # an emptyDir in each pod: the agent's folder (checkpoint directory, stop file, metrics)
# What only the pod knows: its node rank (the operator sets PET_NODE_RANK on every pod of a job with a Master:
# training-operator v1.7+, pkg/controller.v1/pytorch/envvar.go) and its name (the downward API, in the template).
NODE_RANK_REF, POD_NAME_REF = "$(PET_NODE_RANK)", "$(DTRAIN_POD_NAME)"
_NODE_RANK, _POD_NAME = "\x00node-rank\x00", "\x00pod-name\x00"  # stand-ins while the spec is built
LEFT_OUT = frozenset({*SECRET_ENV, "HF_TOKEN"})
MAX_NAME = 63 - len("-worker-") - 4  # pod and service names (<job>-worker-<index>) stay DNS labels


def job_name(run_id: str, restarts: int) -> str:
    """The PyTorchJob's name (a DNS-1035 label): the run's id, and the start it is (a --resume is another job)."""
    base = re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-")
    base = base if base[:1].isalpha() else f"dtrain-{base}".rstrip("-")
    suffix = f"-r{restarts}" if restarts else ""
    if len(base) + len(suffix) > MAX_NAME:
        digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
        base = f"{base[: MAX_NAME - len(suffix) - 9].rstrip('-')}-{digest}"
    return base + suffix


def literal(text: str) -> str:
    """`text` as kubelet hands it on: its $(NAME) expansion in command, args and env values escaped ($$ is $)."""
    return text.replace("$", "$$")


def agent_spec(plan: Plan, cluster: Cluster, role: str, nproc: int) -> tuple[dict[str, str], str]:
    """One role's node agent spec (remote_program.program_spec, as over SSH in container mode): the variables the
    same on every pod of the role, and the spec itself as the container's argument, with the pod's rank and name
    left for kubelet to fill in."""
    from dtrain.control.cluster import Node
    from dtrain.control.remote_program import program_spec

    master = cluster.nodes[0]
    node = master if role == "Master" else Node(name="worker", address=_POD_NAME, gpus=master.gpus)
    nodes = (master, *[node] * (len(cluster.nodes) - 1))
    inner = dataclasses.replace(cluster, image="", nodes=nodes)  # in the image already: no docker run around it
    cpus = int(cluster.options.get("cpus") or 0)
    restore = plan.target.resumed or plan.max_restarts > 0  # a restarted pod puts the last copy back
    spec = program_spec(plan, plan.target, inner, node, rank=0 if role == "Master" else _NODE_RANK, nproc=nproc,  # type: ignore[arg-type]
                        threads=max(1, cpus // nproc), restore=restore, gpus=node.gpus)  # fmt: skip
    env = {k: str(v) for k, v in spec.pop("env").items() if k not in LEFT_OUT and not _loopback(k, str(v))}
    env["DTRAIN_INTERNAL_PROGRESS"] = "0"  # plain lines for kubectl logs: no launcher reads a progress line here
    per_pod = {k: v for k, v in env.items() if _NODE_RANK in v or _POD_NAME in v}
    text = literal(json.dumps({**spec, "env": per_pod}))
    for stand_in, ref in ((_NODE_RANK, NODE_RANK_REF), (_POD_NAME, POD_NAME_REF)):
        text = text.replace(json.dumps(stand_in)[1:-1], ref)
    return {k: v for k, v in env.items() if k not in per_pod}, text


def replica(plan: Plan, cluster: Cluster, role: str, replicas: int, nproc: int) -> dict[str, Any]:
    from dtrain.common.nodeagent import CONTAINER_FINAL_COPY_S, INNER_SPEC_ENV

    o = cluster.options
    env, spec = agent_spec(plan, cluster, role, nproc)
    # The image's working directory becomes the agent's `work` (a program's code), the agent works in the scratch.
    script = (
        f'mkdir -p {SCRATCH}/run && ln -sfn "$PWD" {SCRATCH}/run/work && cd {SCRATCH}/run && '
        f'export {INNER_SPEC_ENV}="$1" && exec python3 -m dtrain.common.nodeagent run --spec-env {INNER_SPEC_ENV}'
    )
    limits: dict[str, Any] = {}
    if o.get("cpus"):
        limits["cpu"] = str(o["cpus"])
    if o.get("memory"):
        limits["memory"] = o["memory"]
    requests = dict(limits)
    if o.get("gpus_per_node"):
        limits["nvidia.com/gpu"] = str(o["gpus_per_node"])  # a quantity: a string, as the models have it
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": cluster.image,
        "command": ["/bin/sh", "-c", literal(script)],
        "args": ["dtrain-agent", spec],
        "env": [
            {"name": "DTRAIN_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            *({"name": k, "value": literal(v)} for k, v in sorted(env.items())),
        ],
        "ports": [{"name": PORT_NAME, "containerPort": cluster.rdzv_port}],
        "volumeMounts": [{"name": "dtrain", "mountPath": SCRATCH}],
    }
    if limits:
        container["resources"] = {"limits": limits, **({"requests": requests} if requests else {})}
    return {
        "replicas": replicas,
        "restartPolicy": "OnFailure" if plan.max_restarts else "Never",
        "template": {
            "spec": {
                "containers": [container],
                "volumes": [{"name": "dtrain", "emptyDir": {}}],
                # SIGTERM, the agent's grace period, then its last copy of the checkpoint directory
                "terminationGracePeriodSeconds": int(plan.grace_s + CONTAINER_FINAL_COPY_S),
            }
        },
    }


def render(plan: Plan) -> dict[str, Any]:
    """The PyTorchJob for `plan`, as plain data (the SDK is not needed to make it; tests check it against its
    models)."""
    cluster = plan.cluster
    nodes = len(cluster.nodes)
    nproc = plan.nproc or int(cluster.options.get("nproc") or 1)
    name = job_name(plan.target.run_id, plan.target.restarts)
    plan = dataclasses.replace(plan, sample_interval=0)  # no launcher records the agents' resource rows here
    master = dataclasses.replace(cluster.nodes[0], name=f"{name}-master-0", address=f"{name}-master-0")
    cluster = dataclasses.replace(cluster, nodes=(master, *cluster.nodes[1:]))
    replicas = {"Master": replica(plan, cluster, "Master", 1, nproc)}
    if nodes > 1:
        replicas["Worker"] = replica(plan, cluster, "Worker", nodes - 1, nproc)
    label = re.sub(r"[^A-Za-z0-9_.-]+", "-", cluster.name).strip("-_.")[:63] or "default"
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": name,
            "namespace": cluster.options.get("namespace", "default"),
            "labels": {"app.kubernetes.io/managed-by": "dtrain", "dtrain/cluster": label},
        },
        "spec": {
            "runPolicy": {"cleanPodPolicy": "None", "backoffLimit": plan.max_restarts},
            "nprocPerNode": str(nproc),
            "pytorchReplicaSpecs": replicas,
        },
    }


def to_yaml(value: Any, indent: int = 0) -> str:
    """Block YAML of plain data, each scalar written as JSON (a YAML 1.2 flow scalar): no YAML library needed."""
    pad = " " * indent
    if isinstance(value, dict) and value:
        lines = []
        for k, v in value.items():
            key = k if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_./-]*", k) else json.dumps(k)
            nested = isinstance(v, (dict, list)) and v
            lines.append(f"{pad}{key}:\n{to_yaml(v, indent + 2)}" if nested else f"{pad}{key}: {to_yaml(v)}")
        return "\n".join(lines)
    if isinstance(value, list) and value:
        return "\n".join(f"{pad}- {to_yaml(v, indent + 2).lstrip()}" for v in value)
    return pad + json.dumps(value)


def apply_line(url: str) -> str:
    """The command that starts the job: kubectl reads a file or stdin, not gs://."""
    return f"gcloud storage cat {url} | kubectl apply -f -" if is_remote(url) else f"kubectl apply -f {url}"


class OnKubernetes:
    name = "kubernetes"
    place = "cluster {name!r}"

    def features(self, cluster: object) -> frozenset[Feature]:
        """Only its image (--image): no queue, no eval, no GPU query, no SSH, no time limit, and no attending."""
        return frozenset({Feature.CONTAINERS})

    def launch(self, plan: Plan, *, events: Events, handle: Handle) -> LaunchResult:
        """Render the PyTorchJob and write it into the run with the run's record; start nothing. Exit 2: the
        training did not run (0 would say it completed, 1, 3, 4 that it ran and failed or stopped)."""
        from dtrain.common import runrecord
        from dtrain.common.rundir import write_json
        from dtrain.control.userjob import program_config

        t, job = plan.target, plan.job
        if not is_remote(t.run.url):
            raise UserError(
                f"a run on Kubernetes cluster {plan.cluster.name!r} needs a bucket its pods reach: set bucket = "
                f'"gs://..." in [clusters.{plan.cluster.name}] or pass --output gs://BUCKET/PREFIX (not {t.run.url})'
            )
        if t.resumed:  # a new PyTorchJob (a name of its own) that counts the starts the pods could not record
            earlier = [n for n in t.run.list(f"{FOLDER}/") if n.startswith(f"{FOLDER}/") and n.endswith(".yaml")]
            t = dataclasses.replace(t, restarts=max(t.restarts, len(earlier)))
            plan = dataclasses.replace(plan, target=t)
        manifest = render(plan)
        rel = f"{FOLDER}/pytorchjob{f'-r{t.restarts}' if t.restarts else ''}.yaml"
        name, url = manifest["metadata"]["name"], t.run.child(rel).url
        t.run.write_bytes(rel, (to_yaml(manifest) + "\n").encode())
        nodes = len(plan.cluster.nodes)
        if not t.resumed and not plan.own_config:  # a built-in writes its own when it starts in the pod
            write_json(t.run, "config.json", program_config(t, job, cluster=plan.cluster.name, nodes=nodes,
                                                            nproc=int(manifest["spec"]["nprocPerNode"])))  # fmt: skip
        apply = apply_line(url)
        note = f"manifests written ({url}); dtrain does not apply or watch Kubernetes jobs: start it with `{apply}`"
        # No start is counted (nobody knows whether or when the pods start); a resumed run keeps its count.
        fields = {"state": NOT_STARTED, "note": note, "kubernetes": {"kind": KIND, "name": name, "manifest": url}}
        runrecord.update_status(t.run, fields if t.resumed else {**fields, "starts": 0}, drop=runrecord.END_FIELDS)
        runrecord.append_events(t.run, [runrecord.event_row("manifests", note, job_kind=KIND, name=name)])
        left = sorted(k for k in LEFT_OUT if k in plan.job.env or _forwarded(k))
        if left:
            events.warning(f"left out of the manifest (secrets; give the pods a Kubernetes Secret): {', '.join(left)}")
        if job.workdir is not None:
            events.warning(
                "the pods run the image as it is: your working directory is not synced and its requirements are not "
                "installed; the image's working directory must hold them"
            )
        events.info(f"wrote {KIND} {name} ({nodes} pod(s)) for run {t.run_id}: {url}")
        events.info(f"not started: dtrain does not apply or watch Kubernetes jobs. Start it with:\n  {apply}")
        return LaunchResult(job.name, t.run_id, t.run.url, int(ExitCode.USAGE), plan.cluster.name)


def _loopback(name: str, value: str) -> bool:
    """This machine's storage emulator (tests, a laptop): an address that means the pod itself there."""
    return name == "STORAGE_EMULATOR_HOST" and bool(re.match(r"^(https?://)?(localhost|127\.|\[::1\])", value))


def _forwarded(name: str) -> bool:
    import os

    from dtrain.control.remote import FORWARD_ENV

    return name in FORWARD_ENV and bool(os.environ.get(name))


LAUNCHER = OnKubernetes()
