"""Training curves as a PNG, without a browser: loss, accuracy or perplexity, and the learning rate
against the step, for one run or several overlaid. matplotlib with its Agg backend (no display, no
GUI toolkit), imported only when a plot is drawn. No torch: the CLI and the workloads both use it.

metrics.jsonl is read tolerantly: it may be appended to while we read (a live run), so a line that
does not parse (a torn last line, a disk that filled) is skipped and reported, never fatal.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dtrain.common.errors import UserError

if TYPE_CHECKING:  # annotations only: the CLI reads this module's defaults for `dtrain --help`
    from dtrain.common.storage import Store

DEFAULT_WIDTH, DEFAULT_HEIGHT, DEFAULT_DPI = 1500, 500, 100
DEFAULT_SMOOTHING = 0.6
MAX_PIXELS = 8000  # per side: past this a typo (--width 150000) would allocate gigabytes

# (panel title, y label, [(metrics key, line label, smoothed?)], log scale?)
PANELS: tuple[tuple[str, str, tuple[tuple[str, str, bool], ...], bool], ...] = (
    ("loss", "loss", (("loss", "train", True), ("eval_loss", "eval", False)), False),
    ("accuracy", "eval accuracy", (("eval_accuracy", "eval", False),), False),
    ("perplexity", "eval perplexity", (("eval_perplexity", "eval", False),), True),
    ("learning rate", "lr", (("lr", "", False),), False),
)


@dataclasses.dataclass
class Curves:
    """One run's metrics: `rows` in file order, and one line per skipped line of the file."""

    name: str
    rows: list[dict[str, Any]]
    skipped: list[str]

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of `key`, the last value logged for a step winning (a resumed run rewrites
        the steps past its checkpoint), in step order; NaN and infinities left out."""
        by_step: dict[float, float] = {}
        for r in self.rows:
            v, s = r.get(key), r.get("step")
            if _number(v) and _number(s) and math.isfinite(v):
                by_step[s] = v
        steps = sorted(by_step)
        return steps, [by_step[s] for s in steps]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def parse_metrics(name: str, text: str) -> Curves:
    rows, skipped = [], []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            skipped.append(f"{name} metrics.jsonl line {n}: not JSON, skipped ({line[:60]!r})")
            continue
        if not isinstance(row, dict):
            skipped.append(f"{name} metrics.jsonl line {n}: not a JSON object, skipped")
            continue
        rows.append(row)
    return Curves(name, rows, skipped)


def read_metrics(run: Store, name: str = "") -> Curves:
    """The run's metrics.jsonl (none yet: no rows)."""
    name = name or run.url.rstrip("/").rsplit("/", 1)[-1]
    try:
        text = run.read_bytes("metrics.jsonl").decode("utf-8", errors="replace")
    except FileNotFoundError:
        text = ""
    return parse_metrics(name, text)


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased so the first points are not
    pulled toward zero. weight 0 leaves the values as they are."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**i) if weight > 0 else v)
    return out


def check_size(width: int, height: int, dpi: int) -> None:
    for name, value in (("--width", width), ("--height", height)):
        if not 50 <= value <= MAX_PIXELS:
            raise UserError(f"{name} {value}: pixels must be between 50 and {MAX_PIXELS}")
    if not 10 <= dpi <= 1000:
        raise UserError(f"--dpi {dpi}: must be between 10 and 1000")


def render(
    runs: Sequence[Curves],
    *,
    width: int = DEFAULT_WIDTH,
    height: int = DEFAULT_HEIGHT,
    dpi: int = DEFAULT_DPI,
    smoothing: float = DEFAULT_SMOOTHING,
) -> bytes:
    """A PNG of exactly width x height pixels with one panel per kind of curve that any run has."""
    check_size(width, height, dpi)
    if not 0.0 <= smoothing < 1.0:
        raise UserError(f"--smoothing {smoothing}: must be in [0, 1)")
    panels = [p for p in PANELS if any(r.series(k)[0] for r in runs for k, _l, _s in p[2])]
    if not panels:
        names = ", ".join(r.name for r in runs)
        raise UserError(f"nothing to plot: no loss, accuracy, perplexity or lr in the metrics of {names}")

    import matplotlib

    matplotlib.use("Agg")  # no display here, and no GUI toolkit wanted: draw to a buffer
    from matplotlib.figure import Figure

    # A Figure made directly (not pyplot) keeps no global state, so a long-lived process (the
    # dashboard) can draw from several threads without figures piling up.
    fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    colours = [f"C{i % 10}" for i in range(len(runs))]
    for ax, (title, ylabel, keys, log) in zip(axes, panels, strict=True):
        for run, colour in zip(runs, colours, strict=True):
            for key, label, smoothed in keys:
                steps, values = run.series(key)
                if not steps:
                    continue
                tag = " ".join(x for x in (run.name if len(runs) > 1 else "", label) if x)
                style = "-" if key != "eval_loss" else "--"
                if smoothed and smoothing > 0 and len(values) > 2:
                    ax.plot(steps, values, style, color=colour, alpha=0.25, linewidth=1)
                    values = smooth(values, smoothing)
                ax.plot(steps, values, style, color=colour, label=tag or None, linewidth=1.5,
                        marker="o" if len(steps) <= 20 and not smoothed else None, markersize=3)  # fmt: skip
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize="small")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)  # no bbox_inches="tight": it would change the size asked for
    return buf.getvalue()


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def write_run_curves(run: Store) -> None:
    """final/curves.png for a run that just completed (the workloads call this on rank 0)."""
    run.write_bytes("final/curves.png", render([read_metrics(run)]))
