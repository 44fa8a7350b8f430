"use strict";
// Encore's page: a plain client of the JSON API (the same endpoints curl uses). No framework, no build.
// Every piece of server or user text goes into the DOM as a text node (see el()), never as HTML.

const POLL_MS = 1000;
const HIDDEN_POLL_MS = 5000;       // a background tab still updates, just less often
const STREAMED_POLL_MS = 5000;     // every open job follows its event stream: the list and status refresh slowly
const REFRESH_MS = 250;            // after an event, a job's record is read again at most this often
const TOKEN_KEY = "encore.apiToken";
const STAGES = {                   // app/kinds.py: stage key (the track's `stage`) and its label
  music: [["backbone", "backbone"], ["superres", "super-res"], ["decode", "decode"], ["export", "export"]],
  lipsync: [["prepare", "prepare"], ["lipsync", "lip-sync"], ["mux", "mux"]],
};
const TERMINAL = new Set(["done", "failed", "canceled", "partial"]);
const RETRYABLE = new Set(["failed", "canceled", "partial"]); // POST /api/v1/jobs/<id>/retry re-runs their tracks
const PAGE_SIZE = 20;              // jobs per page of the list (GET /api/v1/jobs?limit=&offset=&q=)
const SEARCH_DELAY_MS = 250;       // typing in the search box lists again once it pauses this long
const MAX_STREAMS = 4;             // a browser opens ~6 connections per server: leave some for the API calls
const WAVE_HEIGHT = 56;            // px of a track's waveform canvas (its width is its box's)

const $ = (selector, root = document) => root.querySelector(selector);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child !== null && child !== undefined && child !== false) node.append(child); // strings become text
  }
  return node;
}

// ---- token + API -------------------------------------------------------------------------------------------

function getToken() {
  try { return localStorage.getItem(TOKEN_KEY) || ""; } catch (_) { return ""; }
}

function setToken(value) {
  try {
    if (value) localStorage.setItem(TOKEN_KEY, value); else localStorage.removeItem(TOKEN_KEY);
  } catch (_) { /* storage disabled: the token lasts until reload */ memoryToken = value; }
}
let memoryToken = "";
const token = () => getToken() || memoryToken;

function authHeaders() {
  const value = token();
  return value ? { Authorization: `Bearer ${value}` } : {};
}

class ApiError extends Error {
  constructor(status, message, field) { super(message); this.status = status; this.field = field; }
}

async function api(path, options = {}) {
  const reply = await fetch(path, { ...options, headers: { ...authHeaders(), ...(options.headers || {}) } });
  let body = null;
  try { body = await reply.json(); } catch (_) { /* not JSON (a proxy error page): reported below */ }
  $("#token-needed").hidden = reply.status !== 401;
  if (!reply.ok) {
    const message = (body && body.error) || `${reply.status} ${reply.statusText}`;
    throw new ApiError(reply.status, message, body && body.field);
  }
  return body;
}

// ---- polling ---------------------------------------------------------------------------------------------

let inFlight = null;
let timer = 0;
let pollAgain = false; // asked for while a poll ran (a new search, another page): poll once it is back

function pollSoon() {
  clearTimeout(timer);
  if (inFlight) { pollAgain = true; return; } // the running poll schedules the next one
  inFlight = poll().finally(() => {
    inFlight = null;
    if (pollAgain) { pollAgain = false; pollSoon(); return; }
    timer = setTimeout(pollSoon, document.hidden ? HIDDEN_POLL_MS : allStreamed() ? STREAMED_POLL_MS : POLL_MS);
  });
}

// ---- server-sent events (GET /api/v1/jobs/<id>/events): an open job's view follows its stream -------------
// EventSource cannot send an Authorization header: with an API token the page keeps polling (the fallback).

const streams = new Map(); // job_id -> EventSource

function canStream() { return typeof EventSource === "function" && !token(); }

