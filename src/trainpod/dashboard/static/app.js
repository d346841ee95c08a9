// The dashboard's glue: hands chart data rendered by the server to Chart.js, fetches node
// telemetry for sparklines. No drawing code of its own (Chart.js draws); htmx does the rest.
(function () {
  "use strict";
  const noTelemetry = new Set(); // URLs that answered 404: the route is not there

  function chart(canvas) {
    if (Chart.getChart(canvas)) return;
    const cfg = JSON.parse(canvas.dataset.chart);
    cfg.options = Object.assign({ animation: false, responsive: true, maintainAspectRatio: false }, cfg.options || {});
    new Chart(canvas, cfg);
  }

  function sparkline(el, samples, field) {
    const values = samples.map((s) => s[field]).filter((v) => v !== null && v !== undefined);
    if (!values.length) { el.textContent = "no " + field; return; }
    const canvas = document.createElement("canvas");
    canvas.width = 120; canvas.height = 28;
    el.replaceChildren(canvas);
    new Chart(canvas, {
      type: "line",
      data: { labels: values.map((_, i) => i), datasets: [{ data: values, pointRadius: 0, borderWidth: 1, borderColor: "#1565c0" }] },
      options: { animation: false, responsive: false, plugins: { legend: { display: false }, tooltip: { enabled: false } },
                 scales: { x: { display: false }, y: { display: false } } },
    });
    el.title = field + ": " + values[values.length - 1];
  }

  const telemetry = {}; // url -> promise of the JSON, for one round of a fragment

  function fetchTelemetry(url) {
    if (!telemetry[url]) {
      telemetry[url] = fetch(url, { credentials: "same-origin" }).then((r) => {
        if (r.status === 404) { noTelemetry.add(url); return null; }
        return r.ok ? r.json() : null;
      }).catch(() => null);
      setTimeout(() => { delete telemetry[url]; }, 1000);
    }
    return telemetry[url];
  }

  let energy = {};
  function showEnergy() {
    const el = document.querySelector("[data-energy]");
    if (!el) return;
    const joules = Object.values(energy);
    if (!joules.length) { el.textContent = "no telemetry"; return; }
    const kwh = joules.reduce((a, b) => a + b, 0) / 3.6e6;
    el.textContent = kwh.toFixed(4) + " kWh over " + joules.length + " device(s), as their counters read";
  }

  function sparks(root) {
    root.querySelectorAll("[data-telemetry]").forEach((el) => {
      const url = el.dataset.telemetry;
      if (noTelemetry.has(url)) { el.textContent = "no telemetry"; return; }
      fetchTelemetry(url).then((body) => {
        if (!body || !body.devices || !body.devices.length) { el.textContent = "no telemetry"; return; }
        const samples = body.devices.flatMap((d) => d.samples.length ? [d.samples] : []);
        if (!samples.length) { el.textContent = "no samples"; return; }
        // One line per node: the mean over its devices, sample by sample.
        const n = Math.min(...samples.map((s) => s.length));
        const mean = [];
        for (let i = 0; i < n; i++) {
          const row = {};
          row[el.dataset.field] = samples.reduce((a, s) => a + (s[s.length - n + i][el.dataset.field] || 0), 0) / samples.length;
          mean.push(row);
        }
        sparkline(el, mean, el.dataset.field);
        if (body.devices.some((d) => d.simulated)) el.classList.add("simulated");
        body.devices.forEach((d) => {
          const last = d.samples[d.samples.length - 1];
          if (last && last.energy_j !== null && last.energy_j !== undefined) energy[url + "#" + d.index] = last.energy_j;
        });
        showEnergy();
      });
    });
  }

  function destroyCharts(root) {
    root.querySelectorAll("canvas").forEach((c) => { const ch = Chart.getChart(c); if (ch) ch.destroy(); });
  }

  htmx.onLoad((root) => {
    root.querySelectorAll("canvas[data-chart]").forEach(chart);
    sparks(root);
  });
  document.body.addEventListener("htmx:beforeSwap", (e) => {
    if (e.detail.target) destroyCharts(e.detail.target);
  });
  document.body.addEventListener("htmx:oobAfterSwap", () => {
    const log = document.getElementById("log-text");
    if (log && log.dataset.pinned !== "no") log.scrollTop = log.scrollHeight;
  });
})();
