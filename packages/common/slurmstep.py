"""What a dtrain job runs inside a Slurm allocation. dtrain.control.slurm writes the job's directory
(`<workdir>/runs/<run id>/`: this code under code/, job.json, the batch script) and submits the batch
script; the script runs this module. Standard library only, so that it also runs where the training
happens in a container.

    python -m dtrain.common.slurmstep batch job.json     the batch step, on the allocation's first node
    python -m dtrain.common.slurmstep node job.json new|resume   one per node, started by the batch step's srun
    python -m dtrain.common.slurmstep follow DIR [--once]    the job's log lines, as they are written
    python -m dtrain.common.slurmstep exists URL             exit 0 if the run at URL has started (config.json)

`batch` decides once whether the run starts or resumes (its config.json exists: a requeued job continues
the same run from its last complete checkpoint), runs `srun` with one `node` task per node, copies their
output to the job's output file, and exits with the job's code (dtrain.common.errors.ExitCode). A job
asked to stop without Slurm signalling the job itself (a node's own shutdown, a Spot notice: SIGTERM to a
node's step or to its processes) whose nodes stopped as asked is preempted (dtrain.common.runrecord.job_outcome,
as every launcher's; exit 3 that nobody asked for is a failure) and requeues itself with `scontrol requeue`; a
failure (exit 1) or a usage error (2) does not. A job that Slurm signalled (scancel) is not requeued: Slurm
ends it as CANCELLED. The run's status.json and events.jsonl are written through dtrain.common.runrecord.

Time limits: the batch script asks Slurm for WARN_SIGNAL (USR1) some time before the job's limit
(dtrain.control.slurm.script.time_options). On it the batch step stops every node's step the way a
preemption does (`scancel --signal=TERM`: the steps' processes, not the batch step), and once they have
checkpointed and stopped (exit 3) it requeues the same job, which resumes the same run: a continuation,
counted in the job's Slurm comment (`dtrain:time-limit:N`, which `dtrain jobs` shows) and recorded in the run
(status.json `requeued` with reason "time limit", an events.jsonl row `time-limit`), until the run completes
or job.json's max_continuations is reached (then the job ends with exit 3 and the run can be resumed).

Hangs (docs/hangs.md, "On Slurm"): each node's step forwards its agent's hang reports and "alive" lines; the
batch step (class Hangs) writes a hang's stacks into the run, says one line, records a `hang` event, stops every
node's step and requeues the job to resume its run while job.json's max_restarts allows (counted in the comment,
`dtrain:hangs:N`), else ends it with exit 4 and the run failed (hang_end). From the "alive" lines it works out the
stragglers: `straggler` events, and the comment's `dtrain:stragglers:...` that `dtrain jobs` shows.

`node` fills in what only the allocation knows (this node's and the first node's addresses, the number
of nodes, the processes for this node's GPUs or cores) in the job spec dtrain wrote, and runs it through
the node agent (dtrain.common.nodeagent: torchrun with a c10d rendezvous on the first node, the
interface that holds this node's address). Slurm signals every process of the step itself
(proctrack/linuxproc or cgroup); the agent ignores those signals so that it outlives its job and reports
the job's exit code. Each output line goes to `logs/<node>.log` in the job directory, stamped, and to
the step's stdout (the job's output file). The last line is a result for the batch step.

A training job (job.json's `program` table, dtrain.control.slurm.programs: a user's program, or a built-in
as one) runs through the same steps. The batch step also records its run (a program's config.json on the
first start, a built-in writing its own; status.json on every start and end) and, on a job directory the
nodes share, puts its checkpoint directory back once before a resumed start; each node's step installs the
project's requirements (dtrain.common.deps; a built-in has none), fills in its own part of the spec
(node_program_spec: DTRAIN_RESTART_COUNT, by which a requeued job continues its run), and on SIGTERM or SIGINT
from Slurm creates the stop file and has the agent kill what is left of the program after the grace period.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dtrain.common import runrecord
from dtrain.common.errors import UserError, stopped_as_asked
from dtrain.common.jobenv import STOP_GRACE_S
from dtrain.common.progress import StragglerSet, hang_error, hang_report, silent_line
from dtrain.common.resources import EVENT as RESOURCES_EVENT

RESULT_PREFIX = "\x02dtrain-step "  # a node's result line, read by the batch step
HEARTBEAT_PREFIX = "\x02dtrain-alive "  # a node's task is alive: every HEARTBEAT_S
HEARTBEAT_S = 2.0
LOST_AFTER_S = 10.0  # a node's task not heard of this long is lost (its node died): the job is requeued
FIRST_HEARTBEAT_S = 30.0  # srun starting a task on every node, and its Python starting
PROGRESS_PREFIX = "\x02dtrain-progress "  # as dtrain.common.metrics writes them
CONTROL_PREFIX = "\x02dtrain-agent "  # as dtrain.common.nodeagent writes them
# Placeholders in the job spec that only the allocation can fill in.
TOKENS = ("__dtrain_master_addr__", "__dtrain_addr__", "__dtrain_is_host__", "__dtrain_nproc__",
          "__dtrain_threads__", "__dtrain_node__", "__dtrain_nnodes__", "__dtrain_node_rank__")  # fmt: skip
ARGS_TOKEN = "__dtrain_workload_args__"  # replaced by the workload's arguments: a new run's, or a resume's
# Container mode: the spec of the agent inside the container, as JSON in job.json (its placeholders filled in like
# the rest), given to it through the environment (nodeagent.INNER_SPEC_ENV) once filled.
INNER_SPEC_KEY = "inner_spec"
RESTARTS_ENV = "DTRAIN_INTERNAL_SLURM_RESTARTS"  # the batch step tells the node tasks the job's restart count
STEP_WAIT_S = 30  # srun --wait: after the first node's task ends, the others get this long, then are killed
FOLLOW_POLL_S = 0.2
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_PREEMPTED, EXIT_HUNG, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130
WARN_SIGNAL = signal.SIGUSR1  # Slurm's warning before the time limit (sbatch --signal=B:USR1@<lead>)
# The job's Slurm comment holds what dtrain counts across its starts and what `dtrain jobs` shows, as fields
# "dtrain:<name>:<value>" joined by COMMENT_SEP (no spaces: `scontrol -o show job` splits on them).
COMMENT_SEP = ";"
TIME_LIMIT_COMMENT = "dtrain:time-limit:"  # time-limit continuations so far ("...:N", ":N:max")
HANGS_COMMENT = "dtrain:hangs:"  # requeues after a hang so far (at most job.json's max_restarts)
STRAGGLERS_COMMENT = "dtrain:stragglers:"  # the stragglers now: "<node>/<rank>/<times slower>", joined by ","
HANG_EVENT, STRAGGLER_EVENT = "hang", "straggler"  # the run's events.jsonl rows (as dtrain.control.remote's)
HANG_KILL_S = 10.0  # after a hang, the nodes' steps get SIGTERM, and SIGKILL this much later if still running
SILENT_FLOOR_S = 30.0  # an agent silent this long (or its hang timeout, if longer) is taken for hung (= remote's)
# Some node's step ended 0 and every other node's agent says its ranks have all ended, yet their steps go on (a
# torchrun waiting in its exit barrier for a peer that will never come, one frozen say): after this long those
# steps are ended, and count as 0 (torchrun's exit barrier follows only a success).
NODES_ENDED_WAIT_S = 30.0
STACK_MAX_CHARS = 200_000  # a rank's stacks as forwarded to the batch step (faulthandler's are a few KB)
TIME_LIMIT_EVENT = "time-limit"  # the run's events.jsonl row of a continuation
TIME_LIMIT_MARK = "time-limit.stop"  # in the job's directory on the batch node while it stops for its time limit
TIME_LIMIT_LINE = ("dtrain: stopped before the job's time limit: the job is requeued and continues this run by "
                   "itself (up to max_continuations; `dtrain jobs` counts them)")  # fmt: skip
# A stop that reached a built-in after it recorded its completion (run_completed): the node step reports 0.
COMPLETED_LINE = "dtrain: the run had completed when the stop came: nothing to continue"
SIGTERM_EXIT = 128 + signal.SIGTERM  # torchrun's own exit after it was sent SIGTERM
# The node agent, outliving Slurm's signals to the step (they reach torchrun and the workers directly) so
# that it reports how the job ended and removes what the job leaves. Handlers, not SIG_IGN: the programs
# it starts get the default dispositions back at exec (an ignored SIGTERM would be inherited by torchrun).
AGENT = (
    "import runpy, signal, sys\n"
    "for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):\n"
    "    signal.signal(s, lambda *_: None)\n"
    "sys.argv = ['dtrain.common.nodeagent', 'run']\n"
    "runpy.run_module('dtrain.common.nodeagent', run_name='__main__', alter_sys=True)\n"
)


def stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def read_job(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


# ---------------------------------------------------------------------------------------------
# batch


def job_code(codes: dict[str, int]) -> int:
    """The job's exit code from its nodes' codes: a failure on any node wins (1; also any code dtrain does
    not define), then a hang (4), a usage error (2), an interrupt (130), a preemption (3); 0 only when all
    finished."""
    values = set(codes.values())
    if values - {EXIT_OK, EXIT_USAGE, EXIT_PREEMPTED, EXIT_HUNG, EXIT_INTERRUPTED}:
        return EXIT_FAILURE
    for code in (EXIT_HUNG, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_PREEMPTED):
        if code in values:
            return code
    return EXIT_OK


def comment_field(comment: str, prefix: str) -> str | None:
    """The value of dtrain's field `prefix` (TIME_LIMIT_COMMENT, ...) in a job's Slurm comment; None: absent."""
    for part in comment.strip().split(COMMENT_SEP):
        if part.startswith(prefix):
            return part[len(prefix) :]
    return None


def with_field(comment: str, prefix: str, value: str | None) -> str:
    """The comment with dtrain's field `prefix` set to `value` (None: removed), the other fields kept."""
    parts = [p for p in comment.strip().split(COMMENT_SEP) if p and not p.startswith(prefix)]
    if value is not None:
        parts.append(prefix + value)
    return COMMENT_SEP.join(parts)