function allStreamed() {
  for (const [id, view] of views) {
    if (!TERMINAL.has(view.root.dataset.state) && !streams.has(id)) return false;
  }
  return true;
}

function follow(view, job) {
  if (!canStream() || TERMINAL.has(job.state) || streams.has(job.job_id)) return;
  if (streams.size >= MAX_STREAMS) return; // the others are polled; a stream frees up when its job ends
  const source = new EventSource(`/api/v1/jobs/${encodeURIComponent(job.job_id)}/events`);
  streams.set(job.job_id, source);
  view.events = 0;
  view.root.dataset.events = "connecting";
  source.onopen = () => { view.root.dataset.events = "live"; };
  source.onmessage = () => {  // a track changed: read the record (stages, queue positions) again, throttled
    view.events += 1;
    view.root.dataset.eventCount = String(view.events);
    refreshSoon(view, job.job_id);
  };
  source.addEventListener("end", () => {  // the job ended: close, or EventSource would reconnect
    unfollow(job.job_id);
    view.root.dataset.events = "ended";
    refreshSoon(view, job.job_id, 0);
  });
  source.onerror = () => {  // it reconnects by itself with Last-Event-ID; polling covers the gap
    if (source.readyState === EventSource.CLOSED) {
      unfollow(job.job_id);
      view.root.dataset.events = "failed";
    } else {
      view.root.dataset.events = "reconnecting";
    }
  };
}

function unfollow(jobId) {
  const source = streams.get(jobId);
  if (source) source.close();
  streams.delete(jobId);
}

function refreshSoon(view, jobId, delay = REFRESH_MS) {
  if (view.refreshing) return;
  view.refreshing = setTimeout(async () => {
    try {
      updateJobView(view, await api(`/api/v1/jobs/${encodeURIComponent(jobId)}`));
    } catch (_) { /* the next list poll shows it */ }
    view.refreshing = 0;
  }, delay);
}

async function poll() {
  try {
    // The worker table is for admin tenants: a client's token gets 403 there and sees its own jobs only.
    const adminOnly = (err) => { if (err.status === 403) return null; throw err; };
    const asked = listingUrl();
    const [jobs, status] = await Promise.all([api(asked), api("/api/v1/status").catch(adminOnly)]);
    if (asked === listingUrl()) showListing(jobs.jobs || []);
    else pollAgain = true; // the search or page changed meanwhile: this answer is for the old one
    if (status) renderStatus(status);
    setConn("live", `live · ${new Date().toLocaleTimeString()}`);
  } catch (err) {
    setConn(err.status === 401 ? "token" : "error", err.status === 401 ? "API token needed" : `offline: ${err.message}`);
  }
}

function setConn(state, text) {
  const conn = $("#conn");
  conn.dataset.state = state;
  conn.textContent = text;
}

// ---- workers and queues -------------------------------------------------------------------------------------

function renderStatus(status) {
  const now = status.time || Date.now() / 1000; // the server's clock: "seen" never suffers from client skew
  const workers = status.workers || [];
  $("#workers tbody").replaceChildren(...workers.map((w) => {
    const current = w.current
      ? `${shortId(w.current.job_id)} #${w.current.track + 1} · ${w.current.stage} · ${ago(now - w.current.since)}`
      : "";
    const memory = w.gpu_total_bytes ? ` · ${gib(w.gpu_free_bytes)}/${gib(w.gpu_total_bytes)} GiB free` : "";
    return el("tr", { "data-worker": w.name, "data-status": w.status },
      el("td", null, w.name),
      el("td", null, el("span", { class: `badge s-${w.status}` }, w.status)),
      el("td", null, w.queue || ""),
      el("td", null, `${w.device || ""}${memory}`, w.runtime_mode ? el("div", { class: "hint" }, w.runtime_mode) : null),
      el("td", null, current),
      el("td", null, w.last_seen ? `${ago(now - Number(w.last_seen))} ago` : ""));
  }));
  $("#workers-empty").hidden = workers.length > 0;
  const queues = status.queues || [];
  $("#queues").hidden = queues.length === 0;
  $("#queues tbody").replaceChildren(...queues.map((q) => el("tr", { "data-queue": q.name, "data-draining": q.draining ? "1" : "0" },
    el("td", null, q.name), el("td", null, q.waiting), el("td", null, q.outstanding),
    el("td", null, Math.round(q.estimated_load || 0)),
    el("td", null, q.draining ? "draining " : "routed here ",
      el("button", { type: "button", class: "drain", onclick: (event) => setDraining(q.name, !q.draining, event.target) },
        q.draining ? "Resume" : "Drain")))));
  $("#unrouted").textContent = status.unrouted ? `${status.unrouted} track(s) waiting for a worker to start` : "";
}

