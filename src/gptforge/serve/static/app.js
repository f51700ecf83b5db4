// gptforge serve's page: polls the runs' metrics (redrawn only when metrics.jsonl changed), shows the selected
// run's samples and config, and streams completions, or a chat's replies, from its newest checkpoint through the
// OpenAI API.
"use strict";

const POLL_MS = 2000;
const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6, 2e6, 5e6];
const chartHeight = (width) => (width < 500 ? 180 : 220); // shorter on a phone: more than one chart per screen
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f"];
const $ = (id) => document.getElementById(id);
const state = {
  runs: [], metrics: {}, versions: {}, charts: {}, selected: null, shownVersion: null, abort: null,
  chat: [], // the playground's conversation: {role, content} turns, the system message apart
};

function headers() {
  const key = localStorage.getItem("gptforge-key");
  return key ? { Authorization: "Bearer " + key } : {};
}

async function getJSON(url) {
  const r = await fetch(url, { headers: headers() });
  if (r.status === 401) { $("keyform").hidden = false; throw new Error("this server needs its API key"); }
  const body = await r.json();
  if (!r.ok) throw new Error(body.error && (body.error.message || body.error) || r.statusText);
  return body;
}

function showError(message) {
  $("error").hidden = !message;
  $("error").textContent = message || "";
}

// --- charts -------------------------------------------------------------------------------------------

const PANELS = {
  loss: { kinds: [["train", "loss", "train"], ["val", "loss", "val"]], perSource: "loss" },
  bpb: { kinds: [["val", "bpb", "val"]], perSource: "bpb" },
  lr: { kinds: [["train", "lr", "lr"]], format: (v) => (v === 0 ? "0" : v.toExponential(1)) },
  tps: { kinds: [["train", "tokens_per_s", "tok/s"]], format: (v) => Math.round(v).toLocaleString() },
  code: {
    kinds: [ // [kind, key, label, dash]
      ["code", "infill_exact", "infill, 1 line", null], ["code", "prefix_exact", "prefix only, 1 line", [6, 4]],
      ["code", "span_infill_exact", "infill, 3 lines", [2, 3]],
      ["code", "span_prefix_exact", "prefix only, 3 lines", [6, 3, 2, 3]],
      ["code", "parse_rate", "bodies that parse", [1, 6]],
    ],
    format: (v) => (100 * v).toFixed(0) + "%",
    optional: "code", // drawn when a run has code measures (eval.code)
  },
  rl: {
    kinds: [
      ["rl", "reward", "reward", null], ["rl", "pass_rate", "solved (training tasks)", [6, 4]],
      ["tasks", "pass@1", "held-out pass@1", null],
    ],
    format: (v) => (100 * v).toFixed(0) + "%",
    optional: "rl", // drawn for a run of `gptforge rl`
  },
};

// A run on a mix logs each folder's val numbers as "loss/NAME", "bpb/NAME": one dotted curve each.
function sourceKinds(panel, m) {
  const prefix = panel.perSource + "/";
  const keys = panel.perSource && m && m.val ? Object.keys(m.val).filter((k) => k.startsWith(prefix)) : [];
  return keys.map((k) => ["val", k, "val " + k.slice(prefix.length)]);
}

function panelData(panel, runs) {
  const tables = [], series = [{ label: "step" }];
  runs.forEach((run, i) => {
    const m = state.metrics[run.id];
    for (const [kind, key, label, dash] of [...panel.kinds, ...sourceKinds(panel, m)]) {
      const cols = m && m[kind];
      if (!cols || !cols.step || !cols.step.length || !cols[key] || cols[key].every((v) => v == null)) continue;
      tables.push([cols.step, cols[key]]);
      const val = kind !== "train" && kind !== "rl"; // evaluations: points, thicker
      const dashed = kind === "val" && panel.kinds.length > 1;
      series.push({
        label: `${run.id} ${label}`, stroke: COLORS[i % COLORS.length], width: val ? 2 : 1.25, spanGaps: true,
        dash: dash !== undefined ? dash || undefined : key.includes("/") ? [2, 3] : dashed ? [6, 4] : undefined,
        points: { show: val },
        value: panel.format ? (u, v) => (v == null ? "–" : panel.format(v)) : undefined,
      });
    }
  });
  return { data: tables.length ? uPlot.join(tables) : [[]], series };
}

