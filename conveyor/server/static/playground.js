// The chat playground: a conversation kept in this browser (localStorage), streamed replies,
// the sampling settings, stop / regenerate, a per-token logprob view and copy as curl / Python.

import { apiURL, streamSSE } from "./api.js";

const CHAT_STORAGE = "conveyor.chat";
const SETTINGS_STORAGE = "conveyor.settings";
const TOP_LOGPROBS = 5;
const $ = (id) => document.getElementById(id);

let messages = load(CHAT_STORAGE, []);  // [{role, content, tokens?, note?}]
let running = null;                     // AbortController of the reply being streamed

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch (_) {
    return fallback;
  }
}

function save() {
  localStorage.setItem(CHAT_STORAGE, JSON.stringify(messages));
}

/** The settings form as request fields; empty fields are left out so the server's defaults apply. */
function settings() {
  const form = $("settings-form");
  const fields = {};
  for (const name of ["temperature", "top_p", "top_k", "min_p", "max_tokens", "seed"]) {
    if (form.elements[name].value !== "") fields[name] = Number(form.elements[name].value);
  }
  const stop = form.elements.stop.value.split("\n").filter((s) => s !== "");
  if (stop.length) fields.stop = stop;
  if (form.elements.logprobs.checked) Object.assign(fields, { logprobs: true, top_logprobs: TOP_LOGPROBS });
  return { system: form.elements.system.value, fields };
}

function saveSettings() {
  const form = $("settings-form");
  const values = {};
  for (const el of form.elements) {
    if (el.name) values[el.name] = el.type === "checkbox" ? el.checked : el.value;
  }
  localStorage.setItem(SETTINGS_STORAGE, JSON.stringify(values));
}

function restoreSettings() {
  const form = $("settings-form");
  const values = load(SETTINGS_STORAGE, {});
  for (const [name, value] of Object.entries(values)) {
    const el = form.elements[name];
    if (!el) continue;
    if (el.type === "checkbox") el.checked = Boolean(value);
    else el.value = value;
  }
}

/** The chat request for the conversation `history` (user / assistant turns). */
function requestBody(history, stream) {
  const { system, fields } = settings();
  const turns = history.map(({ role, content }) => ({ role, content }));
  const body = { messages: system ? [{ role: "system", content: system }, ...turns] : turns, ...fields };
  if (stream) Object.assign(body, { stream: true, stream_options: { include_usage: true } });
  return body;
}

// ---- rendering ----------------------------------------------------------------------------

function tokenTitle(entry) {
  const lines = [`${JSON.stringify(entry.token)}  p=${Math.exp(entry.logprob).toFixed(3)}`];
  for (const alt of entry.top_logprobs || []) {
    lines.push(`  ${JSON.stringify(alt.token)}  p=${Math.exp(alt.logprob).toFixed(3)}`);
  }
  return lines.join("\n");
}

function renderTokens(container, tokens) {
  for (const entry of tokens) {
    const span = document.createElement("span");
    const p = Math.exp(entry.logprob);
    span.className = "tok";
    span.textContent = entry.token;
    span.style.backgroundColor = `hsl(${Math.round(120 * p)} 70% 50% / 0.28)`;  // red (unlikely) to green
    span.title = tokenTitle(entry);
    container.appendChild(span);
  }
}

function renderMessage(message) {
  const item = document.createElement("div");
  item.className = `msg ${message.role}`;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = message.role === "user" ? "You" : "Assistant";
  const body = document.createElement("div");
  body.className = "body";
  if (message.tokens && message.tokens.length) renderTokens(body, message.tokens);
  else body.textContent = message.content;
  item.append(who, body);
  if (message.note) {
    const note = document.createElement("div");
    note.className = "note";
    note.textContent = message.note;
    item.appendChild(note);
  }
  return item;
}

function render() {
  const box = $("messages");
  box.replaceChildren(...messages.map(renderMessage));
  box.scrollTop = box.scrollHeight;
}

function showError(text) {
  const el = $("chat-error");
  el.textContent = text;
  el.hidden = !text;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("regenerate").disabled = busy;
  $("stop").disabled = !busy;
}

// ---- actions -------------------------------------------------------------------------------

