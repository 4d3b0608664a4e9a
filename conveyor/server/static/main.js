// Wires the page: the view tabs (narrow screens show one view at a time), the API-key dialog,
// the playground and the engine view.

import { apiKey, onUnauthorized, setApiKey } from "./api.js";
import { initEngineView, resumeEngineView } from "./engine_view.js";
import { initPlayground } from "./playground.js";

const $ = (id) => document.getElementById(id);

function showView(name) {
  $("views").dataset.view = name;
  for (const button of document.querySelectorAll(".tabs button")) {
    button.setAttribute("aria-pressed", String(button.dataset.view === name));
  }
}

function askForKey(reason) {
  const dialog = $("key-dialog");
  $("key-reason").textContent = reason ? `The server answered: ${reason}` : "";
  $("key-reason").hidden = !reason;
  $("key-input").value = apiKey();
  if (!dialog.open) dialog.showModal();
  $("key-input").focus();
}

function initKeyDialog() {
  onUnauthorized((message) => askForKey(message));
  $("key-button").addEventListener("click", () => askForKey(""));
  $("key-cancel").addEventListener("click", () => $("key-dialog").close());
  $("key-form").addEventListener("submit", () => {
    setApiKey($("key-input").value.trim());
    resumeEngineView();
  });
}

initKeyDialog();
for (const button of document.querySelectorAll(".tabs button")) {
  button.addEventListener("click", () => showView(button.dataset.view));
}
initPlayground();
initEngineView();
