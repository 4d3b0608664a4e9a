// Calls to the server's API: the API key (asked once, kept in this tab), error messages as the
// server wrote them, and Server-Sent Events read from a fetch body.

const KEY_STORAGE = "conveyor.apiKey";
const listeners = new Set();

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  sessionStorage.setItem(KEY_STORAGE, key);
}

/** Call `fn(message)` whenever the server refuses the key (HTTP 401). */
export function onUnauthorized(fn) {
  listeners.add(fn);
}

export function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

/** The OpenAI-shaped error message of a failed response, or a plain description. */
async function errorOf(response) {
  let text = "";
  try {
    text = await response.text();
    const body = JSON.parse(text);
    if (body && body.error && body.error.message) return body.error.message;
  } catch (_) { /* not JSON: fall through */ }
  return `HTTP ${response.status} ${response.statusText}${text ? `: ${text.slice(0, 300)}` : ""}`;
}

/** The full URL of an API path ("/v1/..."), under the prefix the page is served at (the server's --root-path,
 * which it writes into the page's <base>). */
export function apiURL(path) {
  return new URL(path.replace(/^\//, ""), document.baseURI).href;
}

/** fetch with the key; a non-2xx answer throws ApiError carrying the server's message. */
export async function apiFetch(path, options = {}) {
  const headers = { ...(options.headers || {}), ...authHeaders() };
  let response;
  try {
    response = await fetch(apiURL(path), { ...options, headers });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new ApiError(0, `the server could not be reached (${err.message})`);
  }
  if (!response.ok) {
    const message = await errorOf(response);
    if (response.status === 401) listeners.forEach((fn) => fn(message));
    throw new ApiError(response.status, message);
  }
  return response;
}

export async function getJSON(path) {
  return (await apiFetch(path)).json();
}

/** POST `body` and call `onEvent(object)` for each SSE `data:` event until `[DONE]`.
 *  An error event from the server (`{"error": ...}`) throws ApiError with its message. */
export async function streamSSE(path, body, onEvent, signal) {
  const response = await apiFetch(path, {
    method: "POST", signal, headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const parsed = JSON.parse(data);
        if (parsed.error) throw new ApiError(500, parsed.error.message);  // the stream failed after it began
        onEvent(parsed);
      }
    }
  }
}