// ---- the job list: one page of it, of every job or of those the search matches (the server pages and searches)

const listing = { page: 0, query: "", hasMore: false, shown: 0 };

function listingUrl() {
  // One more than a page is asked for: when it comes, a next page exists.
  const params = new URLSearchParams({ limit: PAGE_SIZE + 1, offset: listing.page * PAGE_SIZE });
  if (listing.query) params.set("q", listing.query);
  return `/api/v1/jobs?${params}`;
}

function showListing(jobs) {
  if (!jobs.length && listing.page > 0) { // the page emptied (jobs expired): back to the first one
    goToPage(0);
    return;
  }
  listing.hasMore = jobs.length > PAGE_SIZE;
  listing.shown = Math.min(jobs.length, PAGE_SIZE);
  renderJobs(jobs.slice(0, PAGE_SIZE));
  renderPager();
}

function renderPager() {
  const first = listing.page * PAGE_SIZE;
  const pager = $("#jobs-pager");
  pager.dataset.page = String(listing.page + 1);
  pager.dataset.hasMore = listing.hasMore ? "1" : "0";
  pager.hidden = listing.page === 0 && !listing.hasMore;
  $("#jobs-prev").disabled = listing.page === 0;
  $("#jobs-next").disabled = !listing.hasMore;
  $("#jobs-page").textContent = listing.shown ? `page ${listing.page + 1} · jobs ${first + 1}–${first + listing.shown}` : "";
  $("#jobs-empty").textContent = listing.query ? `No job matches “${listing.query}”.` : "No jobs yet.";
}

function goToPage(page) {
  listing.page = Math.max(0, page);
  pollSoon();
}

function search(query) {
  if (query === listing.query) return;
  listing.query = query;
  goToPage(0);
}

function setUpJobList() {
  const box = $("#job-search");
  let typing = 0;
  box.addEventListener("input", () => {
    clearTimeout(typing);
    typing = setTimeout(() => search(box.value.trim()), SEARCH_DELAY_MS);
  });
  $("#jobs-search").addEventListener("submit", (event) => {
    event.preventDefault();
    clearTimeout(typing);
    search(box.value.trim());
  });
  $("#jobs-prev").addEventListener("click", () => goToPage(listing.page - 1));
  $("#jobs-next").addEventListener("click", () => goToPage(listing.page + 1));
}

// ---- jobs -------------------------------------------------------------------------------------------------

const views = new Map(); // job_id -> {root, tracks: [{root, media}], blobUrls: []}

function renderJobs(jobs) {
  const list = $("#jobs");
  const seen = new Set();
  jobs.forEach((job, index) => {
    seen.add(job.job_id);
    let view = views.get(job.job_id);
    if (!view) {
      view = createJobView(job);
      views.set(job.job_id, view);
    }
    updateJobView(view, job);
    follow(view, job);
    // Only move a node that is out of place: moving a playing <audio> pauses it.
    if (list.children[index] !== view.root) list.insertBefore(view.root, list.children[index] || null);
  });
  for (const [id, view] of views) {
    if (!seen.has(id)) dropView(id, view);
  }
  $("#jobs-empty").hidden = jobs.length > 0;
}

