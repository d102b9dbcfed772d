"""A user project's Python dependencies on a node: one virtual environment per distinct set of
requirements, setup commands and base interpreter, built once and reused by every later job.

What is installed is the project's requirements.txt, else its pyproject.toml's
`[project].dependencies` (the dependencies only, not the project itself), then its setup commands.
The environment is a venv with --system-site-packages on top of the node's interpreter, so the
node's torch (and CUDA build) is used rather than downloaded again; when that interpreter is itself a
venv, a .pth file adds its site-packages too, which --system-site-packages alone would not.

Layout under `envs_root`: `<key>/` (the venv; complete once `<key>/.dtrain-ready` exists, written
last), `<key>.log` (every step's output, appended) and `<key>.lock` (flock'd while building, so two
jobs on one node build it once). An environment without its marker is a build that was interrupted:
it is removed and built again.

Standard library only: the node agent runs this on nodes before anything else is installed.
Command line: `python -m dtrain.common.deps ensure --code-dir D --envs E [--setup CMD]... [--node N]
[--image IMAGE [--docker CMD]]` prints the EnvResult as one JSON line (exit 0), or the one-line error on
stderr (exit 2). With --image, the environment is built by that image's Python in a container
(ensure_in_image), for a job that runs in the image. A launch adds `--sync-dest DIR --sync-snapshot S` (first
receive the working directory: dtrain.common.codesync's node half over stdin/stdout) and `--info-addr A
--info-workdir W` (when nothing is installed, a second JSON line: `nodeagent info --cached`'s), so that one
process in one SSH session does all three.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from dtrain.common.errors import ExitCode, UserError
from dtrain.common.fileops import locked

REQUIREMENTS_TXT = "requirements.txt"
PYPROJECT = "pyproject.toml"
READY = ".dtrain-ready"
BASE_VENV_PTH = "_dtrain_base_venv.pth"
# Part of the key: an env built by an earlier layout is rebuilt, not reused (layout 1 wrote plain path
# lines into BASE_VENV_PTH, which hid the base venv's editable installs).
ENV_LAYOUT = 2
# How much of a failed step's last output line goes into the error message.
MAX_DETAIL_CHARS = 200

# pip's ways of naming the requirement it could not install, most specific first.
# Each gives (pattern, what went wrong); group 1 is the requirement.
_PIP_FAILURES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Invalid requirement: '([^']+)'"), "is not a valid requirement"),
    (re.compile(r"No matching distribution found for (\S+)"), "was not found in the package index"),
    (
        re.compile(r"Could not find a version that satisfies the requirement (\S+)"),
        "was not found in the package index",
    ),
    (re.compile(r"Failed building wheel for (\S+)"), "failed to build"),
    (re.compile(r"Failed to build installable wheels for .*?\(([^)]+)\)"), "failed to build"),
    (re.compile(r"Failed to build (\S+)"), "failed to build"),
)


class DepsError(UserError):
    """Installing a project's dependencies failed. The message is one line: the node, the package or
    step that failed, and the log file with pip's (or the setup command's) full output."""


@dataclass
class Requirements:
    """What a project asks to have installed. Falsy when it asks for nothing.

    `lines`: requirement strings, as pip reads them; for a requirements.txt, its lines without
    comments and blanks, with the content of the files it includes (`-r`/`-c`) in place of the include,
    so the environment's key changes when an included file does. `source`: the file they came from
    ("requirements.txt", "pyproject.toml", or "" for none)."""

    lines: list[str] = field(default_factory=list)
    source: str = ""

    def __bool__(self) -> bool:
        return bool(self.lines)

    def pip_args(self) -> list[str]:
        """pip install's arguments, run in the project's directory (so `-r`, `-e .` and relative paths
        in a requirements.txt mean what they mean to the user)."""
        if self.source == REQUIREMENTS_TXT:
            return ["-r", REQUIREMENTS_TXT]
        return list(self.lines)


@dataclass
class EnvResult:
    """The interpreter to run the job with. `key` is "" (and `python` the base interpreter) when the
    project needs nothing installed; `created` is False when an existing environment was reused."""

    python: str
    key: str
    created: bool
    log_file: str | None
    seconds: float = 0.0


# --- what to install ---------------------------------------------------------------------------


def requirements_of(code_dir: Path) -> Requirements:
    """requirements.txt if the project has one, else pyproject.toml's [project].dependencies, else none."""
    code_dir = Path(code_dir)
    req = code_dir / REQUIREMENTS_TXT
    if req.is_file():
        return Requirements(lines=_requirement_lines(req, seen=set()), source=REQUIREMENTS_TXT)
    pyproject = code_dir / PYPROJECT
    if pyproject.is_file():
        deps = _pyproject_dependencies(pyproject)
        return Requirements(lines=deps, source=PYPROJECT if deps else "")
    return Requirements()


