// The dashboard's glue: hands the chart configurations the server rendered to Chart.js, and
// fetches node telemetry (sparklines) and energy figures. No drawing code of its own: Chart.js
// draws, htmx swaps the live fragments.
(function () {
  "use strict";
  const absent = new Set(); // URLs that answered 404: the route is not there (yet)
  const pending = {}; // url -> promise of its JSON, shared by one round of a fragment

  function fetchJSON(url) {
    if (!pending[url]) {
      pending[url] = fetch(url, { credentials: "same-origin" }).then((r) => {
        if (r.status === 404) { absent.add(url); return null; }
        return r.ok ? r.json() : null;
      }).catch(() => null);
      setTimeout(() => { delete pending[url]; }, 1000);
    }
    return pending[url];
  }

  function chart(canvas) {
    if (Chart.getChart(canvas)) return;
    const cfg = JSON.parse(canvas.dataset.chart);
    cfg.options = Object.assign({ animation: false, responsive: true, maintainAspectRatio: false }, cfg.options || {});
    new Chart(canvas, cfg);
  }

  function sparkline(el, values, field) {
    const canvas = document.createElement("canvas");
    canvas.width = 120; canvas.height = 28;
    canvas.className = "sparkline";
    el.replaceChildren(canvas);
    new Chart(canvas, {
      type: "line",
      data: { labels: values.map((_, i) => i), datasets: [{ data: values, pointRadius: 0, borderWidth: 1, borderColor: "#1565c0" }] },
      options: { animation: false, responsive: false, plugins: { legend: { display: false }, tooltip: { enabled: false } },
                 scales: { x: { display: false }, y: { display: false } } },
    });
    el.title = field + ": " + values[values.length - 1].toFixed(1);
  }

  // The telemetry route's answer: a list of devices, or {devices: [...]}.
  function devicesOf(body) {
    if (Array.isArray(body)) return body;
    return (body && Array.isArray(body.devices)) ? body.devices : [];
  }

  function sparks(root) {
    root.querySelectorAll("[data-telemetry]").forEach((el) => {
      const url = el.dataset.telemetry;
      const field = el.dataset.field;
      if (absent.has(url)) { el.textContent = "no telemetry"; return; }
      fetchJSON(url).then((body) => {
        const devices = devicesOf(body);
        const series = devices.map((d) => (d.samples || []).map((s) => s[field]).filter((v) => typeof v === "number"))
          .filter((v) => v.length);
        if (!series.length) { el.textContent = body ? "no samples" : "no telemetry"; return; }
        // One line per node: the mean over its devices, newest samples aligned.
        const n = Math.min(...series.map((v) => v.length));
        const mean = [];
        for (let i = 0; i < n; i++) mean.push(series.reduce((a, v) => a + v[v.length - n + i], 0) / series.length);
        sparkline(el, mean, field);
        el.classList.toggle("simulated", devices.some((d) => d.simulated));
      });
    });
  }

  // Energy and CO2e: GET /v1/energy ({cluster: {kwh, co2e_kg, simulated}, ...}) or
  // /v1/jobs/N/energy ({kwh, co2e_kg, simulated, ...}); "no energy figures" on a 404.
  function energy(root) {
    root.querySelectorAll("[data-energy-url]").forEach((el) => {
      const url = el.dataset.energyUrl;
      if (absent.has(url)) { el.textContent = "no energy figures"; return; }
      fetchJSON(url).then((body) => {
        const f = body && (body.cluster || body);
        if (!f || typeof f.kwh !== "number") { el.textContent = "no energy figures"; return; }
        el.textContent = f.kwh.toFixed(3) + " kWh · " + f.co2e_kg.toFixed(3) + " kg CO2e" +
          (f.simulated ? " (simulated devices)" : "") +
          (body.intensity_source ? " · " + body.g_per_kwh + " g/kWh (" + body.intensity_source + ")" : "");
      });
    });
  }

  function destroyCharts(root) {
    root.querySelectorAll("canvas").forEach((c) => { const ch = Chart.getChart(c); if (ch) ch.destroy(); });
  }

  htmx.onLoad((root) => {
    root.querySelectorAll("canvas[data-chart]").forEach(chart);
    sparks(root);
    energy(root);
  });
  document.body.addEventListener("htmx:beforeSwap", (e) => {
    if (e.detail.target) destroyCharts(e.detail.target);
  });
  document.body.addEventListener("htmx:oobAfterSwap", () => {
    const log = document.getElementById("log-text");
    if (log) log.scrollTop = log.scrollHeight;
  });
})();
