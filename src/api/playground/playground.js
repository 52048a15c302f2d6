// imajev-serve playground: builds a POST /v1/systemone request from a form, sends it to this
// server, and shows each answer as it matters to a person.
//
// The page's Content-Security-Policy requires Trusted Types, so this script never parses HTML:
// every node is made with createElement and filled with textContent. It talks to this server only
// (GET /v1/models, POST /v1/systemone, the example photos) and stores nothing: the API key lives
// in its input field until the page is closed.
//
// Requests are valid in both contract modes (imajev and typesafe): `state` and `instructions` are
// always sent; answers are read under both the plain and the `x_` names of imajev's extra fields.
// Objects whose key order matters (questions, options) are written by `toJson` from Maps, since a
// plain JavaScript object would move integer-like keys ("2", "10") to the front. A JSON state is
// sent as typed (numbers such as 1.0 or 2^64 survive), after JSON.parse has checked it.
"use strict";

const MAX_IMAGES = 2;
const MAX_STATE_BYTES = 131072;
const TYPES = [
  ["noul", "noul — yes or no"],
  ["choice", "choice — one option"],
  ["score", "score — a rating"],
  ["multi", "multi — any of the labels"],
];

// ----------------------------------------------------------------------------------- helpers

const $ = (id) => document.getElementById(id);

/** Makes an element: attrs (class, text, dataset keys as data-*, other attributes), children. */
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("data-")) node.setAttribute(k, String(v));
    else if (k === "value") node.value = v;
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    node.append(typeof c === "string" ? document.createTextNode(c) : c);
  }
  return node;
}

/** A JSON text kept verbatim inside a request built by toJson. */
class RawJson {
  constructor(text) {
    this.text = text;
  }
}

/** Compact JSON of plain values, Maps (key order kept), arrays and RawJson. */
function toJson(v) {
  if (v instanceof RawJson) return reindent(v.text, 0);
  if (Array.isArray(v)) return "[" + v.map(toJson).join(",") + "]";
  if (v instanceof Map) return "{" + [...v].map(([k, x]) => JSON.stringify(k) + ":" + toJson(x)).join(",") + "}";
  if (v !== null && typeof v === "object") return toJson(new Map(Object.entries(v)));
  return JSON.stringify(v);
}

/**
 * Re-indents a JSON text without parsing its values (numbers and key order stay as they are):
 * `step` 0 removes the whitespace between tokens, > 0 indents by that many spaces.
 */
function reindent(text, step) {
  const ws = " \n\r\t";
  const nl = (d) => (step ? "\n" + " ".repeat(step * d) : "");
  let out = "";
  let depth = 0;
  let inString = false;
  let escaped = false;
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (inString) {
      out += c;
      if (escaped) escaped = false;
      else if (c === "\\") escaped = true;
      else if (c === '"') inString = false;
      continue;
    }
    if (c === '"') {
      inString = true;
      out += c;
    } else if (ws.includes(c)) {
      continue;
    } else if (c === "{" || c === "[") {
      const closer = c === "{" ? "}" : "]";
      let j = i + 1;
      while (j < text.length && ws.includes(text[j])) j++;
      if (text[j] === closer) {
        out += c + closer;
        i = j;
      } else {
        depth++;
        out += c + nl(depth);
      }
    } else if (c === "}" || c === "]") {
      depth--;
      out += nl(depth) + c;
    } else if (c === ",") {
      out += "," + nl(depth);
    } else if (c === ":") {
      out += step ? ": " : ":";
    } else {
      out += c;
    }
  }
  return out;
}

const utf8Bytes = (s) => new TextEncoder().encode(s).length;
const pct = (v) => (typeof v === "number" ? (v * 100).toFixed(1) + "%" : "—");
const fixed = (v, n) => (typeof v === "number" ? v.toFixed(n) : "—");
const clamp01 = (v) => Math.min(1, Math.max(0, Number(v) || 0));
/** imajev's extra answer fields are `x_`-prefixed in the typesafe contract mode. */
const pick = (a, name) => (a[name] !== undefined ? a[name] : a["x_" + name]);
const kib = (n) => (n < 1024 ? n + " B" : (n / 1024).toFixed(n < 10240 ? 1 : 0) + " KiB");

// --------------------------------------------------------------------------------- the state

function stateMode() {
  return $("state-mode-text").checked ? "text" : "json";
}