_INCLUDE = re.compile(r"^(?:-r|--requirement|-c|--constraint)(?:\s*=?\s*|\s+)(\S+)$")


def _requirement_lines(path: Path, seen: set[Path]) -> list[str]:
    real = path.resolve()
    if real in seen:  # pip would loop too; the key needs each file once
        return []
    seen.add(real)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise DepsError(f"cannot read {path}: {e.strerror}; fix the path in the requirements file") from None
    lines: list[str] = []
    for raw in text.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()  # pip's comment rule: '#' at the start or after a space
        if not line:
            continue
        include = _INCLUDE.match(line)
        if include and not re.match(r"^[a-z][a-z0-9+.-]*://", include.group(1)):
            lines.append(line)  # the include itself, then what it includes
            lines.extend(_requirement_lines(path.parent / include.group(1), seen))
        else:
            lines.append(line)
    return lines


def _pyproject_dependencies(path: Path) -> list[str]:
    data = path.read_bytes()
    try:
        import tomllib  # Python 3.11+
    except ImportError:
        return _toml_dependencies_fallback(data.decode("utf-8"))
    try:
        project = tomllib.loads(data.decode("utf-8")).get("project", {})
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise DepsError(f"{path} is not valid TOML ({e}); fix it and run again") from None
    deps = project.get("dependencies", []) if isinstance(project, dict) else []
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        raise DepsError(f"{path}: [project].dependencies must be a list of strings")
    return deps