async function reply() {
  const history = messages.slice();
  const answer = { role: "assistant", content: "", tokens: [] };
  messages.push(answer);
  render();
  const body = $("messages").lastElementChild.querySelector(".body");
  const wantsTokens = Boolean(settings().fields.logprobs);
  const started = performance.now();
  let usage = null;
  let finish = null;
  running = new AbortController();
  setBusy(true);
  showError("");
  try {
    await streamSSE("/v1/chat/completions", requestBody(history, true), (chunk) => {
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      if (choice.finish_reason) finish = choice.finish_reason;
      const text = choice.delta && choice.delta.content;
      if (!text) return;
      answer.content += text;
      const entries = choice.logprobs && choice.logprobs.content;
      if (wantsTokens && entries) {
        answer.tokens.push(...entries);
        renderTokens(body, entries);
      } else {
        body.append(text);
      }
      $("messages").scrollTop = $("messages").scrollHeight;
    }, running.signal);
    const seconds = (performance.now() - started) / 1000;
    answer.note = usage
      ? `${usage.completion_tokens} tokens in ${seconds.toFixed(1)} s (${(usage.completion_tokens / seconds).toFixed(1)} tok/s), finish: ${finish}`
      : `finish: ${finish}`;
  } catch (err) {
    if (err.name === "AbortError") {
      answer.note = "stopped";
    } else {
      showError(err.message);
      if (!answer.content) messages.pop();  // nothing came: keep the conversation as it was
      else answer.note = `error: ${err.message}`;
    }
  } finally {
    running = null;
    setBusy(false);
    if (!answer.tokens.length) delete answer.tokens;
    save();
    render();
  }
}

function send() {
  const input = $("chat-input");
  const text = input.value.trim();
  if (!text || running) return;
  messages.push({ role: "user", content: text });
  input.value = "";
  save();
  render();
  reply();
}

function regenerate() {
  if (running) return;
  while (messages.length && messages[messages.length - 1].role === "assistant") messages.pop();
  if (!messages.length) return;
  save();
  render();
  reply();
}

function stop() {
  if (running) running.abort();
}

/** The next request: the conversation plus what is typed in the box. */
function pendingHistory() {
  const text = $("chat-input").value.trim();
  return text ? [...messages, { role: "user", content: text }] : messages.slice();
}

function copyText(title, text, note) {
  $("copy-title").textContent = title;
  $("copy-text").value = text;
  $("copy-note").textContent = note;
  $("copy-dialog").showModal();
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(text).then(
      () => { $("copy-note").textContent = `Copied to the clipboard. ${note}`; },
      () => {});
  }
}

function copyCurl() {
  const body = JSON.stringify(requestBody(pendingHistory(), false), null, 2).replaceAll("'", "'\\''");
  const text = `curl ${apiURL("/v1/chat/completions")} \\\n  -H 'Content-Type: application/json' \\\n` +
    `  -H "Authorization: Bearer $CONVEYOR_API_KEY" \\\n  -d '${body}'`;
  copyText("Copy as curl", text, "The key is read from $CONVEYOR_API_KEY; the page never puts it in the text.");
}

/** A Python literal for a JSON value (JSON's string escapes are valid in Python). */
function py(value) {
  if (value === null) return "None";
  if (value === true) return "True";
  if (value === false) return "False";
  if (Array.isArray(value)) return `[${value.map(py).join(", ")}]`;
  if (typeof value === "object") {
    return `{${Object.entries(value).map(([k, v]) => `${JSON.stringify(k)}: ${py(v)}`).join(", ")}}`;
  }
  return JSON.stringify(value);
}

function copyPython() {
  const body = requestBody(pendingHistory(), false);
  const { messages: msgs, ...fields } = body;
  const extra = {};
  for (const name of ["top_k", "min_p"]) {  // not in OpenAI's client signature: sent as extra_body
    if (name in fields) { extra[name] = fields[name]; delete fields[name]; }
  }
  const args = Object.entries(fields).map(([k, v]) => `    ${k}=${py(v)},`);
  if (Object.keys(extra).length) args.push(`    extra_body=${py(extra)},`);
  const text = [
    "import os", "", "from openai import OpenAI", "",
    `client = OpenAI(base_url="${apiURL("/v1")}", api_key=os.environ.get("CONVEYOR_API_KEY", "unused"))`,
    "reply = client.chat.completions.create(",
    `    model=client.models.list().data[0].id,`,
    "    messages=[",
    ...msgs.map((m) => `        ${py(m)},`),
    "    ],",
    ...args,
    ")",
    "print(reply.choices[0].message.content)",
  ].join("\n");
  copyText("Copy as Python", text, "Uses the openai package; the key is read from CONVEYOR_API_KEY.");
}

export function initPlayground() {
  restoreSettings();
  $("settings-form").addEventListener("input", saveSettings);
  $("chat-form").addEventListener("submit", (event) => { event.preventDefault(); send(); });
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    } else if (event.key === "Escape") {
      stop();
    }
  });
  $("stop").addEventListener("click", stop);
  $("regenerate").addEventListener("click", regenerate);
  $("clear").addEventListener("click", () => { stop(); messages = []; save(); render(); showError(""); });
  $("copy-curl").addEventListener("click", copyCurl);
  $("copy-python").addEventListener("click", copyPython);
  render();
}