/** Checks the state as typed; returns {ok, value (for toJson), message}. */
function checkState() {
  const text = $("state").value;
  if (stateMode() === "text") {
    const bytes = utf8Bytes(JSON.stringify(text));
    return { ok: true, value: text, message: `Plain text: sent as one JSON string (${kib(bytes)}).`, bytes };
  }
  if (text.trim() === "") return { ok: true, value: new Map(), message: "Empty: sent as {} (no state).", bytes: 2 };
  let parsed;
  try {
    parsed = JSON.parse(text);
  } catch (e) {
    return { ok: false, message: "Not valid JSON: " + describeJsonError(text, e) };
  }
  const compact = reindent(text, 0);
  const bytes = utf8Bytes(compact);
  let what;
  if (parsed !== null && typeof parsed === "object" && !Array.isArray(parsed)) {
    const n = Object.keys(parsed).length;
    what = `a JSON object with ${n} key${n === 1 ? "" : "s"}`;
  } else if (typeof parsed === "string") {
    what = "a JSON string";
  } else {
    what = `a JSON ${Array.isArray(parsed) ? "array" : parsed === null ? "null" : typeof parsed} (the server wraps it as {"state": …}; the typesafe mode refuses null)`;
  }
  const over = bytes > MAX_STATE_BYTES ? ` — over the server's limit of ${MAX_STATE_BYTES.toLocaleString("en")} bytes` : "";
  return { ok: true, value: new RawJson(text), message: `Valid JSON: ${what}, ${kib(bytes)} compact${over}.`, bytes, over: !!over };
}

function describeJsonError(text, e) {
  const m = /position (\d+)/.exec(String(e.message));
  if (!m) return String(e.message);
  const pos = Number(m[1]);
  const before = text.slice(0, pos);
  const line = before.split("\n").length;
  const col = pos - before.lastIndexOf("\n");
  return `line ${line}, column ${col}: ${String(e.message).replace(/ in JSON at position.*$/, "")}`;
}

function showStateStatus() {
  const r = checkState();
  const status = $("state-status");
  status.textContent = r.message;
  status.className = "field-status " + (!r.ok || r.over ? "bad" : "ok");
  $("state").classList.toggle("invalid", !r.ok);
  return r;
}

function setState(mode, text) {
  $(mode === "text" ? "state-mode-text" : "state-mode-json").checked = true;
  $("state").value = text;
  showStateStatus();
}

// ------------------------------------------------------------------------------- questions

const questionsBox = () => $("questions");
const cards = () => [...questionsBox().querySelectorAll(".question")];

function nextQuestionId() {
  const used = new Set(cards().map((c) => c.querySelector(".q-id").value));
  for (let i = 1; ; i++) if (!used.has("q" + i)) return "q" + i;
}

/** Adds a question card: q = {id, type, instructions, criteria, threshold}. */
function addQuestion(q) {
  q = q || {};
  const type = q.type || "noul";
  const select = el("select", { class: "q-type", "aria-label": "Question type" });
  for (const [value, label] of TYPES) select.append(el("option", { value, text: label }));
  select.value = type;
  const card = el(
    "div",
    { class: "question", "data-type": type },
    el(
      "div",
      { class: "row" },
      el("label", {}, "Id ", el("input", { type: "text", class: "q-id", value: q.id || nextQuestionId(), spellcheck: "false", "aria-label": "Question id" })),
      el("label", {}, "Type ", select),
      el("button", { type: "button", class: "link q-remove", text: "Remove" }),
    ),
    el("p", { class: "field-error q-error" }),
    el(
      "label",
      { class: "stack" },
      el("span", { text: "Instructions" }),
      el("textarea", { class: "q-instructions", rows: "2", "aria-label": "Instructions" }),
    ),
    el("p", { class: "field-error q-error-instructions" }),
    el("p", { class: "field-error q-error-type" }),
    el("div", { class: "criteria-head" }),
    el("div", { class: "q-criteria" }),
    el("div", { class: "row" }, el("button", { type: "button", class: "q-add-row" })),
    el("p", { class: "field-error q-error-criteria" }),
    el(
      "div",
      { class: "row q-threshold-row" },
      el("label", {}, "Threshold ", el("input", { type: "number", class: "q-threshold", min: "0", max: "1", step: "0.05", "aria-label": "Threshold" })),
      el("span", { class: "muted small", text: "a label is selected when its yes-probability is above this (default 0.5)" }),
    ),
    el("p", { class: "field-error q-error-threshold" }),
  );
  card.querySelector(".q-instructions").value = q.instructions || "";
  if (q.threshold !== undefined && q.threshold !== null) card.querySelector(".q-threshold").value = String(q.threshold);
  select.addEventListener("change", () => changeType(card, select.value));
  card.querySelector(".q-remove").addEventListener("click", () => card.remove());
  card.querySelector(".q-add-row").addEventListener("click", () => {
    addRow(card, card.dataset.type, { key: "", desc: "" });
    renumber(card);
    const inputs = card.querySelectorAll(".q-criteria input");
    if (inputs.length) inputs[inputs.length - (card.dataset.type === "score" ? 1 : 2)].focus();
  });
  setRows(card, type, criteriaRows(type, q.criteria));
  questionsBox().append(card);
  return card;
}

/** A question's criteria as rows [{key, desc}] for its type. */
function criteriaRows(type, criteria) {
  if (type === "noul") {
    const c = criteria || {};
    return [
      { key: "true", desc: c.true || "" },
      { key: "false", desc: c.false || "" },
    ];
  }
  if (type === "score") return (criteria || ["", ""]).map((d) => ({ key: "", desc: d || "" }));
  const pairs = criteria || (type === "choice" ? [["", ""], ["", ""]] : [["", ""]]);
  return pairs.map(([k, d]) => ({ key: k, desc: d || "" }));
}

