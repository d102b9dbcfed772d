"""Typed configuration shared by every workload, and the dataclass <-> command line bridge.

No torch here: the CLI reads these dataclasses to know which keys exist and what type each has.
Workloads are run by torchrun as modules and take every setting as a flag, so the same command
line works on a laptop, in compose and on a VM.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import re
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from dtrain.common.choices import Backend, Precision, Tracker
from dtrain.common.errors import UserError

DEFAULT_OUTPUT = "runs"  # where runs go when neither --output nor the settings say: ./runs/<run-id>/

T = TypeVar("T")


def opt(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - mirrors argparse
    """A dataclass field with help text; the help shows in `--help` and `dtrain config show`."""
    meta = {"help": help, **kw}
    if isinstance(default, list):  # mutable: each instance gets its own copy
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# RunConfig keys that say where a run lives rather than how it trains: a resumed run never inherits
# them from its saved config.
PLACEMENT_KEYS = frozenset({"output", "run_id", "resume", "run_dir"})


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    """Options every workload shares: where the run goes, precision, checkpoints, seed."""

    output: str = opt(DEFAULT_OUTPUT, "parent directory or gs://bucket/prefix of the runs: <output>/<run-id>/")
    run_id: str = opt("", "run id (default: generated, <workload>-<utc time>-<hex>)")
    resume: str = opt("", "run id or run directory/URL to continue from its newest complete checkpoint")
    # Set by dtrain's launchers, which work out where the run lives once and hand it down; a plain
    # torchrun leaves it empty and the workload derives it from output and run_id itself.
    run_dir: str = opt("", "the run's directory or URL, as the launcher resolved it", internal=True)
    precision: Precision = opt(Precision.AUTO, "auto picks bf16 on GPUs that have it, fp16 on older GPUs, fp32 on CPU")
    backend: Backend = opt(Backend.AUTO, "process-group backend; auto is nccl with CUDA, gloo without")
    seed: int = opt(0, "seed for weights, data order and augmentation")
    checkpoint_every: int = opt(0, "also checkpoint every N optimizer steps (0: only at epoch ends and at the end)")
    keep_checkpoints: int = opt(3, "how many complete checkpoints to keep")
    log_every: int = opt(20, "write a metrics line every N steps")
    dist_timeout: float = opt(300.0, "seconds a collective may wait for a peer before failing")
    tracker: list[Tracker] = opt(
        [], "experiment trackers rank 0 also logs to: mlflow, wandb (set up by their own MLFLOW_*/WANDB_* variables)"
    )

    def __post_init__(self) -> None:
        self.precision = Precision(self.precision)
        self.backend = Backend(self.backend)
        self.tracker = [Tracker(t) for t in self.tracker]
        if not self.output:
            raise ValueError("output: must not be empty")
        for name in ("checkpoint_every", "log_every", "keep_checkpoints"):
            if getattr(self, name) < (1 if name in ("log_every", "keep_checkpoints") else 0):
                raise ValueError(f"{name}: must be {'>= 1' if name != 'checkpoint_every' else '>= 0'}")
        if self.run_id and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,79}", self.run_id):
            raise ValueError(f"run_id: {self.run_id!r} must be letters, digits, '.', '_' or '-' (a folder name)")
        if self.dist_timeout <= 0:
            raise ValueError("dist_timeout: must be > 0 seconds")


# ---------------------------------------------------------------------------------------------
# dataclass <-> flags


def field_type(cls: type, f: dataclasses.Field) -> Any:
    """The resolved annotation of a dataclass field (annotations are strings under __future__)."""
    return _hints(cls)[f.name]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    # Resolving a class's string annotations evaluates them all: once per class, not once per field.
    return typing.get_type_hints(cls)


def scalar_fields(cls: type) -> list[tuple[str, dataclasses.Field, Any]]:
    """(flat key, field, type) for every leaf field; nested dataclass fields are flattened."""
    out: list[tuple[str, dataclasses.Field, Any]] = []
    for f in dataclasses.fields(cls):
        tp = field_type(cls, f)
        if dataclasses.is_dataclass(tp):
            out.extend(scalar_fields(tp))
        else:
            out.append((f.name, f, tp))
    return out


def type_name(tp: Any) -> str:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(m.value for m in tp)
    if typing.get_origin(tp) in (list, Sequence):
        return f"list of {type_name(typing.get_args(tp)[0])}"
    return {int: "integer", float: "number", str: "string", bool: "boolean"}.get(tp, str(tp))


def coerce(value: Any, tp: Any, *, from_text: bool = False) -> Any:
    """Check `value` against `tp`; with from_text, parse it from a string (env vars, flags).

    Raises TypeError naming the expected type; callers add which key and where it came from.
    """
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value.value if isinstance(value, enum.Enum) else value)
        except ValueError:
            raise TypeError(f"expected one of {type_name(tp)}, got {value!r}") from None
    if typing.get_origin(tp) in (list, Sequence):
        (item,) = typing.get_args(tp)
        if from_text and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"expected {type_name(tp)}, got {type(value).__name__} {value!r}")
        return [coerce(v, item, from_text=from_text) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if (
            from_text
            and isinstance(value, str)
            and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off")
        ):
            return value.lower() in ("1", "true", "yes", "on")
        raise TypeError(f"expected a boolean, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_text and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise TypeError(f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_text and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise TypeError(f"expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise TypeError(f"expected a string, got {type(value).__name__} {value!r}")
    raise TypeError(f"unsupported config type {tp!r}")


def build(cls: type[T], values: Mapping[str, Any]) -> T:
    """Build a (possibly nested) config dataclass from flat key -> value pairs.

    Unknown keys and values of the wrong type raise UserError naming the key; a failed
    `__post_init__` validation (ValueError naming the field) becomes a UserError too.
    """
    known = {k for k, _, _ in scalar_fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UserError(f"unknown option {unknown[0]!r} for {cls.__name__} (known: {', '.join(sorted(known))})")

    missing = [k for k, f, _ in scalar_fields(cls) if k not in values and _required(f)]
    if missing:
        raise UserError(f"missing required option {flag(missing[0])}")

    def make(c: type) -> Any:
        kwargs = {}
        for f in dataclasses.fields(c):
            tp = field_type(c, f)
            if dataclasses.is_dataclass(tp):
                kwargs[f.name] = make(tp)
            elif f.name in values:
                try:
                    kwargs[f.name] = coerce(values[f.name], tp)
                except TypeError as e:
                    raise UserError(f"{f.name}: {e}") from None
        return c(**kwargs)

    try:
        return make(cls)
    except ValueError as e:
        raise UserError(f"invalid configuration: {e}") from None


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING  # type: ignore[misc]


def flatten(cfg: Any) -> dict[str, Any]:
    """Flat key -> JSON-able value for a config dataclass (enums as their values)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out.update(flatten(v))
        else:
            out[f.name] = _plain(v)
    return out