def continuations(comment: str) -> tuple[int, bool]:
    """(time-limit continuations so far, whether the limit stopped them) from a job's Slurm comment."""
    value = comment_field(comment, TIME_LIMIT_COMMENT)
    if value is None:
        return 0, False
    count, _, rest = value.partition(":")
    return (int(count) if count.isdigit() else 0), rest == "max"


def time_limit_comment(count: int, *, stopped: bool = False) -> str:
    return f"{TIME_LIMIT_COMMENT}{count}" + (":max" if stopped else "")


def hang_requeues(comment: str) -> int:
    """Times the job was requeued after a hang, from its Slurm comment."""
    value = comment_field(comment, HANGS_COMMENT) or ""
    return int(value) if value.isdigit() else 0


def stragglers_field(found: dict[str, float]) -> str | None:
    """The comment's value for stragglers {"<node> rank <r>": times slower} (None: none)."""
    if not found:
        return None
    return ",".join(f"{k.replace(' rank ', '/')}/{x:g}" for k, x in sorted(found.items()))


def stragglers_of(comment: str) -> dict[str, float]:
    """The stragglers the batch step last saw, from a job's Slurm comment: {"<node> rank <r>": times slower}."""
    out: dict[str, float] = {}
    for item in (comment_field(comment, STRAGGLERS_COMMENT) or "").split(","):
        node, _, rest = item.partition("/")
        rank, _, ratio = rest.partition("/")
        with contextlib.suppress(ValueError):
            out[f"{node} rank {rank}"] = float(ratio)
    return out


def stragglers_text(found: dict[str, float]) -> str:
    """Stragglers in a few words: "h1 rank 1 (2.3x)", "" for none."""
    return ", ".join(f"{k} ({x:.1f}x)" for k, x in sorted(found.items()))


def should_requeue_hang(*, signalled: bool, done: int, allowance: int, run_started: bool) -> bool:
    """Whether a job whose ranks hung is requeued to resume its run from its last complete checkpoint: Slurm did
    not end the job itself meanwhile, its run got as far as starting (there is something to resume), and it
    has had fewer hang requeues than its allowance (job.json's max_restarts: `--max-restarts`)."""
    return not signalled and run_started and done < allowance


def should_continue(code: int, *, warned: bool, signalled: bool, done: int, limit: int) -> bool:
    """Whether a job warned of its time limit is requeued to continue its run: its nodes stopped after a
    checkpoint (exit 3; a run that finished first has nothing to continue, a failure is not retried), Slurm did
    not end the job itself meanwhile (scancel, the limit reached), and fewer than `limit` continuations were made."""
    return warned and not signalled and code == EXIT_PREEMPTED and done < limit


def run_exists(job: dict[str, Any]) -> bool:
    """Whether the job's run has started before (its config.json exists): then this start resumes it.
    Asked with the job's own environment, as its ranks read the run (STORAGE_EMULATOR_HOST, say): the
    batch step's is Slurm's, which dtrain does not set."""
    if job.get("image"):
        return _run_exists_in_image(job)
    with _environ(job_env(job)):
        return exists(job["run_url"])


def job_env(job: dict[str, Any]) -> dict[str, str]:
    """The environment dtrain gives the job's processes (the same on every node, save placeholders)."""
    spec = next(iter(job.get("specs", {}).values()), {})
    return {k: v for k, v in spec.get("env", {}).items() if not any(t in v for t in TOKENS)}


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def exists(url: str) -> bool:
    from dtrain.common.storage import open_store

    return open_store(url).exists("config.json")


def run_completed(job: dict[str, Any]) -> bool:
    """Whether the job's run recorded its own completion (a built-in's status.json says completed): a stop that
    reached it after that (its teardown: the last checkpoint copy) is no preemption, and there is nothing to
    continue (each node's step then reports exit 0). Asked as run_exists asks; False where it cannot be read."""
    try:
        if job.get("image"):
            return in_image(job, ["completed", job["run_url"]], capture=True).returncode == 0
        with _environ(job_env(job)):
            return completed(job["run_url"])
    except Exception:  # noqa: BLE001 - unreadable: the exit code stands
        return False


def completed(url: str) -> bool:
    from dtrain.common.storage import open_store

    return (runrecord.read_status(open_store(url)) or {}).get("state") == runrecord.COMPLETED


