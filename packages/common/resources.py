"""Resource curves (docs/runs.md, "Resource curves"): what a node's CPU, memory and GPUs did while a job ran, and
each rank's peak memory. Standard library only at import time: the node agent runs it where only Python is
sure to be, and NVML (the `nvidia-ml-py` wheel's `pynvml`) is imported when a sampler first looks for GPUs.

Two halves:

    Sampler   on the node (dtrain.common.nodeagent's `run`, or dtrain.control.userjob on this machine): one row
              every interval from /proc (the node's CPU %, its memory used/total, the job's process tree's RSS,
              each rank's RSS and its high-water mark VmHWM) and NVML where a driver answers (each GPU's
              utilisation and memory; each rank's GPU memory, from NVML's per-process accounting).
    Recorder  where the run is recorded (the launcher; Slurm's batch step): the rows of node N appended to the
              run's resources/<N>.jsonl, and each rank's peak in status.json's `peak_memory`
              (dtrain.common.runrecord.record_peaks) when the job has ended. Not before: a built-in's rank 0
              rewrites status.json while it runs (its peers, its result), and two writers of one file would
              lose each other's fields. While the job runs, the rows' own high-water marks are its peaks
              (read_series gives them).

A node's file is bounded: past MAX_ROWS rows every other row is dropped (the file rewritten once) and from then on
only every other row is kept, so a week-long run keeps its whole span at a coarser step.

A row: {"time", "node", "cpu_pct", "mem_used", "mem_total", "tree_rss", "ranks": {"<rank>": {"rss", "hwm",
"gpu"?}}, "gpus": [{"index", "util_pct", "mem_used", "mem_total"}], "sample_ms"}: bytes, and the sampler's own
CPU time for the row (its thread's CPU time, milliseconds).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtrain.common.storage import Store

SAMPLE_EVERY_S = 5.0  # the default interval ([run] sample_interval, DTRAIN_SAMPLE_INTERVAL)
RESOURCES = "resources"  # the run's folder of per-node files: resources/<node>.jsonl
MAX_ROWS = 2000  # rows a node's file keeps (2.8 hours at 5 s before the first thinning)
REMOTE_FLUSH_S = 30.0  # a bucket's run: rows appended in batches this often (each append is two requests)
EVENT = "resources"  # the node agent's control line: {"event": "resources", **row}


def resources_file(node: str) -> str:
    return f"{RESOURCES}/{node}.jsonl"


# --- the node side ----------------------------------------------------------------------------------------------


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of the whole node, from /proc/stat's first line."""
    fields = [int(x) for x in _read("/proc/stat").split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user time
    return total - idle, total


def node_memory() -> tuple[int, int]:
    """(used, total) bytes: MemTotal - MemAvailable, as `free` counts used memory."""
    info: dict[str, int] = {}
    for line in _read("/proc/meminfo").splitlines():
        name, _, rest = line.partition(":")
        if name in ("MemTotal", "MemAvailable", "MemFree"):
            info[name] = int(rest.split()[0]) * 1024
    total = info.get("MemTotal", 0)
    return total - info.get("MemAvailable", info.get("MemFree", 0)), total


def process_memory(pid: int) -> tuple[int, int] | None:
    """(RSS, peak RSS) bytes of a process (/proc/PID/status VmRSS, VmHWM), None if it is gone (or a zombie)."""
    try:
        text = _read(f"/proc/{pid}/status")
    except OSError:
        return None
    got: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            got[line[:5]] = int(line.split()[1]) * 1024
    if "VmRSS" not in got:
        return None
    return got["VmRSS"], got.get("VmHWM", got["VmRSS"])


def _environ_rank(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"RANK="):
                    return int(item[5:])
    except (OSError, ValueError):
        return None
    return None


def _parent(pid: int) -> int | None:
    try:
        return int(_read(f"/proc/{pid}/stat").rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


class Gpus:
    """The node's GPUs through NVML: nothing (and no error) where `pynvml` is not installed or no driver answers.
    `sample()`: one dict a GPU, and the GPU memory each process uses (pid -> bytes, over every GPU)."""

    def __init__(self) -> None:
        self.nvml: Any = None
        self.handles: list[Any] = []
        self.why = ""  # why there are none: "pynvml is not installed", NVML's own error
        try:
            import pynvml  # the nvidia-ml-py wheel
        except ImportError:
            self.why = "pynvml (nvidia-ml-py) is not installed"
            return
        try:
            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except pynvml.NVMLError as e:
            self.why = f"NVML: {e}"
            return
        self.nvml = pynvml

    def sample(self) -> tuple[list[dict[str, Any]], dict[int, int]]:
        if self.nvml is None:
            return [], {}
        nv, gpus, per_pid = self.nvml, [], {}
        for i, h in enumerate(self.handles):
            row: dict[str, Any] = {"index": i}
            with contextlib.suppress(nv.NVMLError):
                row["util_pct"] = int(nv.nvmlDeviceGetUtilizationRates(h).gpu)
            with contextlib.suppress(nv.NVMLError):
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                row["mem_used"], row["mem_total"] = int(mem.used), int(mem.total)
            with contextlib.suppress(nv.NVMLError):
                for p in nv.nvmlDeviceGetComputeRunningProcesses(h):
                    used = p.usedGpuMemory  # None where the driver does not account per process (some vGPUs)
                    if isinstance(used, int):
                        per_pid[int(p.pid)] = per_pid.get(int(p.pid), 0) + used
            gpus.append(row)
        return gpus, per_pid

    def close(self) -> None:
        if self.nvml is not None:
            with contextlib.suppress(self.nvml.NVMLError):
                self.nvml.nvmlShutdown()
            self.nvml = None


class Sampler:
    """One row of a node's resources per `sample(pids)` call, `pids` being the job's process tree (its root
    first). A rank is a process with RANK in its environment whose parent has none (torchrun's workers, or
    accelerate's); its RANK is learnt once, while it runs."""

    def __init__(self, *, gpus: bool = True) -> None:
        self.gpus = Gpus() if gpus else None
        self._cpu = cpu_times()
        self._ranks: dict[int, int | None] = {}  # pid -> its rank (None: not a rank)

    def rank_of(self, pid: int) -> int | None:
        if pid not in self._ranks:
            rank = _environ_rank(pid)
            parent = _parent(pid) if rank is not None else None
            # A rank's own children (data loader workers, a compile worker) inherit RANK: their parent has it too.
            if rank is not None and parent is not None and _environ_rank(parent) is not None:
                rank = None
            self._ranks[pid] = rank
        return self._ranks[pid]

    def sample(self, pids: Iterable[int]) -> dict[str, Any]:
        spent = time.thread_time()
        busy, total = cpu_times()
        d_busy, d_total = busy - self._cpu[0], total - self._cpu[1]
        self._cpu = (busy, total)
        used, mem_total = node_memory()
        gpus, gpu_by_pid = self.gpus.sample() if self.gpus is not None else ([], {})
        tree_rss, ranks = 0, {}
        live = list(pids)
        for pid in live:
            mem = process_memory(pid)
            if mem is None:
                continue
            tree_rss += mem[0]
            rank = self.rank_of(pid)
            if rank is not None:
                entry = {"rss": mem[0], "hwm": mem[1]}
                if pid in gpu_by_pid:
                    entry["gpu"] = gpu_by_pid[pid]
                ranks[str(rank)] = entry
        for gone in set(self._ranks) - set(live):
            del self._ranks[gone]
        row: dict[str, Any] = {
            "time": round(time.time(), 3),
            "cpu_pct": round(100.0 * d_busy / d_total, 1) if d_total > 0 else 0.0,
            "mem_used": used,
            "mem_total": mem_total,
            "tree_rss": tree_rss,
            "ranks": ranks,
        }
        if gpus:
            row["gpus"] = gpus
        row["sample_ms"] = round((time.thread_time() - spent) * 1000, 3)
        return row

    def close(self) -> None:
        if self.gpus is not None:
            self.gpus.close()


class SamplerThread:
    """A Sampler run every `interval_s` on a thread of its own, each row handed to `emit` (a control line, a
    Recorder); `pids()` gives the job's process tree at that moment. A failing sampler says so once and stops:
    it never takes the job down with it.

    The Sampler is made by `start`, in the caller's thread: its imports (pynvml, ctypes) must not run on the
    thread while the caller forks. A thread importing a module at the moment of a fork leaves the module's
    lock held in the child, and a `preexec_fn` that imports (dtrain.common.procs.dies_with_parent imports
    ctypes) then waits for it forever: the launcher on this machine hung so before the job ever started."""

    def __init__(
        self, interval_s: float, pids: Callable[[], list[int]], emit: Callable[[dict[str, Any]], None],
        *, warn: Callable[[str], None] = lambda _m: None,
    ) -> None:  # fmt: skip
        self.interval_s, self.pids, self.emit, self.warn = interval_s, pids, emit, warn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="resources", daemon=True)
        self.sampler: Sampler | None = None

    def start(self) -> SamplerThread:
        if self.interval_s > 0:
            try:
                self.sampler = Sampler()
            except Exception as e:  # noqa: BLE001 - no /proc (not Linux): no curves, the job runs on
                self.warn(f"resource sampling is off: {e}")
                return self
            self._thread.start()
        return self

    def _loop(self) -> None:
        sampler = self.sampler
        assert sampler is not None
        try:
            while not self._stop.wait(self.interval_s):
                pids = self.pids()
                if pids:
                    self.emit(sampler.sample(pids))
        except Exception as e:  # noqa: BLE001
            self.warn(f"resource sampling stopped: {e}")
        finally:
            sampler.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


# --- the recording side -----------------------------------------------------------------------------------------


def series_peaks(series: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each rank's peak over read_series' nodes (what status.json's peak_memory will say once the job ends)."""
    out: dict[str, dict[str, Any]] = {}
    for s in series.values():
        merge_peaks(out, s.get("peaks") or {})
    return out


def peaks_of(row: Mapping[str, Any], node: str) -> dict[str, dict[str, Any]]:
    """Each rank's peak as one row shows it: {"<rank>": {"node", "rss_peak", "gpu_peak"?}} (bytes)."""
    out: dict[str, dict[str, Any]] = {}
    ranks = row.get("ranks")
    if not isinstance(ranks, dict):
        return out
    for rank, r in ranks.items():
        if not isinstance(r, dict):
            continue
        with contextlib.suppress(TypeError, ValueError):
            peak = {"node": node, "rss_peak": int(max(r.get("hwm") or 0, r.get("rss") or 0))}
            if r.get("gpu") is not None:
                peak["gpu_peak"] = int(r["gpu"])
            out[str(rank)] = peak
    return out


def merge_peaks(into: dict[str, dict[str, Any]], more: Mapping[str, Mapping[str, Any]]) -> bool:
    """`more`'s peaks into `into` (the larger of each); True if anything grew."""
    grew = False
    for rank, p in more.items():
        have = into.setdefault(rank, {"node": p.get("node")})
        for key in ("rss_peak", "gpu_peak"):
            if isinstance(p.get(key), int) and p[key] > (have.get(key) or 0):
                have[key], have["node"], grew = p[key], p.get("node"), True
    return grew


class Recorder:
    """Rows from the nodes into the run (see the module docstring). `add` may be called from several threads;
    `close` (once the job has ended, before the launcher records the end) writes the last rows and the peaks.
    Only counts are kept in memory: a thinning reads the node's file back once."""

    def __init__(
        self, run: Store, *, max_rows: int = MAX_ROWS, flush_s: float | None = None, staging: bool = False
    ) -> None:
        """`staging`: `run` is a folder that holds rows for `publish` (which makes the run's checks), not a run."""
        from dtrain.common.storage import is_remote

        self.run, self.max_rows, self.staging = run, max_rows, staging
        self.flush_s = (REMOTE_FLUSH_S if is_remote(run.url) else 0.0) if flush_s is None else flush_s
        self._lock = threading.Lock()
        self._count: dict[str, int] = {}  # node -> rows its file holds, pending ones included
        self._stride: dict[str, int] = {}  # node -> keep one row in this many
        self._seen: dict[str, int] = {}  # node -> rows offered since the last thinning
        self._pending: dict[str, list[dict[str, Any]]] = {}
        self._flushed_at = time.monotonic()
        self.peaks: dict[str, dict[str, Any]] = {}
        self._before: dict[str, bytes | None] = {}  # node -> its file as this start found it (None: there was none)
        self._closed = False

    def _start(self, node: str) -> None:
        """The node's file as an earlier start of the run left it: a resumed run's curve goes on (thinned as if it
        had grown here)."""
        before = None  # no file yet (or an unreadable store): no rows
        with contextlib.suppress(Exception):
            before = self.run.read_bytes(resources_file(node))
        self._before[node] = before
        self._count[node], self._stride[node], self._seen[node] = len(parse_rows(before or b"")), 1, 0
        if self._count[node] >= self.max_rows:
            self._thin(node)

    def _thin(self, node: str) -> None:
        """Every other row of the node's file dropped (until it is under max_rows); later rows kept as sparsely."""
        self._flush(node)
        rows = read_rows(self.run, resources_file(node))
        while len(rows) >= self.max_rows:
            rows = rows[::2]
            self._stride[node] *= 2
        self._count[node], self._seen[node] = len(rows), 0
        with contextlib.suppress(Exception):  # best effort: curves never fail a run
            self.run.write_bytes(resources_file(node), "".join(json.dumps(r) + "\n" for r in rows).encode())

    def add(self, node: str, row: Mapping[str, Any]) -> None:
        row = {**row, "node": node}
        with self._lock:
            if self._closed:
                return
            if node not in self._count:
                self._start(node)
            merge_peaks(self.peaks, peaks_of(row, node))
            self._seen[node] += 1
            if (self._seen[node] - 1) % self._stride[node]:
                return  # thinned: this row is not kept (its peaks are)
            self._pending.setdefault(node, []).append(row)
            self._count[node] += 1
            if self._count[node] >= self.max_rows:
                self._thin(node)
            elif time.monotonic() - self._flushed_at >= self.flush_s:
                self._flushed_at = time.monotonic()
                for name in list(self._pending):
                    self._flush(name)

    def _flush(self, node: str) -> None:
        rows = self._pending.pop(node, [])
        if rows:
            with contextlib.suppress(Exception):
                self.run.append_bytes(resources_file(node), "".join(json.dumps(r) + "\n" for r in rows).encode())

    def close(self, refused: bool = False) -> None:
        """The last rows, and the peaks into status.json: call it once the job has ended on every node (nothing
        else writes status.json then), before the launcher records the end. `refused`: the job refused its input
        (exit 2, ExitCode.USAGE), which changes nothing in a run: each node's file goes back to what this start
        found (or away), and no peaks are recorded."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if refused:
                self._pending.clear()
                self._restore()
                return
            for name in list(self._pending):
                self._flush(name)
            if not self.staging and not discard_unmade(self.run):
                return
            if self.peaks:
                from dtrain.common import runrecord

                with contextlib.suppress(Exception):
                    runrecord.record_peaks(self.run, self.peaks)

    def _restore(self) -> None:
        with contextlib.suppress(Exception):  # best effort, as every write of the curves
            for node, before in self._before.items():
                if before is None:
                    self.run.delete(resources_file(node))
                else:
                    self.run.write_bytes(resources_file(node), before)
            if self._before and not self.run.list(f"{RESOURCES}/"):
                self.run.delete(RESOURCES)


def discard_unmade(run: Store) -> bool:
    """False, with the rows removed, for a run that was never made or was removed while the job ran (no
    config.json: a built-in refusing its input deletes its run), so the curves leave no debris; True otherwise."""
    try:
        if run.exists("config.json"):
            return True
        if all(name.startswith(f"{RESOURCES}/") for name in run.list("")):
            run.delete("")  # nothing but the rows: the run's folder goes with them
        else:
            run.delete(RESOURCES)
    except Exception:  # noqa: BLE001 - best effort, as every write of the curves
        pass
    return False


def publish(staged: Store, run: Store) -> None:
    """A start's rows and peaks, kept by a Recorder over `staged` (a folder of the node, where the run's store
    cannot be reached: dtrain.common.slurmstep.ImageResources), added to the run: each node's rows appended to
    its file, the peaks merged into status.json."""
    from dtrain.common import runrecord

    if not run.exists("config.json"):  # the run was never made, or removed for bad input: nothing to add
        return
    for name in staged.list(RESOURCES):
        if name.startswith(f"{RESOURCES}/") and name.endswith(".jsonl"):
            run.append_bytes(name, staged.read_bytes(name))
    peaks = (runrecord.read_status(staged) or {}).get(runrecord.PEAK_MEMORY)
    if peaks:
        runrecord.record_peaks(run, peaks)


def read_rows(run: Store, rel: str) -> list[dict[str, Any]]:
    """The rows of a node's file (`rel`: resources_file(node)), in file order; [] without one. A line that is not
    a JSON object (a torn last line) is skipped."""
    try:
        data = run.read_bytes(rel)
    except Exception:  # noqa: BLE001 - no file yet, an unreadable store: no rows
        return []
    return parse_rows(data)


def parse_rows(data: bytes) -> list[dict[str, Any]]:
    """A node's file's rows (read_rows), from its bytes."""
    rows: list[dict[str, Any]] = []
    for line in data.decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            if isinstance(row := json.loads(line), dict):
                rows.append(row)
    return rows


def read_series(run: Store, *, points: int = 0) -> dict[str, dict[str, Any]]:
    """Each node's curves from the run's resources/: {node: {"time": [...], "cpu_pct": [...], "mem_used": [...],
    "mem_total", "tree_rss": [...], "gpu_util_pct": [[...] per GPU], "gpu_mem_used": [[...] per GPU],
    "peaks": {"<rank>": {"node", "rss_peak", "gpu_peak"?}}}}: `peaks` over every row (a running job's peaks so far);
    with `points`, at most that many samples a node (evenly spaced, the last one kept)."""
    out: dict[str, dict[str, Any]] = {}
    try:
        names = sorted(p for p in run.list(RESOURCES) if p.startswith(f"{RESOURCES}/") and p.endswith(".jsonl"))
    except Exception:  # noqa: BLE001 - no folder, an unreadable store: no curves
        return out
    for name in names:
        rows = [r for r in read_rows(run, name) if isinstance(r.get("time"), (int, float))]
        if not rows:
            continue
        rows.sort(key=lambda r: r["time"])
        node = name.rsplit("/", 1)[-1][: -len(".jsonl")]
        peaks: dict[str, dict[str, Any]] = {}
        for r in rows:
            merge_peaks(peaks, peaks_of(r, node))
        if points and len(rows) > points:
            step = len(rows) / points
            rows = [rows[int(i * step)] for i in range(points - 1)] + [rows[-1]]
        n_gpus = max((len(r.get("gpus") or []) for r in rows), default=0)
        series: dict[str, Any] = {
            "time": [r["time"] for r in rows],
            "cpu_pct": [r.get("cpu_pct") for r in rows],
            "mem_used": [r.get("mem_used") for r in rows],
            "mem_total": rows[-1].get("mem_total"),
            "tree_rss": [r.get("tree_rss") for r in rows],
        }
        if n_gpus:
            series["gpu_util_pct"] = [[_gpu(r, i, "util_pct") for r in rows] for i in range(n_gpus)]
            series["gpu_mem_used"] = [[_gpu(r, i, "mem_used") for r in rows] for i in range(n_gpus)]
            series["gpu_mem_total"] = [_gpu(rows[-1], i, "mem_total") for i in range(n_gpus)]
        series["peaks"] = peaks
        out[node] = series
    return out


def _gpu(row: Mapping[str, Any], i: int, key: str) -> Any:
    gpus = row.get("gpus") or []
    return gpus[i].get(key) if i < len(gpus) and isinstance(gpus[i], dict) else None
