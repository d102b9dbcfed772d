// The compare page: the chosen runs' curves overlaid, one colour per run (the table lists them).
"use strict";

(() => {
  const runs = JSON.parse(document.getElementById("compare-data").textContent);
  const series = runs.map((r, i) => ({ name: r.run_id, rows: r.rows, color: DtrainCharts.COLORS[i % DtrainCharts.COLORS.length] }));
  document.querySelectorAll("table.runs tbody tr").forEach((tr, i) => {
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = series[i].color;
    tr.cells[0].prepend(swatch);
  });
  DtrainCharts.board(() => series);
})();