function dropView(id, view) {
  unfollow(id);
  view.root.remove();
  view.blobUrls.forEach((url) => URL.revokeObjectURL(url));
  views.delete(id);
}

function createJobView(job) {
  const view = { root: null, tracks: [], blobUrls: [] };
  view.cancel = el("button", { type: "button", class: "cancel", onclick: () => cancelJob(job.job_id, view) }, "Cancel");
  view.retry = el("button", { type: "button", class: "retry", hidden: true, onclick: () => retryJob(job.job_id, view) },
    "Retry");
  view.state = el("span", { class: "badge" });
  view.position = el("span", { class: "position" });
  view.eta = el("span", { class: "eta" });
  view.offline = el("span", { class: "offline", hidden: true }, "no worker online · resumes when one is back");
  view.etaAt = null;
  view.message = el("p", { class: "error" });
  view.trackList = el("div", { class: "tracks" });
  view.root = el("article", { class: "job", "data-job-id": job.job_id, "data-kind": job.kind },
    el("header", null,
      el("span", { class: "kind" }, job.kind), " ",
      el("code", { title: job.job_id }, shortId(job.job_id)), " ", view.state, " ", view.position, " ", view.eta, " ", view.offline,
      el("span", { class: "when" }, new Date(job.created_at * 1000).toLocaleTimeString()),
      view.cancel, view.retry),
    el("p", { class: "summary" }, summary(job)),
    view.message,
    view.trackList);
  return view;
}

function summary(job) {
  const p = job.params || {};
  if (job.kind === "lipsync") {
    return [`${num(p.audio_duration_s)} s audio`, `${p.output_frames} frames at ${p.fps} fps`,
      p.width ? `${p.width}×${p.height} video` : ""].filter(Boolean).join(" · ");
  }
  return [p.mode, p.tags, p.prompt, `${num(p.duration_s)} s`, `${job.num_tracks} track${job.num_tracks > 1 ? "s" : ""}`,
    p.seed !== undefined ? `seed ${p.seed}` : ""].filter(Boolean).join(" · ");
}

function updateJobView(view, job) {
  view.root.dataset.state = job.state;
  view.state.className = `badge s-${job.state}`;
  view.state.textContent = job.state;
  view.position.textContent = job.state === "queued" && job.queue_position > 0 ? `#${job.queue_position} in queue` : "";
  view.cancel.hidden = TERMINAL.has(job.state);
  if (view.cancel.hidden) view.cancel.disabled = false;
  view.retry.hidden = !RETRYABLE.has(job.state);
  view.offline.hidden = !job.worker_offline || TERMINAL.has(job.state); // the record's flag: nothing runs it now
  view.root.dataset.workerOffline = view.offline.hidden ? "0" : "1";
  setEta(view, job);
  job.tracks.forEach((track, index) => {
    if (!view.tracks[index]) {
      view.tracks[index] = createTrackView(job, index);
      view.trackList.append(view.tracks[index].root);
    }
    updateTrackView(view, view.tracks[index], job, track);
  });
}

// ---- ETA: the record's `eta_s` (null while no live worker can take a track), counted down between updates ------

function setEta(view, job) {
  const known = !TERMINAL.has(job.state) && job.eta_s !== null && job.eta_s !== undefined;
  view.etaAt = known ? Date.now() / 1000 + Number(job.eta_s) : null;
  showEta(view);
}

function showEta(view) {
  const eta = view.eta;
  if (TERMINAL.has(view.root.dataset.state)) {
    eta.textContent = "";
    delete eta.dataset.eta;
  } else if (view.etaAt === null) {
    eta.textContent = "ETA unknown";
    eta.title = "no live worker can take its tracks yet";
    eta.dataset.eta = "unknown";
  } else {
    const left = Math.max(0, view.etaAt - Date.now() / 1000);
    eta.textContent = `ETA ${ago(left)}`;
    eta.title = "estimated time until it is done, the work queued ahead of it included";
    eta.dataset.eta = String(Math.round(left));
  }
}