def _toml_dependencies_fallback(text: str) -> list[str]:
    """[project].dependencies without tomllib (Python 3.10): finds the `[project]` table and reads the
    `dependencies = [...]` array of string literals in it, the only form PEP 621 allows there. Escapes
    inside basic strings are not interpreted (requirement strings have none)."""
    table = re.search(r"^\[project\][ \t]*(?:#[^\n]*)?$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    start = table and re.search(r"^dependencies\s*=\s*\[", table.group(1), re.M)
    if not table or not start:
        return []
    body = table.group(1)[start.end() :]
    deps: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c == "]":
            return deps
        if c == "#":
            i = body.find("\n", i)
            i = len(body) if i < 0 else i
            continue
        if c in "'\"":
            quote = c * 3 if body.startswith(c * 3, i) else c
            end = body.find(quote, i + len(quote))
            if end < 0:
                break
            deps.append(body[i + len(quote) : end])
            i = end + len(quote)
            continue
        i += 1
    raise DepsError("pyproject.toml: [project].dependencies is not a closed array of strings")


# --- the environment's key ---------------------------------------------------------------------


@functools.cache
def _interpreter(python: str) -> dict[str, Any]:
    """What the key and the venv need to know about an interpreter, asked once per process."""
    probe = (
        "import importlib.util, json, site, sys; print(json.dumps({'version': sys.version, 'prefix': sys.prefix,"
        " 'base_prefix': sys.base_prefix, 'site': site.getsitepackages(),"
        " 'lib': 'python%d.%d' % sys.version_info[:2],"
        " 'ensurepip': importlib.util.find_spec('ensurepip') is not None,"
        " 'pip': importlib.util.find_spec('pip') is not None}))"
    )
    try:
        out = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True, check=True, timeout=60)
        return json.loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        raise DepsError(f"the base interpreter {python} does not run ({e}); check the node's Python") from None


def env_key(reqs: Requirements, setup: Sequence[str], base_python: str) -> str:
    """16 hex digits of sha256 over what determines the environment: the requirements' content and
    source, the setup commands, and the base interpreter (real path, prefix and version: a venv's
    python is a link to the system one, and an upgraded Python must not reuse an old env)."""
    info = _interpreter(base_python)
    payload = {
        "requirements": [reqs.source, *reqs.lines],
        "setup": list(setup),
        "python": os.path.realpath(shutil.which(base_python) or base_python),
        "prefix": info["prefix"],
        "version": info["version"],
        "layout": ENV_LAYOUT,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


# --- building it -------------------------------------------------------------------------------


def ensure_env(
    code_dir: Path,
    envs_root: Path,
    *,
    setup: Sequence[str] = (),
    base_python: str = sys.executable,
    node: str = "",
    log: Callable[[str], None] = print,
) -> EnvResult:
    """The interpreter to run the project in `code_dir` with: `base_python` if it needs nothing
    installed, else the environment for its key under `envs_root`, built now if no complete one exists.

    Raises DepsError (one line: node, failing package or step, log file); the half-built environment
    is removed."""
    code_dir, envs_root = Path(code_dir).resolve(), Path(envs_root).resolve()  # steps run in code_dir
    reqs = requirements_of(code_dir)
    setup = list(setup)
    if not reqs and not setup:
        return EnvResult(python=base_python, key="", created=False, log_file=None)
    t0 = time.monotonic()
    key = env_key(reqs, setup, base_python)
    envs_root.mkdir(parents=True, exist_ok=True)
    env_dir = envs_root / key
    log_file = envs_root / f"{key}.log"
    result = EnvResult(python=str(env_dir / "bin" / "python"), key=key, created=False, log_file=str(log_file))
    with locked(envs_root / f"{key}.lock"):
        if (env_dir / READY).exists():
            log(f"using environment {key} ({reqs.source or 'setup commands'})")
        else:
            if env_dir.exists():
                log(f"removing incomplete environment {key}")
                shutil.rmtree(env_dir)
            log(f"creating environment {key} ({reqs.source or 'setup commands'}); output in {log_file}")
            try:
                _build(env_dir, code_dir, reqs, setup, base_python, log_file, node)
                marker = {"source": reqs.source, "setup": setup, "python": base_python}
                (env_dir / READY).write_text(json.dumps(marker))  # last: the env is complete
            except BaseException:
                shutil.rmtree(env_dir, ignore_errors=True)
                raise
            result.created = True
    result.seconds = round(time.monotonic() - t0, 3)
    return result


def _build(
    env_dir: Path,
    code_dir: Path,
    reqs: Requirements,
    setup: list[str],
    base_python: str,
    log_file: Path,
    node: str,
) -> None:
    with open(log_file, "ab") as out:
        step = _Steps(out, log_file, node)
        info = _interpreter(base_python)
        # An image's Python may lack ensurepip (Debian's and Ubuntu's python3 without python3-venv): the env is
        # then made without pip of its own, and installs with the base's pip, which it sees as a system package.
        own_pip = [] if info.get("ensurepip", True) else ["--without-pip"]
        if reqs and own_pip and not info.get("pip", True):
            raise DepsError(
                f"{'node ' + node + ': ' if node else ''}{base_python} has neither pip nor ensurepip, so "
                f"{reqs.source} cannot be installed: add pip to the node or image (python3-pip or python3-venv)"
            )
        venv = [base_python, "-m", "venv", "--system-site-packages", *own_pip, str(env_dir)]
        step.run("python -m venv", venv, cwd=code_dir)
        _see_base_venv(env_dir, info)
        python = str(env_dir / "bin" / "python")
        if reqs:
            pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", *reqs.pip_args()]
            step.run(f"pip install ({reqs.source})", pip, cwd=code_dir, source=reqs.source)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHOME"}
        env["VIRTUAL_ENV"] = str(env_dir)
        env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env.get('PATH', os.defpath)}"
        for i, cmd in enumerate(setup, 1):
            step.run(f"setup command {i} {json.dumps(cmd)}", ["bash", "-c", cmd], cwd=code_dir, env=env)


def _see_base_venv(env_dir: Path, info: dict[str, Any]) -> None:
    """--system-site-packages shows the base *installation's* packages; when the base interpreter is a
    venv (a node image's /opt/venv, say), its own site-packages, where torch is, needs this .pth too.

    Each line calls site.addsitedir rather than naming the folder: a plain path line only puts the folder
    on sys.path, and the .pth files inside it never run. An editable install (scripts/setup.sh's `pip
    install -e`) is such a .pth file, an import hook, so with a plain line the env could not import
    dtrain itself, nor any other package the base venv holds in editable form."""
    if info["prefix"] == info["base_prefix"]:
        return
    ours = env_dir / "lib" / info["lib"] / "site-packages"
    base = [p for p in info["site"] if p.startswith(info["prefix"])]
    if ours.is_dir() and base:
        lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in base)
        (ours / BASE_VENV_PTH).write_text(lines)


