"""What a job runs: the user's program, and the job around it.

    dtrain train [OPTIONS] train.py [ARGS]...          a Python script, under torchrun on every node
    dtrain train [OPTIONS] -m pkg.module [ARGS]...     a module, under torchrun (torchrun's own -m)
    dtrain train [OPTIONS] NAME [ARGS]...              a [jobs.NAME] table of dtrain.toml, or a built-in (mnist, lora)
    dtrain train [OPTIONS] -- COMMAND [ARGS]...        any command, once per node, with the node's rank

dtrain's options may stand before or after the program; everything after `--` that follows a
program goes to it untouched, and so do options dtrain does not know (docs/user-code.md). A
`[jobs.NAME]` table writes the same down:

    [jobs.finetune]
    script = "train.py"           # or module = "pkg.train", or command = ["accelerate", "launch", ...]
    args = ["--lr", "3e-4"]       #   (a command given as one string runs under bash -c: $NODE_RANK expands)
    workdir = "."                 # relative to dtrain.toml's folder; default: that folder
    setup = ["make data"]         # run once per node per content, after requirements.txt
    env = {WANDB_MODE = "offline"}
    nodes = 2                     # default: every node of the cluster
    nproc = 0                     # processes per node (0: one per GPU, or 2 on CPU)
    cluster = "lab"
    image = ""
    max_restarts = 2

No torch here: the control layer reads it.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dtrain.common.errors import UserError

SCRIPT, MODULE, COMMAND, SHELL = "script", "module", "command", "shell"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,39}")
JOB_KEYS = {
    "script": "a Python file, relative to workdir",
    "module": "a Python module to run with -m",
    "command": "a command (a list, or one string run under bash -c)",
    "args": "arguments for the script or module (a list of strings)",
    "workdir": "the project folder synced to every node (relative to dtrain.toml's folder)",
    "setup": "commands run once per node per content hash, after requirements.txt",
    "env": "environment variables for the job (a table of strings)",
    "nodes": "how many of the cluster's nodes to use (0: all)",
    "nproc": "processes per node for a script or module (0: one per GPU, or 2 on CPU)",
    "cluster": "a [clusters.NAME] to run on (default: this machine)",
    "image": "a Docker image to run in (container mode)",
    "max_restarts": "relaunches of the whole job after a failure",
    "checkpoint_dir": "where the program writes checkpoints, relative to workdir (default: dtrain's own)",
    "code_limit": "the most MB of working directory to sync (default 200)",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Program:
    """One program: `kind` script | module (under torchrun) | command (argv) | shell (one bash -c line)."""

    kind: str
    target: str  # the script's path relative to workdir, the module, or "" for command/shell
    args: tuple[str, ...] = ()  # the script's or module's arguments; the command's argv; the shell line

    @property
    def under_torchrun(self) -> bool:
        return self.kind in (SCRIPT, MODULE)

    def torchrun_tail(self) -> list[str]:
        """What follows torchrun's own options."""
        if self.kind == SCRIPT:
            return [self.target, *self.args]
        if self.kind == MODULE:
            return ["-m", self.target, *self.args]
        raise ValueError(f"a {self.kind} does not run under torchrun")

    def command_argv(self) -> list[str]:
        if self.kind == COMMAND:
            return list(self.args)
        if self.kind == SHELL:
            return ["bash", "-c", self.args[0]]
        raise ValueError(f"a {self.kind} runs under torchrun")

    def describe(self) -> str:
        if self.kind == SCRIPT:
            return shlex.join([self.target, *self.args])
        if self.kind == MODULE:
            return shlex.join(["-m", self.target, *self.args])
        if self.kind == SHELL:
            return self.args[0]
        return shlex.join(self.args)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "args": list(self.args)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Program:
        return cls(kind=str(d["kind"]), target=str(d.get("target", "")), args=tuple(d.get("args", ())))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Job:
    """A program and what surrounds it on the nodes. `workdir` None: dtrain's own code (a built-in's module)."""

    name: str  # the run id's prefix: the job table's name, the script's stem, the command's first word
    program: Program
    workdir: Path | None = None
    setup: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    nodes: int = 0
    checkpoint_dir: str = ""  # relative to workdir; "" is dtrain's own per-run directory
    code_limit_mb: int = 0  # the most the working directory may hold to sync; 0: codesync's default
    time: str = ""  # a Slurm job's --time ("": the cluster table's); not saved with the run

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "program": self.program.to_json(),
            "workdir": str(self.workdir) if self.workdir else None,
            "setup": list(self.setup),
            "env": dict(self.env),
            "nodes": self.nodes,
            "checkpoint_dir": self.checkpoint_dir,
            "code_limit_mb": self.code_limit_mb,
        }


