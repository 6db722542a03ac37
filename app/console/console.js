// devicemq console: the admin API (/api/v1, app/admin.py) in one page.
// No framework and no build step. Everything the API returns goes into the page as
// text (textContent / Node.append of strings), never as HTML. The token lives in
// sessionStorage (this tab only) and is sent as "Authorization: Bearer" on every call.
"use strict";

const TOKEN_KEY = "devicemq.admin.token";
const REFRESH_EVERY_MS = 5000; // the headline, sessions, block list and replicas, while "Auto-refresh" is on
const PAGE_SIZE = 50;
const PEEK = 20;

const $ = (id) => document.getElementById(id);

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// -- the API -----------------------------------------------------------------------------

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

async function api(method, path, query, body) {
  const params = new URLSearchParams();
  for (const [name, value] of Object.entries(query || {})) {
    if (value !== null && value !== undefined && value !== "") params.set(name, String(value));
  }
  const search = params.toString();
  const init = { method, headers: {}, cache: "no-store" };
  if (token()) init.headers.Authorization = "Bearer " + token();
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const url = "/api/v1/" + path + (search ? "?" + search : "");
  let response;
  try {
    response = await fetch(url, init);
  } catch (e) {
    // A GET is asked once more: the browser may have sent it on a kept-alive
    // connection the server had just closed (idle, or pushed out by
    // admin.max_connections_per_source). A write is never sent twice.
    if (method !== "GET") throw new ApiError(0, "cannot reach the admin API: " + e.message);
    try {
      response = await fetch(url, init);
    } catch (again) {
      throw new ApiError(0, "cannot reach the admin API: " + again.message);
    }
  }
  let data = null;
  try {
    data = await response.json();
  } catch (e) {
    data = null;
  }
  if (!response.ok) {
    const message = data && typeof data.error === "string" ? data.error : response.statusText;
    throw new ApiError(response.status, message);
  }
  return data;
}

// A client ID as a path segment. Browsers resolve the segments "." and ".." (and
// their %2E spellings) before a request leaves: purging the session "." would go to
// /api/v1/sessions/messages, another session. A client ID never holds U+0000
// (MQTT-1.5.4-2), so a leading %00 marks such a segment; the server drops it.
function clientIdSegment(clientId) {
  const encoded = encodeURIComponent(clientId);
  return clientId === "." || clientId === ".." ? "%00" + encoded : encoded;
}

function sessionPath(clientId, ...rest) {
  return ["sessions", clientIdSegment(clientId), ...rest].join("/");
}

// A queue's ID is a client ID ($ECQ) or a group store's filter ("$queue/g/a/+"): one
// segment either way, its "/" and "+" percent-encoded (the server splits, then decodes).
function queuePath(queueId, ...rest) {
  return ["queues", clientIdSegment(queueId), ...rest].join("/");
}

// -- small helpers -----------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value !== null && value !== undefined) node.setAttribute(name, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : text(child));
  return node;
}

function text(value) {
  return value === null || value === undefined || value === "" ? "—" : String(value);
}

// Times in UTC, written as the CLI writes them (app/admin_cli.py): 2026-11-28 14:24:08Z
function when(epoch) {
  if (!epoch) return "—";
  return new Date(epoch * 1000).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  if (seconds < 120) return Math.round(seconds) + " s";
  if (seconds < 7200) return Math.round(seconds / 60) + " min";
  if (seconds < 172800) return Math.round(seconds / 3600) + " h";
  return Math.round(seconds / 86400) + " d";
}

function payloadText(b64) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  let shown = "base64:" + b64;
  try {
    const decoded = new TextDecoder("utf-8", { fatal: true }).decode(bytes);
    if (!/[\u0000-\u0008\u000e-\u001f\u007f]/.test(decoded)) shown = decoded;
  } catch (e) {
    // not UTF-8: shown as base64
  }
  return shown.length > 120 ? shown.slice(0, 120) + "…" : shown;
}

function button(label, attrs, onClick) {
  const b = el("button", { type: "button", ...attrs }, label);
  b.addEventListener("click", (event) => {
    event.stopPropagation();
    run(onClick);
  });
  return b;
}

