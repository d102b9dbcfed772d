"""The workload registry: dtrain's built-in examples (`WORKLOADS`, one `Builtin` entry each: a program with a
typed config) and those that installed packages add through the "dtrain.workloads" entry-point group.
The settings (dtrain.control.settings) read each one's config dataclass for its flags, [NAME] section and
DTRAIN_NAME_* variables; the images hold its package (dtrain.control.assets, from `builtin_packages`).

Cheap to import: the config modules hold dataclasses, not torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging

from dtrain.common.errors import UserError


@dataclasses.dataclass(frozen=True)
class Builtin:
    """A built-in example: a program (`module`, run under torchrun like any user's -m module) with a typed
    config (`config`: "module:Class", a kw_only dataclass with one nested RunConfig) from which its
    `dtrain train NAME` flags, [NAME] section and DTRAIN_NAME_* variables follow.

    `dtrain eval` of its runs: `evaluate` names the module that evaluates them (`python -m dtrain.evaluate
    eval --evaluator MODULE` calls its `evaluate_args(run, saved, step, *, device, args, log)`; "" for none);
    `eval_options`, which of eval's workload options it takes ("data", "prompts", "max_new_tokens"; the
    others are refused in one line); `eval_view`, "module:function" that turns an evaluation's record into
    the terminal's headline and details (a CLI-side module: no torch), or "" for a table of its figures.

    `dtrain export --onnx` of its runs: `export` names the module whose `export(run, saved, step, *, data_dir,
    split, log)` writes the ONNX model and its check under the run (`python -m dtrain.evaluate export
    --exporter MODULE` calls it); "" for none, and then `export_note` says where its model already is."""

    config: str
    module: str
    evaluate: str = ""
    eval_options: tuple[str, ...] = ()
    eval_view: str = ""
    export: str = ""
    export_note: str = ""


# The built-in examples. A new one is one entry here (and its package); a user's own package can add one
# through the "dtrain.workloads" entry-point group, whose entries load a Builtin (see _add_entry_points()).
WORKLOADS: dict[str, Builtin] = {
    "mnist": Builtin(
        "dtrain.mnist.config:MnistConfig",
        "dtrain.mnist.train",
        evaluate="dtrain.evaluate.mnist",
        eval_view="dtrain.cli.eval_views:mnist",
        export="dtrain.evaluate.export",
    ),
    "lora": Builtin(
        "dtrain.lora.config:LoraConfig",
        "dtrain.lora.train",
        evaluate="dtrain.evaluate.lora",
        eval_options=("data", "prompts", "max_new_tokens"),
        eval_view="dtrain.cli.eval_views:lora",
        export_note="its adapter is already saved in PEFT format under final/adapter",
    ),
}
ENTRY_POINTS = "dtrain.workloads"


def builtin_packages() -> list[str]:
    """The packages of dtrain's own built-ins (["mnist", "lora"]: dtrain.mnist, ...), each once, in the
    registry's order; a plug-in whose module is outside dtrain brings its own. What the training images
    hold besides dtrain.common (dtrain.control.assets) follows from this."""
    own = [b.module.split(".")[1] for b in WORKLOADS.values() if b.module.startswith("dtrain.")]
    return list(dict.fromkeys(own))


def _add_entry_points() -> None:
    """Built-ins that installed packages declare (entry-point group dtrain.workloads, name -> a Builtin)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINTS):
        if ep.name in WORKLOADS:
            continue  # dtrain's own come first
        try:
            b = ep.load()
        except Exception as e:  # noqa: BLE001 - a broken plug-in must not break dtrain
            # logging, not print: control/ leaves the terminal to its caller (Python's last-resort
            # handler shows it on stderr where the caller has set up no logging)
            logging.getLogger(__name__).warning("dtrain: warning: entry point %s (%s) does not load: %s", ep.name,
                                                ep.value, e)  # fmt: skip
            continue
        if isinstance(b, Builtin):
            WORKLOADS[ep.name] = b


_add_entry_points()


def builtin(name: str) -> Builtin:
    if name not in WORKLOADS:
        raise UserError(f"unknown workload {name!r} (known: {', '.join(sorted(WORKLOADS))})")
    return WORKLOADS[name]


def workload_class(name: str) -> type:
    """The config dataclass of a registered workload."""
    module, _, attr = builtin(name).config.partition(":")
    return getattr(importlib.import_module(module), attr)