function tickEtas() {
  for (const view of views.values()) showEta(view);
}

function createTrackView(job, index) {
  const tv = { media: null };
  tv.state = el("span", { class: "badge" });
  tv.info = el("span", { class: "info" });
  tv.restarts = el("span", { class: "restarts", title: "times a worker's crash or loss made it run again" });
  tv.error = el("p", { class: "error" });
  tv.stages = {};
  const bars = (STAGES[job.kind] || []).map(([key, label]) => {
    const fill = el("div", { class: "fill" });
    const text = el("span", { class: "stage-text" });
    tv.stages[key] = { root: null, fill, text };
    tv.stages[key].root = el("div", { class: "stage", "data-stage": key, "data-status": "pending" },
      el("div", { class: "stage-label" }, el("span", null, label), text),
      el("div", { class: "bar", role: "progressbar", "aria-label": label, "aria-valuemin": 0, "aria-valuemax": 100 }, fill));
    return tv.stages[key].root;
  });
  tv.mediaBox = el("div", { class: "media" });
  const label = job.kind === "music" ? `Track ${index + 1}` : "Output";
  tv.root = el("div", { class: "track", "data-track": index },
    el("div", { class: "track-head" }, el("strong", null, label), " ", tv.state, " ", tv.restarts, " ", tv.info),
    el("div", { class: "stages" }, bars), tv.error, tv.mediaBox);
  return tv;
}

// The track's detail beside its state badge, without the state's own word ("canceled during backbone" next to
// the badge "canceled" reads "during backbone"), nothing when the detail is only the state.
function detailAfterState(track) {
  const detail = track.detail || "";
  if (detail === track.state) return "";
  return detail.startsWith(`${track.state} `) ? detail.slice(track.state.length + 1) : detail;
}

function updateTrackView(view, tv, job, track) {
  tv.root.dataset.state = track.state;
  tv.state.className = `badge s-${track.state}`;
  tv.state.textContent = track.state;
  const info = [];
  if (track.state === "queued") {
    info.push(track.queue ? `queue ${track.queue}` : "", track.queue_position ? `position ${track.queue_position}` : "");
  }
  info.push(detailAfterState(track), track.worker || "");
  if (track.worker_status === "offline") info.push("worker offline");
  if (track.retries > 0) info.push(`retried ${track.retries}×`);
  tv.info.textContent = info.filter(Boolean).join(" · ");
  const restarts = Number(track.restarts) || 0;
  tv.restarts.textContent = restarts > 0 ? `restarted ${restarts}×` : "";
  tv.restarts.dataset.restarts = String(restarts);
  tv.error.textContent = track.error || "";

  const stages = track.stages || {};
  const keys = (STAGES[job.kind] || []).map(([key]) => key);
  const reached = keys.indexOf(track.stage);
  keys.forEach((key, i) => {
    const bar = tv.stages[key];
    const timing = stages[key] || {};
    let status = "pending";
    let fraction = 0;
    if (timing.finished_at) {
      status = "done";
      fraction = 1;
    } else if (i === reached && track.stage) {
      // The stage the track is in (or stopped in): its own progress, coloured by how it ended.
      status = TERMINAL.has(track.state) ? track.state : "running";
      fraction = Math.max(0, Math.min(1, Number(track.progress) || 0));
    }
    bar.root.dataset.status = status;
    bar.fill.style.width = `${(fraction * 100).toFixed(1)}%`;
    bar.root.lastChild.setAttribute("aria-valuenow", Math.round(fraction * 100));
    bar.text.textContent = status === "done" ? `${num(timing.duration_s)} s`
      : status === "running" ? `${Math.round(fraction * 100)}%` : "";
    bar.root.title = status === "running" && track.detail ? track.detail : status;
  });

  if (track.state === "done" && !tv.media) {
    tv.media = true; // set at once: the next poll must not start a second download
    showMedia(view, tv, job, track).catch((err) => { tv.error.textContent = `media: ${err.message}`; tv.media = null; });
  }
}