class _Steps:
    """Runs one build step after another into the log, each under a header line; a failing step
    becomes a DepsError."""

    def __init__(self, out: IO[bytes], log_file: Path, node: str) -> None:
        self.out = out
        self.log_file = log_file
        self.node = node

    def run(
        self, name: str, argv: list[str], *, cwd: Path, env: dict[str, str] | None = None, source: str = ""
    ) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.out.write(f"==== {stamp} {name}: {' '.join(argv)}\n".encode())
        self.out.flush()
        start = self.out.tell()
        try:
            rc = subprocess.run(
                argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=self.out, stderr=subprocess.STDOUT
            ).returncode
        except OSError as e:
            raise DepsError(self._message(f"{name} could not start ({e.strerror})")) from None
        self.out.flush()
        if rc == 0:
            return
        output = self._output_since(start)
        failed = _pip_failure(output) if source else None
        if failed:
            raise DepsError(self._message(f'"{failed[0]}" from {source} {failed[1]}; fix {source} and run again'))
        status = f"exited {rc}" if rc > 0 else f"was killed by signal {-rc}"
        last = next((ln.strip() for ln in reversed(output.splitlines()) if ln.strip()), "")
        detail = f": {last[:MAX_DETAIL_CHARS]}" if last else ""
        raise DepsError(self._message(f"{name} {status}{detail}"))

    def _output_since(self, offset: int) -> str:
        with open(self.log_file, "rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", "replace")

    def _message(self, what: str) -> str:
        where = f"on node {self.node}" if self.node else "on this node"
        return f"setting up the project's Python environment {where} failed: {what} (log: {self.log_file})"


def _pip_failure(output: str) -> tuple[str, str] | None:
    """(requirement, what went wrong) from pip's output, when it names the requirement that failed."""
    for pattern, what in _PIP_FAILURES:
        m = pattern.search(output)
        if m:
            return m.group(1).strip().rstrip(".,:"), what
    return None


# --- in a container image -----------------------------------------------------------------------


