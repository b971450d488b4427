// The flowrt run viewer: the run list (/ui) and a run's page (/ui/runs/ID), over the JSON API in /ui/api.
"use strict";

const KEY = "flowrt-api-key";
const $ = (sel) => document.querySelector(sel);
const SVG = "http://www.w3.org/2000/svg";

function el(tag, attrs = {}, ...children) {
  const e = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}

function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, opts = {}) {
  const res = await fetch(`/ui/api${path}`, { ...opts, headers: headers(opts.headers) });
  if (res.status === 401) askKey();
  const body = await res.json().catch(() => ({}));
  if (!res.ok) throw new ApiError(res.status, body.detail || (body.error && body.error.message) || res.statusText);
  return body;
}

function askKey() {
  const form = $("#keyform");
  form.hidden = false;
  form.onsubmit = (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, $("#key").value);
    location.reload();
  };
}

function say(text, ok = false) {
  const m = $("#message");
  m.textContent = text;
  m.className = ok ? "message ok" : "message";
  m.hidden = !text;
}

const fmtTime = (t) => (t ? new Date(t * 1000).toLocaleString() : "");
function fmtDuration(s) {
  if (s === null || s === undefined) return "";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
}
const fmtTokens = (t) => `${t.llm_calls} calls · ${t.prompt_tokens} / ${t.cached_tokens} / ${t.generated_tokens}`;
const show = (v) => (typeof v === "string" ? v : JSON.stringify(v, null, 2));

// ---------------------------------------------------------------- the run list
async function listView() {
  $("#list-view").hidden = false;
  const params = new URLSearchParams(location.search);
  const filter = $("#status-filter");
  filter.value = params.get("status") || "";
  filter.onchange = () => {
    const q = filter.value ? `?status=${encodeURIComponent(filter.value)}` : "";
    history.replaceState(null, "", `/ui${q}`);
    refreshList();
  };
  await refreshList();
  setInterval(refreshList, 2000);
}

async function refreshList() {
  const status = $("#status-filter").value;
  let data;
  try {
    data = await api(`/runs${status ? `?status=${encodeURIComponent(status)}` : ""}`);
  } catch (e) { say(e.message); return; }
  say("");
  $("#counts").textContent = Object.entries(data.counts)
    .map(([k, n]) => `${n} ${k === "interrupted" ? "waiting for an answer" : k}`).join(" · ") || "no runs yet";
  const body = $("#runs tbody");
  body.replaceChildren(...data.runs.map((r) => el("tr", { id: `run-${r.run_id}`, "data-status": r.status,
      onclick: () => { location.href = `/ui/runs/${r.run_id}`; } },
    el("td", { class: "mono" }, el("a", { href: `/ui/runs/${r.run_id}`, text: r.run_id })),
    el("td", {}, el("span", { class: `badge ${r.status}`, text: r.status === "interrupted" ? "waiting" : r.status })),
    el("td", { text: r.workflow }),
    el("td", { text: fmtTime(r.started) }),
    el("td", { text: fmtDuration(r.duration) }),
    el("td", { class: "mono", text: fmtTokens(r.tokens) }))));
  if (!data.runs.length) body.append(el("tr", {}, el("td", { colspan: 6, class: "muted", text: "no runs" })));
}

// ---------------------------------------------------------------- a run's page
const open = new Set();   // step cards the user opened (kept across live updates)
let runId = null;
let stream = null;

async function runView(id) {
  runId = id;
  $("#run-view").hidden = false;
  $("#run-title").textContent = id;
  follow();
}

// The run's Server-Sent Events, read with fetch (EventSource cannot send the API key).
async function follow() {
  if (stream) stream.abort();
  const ctrl = new AbortController();
  stream = ctrl;
  $("#live").hidden = false;
  try {
    const res = await fetch(`/ui/api/runs/${runId}/events`, { headers: headers(), signal: ctrl.signal });
    if (res.status === 401) askKey();
    if (!res.ok) {
      const body = await res.json().catch(() => ({}));
      throw new Error(body.detail || (body.error && body.error.message) || res.statusText);
    }
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const chunk = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const kind = (chunk.match(/^event: (.*)$/m) || [])[1];
        const data = chunk.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (kind === "run") render(JSON.parse(data));
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") say(e.message);
  } finally {
    if (stream === ctrl) $("#live").hidden = true;
  }
}

function render(d) {
  const r = d.run;
  const status = $("#run-status");
  status.textContent = r.status === "interrupted" ? "waiting for an answer" : r.status;
  status.className = `badge ${r.status}`;
  status.dataset.status = r.status;
  const bits = [r.workflow, `started ${fmtTime(r.started)}`, fmtDuration(r.duration), fmtTokens(r.tokens)];
  if (r.forked_from) bits.push(`forked from ${r.forked_from.run_id} at ${r.forked_from.at}`);
  $("#run-meta").textContent = bits.join(" · ");
  renderInterrupts(r);
  renderGraph(d.graph, d.steps);
  renderSteps(d.steps);
  renderForks(d.forks);
  renderHistory(d.history, r);
}