def _run_exists_in_image(job: dict[str, Any]) -> bool:
    """Container mode: the node has no storage libraries; ask the image (it has this module)."""
    p = in_image(job, ["exists", job["run_url"]], capture=True)
    if p.returncode not in (0, 1):
        raise RuntimeError(f"cannot check the run in {job['image']}: {p.stderr.strip()[-300:]}")
    return p.returncode == 0


IN_IMAGE_ENV = "DTRAIN_INTERNAL_IN_IMAGE"  # set in the throwaway containers below: do the work, do not recurse


def in_image(job: dict[str, Any], args: list[str], *, capture: bool = False) -> subprocess.CompletedProcess:
    """`python -m dtrain.common.slurmstep ARGS` in the job's image (container mode: the node has Docker and no
    storage libraries), in the job's directory mounted at its own path, with the job's environment by name and
    dtrain's code from the job's directory first on PYTHONPATH (the image's may be older)."""
    from dtrain.common.nodeagent import container_argv, run_folder_mount

    spec = next(iter(job["specs"].values()))
    docker = spec["container"]["docker"] if spec.get("container") else _docker(job, "*")
    here = Path.cwd()  # the job runs in <workdir>/runs/<run id>
    name = f"dtrain-step-{os.environ.get('SLURM_JOB_ID', 'x')}-{os.getpid()}"
    c = {"image": job["image"], "docker": docker, "name": name,
         "mounts": [[str(here), "", "rw"], *run_folder_mount(job["run_url"])], "cwd": str(here), "user": "host",
         "entrypoint": "python3",
         "args": ["-m", "dtrain.common.slurmstep", *args]}  # fmt: skip
    env = {**job_env(job), "PYTHONPATH": str(here / "code"), IN_IMAGE_ENV: "1"}
    argv = container_argv(c, sorted(env), here, os.getuid(), os.getgid())
    argv.remove("--init")  # short-lived, and its exit code is the command's
    return subprocess.run(argv, env={**os.environ, **env}, capture_output=capture, text=True, timeout=600, check=False)


def _docker(job: dict[str, Any], key: str) -> list[str]:
    """A user's program in an image: the docker command of the node `key` (or any node's)."""
    import shlex

    docker = job.get("program", {}).get("docker", {})
    return shlex.split(docker.get(key) or next(iter(docker.values()), "docker"))


def step_command(job: dict[str, Any], mode: str) -> list[str]:
    """srun's command line: one task per node of the allocation, in the job's directory (the batch step's
    own), with the batch step's environment (PYTHONPATH: the job's code)."""
    return ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=0", f"--wait={STEP_WAIT_S}",
            job["python"], "-m", "dtrain.common.slurmstep", "node", "job.json", mode]  # fmt: skip