function facts(list, pairs) {
  list.replaceChildren(
    ...pairs.map(([key, label, value]) =>
      el("div", { "data-testid": key }, el("dt", {}, label), el("dd", {}, value)),
    ),
  );
}

// -- errors and status -------------------------------------------------------------------

function showError(error) {
  let message = error instanceof ApiError && error.status ? error.status + ": " : "";
  message += error.message || String(error);
  if (error.status === 401) {
    message += token() ? " (the token was refused)" : " (enter the admin token above)";
    clearData();
  }
  $("error").textContent = message;
  $("error").hidden = false;
}

function setStatus(message) {
  $("status").textContent = message;
}

// A user's action: errors shown, the previous message gone.
async function run(action) {
  $("error").hidden = true;
  $("error").textContent = "";
  setStatus("");
  try {
    await action();
  } catch (error) {
    showError(error);
  }
}

function clearData() {
  for (const id of ["stats", "sessions-body", "blocked-body", "retained-body", "queues-body",
    "replicas-body", "subscribers-body"]) {
    $(id).replaceChildren();
  }
  closeDetail();
}

// -- headline numbers --------------------------------------------------------------------

const STATS = [
  ["connections", "Connections"],
  ["sessions", "Sessions"],
  ["persistent_sessions", "Persistent sessions"],
  ["sessions_here", "Sessions on this replica"],
  ["retained", "Retained messages"],
  ["blocked", "Block-list entries"],
  ["messages_received", "Messages received"],
  ["messages_sent", "Messages sent"],
  ["connections_total", "Connections since start"],
];
let lastStats = null;

async function loadStats() {
  const s = await api("GET", "stats");
  const now = Date.now() / 1000;
  const rate = (key) => {
    if (!lastStats || now - lastStats.at < 0.5) return "—";
    return ((s[key] - lastStats.s[key]) / (now - lastStats.at)).toFixed(1);
  };
  const pairs = STATS.map(([key, label]) => ["stat-" + key, label, text(s[key])]);
  const health = s.health; // what /ready answers, the Kafka lag and the backlog (app/serve.py)
  if (health) {
    pairs.unshift(["stat-ready", "Ready", health.ready ? "yes" : "no: " + text(health.reason)]);
    if (health.kafka_lag !== null) {
      pairs.push(["stat-kafka-lag", "Kafka consumer lag (records)", text(health.kafka_lag)]);
    }
    if (health.backlog !== null) {
      pairs.push(["stat-backlog", "Stored for persistent sessions", text(health.backlog)]);
    }
  }
  pairs.push(["stat-in-rate", "Received / s", rate("messages_received")]);
  pairs.push(["stat-out-rate", "Sent / s", rate("messages_sent")]);
  for (const rule of s.integrations || []) {
    // the audit count of a topic-to-Kafka rule (docs/integrations.md)
    const label = `Rule ${rule.name} → ${rule.kafka_topic}: produced / failed`;
    pairs.push(["stat-rule-" + rule.name, label, `${rule.produced} / ${rule.failed}`]);
  }
  facts($("stats"), pairs);
  const ready = $("stats").querySelector('[data-testid="stat-ready"]');
  if (ready) ready.classList.add(health.ready ? "ready" : "not-ready");
  $("stats-node").textContent = s.node ? "replica " + s.node : "";
  lastStats = { s, at: now };
}

// -- sessions ----------------------------------------------------------------------------

const paging = { cursors: [""], next: null };
let selected = null; // the client ID in the detail panel
let sessionsAsked = 0; // only the answer to the latest request is shown
let typing = null; // the search box's pending search