function setRows(card, type, rows) {
  card.dataset.type = type;
  const box = card.querySelector(".q-criteria");
  box.replaceChildren();
  for (const r of rows) addRow(card, type, r);
  const heads = {
    noul: "What yes and no mean (optional)",
    choice: "Options: value, then an optional description",
    score: "Levels, lowest first (each needs a description)",
    multi: "Labels: label, then an optional description",
  };
  card.querySelector(".criteria-head").textContent = heads[type];
  const add = card.querySelector(".q-add-row");
  add.hidden = type === "noul";
  add.textContent = { choice: "Add an option", score: "Add a level", multi: "Add a label" }[type] || "";
  card.querySelector(".q-threshold-row").hidden = type !== "multi";
  renumber(card);
}

function addRow(card, type, r) {
  let keyCell;
  if (type === "noul") keyCell = el("span", { class: "fixed-key", text: r.key === "true" ? "yes means" : "no means" });
  else if (type === "score") keyCell = el("span", { class: "fixed-key level" });
  else keyCell = el("input", { type: "text", class: "c-key", value: r.key, spellcheck: "false", placeholder: type === "choice" ? "option" : "label", "aria-label": type === "choice" ? "Option" : "Label" });
  const desc = el("input", { type: "text", class: "c-desc", value: r.desc, placeholder: type === "score" ? "description" : "description (optional)", "aria-label": "Description" });
  const row = el(
    "div",
    { class: "criteria-row", "data-key": type === "noul" ? r.key : null },
    keyCell,
    desc,
    type === "noul" ? el("span") : el("button", { type: "button", class: "link c-remove", text: "Remove" }),
    el("p", { class: "field-error c-error" }),
  );
  const remove = row.querySelector(".c-remove");
  if (remove)
    remove.addEventListener("click", () => {
      row.remove();
      renumber(card);
    });
  card.querySelector(".q-criteria").append(row);
}

function renumber(card) {
  card.querySelectorAll(".level").forEach((s, i) => (s.textContent = "level " + i));
}

function readRows(card) {
  return [...card.querySelectorAll(".criteria-row")].map((row) => ({
    row,
    key: row.dataset.key !== undefined ? row.dataset.key : row.querySelector(".c-key") ? row.querySelector(".c-key").value : "",
    desc: row.querySelector(".c-desc").value,
  }));
}

function changeType(card, type) {
  const before = card.dataset.type;
  const rows = readRows(card).map(({ key, desc }) => ({ key, desc }));
  let next;
  if (type === "noul") next = criteriaRows("noul", null);
  else if (before === "noul") next = criteriaRows(type, null);
  else if (type === "score") next = rows.map((r) => ({ key: "", desc: r.desc || r.key }));
  else next = rows.map((r) => ({ key: before === "score" ? "" : r.key, desc: r.desc }));
  setRows(card, type, next);
}

/**
 * Reads one card into a question of the request. Returns {id, question (a Map), keys (the
 * criteria keys as sent, for placing errors), problems: [[element, message]]}.
 */
function readQuestion(card) {
  const type = card.dataset.type;
  const id = card.querySelector(".q-id").value;
  const problems = [];
  const q = new Map([["type", type], ["instructions", card.querySelector(".q-instructions").value]]);
  const rows = readRows(card);
  const keys = [];
  if (type === "noul") {
    const c = new Map();
    for (const r of rows) {
      r.row.dataset.sentKey = r.key;
      if (r.desc !== "") c.set(r.key, r.desc);
    }
    if (c.size) q.set("criteria", c);
  } else if (type === "score") {
    q.set(
      "criteria",
      rows.map((r, i) => {
        r.row.dataset.sentKey = String(i);
        keys.push(String(i));
        return r.desc;
      }),
    );
  } else {
    const c = new Map();
    for (const r of rows) {
      r.row.dataset.sentKey = r.key;
      if (c.has(r.key)) {
        problems.push([r.row.querySelector(".c-error"), `"${r.key}" appears twice: each ${type === "choice" ? "option" : "label"} can be listed once.`, r.row.querySelector(".c-key")]);
        continue;
      }
      c.set(r.key, r.desc === "" ? null : r.desc);
      keys.push(r.key);
    }
    q.set("criteria", c);
    if (type === "multi") {
      const t = card.querySelector(".q-threshold");
      if (t.value !== "") q.set("threshold", Number(t.value));
      else if (t.validity.badInput) problems.push([card.querySelector(".q-error-threshold"), "The threshold must be a number between 0 and 1.", t]);
    }
  }
  return { id, type, card, question: q, keys, problems };
}

// ---------------------------------------------------------------------------------- images

let images = []; // {file, url, dataUrl, ready: Promise, width, height}

function addFiles(fileList) {
  const files = [...fileList];
  const refused = [];
  for (const file of files) {
    if (images.length >= MAX_IMAGES) {
      refused.push(file.name);
      continue;
    }
    const entry = { file, url: URL.createObjectURL(file), dataUrl: null };
    entry.ready = new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.addEventListener("load", () => {
        entry.dataUrl = reader.result;
        resolve();
      });
      reader.addEventListener("error", () => reject(new Error(`could not read ${file.name}: ${reader.error}`)));
      reader.readAsDataURL(file);
    });
    images.push(entry);
  }
  renderImages();
  if (refused.length) {
    const err = $("error-images");
    err.textContent = `Not added: ${refused.join(", ")}. A request takes at most two images (the server refuses a third); remove one first.`;
    $("dropzone").classList.add("invalid");
  }
}

