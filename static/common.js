// Shared by the chat and stats pages: source colours, token rendering, legend, API key handling.
"use strict";

const WF = (() => {
  // Fixed colours for the known sources; anything else (a future drafter kind) gets a colour
  // derived from its name, so it is stable across reloads and pages.
  const KNOWN = {
    eagle3: { fg: "#1f6feb", bg: "#dbe9ff" },
    dflash: { fg: "#d4561c", bg: "#ffe3d3" },
    ngram: { fg: "#1a7f37", bg: "#dafbe1" },
    target: { fg: "#8c959f", bg: "#eef0f2" },
  };
  const KEY_STORAGE = "whiflash_key";
  const KEY_COOKIE = "whiflash_key";

  function hash(text) {
    let h = 0;
    for (const ch of text) h = (h * 31 + ch.codePointAt(0)) >>> 0;
    return h;
  }

  function colour(source) {
    if (!source) return KNOWN.target;
    if (KNOWN[source]) return KNOWN[source];
    const hue = (hash(source) * 137) % 360;  // spread similar names apart
    KNOWN[source] = { fg: `hsl(${hue} 65% 42%)`, bg: `hsl(${hue} 80% 90%)` };
    return KNOWN[source];
  }

  function paint(el, source) {
    const c = colour(source);
    el.style.setProperty("--tok-fg", c.fg);
    el.style.setProperty("--tok-bg", c.bg);
  }

  // One generated token. textContent, never innerHTML: model output is untrusted text.
  function tokenSpan(text, source, round) {
    const span = document.createElement("span");
    span.className = "tok";
    span.textContent = text;
    span.dataset.source = source;
    span.dataset.round = String(round);
    span.title = `round ${round} · ${source}`;
    paint(span, source);
    return span;
  }

  // Legend entries for every source seen so far (known ones always listed first).
  function renderLegend(container, extraSources = []) {
    const sources = ["target", "eagle3", "dflash", ...extraSources.filter((s) => !(s in { target: 1, eagle3: 1, dflash: 1 }))];
    container.replaceChildren(...sources.map((s) => {
      const item = document.createElement("span");
      item.dataset.legend = s;
      const sw = document.createElement("span");
      sw.className = "swatch";
      paint(sw, s);
      item.append(sw, s === "target" ? "target (verifier's own token)" : `${s} (accepted draft)`);
      return item;
    }));
  }

  // --- API key: kept in localStorage for fetch() headers, mirrored into a cookie because
  // EventSource cannot send headers. SameSite=Strict keeps other sites from riding on it.
  function getKey() {
    return localStorage.getItem(KEY_STORAGE) || "";
  }

  function setKey(key) {
    if (key) {
      localStorage.setItem(KEY_STORAGE, key);
      document.cookie = `${KEY_COOKIE}=${encodeURIComponent(key)}; path=/; SameSite=Strict`;
    } else {
      localStorage.removeItem(KEY_STORAGE);
      document.cookie = `${KEY_COOKIE}=; path=/; max-age=0; SameSite=Strict`;
    }
  }

  function authHeaders() {
    // the server ignores the header when it has no key; "none" mirrors the openai client's habit
    return { Authorization: `Bearer ${getKey() || "none"}` };
  }

  // Wire a key form: calls onKey() after the user saves a key.
  function keyForm(form, onKey) {
    const input = form.querySelector("input");
    input.value = getKey();
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      setKey(input.value.trim());
      onKey();
    });
  }

  function fmt(value, digits = 2) {
    if (value === null || value === undefined || Number.isNaN(value)) return "–";
    return Number(value).toFixed(digits);
  }

  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs)) {
      if (k === "class") node.className = v;
      else if (k === "dataset") Object.assign(node.dataset, v);
      else node.setAttribute(k, v);
    }
    node.append(...children);
    return node;
  }

  return { colour, paint, tokenSpan, renderLegend, getKey, setKey, authHeaders, keyForm, fmt, el };
})();
