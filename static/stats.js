// Live stats page: renders the server's provenance event stream (GET /v1/stats/events).
//
// The stream opens with a snapshot (the retained events of active and recent requests plus the
// aggregates), which is replayed through the same handlers as live events, so a page opened
// mid-generation shows everything that already happened.
"use strict";

const MAX_PANELS = 20;          // request panels kept on the page (the server keeps as many)
const CHART_POINTS = 120;       // two minutes of one-second samples
const $ = (id) => document.getElementById(id);

const state = {
  requests: new Map(),          // id -> request view (see newRequest)
  samples: [],                  // [{time, tokens_per_s, acceptance_length}]
  sources: new Set(),
  source: null,                 // the EventSource
  askedAdmin: false,            // an admin key was just entered: say so if it was not accepted
};

// --- connection -------------------------------------------------------------------------------

function setStatus(text, cls) {
  const s = $("status");
  s.textContent = text;
  s.className = `status ${cls || ""}`;
}

function connect() {
  if (state.source) state.source.close();
  setStatus("connecting…");
  // the key travels in the whiflash_key cookie (EventSource cannot send an Authorization header)
  const es = new EventSource("/v1/stats/events");
  state.source = es;
  es.onopen = () => { setStatus("live", "live"); $("access").classList.add("hidden"); };
  es.onmessage = (msg) => handle(JSON.parse(msg.data));
  es.onerror = () => {
    if (es.readyState === EventSource.CLOSED) checkAccess();   // refused (401/403): no retry by itself
    else setStatus("reconnecting…", "down");                   // dropped: EventSource retries itself
  };
}

// EventSource hides the HTTP status of a refusal, so ask the snapshot endpoint why.
async function checkAccess() {
  setStatus("disconnected", "down");
  let response;
  try {
    response = await fetch("/v1/stats/snapshot", { headers: WF.getKey() ? WF.authHeaders() : {} });
  } catch {
    setTimeout(connect, 3000);
    return;
  }
  if (response.status === 401 || response.status === 403) {
    const body = await response.json().catch(() => ({}));
    const message = body.error ? body.error.message : `HTTP ${response.status}`;
    const remote = body.error && body.error.code === "loopback_only";  // a key-less server seen from afar
    $("access-message").textContent = response.status === 401
      ? `${message} Enter the server's API key to see the live stream.`
      : remote ? `${message} Enter the admin key (--admin-key), or start the server with --api-key, to view it remotely.`
        : message;
    $("access").classList.remove("hidden");
    $("key-form").classList.toggle("hidden", response.status !== 401 && !remote);
  } else {
    setTimeout(connect, 1000);
  }
}

// --- events -----------------------------------------------------------------------------------

function handle(event) {
  // every retained request's request_started is in the snapshot, so an unknown id is a request that
  // never started (e.g. timed out in the queue): nothing to show
  if (event.id && event.type !== "request_started" && !state.requests.has(event.id)) return undefined;
  switch (event.type) {
    case "snapshot": return onSnapshot(event);
    case "aggregate": return onAggregate(event);
    case "request_started": return onStarted(event);
    case "round": return onRound(event);
    case "tokens": return onTokens(event);
    case "request_finished": return onFinished(event);
    default: return undefined;  // newer server, older page: ignore what we don't know
  }
}

function onSnapshot(snap) {
  // a (re)connect: start over from the server's view
  renderViewer(snap.viewer || {});
  state.requests.clear();
  $("requests").replaceChildren();
  for (const event of snap.events) handle(event);
  state.samples = snap.samples.slice(-CHART_POINTS);
  renderAggregate(snap.aggregate);
  drawCharts();
  updateEmpty();
}

function onAggregate(event) {
  renderAggregate(event.aggregate);
  if (!event.sample) return;   // sent on request start/finish: totals only, no chart point
  state.samples.push(event.sample);
  if (state.samples.length > CHART_POINTS) state.samples.shift();
  drawCharts();
}

