/* ocrq's pages, live: each page polls its small JSON (/live/...) every data-poll-ms and updates
   its numbers, bars, rows and plots in place. Elements are updated, not replaced, so keyboard
   focus stays where it is; a part of the page that holds focus is left alone until it has none.
   Without JavaScript the pages are complete as served. */
(function () {
  "use strict";
  var POLL = parseInt(document.body.getAttribute("data-poll-ms") || "1500", 10);
  var status = document.getElementById("live-status");
  var alertBox = document.getElementById("live-alert");

  function say(text) { if (alertBox) alertBox.textContent = text; }

  function mark(ok) {
    if (!status) return;
    status.hidden = false;
    status.classList.toggle("stale", !ok);
    status.textContent = ok ? "Live · updated " + new Date().toLocaleTimeString() : "Not updating: retrying";
  }

  /* GET url as JSON every POLL ms while the page is visible; apply(data) each time */
  function poll(url, apply) {
    var failures = 0, timer = null, stopped = false;
    function schedule() {
      var wait = failures ? Math.min(POLL * Math.pow(2, failures), 30000) : POLL;
      timer = setTimeout(tick, wait);
    }
    function tick() {
      timer = null;
      if (document.hidden) return;  /* resumed when the page is shown again */
      fetch(url, { credentials: "same-origin", cache: "no-store", headers: { Accept: "application/json" } })
        .then(function (r) {
          if (r.status === 401) {
            stopped = true;
            window.location.assign("/login?next=" + encodeURIComponent(location.pathname + location.search));
            return null;
          }
          if (r.status === 404) { stopped = true; say("This is gone: it no longer exists."); return null; }
          if (!r.ok) throw new Error("HTTP " + r.status);
          return r.json();
        })
        .then(function (data) {
          if (data === null) return;
          if (failures >= 2) say("Live updates are back.");
          failures = 0;
          apply(data);
          mark(true);
        })
        .catch(function () {
          failures += 1;
          if (failures === 2) say("Live updates paused: the server does not answer. Retrying.");
          mark(false);
        })
        .then(function () { if (!stopped) schedule(); });
    }
    document.addEventListener("visibilitychange", function () {
      if (!document.hidden && !timer && !stopped) tick();
    });
    schedule();
  }

  /* every [data-f] under root gets rec[its name]: text, or an href / class built from it */
  function fill(root, rec) {
    root.querySelectorAll("[data-f]").forEach(function (node) {
      var key = node.getAttribute("data-f");
      if (!Object.prototype.hasOwnProperty.call(rec, key)) return;
      var value = rec[key] === null || rec[key] === undefined ? "–" : String(rec[key]);
      var href = node.getAttribute("data-href"), cls = node.getAttribute("data-class");
      if (href !== null) node.setAttribute("href", href + encodeURIComponent(value));
      if (cls !== null && node.className !== cls + value) node.className = cls + value;
      if (node.textContent !== value) node.textContent = value;
    });
  }

  function setBar(bar, p, label) {
    if (!bar || !p) return;
    bar.setAttribute("aria-valuemax", String(Math.max(p.total, 1)));
    bar.setAttribute("aria-valuenow", String(p.final));
    bar.setAttribute("aria-valuetext", p.text);
    if (label) bar.setAttribute("aria-label", "Progress of " + label);
    p.segments.forEach(function (s) {
      var rect = bar.querySelector('[data-seg="' + s.name + '"]');
      if (rect) { rect.setAttribute("x", String(s.x)); rect.setAttribute("width", String(s.width)); }
    });
    var text = bar.querySelector("[data-bar-label]");
    if (text && text.textContent !== p.label) text.textContent = p.label;
  }

  /* the children of box (rows, cards) follow recs (by key): updated in place, new ones from the
     template, gone ones removed */
  function syncRows(tbody, recs, template, fillRow) {
    var byKey = {};
    Array.prototype.forEach.call(tbody.querySelectorAll(":scope > [data-key]"), function (tr) {
      byKey[tr.getAttribute("data-key")] = tr;
    });
    var keep = {};
    recs.forEach(function (rec, i) {
      var tr = byKey[rec.key];
      if (!tr) {
        tr = template.content.firstElementChild.cloneNode(true);
        tr.setAttribute("data-key", rec.key);
      }
      keep[rec.key] = true;
      fillRow(tr, rec);
      if (tbody.children[i] !== tr) tbody.insertBefore(tr, tbody.children[i] || null);
    });
    Object.keys(byKey).forEach(function (k) { if (!keep[k]) byKey[k].remove(); });
  }

  function jobsPage(table) {
    var tbody = table.querySelector("tbody[data-rows]");
    var template = document.getElementById("row-template");
    var summary = document.getElementById("jobs-summary");
    var empty = document.querySelector("[data-empty]");
    poll(table.getAttribute("data-live"), function (data) {
      data.rows.forEach(function (r) { r.key = r.id; });
      syncRows(tbody, data.rows, template, function (tr, r) {
        fill(tr, r);
        setBar(tr.querySelector("[data-bar]"), r.progress, r.id);
      });
      if (summary && data.summary && summary.textContent.trim() !== data.summary) summary.textContent = data.summary;
      if (empty) empty.hidden = data.total > 0;
    });
  }

  function drawPlots(series) {
    var rate = document.getElementById("chart-rate"), done = document.getElementById("chart-done");
    if (!window.ocrqCharts || !series) return;
    if (rate) window.ocrqCharts.bars(rate, series.rate);
    if (done) window.ocrqCharts.line(done, series.cumulative);
  }

  function pointsTable(series) {
    var tbody = document.querySelector("tbody[data-points]");
    if (!tbody) return;
    while (tbody.firstChild) tbody.removeChild(tbody.firstChild);
    series.cumulative.forEach(function (p) {
      var tr = document.createElement("tr");
      [String(p[0]), p[1].toLocaleString("en-US")].forEach(function (v) {
        var td = document.createElement("td");
        td.className = "num";
        td.textContent = v;
        tr.appendChild(td);
      });
      tbody.appendChild(tr);
    });
  }

  /* the parts of the job page the numbers do not carry, fetched again when they changed */
  var refreshing = false;
  function refreshSections(head, key) {
    if (refreshing) return;
    refreshing = true;
    fetch(location.pathname, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) { return r.ok ? r.text() : Promise.reject(new Error("HTTP " + r.status)); })
      .then(function (html) {
        var fresh = new DOMParser().parseFromString(html, "text/html");
        var all = true;
        document.querySelectorAll("[data-section]").forEach(function (old) {
          var next = fresh.getElementById(old.id);
          if (!next) return;
          if (old.contains(document.activeElement)) { all = false; return; }  /* not under the user's feet */
          if (old.innerHTML !== next.innerHTML) old.innerHTML = next.innerHTML;
        });
        if (all) head.setAttribute("data-sections", key);
      })
      .catch(function () { /* the next poll tries again */ })
      .then(function () { refreshing = false; });
  }

  function jobPage(head) {
    var data = JSON.parse(document.getElementById("job-data").textContent);
    var main = document.querySelector("main");
    var bar = main.querySelector(".bar-big");
    var last = JSON.stringify(data.series);
    drawPlots(data.series);
    var resized = null;
    window.addEventListener("resize", function () {
      clearTimeout(resized);
      resized = setTimeout(function () { drawPlots(data.series); }, 150);
    });
    poll(head.getAttribute("data-job-live"), function (fresh) {
      data = fresh;
      fill(main, fresh.cells);
      setBar(bar, fresh.progress);
      var now = JSON.stringify(fresh.series);
      if (now !== last) { last = now; drawPlots(fresh.series); pointsTable(fresh.series); }
      if (fresh.sections !== head.getAttribute("data-sections")) refreshSections(head, fresh.sections);
    });
  }

  function fleetPage(head) {
    var main = document.querySelector("main");
    var meter = document.getElementById("broker-meter");
    var empty = main.querySelector("[data-empty]");
    poll(head.getAttribute("data-fleet-live"), function (data) {
      var workers = main.querySelector("[data-workers]");
      var queues = main.querySelector('[data-table="queues"] tbody');
      syncRows(workers, data.workers, document.getElementById("worker-template"), fill);
      syncRows(queues, data.queues, document.getElementById("queue-template"), function (tr, q) {
        fill(tr, q);
        tr.classList.toggle("total", !!q.total);
      });
      var m = data.memory;
      fill(main, { worker_count: data.workers.length, unacked: data.unacked, read_at: data.read_at,
                   used_text: m.used_text, max_text: m.max_text, share: m.share, refuse_text: m.refuse_text });
      if (meter && m.max) { meter.max = m.max; meter.value = m.used; meter.textContent = m.share; }
      if (empty) empty.hidden = data.workers.length > 0;
    });
  }

  function init() {
    var jobs = document.querySelector("table.jobs[data-live]");
    if (jobs) jobsPage(jobs);
    var job = document.querySelector("[data-job-live]");
    if (job) jobPage(job);
    var fleet = document.querySelector("[data-fleet-live]");
    if (fleet) fleetPage(fleet);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", init);
  else init();
})();