async function loadSessions() {
  const asked = ++sessionsAsked;
  const query = {
    client_id: $("search-prefix").value,
    connected: $("filter-connected").value,
    persistent: $("filter-persistent").value,
    cursor: paging.cursors[paging.cursors.length - 1],
    limit: PAGE_SIZE,
  };
  const table = $("sessions-table");
  table.setAttribute("aria-busy", "true");
  let page;
  try {
    page = await api("GET", "sessions", query);
  } finally {
    if (asked === sessionsAsked) table.setAttribute("aria-busy", "false");
  }
  if (asked !== sessionsAsked) return;
  paging.next = page.next_cursor;
  $("sessions-body").replaceChildren(...page.items.map(sessionRow));
  $("sessions-empty").hidden = page.items.length > 0;
  $("next-page").disabled = !paging.next;
  $("first-page").disabled = paging.cursors.length <= 1;
  $("previous-page").disabled = paging.cursors.length <= 1;
}

function sessionRow(s) {
  const open = el("button", { type: "button", class: "link", "data-client-id": s.client_id });
  open.append(s.client_id === "" ? "(empty)" : s.client_id);
  const row = el(
    "tr",
    { "data-client-id": s.client_id, class: s.client_id === selected ? "selected" : null },
    el("td", {}, open),
    el("td", {}, s.username),
    el("td", { class: s.connected ? "online" : null }, s.connected ? "connected" : "offline"),
    el("td", {}, s.persistent ? "yes" : "no"),
    el("td", {}, s.protocol),
    el("td", { class: "mono" }, s.peer),
    el("td", {}, s.replica),
    el("td", { class: "num" }, s.subscriptions),
    el("td", { class: "num", "data-testid": "backlog" }, s.backlog),
    el("td", { class: "num" }, s.in_flight),
    el("td", {}, s.connected ? "now" : when(s.last_seen)),
  );
  // The whole row opens the session; the button inside is there for the keyboard.
  row.addEventListener("click", () => run(() => openSession(s.client_id)));
  return row;
}

function search() {
  clearTimeout(typing);
  paging.cursors = [""];
  return loadSessions();
}

async function openSession(clientId) {
  const s = await api("GET", sessionPath(clientId));
  selected = clientId;
  for (const row of $("sessions-body").rows) {
    row.classList.toggle("selected", row.dataset.clientId === clientId);
  }
  $("detail").hidden = false;
  $("detail-client-id").textContent = clientId;
  const backlog = s.backlog_detail || {};
  facts($("detail-facts"), [
    ["detail-state", "State", s.connected ? "connected" : "offline"],
    ["detail-persistent", "Persistent", s.persistent ? "yes" : "no"],
    ["detail-session-type", "Session type", text(s.session_type)],
    ["detail-backlog", "Backlog", text(s.backlog)],
    ["detail-in-flight", "In flight", text(s.in_flight)],
    ["detail-oldest", "Oldest stored", duration(backlog.oldest_age)],
    ["detail-packet-ids", "Stored packet IDs", backlog.packet_ids ? backlog.packet_ids.join(" to ") : "—"],
    ["detail-user", "Username", text(s.username)],
    ["detail-protocol", "Protocol", text(s.protocol)],
    ["detail-peer", "Peer", text(s.peer)],
    ["detail-replica", "Replica", text(s.replica)],
    ["detail-expiry", "Session expiry", s.session_expiry === null ? "never" : duration(s.session_expiry)],
    ["detail-connected-at", "Connected at", when(s.connected_at)],
    ["detail-last-seen", "Last seen", s.connected ? "now" : when(s.last_seen)],
  ]);
  $("kick").disabled = !s.connected;
  $("purge").disabled = !s.persistent;
  $("rewind").disabled = !s.persistent;
  const options = (sub) =>
    [sub.no_local && "no local", sub.retain_as_published && "retain as published",
     sub.retain_handling && "retain handling " + sub.retain_handling,
     sub.subscription_identifier && "id " + sub.subscription_identifier].filter(Boolean).join(", ");
  $("detail-subscriptions").tBodies[0].replaceChildren(
    ...(s.subscription_list || []).map((sub) =>
      el("tr", {}, el("td", { class: "mono" }, sub.filter), el("td", { class: "num" }, sub.qos),
        el("td", {}, options(sub))),
    ),
  );
  await peekMessages(clientId, s.persistent);
}

