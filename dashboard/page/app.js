// Narwhal fleet page. Every string it shows comes from the bus and is
// hostile input: it is only ever set as textContent (or a title, or a
// data attribute), never parsed as HTML. The page sends nothing but GET
// requests: the event stream and its own files.
"use strict";

(function () {
  const WINDOW_MS = 15 * 60 * 1000; // the strips' span
  const STALE_MS = 3000; // no snapshot for this long: the page says so
  let last = null; // the last snapshot
  let lastAt = 0; // when it arrived (browser clock)
  let skew = 0; // dashboard clock minus browser clock, ms

  // el makes an element with a class and text (textContent: never HTML).
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }

  function cell(row, text, cls) {
    const td = el("td", cls, text);
    row.appendChild(td);
    return td;
  }

  function now() { return Date.now() + skew; }

  function seconds(v) {
    if (v === null || v === undefined) return "–";
    if (v < 0.001) return Math.round(v * 1e6) + " µs";
    if (v < 1) return (v * 1000).toFixed(v < 0.01 ? 1 : 0) + " ms";
    return v.toFixed(2) + " s";
  }

  function ago(iso) {
    const d = Math.max(0, now() - Date.parse(iso)) / 1000;
    if (d < 60) return Math.round(d) + " s ago";
    if (d < 3600) return Math.round(d / 60) + " min ago";
    return Math.round(d / 3600) + " h ago";
  }

  function inFuture(iso) {
    const d = Math.max(0, Date.parse(iso) - now()) / 1000;
    if (d < 60) return Math.round(d) + " s";
    if (d < 3600) return Math.round(d / 60) + " min";
    return Math.round(d / 3600) + " h";
  }

  function clock(iso) {
    const d = new Date(iso);
    return isNaN(d) ? "–" : d.toLocaleTimeString([], { hour12: false });
  }

  function fill(tableId, rows, build) {
    const body = document.querySelector("#" + tableId + " tbody");
    const out = [];
    for (const r of rows) out.push(build(r));
    body.replaceChildren(...out);
    document.getElementById(tableId + "-empty").hidden = rows.length > 0;
  }

  function why(e) {
    const parts = [];
    if (e.state === "quarantined" && e.quarantined_until) parts.push("quarantined for " + inFuture(e.quarantined_until));
    if (e.reason) parts.push(e.reason);
    if (e.probe && e.state !== "eligible") {
      let p = "last probe " + e.probe.outcome + " " + ago(e.probe.at);
      if (e.probe.message) p += ": " + e.probe.message;
      parts.push(p);
    }
    if (e.fleet && e.fleet !== "active") parts.push("fleet: " + e.fleet);
    return parts.join(" · ");
  }

  function renderEngines(s) {
    fill("engines", s.engines, (e) => {
      const tr = el("tr", e.state === "ejected" ? "row-ejected" : "");
      tr.dataset.engine = e.id;
      tr.dataset.state = e.state;
      cell(tr, e.id, "id");
      cell(tr, e.role || "?");
      const st = cell(tr, "");
      st.appendChild(el("span", "badge s-" + e.state, e.state));
      cell(tr, e.streak, "num");
      cell(tr, e.inflight, "num");
      cell(tr, seconds(e.ttft_s), "num");
      cell(tr, seconds(e.first_byte_s), "num");
      cell(tr, seconds(e.itl_s), "num");
      cell(tr, e.failures, "num");
      cell(tr, why(e), "why");
      return tr;
    });
  }

  function renderRouters(s) {
    fill("routers", s.routers, (r) => {
      const tr = el("tr");
      cell(tr, r.id, "id");
      cell(tr, r.request_rate.toFixed(1), "num");
      const err = cell(tr, (r.error_rate * 100).toFixed(1) + " %", "num");
      if (r.error_rate > 0) err.classList.add("s-ejected");
      cell(tr, r.inflight, "num");
      cell(tr, r.requests + (r.errors ? " (" + r.errors + " 5xx)" : ""), "num");
      return tr;
    });
  }

  function renderFaults(s) {
    fill("chaos", s.faults, (f) => {
      const tr = el("tr");
      cell(tr, f.engine_id, "id");
      cell(tr, f.fault_id === f.fault ? f.fault : f.fault + " (" + f.fault_id + ")");
      cell(tr, f.phase);
      cell(tr, f.probability, "num");
      cell(tr, f.count > 0 ? f.left + " of " + f.count : "unlimited", "num");
      cell(tr, f.params || "", "msg");
      cell(tr, "in " + inFuture(f.expires), "num");
      return tr;
    });
  }

  function renderFailures(s) {
    fill("failures", s.failures, (f) => {
      const tr = el("tr");
      const when = cell(tr, clock(f.at));
      when.title = f.at;
      cell(tr, f.engine_id, "id");
      cell(tr, f.phase);
      cell(tr, f.kind + (f.counts ? "" : " (not counted)"));
      cell(tr, f.status, "num");
      cell(tr, f.message, "msg");
      cell(tr, f.router_id || "", "id");
      return tr;
    });
  }

  function renderTimeline(s) {
    const list = document.getElementById("timeline");
    const items = s.timeline.map((t) => {
      const li = el("li");
      li.dataset.engine = t.engine_id;
      li.dataset.what = t.what;
      const when = el("span", "when", clock(t.at));
      when.title = t.at;
      li.appendChild(when);
      li.appendChild(el("span", "what w-" + t.what, t.what));
      li.appendChild(el("span", "id", t.engine_id));
      if (t.reason) li.appendChild(el("span", "reason", t.reason));
      return li;
    });
    list.replaceChildren(...items);
    document.getElementById("timeline-empty").hidden = items.length > 0;
    renderStrips(s);
  }

  // renderStrips draws, per engine, the last 15 minutes: red where it was
  // ejected, a mark at each quarantine.
  function renderStrips(s) {
    const end = now();
    const start = end - WINDOW_MS;
    const pct = (t) => ((Math.min(Math.max(t, start), end) - start) / WINDOW_MS) * 100;
    const byEngine = new Map();
    for (const t of s.timeline.slice().reverse()) { // oldest first
      if (!byEngine.has(t.engine_id)) byEngine.set(t.engine_id, []);
      byEngine.get(t.engine_id).push(t);
    }
    const nodes = [];
    for (const e of s.engines) {
      const strip = el("div", "strip");
      strip.title = e.id;
      let outSince = null;
      let seen = false;
      const add = (from, to) => {
        const d = el("div", "out");
        d.style.left = pct(from) + "%";
        d.style.width = Math.max(pct(to) - pct(from), 0.4) + "%";
        strip.appendChild(d);
      };
      for (const t of byEngine.get(e.id) || []) {
        const at = Date.parse(t.at);
        if (t.what === "ejected") {
          if (outSince === null) outSince = at;
          seen = true;
        } else if (t.what === "readmitted" || t.what === "eligible") {
          if (outSince !== null) add(outSince, at);
          else if (!seen && t.what === "readmitted" && at > start) add(start, at); // ejected before the window
          outSince = null;
          seen = true;
        } else if (t.what === "quarantined" && at >= start) {
          const m = el("div", "mark");
          m.style.left = pct(at) + "%";
          strip.appendChild(m);
        }
      }
      if (outSince !== null) add(outSince, end);
      else if (!seen && e.state === "ejected") add(start, end);
      nodes.push(el("span", "label", e.id), strip);
    }
    document.getElementById("strips").replaceChildren(...nodes);
  }

  function renderStatus() {
    const status = document.getElementById("status");
    let text, cls;
    if (!last) {
      text = "connecting…"; cls = "stale";
    } else if (Date.now() - lastAt > STALE_MS) {
      text = "no update for " + Math.round((Date.now() - lastAt) / 1000) + " s"; cls = "stale";
    } else if (!last.bus.connected) {
      text = "bus disconnected"; cls = "down";
    } else {
      text = "live"; cls = "live";
    }
    if (status.textContent !== text) status.textContent = text;
    status.className = "status " + cls;
    if (last) status.title = "bus " + last.bus.url;
  }

  function render(s) {
    renderEngines(s);
    renderRouters(s);
    renderFaults(s);
    renderFailures(s);
    renderTimeline(s);
    const counts = {};
    for (const e of s.engines) counts[e.state] = (counts[e.state] || 0) + 1;
    const parts = [s.engines.length + " engines"];
    for (const k of Object.keys(counts).sort()) parts.push(counts[k] + " " + k);
    let rate = 0;
    for (const r of s.routers) rate += r.request_rate;
    parts.push(rate.toFixed(1) + " requests/s");
    document.getElementById("summary").textContent = parts.join(" · ");
    document.getElementById("ignored").textContent =
      s.ignored > 0 ? s.ignored + " bus values were not valid and are not shown." : "every value seen was valid.";
    renderStatus();
  }

  function connect() {
    const es = new EventSource("/events");
    es.addEventListener("state", (m) => {
      let s;
      try { s = JSON.parse(m.data); } catch (err) { return; }
      last = s;
      lastAt = Date.now();
      skew = Date.parse(s.at) - lastAt || 0;
      render(s);
    });
    es.onerror = () => renderStatus(); // EventSource reconnects by itself
  }

  function setLarge(on) {
    document.documentElement.classList.toggle("large", on);
    const b = document.getElementById("large");
    b.setAttribute("aria-pressed", on ? "true" : "false");
    try { localStorage.setItem("narwhal-large", on ? "1" : "0"); } catch (err) { /* private mode */ }
  }

  document.addEventListener("DOMContentLoaded", () => {
    const params = new URLSearchParams(location.search);
    let large = params.has("large");
    try { large = large || localStorage.getItem("narwhal-large") === "1"; } catch (err) { /* private mode */ }
    setLarge(large);
    document.getElementById("large").addEventListener("click", () =>
      setLarge(!document.documentElement.classList.contains("large")));
    document.addEventListener("keydown", (ev) => {
      if ((ev.key === "l" || ev.key === "L") && !ev.ctrlKey && !ev.metaKey && !ev.altKey) {
        setLarge(!document.documentElement.classList.contains("large"));
      }
    });
    setInterval(renderStatus, 1000);
    connect();
  });
})();
