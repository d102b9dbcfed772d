"""The terminal: console output for people (rich, stderr for errors), process-wide CLI state, and the
edge where the control layer's events become output and signals become stop requests.

    with console.operation() as (events, handle):
        result = launch(request, events=events, handle=handle)

Inside `operation()`, Ctrl-C asks the operation to stop (a second one: at once) and SIGTERM asks it
to checkpoint and stop; outside it Python's defaults apply. Nothing below cli/ touches a terminal or
a signal handler.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dtrain.control.events import Event, Events, Handle

if typing.TYPE_CHECKING:
    from rich.console import Console


class _LazyConsole:
    """A rich Console made on first use: importing rich's console costs about a third of `dtrain --help`,
    whose plain help (click's) prints without it (docs/decisions.md)."""

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._console: Any = None

    @property
    def real(self) -> Console:
        """The Console itself, for what rich takes as an argument (a progress bar's console)."""
        if self._console is None:
            from rich.console import Console

            self._console = Console(**self._kwargs)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


# soft_wrap: never hard-wrap a line (a path or URL split over lines breaks grep and copy-paste).
out: Console = _LazyConsole(soft_wrap=True)  # type: ignore[assignment]
err: Console = _LazyConsole(stderr=True, soft_wrap=True)  # type: ignore[assignment]


@dataclasses.dataclass
class _State:
    config_path: Path | None = None
    debug: bool = False
    exit_code: int = 0  # a command that finishes without raising may still set a non-zero code


state = _State()


def error(message: str) -> None:
    """One line on stderr. Markup is off so paths and brackets print as they are."""
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def escape(text: str) -> str:
    from rich.markup import escape as _escape

    return _escape(text)


@contextlib.contextmanager
def operation() -> Iterator[tuple[Events, Handle]]:
    """Events rendered on this terminal, and a Handle that SIGINT and SIGTERM drive, for one long
    operation; the previous signal handlers come back when it ends."""
    handle = Handle()
    renderer = Renderer()

    def on_signal(signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT:
            handle.interrupt()
        else:
            handle.terminate()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield Events(renderer), handle
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        renderer.close()


STYLES = ("cyan", "magenta", "green", "yellow", "blue", "red")
QUIET_TERRAFORM = ("module.plan.",)  # infra/modules/plan's rule checks: made and gone in no time


class Renderer:
    """Turns control-layer events (dtrain.control.events) into terminal output."""

    def __init__(self) -> None:
        self._nodes: dict[str, str] = {}  # node -> colour, in order of first appearance
        self._bar: Any = None  # rich Progress: rank 0's training progress, or a build's steps
        self._task: Any = None
        self._layers: dict[str, Any] = {}
        self._terraform: _TerraformStatus | None = None

    def __call__(self, ev: Event) -> None:
        handler = getattr(self, f"_on_{ev.kind}", None)
        if handler is not None:
            handler(ev)
        elif ev.message:
            self._print(escape(ev.message))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self._terraform is not None:
            self._terraform.close()
            self._terraform = None

    def _print(self, text: Any, **kw: Any) -> None:
        target = self._bar.console if self._bar is not None else out
        target.print(text, highlight=False, soft_wrap=True, **kw)

    def _on_warning(self, ev: Event) -> None:
        self._print(f"[yellow]{escape(ev.message)}[/]")

    def _on_check(self, ev: Event) -> None:
        mark = "[green]ok[/]" if ev.data.get("ok") else "[red]x[/]"
        self._print(f"  {mark} {escape(ev.message)}")

    def _on_stage(self, ev: Event) -> None:
        self._print(f"[dim]{escape(ev.message)}[/]")

    def _on_output(self, ev: Event) -> None:
        from rich.text import Text

        node = str(ev.data.get("node", ""))
        colour = self._nodes.setdefault(node, STYLES[len(self._nodes) % len(STYLES)])
        if node == "build":
            self._print(Text(ev.message, style="dim"))
        else:
            self._print(Text.assemble((f"[{node}] ", colour), ev.message))

    def _on_progress(self, ev: Event) -> None:
        if not out.is_terminal:
            return
        d = ev.data
        self._ensure_bar(str(d.get("description", "")), d.get("total"))
        self._bar.update(self._task, completed=d.get("completed", 0), total=d.get("total"), status=d.get("status", ""))

    def _on_build_step(self, ev: Event) -> None:
        d = ev.data
        if out.is_terminal:
            self._ensure_bar("build", d.get("total"))
            self._bar.update(
                self._task,
                completed=d["step"] - 1,
                total=d["total"],
                description=f"step {d['step']}/{d['total']}",
                status=d.get("status", ""),
            )
        self._print(escape(ev.message))

    def _on_push_layer(self, ev: Event) -> None:
        d = ev.data
        if not out.is_terminal:
            return
        self._ensure_bar("push", None)
        layer = d["layer"]
        if layer not in self._layers:
            self._layers[layer] = self._bar.add_task(f"layer {layer}", total=None, status="")
        self._bar.update(self._layers[layer], completed=d.get("current") or 0, total=d.get("total"), status=d["status"])

    def _ensure_bar(self, description: str, total: Any) -> None:
        if self._bar is None:
            from dtrain.common.metrics import progress_bar

            self._bar = progress_bar(out.real)  # type: ignore[attr-defined]
            self._bar.start()
            self._task = self._bar.add_task(description, total=total, status="")

    def _on_launch(self, ev: Event) -> None:
        self._print(f"[bold]{escape(ev.message)}[/]")

    def _on_plan(self, ev: Event) -> None:
        from rich.table import Table

        plan = ev.data["plan"]
        table = Table(title=ev.message, title_justify="left")
        for col in ("node", "machine type", "GPUs", "spot", "disk", "$/hour"):
            table.add_column(col, justify="right" if col in ("GPUs", "disk", "$/hour") else "left")
        for r in plan.rows:
            table.add_row(
                r.node,
                r.machine_type,
                f"{r.gpus} x {r.accelerator}" if r.gpus else "-",
                "yes" if r.spot else "no",
                f"{r.disk_gb} GB",
                f"{r.usd_per_hour:.3f}" if r.usd_per_hour is not None else "?",
            )
        out.print(table)
        figure = f"${plan.usd_per_hour:.2f}/hour" + ("" if plan.complete else " (some prices unknown: not counted)")
        out.print(f"estimated cost: {figure} for {len(plan.rows)} nodes; plus the bucket's storage")
        out.print(f"[dim]{escape(plan.note)}[/]")

    def _on_terraform_start(self, ev: Event) -> None:
        self._terraform = _TerraformStatus(str(ev.data["verb"]))

    def _on_terraform(self, ev: Event) -> None:
        if self._terraform is not None:
            self._terraform(ev.data["event"])

    def _on_terraform_end(self, ev: Event) -> None:
        if self._terraform is not None:
            self._terraform.close()
            self._terraform = None


class _TerraformStatus:
    """What Terraform is doing: one line per resource as it finishes, and a spinner naming the ones
    still in flight (creating a GPU VM takes a minute or two)."""

    def __init__(self, verb: str) -> None:
        self.verb = verb
        self.inflight: dict[str, float] = {}
        self.done = 0
        self._status = out.status(f"terraform {verb} ...")
        self._status.__enter__()

    def close(self) -> None:
        self._status.__exit__(None, None, None)

    def __call__(self, event: dict) -> None:
        from dtrain.control.gcp.terraform import redact

        kind = event.get("type")
        hook = event.get("hook") or {}
        addr = (hook.get("resource") or {}).get("addr", "")
        if addr.startswith(QUIET_TERRAFORM):
            return
        if kind == "apply_start":
            self.inflight[addr] = time.monotonic()
        elif kind in ("apply_complete", "apply_errored"):
            start = self.inflight.pop(addr, time.monotonic())
            self.done += kind == "apply_complete"
            mark = "[green]done[/]" if kind == "apply_complete" else "[red]failed[/]"
            action = hook.get("action", "")
            out.print(f"  {mark} {action} {addr} ({time.monotonic() - start:.0f}s)", highlight=False)
        elif kind == "dtrain_interrupt":
            out.print("[yellow]interrupted: waiting for Terraform to stop safely (Ctrl-C again to abandon)[/]")
        elif kind == "diagnostic" and (event.get("diagnostic") or {}).get("severity") == "warning":
            d = event["diagnostic"]
            out.print(f"  [yellow]warning:[/] {escape(redact(d.get('summary', '')))}", highlight=False)
        busy = ", ".join(sorted(self.inflight)[:3]) + (" ..." if len(self.inflight) > 3 else "")
        self._status.update(f"terraform {self.verb}: {self.done} done" + (f"; {busy}" if busy else ""))