function renderInterrupts(r) {
  const box = $("#interrupts");
  box.replaceChildren(...r.interrupts.map((i, n) => {
    const input = el("input", { type: "text", id: n === 0 ? "answer-input" : `answer-input-${n}`,
      placeholder: "your answer (JSON, or plain text)" });
    const form = el("form", { onsubmit: (ev) => { ev.preventDefault(); answer(r, i, input.value); } },
      input, el("button", { type: "submit", class: "primary", id: n === 0 ? "answer-submit" : null, text: "Answer" }));
    return el("div", { class: "interrupt", "data-step": i.step },
      el("div", {}, el("strong", { text: `${i.step} asks:` })), el("pre", { text: show(i.payload) }), form);
  }));
}

function parseAnswer(text) {
  try { return JSON.parse(text); } catch { return text; }
}

async function answer(r, interrupt, text) {
  const value = parseAnswer(text);
  const body = r.interrupts.length > 1 ? { answers: { [interrupt.step]: value } } : { answer: value };
  try {
    await api(`/runs/${r.run_id}/answer`, { method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json" } });
    say(`Answered ${interrupt.step}: the run goes on.`, true);
    follow();
  } catch (e) { say(e.message); }
}

function renderGraph(g, steps) {
  const box = $("#graph");
  if (!g) { box.replaceChildren(el("p", { class: "muted", text: "The workflow's file cannot be loaded here: no graph." })); return; }
  const state = Object.fromEntries(steps.map((s) => [s.step, s.state]));
  const svg = el("svg:svg", { viewBox: `0 0 ${g.width} ${g.height}`, width: g.width, height: g.height });
  svg.append(el("svg:defs", {}, el("svg:marker", { id: "arrow", viewBox: "0 0 10 10", refX: 9, refY: 5,
    markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" }, el("svg:path", { d: "M0,0 L10,5 L0,10 z", fill: "#8e8e96" }))));
  for (const c of g.clusters) {
    svg.append(el("svg:g", { class: "cluster" }, el("svg:rect", { x: c.x, y: c.y, width: c.w, height: c.h }),
      el("svg:text", { x: c.x + 8, y: c.y + 13, text: c.label })));
  }
  const at = Object.fromEntries(g.nodes.map((n) => [n.id, n]));
  for (const e of g.edges) {
    const a = at[e.source], b = at[e.target];
    if (!a || !b) continue;
    let d;
    if (b.y > a.y) {
      const x1 = a.x + a.w / 2, y1 = a.y + a.h, x2 = b.x + b.w / 2, y2 = b.y, m = (y1 + y2) / 2;
      d = `M${x1},${y1} C${x1},${m} ${x2},${m} ${x2},${y2}`;
    } else {   // a loop back up: around the right side
      const x1 = a.x + a.w, y1 = a.y + a.h / 2, x2 = b.x + b.w, y2 = b.y + b.h / 2;
      const out = Math.max(x1, x2) + 40;
      d = `M${x1},${y1} C${out},${y1} ${out},${y2} ${x2},${y2}`;
    }
    svg.append(el("svg:path", { class: `edge ${e.kind}`, d, "marker-end": "url(#arrow)" }));
  }
  for (const n of g.nodes) {
    const st = n.kind === "input" ? null : (state[n.id] || "pending");
    const name = n.kind === "input" ? n.id : n.id.split("/").pop();
    const node = el("svg:g", { class: `node ${n.kind}${st ? ` st-${st}` : ""}`, "data-step": n.id, "data-state": st,
      onclick: () => focusStep(n.id) },
      el("svg:title", { text: `${n.label}${st ? ` — ${st}` : ""}` }),
      el("svg:rect", { x: n.x, y: n.y, width: n.w, height: n.h }),
      el("svg:text", { x: n.x + n.w / 2, y: n.y + (st ? 18 : n.h / 2 + 4), "text-anchor": "middle", "font-weight": st ? 600 : 400, text: name }));
    if (st) node.append(el("svg:text", { x: n.x + n.w / 2, y: n.y + 34, "text-anchor": "middle", fill: "#6b6b70", text: st }));
    svg.append(node);
  }
  box.replaceChildren(svg);
}

function focusStep(path) {
  const card = document.getElementById(`step-${path}`);
  if (!card) return;
  card.open = true;
  open.add(path);
  card.scrollIntoView({ behavior: "smooth", block: "center" });
  card.classList.add("flash");
  setTimeout(() => card.classList.remove("flash"), 1200);
}

function renderCall(c, i) {
  const nums = [`${c.kind}`, c.thread_id !== undefined ? `thread #${c.thread_id}` : null,
    `prompt ${c.prompt_tokens ?? "?"} tokens`, `cached ${c.cached_tokens ?? 0}`,
    `generated ${c.generated_tokens ?? 0}`, fmtDuration(c.seconds), c.finish_reason ? `(${c.finish_reason})` : null]
    .filter(Boolean).join(" · ");
  return el("div", { class: "call" },
    el("div", { class: "nums", text: `call ${i + 1}: ${nums}` }),
    c.error ? el("div", { class: "error" }, el("pre", { text: c.error })) : null,
    el("details", {}, el("summary", { text: "prompt" }), el("pre", { text: c.prompt ?? "" })),
    c.output ? el("div", {}, el("div", { class: "muted", text: "output" }), el("pre", { text: c.output })) : null);
}

function renderSteps(steps) {
  const box = $("#steps");
  box.replaceChildren(...steps.map((s) => {
    const card = el("details", { class: `step st-${s.state}`, id: `step-${s.step}`, "data-state": s.state,
      open: open.has(s.step) ? "" : null,
      ontoggle: (ev) => { if (ev.target.open) open.add(s.step); else open.delete(s.step); } },
      el("summary", {}, el("span", { class: "name", text: s.step }), el("span", { class: `badge`, text: s.state }),
        el("span", { class: "muted", text: [s.seconds !== null && s.seconds !== undefined ? fmtDuration(s.seconds) : "",
          s.calls.length ? `${s.calls.length} LLM call${s.calls.length > 1 ? "s" : ""}` : "",
          s.visits > 1 ? `${s.visits} visits` : ""].filter(Boolean).join(" · ") })));
    const body = el("div", { class: "body" });
    if ("result" in s) body.append(el("div", { class: "muted", text: "result" }), el("pre", { class: "result", text: show(s.result) }));
    if (s.error) {
      body.append(el("div", { class: "error" }, el("div", { class: "muted", text: `${s.error.kind}` }),
        el("pre", { text: s.error.message }),
        s.error.traceback ? el("details", {}, el("summary", { text: "traceback" }), el("pre", { text: s.error.traceback })) : null));
    }
    if ("answers" in s) body.append(el("div", { class: "muted", text: "answered" }), el("pre", { text: show(s.answers) }));
    s.calls.forEach((c, i) => body.append(renderCall(c, i)));
    if (!body.children.length) body.append(el("p", { class: "muted", text: "nothing recorded yet" }));
    card.append(body);
    return card;
  }));
}

function renderForks(f) {
  const box = $("#forks");
  const threads = f.threads;
  if (!f.forks.length) {
    box.replaceChildren(el("p", { class: "muted", text: threads.length
      ? `${threads.length} thread${threads.length > 1 ? "s" : ""}, no forks.` : "No threads recorded." }));
    return;
  }
  const kids = {};
  for (const t of threads) (kids[t.parent] = kids[t.parent] || []).push(t);
  const item = (t) => el("li", {},
    el("span", { class: "mono", text: `thread #${t.id}` }), ` (${t.step || "?"})`,
    t.parent !== null ? el("span", { class: "share", text: ` shares ${t.shared_tokens} tokens` +
      (t.shared_blocks !== null ? ` = ${t.shared_blocks} full KV block${t.shared_blocks === 1 ? "" : "s"}` : "") + ` with #${t.parent}` }) : null,
    t.calls ? el("span", { class: "share", text: ` · ${t.calls} calls, ${t.cached_tokens} cached / ${t.prompt_tokens} prompt tokens` }) : null,
    kids[t.id] ? el("ul", {}, ...kids[t.id].map(item)) : null);
  const roots = threads.filter((t) => t.parent === null && kids[t.id]);
  box.replaceChildren(el("ul", { class: "tree" }, ...roots.map(item)),
    el("p", { class: "muted", text: f.block_size ? `KV block size ${f.block_size} tokens.` : "" }));
}

function renderHistory(hist, r) {
  const body = $("#history tbody");
  body.replaceChildren(...hist.map((h) => {
    const top = h.step ? h.step.split("/")[0].split("[")[0] : null;
    const btn = top && r.status !== "running"
      ? el("button", { class: "fork", "data-seq": h.seq, text: `fork at ${h.step}`, onclick: () => forkAt(r, h.step) }) : null;
    return el("tr", { "data-seq": h.seq },
      el("td", { text: h.seq }), el("td", { class: "mono", text: h.step || "(run)" }), el("td", { text: h.status }),
      el("td", { class: "mono", text: h.result === null ? "" : show(h.result).slice(0, 80) }), el("td", {}, btn));
  }));
}

async function forkAt(r, step) {
  const raw = prompt(`Fork ${r.run_id} at ${step}: inputs to change, as JSON (empty: the same inputs)`,
    JSON.stringify(r.inputs));
  if (raw === null) return;
  let inputs = {};
  if (raw.trim()) {
    try { inputs = JSON.parse(raw); } catch (e) { say(`not JSON: ${e.message}`); return; }
  }
  try {
    const res = await api(`/runs/${r.run_id}/fork`, { method: "POST", body: JSON.stringify({ at: step, inputs }),
      headers: { "Content-Type": "application/json" } });
    location.href = `/ui/runs/${res.run_id}`;
  } catch (e) { say(e.message); }
}

// ---------------------------------------------------------------- start
const m = location.pathname.match(/^\/ui\/runs\/([^/]+)\/?$/);
if (m) runView(decodeURIComponent(m[1]));
else listView();
