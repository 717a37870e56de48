// Chat page: streams /v1/chat/completions with fetch() and shows where every token came from.
//
// Text deltas arrive uncoloured (a delta may hold part of a token or several tokens); the final
// chunk's `speculation.tokens` (requested with trace: true) carries each token's source and round,
// and the answer is then re-rendered coloured from it.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];        // the OpenAI messages sent so far
let controller = null;          // AbortController of the running request
let servedModel;                // the id /v1/models lists first (other names are 404s)

// --- setup ------------------------------------------------------------------------------------

async function loadOptions() {
  const response = await fetch("/v1/speculation/methods", { headers: WF.authHeaders() });
  if (!response.ok) {
    await showError(response);
    return;
  }
  $("access").classList.add("hidden");
  const info = await response.json();
  const select = $("method");
  select.replaceChildren(...info.methods.map((m) => WF.el("option", { value: m }, m)));
  select.value = info.default;
  $("alpha").value = info.alpha;
  syncControls();
  const models = await fetch("/v1/models", { headers: WF.authHeaders() }).then((r) => r.json()).catch(() => null);
  if (models && models.data && models.data[0]) $("model").textContent = servedModel = models.data[0].id;
}

function syncControls() {
  $("alpha-value").textContent = Number($("alpha").value).toFixed(2);
  // alpha only steers the whiflash router; keep it visible but say so
  $("alpha").disabled = $("method").value !== "whiflash";
}

async function showError(response, target) {
  const body = await response.json().catch(() => ({}));
  const message = body.error ? body.error.message : `HTTP ${response.status}`;
  if (response.status === 401) {
    $("access-message").textContent = `${message} Enter the server's API key.`;
    $("access").classList.remove("hidden");
  }
  if (target) target.append(WF.el("div", { class: "error" }, message));
}

// --- conversation view ------------------------------------------------------------------------

function addUserMessage(text) {
  $("conversation").append(WF.el("div", { class: "msg user" }, text));
}

function addAssistantMessage() {
  const answer = WF.el("div", { class: "answer streaming" });
  const meta = WF.el("div", { class: "meta hidden" });
  const box = WF.el("div", { class: "msg assistant" }, answer, meta);
  $("conversation").append(box);
  box.scrollIntoView({ block: "end" });
  return { box, answer, meta, content: "" };
}

function colourAnswer(view, tokens) {
  view.answer.replaceChildren(...tokens.map((t) => WF.tokenSpan(t.text, t.source, t.round)));
  const extra = [...new Set(tokens.map((t) => t.source))];
  WF.renderLegend($("legend"), extra);
}

function showStats(view, stats, finishReason, usage, wallSeconds) {
  const timing = stats.timing || {};
  const tokens = usage ? usage.completion_tokens : (stats.tokens || []).length;
  const engineSeconds = timing.total_s || 0;
  const drafters = Object.entries(stats.drafters || {})
    .map(([name, d]) => `${name} ${d.accepted_tokens}/${d.draft_tokens} accepted in ${d.rounds} rounds`)
    .join(" · ");
  const item = (label, value, title) =>
    WF.el("div", title ? { title } : {}, WF.el("span", {}, label), WF.el("b", {}, String(value)));
  view.meta.replaceChildren(
    WF.el("div", { class: "kv" },
      item("method", stats.method),
      item("α", WF.fmt(Number($("alpha").value), 2), "the alpha sent with this request"),
      item("tokens", tokens),
      item("acceptance length", WF.fmt(stats.acceptance_length, 2), "tokens decided per target forward"),
      item("tokens/s", WF.fmt(engineSeconds ? tokens / engineSeconds : null, 1), "engine time, prefill included"),
      item("rounds", stats.rounds),
      item("switches", stats.switches),
      item("finish", finishReason || "?"),
      item("wall", `${WF.fmt(wallSeconds, 2)} s`, "as seen by this page")),
    drafters ? WF.el("div", { class: "muted" }, drafters) : "");
  view.meta.classList.remove("hidden");
}

// --- streaming --------------------------------------------------------------------------------

// Yields the `data:` payload of each server-sent event in a fetch() body.
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer = (buffer + value).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n")
        .filter((line) => line.startsWith("data:"))      // skips ": ping" comments
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}

function requestBody() {
  const method = $("method").value;
  const speculation = { trace: true };
  if (method) speculation.method = method;
  if (method === "whiflash") speculation.alpha = Number($("alpha").value);
  return {
    model: servedModel,
    messages: conversation,
    stream: true,
    stream_options: { include_usage: true },
    max_tokens: Number($("max-tokens").value) || undefined,
    temperature: Number($("temperature").value),
    speculation,
  };
}

async function send(text) {
  conversation.push({ role: "user", content: text });
  addUserMessage(text);
  const view = addAssistantMessage();
  setBusy(true);
  controller = new AbortController();
  const t0 = performance.now();
  let stats = null, usage = null, finishReason = null;
  try {
    // same-origin: the browser adds this page's whiflash_viewer cookie, so the stats page shows
    // this browser the text of its own requests (and others only their counts)
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...WF.authHeaders() },
      body: JSON.stringify(requestBody()),
      signal: controller.signal,
    });
    if (!response.ok) {
      conversation.pop();   // not answered: don't send it again with the next turn
      await showError(response, view.answer);
      return;
    }
    for await (const data of sseData(response.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) {   // failures after the 200 arrive in-stream
        view.answer.append(WF.el("div", { class: "error" }, chunk.error.message));
        break;
      }
      const choice = chunk.choices && chunk.choices[0];
      if (choice && choice.delta && choice.delta.content) {
        view.content += choice.delta.content;
        view.answer.append(choice.delta.content);
        view.box.scrollIntoView({ block: "end" });
      }
      if (choice && choice.finish_reason) finishReason = choice.finish_reason;
      if (chunk.usage) usage = chunk.usage;
      if (chunk.speculation) stats = chunk.speculation;
    }
    if (stats && stats.tokens) colourAnswer(view, stats.tokens);
    if (stats) showStats(view, stats, finishReason, usage, (performance.now() - t0) / 1000);
    conversation.push({ role: "assistant", content: view.content });
  } catch (err) {
    if (err.name === "AbortError") {
      view.answer.append(WF.el("span", { class: "muted" }, " [stopped]"));
      conversation.push({ role: "assistant", content: view.content });
    } else {
      view.answer.append(WF.el("div", { class: "error" }, String(err)));
    }
  } finally {
    view.answer.classList.remove("streaming");
    setBusy(false);
    controller = null;
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// --- start ------------------------------------------------------------------------------------

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  conversation.length = 0;
  $("conversation").replaceChildren();
});
$("method").addEventListener("change", syncControls);
$("alpha").addEventListener("input", syncControls);
WF.keyForm($("key-form"), loadOptions);
WF.renderLegend($("legend"));
loadOptions();
