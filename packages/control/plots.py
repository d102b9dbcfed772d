"""`dtrain plot`: the curves of one or more runs in one PNG (dtrain.evaluate.curves draws it; no
torch). A line of metrics.jsonl that does not parse is skipped and reported as a warning."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from dtrain.common.errors import UserError
from dtrain.common.rundir import locate
from dtrain.common.storage import is_remote, open_store
from dtrain.control.events import Events
from dtrain.evaluate import curves

DEFAULTS = {
    "width": curves.DEFAULT_WIDTH,
    "height": curves.DEFAULT_HEIGHT,
    "dpi": curves.DEFAULT_DPI,
    "smoothing": curves.DEFAULT_SMOOTHING,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlotRequest:
    runs: Sequence[str]  # run ids under the output location, or run directories / gs:// URLs
    path: str = "curves.png"  # where the PNG goes: a local path or gs://bucket/.../name.png
    width: int = curves.DEFAULT_WIDTH  # pixels
    height: int = curves.DEFAULT_HEIGHT
    dpi: int = curves.DEFAULT_DPI
    smoothing: float = curves.DEFAULT_SMOOTHING
    output: str | None = None
    config_path: Path | None = None


@dataclasses.dataclass(frozen=True)
class PlotResult:
    path: str
    width: int
    height: int
    runs: list[str]
    skipped: list[str]  # one line per metrics line left out


def plot(req: PlotRequest, *, events: Events) -> PlotResult:
    from dtrain.control.settings import load_settings

    if not req.runs:
        raise UserError("name at least one run to plot (`dtrain runs` lists them)")
    if not req.path.lower().endswith(".png"):
        raise UserError(f"-o {req.path}: the plot is a PNG; name a file ending in .png")
    output = load_settings(req.config_path, {"run.output": req.output}).run.output
    data = []
    for ref in req.runs:
        run = locate(output, ref)
        c = curves.read_metrics(run)
        for line in c.skipped:
            events.warning(line)
        data.append(c)
    png = curves.render(data, width=req.width, height=req.height, dpi=req.dpi, smoothing=req.smoothing)
    if is_remote(req.path):
        parent, _, name = req.path.rpartition("/")
        open_store(parent).write_bytes(name, png)
        where = req.path
    else:
        target = Path(req.path).expanduser()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(png)
        where = str(target.resolve())
    width, height = curves.png_size(png)
    return PlotResult(where, width, height, [c.name for c in data], [s for c in data for s in c.skipped])