def _plain(v: Any) -> Any:
    """A value as JSON and the command line spell it: an enum as its value, in a list too."""
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v.value if isinstance(v, enum.Enum) else v


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def to_argv(values: Mapping[str, Any]) -> list[str]:
    """Flat key -> value pairs as workload flags (the inverse of `parse_explicit`)."""
    argv: list[str] = []
    for key, v in values.items():
        if isinstance(v, bool):
            argv.append(flag(key) if v else "--no-" + key.replace("_", "-"))
        elif isinstance(v, (list, tuple)):
            argv += [flag(key), ",".join(str(_plain(x)) for x in v)]
        else:
            argv += [flag(key), str(v.value if isinstance(v, enum.Enum) else v)]
    return argv


def make_parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    """An argparse parser with one flag per config field. Defaults are suppressed so that
    `parse_explicit` returns only what the command line set: a resumed run's saved config can
    then sit beneath it."""
    p = argparse.ArgumentParser(prog=prog, description=description, argument_default=argparse.SUPPRESS)
    for key, f, tp in scalar_fields(cls):
        if _required(f):
            help_text = f"{f.metadata.get('help', '')} (required)"
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            shown = default.value if isinstance(default, enum.Enum) else default
            help_text = f"{f.metadata.get('help', '')} (default: {shown!r})"
        help_text = help_text.replace("%", "%%")  # argparse %-formats help ("3% of the run" would crash --help)
        if tp is bool:
            p.add_argument(flag(key), dest=key, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            p.add_argument(
                flag(key),
                dest=key,
                metavar=type_name(tp).upper().replace(" ", "_")[:24],
                type=_text_parser(key, tp),
                help=help_text,
            )
    return p


def _text_parser(key: str, tp: Any):
    def parse(text: str) -> Any:
        try:
            return coerce(text, tp, from_text=True)
        except TypeError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = type_name(tp)
    return parse


def parse_explicit(cls: type, argv: Sequence[str] | None, prog: str, description: str) -> dict[str, Any]:
    """Flags given on the command line, as flat key -> typed value."""
    return vars(make_parser(cls, prog, description).parse_args(argv))