function removeImage(i) {
  URL.revokeObjectURL(images[i].url);
  images.splice(i, 1);
  renderImages();
}

function renderImages() {
  $("error-images").textContent = "";
  $("dropzone").classList.remove("invalid");
  const list = $("image-list");
  list.replaceChildren();
  images.forEach((img, i) => {
    const dims = el("span", { class: "dims" });
    const pic = el("img", { src: img.url, alt: `image ${i + 1}: ${img.file.name}` });
    pic.addEventListener("load", () => {
      img.width = pic.naturalWidth;
      img.height = pic.naturalHeight;
      dims.textContent = ` · ${pic.naturalWidth}×${pic.naturalHeight}`;
    });
    const remove = el("button", { type: "button", class: "link", text: "Remove" });
    remove.addEventListener("click", () => removeImage(i));
    list.append(
      el(
        "div",
        { class: "thumb", "data-index": i },
        pic,
        el("div", { class: "caption" }, el("span", { class: "role", text: `${i + 1} · ${i === 0 ? "reference" : "target"}` }), " ", img.file.name, ` · ${kib(img.file.size)}`, dims),
        remove,
        el("p", { class: "field-error image-error" }),
      ),
    );
  });
  $("dropzone").hidden = false;
}

async function addExamplePhotos(names) {
  const files = [];
  for (const name of names) {
    const res = await fetch("/playground/examples/" + name);
    if (!res.ok) throw new Error(`the example photo ${name} could not be loaded (${res.status})`);
    files.push(new File([await res.blob()], name, { type: res.headers.get("content-type") || "image/png" }));
  }
  addFiles(files);
}

function clearImages() {
  for (const img of images) URL.revokeObjectURL(img.url);
  images = [];
  renderImages();
}

// ----------------------------------------------------------------------------- the request

/** Everything needed to send, copy and read back a request, or the problems found on the page. */
async function buildRequest() {
  const problems = [];
  const state = checkState();
  if (!state.ok) problems.push([$("error-state"), state.message + " Fix it, or switch to plain text.", $("state")]);
  const questions = new Map();
  const sent = [];
  const seen = new Map();
  for (const card of cards()) {
    const r = readQuestion(card);
    problems.push(...r.problems);
    if (r.id === "") {
      problems.push([card.querySelector(".q-error"), "Give the question an id (any text; the answer comes back under it).", card.querySelector(".q-id")]);
      continue;
    }
    if (seen.has(r.id)) {
      problems.push([card.querySelector(".q-error"), `The id "${r.id}" is used by another question: ids must differ.`, card.querySelector(".q-id")]);
      continue;
    }
    seen.set(r.id, card);
    questions.set(r.id, r.question);
    sent.push(r);
  }
  let dataUrls = [];
  try {
    await Promise.all(images.map((i) => i.ready));
    dataUrls = images.map((i) => i.dataUrl);
  } catch (e) {
    problems.push([$("error-images"), String(e.message || e), $("dropzone")]);
  }
  if (problems.length) return { problems };
  const body = new Map([["state", state.value], ["questions", questions]]);
  if (dataUrls.length) body.set("images", dataUrls);
  const compact = toJson(body);
  return { problems, body: compact, sent, key: $("api-key").value.trim() };
}

// ---------------------------------------------------------------------------------- errors

function clearErrors() {
  document.querySelectorAll(".field-error").forEach((e) => (e.textContent = ""));
  document.querySelectorAll(".invalid").forEach((e) => e.classList.remove("invalid"));
  showStateStatus();
}

function showAt(target, message, field) {
  target.textContent = target.textContent ? target.textContent + "\n" + message : message;
  if (field) field.classList.add("invalid");
}

/**
 * Places one 422 detail next to the field its `loc` names; returns false when no field of the
 * page matches (the caller shows it with the general errors).
 */
function placeError(loc, msg, sent) {
  if (!Array.isArray(loc) || loc[0] !== "body" || loc.length < 2) return false;
  const [, top, ...rest] = loc;
  if (top === "state") {
    showAt($("error-state"), msg, $("state"));
    return true;
  }
  if (top === "images" || top === "image" || top === "image[]") {
    const thumb = typeof rest[0] === "number" ? document.querySelector(`.thumb[data-index="${rest[0]}"]`) : null;
    if (thumb) showAt(thumb.querySelector(".image-error"), msg, thumb);
    else showAt($("error-images"), msg, $("dropzone"));
    return true;
  }
  if (top !== "questions") return false;
  const q = rest.length ? sent.find((s) => s.id === String(rest[0])) : null;
  if (!q) {
    showAt($("error-questions"), rest.length ? `${rest[0]}: ${msg}` : msg, null);
    return true;
  }
  const card = q.card;
  const field = rest[1];
  if (field === "criteria") {
    const row = rest.length > 2 ? [...card.querySelectorAll(".criteria-row")].find((r) => r.dataset.sentKey === String(rest[2])) : null;
    if (row) showAt(row.querySelector(".c-error"), msg, row.querySelector(rest[3] === undefined && row.querySelector(".c-key") ? ".c-key" : ".c-desc"));
    else showAt(card.querySelector(".q-error-criteria"), msg, card.querySelector(".q-criteria"));
  } else if (field === "instructions") {
    showAt(card.querySelector(".q-error-instructions"), msg, card.querySelector(".q-instructions"));
  } else if (field === "type") {
    showAt(card.querySelector(".q-error-type"), msg, card.querySelector(".q-type"));
  } else if (field === "threshold") {
    showAt(card.querySelector(".q-error-threshold"), msg, card.querySelector(".q-threshold"));
  } else {
    showAt(card.querySelector(".q-error"), msg, card);
  }
  return true;
}

