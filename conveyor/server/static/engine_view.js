// The live engine view: polls GET /v1/engine/status twice a second (only new spans each time),
// keeps a minute of counters and a few seconds of spans in the page, and redraws the plots.

import { ApiError, getJSON, onUnauthorized } from "./api.js";
import { COLORS, barChart, lineChart, timeline } from "./charts.js";

const POLL_MS = 500;
const HISTORY_S = 60;       // counters kept and plotted
const TIMELINE_S = [2, 10]; // timeline window: 2 s, widened to show ~8 steps when steps are long
const SPANS_KEPT_S = 10;    // spans kept for the batch-size bars
const BARS = 60;            // steps shown as bars
const $ = (id) => document.getElementById(id);

const state = {
  history: [],              // [{t, running, waiting, preempted, tps, used, total, prefix}]
  spans: new Map(),         // "lane name start" -> span
  lastNow: null,            // engine clock of the last answer
  lastPrefix: null,         // {hit, query} of the last answer
  prefixRate: 0,
  paused: false,            // waiting for an API key
};

function set(id, text) {
  const el = $(id);
  if (el.textContent !== text) el.textContent = text;
}

function showError(text) {
  const el = $("engine-error");
  el.textContent = text;
  el.hidden = !text;
}

function record(status) {
  if (state.lastNow !== null && status.now < state.lastNow) {  // the server restarted: start afresh
    state.history = [];
    state.spans.clear();
    state.lastPrefix = null;
  }
  state.lastNow = status.now;
  for (const span of status.spans) state.spans.set(`${span.lane} ${span.name} ${span.start}`, span);
  for (const [key, span] of state.spans) if (status.now - span.end > SPANS_KEPT_S) state.spans.delete(key);
  const s = status.stats;
  if (!s) return;
  const prefix = s.prefix_cache;
  if (state.lastPrefix && prefix.query_tokens > state.lastPrefix.query) {  // the rate of the lookups since the last poll
    state.prefixRate = (prefix.hit_tokens - state.lastPrefix.hit) / (prefix.query_tokens - state.lastPrefix.query);
  } else if (!state.lastPrefix) {
    state.prefixRate = prefix.hit_rate;
  }
  state.lastPrefix = { hit: prefix.hit_tokens, query: prefix.query_tokens };
  state.history.push({
    t: status.now, running: s.requests.running, waiting: s.requests.waiting, preempted: s.requests.preempted,
    tps: status.tokens_per_s, used: s.kv_blocks.used, total: s.kv_blocks.total, prefix: state.prefixRate,
  });
  while (state.history.length && status.now - state.history[0].t > HISTORY_S) state.history.shift();
}

function draw(status) {
  set("model-name", status.model);
  const badge = $("engine-state");
  set("engine-state", status.state);
  badge.dataset.state = status.state;
  showError(status.error ? `engine: ${status.error}` : "");
  const s = status.stats;
  const spans = [...state.spans.values()].sort((a, b) => a.start - b.start);
  const steps = spans.filter((x) => x.lane === "device").slice(-BARS);
  if (s) {
    set("t-running", String(s.requests.running));
    set("t-waiting", String(s.requests.waiting));
    set("t-preempted", String(s.requests.preempted));
    set("t-tps", status.tokens_per_s.toFixed(1));
    set("t-batch", steps.length ? String(steps[steps.length - 1].seqs) : "0");
    set("t-kv", `${s.kv_blocks.used} / ${s.kv_blocks.total}`);
    set("t-prefix", `${(100 * s.prefix_cache.hit_rate).toFixed(1)}%`);
    set("t-idle", `${(100 * s.device_idle_fraction).toFixed(1)}%`);
  }
  if ($("engine").offsetParent === null) return;  // hidden (the playground tab on a narrow screen)
  const now = status.now;
  const h = state.history;
  const seconds = timelineSeconds(steps);
  set("timeline-seconds", String(seconds));
  timeline($("c-timeline"), spans, now, seconds);
  lineChart($("c-tps"), [{ points: h.map((p) => [p.t, p.tps]), color: COLORS.tps }], now, HISTORY_S);
  lineChart($("c-requests"), ["running", "waiting", "preempted"].map((k) => (
    { points: h.map((p) => [p.t, p[k]]), color: COLORS[k] })), now, HISTORY_S);
  barChart($("c-batch"), steps.map((x) => x.seqs), COLORS.batch, `last ${steps.length} steps`);
  const total = h.length ? h[h.length - 1].total : 1;
  lineChart($("c-kv"), [
    { points: h.map((p) => [p.t, p.used]), color: COLORS.used },
    { points: h.map((p) => [p.t, 100 * p.prefix]), color: COLORS.prefix, right: true },
  ], now, HISTORY_S, { yMax: total, rightMax: 100 });
}

/** Long enough to show about 8 steps (a slow machine's steps can take a second each). */
function timelineSeconds(steps) {
  const durations = steps.slice(-8).map((x) => x.end - x.start).sort((a, b) => a - b);
  const median = durations.length ? durations[Math.floor(durations.length / 2)] : 0;
  return Math.min(TIMELINE_S[1], Math.max(TIMELINE_S[0], Math.ceil(8 * median)));
}

async function poll() {
  if (state.paused || document.hidden) return;
  const since = state.lastNow === null ? "" : `&since=${Math.max(0, state.lastNow - 0.25)}`;
  try {
    const status = await getJSON(`/v1/engine/status?window=${SPANS_KEPT_S}${since}`);
    record(status);
    draw(status);
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) {
      state.paused = true;  // until a key is given
    } else {
      set("engine-state", "unreachable");
      $("engine-state").dataset.state = "dead";
      showError(err.message);
    }
  }
}

function legend() {
  const box = $("timeline-legend");
  for (const name of ["schedule", "prepare", "commit", "grammar", "forward+sample"]) {
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = COLORS[name];
    item.append(swatch, name);
    box.appendChild(item);
  }
}

/** Poll again (after a new API key). */
export function resumeEngineView() {
  state.paused = false;
  poll();
}

export function initEngineView() {
  legend();
  onUnauthorized(() => { state.paused = true; });
  const loop = async () => {
    await poll();
    setTimeout(loop, POLL_MS);
  };
  loop();
}