async function peekMessages(clientId, persistent) {
  const note = $("detail-messages-note");
  const body = $("detail-messages").tBodies[0];
  body.replaceChildren();
  note.hidden = true;
  if (!persistent) {
    note.textContent = "A clean session: its messages wait in memory, none are stored.";
    note.hidden = false;
    return;
  }
  let page;
  try {
    page = await api("GET", sessionPath(clientId, "messages"), { limit: PEEK, payload: true });
  } catch (error) {
    if (!(error instanceof ApiError) || error.status !== 409) throw error;
    note.textContent = error.message;
    note.hidden = false;
    return;
  }
  body.replaceChildren(
    ...page.items.map((m) =>
      el("tr", {}, el("td", { class: "num" }, m.packet_id), el("td", { class: "mono" }, m.topic),
        el("td", { class: "num" }, m.qos), el("td", { class: "num" }, m.size),
        el("td", {}, when(m.published_at)), el("td", {}, m.sent ? "yes" : "no"),
        el("td", { class: "mono" }, m.payload === undefined ? "" : payloadText(m.payload))),
    ),
  );
  if (page.items.length === 0) {
    note.textContent = "No stored messages.";
    note.hidden = false;
  }
}

function closeDetail() {
  selected = null;
  $("detail").hidden = true;
  for (const row of $("sessions-body").rows) row.classList.remove("selected");
}

async function sessionAction(what, question, method, path, done) {
  const clientId = selected;
  if (clientId === null || !confirm(question(clientId))) return;
  const result = await api(method, path(clientId));
  setStatus(done(clientId, result));
  if (what === "delete") closeDetail();
  else await openSession(clientId);
  await Promise.all([loadSessions(), loadStats()]);
}

// Deliver again (DUP) what the session's topics got since a time, read back from Kafka.
async function rewindSession() {
  const clientId = selected;
  const raw = $("rewind-since").value.trim();
  const since = /^\d+(\.\d+)?$/.test(raw) ? Number(raw) : raw;
  if (clientId === null || !confirm(`Deliver again to ${clientId} what was published since ${raw}?`)) {
    return;
  }
  const r = await api("POST", sessionPath(clientId, "rewind"), undefined, { since });
  setStatus(`Rewound ${clientId}: ${r.rewound} messages stored again ` +
    `(${r.matched} matched of ${r.records_read} records read).`);
  await openSession(clientId);
}

// -- queues ($ECQ and $queue group stores) -----------------------------------------------

async function loadQueues() {
  const { queues } = await api("GET", "queues", { kind: $("queues-kind").value, limit: 100 });
  const owners = await Promise.all(
    queues.map((q) => (q.kind === "ecq" ? api("GET", queuePath(q.client_id, "owner")) : null)),
  );
  $("queues-body").replaceChildren(
    ...queues.map((q, i) => {
      const holder = q.kind === "ecq"
        ? "owner " + text(owners[i].owner)
        : q.members ? "members subscribed" : "no members since " + when(q.unused_since);
      const actions = el("td", {},
        button("Purge", { class: "danger", "data-testid": "purge-queue" }, () => purgeQueue(q.client_id)));
      if (q.kind === "ecq") {
        actions.append(" ", button("Rewind", { "data-testid": "rewind-queue" }, () => rewindQueue(q.client_id)));
      }
      return el("tr", { "data-queue": q.client_id },
        el("td", { class: "mono" }, q.client_id), el("td", {}, q.kind === "ecq" ? "$ECQ" : "group"),
        el("td", { class: "num", "data-testid": "queue-pending" }, q.pending),
        el("td", { class: "num" }, q.keys), el("td", { class: "num", "data-testid": "queue-bytes" }, q.bytes),
        el("td", { class: "num" }, q.last_seq), el("td", { "data-testid": "queue-holder" }, holder),
        actions);
    }),
  );
  const note = $("queues-note");
  note.textContent = queues.length ? (queues.length >= 100 ? "Only the first 100 are shown." : "") : "No queues.";
  note.hidden = note.textContent === "";
}

