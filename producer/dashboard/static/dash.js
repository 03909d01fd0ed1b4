// The dashboard's live parts: plain JavaScript, no build step. Each part polls the server at most once
// a second; what it puts in the page is either HTML the server rendered (autoescaped there) or text set
// with textContent, never markup built here from data.
(function () {
  "use strict";
  var pollMs = Math.max(1000, parseInt(document.body.dataset.pollMs, 10) || 1000);

  function get(url, as) {
    return fetch(url, {credentials: "same-origin", cache: "no-store"}).then(function (r) {
      if (!r.ok) { throw new Error(url + ": " + r.status); }
      return as === "json" ? r.json() : r.text();
    });
  }

  // overview: the tables, rendered by the server, swapped in whole
  var live = document.getElementById("live");
  if (live) {
    var busy = false;
    setInterval(function () {
      if (busy) { return; }
      busy = true;
      get(live.dataset.liveUrl, "text").then(function (html) { live.innerHTML = html; })
        .catch(function () {}).then(function () { busy = false; });
    }, pollMs);
  }

  // the last hour's plots (uPlot)
  var CHARTS = {
    throughput: {title: "Throughput", series: [["tok_s", "tokens/s", "#2563eb"], ["jobs_per_min", "jobs/min", "#16a34a"]]},
    queued: {title: "Queue depth", series: [["queued_high", "high", "#dc2626"], ["queued_normal", "normal", "#2563eb"],
                                            ["queued_low", "low", "#9ca3af"]]},
    ttft: {title: "Time to first token (s)", series: [["ttft_p50", "p50", "#2563eb"], ["ttft_p95", "p95", "#dc2626"]]},
    wait: {title: "Queue wait (s)", series: [["wait_p50", "p50", "#2563eb"], ["wait_p95", "p95", "#dc2626"]]},
    gw_requests: {title: "API requests per minute", series: [["requests_per_min", "requests", "#2563eb"],
                                                            ["errors_per_min", "5xx", "#dc2626"]]},
    gw_ttft: {title: "Time to first streamed token (s)", series: [["ttft_p50", "p50", "#2563eb"],
                                                                  ["ttft_p95", "p95", "#dc2626"]]}
  };

  function columns(data, spec) {
    return [data.t].concat(spec.series.map(function (s) { return data[s[0]]; }));
  }

  document.querySelectorAll("section.charts").forEach(function (section) {
    var plots = {};
    function draw(data) {
      section.querySelectorAll("div.chart").forEach(function (el) {
        var spec = CHARTS[el.dataset.chart];
        if (plots[el.dataset.chart]) { plots[el.dataset.chart].setData(columns(data, spec)); return; }
        var opts = {
          title: spec.title, width: Math.max(300, Math.min(560, el.clientWidth || 480)), height: 200,
          series: [{}].concat(spec.series.map(function (s) { return {label: s[1], stroke: s[2], width: 2, spanGaps: true}; })),
          axes: [{}, {size: 60}],
          // the last hour, whatever the points cover (a worker that just started has one)
          scales: {x: {time: true, range: function () { var now = Date.now() / 1000; return [now - 3600, now]; }}}
        };
        plots[el.dataset.chart] = new uPlot(opts, columns(data, spec), el);
      });
      section.dataset.points = String(data.t.length);
    }
    function refresh() { get(section.dataset.seriesUrl, "json").then(draw).catch(function () {}); }
    refresh();
    setInterval(refresh, Math.max(pollMs, 10000));  // the workers write a point every 10 s
  });

  // a job's page: its tokens as they reach the durable record
  var job = document.getElementById("job");
  if (job) {
    var output = document.getElementById("output"), status = document.getElementById("status");
    var timer = null;
    function tick() {
      get(job.dataset.jobUrl, "json").then(function (d) {
        output.textContent = d.text;
        status.textContent = d.status;
        document.getElementById("attempts").textContent = d.attempts;
        document.getElementById("tokens").textContent = "(" + d.text.length + " characters)";
        document.getElementById("finish").textContent = d.finish_reason || "-";
        document.getElementById("error").textContent = d.error || "-";
        Object.keys(d.times).forEach(function (name) {
          var cell = document.getElementById("t-" + name);
          if (cell) { cell.textContent = d.times[name]; }
        });
        if (d.done) { clearInterval(timer); job.dataset.done = "1"; }
      }).catch(function () {});
    }
    tick();
    timer = setInterval(tick, pollMs);
  }
})();