function drawChart(name, runs) {
  const el = $("chart-" + name);
  const { data, series } = panelData(PANELS[name], runs);
  const signature = series.map((s) => s.label).join("|");
  const old = state.charts[name];
  if (old && old.signature === signature) { old.plot.setData(data); return; }
  if (old) old.plot.destroy();
  const format = PANELS[name].format;
  const opts = {
    width: Math.max(260, el.clientWidth), height: chartHeight(el.clientWidth), series, legend: { live: true },
    scales: { x: { time: false } },
    axes: [{ label: "step", incrs: STEP_INCRS }, { size: 60, values: format ? (u, vals) => vals.map(format) : undefined }],
  };
  state.charts[name] = { plot: new uPlot(opts, data, el), signature };
}

function drawCharts() {
  const runs = state.runs.filter((r) => state.metrics[r.id]);
  for (const [name, panel] of Object.entries(PANELS)) {
    if (panel.optional) {
      const has = runs.some((r) => Object.entries(state.metrics[r.id][panel.optional] || {})
        .some(([key, values]) => key !== "step" && values.some((v) => v != null)));
      $("figure-" + name).hidden = !has;
      if (!has) continue;
    }
    drawChart(name, runs);
  }
}

new ResizeObserver(() => {
  for (const [name, chart] of Object.entries(state.charts)) {
    const width = $("chart-" + name).clientWidth;
    chart.plot.setSize({ width: Math.max(260, width), height: chartHeight(width) });
  }
}).observe($("charts"));

// --- polling ------------------------------------------------------------------------------------------

async function poll() {
  try {
    const listing = await getJSON("/api/runs");
    $("root").textContent = "· " + listing.root;
    state.runs = listing.runs;
    updateRunSelect();
    let changed = false;
    for (const run of state.runs.filter((r) => r.has_metrics)) {
      const since = state.versions[run.id] ? "?version=" + encodeURIComponent(state.versions[run.id]) : "";
      const m = await getJSON(`/api/runs/${encodeURIComponent(run.id)}/metrics${since}`);
      if (m.unchanged) continue;
      state.versions[run.id] = m.version;
      state.metrics[run.id] = m;
      changed = true;
    }
    $("charts").hidden = !state.runs.some((r) => r.has_metrics); // a lone checkpoint has no training log to draw
    if (changed) drawCharts();
    await showSelected();
    showError("");
  } catch (e) {
    showError(String(e.message || e));
  }
  setTimeout(poll, POLL_MS);
}

function updateRunSelect() {
  const select = $("run");
  const ids = state.runs.map((r) => r.id);
  if ([...select.options].map((o) => o.value).join() !== ids.join()) {
    select.replaceChildren(...ids.map((id) => new Option(id, id)));
  }
  if (!ids.includes(state.selected)) state.selected = ids[0] || null;
  select.value = state.selected || "";
}

async function showSelected() {
  const run = state.runs.find((r) => r.id === state.selected);
  if (!run) { $("status").textContent = "no runs yet"; return; }
  const m = state.metrics[run.id];
  const steps = m && m.train && m.train.step;
  const last = steps && steps.length ? steps[steps.length - 1] : null;
  const progress = run.is_checkpoint ? "a checkpoint (no training log)" : last !== null ? `step ${last}` : "no steps yet";
  $("status").textContent = `${progress} · updated ${new Date().toLocaleTimeString()}`;
  const where = run.is_checkpoint ? run.id : `${run.id} / ${run.checkpoint}`;
  $("checkpoint").textContent = run.checkpoint ? `· ${where}` : "· no checkpoint yet";
  $("generate").disabled = !run.checkpoint || state.abort !== null;
  const version = run.id + "@" + (state.versions[run.id] || "") + "@" + (run.checkpoint || "");
  if (version === state.shownVersion) return;
  state.shownVersion = version;
  const id = encodeURIComponent(run.id);
  const [samples, config] = await Promise.all([getJSON(`/api/runs/${id}/samples`), getJSON(`/api/runs/${id}/config`)]);
  showSamples(samples.samples);
  $("config").textContent = config.toml || "(no config.toml)";
}

function showSamples(samples) {
  if (!samples.length) { $("samples").replaceChildren(Object.assign(document.createElement("p"), { className: "muted", textContent: "none yet" })); return; }
  $("samples").replaceChildren(...samples.map((s) => {
    const pre = document.createElement("pre");
    const head = document.createElement("span");
    head.className = "muted";
    head.textContent = `step ${s.step}\n`;
    pre.append(head, s.text);
    return pre;
  }));
}

$("run").addEventListener("change", () => { state.selected = $("run").value; showSelected().catch((e) => showError(e.message)); });