function renderError(status, json, text, sent) {
  const general = $("error-general");
  const setStatus = (s) => setResultStatus(s, "error", status);
  if (json && Array.isArray(json.detail)) {
    const left = [];
    for (const d of json.detail) if (!placeError(d.loc, String(d.msg), sent)) left.push(`${(d.loc || []).join(".")}: ${d.msg}`);
    if (left.length) general.textContent = left.join("\n");
    setStatus(`${status} ${json.error || ""} — the server refused the request; its reasons are shown next to the fields.`);
  } else if (json && json.detail && typeof json.detail === "object") {
    const message = String(json.detail.message || json.error);
    const code = json.error || json.detail.error_type || "";
    if (status === 401) showAt($("error-key"), message, $("api-key"));
    else if (code === "image_too_large" || code === "bad_image") showAt($("error-images"), message, $("dropzone"));
    else general.textContent = message;
    setStatus(`${status} ${code}`);
  } else {
    general.textContent = text || "(empty response)";
    setStatus(`${status}`);
  }
  const first = document.querySelector(".field-error:not(:empty)");
  if (first) first.scrollIntoView({ block: "nearest" });
}

function setResultStatus(text, state, httpStatus) {
  const s = $("status");
  s.textContent = text;
  s.dataset.state = state;
  s.dataset.httpStatus = httpStatus === undefined ? "" : String(httpStatus);
  s.className = "status " + (state === "done" ? "ok" : state === "error" || state === "refused" ? "bad" : "");
}

// --------------------------------------------------------------------------------- answers

function bar(key, label, value, opts) {
  opts = opts || {};
  const fill = el("span", { class: "bar-fill" });
  fill.style.width = clamp01(value) * 100 + "%";
  const track = el("span", { class: "bar-track" }, fill);
  if (opts.marker !== undefined) {
    const m = el("span", { class: "bar-marker", title: "threshold " + opts.marker });
    m.style.left = clamp01(opts.marker) * 100 + "%";
    track.append(m);
  }
  return el(
    "div",
    { class: "bar-row" + (opts.chosen ? " chosen" : ""), "data-key": key, "data-value": String(value), title: opts.title || `${label}: ${value}` },
    el("span", { class: "bar-label", text: label }),
    track,
    el("span", { class: "bar-value", text: pct(value) }),
  );
}

function fact(list, field, label, text, value) {
  list.append(el("dt", { text: label }), el("dd", { "data-field": field, "data-value": value === undefined ? null : String(value), text }));
}

function abstainedWords(v, multi) {
  if (v === true)
    return multi
      ? "Yes — every label abstained: the model judged none of them can be decided from the evidence."
      : "Yes — the model abstained: its trained “unknown” answer scored highest, so it judged this cannot be decided from the evidence. The answer shown is only its best guess.";
  if (v === false) return multi ? "No — at least one label was answered." : "No — the model answered.";
  return "not reported";
}

function commonFacts(list, a) {
  const u = pick(a, "unknown_probability");
  fact(list, "unknown_probability", "Unknown probability", typeof u === "number" ? `${pct(u)} (mass on “cannot be determined”)` : "—", u);
  fact(list, "abstained", "Abstained", abstainedWords(pick(a, "abstained"), false), pick(a, "abstained"));
  if (typeof a.confidence === "number") fact(list, "confidence", "Confidence", fixed(a.confidence, 3), a.confidence);
  const cal = pick(a, "calibration_version");
  fact(list, "calibration_version", "Calibration", cal ? String(cal) : "none — raw probabilities (the server has no --calibration file)", cal || "");
}

/** Keys of an answer's map in the order the request listed them (then any others). */
function ordered(map, keys) {
  const out = keys.filter((k) => Object.prototype.hasOwnProperty.call(map, k));
  for (const k of Object.keys(map)) if (!out.includes(k)) out.push(k);
  return out;
}