async function purgeQueue(queueId) {
  if (!confirm(`Purge the queue ${queueId}? Every entry is deleted for good.`)) return;
  const r = await api("DELETE", queuePath(queueId));
  setStatus(`Purged ${queueId}: ${r.entries} entries (${r.pending} pending), ${r.bytes} bytes.`);
  await loadQueues();
}

async function rewindQueue(queueId) {
  const answer = prompt(`Deliver ${queueId} again from which sequence number?`, "1");
  if (answer === null) return;
  const seq = Number(answer.trim());
  if (!Number.isInteger(seq) || seq < 1) throw new Error("seq: a sequence number, 1 or more");
  const r = await api("POST", queuePath(queueId, "rewind"), undefined, { seq });
  setStatus(`Rewound ${queueId} from ${r.seq}: ${r.pending_again} entries pending again.`);
  await loadQueues();
}

// -- replicas and a topic's subscribers --------------------------------------------------

async function loadReplicas() {
  const { items } = await api("GET", "replicas");
  $("replicas-body").replaceChildren(
    ...items.map((r) =>
      el("tr", { "data-node": r.node },
        el("td", {}, r.here ? r.node + " (this one)" : r.node),
        el("td", {}, r.here ? "now" : when(r.last_seen)),
        el("td", { class: "num", "data-testid": "replica-connected" }, r.connected))),
  );
}

async function askSubscribers() {
  const topic = $("subscribers-topic").value;
  const page = await api("GET", "subscribers", { topic, limit: 100 });
  $("subscribers-body").replaceChildren(
    ...page.items.map((i) =>
      el("tr", { "data-client-id": i.client_id },
        el("td", {}, i.client_id), el("td", { class: "mono" }, i.filter),
        el("td", { class: "num" }, i.qos),
        el("td", {}, i.share_group === null ? "" : (i.group_queue ? "queue " : "shared ") + i.share_group),
        el("td", {}, i.replica))),
  );
  const note = $("subscribers-note");
  note.textContent = page.truncated ? `The first ${page.items.length} of ${page.count} are shown.`
    : page.items.length ? `${page.count} subscriptions match ${topic}.` : `Nobody subscribes to ${topic}.`;
  note.hidden = false;
}

// -- block list --------------------------------------------------------------------------

async function loadBlocked() {
  const { items } = await api("GET", "blocked");
  $("blocked-body").replaceChildren(
    ...items.map((e) =>
      el("tr", { "data-kind": e.kind, "data-value": e.value },
        el("td", {}, e.kind), el("td", { class: "mono" }, e.value), el("td", {}, e.reason),
        el("td", {}, e.by), el("td", {}, when(e.created)),
        el("td", {}, e.until ? when(e.until) : "for ever"),
        el("td", {}, button("Remove", { "data-testid": "unblock" }, () => unblock(e)))),
    ),
  );
  $("blocked-empty").hidden = items.length > 0;
}

async function block() {
  const ttl = $("block-ttl").value;
  const entry = { kind: $("block-kind").value, value: $("block-value").value.trim() };
  if ($("block-reason").value) entry.reason = $("block-reason").value;
  if (ttl) entry.ttl = Number(ttl);
  const result = await api("POST", "blocked", undefined, entry);
  setStatus(`Blocked ${entry.kind} ${result.value}; connections closed here: ${result.closed_here}.`);
  $("block-form").reset();
  await Promise.all([loadBlocked(), loadStats()]);
}

async function unblock(e) {
  if (!confirm(`Remove the block on ${e.kind} ${e.value}?`)) return;
  await api("DELETE", "blocked", { kind: e.kind, value: e.value });
  setStatus(`Removed the block on ${e.kind} ${e.value}.`);
  await Promise.all([loadBlocked(), loadStats()]);
}

// -- retained messages -------------------------------------------------------------------