function onStarted(e) {
  const r = request(e.id);
  r.hidden = Boolean(e.hidden);  // another viewer's request: its counts, never its text
  r.started = e.time;
  r.method = e.method;
  r.alpha = e.alpha;
  r.maxTokens = e.max_tokens;
  renderRequest(r);
}

function onRound(e) {
  const r = request(e.id);
  r.rounds += 1;
  r.roundTokens += e.decided ?? (e.accepted || 0) + 1;  // tokens the round decided (engine's Round.decided)
  r.last = e.time;
  if (e.drafter) {
    const d = r.drafters[e.drafter] || (r.drafters[e.drafter] = { rounds: 0, accepted: 0, drafted: 0 });
    d.rounds += 1;
    d.accepted += e.accepted || 0;
    d.drafted += e.draft_tokens || 0;
    if (e.switched) r.switches += 1;  // decided by the engine's router (Round.switched)
  }
  r.timeline.append(timelineBar(e));
  renderRequest(r);
}

function onTokens(e) {
  const r = request(e.id);
  const atBottom = r.text.scrollHeight - r.text.scrollTop - r.text.clientHeight < 8;
  const frag = document.createDocumentFragment();
  for (const t of e.tokens) {
    frag.append(e.hidden ? hiddenToken(t.source, e.round) : WF.tokenSpan(t.text, t.source, e.round));
    noteSource(t.source);
  }
  r.text.append(frag);
  r.tokens += e.tokens.length;
  r.last = e.time;
  if (atBottom) r.text.scrollTop = r.text.scrollHeight;
  renderRequest(r);
}

function onFinished(e) {
  const r = request(e.id);
  r.finished = e.time;
  r.last = e.time;
  r.reason = e.finish_reason;
  r.error = e.error || null;
  r.stats = e.stats || null;
  renderRequest(r);
  prune();
}

// A token of another viewer's request: the server sent its source, not its text.
function hiddenToken(source, round) {
  const span = WF.tokenSpan("", source, round);
  span.classList.add("redacted");
  span.title = `round ${round} · ${source} (text hidden: another viewer's request)`;
  return span;
}

// --- who is looking -----------------------------------------------------------------------------

function renderViewer(viewer) {
  $("viewer").textContent = viewer.admin ? "admin: every request's text" : "your requests' text";
  $("privacy").classList.toggle("hidden", Boolean(viewer.admin));
  $("privacy-message").textContent = (state.askedAdmin && !viewer.admin ? "That is not the admin key. " : "") +
    (viewer.identified
      ? "Text is shown for your own requests; other viewers' requests show their counts only. The admin key shows every request's text."
      : "This page has no viewer identity (cookies off?), so requests show their counts only. The admin key shows every request's text.");
  state.askedAdmin = false;
}

// --- per-request panels -----------------------------------------------------------------------

function request(id) {
  let r = state.requests.get(id);
  if (!r) {
    r = newRequest(id);
    state.requests.set(id, r);
    $("requests").prepend(r.panel);   // newest on top
    updateEmpty();
  }
  return r;
}

function newRequest(id) {
  const r = {
    id, started: null, last: null, finished: null, reason: null, error: null, stats: null,
    method: "?", alpha: null, maxTokens: null, hidden: false,
    tokens: 0, rounds: 0, roundTokens: 0, switches: 0, drafters: {},
  };
  r.title = WF.el("span");
  r.numbers = WF.el("div", { class: "kv" });
  r.timeline = WF.el("div", { class: "timeline", "aria-label": "router decisions, one bar per round" });
  r.summary = WF.el("div", { class: "timeline-summary" });
  r.text = WF.el("div", { class: "tokens" });
  r.panel = WF.el("section", { class: "panel req", dataset: { requestId: id } },
    WF.el("header", {}, r.title, WF.el("code", {}, id)),
    r.numbers,
    WF.el("div", { class: "timeline-wrap" },
      WF.el("div", { class: "subhead" }, "Router decisions: one bar per round, coloured by drafter, height = accepted tokens"),
      r.timeline, r.summary),
    r.text);
  return r;
}