function renderAnswer(id, a, q) {
  const type = a.type || (q && q.type);
  const card = el("article", { class: "answer", "data-qid": id, "data-type": type }, el("h3", {}, id, el("span", { class: "type", text: type })));
  const bars = el("div", { class: "bars" });
  const facts = el("dl", { class: "facts" });
  const keys = q ? q.keys : [];
  let headline;
  if (type === "noul") {
    const v = a.noul;
    const lean = v > 0.5 ? "leans yes" : v < 0.5 ? "leans no" : "undecided";
    headline = el("p", { class: "headline" }, "P(yes) + ½·P(unknown) = ", el("strong", { class: "headline-value", text: pct(v) }), ` — ${lean}`);
    bars.append(bar("noul", "yes", v));
    commonFacts(facts, a);
  } else if (type === "choice") {
    const abst = pick(a, "abstained") === true;
    headline = el("p", { class: "headline" }, "Chosen: ", el("strong", { class: "chosen-value", text: String(a.choice) }), abst ? " (best guess: the model abstained)" : "");
    for (const k of ordered(a.probabilities || {}, keys)) bars.append(bar(k, k, a.probabilities[k], { chosen: k === a.choice }));
    commonFacts(facts, a);
  } else if (type === "score") {
    const levels = Object.keys(a.probabilities || {}).sort((x, y) => Number(x) - Number(y));
    headline = el("p", { class: "headline" }, "Score: ", el("strong", { class: "headline-value", text: fixed(a.score, 2) }), ` on a scale of 0 to ${levels.length - 1} (the expected level)`);
    for (const k of levels) {
      const legend = a.legend && a.legend[k] !== undefined ? `${k} — ${a.legend[k]}` : k;
      bars.append(bar(k, legend, a.probabilities[k]));
    }
    commonFacts(facts, a);
  } else if (type === "multi") {
    const labels = a.labels || [];
    const t = a.threshold;
    headline = el("p", { class: "headline" }, "Selected: ", el("strong", { class: "chosen-value", text: labels.length ? labels.join(", ") : "none" }), ` (yes-probability above ${t})`);
    const unknowns = pick(a, "unknown_probabilities") || {};
    for (const k of ordered(a.probabilities || {}, keys)) {
      const u = unknowns[k];
      bars.append(bar(k, k, a.probabilities[k], { chosen: labels.includes(k), marker: t, title: `${k}: ${a.probabilities[k]}; unknown ${u}` }));
    }
    fact(facts, "threshold", "Threshold", String(t), t);
    const us = Object.keys(unknowns).map((k) => `${k} ${pct(unknowns[k])}`);
    fact(facts, "unknown_probabilities", "Unknown probabilities", us.length ? us.join(", ") : "—", JSON.stringify(unknowns));
    fact(facts, "abstained", "Abstained", abstainedWords(pick(a, "abstained"), true), pick(a, "abstained"));
  } else {
    headline = el("p", { class: "headline", text: "An answer of a type this page does not know; see the JSON below." });
  }
  card.append(headline, bars, facts);
  return card;
}

function renderUsage(u, roundTripMs) {
  const box = $("usage");
  box.replaceChildren();
  if (!u) return;
  const rows = [
    ["input_tokens", "Input tokens (longest pass, image tokens included)", u.input_tokens, String(u.input_tokens)],
    ["processed_tokens", "Tokens the engine ran", u.processed_tokens, String(u.processed_tokens)],
    ["passes", "Passes (question × option order)", u.passes, String(u.passes)],
    ["rotations", "Option orders averaged", u.rotations, String(u.rotations)],
    ["vision_ms", "Vision", u.vision_ms, fixed(u.vision_ms, 1) + " ms"],
    ["prefill_ms", "Shared prefix", u.prefill_ms, fixed(u.prefill_ms, 1) + " ms"],
    ["questions_ms", "Questions", u.questions_ms, fixed(u.questions_ms, 1) + " ms"],
    ["total_ms", "Total on the server", u.total_ms, fixed(u.total_ms, 1) + " ms"],
    ["round_trip_ms", "Round trip seen by this page", roundTripMs, fixed(roundTripMs, 1) + " ms"],
  ];
  const table = el("table", {}, el("caption", { class: "muted", text: "Usage" }));
  for (const [field, label, value, text] of rows) {
    if (value === undefined) continue;
    table.append(el("tr", {}, el("th", { text: label }), el("td", { class: "num", "data-field": field, "data-value": String(value), text })));
  }
  const imgs = u.images || [];
  const imgText = imgs.length ? imgs.map((i, n) => `${n + 1}: ${i.width}×${i.height}, sha256 ${String(i.sha256).slice(0, 12)}…`).join("; ") : "none";
  table.append(el("tr", {}, el("th", { text: "Images" }), el("td", { "data-field": "images", "data-value": JSON.stringify(imgs), text: imgText })));
  box.append(table);
}

function showResponseText(text) {
  let shown = text;
  try {
    JSON.parse(text);
    shown = reindent(text, 2);
  } catch (_) {
    // not JSON: shown as it came
  }
  $("response-json").textContent = shown;
}

// -------------------------------------------------------------------------------- sending

let sendCount = 0;

/** Sends the request; `#status[data-seq]` counts finished attempts (sent or refused on the page). */
async function send() {
  try {
    await sendOnce();
  } finally {
    $("status").dataset.seq = String(++sendCount);
  }
}

