// The run page: charts from the rows the server embedded, then kept current from the run's stream
// of server-sent events (/api/v1/runs/{id}/stream) until the run ends.
"use strict";

(() => {
  const data = JSON.parse(document.getElementById("run-data").textContent);
  let rows = data.metrics.rows;
  const skipped = new Set(data.metrics.skipped.lines);
  const redraw = DtrainCharts.board(() => [{ name: data.run_id, rows }]);
  const logs = document.getElementById("logs");
  const LOG_LINES = 2000; // kept on the page

  // As the server writes them (pages.py's duration filter).
  const duration = (s) => {
    if (s === null || s === undefined) return "-";
    s = Math.floor(s);
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${String(s % 60).padStart(2, "0")} s`;
    return `${Math.floor(s / 3600)} h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")} min`;
  };
  const when = (t) => (typeof t === "number" ? new Date(t * 1000).toISOString().slice(0, 19).replace("T", " ") : "");

  // Python's "{:.1f}", as the server and the launcher's messages write a ratio: toFixed rounds the exact
  // value as Python does, except an exact half (x.25, x.75: a quarter), which Python takes to the even tenth.
  const tenths = (r) => {
    if (!Number.isInteger(r * 4) || (r * 4) % 2 === 0) return r.toFixed(1);
    const n = Math.floor(r * 10);
    return ((n % 2 ? n + 1 : n) / 10).toFixed(1);
  };
  // As the server writes them (runs.stragglers_label): slowest first, "h1 rank 1 (2.3x), ...".
  const stragglers = (found) =>
    Object.entries(found || {})
      .sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0))
      .map(([name, ratio]) => `${name} (${tenths(ratio)}x)`)
      .join(", ");

  function showSkipped() {
    const box = document.getElementById("skipped");
    if (!skipped.size) return;
    const lines = [...skipped].sort((a, b) => a - b);
    box.hidden = false;
    box.textContent = `${lines.length} line(s) of metrics.jsonl are not JSON and are left out: line ${lines.slice(0, 20).join(", ")}${lines.length > 20 ? ", ..." : ""}`;
  }

  function addEvents(events) {
    const body = document.querySelector("#events-table tbody");
    for (const e of events) {
      const tr = body.insertRow();
      tr.className = `event-${e.event}`;
      for (const v of [when(e.time), e.step ?? "", e.event ?? "", e.message ?? ""]) tr.insertCell().textContent = v;
      tr.cells[1].className = "num";
    }
    if (events.length) document.getElementById("events-empty").hidden = true;
    if (events.some((e) => e.event === "hang")) showHangs();
  }

  // A hung rank's stacks are in the run before its "hang" event is: fetched when one arrives.
  async function showHangs() {
    const answer = await fetch(`/api/v1/runs/${encodeURIComponent(data.run_id)}/hangs`);
    if (!answer.ok) return;
    const list = document.getElementById("hangs-list");
    list.replaceChildren();
    for (const h of (await answer.json()).hangs) {
      const box = document.createElement("details");
      box.className = "hang";
      box.open = true;
      const summary = box.appendChild(document.createElement("summary")).appendChild(document.createElement("code"));
      summary.textContent = `hangs/${h.name}`;
      const pre = box.appendChild(document.createElement("pre"));
      pre.className = "logs";
      pre.textContent = h.text;
      list.appendChild(box);
    }
    document.getElementById("hangs").hidden = !list.children.length;
  }

  function addLogs(lines) {
    if (!lines.length) return;
    const text = lines.map((l) => `${l.stamp.slice(11, 23)} [${l.node}] ${l.text}`).join("\n") + "\n";
    logs.textContent = (logs.textContent + text).split("\n").slice(-LOG_LINES - 1).join("\n");
    logs.scrollTop = logs.scrollHeight;
  }

  function showRun(detail) {
    const row = detail.summary;
    const status = document.getElementById("run-status");
    status.textContent = row.status;
    status.className = `status ${row.status}`;
    document.getElementById("fact-step").textContent = row.last_step ?? "-";
    document.getElementById("fact-duration").textContent = duration(row.duration_s);
    const slow = document.getElementById("fact-stragglers");
    const found = row.status === "running" ? stragglers(row.stragglers) : "";
    slow.textContent = found || (row.status === "running" ? "none" : "-");
    slow.className = found ? "straggler" : "";
    if (row.best_value !== null) {
      document.getElementById("fact-best").textContent = `${row.best_metric.replace("eval_accuracy", "acc")} ${row.best_value.toFixed(4)}`;
    }
    const body = document.querySelector("#checkpoints-table tbody");
    body.replaceChildren();
    document.getElementById("checkpoints-empty").hidden = detail.checkpoints.length > 0;
    for (const c of detail.checkpoints) {
      const tr = body.insertRow();
      const size = c.bytes === null ? "-" : `${(c.bytes / 1048576).toFixed(1)} MiB`;
      for (const v of [c.step, when(c.created), size, !c.complete ? "incomplete" : c.latest ? "latest" : ""]) {
        tr.insertCell().textContent = v;
      }
      tr.cells[0].className = tr.cells[2].className = "num";
    }
  }

  showSkipped();

  // Node logs: their own stream (what `dtrain logs -f` follows); it ends when the run has.
  const id = encodeURIComponent(data.run_id);
  let logLines = 0;
  const logSource = new EventSource(`/api/v1/runs/${id}/logs?follow=1&tail=${data.log_tail}`);
  logSource.addEventListener("logs", (ev) => {
    const lines = JSON.parse(ev.data).lines;
    logLines += lines.length;
    addLogs(lines);
  });
  logSource.addEventListener("end", () => {
    logSource.close();
    document.getElementById("logs-note").hidden = logLines > 0;
  });
  logSource.addEventListener("error", (ev) => {
    if (ev.data) logSource.close(); // the server said why (an "error" event); a dropped connection retries
  });

  if (["completed", "failed", "preempted", "interrupted", "stopped"].includes(data.status)) return;

  const url = `/api/v1/runs/${id}/stream?metrics_line=${data.metrics.lines}&events_line=${data.events.lines}`;
  const source = new EventSource(url);
  source.addEventListener("metrics", (ev) => {
    const page = JSON.parse(ev.data);
    rows = page.reset ? page.rows : rows.concat(page.rows);
    if (page.reset) skipped.clear();
    page.skipped.lines.forEach((n) => skipped.add(n));
    showSkipped();
    redraw();
  });
  source.addEventListener("events", (ev) => addEvents(JSON.parse(ev.data).rows));
  source.addEventListener("run", (ev) => showRun(JSON.parse(ev.data)));
  source.addEventListener("end", () => {
    source.close();
    document.getElementById("live").hidden = true;
  });
})();