function timelineBar(e) {
  const accepted = e.accepted || 0;
  const drafter = e.drafter || "target";
  const bar = WF.el("span", { class: "bar", dataset: { round: String(e.round), drafter } });
  // 8 px for a round with nothing accepted (still visible), 4 px more per accepted token, capped
  bar.style.height = `${Math.min(8 + 4 * accepted, 64)}px`;
  bar.title = e.drafter
    ? `round ${e.round}: ${e.drafter}, ${accepted}/${e.draft_tokens} drafted tokens accepted`
    : `round ${e.round}: no drafter (target only)`;
  WF.paint(bar, drafter);
  return bar;
}

function renderRequest(r) {
  const failed = r.error || r.reason === "error" || r.reason === "timeout";
  const badge = r.finished === null
    ? WF.el("span", { class: "badge" }, "running")
    : WF.el("span", { class: `badge ${failed ? "failed" : "done"}` }, r.reason || "finished");
  r.title.replaceChildren(WF.el("b", {}, r.method), " ",
    WF.el("span", { class: "muted" }, `α ${WF.fmt(r.alpha, 2)}`), " ", badge,
    r.error ? WF.el("span", { class: "error" }, ` ${r.error}`) : "",
    r.hidden ? WF.el("span", { class: "hidden-note" }, " text hidden: another viewer's request") : "");
  r.panel.classList.toggle("finished", r.finished !== null && !failed);
  r.panel.classList.toggle("failed", Boolean(failed));

  // final stats are the engine's own numbers; until then, what the events add up to
  const s = r.stats || {};
  const acceptance = s.acceptance_length ?? (r.rounds ? r.roundTokens / r.rounds : null);
  const seconds = r.started !== null && r.last !== null ? r.last - r.started : 0;
  const tps = seconds > 0.05 ? r.tokens / seconds : null;
  r.numbers.replaceChildren(
    kv("tokens", r.maxTokens ? `${r.tokens} / ${r.maxTokens}` : r.tokens, "completion tokens / max_tokens"),
    kv("acceptance length", WF.fmt(acceptance, 2), "tokens decided per target forward (1 = no speedup)"),
    kv("tokens/s", WF.fmt(tps, 1), "completion tokens per second since the request started"),
    kv("rounds", s.rounds ?? r.rounds),
    kv("switches", s.switches ?? r.switches, "rounds whose drafter differs from the previous round's"),
  );
  r.summary.textContent = Object.entries(r.drafters)
    .map(([name, d]) => `${name}: ${d.rounds} rounds, ${d.accepted}/${d.drafted} accepted`)
    .join(" · ") || (r.rounds ? "no drafter: every round is one target forward" : "");
}

function kv(label, value, title) {
  const div = WF.el("div", title ? { title } : {}, WF.el("span", {}, label), WF.el("b", {}, String(value)));
  return div;
}

function prune() {
  const finished = [...state.requests.values()].filter((r) => r.finished !== null);
  while (state.requests.size > MAX_PANELS && finished.length) {
    const oldest = finished.shift();   // Map order = arrival order
    oldest.panel.remove();
    state.requests.delete(oldest.id);
  }
}

function updateEmpty() {
  $("empty").classList.toggle("hidden", state.requests.size > 0);
}

function noteSource(source) {
  if (!state.sources.has(source)) {
    state.sources.add(source);
    WF.renderLegend($("legend"), [...state.sources]);
  }
}

// --- aggregates -------------------------------------------------------------------------------