async function sendOnce() {
  clearErrors();
  $("answers").replaceChildren();
  $("usage").replaceChildren();
  $("error-general").textContent = "";
  const req = await buildRequest();
  if (req.problems.length) {
    for (const [target, msg, field] of req.problems) showAt(target, msg, field);
    setResultStatus("Not sent: fix the highlighted fields first.", "refused");
    return;
  }
  const button = $("send");
  button.disabled = true;
  setResultStatus(`Sending ${kib(utf8Bytes(req.body))}…`, "sending");
  const headers = { "Content-Type": "application/json" };
  if (req.key) headers.Authorization = "Bearer " + req.key;
  const t0 = performance.now();
  try {
    const res = await fetch("/v1/systemone", { method: "POST", headers, body: req.body, credentials: "omit", cache: "no-store", referrerPolicy: "no-referrer" });
    const text = await res.text();
    const ms = performance.now() - t0;
    let json = null;
    try {
      json = JSON.parse(text);
    } catch (_) {
      json = null;
    }
    showResponseText(text);
    if (res.ok && json && json.answers) {
      const answers = $("answers");
      const ids = req.sent.map((s) => s.id);
      for (const id of ordered(json.answers, ids)) answers.append(renderAnswer(id, json.answers[id], req.sent.find((s) => s.id === id)));
      renderUsage(json.usage, ms);
      const n = Object.keys(json.answers).length;
      setResultStatus(`${res.status} OK — ${n} answer${n === 1 ? "" : "s"} from ${json.model} in ${ms.toFixed(0)} ms`, "done", res.status);
    } else {
      renderError(res.status, json, text, req.sent);
    }
  } catch (e) {
    $("error-general").textContent = `Could not reach the server: ${e.message || e}`;
    setResultStatus("No answer", "error", 0);
  } finally {
    button.disabled = false;
  }
}

// ---------------------------------------------------------------------------- copy as code