@dataclasses.dataclass(frozen=True)
class Parsed:
    """`dtrain train`'s command line split: dtrain's options (name -> value) and the program."""

    options: dict[str, Any]
    program: Program | None  # None: a job table or a built-in named by `name`
    name: str  # the job table or built-in, when program is None
    extra: tuple[str, ...]  # arguments added to that job table's program, or to a resumed run's (`-- ARGS`)


def job_name(text: str) -> str:
    """A job's name from a script stem or a command word ("train.py" -> "train")."""
    stem = Path(text).name.removesuffix(".py") or "job"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-._")[:40] or "job"


def run_prefix(name: str) -> str:
    """The run id's first part (<prefix>-<utc>-<hex>, dtrain.common.rundir): lower-case letters and digits."""
    return re.sub(r"[^a-z0-9]", "", name.lower())[:24] or "job"


# ---------------------------------------------------------------------------------------------
# the command line


@dataclasses.dataclass(frozen=True)
class Option:
    name: str  # "--cluster"
    dest: str
    takes_value: bool
    repeat: bool = False
    convert: Any = str
    help: str = ""
    metavar: str = ""  # what --help shows after the name of an option that takes a value


def _nonneg_int(flag: str) -> Any:
    def conv(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise UserError(f"{flag} must be a whole number, got {v!r}") from None
        if n < 0:
            raise UserError(f"{flag} must be >= 0, got {n}")
        return n

    return conv


def _seconds(flag: str, zero: str):
    def conv(v: str) -> float:
        try:
            s = float(v)
        except ValueError:
            raise UserError(f"{flag} must be a number of seconds ({zero}), got {v!r}") from None
        if s < 0 or s != s or s == float("inf"):
            raise UserError(f"{flag} must be >= 0 seconds ({zero}), got {v!r}")
        return s

    return conv


def _slurm_time(v: str) -> str:
    from dtrain.control.slurm.spec import check_time

    return check_time(v, "--time")


OPTIONS = [
    Option(
        "--cluster", "cluster", True, help="a [clusters.NAME] from dtrain.toml (default: this machine)", metavar="NAME"
    ),
    Option(
        "--nodes",
        "nodes",
        True,
        convert=_nonneg_int("--nodes"),
        help="use the cluster's first N nodes (0: all)",
        metavar="N",
    ),
    Option("--nproc", "nproc", True, convert=_nonneg_int("--nproc"), help="processes per node (0: auto)", metavar="N"),
    Option(
        "--output",
        "output",
        True,
        help="the folder of the runs, each as <output>/<run-id>/: a directory or gs://bucket/prefix (default: runs)",
        metavar="DIR|gs://...",
    ),
    Option(
        "--resume",
        "resume",
        True,
        help="a run id (under ./runs), or a run's folder or gs:// URL, to continue; its checkpoints are put back first",
        metavar="RUN|PATH",
    ),
    Option("--run-id", "run_id", True, help="the run's id (default: generated)", metavar="ID"),
    Option(
        "--max-restarts",
        "max_restarts",
        True,
        convert=_nonneg_int("--max-restarts"),
        help="relaunches after a failure",
        metavar="N",
    ),
    Option(
        "--hang-timeout",
        "hang_timeout",
        True,
        convert=_seconds("--hang-timeout", "0: off"),
        help="seconds without progress before a hung job is stopped (0: off; default: from the step time)",
        metavar="SECONDS",
    ),
    Option(
        "--startup-timeout",
        "startup_timeout",
        True,
        convert=_seconds("--startup-timeout", "0: no bound of its own"),
        help="seconds without progress before a rank still starting is hung (0: none of its own; default: 300)",
        metavar="SECONDS",
    ),
    Option(
        "--time",
        "time",
        True,
        convert=_slurm_time,
        help="the Slurm job's time limit (minutes, HH:MM:SS, D-HH:MM:SS); at it the job checkpoints and continues",
        metavar="LIMIT",
    ),
    Option("--workdir", "workdir", True, help="the project folder synced to every node (default: .)", metavar="DIR"),
    Option(
        "--setup",
        "setup",
        True,
        repeat=True,
        help="a command run once per node per content (repeatable)",
        metavar="CMD",
    ),
    Option(
        "--env", "env", True, repeat=True, help="NAME=VALUE for the job's processes (repeatable)", metavar="NAME=VALUE"
    ),
    Option(
        "--checkpoint-dir",
        "checkpoint_dir",
        True,
        help="the folder (in workdir) the program saves checkpoints in; default: $DTRAIN_CHECKPOINT_DIR's own",
        metavar="DIR",
    ),
    Option(
        "--code-limit",
        "code_limit",
        True,
        convert=_nonneg_int("--code-limit"),
        help="the most MB of working directory to sync (default 200)",
        metavar="MB",
    ),
    Option("--image", "image", True, help="run in this Docker image on every node (container mode)", metavar="IMAGE"),
    Option("--accept-new-host-keys", "accept_new_host_keys", False, help="trust first-seen SSH host keys"),
    Option("--oversubscribe", "oversubscribe", False, help="allow more processes than cores (or GPUs)"),
]
_BY_NAME = {o.name: o for o in OPTIONS}
# `dtrain submit`'s own, besides OPTIONS: not dtrain train's, so `dtrain train train.py --name x` still gives
# --name to the script.
SUBMIT_OPTIONS = [Option("--name", "name", True, help="the Slurm job's name (default: the job's)", metavar="NAME")]


def parse_command_line(argv: Sequence[str], extra: Sequence[Option] = ()) -> Parsed:
    """Split `dtrain train`'s arguments (everything after `train`; `extra`: a command's own options besides
    OPTIONS, such as SUBMIT_OPTIONS). Raises UserError for a malformed line."""
    by_name = {**_BY_NAME, **{o.name: o for o in extra}}
    argv = list(argv)
    tail: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, tail = argv[:i], argv[i + 1 :]
    options: dict[str, Any] = {}
    head: list[str] = []  # the program and its arguments, in order
    module = False
    i = 0
    while i < len(argv):
        tok = argv[i]
        name, eq, inline = tok.partition("=")
        opt = by_name.get(name) if tok.startswith("--") else None
        if opt is not None:
            if opt.takes_value:
                if eq:
                    value = inline
                elif i + 1 < len(argv):
                    i += 1
                    value = argv[i]
                else:
                    raise UserError(f"{opt.name} needs a value")
                value = opt.convert(value)
                if opt.repeat:
                    options.setdefault(opt.dest, []).append(value)
                else:
                    options[opt.dest] = value
            elif eq:
                raise UserError(f"{opt.name} takes no value")
            else:
                options[opt.dest] = True
        elif not head and tok == "-m":
            if i + 1 >= len(argv):
                raise UserError("-m needs a module name (dtrain train -m pkg.train)")
            module = True
            i += 1
            head.append(argv[i])
        elif not head and tok.startswith("-"):
            close = difflib.get_close_matches(name, list(by_name), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise UserError(
                f"unknown option {name} before the program: {hint}put the program's own options after it "
                "(dtrain train train.py --lr 3e-4), see dtrain train --help"
            )
        else:
            head.append(tok)
        i += 1
    for name in ("env",):
        if name in options:
            options[name] = _env_pairs(options[name], "--env")
    if not head:
        if options.get("resume"):
            # the resumed run's own job; what follows -- is added to the end of its program's line
            return Parsed(options, None, "", tuple(tail))
        if not tail:
            raise UserError(
                "nothing to run: give a script (dtrain train train.py), a module (-m pkg.train), "
                "a job (dtrain train NAME) or a command after -- (dtrain train -- CMD ...)"
            )
        return Parsed(options, Program(kind=COMMAND, target="", args=tuple(tail)), "", ())
    first, rest = head[0], (*head[1:], *tail)
    if module:
        return Parsed(options, Program(kind=MODULE, target=first, args=rest), "", ())
    if first.endswith(".py"):
        return Parsed(options, Program(kind=SCRIPT, target=first, args=rest), "", ())
    if NAME_RE.fullmatch(first) and "/" not in first:
        return Parsed(options, None, first, rest)
    raise UserError(
        f"{first!r} is not a Python script (*.py), a module (-m), or a job name: to run a command, "
        f"put it after --: dtrain train -- {shlex.join(head)}"
    )


def _env_pairs(pairs: Sequence[str], where: str) -> dict[str, str]:
    out = {}
    for p in pairs:
        k, eq, v = p.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise UserError(f"{where} {p!r}: expected NAME=VALUE")
        out[k] = v
    return out


# ---------------------------------------------------------------------------------------------
# [jobs.NAME] tables


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobTable:
    """A [jobs.NAME] table, checked: its Job and the launch settings it names."""

    job: Job
    cluster: str = ""
    nproc: int | None = None
    image: str = ""
    max_restarts: int | None = None


def parse_job_table(name: str, table: Any, *, src: str, base: Path) -> JobTable:
    """Check one [jobs.NAME] table (src: the file, for messages; base: its folder) and build its Job."""
    where = f"{src}: [jobs.{name}]"
    if not isinstance(table, dict):
        raise UserError(f"{where} must be a table")
    if not NAME_RE.fullmatch(name):
        raise UserError(f"{where}: the name must be letters, digits, '.', '_' or '-' (at most 40)")
    for key in table:
        if key not in JOB_KEYS:
            close = difflib.get_close_matches(key, list(JOB_KEYS), n=1)
            hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(JOB_KEYS)}"
            raise UserError(f"{where}: unknown key {key} ({hint})")
    what = [k for k in ("script", "module", "command") if k in table]
    if len(what) != 1:
        got = " and ".join(what) if what else "none"
        raise UserError(f"{where} needs exactly one of script, module or command (got {got})")

    def strings(key: str) -> tuple[str, ...]:
        v = table.get(key, [])
        if isinstance(v, str) and key == "setup":
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise UserError(f"{where}: {key} must be a list of strings")
        return tuple(v)

    def integer(key: str) -> int | None:
        v = table.get(key)
        if v is None:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise UserError(f"{where}: {key} must be a whole number >= 0, got {v!r}")
        return v

    def string(key: str) -> str:
        v = table.get(key, "")
        if not isinstance(v, str):
            raise UserError(f"{where}: {key} must be a string, got {v!r}")
        return v

    args = strings("args")
    kind = what[0]
    if kind == "command":
        cmd = table["command"]
        if isinstance(cmd, str) and cmd.strip():
            if args:
                raise UserError(f"{where}: args go with script or module; put them in the command")
            program = Program(kind=SHELL, target="", args=(cmd,))
        elif isinstance(cmd, list) and cmd and all(isinstance(s, str) for s in cmd):
            program = Program(kind=COMMAND, target="", args=(*cmd, *args))
        else:
            raise UserError(f"{where}: command must be a non-empty list of strings or one string")
    else:
        target = string(kind)
        if not target:
            raise UserError(f"{where}: {kind} must not be empty")
        if kind == "script" and not target.endswith(".py"):
            raise UserError(f"{where}: script must be a .py file (for anything else use command = [...])")
        program = Program(kind=SCRIPT if kind == "script" else MODULE, target=target, args=args)
    env = table.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise UserError(f'{where}: env must be a table of strings (env = {{NAME = "value"}})')
    workdir = (base / string("workdir")).resolve() if table.get("workdir") else base.resolve()
    job = Job(
        name=name,
        program=program,
        workdir=workdir,
        setup=strings("setup"),
        env=dict(env),
        nodes=integer("nodes") or 0,
        checkpoint_dir=string("checkpoint_dir"),
        code_limit_mb=integer("code_limit") or 0,
    )
    return JobTable(
        job=job,
        cluster=string("cluster"),
        nproc=integer("nproc"),
        image=string("image"),
        max_restarts=integer("max_restarts"),
    )


def check_program(job: Job) -> None:
    """Refuse, in one line, a program that cannot start: a script that is not in the working directory."""
    if job.workdir is None:
        return
    if not job.workdir.is_dir():
        raise UserError(f"working directory {job.workdir} does not exist (--workdir, or workdir = ... in the job)")
    p = job.program
    if p.kind == SCRIPT:
        script = (job.workdir / p.target).resolve()
        if not script.is_file():
            raise UserError(f"script {p.target} not found in {job.workdir}: check the path (it is relative to workdir)")
        if job.workdir not in script.parents:
            raise UserError(f"script {p.target} is outside the working directory {job.workdir}: only that is synced")
    if job.checkpoint_dir and (Path(job.checkpoint_dir).is_absolute() or ".." in Path(job.checkpoint_dir).parts):
        raise UserError(f"checkpoint_dir {job.checkpoint_dir!r} must be a path inside the working directory")