async function loadRetained() {
  const page = await api("GET", "retained", { topic: $("retained-filter").value || "#", limit: 100 });
  $("retained-body").replaceChildren(
    ...page.items.map((r) =>
      el("tr", { "data-topic": r.topic },
        el("td", { class: "mono" }, r.topic), el("td", { class: "num" }, r.qos),
        el("td", { class: "num" }, r.size), el("td", {}, r.origin),
        el("td", {}, button("Delete", { class: "danger", "data-testid": "delete-retained" },
          () => deleteRetained(r.topic)))),
    ),
  );
  const note = $("retained-note");
  note.textContent = page.truncated ? "Only the first 100 are shown: narrow the filter."
    : page.items.length ? "" : "No retained messages match.";
  note.hidden = note.textContent === "";
}

async function deleteRetained(topic) {
  if (!confirm(`Delete the retained message of ${topic}?`)) return;
  await api("DELETE", "retained", { topic });
  setStatus(`Deleted the retained message of ${topic}.`);
  await Promise.all([loadRetained(), loadStats()]);
}

// -- wiring ------------------------------------------------------------------------------

async function loadAll() {
  const results = await Promise.allSettled(
    [loadStats(), loadSessions(), loadBlocked(), loadRetained(), loadQueues(), loadReplicas()]);
  const failed = results.find((r) => r.status === "rejected");
  if (failed) throw failed.reason;
}

function onSubmit(id, action) {
  $(id).addEventListener("submit", (event) => {
    event.preventDefault();
    run(action);
  });
}

function onClick(id, action) {
  $(id).addEventListener("click", () => run(action));
}

// -- auto-refresh ------------------------------------------------------------------------

let refreshes = 0; // completed automatic refreshes (data-refreshes on #updated)

async function autoRefresh() {
  if (document.hidden || !$("auto-refresh").checked) return;
  try {
    await Promise.all([loadStats(), loadSessions(), loadBlocked(), loadReplicas()]);
  } catch (error) {
    showError(error);
    return;
  }
  refreshes += 1;
  $("updated").textContent = "updated " + when(Date.now() / 1000);
  $("updated").dataset.refreshes = String(refreshes);
}

function showTokenState() {
  $("token").placeholder = token() ? "token set (this tab)" : "none";
}

function init() {
  onSubmit("token-form", () => {
    sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
    $("token").value = "";
    showTokenState();
    return loadAll();
  });
  onClick("token-clear", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    showTokenState();
    clearData();
    return loadAll();
  });
  onSubmit("session-search", search);
  for (const id of ["filter-connected", "filter-persistent"]) {
    $(id).addEventListener("change", () => run(search));
  }
  $("search-prefix").addEventListener("input", () => {
    clearTimeout(typing);
    typing = setTimeout(() => run(search), 300);
  });
  onClick("next-page", () => {
    paging.cursors.push(paging.next);
    return loadSessions();
  });
  onClick("previous-page", () => {
    if (paging.cursors.length > 1) paging.cursors.pop();
    return loadSessions();
  });
  onClick("first-page", search);
  onClick("refresh-sessions", loadSessions);
  onClick("refresh-detail", () => openSession(selected));
  onClick("close-detail", closeDetail);
  onClick("kick", () => sessionAction("kick",
    (c) => `Disconnect ${c}? Its session stays; the client may connect again.`,
    "POST", (c) => sessionPath(c, "disconnect"), (c) => `Disconnected ${c}.`));
  onClick("purge", () => sessionAction("purge",
    (c) => `Purge the backlog of ${c}? Its stored messages are deleted for good ` +
      "(messages in flight stay until acknowledged).",
    "DELETE", (c) => sessionPath(c, "messages"), (c, r) => `Purged ${r.purged} messages of ${c}.`));
  onClick("delete-session", () => sessionAction("delete",
    (c) => `Delete the session of ${c}? The client is disconnected and its subscriptions ` +
      "and stored messages are deleted.",
    "DELETE", (c) => sessionPath(c), (c) => `Deleted the session of ${c}.`));
  onSubmit("block-form", block);
  onSubmit("retained-form", loadRetained);
  onSubmit("queues-form", loadQueues);
  onSubmit("subscribers-form", askSubscribers);
  onSubmit("rewind-form", rewindSession);
  showTokenState();
  run(loadAll);
  setInterval(autoRefresh, REFRESH_EVERY_MS);
}

init();