function downloadsOf(job, track) {
  if (track.downloads) return track.downloads;
  // A record without `downloads`: the same URLs GET /api/v1/jobs/<id> would list.
  const urls = {};
  for (const name of track.artifacts || []) {
    if (name === "output.mp4") urls.mp4 = `/api/v1/jobs/${job.job_id}/video.mp4`;
    const match = /^track(\d+)\.(mp3|wav)$/.exec(name);
    if (match) urls[match[2]] = `/api/v1/jobs/${job.job_id}/tracks/${match[1]}.${match[2]}`;
  }
  return urls;
}

async function blobUrl(view, url) {
  // <audio src> and <a href> cannot send headers: with a token, fetch the file and hand over a blob: URL.
  const reply = await fetch(url, { headers: authHeaders() });
  if (!reply.ok) throw new Error(`${reply.status} ${reply.statusText}`);
  const local = URL.createObjectURL(await reply.blob());
  view.blobUrls.push(local);
  return local;
}

async function showMedia(view, tv, job, track) {
  const downloads = downloadsOf(job, track);
  const formats = Object.keys(downloads);
  if (!formats.length) return;
  const playable = downloads.mp4 ? "mp4" : downloads.mp3 ? "mp3" : formats[0];
  const player = playable === "mp4"
    ? el("video", { controls: true, preload: "metadata", playsinline: true })
    : el("audio", { controls: true, preload: "metadata" });
  const playUrl = token() ? await blobUrl(view, downloads[playable]) : downloads[playable];
  player.src = playUrl;
  const base = `encore-${shortId(job.job_id)}-${job.kind === "music" ? `track${track.track}` : "lipsync"}`;
  const links = formats.map((fmt) => {
    const link = el("a", { href: fmt === playable ? playUrl : downloads[fmt], download: `${base}.${fmt}`,
      "data-format": fmt }, `⬇ ${fmt}`);
    // With a token, other formats (a WAV can be large) are fetched only when clicked.
    if (token()) link.addEventListener("click", (event) => tokenDownload(event, view, link, downloads[fmt]));
    return [link, " "];
  });
  const wave = job.kind === "music" && playable !== "mp4" ? waveformOf(playUrl, player) : null;
  tv.mediaBox.replaceChildren(...[wave, player, el("span", { class: "downloads" }, links)].filter(Boolean));
}

// ---- a finished track's waveform: its audio fetched, decoded by the browser, min/max per pixel column --------

function waveformOf(url, player) {
  const canvas = el("canvas", { class: "waveform", height: WAVE_HEIGHT, "aria-label": "waveform", role: "img" });
  // Drawn once the canvas is in the page (its width is then known).
  requestAnimationFrame(() => drawWaveform(canvas, url, player).catch((err) => {
    canvas.dataset.error = err.message;
    canvas.title = `waveform: ${err.message}`;
    canvas.hidden = true;
  }));
  return canvas;
}

async function drawWaveform(canvas, url, player) {
  const reply = await fetch(url, { headers: authHeaders() }); // a blob: URL when there is a token
  if (!reply.ok) throw new Error(`${reply.status} ${reply.statusText}`);
  const audio = await decodeAudio(await reply.arrayBuffer());
  const scale = window.devicePixelRatio || 1;
  canvas.width = Math.max(1, Math.round((canvas.clientWidth || 480) * scale));
  canvas.height = Math.round(WAVE_HEIGHT * scale);
  paintPeaks(canvas, peaks(audio, canvas.width));
  canvas.dataset.duration = audio.duration.toFixed(3);
  canvas.dataset.drawn = "1";
  canvas.title = "click to play from there";
  canvas.addEventListener("click", (event) => {
    player.currentTime = (event.offsetX / canvas.clientWidth) * audio.duration;
    player.play().catch(() => { /* the browser wants a gesture it did not count: the player's own button works */ });
  });
}