function shellQuote(s) {
  return "'" + s.replace(/'/g, "'\\''") + "'";
}

function curlSnippet(req) {
  const lines = [];
  if (req.key) lines.push("# The key is read from IMAJEV_API_KEY: export IMAJEV_API_KEY=… first.");
  lines.push(`curl -sS ${shellQuote(location.origin + "/v1/systemone")} \\`, "  -H 'Content-Type: application/json' \\");
  if (req.key) lines.push('  -H "Authorization: Bearer $IMAJEV_API_KEY" \\');
  lines.push("  --data-binary @- <<'IMAJEV_REQUEST'", reindent(req.body, 2), "IMAJEV_REQUEST");
  return lines.join("\n") + "\n";
}

function pythonSnippet(req) {
  const headers = ['"Content-Type": "application/json"'];
  if (req.key) headers.push('"Authorization": "Bearer " + os.environ["IMAJEV_API_KEY"]');
  return [
    "import json",
    "import os",
    "import urllib.error",
    "import urllib.request",
    "",
    "# The exact request the playground sends (JSON; images as data URLs).",
    'BODY = r"""',
    reindent(req.body, 2),
    '"""',
    "",
    "request = urllib.request.Request(",
    `    ${JSON.stringify(location.origin + "/v1/systemone")},`,
    '    data=BODY.encode("utf-8"),',
    `    headers={${headers.join(", ")}},`,
    '    method="POST",',
    ")",
    "try:",
    "    with urllib.request.urlopen(request) as response:",
    "        print(json.dumps(json.load(response), indent=2, ensure_ascii=False))",
    "except urllib.error.HTTPError as e:",
    '    print(e.code, e.read().decode("utf-8", "replace"))',
    "",
  ].join("\n");
}

async function copySnippet(kind) {
  clearErrors();
  const req = await buildRequest();
  if (req.problems.length) {
    for (const [target, msg, field] of req.problems) showAt(target, msg, field);
    setResultStatus("Nothing to copy: fix the highlighted fields first.", "refused");
    return;
  }
  const text = kind === "curl" ? curlSnippet(req) : pythonSnippet(req);
  const box = $("snippet-box");
  const area = $("snippet");
  box.hidden = false;
  box.dataset.kind = kind;
  area.value = text;
  const status = $("snippet-status");
  const label = kind === "curl" ? "curl command" : "Python script (standard library only)";
  try {
    await navigator.clipboard.writeText(text);
    status.textContent = `Copied the ${label} to the clipboard.`;
  } catch (_) {
    area.focus();
    area.select();
    status.textContent = `The browser did not allow writing to the clipboard: the ${label} is selected below, copy it from there.`;
  }
}

// -------------------------------------------------------------------------------- examples

const EXAMPLES = {
  tickets: {
    stateMode: "json",
    state: JSON.stringify(
      {
        ticket: {
          id: "T-1042",
          from: "accounting",
          subject: "Printer shows E-204",
          body: "Since this morning's firmware update the printer on floor 3 shows E-204 and nobody in accounting can print invoices. Month-end closing is on Friday.",
        },
      },
      null,
      2,
    ),
    questions: [
      {
        id: "team",
        type: "choice",
        instructions: "Which team should handle this ticket?",
        criteria: [
          ["infra", "network, servers and firmware"],
          ["facilities", "broken devices and rooms"],
          ["identity", "accounts, passwords and access"],
          ["billing", "invoices and payments"],
        ],
      },
      {
        id: "urgent",
        type: "noul",
        instructions: "Does the reporter need an answer today?",
        criteria: { true: "work is blocked or a deadline is near", false: "it can wait for the normal queue" },
      },
      { id: "impact", type: "score", instructions: "How many people are affected?", criteria: ["one person", "a team", "the whole office"] },
      {
        id: "tags",
        type: "multi",
        instructions: "Which topics does the ticket touch?",
        criteria: [
          ["hardware", "devices, printers, cables"],
          ["software", "apps and firmware"],
          ["finance", "money and invoices"],
        ],
        threshold: 0.5,
      },
    ],
    photos: [],
  },
  photos: {
    stateMode: "text",
    state: "Maintenance check of the printer on floor 3. The first photo is from the last visit, the second from today.",
    questions: [
      { id: "same_device", type: "noul", instructions: "Do both photos show the same printer?" },
      {
        id: "change",
        type: "choice",
        instructions: "What changed between the first photo and the second?",
        criteria: [
          ["nothing", "both photos look the same"],
          ["error", "the screen or the status light shows an error"],
          ["damage", "the case is cracked or a part is missing"],
          ["other_device", "it is a different printer"],
        ],
      },
      { id: "condition", type: "score", instructions: "In what condition is the printer in the second photo?", criteria: ["broken", "worn but working", "like new"] },
    ],
    photos: ["reference.png", "target.png"],
  },
};

async function loadExample(name) {
  const ex = EXAMPLES[name];
  resetResult();
  setState(ex.stateMode, ex.state);
  questionsBox().replaceChildren();
  for (const q of ex.questions) addQuestion(q);
  clearImages();
  clearErrors();
  if (ex.photos.length) {
    try {
      await addExamplePhotos(ex.photos);
    } catch (e) {
      $("error-images").textContent = String(e.message || e);
    }
  }
}

function clearAll() {
  resetResult();
  setState("json", "");
  questionsBox().replaceChildren();
  clearImages();
  clearErrors();
}

function resetResult() {
  $("answers").replaceChildren();
  $("usage").replaceChildren();
  $("response-json").textContent = "";
  $("error-general").textContent = "";
  setResultStatus("Build a request and press Send.", "idle");
}

// ------------------------------------------------------------------------------ the model

async function loadModelInfo() {
  const info = $("model-info");
  try {
    const res = await fetch("/v1/models", { credentials: "omit", cache: "no-store" });
    const m = await res.json();
    if (res.status === 503) {
      info.textContent = `The model is ${m.error === "loading" ? "still loading" : "not available"}: ${m.detail && m.detail.message ? m.detail.message : ""} (asking again in 2 s)`;
      setTimeout(loadModelInfo, 2000);
      return;
    }
    if (!res.ok) {
      info.textContent = `GET /v1/models answered ${res.status}.`;
      return;
    }
    info.dataset.model = m.model;
    info.textContent = `Model ${m.model} · backend ${m.backend} · readout ${m.readout_codes} codes (choices of up to ${m.max_options} options) · POST /v1/systemone`;
    const described = m.models && m.models[0] && m.models[0].description;
    if (described && /^demo/i.test(described)) {
      const note = $("model-note");
      note.textContent = described;
      note.hidden = false;
    }
  } catch (e) {
    info.textContent = `Could not reach the server: ${e.message || e}`;
  }
}

// ---------------------------------------------------------------------------------- wiring

function wire() {
  $("state").addEventListener("input", showStateStatus);
  $("state-mode-json").addEventListener("change", showStateStatus);
  $("state-mode-text").addEventListener("change", showStateStatus);
  $("add-question").addEventListener("click", () => addQuestion({}).querySelector(".q-instructions").focus());
  $("send").addEventListener("click", send);
  $("copy-curl").addEventListener("click", () => copySnippet("curl"));
  $("copy-python").addEventListener("click", () => copySnippet("python"));
  $("example-tickets").addEventListener("click", () => loadExample("tickets"));
  $("example-photos").addEventListener("click", () => loadExample("photos"));
  $("clear-all").addEventListener("click", clearAll);
  const input = $("image-input");
  input.addEventListener("change", () => {
    addFiles(input.files);
    input.value = "";
  });
  const zone = $("dropzone");
  zone.addEventListener("keydown", (e) => {
    if (e.key === "Enter" || e.key === " ") {
      e.preventDefault();
      input.click();
    }
  });
  zone.addEventListener("dragover", (e) => {
    e.preventDefault();
    zone.classList.add("over");
  });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", (e) => {
    e.preventDefault();
    zone.classList.remove("over");
    if (e.dataTransfer && e.dataTransfer.files.length) addFiles(e.dataTransfer.files);
  });
  // A file dropped beside the zone must not make the browser leave the page.
  window.addEventListener("dragover", (e) => e.preventDefault());
  window.addEventListener("drop", (e) => e.preventDefault());
}

document.addEventListener("DOMContentLoaded", () => {
  wire();
  loadModelInfo();
  loadExample("tickets");
});