$("keyform").addEventListener("submit", (event) => {
  event.preventDefault();
  localStorage.setItem("gptforge-key", $("key").value);
  $("keyform").hidden = true;
  state.shownVersion = null;
});

// --- playground: POST /v1/completions or /v1/chat/completions with stream: true, read as server-sent events -----

const mode = () => document.querySelector("input[name=mode]:checked").value;

function showMode() {
  for (const el of document.querySelectorAll("[data-mode]")) el.hidden = el.dataset.mode !== mode();
  $("generate").textContent = mode() === "chat" ? "Send" : "Generate";
  $("out-info").textContent = "";
}

// Streams the selected run's answer to `body`, handing each choice of each chunk to onChoice; false on an error.
async function stream(url, body, onChoice) {
  state.abort = new AbortController();
  $("generate").disabled = true;
  $("stop").disabled = false;
  $("out-info").textContent = "";
  try {
    const r = await fetch(url, {
      method: "POST", signal: state.abort.signal,
      headers: { "Content-Type": "application/json", ...headers() },
      body: JSON.stringify({
        model: state.selected, stream: true, ...body,
        max_tokens: Number($("max-tokens").value), temperature: Number($("temperature").value),
      }),
    });
    if (!r.ok) { const answer = await r.json(); throw new Error(answer.error.message); }
    await readEvents(r.body.getReader(), onChoice);
    return true;
  } catch (e) {
    if (e.name === "AbortError") return true; // stopped: what came so far stays
    $("out-info").textContent = "error: " + (e.message || e);
    return false;
  } finally {
    state.abort = null;
    $("generate").disabled = false;
    $("stop").disabled = true;
  }
}

async function readEvents(reader, onChoice) {
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, end).replace(/^data: /, "");
      buffer = buffer.slice(end + 2);
      if (line === "[DONE]") return;
      const chunk = JSON.parse(line);
      if (chunk.error) throw new Error(chunk.error.message);
      for (const c of chunk.choices) {
        onChoice(c);
        if (c.finish_reason) $("out-info").textContent = `${chunk.system_fingerprint} · finished: ${c.finish_reason}`;
      }
    }
  }
}

function complete() {
  const prompt = $("prompt").value;
  const suffix = $("suffix").value;
  $("out-prompt").textContent = prompt;
  $("out-suffix").textContent = suffix;
  $("out-text").textContent = "";
  return stream("/v1/completions", { prompt, ...(suffix ? { suffix } : {}) }, (c) => { $("out-text").textContent += c.text; });
}

function addMessage(role, content) {
  const div = Object.assign(document.createElement("div"), { className: "message " + role, textContent: content });
  div.dataset.role = role === "user" ? "you" : "assistant";
  $("conversation").append(div);
  return div;
}

// The whole conversation goes with every message (the server keeps none); a reply that failed is taken back out,
// its message put back in the box, so the next one does not follow an unanswered turn.
async function send() {
  const content = $("message").value;
  if (!content.trim()) return;
  const history = state.chat; // Reset starts a new one: a reply still streaming then lands in the old one
  history.push({ role: "user", content });
  $("message").value = "";
  const asked = addMessage("user", content);
  const reply = addMessage("assistant", "");
  const system = $("system").value.trim() ? [{ role: "system", content: $("system").value }] : [];
  const ok = await stream("/v1/chat/completions", { messages: [...system, ...history] }, (c) => {
    reply.textContent += (c.delta && c.delta.content) || "";
    $("conversation").scrollTop = $("conversation").scrollHeight;
  });
  if (ok) { history.push({ role: "assistant", content: reply.textContent }); return; }
  history.pop();
  asked.remove();
  reply.remove();
  if (!$("message").value) $("message").value = content;
}

function reset() {
  if (state.abort) state.abort.abort();
  state.chat = [];
  $("conversation").replaceChildren();
  $("out-info").textContent = "";
}

for (const radio of document.querySelectorAll("input[name=mode]")) radio.addEventListener("change", showMode);
$("message").addEventListener("keydown", (event) => {
  if (event.key !== "Enter" || event.shiftKey || event.isComposing) return;
  event.preventDefault();
  if (!$("generate").disabled) send();
});
$("generate").addEventListener("click", () => (mode() === "chat" ? send() : complete()));
$("stop").addEventListener("click", () => state.abort && state.abort.abort());
$("reset").addEventListener("click", reset);
showMode(); // a reload keeps the checked mode
poll();