function decodeAudio(bytes) {
  // An offline context decodes without an audio device and without a user's gesture.
  return new OfflineAudioContext(1, 1, 44100).decodeAudioData(bytes);
}

function peaks(audio, columns) {
  // [lowest, highest] sample of each pixel column, over every channel.
  const channels = Array.from({ length: audio.numberOfChannels }, (_, c) => audio.getChannelData(c));
  const perColumn = audio.length / columns;
  const result = [];
  for (let x = 0; x < columns; x += 1) {
    const start = Math.floor(x * perColumn);
    const end = Math.min(audio.length, Math.max(start + 1, Math.floor((x + 1) * perColumn)));
    let low = 0;
    let high = 0;
    for (const data of channels) {
      for (let i = start; i < end; i += 1) {
        if (data[i] < low) low = data[i];
        else if (data[i] > high) high = data[i];
      }
    }
    result.push([low, high]);
  }
  return result;
}

function paintPeaks(canvas, columns) {
  const context = canvas.getContext("2d");
  const middle = canvas.height / 2;
  context.clearRect(0, 0, canvas.width, canvas.height);
  context.fillStyle = getComputedStyle(canvas).color;
  columns.forEach(([low, high], x) => {
    const top = middle - Math.min(1, high) * middle;
    const bottom = middle - Math.max(-1, low) * middle;
    context.fillRect(x, top, 1, Math.max(1, bottom - top)); // silence still draws its centre line
  });
}

async function tokenDownload(event, view, link, url) {
  if (link.href.startsWith("blob:")) return; // fetched already: let the browser save it
  event.preventDefault();
  try {
    link.href = await blobUrl(view, url);
    link.click();
  } catch (err) {
    link.title = `download failed: ${err.message}`;
    link.classList.add("failed");
  }
}

async function cancelJob(jobId, view) {
  view.cancel.disabled = true;
  view.message.textContent = "";
  try {
    const record = await api(`/api/v1/jobs/${encodeURIComponent(jobId)}`, { method: "DELETE" });
    updateJobView(view, record);
  } catch (err) {
    view.message.textContent = `cancel failed: ${err.message}`;
    view.cancel.disabled = false;
  }
  pollSoon();
}

async function retryJob(jobId, view) {
  view.retry.disabled = true;
  view.message.textContent = "";
  try {
    const record = await api(`/api/v1/jobs/${encodeURIComponent(jobId)}/retry`, { method: "POST" });
    updateJobView(view, record);
    follow(view, record);
  } catch (err) {
    // A refusal names its reason (403 `retries`: the limit was reached; 409 `job`: it runs again already).
    view.message.textContent = `retry ${err.status ? "refused" : "failed"}: ${err.message}`;
  } finally {
    view.retry.disabled = false;
  }
  pollSoon();
}

async function setDraining(queue, drain, button) {
  button.disabled = true;
  try {
    await api(`/api/v1/queues/${encodeURIComponent(queue)}/drain`, { method: drain ? "POST" : "DELETE" });
  } catch (err) {
    button.title = `${drain ? "drain" : "resume"} failed: ${err.message}`;
    button.disabled = false;
  }
  pollSoon();
}

// ---- forms ------------------------------------------------------------------------------------------------

function numberField(form, name) {
  const raw = form.elements[name].value.trim();
  return raw === "" ? undefined : Number(raw); // a number, not a string: the API is strict about types
}