def allocation_nodes() -> list[str]:
    out = subprocess.run(
        ["scontrol", "show", "hostnames", os.environ.get("SLURM_JOB_NODELIST", "")],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return out.split()


def batch(jobfile: str) -> int:
    job = read_job(jobfile)
    signalled = threading.Event()

    def on_signal(_signum: int, _frame: Any) -> None:
        signalled.set()  # Slurm signals the steps itself; keep copying their output until they end

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    warned = threading.Event()  # Slurm's warning: the time limit is near
    signal.signal(WARN_SIGNAL, lambda *_: warned.set())
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    with contextlib.suppress(OSError):
        Path(TIME_LIMIT_MARK).unlink(missing_ok=True)  # an earlier start's
    try:
        # A job's first start begins its run (unless it was submitted to continue one); a later start
        # resumes it if the run got as far as writing its config.
        resume = bool(job.get("resume")) or (restarts > 0 and run_exists(job))
    except Exception as e:  # noqa: BLE001 - the run cannot be read: say so in the job's output
        print(f"{stamp()} dtrain: error: cannot read the run {job['run_url']}: {e}", flush=True)
        return EXIT_FAILURE
    nodes = allocation_nodes()
    if restarts and comment_field(comment := _job_comment(), STRAGGLERS_COMMENT) is not None:
        _set_comment(with_field(comment, STRAGGLERS_COMMENT, None))  # the last start's: this one has its own
    verb = "resuming" if resume else "starting"
    print(f"{stamp()} dtrain: job {os.environ.get('SLURM_JOB_ID', '?')} (restart {restarts}) on "
          f"{','.join(nodes)}: {verb} {job['workload']} run {job['run_id']}", flush=True)  # fmt: skip
    if job.get("program"):
        try:
            program_started(job, restarts=restarts, nodes=nodes, resume=resume)
        except Exception as e:  # noqa: BLE001 - the run cannot be written: say so in the job's output
            print(f"{stamp()} dtrain: error: cannot record the start in the run {job['run_url']}: {e}", flush=True)
            return EXIT_FAILURE
    proc = subprocess.Popen(
        step_command(job, "resume" if resume else "new"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, RESTARTS_ENV: str(restarts)},
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for raw in proc.stdout:  # type: ignore[union-attr]
            lines.put(raw.decode(errors="replace").rstrip("\r\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    codes: dict[str, int] = {}
    asked: set[str] = set()  # nodes whose steps Slurm asked to stop
    heard = dict.fromkeys(nodes, time.monotonic() + FIRST_HEARTBEAT_S - LOST_AFTER_S)
    lost: list[str] = []
    stopping = False
    watch = Hangs(job)
    resources = resources_recorder(job)
    ended_early: list[str] = []  # nodes whose steps were ended after their ranks had (NODES_ENDED_WAIT_S)
    ranks_done_at: float | None = None
    while (line := _next(lines)) is not None:
        rest = [n for n in nodes if n not in codes]
        if rest and not ended_early and all(watch.ranks_ended(n) for n in rest):
            ranks_done_at = ranks_done_at or time.monotonic()  # every node still running: its ranks have ended
            if (codes and all(c == 0 for c in codes.values()) and time.monotonic() - ranks_done_at >= NODES_ENDED_WAIT_S
                    and not job.get("image") and watch.hang is None and not stopping and not lost
                    and not signalled.is_set()):  # fmt: skip
                ended_early = rest
                note(
                    f"dtrain: the ranks on {', '.join(rest)} ended {NODES_ENDED_WAIT_S:.0f} s ago and the other "
                    "nodes' steps ended 0, but their steps go on: ending them; the job ends as its ranks did"
                )
                _kill_steps(job)
        else:
            ranks_done_at = None
        if watch.kill_at < time.monotonic() and proc.poll() is None:
            watch.kill_at = float("inf")
            _kill_steps(job)
        judge = not stopping and not signalled.is_set() and not lost
        if judge:
            watch.check_silent(set(codes))
        if line.startswith(CONTROL_PREFIX):  # an agent's hang report or its ranks' step times (node steps forward them)
            if not record_resources(resources, line):
                watch.on_control(line, judge=judge)
            continue
        if warned.is_set() and not stopping and not signalled.is_set():
            stopping = True
            print(f"{stamp()} dtrain: the job's time limit is near: every node checkpoints and stops; the job is "
                  "then requeued and continues the run", flush=True)  # fmt: skip
            with contextlib.suppress(OSError):
                Path(TIME_LIMIT_MARK).touch()
            _signal_steps("TERM")
        if line.startswith((HEARTBEAT_PREFIX, RESULT_PREFIX)):
            with contextlib.suppress(ValueError, KeyError):
                r = json.loads(line.split(" ", 1)[1])
                heard[r["node"]] = time.monotonic()
                if "exit" in r:
                    codes[r["node"]] = int(r["exit"])
                    if r.get("asked"):
                        asked.add(r["node"])
        elif line:
            watch.heard(line)
            print(line, flush=True)
        silent = [n for n in nodes if n not in codes and time.monotonic() - heard.get(n, 0) > LOST_AFTER_S]
        if silent and not lost and not signalled.is_set():
            # The node died (or its task did, outright): its peers fail at once, long before Slurm would mark
            # it down and requeue the job itself. Requeue now; the job resumes the run from its checkpoint.
            lost = silent
            print(f"{stamp()} dtrain: lost node(s) {', '.join(lost)} (no word for {LOST_AFTER_S:.0f} s): "
                  "requeueing the job; it resumes from its last complete checkpoint", flush=True)  # fmt: skip
            _requeue()
            proc.kill()  # srun would wait for the lost node's task until Slurm's KillWait runs out
            break
    proc.wait()
    for n in ended_early:
        codes.setdefault(n, 0)  # its ranks succeeded: torchrun waits in its exit barrier only after a success
    code = job_code(codes) if not lost and len(codes) >= len(nodes) else EXIT_FAILURE
    if resources is not None:
        # its last rows and the ranks' peaks, before the end is recorded (both write status.json); none for a refusal
        resources.close(refused=code == EXIT_USAGE)
    if not lost and len(codes) >= len(nodes):
        # Asked to stop (Slurm, the time limit, a node's processes by the cloud) and stopped as asked: preempted;
        # exit 3 that nobody asked for is a failure (dtrain.common.runrecord.job_outcome, as every launcher's).
        code = runrecord.job_outcome(code, codes.values(), asked=bool(asked) or stopping or signalled.is_set())
    if watch.hang is not None and not lost:
        code = EXIT_HUNG  # whatever the other nodes' steps made of their stop
    print(f"{stamp()} dtrain: job ended with exit code {code} (nodes: {codes})", flush=True)
    if watch.hang is not None and not lost:
        return hang_end(job, watch.hang, signalled=signalled.is_set())
    if stopping and not lost:
        return time_limit_end(job, code, signalled=signalled.is_set())
    if job.get("program"):
        requeued = bool(lost) or (code == EXIT_PREEMPTED and not signalled.is_set())
        program_ended(job, code, requeued=requeued)
    if code == EXIT_PREEMPTED and not lost and not signalled.is_set():
        # The ranks saved a checkpoint after a SIGTERM that was not Slurm's (a node's own shutdown, say).
        print(f"{stamp()} dtrain: preempted: requeueing the job; it resumes from its checkpoint", flush=True)
        _requeue()
    return code


def time_limit_end(job: dict[str, Any], code: int, *, signalled: bool) -> int:
    """The job was stopped before its time limit (code: its nodes'): requeue it to continue the run (a
    continuation, counted in its comment and recorded in the run), unless it finished, failed, was ended by
    Slurm meanwhile, or has had max_continuations already."""
    done, _ = continuations(_job_comment())
    limit = int(job.get("max_continuations", 0))
    if should_continue(code, warned=True, signalled=signalled, done=done, limit=limit):
        n = done + 1
        _set_field(TIME_LIMIT_COMMENT, time_limit_comment(n)[len(TIME_LIMIT_COMMENT) :])
        message = (f"time limit: checkpoint saved; the job is requeued and continues the run (continuation {n} "
                   f"of at most {limit})")  # fmt: skip
        record_time_limit(job, n, limit, message, stopped=False)
        print(f"{stamp()} dtrain: {message}", flush=True)
        _requeue()
        return code
    if code == EXIT_PREEMPTED and not signalled:
        _set_field(TIME_LIMIT_COMMENT, time_limit_comment(done, stopped=True)[len(TIME_LIMIT_COMMENT) :])
        message = (f"time limit: checkpoint saved; not continued: the job has had its {limit} continuation(s) "
                   "(max_continuations); resume the run to go on")  # fmt: skip
        record_time_limit(job, done, limit, message, stopped=True)
        print(f"{stamp()} dtrain: {message}", flush=True)
    elif job.get("program"):
        program_ended(job, code, requeued=False)
    return code


class Hangs:
    """The batch step's side of hang detection (docs/hangs.md, "Slurm"), as the SSH launcher's
    (dtrain.control.remote.Job._on_hang, _on_alive): the node agents' control lines, forwarded by the node steps
    with their node's name. A hang: its stacks into the run (hangs/<node>-rank<r>.txt), one line, a `hang` row
    in events.jsonl, and every node's step stopped (SIGTERM, SIGKILL HANG_KILL_S later); `hang_end` then
    requeues the job or ends it. The agents' median step times: the stragglers, in the run's events and in the
    job's Slurm comment (`dtrain jobs`)."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.hang: dict[str, Any] | None = None  # the first hang reported
        self.kill_at = float("inf")
        self.stragglers = StragglerSet()  # from the agents' "alive" lines
        self.alive: dict[str, tuple[float, float]] = {}  # node -> (its agent's last "alive", its hang timeout)
        self.ranks: dict[str, int] = {}  # node -> its ranks that ran at its agent's last "alive"
        self.had_ranks: set[str] = set()  # nodes whose agents have reported ranks running

    def ranks_ended(self, node: str) -> bool:
        """The node's agent has reported ranks running, and now none."""
        return node in self.had_ranks and self.ranks.get(node) == 0

    def check_silent(self, ended: set[str]) -> None:
        """An agent that said "alive" once and then nothing for its hang timeout (at least SILENT_FLOOR_S) while
        its node's step still runs (`ended`: the nodes whose steps have ended) is taken for hung, as over SSH."""
        if self.hang is not None:
            return
        now = time.monotonic()
        for node, (at, timeout) in self.alive.items():
            limit = max(SILENT_FLOOR_S, timeout)
            if node not in ended and timeout > 0 and now - at > limit:
                _signal_steps("TERM")
                self.kill_at = now + HANG_KILL_S
                line = silent_line(node, limit)
                self.hang = {"node": node, "silent_s": round(now - at, 1), "message": line}
                note(line)
                row = runrecord.event_row(HANG_EVENT, line, node=node, silent_s=self.hang["silent_s"],
                                          job_id=os.environ.get("SLURM_JOB_ID", ""))  # fmt: skip
                record_run(self.job, events=[row])
                return

    def heard(self, line: str) -> None:
        """Any line of a node's agent ("[<node>] ..." as its step prints it) says it answers, as over SSH."""
        node = line[1:].partition("] ")[0] if line.startswith("[") else ""
        if node in self.alive:
            self.alive[node] = (time.monotonic(), self.alive[node][1])

    def on_control(self, line: str, *, judge: bool) -> None:
        """`judge`: a hang is acted on (not while the job stops for its time limit, or Slurm ends it)."""
        try:
            ev = json.loads(line[len(CONTROL_PREFIX) :])
        except ValueError:
            return
        if not isinstance(ev, dict):
            return
        node = str(ev.pop("node", "") or ev.get("host") or "?")
        if ev.get("event") == HANG_EVENT and judge:
            self.on_hang(node, ev)
        elif ev.get("event") == "alive":
            with contextlib.suppress(TypeError, ValueError):
                self.alive[node] = (time.monotonic(), float(ev.get("timeout_s") or 0))
            with contextlib.suppress(TypeError, ValueError):
                if ev.get("ranks") is not None:  # an agent from before it was reported says nothing of its ranks
                    self.ranks[node] = int(ev["ranks"])
                    if self.ranks[node] > 0:
                        self.had_ranks.add(node)
            self.on_alive(node, ev)

    def on_hang(self, node: str, ev: dict[str, Any]) -> None:
        if self.hang is not None:
            return
        _signal_steps("TERM")  # the hung node's agent stops its own ranks; the others wait in a collective
        self.kill_at = time.monotonic() + HANG_KILL_S
        line, facts, files = hang_report(self.job["run_url"], node, ev)
        self.hang = {**facts, "message": line}
        record_run(self.job, files=files)  # the stacks first: the line names their file
        note(line)
        rest = {k: v for k, v in facts.items() if k != "step"}
        row = runrecord.event_row(HANG_EVENT, line, ev.get("step"), **rest, job_id=os.environ.get("SLURM_JOB_ID", ""))
        record_run(self.job, events=[row])

    def on_alive(self, node: str, ev: dict[str, Any]) -> None:
        medians = ev.get("medians")
        if not isinstance(medians, dict):
            return
        message = self.stragglers.update(node, medians)
        if message is None:
            return
        now = self.stragglers.now
        note(message)
        row = runrecord.event_row(STRAGGLER_EVENT, message, stragglers=now)
        record_run(self.job, events=[row])
        _set_field(STRAGGLERS_COMMENT, stragglers_field(now))


def hang_end(job: dict[str, Any], hang: dict[str, Any], *, signalled: bool) -> int:
    """The job hung (its nodes' steps have ended): requeue it to resume its run from the last complete checkpoint
    while its allowance lasts (job.json's max_restarts, the `--max-restarts` of the request; the hang requeues so
    far are counted in its Slurm comment, `dtrain:hangs:N`), else end it with exit 4 and the run failed."""
    done = hang_requeues(_job_comment())
    allowance = int(job.get("max_restarts") or 0)
    try:
        started = run_exists(job)
    except Exception:  # noqa: BLE001 - the run cannot be read: nothing to resume from
        started = False
    if should_requeue_hang(signalled=signalled, done=done, allowance=allowance, run_started=started):
        n = done + 1
        _set_field(HANGS_COMMENT, str(n))
        record_run(job, status={"state": "requeued", "reason": "hang", "hang_restarts": n},
                   drop=("exit_code", "error", "pid"))  # fmt: skip
        note(f"dtrain: the job hung: requeued; it resumes from its last complete checkpoint (restart {n} of "
             f"{allowance})")  # fmt: skip
        _requeue()
        return EXIT_HUNG
    if signalled:
        why = "the job was cancelled meanwhile"
    elif not started:
        why = "its run had not started"
    else:
        why = f"it has had its {allowance} restart(s) (--max-restarts)" if allowance else "--max-restarts is 0"
    record_run(job, status={"state": "failed", "exit_code": EXIT_HUNG, "error": hang_error(hang)})
    note(f"dtrain: the job hung and ends (exit {EXIT_HUNG}), not requeued: {why}")
    return EXIT_HUNG


def note(line: str) -> None:
    """One of the batch step's own lines: to the job's output file and to this node's log in the job's directory
    (logs/<node>.log, appended whole), which `dtrain logs` and `dtrain train`'s follower show."""
    text = f"{stamp()} {line}"
    print(text, flush=True)
    name = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    with contextlib.suppress(OSError):
        Path("logs").mkdir(exist_ok=True)
        fd = os.open(f"logs/{name}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (text + "\n").encode())
        finally:
            os.close(fd)


def record_run(
    job: dict[str, Any],
    *,
    files: dict[str, str] | None = None,
    events: list[dict[str, Any]] | None = None,
    status: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
) -> None:
    """Write into the job's run: `files` (relative path -> text), `events` (events.jsonl rows), `status` (merged
    into status.json, `drop` keys removed). Best effort, each part on its own: the run's store may be a folder or
    gs://; in container mode the node has no storage libraries and the job's image does it."""
    if job.get("image") and not os.environ.get(IN_IMAGE_ENV):
        path = Path(f"record-{os.getpid()}-{time.monotonic_ns()}.json")
        with contextlib.suppress(Exception):
            path.write_text(json.dumps({"files": files, "events": events, "status": status, "drop": list(drop)}))
            in_image(job, ["record", "job.json", str(path)], capture=True)
        with contextlib.suppress(OSError):
            path.unlink()
        return
    from dtrain.common.storage import open_store

    with _environ(job_env(job)):
        try:
            run = open_store(job["run_url"])
        except Exception:  # noqa: BLE001
            return
        for rel, text in (files or {}).items():
            with contextlib.suppress(Exception):
                run.write_bytes(rel, text.encode())
        runrecord.append_events(run, events or [])
        if status is not None:
            with contextlib.suppress(Exception):
                runrecord.update_status(run, status, drop=drop)


RESOURCES_STAGING = "resources-staging"  # container mode: this start's rows, in the job's directory, until its end


def resources_recorder(job: dict[str, Any]) -> Any:
    """Where the agents' "resources" lines go (dtrain.common.resources.Recorder): the run, opened here. In container
    mode the node has no storage libraries: the rows wait in the job's directory, and at the start's end one
    container adds them to the run (ImageResources). None where the run cannot be opened."""
    from dtrain.common.resources import Recorder
    from dtrain.common.storage import open_store

    if job.get("image") and not os.environ.get(IN_IMAGE_ENV):
        return ImageResources(job)
    with contextlib.suppress(Exception), _environ(job_env(job)):
        return Recorder(open_store(job["run_url"]))
    return None


class ImageResources:
    """The batch step's Recorder in container mode: rows and peaks kept in RESOURCES_STAGING (a Recorder over a
    local folder, bounded as the run's files are), published to the run by one `slurmstep resources` in the job's
    image when the start ends (dtrain.common.resources.publish: rows appended, peaks merged), not a container
    every few seconds."""

    def __init__(self, job: dict[str, Any]) -> None:
        import shutil

        from dtrain.common.resources import Recorder
        from dtrain.common.storage import open_store

        self.job, self.dir = job, Path(RESOURCES_STAGING)
        shutil.rmtree(self.dir, ignore_errors=True)  # an earlier start's that never got to its end
        self.recorder = Recorder(open_store(str(self.dir)), flush_s=0.0, staging=True)

    def add(self, node: str, row: dict[str, Any]) -> None:
        self.recorder.add(node, row)

    def close(self, refused: bool = False) -> None:
        import shutil

        self.recorder.close()
        # a refusal (exit 2) changes nothing in the run: its staged rows are not published
        if not refused and any(self.dir.glob("resources/*.jsonl")):
            with contextlib.suppress(Exception):  # best effort: curves never fail a job
                in_image(self.job, ["resources", "job.json", str(self.dir.resolve())], capture=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def record_resources(recorder: Any, line: str) -> bool:
    """A forwarded "resources" control line ({"event": "resources", "node", ...the row}) into the run; False if
    the line is another event."""
    try:
        ev = json.loads(line[len(CONTROL_PREFIX) :])
    except ValueError:
        return False
    if not isinstance(ev, dict) or ev.get("event") != RESOURCES_EVENT:
        return False
    if recorder is not None:
        node = str(ev.get("node") or "?")
        recorder.add(node, {k: v for k, v in ev.items() if k not in ("event", "node")})
    return True


def record_time_limit(job: dict[str, Any], count: int, limit: int, message: str, *, stopped: bool) -> None:
    """The run's side of a time-limit stop: an events.jsonl row, and status.json requeued (reason "time limit",
    the continuations so far) while the job continues, so the run is not shown preempted with a --resume hint;
    a stop at the limit of continuations stays preempted (a resume continues it). The row is the stop's one
    label (dtrain.common.runrecord), at the run's last complete checkpoint. Best effort."""
    from dtrain.common.storage import open_store

    with contextlib.suppress(Exception), _environ(job_env(job)):
        run = open_store(job["run_url"])
        row = runrecord.event_row(TIME_LIMIT_EVENT, message, runrecord.last_step(run), continuation=count,
                                  max_continuations=limit, continued=not stopped,
                                  job_id=os.environ.get("SLURM_JOB_ID", ""))  # fmt: skip
        runrecord.append_events(run, [row])
        fields: dict[str, Any] = {"reason": "time limit", "continuations": count}
        if stopped:
            fields.update(state=runrecord.PREEMPTED, exit_code=EXIT_PREEMPTED)
        else:
            fields["state"] = runrecord.REQUEUED
        runrecord.update_status(run, fields, drop=() if stopped else ("exit_code",))


def _signal_steps(name: str) -> None:
    """Signal every process of the job's steps (srun's tasks on every node), not the batch step, as Slurm's own
    termination does: the built-ins checkpoint and exit 3, a program's node step makes its stop file."""
    _slurm(["scancel", f"--signal={name}", os.environ.get("SLURM_JOB_ID", "")])


def _job_comment() -> str:
    out = _slurm(["scontrol", "-o", "show", "job", os.environ.get("SLURM_JOB_ID", "")])
    for field in out.split():
        if field.startswith("Comment="):
            return field.split("=", 1)[1]
    return ""


def _set_comment(comment: str) -> None:
    _slurm(["scontrol", "update", f"JobId={os.environ.get('SLURM_JOB_ID', '')}", f"Comment={comment}"])


def _slurm(argv: list[str]) -> str:
    """One of Slurm's commands, its output; "" where it cannot run (the batch step goes on: best effort)."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _set_field(prefix: str, value: str | None) -> None:
    """One of dtrain's fields in the job's Slurm comment (None: removed), the others kept."""
    _set_comment(with_field(_job_comment(), prefix, value))


def _kill_steps(job: dict[str, Any]) -> None:
    """SIGKILL to every process of the job's steps (srun's tasks), not the batch step: what a hang's SIGTERM left.
    Not in container mode: the containers are not the steps' processes, and their agents stop them (a killed
    node step would leave its container running); srun's --wait ends those steps."""
    if job.get("image"):
        return
    job_id = os.environ.get("SLURM_JOB_ID", "")
    out = _slurm(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"])
    steps = [s for s in out.split() if s.startswith(f"{job_id}.") and s.split(".", 1)[1].isdigit()]
    for step in steps:  # scancel --signal=KILL of the job itself would reach the batch step too
        _slurm(["scancel", "--signal=KILL", step])


def program_started(job: dict[str, Any], *, restarts: int, nodes: list[str], resume: bool) -> None:
    """A training job (job["program"]): its run is dtrain's to record, as the SSH launcher does
    (dtrain.control.userjob.record_start). On a program's first start, config.json (its job, the world size
    worked out here; a built-in writes its own); on every start, status.json running with the starts so far.
    Where the job's directory is one shared by its nodes (a user's cluster), so is the checkpoint directory: it
    is put back here, once, before any node starts (on dtrain's own clusters every node restores its own:
    dtrain.common.nodeagent.JobFiles)."""
    from dtrain.common.nodeagent import smi_gpus
    from dtrain.common.rundir import write_json
    from dtrain.common.storage import open_store

    if job.get("image") and not os.environ.get(IN_IMAGE_ENV):
        args = ["started", "job.json", str(restarts), ",".join(nodes), str(int(resume))]
        if in_image(job, args).returncode != 0:
            raise RuntimeError(f"recording the start in {job['image']} failed (its output is above)")
        return
    p = job["program"]
    with _environ(job_env(job)):
        run = open_store(job["run_url"])
        if p.get("config") is not None and not run.exists("config.json"):  # None: a built-in writes its own
            config = {**p["config"], "created": time.time(), "nodes": len(nodes)}
            if p.get("torchrun"):
                cpus = int(os.environ.get("SLURM_CPUS_ON_NODE") or os.cpu_count() or 1)
                with contextlib.suppress(UserError):
                    config["world_size"] = len(nodes) * processes(job, cpus, len(smi_gpus()))
            write_json(run, "config.json", config)
        runrecord.record_start(run, starts=int(p.get("restarts", 0)) + restarts + 1, host=os.uname().nodename,
                               job_id=os.environ.get("SLURM_JOB_ID", ""))  # fmt: skip
        if resume and p.get("shared"):
            from dtrain.common.mirror import restore

            spec = next(iter(job["specs"].values()))
            got = restore(open_store(spec["files"]["mirror"]["store"]), Path(spec["files"]["checkpoint_dir"]),
                          log=lambda m: print(f"{stamp()} dtrain: {m}", flush=True))  # fmt: skip
            if got is not None:
                print(f"{stamp()} dtrain: checkpoint directory restored from the run: {got.files} file(s), "
                      f"{got.bytes} bytes", flush=True)  # fmt: skip


def program_ended(job: dict[str, Any], code: int, *, requeued: bool) -> None:
    """status.json at the end of a program's start (dtrain.common.runrecord.record_end, as every launcher's: its
    state and exit code, or requeued: it starts again; a preemption's label). Best effort: the job's own exit code
    is what Slurm keeps."""
    from dtrain.common.storage import open_store

    if job.get("image") and not os.environ.get(IN_IMAGE_ENV):
        with contextlib.suppress(Exception):
            in_image(job, ["ended", "job.json", str(code), str(int(requeued))])
        return
    with contextlib.suppress(Exception), _environ(job_env(job)):
        runrecord.record_end(open_store(job["run_url"]), code, requeued=requeued)


def _next(lines: queue.Queue[str | None]) -> str | None:
    """The next output line, or "" after a second without one (the caller then checks on the nodes)."""
    try:
        return lines.get(timeout=1.0)
    except queue.Empty:
        return ""


def _requeue() -> None:
    subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)


# ---------------------------------------------------------------------------------------------
# node


def node_address(name: str) -> str:
    """A node's address as Slurm reaches it (NodeAddr), for the rendezvous and --local-addr."""
    out = subprocess.run(["scontrol", "-o", "show", "node", name], capture_output=True, text=True, check=False).stdout
    for field in out.split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1]
    return name


def processes(job: dict[str, Any], cpus: int, gpus: int, where: str = "this node") -> int:
    """Processes on this node for torchrun: the rule every launcher applies (dtrain.common.nproc: as asked,
    checked against its GPUs or cores and, with --oversubscribe, a per-core ceiling; else one per GPU, else
    2 on 2+ cores). A command runs once per node. Raises UserError."""
    from dtrain.common.nproc import processes as rule

    if job.get("program") and not job["program"].get("torchrun"):
        return 1
    n = int(job.get("nproc") or 0)
    return rule(n, gpus=gpus, cpus=cpus, oversubscribe=bool(job.get("oversubscribe")), where=where)


def fill(spec: Any, values: dict[str, str], args: list[str]) -> Any:
    """The spec with every token replaced, and ARGS_TOKEN spliced out into `args`; a container's inner agent
    spec (INNER_SPEC_KEY) filled in too and put in the environment it is read from."""
    out = _fill(spec, values, args)
    if isinstance(out, dict) and INNER_SPEC_KEY in out:
        from dtrain.common.nodeagent import INNER_SPEC_ENV

        out.setdefault("env", {})[INNER_SPEC_ENV] = json.dumps(out.pop(INNER_SPEC_KEY))
    return out


def _fill(spec: Any, values: dict[str, str], args: list[str]) -> Any:
    if isinstance(spec, dict):
        return {k: _fill(v, values, args) for k, v in spec.items()}
    if isinstance(spec, list):
        out: list[Any] = []
        for v in spec:
            out.extend(args if v == ARGS_TOKEN else [_fill(v, values, args)])
        return out
    if isinstance(spec, str):
        for token, value in values.items():
            spec = spec.replace(token, value)
    return spec


def node(jobfile: str, mode: str) -> int:
    from dtrain.common.nodeagent import smi_gpus

    job = read_job(jobfile)
    name = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    container = bool(job.get("image"))
    logs = Path("logs")
    logs.mkdir(exist_ok=True)
    log = (logs / f"{name}.log").open("a", encoding="utf-8")
    interactive = bool(job.get("interactive"))

    def emit(line: str) -> None:
        if line.startswith(PROGRESS_PREFIX) and not interactive:
            return  # a queued job's progress bar has no terminal to go to
        log.write(f"{stamp()} {line}\n")
        log.flush()
        if not line.startswith(PROGRESS_PREFIX):
            say(f"[{name}] {line}")

    got: list[int] = []
    agent: subprocess.Popen | None = None
    alive = threading.Event()
    threading.Thread(target=_heartbeat, args=(name, alive), daemon=True).start()
    program = job.get("program")
    stopping: dict[str, Any] = {}  # a program's stop file and grace period, once its spec is filled in

    def tell_agent(word: str) -> None:
        if agent is not None and agent.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                agent.stdin.write(f"{word}\n".encode())
                agent.stdin.flush()

    def on_signal(signum: int, _frame: Any) -> None:
        got.append(signum)
        # Slurm signals every process of the step; a container's are not among them: tell the agent.
        if container:
            tell_agent("INT" if signum == signal.SIGINT else "TERM")
        if stopping and "timer" not in stopping:
            # A user's program got the signal from Slurm itself; it also gets the stop file, and the grace
            # period: then the agent kills whatever is left of it (Slurm's own KillWait is longer).
            with contextlib.suppress(OSError):
                Path(stopping["file"]).touch()
            stopping["timer"] = threading.Timer(stopping["grace"], tell_agent, args=("KILL",))
            stopping["timer"].daemon = True
            stopping["timer"].start()

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    code = EXIT_FAILURE
    try:
        master = allocation_nodes()[0]
        cpus = int(os.environ.get("SLURM_CPUS_ON_NODE") or os.cpu_count() or 1)
        gpus = len(smi_gpus())
        try:
            nproc = processes(job, cpus, gpus, where=f"node {name}")
        except UserError as e:
            emit(f"error: {e}")
            code = EXIT_USAGE
            return code
        rank = int(os.environ.get("SLURM_NODEID") or 0)  # this node's index in the allocation (0: the first)
        values = {
            "__dtrain_master_addr__": node_address(master),
            "__dtrain_addr__": node_address(name),
            "__dtrain_is_host__": "1" if name == master else "0",
            "__dtrain_nproc__": str(nproc),
            "__dtrain_threads__": str(max(1, cpus // nproc)),
            "__dtrain_node__": name,
            "__dtrain_nnodes__": os.environ.get("SLURM_JOB_NUM_NODES", "1"),
            "__dtrain_node_rank__": str(rank),
        }
        key = name if name in job["specs"] else "*"
        spec = fill(job["specs"][key], values, job["argv_resume" if mode == "resume" else "argv_new"])
        if program:
            try:
                spec = node_program_spec(job, spec, key=key, name=name, rank=rank, resume=mode == "resume", emit=emit)
            except UserError as e:  # its requirements did not install: one line naming the node, package and log
                emit(f"error: {e}")
                code = EXIT_USAGE
                return code
            stopping.update(file=spec["files"]["stop_file"], grace=float(spec.get("grace_s", STOP_GRACE_S)))
            if container:  # the program in its image: an agent inside runs the spec (nodeagent.program_container)
                from dtrain.common.nodeagent import program_container

                spec = program_container(spec, image=job["image"], run_id=job["run_id"], node=name,
                                         docker=_docker(job, key), gpus=gpus > 0, run_url=job["run_url"])  # fmt: skip
                stopping["grace"] = float(spec["grace_s"])  # its grace period, then its last checkpoint copy
            if got:  # stopped while its requirements were installed: nothing to start
                code = EXIT_PREEMPTED
                return code
        what = f"{nproc} process(es)" if not program or program.get("torchrun") else "the command"
        emit(f"dtrain: {mode} on {name} ({values['__dtrain_addr__']}): {what}, rendezvous on {master}")
        agent = subprocess.Popen(
            [sys.executable, "-c", AGENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        agent.stdin.write((json.dumps(spec) + "\n").encode())  # type: ignore[union-attr]
        agent.stdin.flush()  # type: ignore[union-attr]
        hang_line = None
        for raw in agent.stdout:  # type: ignore[union-attr]
            line = raw.decode(errors="replace").rstrip("\r\n")
            if line.startswith(CONTROL_PREFIX):
                hang_line = forward_control(line, name) or hang_line
            elif line != hang_line:  # the agent's own hang line names its node's file: the batch step names the run's
                emit(line)
        code = agent.wait()
        if code == SIGTERM_EXIT and signal.SIGTERM in got:
            code = EXIT_PREEMPTED  # torchrun was sent SIGTERM with its workers, which checkpointed and stopped
        elif program and signal.SIGINT in got:
            code = EXIT_INTERRUPTED
        elif program and signal.SIGTERM in got and stopped_as_asked(code):
            code = EXIT_PREEMPTED  # asked to stop, and it did: safe to resume (as dtrain.control.userjob.exit_code)
        if code == EXIT_PREEMPTED and program and run_completed(job):
            emit(COMPLETED_LINE)
            code = EXIT_OK  # a built-in recorded its completion; the stop reached its teardown
        if code == EXIT_PREEMPTED and Path(TIME_LIMIT_MARK).exists():
            # The ranks' own "preempted ... resume with --resume" is not the next step here: say what is.
            emit(TIME_LIMIT_LINE)
        return code
    finally:
        alive.set()
        if "timer" in stopping:
            stopping["timer"].cancel()
        log.close()
        if not container:
            _keep_log(job, logs / f"{name}.log")
        # "asked": Slurm signalled this node's step (a cancel, a preemption, a time limit, a node's shutdown)
        say(RESULT_PREFIX + json.dumps({"node": name, "exit": code, "asked": signal.SIGTERM in got}))


def forward_control(line: str, node: str) -> str | None:
    """An agent's hang report or its ranks' step times (its "alive" lines), to the batch step (class Hangs) with
    this node's name; each rank's stacks cut to STACK_MAX_CHARS (srun carries whole lines). A hang report's own
    line, which the agent prints next, is returned."""
    try:
        ev = json.loads(line[len(CONTROL_PREFIX) :])
    except ValueError:
        return None
    if not isinstance(ev, dict) or ev.get("event") not in (HANG_EVENT, "alive", RESOURCES_EVENT):
        return None
    if isinstance(ev.get("stacks"), dict):
        ev["stacks"] = {r: str(t)[-STACK_MAX_CHARS:] for r, t in ev["stacks"].items()}
    say(CONTROL_PREFIX + json.dumps({**ev, "node": node}))
    return ev.get("line") if ev.get("event") == HANG_EVENT else None


def node_program_spec(
    job: dict[str, Any], spec: dict[str, Any], *, key: str, name: str, rank: int, resume: bool, emit: Any
) -> dict[str, Any]:
    """A user's program on this node: its requirements (dtrain.common.deps, once per node per content hash,
    in <workdir>/envs: shared by every node where the workdir is shared, under deps' lock), the interpreter
    that has them, and what differs by node: the rank's copy of the checkpoint directory (on a shared job
    directory only the first node copies it, and the batch step restored it), the metrics forwarded from
    the first node, and DTRAIN_RESTART_COUNT (starts before this job's + Slurm's requeues)."""
    from dtrain.common import deps, jobenv

    p = job["program"]
    say = lambda m: emit(f"dtrain: {m}")  # noqa: E731
    if not p.get("workdir", True):  # a built-in: dtrain's code, the node's Python (in an image, the image's)
        found = {"python": "python3" if job.get("image") else (p["python"].get(key) or job["python"])}
    elif job.get("image"):  # the image's Python makes the environment, in a container: it sees the image's torch
        found = deps.ensure_in_image(Path("work"), Path("../../envs"), image=job["image"], docker=_docker(job, key),
                                     setup=p.get("setup", []), node=name, log=say)  # fmt: skip
    else:
        base = p["python"].get(key) or job["python"]
        found = dataclasses.asdict(deps.ensure_env(Path("work"), Path("../../envs"), setup=p.get("setup", []),
                                                   base_python=base, node=name, log=say))  # fmt: skip
    if found.get("key"):
        emit(f"dtrain: requirements {'installed' if found.get('created') else 'reused'} on {name} ({found['key']})")
    python = str(found["python"])
    if p.get("torchrun"):
        spec["argv"][0] = python
    if "/" in python:  # the job's tools (accelerate, deepspeed, ...) and `python` first on PATH
        spec["path_prepend"] = os.path.dirname(os.path.abspath(python))
    files = spec["files"]
    if rank != 0:
        files["forward"] = []
    mirror = files.get("mirror")
    if mirror is not None:
        if p.get("shared") and rank != 0:
            del files["mirror"]  # one directory for the job: the first node copies it
        else:
            mirror.update(node=rank, restore=resume and not p.get("shared"))
    restarts = int(os.environ.get(RESTARTS_ENV) or os.environ.get("SLURM_RESTART_COUNT") or 0)
    spec["env"][jobenv.RESTART_COUNT] = str(int(p.get("restarts", 0)) + restarts)
    return spec


_say_lock = threading.Lock()


def say(line: str) -> None:
    """One whole line to stdout (srun carries it to the batch step), from any thread."""
    with _say_lock:
        print(line, flush=True)


def _heartbeat(name: str, done: threading.Event) -> None:
    while not done.is_set():
        say(HEARTBEAT_PREFIX + json.dumps({"node": name}))
        done.wait(HEARTBEAT_S)


def _keep_log(job: dict[str, Any], path: Path) -> None:
    """A copy of this node's log under the run (logs/<node>.log), so that `dtrain logs RUN` has it; not for
    a job that only reads the run (an evaluation: keep_log false), whose log would replace the training's."""
    if job.get("keep_log") is False:
        return
    with contextlib.suppress(Exception), _environ(job_env(job)):
        from dtrain.common.storage import open_store

        run = open_store(job["run_url"])
        if run.exists("config.json") and Path(run.url).resolve() != Path.cwd().resolve():
            run.write_bytes(f"logs/{path.name}", path.read_bytes())


# ---------------------------------------------------------------------------------------------
# follow


def follow(directory: str, once: bool) -> int:
    """Print `<node> <line>` for every line of DIR/*.log, then, unless `once`, every line appended to them
    (new files included) until stdin closes."""
    closed = threading.Event()
    if not once:

        def watch() -> None:
            sys.stdin.read()
            closed.set()

        threading.Thread(target=watch, daemon=True).start()
    offsets: dict[Path, int] = {}
    partial: dict[Path, bytes] = {}
    d = Path(directory)
    while True:
        for path in sorted(d.glob("*.log")) if d.is_dir() else []:
            with contextlib.suppress(OSError), path.open("rb") as f:
                f.seek(offsets.get(path, 0))
                data = partial.pop(path, b"") + f.read()
                offsets[path] = f.tell()
            lines = data.split(b"\n")
            if lines[-1]:
                partial[path] = lines[-1]  # a line still being written
            out = "".join(f"{path.stem} {ln.decode(errors='replace')}\n" for ln in lines[:-1])
            if out:
                sys.stdout.write(out)
                sys.stdout.flush()
        if once or closed.wait(FOLLOW_POLL_S):
            return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["batch"] and len(args) == 2:
        return batch(args[1])
    if args[:1] == ["node"] and len(args) == 3 and args[2] in ("new", "resume"):
        return node(args[1], args[2])
    if args[:1] == ["follow"] and len(args) in (2, 3):
        return follow(args[1], once=args[2:] == ["--once"])
    if args[:1] == ["exists"] and len(args) == 2:
        return 0 if exists(args[1]) else 1
    if args[:1] == ["completed"] and len(args) == 2:  # run_completed, in the job's image
        return 0 if completed(args[1]) else 1
    if args[:1] == ["started"] and len(args) == 5:  # program_started, in the job's image
        program_started(read_job(args[1]), restarts=int(args[2]), nodes=args[3].split(","), resume=args[4] == "1")
        return 0
    if args[:1] == ["record"] and len(args) == 3:  # record_run, in the job's image
        what = json.loads(Path(args[2]).read_text())
        record_run(read_job(args[1]), files=what.get("files"), events=what.get("events"), status=what.get("status"),
                   drop=tuple(what.get("drop") or ()))  # fmt: skip
        return 0
    if args[:1] == ["resources"] and len(args) == 3:  # ImageResources.close, in the job's image
        from dtrain.common.resources import publish
        from dtrain.common.storage import open_store

        with _environ(job_env(job := read_job(args[1]))):
            publish(open_store(args[2]), open_store(job["run_url"]))
        return 0
    if args[:1] == ["ended"] and len(args) == 4:  # program_ended, in the job's image
        program_ended(read_job(args[1]), int(args[2]), requeued=args[3] == "1")
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