function renderAggregate(a) {
  for (const s of Object.keys(a.tokens_by_source)) noteSource(s);
  $("totals").replaceChildren(
    kv("requests", `${a.requests} (${a.active} active)`),
    kv("tokens", a.tokens),
    kv("rounds", a.rounds),
    kv("acceptance length", WF.fmt(a.acceptance_length, 2)),
    kv("switches", a.switches),
    kv("switches / 100 tokens", WF.fmt(a.switches_per_100_tokens, 2)),
  );
  const entries = Object.entries(a.tokens_by_source).sort((x, y) => y[1] - x[1]);
  $("source-bar").replaceChildren(...entries.map(([source, n]) => {
    const seg = WF.el("span", { title: `${source}: ${n}`, dataset: { source } });
    seg.style.flexGrow = String(n);
    WF.paint(seg, source);
    return seg;
  }));
  $("source-counts").replaceChildren(...entries.map(([source, n]) =>
    kv(source, `${n} (${WF.fmt((100 * n) / Math.max(a.tokens, 1), 1)}%)`)));
  const drafters = Object.entries(a.drafters);
  $("drafters").replaceChildren(...(drafters.length ? drafters.map(([name, d]) =>
    kv(name, WF.fmt(d.acceptance_length, 2), `${d.rounds} rounds, ${d.accepted_tokens}/${d.draft_tokens} accepted`))
    : [WF.el("span", { class: "muted" }, "no speculative rounds yet")]));
}

// --- charts: plain canvas, two series, one per chart ---------------------------------------------

function drawCharts() {
  const tps = state.samples.map((s) => s.tokens_per_s);
  const al = state.samples.map((s) => s.acceptance_length);
  drawChart($("chart-tps"), tps, "#0969da", 1);
  drawChart($("chart-al"), al, "#d4561c", 2);
  $("now-tps").textContent = WF.fmt(lastValue(tps), 1);
  $("now-al").textContent = WF.fmt(lastValue(al), 2);
}

function lastValue(values) {
  for (let i = values.length - 1; i >= 0; i--) if (values[i] !== null && values[i] !== undefined) return values[i];
  return null;
}

function drawChart(canvas, values, colour, minTop) {
  // size the backing store to the displayed size so lines stay crisp on any screen
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width;
  const h = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(w * dpr)) canvas.width = Math.round(w * dpr);
  if (canvas.height !== Math.round(h * dpr)) canvas.height = Math.round(h * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);

  const pad = { left: 40, right: 8, top: 10, bottom: 8 };
  const plotW = w - pad.left - pad.right;
  const plotH = h - pad.top - pad.bottom;
  const present = values.filter((v) => v !== null && v !== undefined);
  const top = Math.max(minTop, ...present) * 1.2;
  const x = (i) => pad.left + plotW * (1 - (values.length - 1 - i) / (CHART_POINTS - 1));
  const y = (v) => pad.top + plotH * (1 - v / top);

  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#656d76";
  ctx.strokeStyle = "#d8dee4";
  ctx.lineWidth = 1;
  for (const v of [0, top / 2, top]) {       // three gridlines with their values
    ctx.beginPath();
    ctx.moveTo(pad.left, Math.round(y(v)) + 0.5);
    ctx.lineTo(w - pad.right, Math.round(y(v)) + 0.5);
    ctx.stroke();
    ctx.fillText(v.toFixed(v >= 10 ? 0 : 1), 4, y(v) + 4);
  }
  if (!present.length) {
    ctx.fillText("waiting for data…", pad.left + 8, pad.top + plotH / 2);
    return;
  }

  // the line, broken where a sample has no value (no speculative round in that window)
  ctx.strokeStyle = colour;
  ctx.lineWidth = 1.8;
  ctx.beginPath();
  let drawing = false;
  values.forEach((v, i) => {
    if (v === null || v === undefined) { drawing = false; return; }
    if (drawing) ctx.lineTo(x(i), y(v)); else ctx.moveTo(x(i), y(v));
    drawing = true;
  });
  ctx.stroke();
  // a dot on the newest value, so a single sample is visible too
  const i = values.length - 1;
  if (values[i] !== null && values[i] !== undefined) {
    ctx.fillStyle = colour;
    ctx.beginPath();
    ctx.arc(x(i), y(values[i]), 3, 0, 2 * Math.PI);
    ctx.fill();
  }
}

// --- start ------------------------------------------------------------------------------------

WF.renderLegend($("legend"));
WF.keyForm($("key-form"), connect);
$("admin-form").addEventListener("submit", (e) => {
  e.preventDefault();
  WF.setKey($("admin-key").value.trim());  // kept where an API key is (the admin key is one too)
  state.askedAdmin = true;
  connect();
});
window.addEventListener("resize", drawCharts);
connect();