function musicBody(form) {
  const body = { mode: form.elements.mode.value };
  for (const name of ["tags", "prompt"]) {
    const value = form.elements[name].value.trim();
    if (value) body[name] = value;
  }
  if (body.mode === "vocal") body.lyrics = form.elements.lyrics.value;
  body.priority = form.elements.priority.value; // orders first stages across jobs (high, normal, low)
  for (const name of ["duration_s", "num_tracks", "seed", "temperature", "top_k"]) {
    const value = numberField(form, name);
    if (value !== undefined) body[name] = value;
  }
  return body;
}

function lipsyncBody(form) {
  const data = new FormData();
  for (const name of ["video", "audio"]) {
    const file = form.elements[name].files[0];
    if (file) data.append(name, file);
  }
  for (const name of ["fps", "extra_margin", "batch_size", "priority"]) {
    const value = form.elements[name].value.trim();
    if (value !== "") data.append(name, value);
  }
  return data;
}

async function submit(form, message, request) {
  const button = form.querySelector("button[type=submit]");
  button.disabled = true;
  form.querySelectorAll("[aria-invalid]").forEach((input) => input.removeAttribute("aria-invalid"));
  message.className = "msg";
  message.textContent = "submitting…";
  delete message.dataset.jobId;
  try {
    const reply = await request();
    message.replaceChildren("Submitted job ", el("code", null, shortId(reply.job_id)),
      reply.queue_position ? ` · #${reply.queue_position} in queue` : "", reply.note ? ` · ${reply.note}` : "");
    message.dataset.jobId = reply.job_id;
    goToPage(0); // where the newest job is listed
  } catch (err) {
    message.className = "msg error";
    message.textContent = err.message;
    const input = err.field && form.elements[err.field];
    if (input && input.setAttribute) {
      input.setAttribute("aria-invalid", "true");
      input.focus();
    }
  } finally {
    button.disabled = false;
  }
}

function setUpForms() {
  const music = $("#music-form");
  const syncLyrics = () => { music.querySelector(".lyrics").hidden = music.elements.mode.value !== "vocal"; };
  music.elements.mode.addEventListener("change", syncLyrics);
  syncLyrics();
  music.addEventListener("submit", (event) => {
    event.preventDefault();
    submit(music, $("#music-msg"), () => api("/api/v1/music", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(musicBody(music)),
    }));
  });

  const lipsync = $("#lipsync-form");
  lipsync.addEventListener("submit", (event) => {
    event.preventDefault();
    submit(lipsync, $("#lipsync-msg"), () => api("/api/v1/lipsync", { method: "POST", body: lipsyncBody(lipsync) }));
  });

  const tokenForm = $("#token-form");
  const tokenInput = $("#token");
  tokenInput.value = token();
  const changed = (value) => {
    setToken(value);
    memoryToken = value;
    // Players made with the old token (plain URLs or old blobs) are rebuilt by the next poll.
    for (const [id, view] of views) dropView(id, view);
    pollSoon();
  };
  tokenForm.addEventListener("submit", (event) => { event.preventDefault(); changed(tokenInput.value.trim()); });
  $("#token-clear").addEventListener("click", () => { tokenInput.value = ""; changed(""); });
}

// ---- small formatting helpers --------------------------------------------------------------------------------

function shortId(id) { return String(id || "").slice(0, 8); }
function num(value) { return value === undefined || value === null ? "?" : String(Math.round(Number(value) * 10) / 10); }
function gib(bytes) { return (Number(bytes || 0) / 2 ** 30).toFixed(1); }
function ago(seconds) {
  const s = Math.max(0, Math.round(Number(seconds) || 0));
  return s < 120 ? `${s} s` : s < 7200 ? `${Math.round(s / 60)} min` : `${Math.round(s / 3600)} h`;
}

document.addEventListener("visibilitychange", () => { if (!document.hidden) pollSoon(); });
setUpForms();
setUpJobList();
setInterval(tickEtas, 1000);
pollSoon();