def ensure_in_image(
    code_dir: Path,
    envs_root: Path,
    *,
    image: str,
    docker: Sequence[str] = ("docker",),
    setup: Sequence[str] = (),
    node: str = "",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """ensure_env with the *image's* Python, for a job that runs in `image` (container mode): a throwaway
    container as this process's user runs this module's `ensure`, so the environment sees the image's torch.
    Environments go under `<envs_root>/image-<image id>/` (one image's never serves another), and the
    environments folder and the folder above `code_dir` (the run's, where the job's container works) are
    mounted at their own paths, so the interpreter returned is valid in the job's container too. dtrain's own
    code (this module's) goes first on the container's PYTHONPATH: an older image may lack this module.
    Returns the EnvResult as a dict; raises DepsError (one line) as ensure_env does."""
    code_dir, envs_root = Path(code_dir).resolve(), Path(envs_root).resolve()
    if not requirements_of(code_dir) and not setup:  # nothing to install: the image's own Python, no container
        return dataclasses.asdict(EnvResult(python="python3", key="", created=False, log_file=None))
    where = f"node {node}: " if node else ""
    inspect = [*docker, "image", "inspect", "--format", "{{.Id}}", image]
    found = subprocess.run(inspect, capture_output=True, text=True, check=False)
    if found.returncode != 0:  # not pulled yet (a Slurm node's first job in it): pull it, as docker run would
        pulled = subprocess.run([*docker, "pull", "--quiet", image], capture_output=True, text=True, check=False)
        found = subprocess.run(inspect, capture_output=True, text=True, check=False)
        if found.returncode != 0:
            why = " ".join((pulled.stderr or found.stderr).split())[-300:]
            raise DepsError(f"{where}cannot pull {image} to install the requirements with ({why})")
    envs = envs_root / f"image-{found.stdout.strip().removeprefix('sha256:')[:12]}"
    envs.mkdir(parents=True, exist_ok=True)
    ours = str(Path(__file__).resolve().parents[2])  # the folder holding dtrain/
    run_dir = code_dir.parent
    argv = [*docker, "run", "--rm", "--network", "host", "--entrypoint", "python3",
            "--user", f"{os.getuid()}:{os.getgid()}", "-e", "HOME=/tmp", "-e", f"PYTHONPATH={ours}",
            "-v", f"{run_dir}:{run_dir}:rw", "-v", f"{envs}:{envs}:rw"]  # fmt: skip
    if not ours.startswith(str(run_dir) + os.sep):
        argv += ["-v", f"{ours}:{ours}:ro"]
    argv += ["-w", str(code_dir), image, "-m", "dtrain.common.deps", "ensure", "--code-dir", str(code_dir),
             "--envs", str(envs), "--python", "python3"]  # fmt: skip
    for cmd in setup:
        argv += ["--setup", cmd]
    if node:
        argv += ["--node", node]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if p.returncode != 0:
        # ensure's own one-line error is its last line; anything else is docker's (the image would not run).
        raise DepsError(lines[-1] if lines else f"{where}installing the requirements in {image} failed "
                        f"(exit {p.returncode})")  # fmt: skip
    for line in lines:
        log(line)
    return json.loads(out.strip().splitlines()[-1])


# --- command line ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtrain.common.deps", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    ensure = commands.add_parser("ensure", help="build (or reuse) the environment for a project")
    ensure.add_argument("--code-dir", type=Path, required=True, help="the project's directory on this node")
    ensure.add_argument("--envs", type=Path, required=True, help="where environments are kept")
    ensure.add_argument("--setup", action="append", default=[], metavar="CMD", help="a setup command (repeatable)")
    ensure.add_argument("--node", default="", help="this node's name, for error messages")
    ensure.add_argument("--python", default=sys.executable, help="the base interpreter (default: this one)")
    ensure.add_argument("--image", default="", help="build it with this image's Python, in a container")
    ensure.add_argument("--docker", default="docker", help="the docker command (with --image)")
    ensure.add_argument("--sync-dest", type=Path, help="first receive the code (codesync's node half) into this")
    ensure.add_argument("--sync-snapshot", type=Path, help="with --sync-dest: its hard-link copy for this run")
    ensure.add_argument("--info-addr", help="nothing to install: then also print `nodeagent info --cached`'s line")
    ensure.add_argument("--info-workdir", default=".", help="with --info-addr: the workdir whose disk it reports")
    args = parser.parse_args(argv)
    say = functools.partial(print, file=sys.stderr, flush=True)
    if args.sync_dest is not None:  # a launch's code sync and environment check in one process (one SSH session)
        from dtrain.common.codesync import receive

        try:
            receive(args.sync_dest, sys.stdin.buffer, sys.stdout.buffer, snapshot=args.sync_snapshot)
        except UserError as e:
            print(f"dtrain code sync: {e}", file=sys.stderr)
            return 1
    try:
        if args.image:
            found = ensure_in_image(args.code_dir, args.envs, image=args.image, docker=shlex.split(args.docker),
                                    setup=args.setup, node=args.node, log=say)  # fmt: skip
            print(json.dumps(found), flush=True)
            return int(ExitCode.OK)
        result = ensure_env(
            args.code_dir,
            args.envs,
            setup=args.setup,
            base_python=args.python,
            node=args.node,
            log=lambda m: print(m, file=sys.stderr, flush=True),
        )
    except UserError as e:
        print(e, file=sys.stderr)
        return int(e.exit_code)
    print(json.dumps(dataclasses.asdict(result)), flush=True)
    if args.info_addr is not None and not result.key:  # the job runs on this interpreter: what it has, too
        from dtrain.common.nodeagent import info_cached

        print(json.dumps(info_cached(str(args.info_workdir), args.info_addr)), flush=True)
    return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
