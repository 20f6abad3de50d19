// The node's page: polls /ui/state once a second (the snapshot `provider status --json` reads) and draws it;
// a chat box streams from /v1/chat/completions. The session cookie is HttpOnly: this script never sees it.
"use strict";
(function () {
  const POLL_MS = 1000;
  const HOUR_S = 3600;
  const $ = (name) => document.querySelector(`[data-field="${name}"]`);
  const state = {seq: 0, pid: null, started: null, history: [], models: [], last: null, busy: null};

  // --- formatting: one rule for every figure (tests format /health's numbers the same way) ---
  const MiB = 1048576, GiB = 1073741824;
  function bytes(n) {
    if (n === null || n === undefined) return "–";
    return n >= GiB ? `${(n / GiB).toFixed(2)} GiB` : `${(n / MiB).toFixed(1)} MiB`;
  }
  function count(n) { return n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"); }
  function duration(s) {
    if (s === null || s === undefined) return "–";
    s = Math.max(0, Math.round(s));
    const d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600), m = Math.floor(s % 3600 / 60);
    return d ? `${d} d ${h} h` : h ? `${h} h ${m} min` : m ? `${m} min ${s % 60} s` : `${s} s`;
  }
  function when(unix) { return unix ? new Date(unix * 1000).toLocaleString() : "–"; }
  function set(name, text, value) {
    const e = $(name);
    if (!e) return;
    if (e.textContent !== text) e.textContent = text;
    if (value !== undefined) e.dataset.value = String(value);
  }

  // --- the live link ---
  function link(ok, text) {
    $("link-dot").className = `dot ${ok ? "on" : "off"}`;
    set("link", text);
  }

  async function poll() {
    const started = performance.now();
    try {
      const r = await fetch(`/ui/state?since=${state.seq}`, {cache: "no-store", credentials: "same-origin"});
      if (r.status === 401) {
        link(false, "signed out: open a new link from `provider status --open`");
      } else if (!r.ok) {
        link(false, `the node answered ${r.status}; retrying`);
      } else {
        render(await r.json());
        link(true, `live · updated ${new Date().toLocaleTimeString()}`);
      }
    } catch (e) {
      link(false, "the node does not answer (restarting?); retrying every second");
    }
    setTimeout(poll, Math.max(0, POLL_MS - (performance.now() - started)));  // once a second, whatever it took
  }

  function render(body) {
    const n = body.node;
    let samples = body.history;
    if (n.pid !== state.pid || n.started_at !== state.started) {  // another process: its history starts anew
      if (state.pid !== null && state.seq !== 0) samples = [];  // asked after the old one's: ask again from 0
      state.pid = n.pid; state.started = n.started_at; state.seq = 0; state.history = [];
    }
    for (const s of samples) state.history.push(s);
    if (samples.length) state.seq = samples[samples.length - 1].seq;
    const cutoff = body.now - HOUR_S;
    while (state.history.length && state.history[0].t < cutoff) state.history.shift();
    state.last = body;
    renderNode(n);
    renderMemory(n, body.os);
    renderModels(n, body.now);
    renderCharts(body.now);
    renderTrust(n);
    set("sample-every", String(body.sample_every_s));
  }

  function renderNode(n) {
    set("version", `v${n.version}`);
    const h = $("health");
    set("health", n.health);
    h.className = `pill ${n.health}`;
    set("uptime", duration(n.uptime_s), n.uptime_s);
    set("pid", `pid ${n.pid}`, n.pid);
    set("mode", n.mode || "none");
    set("default-model", n.default_model || "none");
    const p = n.platform;
    set("platform", `${p.backend} · ${p.device} · ${p.cpu_cores} cores · ${p.os}`);
    const d = n.coordinator_session_detail;
    set("coordinator", n.coordinator ? `${n.coordinator} (${n.coordinator_session})` : "off (local only)");
    set("connected-since", d && d.connected_since ? when(d.connected_since) : "–");
    set("coordinator-jobs", d ? `${count(d.jobs_received)} received, ${count(d.outcomes_sent)} outcomes sent, ` +
      `${count(d.sessions)} sessions` : "–");
    const g = n.group;
    set("group", g ? `${g.ranks} ranks over ${g.backend}; budgets ${g.budget_bytes.map(bytes).join(", ")}` : "none");
    const c = n.counters, q = n.queue;
    set("active-jobs", count(n.active_jobs), n.active_jobs);
    set("queued-jobs", count(n.queued_jobs), n.queued_jobs);
    set("waiting-for-memory", count(q.waiting_for_memory), q.waiting_for_memory);
    set("jobs-completed", count(c.jobs_completed), c.jobs_completed);
    set("jobs-failed", count(c.jobs_failed), c.jobs_failed);
    set("jobs-cancelled", count(c.jobs_cancelled), c.jobs_cancelled);
    set("tokens-generated", count(c.tokens_generated), c.tokens_generated);
    set("prompt-tokens", count(c.prompt_tokens), c.prompt_tokens);
    set("prefix-hit-tokens", `${count(q.prefix_hit_tokens)} (${count(q.prefix_hits)} jobs)`, q.prefix_hit_tokens);
  }

  function renderMemory(n, os) {
    const m = n.memory;
    set("budget", bytes(m.usable_bytes), m.usable_bytes);
    set("budget-source", `${m.source}; ${bytes(m.reserve_bytes)} kept in reserve`);
    set("reserved", bytes(m.reserved_bytes), m.reserved_bytes);
    set("free", bytes(m.free_bytes), m.free_bytes);
    const parts = [];
    n.models.filter((x) => x.state !== "available").forEach((x) => {
      const drafter = x.drafter_bytes || 0;
      const lumped = !drafter && !x.drafter_reason;  // a node that does not say what its drafter holds
      parts.push([`${x.id} (weights, activations${lumped ? ", drafter" : ""})`, x.bytes - drafter, "c1"]);
      if (drafter) parts.push([`${x.id}'s drafter`, drafter, "c2"]);
    });
    parts.push(["jobs' KV", m.jobs_kv_bytes, "c3"], ["prefix cache", m.prefix_cache_bytes, "c4"],
      ["stored responses", m.responses_store_bytes || 0, "c6"], ["held outside the ledger", m.unaccounted_bytes, "c5"],
      ["free", m.free_bytes, "cfree"]);
    const total = Math.max(1, m.usable_bytes);
    const bar = $("memory-bar"), legend = $("memory-legend");
    bar.replaceChildren();
    legend.replaceChildren();
    for (const [name, b, cls] of parts) {
      if (b > 0) {
        const seg = document.createElement("span");
        seg.className = cls;
        seg.style.width = `${Math.min(100, 100 * b / total)}%`;
        seg.title = `${name}: ${bytes(b)}`;
        bar.appendChild(seg);
      }
      if (b > 0 || cls === "cfree") {
        const li = document.createElement("li");
        const sw = document.createElement("i");
        sw.className = cls;
        li.append(sw, `${name}: ${bytes(b)}`);
        legend.appendChild(li);
      }
    }
    bar.setAttribute("aria-label", `memory budget ${bytes(m.usable_bytes)}: ` +
      parts.filter(([, b]) => b > 0).map(([name, b]) => `${name} ${bytes(b)}`).join(", "));
    const d = n.prefix_disk;
    set("prefix-disk", d ? `${bytes(d.bytes)} of ${bytes(d.budget_bytes)}, ${count(d.entries)} entries, ` +
      `${count(d.hits)} hits` : "off");
    set("mlx-active", bytes(m.mlx_active_bytes), m.mlx_active_bytes);
    set("mlx-peak", bytes(m.mlx_peak_bytes), m.mlx_peak_bytes);
    set("rss", bytes(os.process_rss_bytes), os.process_rss_bytes);
    set("os-total", bytes(os.total_bytes), os.total_bytes);
    set("os-available", `${bytes(os.available_bytes)} (${Math.round(100 * os.available_bytes / os.total_bytes)} %)`,
      os.available_bytes);
  }

  function stays(x, now) {
    if (x.pinned) return "pinned";
    if (x.keep_alive_s === null || x.keep_alive_s === undefined) return "kept";
    if (x.unload_at === null || x.unload_at === undefined) return `${duration(x.keep_alive_s)} after its jobs`;
    return `unloads in ${duration(x.unload_at - now)} if idle`;
  }

  function speculation(x) {
    const f = x.facts;
    let text;
    if (x.drafter_reason) {  // the node says what its drafter plan came to
      if (!x.drafter_mode) return `serves alone: ${x.drafter_reason}`;
      text = `${x.drafter_mode}${f && f.speculates_with ? ` with its ${f.speculates_with.replace(/_/g, " ")}` : ""}`;
    } else {
      if (!f) return "unknown (its files cannot be read)";
      if (!f.mtp_capable && !f.draft_compatible) return "serves alone: not_mtp_capable";
      text = f.speculates_with || (f.mtp_capable ? "mtp" : "draft model");
    }
    const prof = x.speculation;
    if (prof) {
      for (const [scheme, v] of Object.entries(prof)) {
        if (v && typeof v === "object" && !Array.isArray(v) && v.k !== undefined)
          text += `; ${scheme.replace(/_/g, " ")}: ${v.k ? `k ${v.k}` : "off (not profitable here)"}, ` +
            `acceptance ${(100 * v.acceptance).toFixed(0)} %`;
      }
    }
    if (x.speculation_profile && x.speculation_profile.source === "measuring") text += "; measuring its costs";
    return text;
  }

  function renderModels(n, now) {
    const rows = $("models");
    const resident = n.models.filter((x) => x.state !== "available");
    const seen = new Set();
    for (const x of resident) {
      seen.add(x.id);
      let tr = rows.querySelector(`tr[data-model="${CSS.escape(x.id)}"]`);
      if (!tr) {
        tr = document.createElement("tr");
        tr.dataset.model = x.id;
        for (const [i, label] of ["Model", "State", "Jobs", "Booked", "Stays", "Speculation"].entries()) {
          const cell = document.createElement(i ? "td" : "th");
          cell.dataset.label = label;  // the phone layout shows it beside the value
          tr.appendChild(cell);
        }
        tr.firstChild.setAttribute("scope", "row");
        rows.appendChild(tr);
      }
      const cells = [x.id, x.state, count(x.active_jobs), bytes(x.bytes), stays(x, now), speculation(x)];
      cells.forEach((t, i) => { if (tr.children[i].textContent !== t) tr.children[i].textContent = t; });
      tr.dataset.state = x.state;
    }
    for (const tr of Array.from(rows.querySelectorAll("tr[data-model]")))
      if (!seen.has(tr.dataset.model)) tr.remove();
    let empty = rows.querySelector("tr.none");
    if (!resident.length && !empty) {
      empty = document.createElement("tr");
      empty.className = "none";
      const td = document.createElement("td");
      td.colSpan = 6; td.className = "empty"; td.textContent = "no model is loaded; a request loads one";
      empty.appendChild(td);
      rows.appendChild(empty);
    } else if (resident.length && empty) empty.remove();
    const others = n.models.filter((x) => x.state === "available").map((x) => x.id);
    set("models-available", others.length ? `Also served, loaded on demand: ${others.join(", ")}` : "");
    const ids = n.models.map((x) => x.id);
    if (ids.join("\n") !== state.models.join("\n")) {  // the chat's choices
      state.models = ids;
      const sel = document.getElementById("chat-model"), keep = sel.value;
      sel.replaceChildren(...ids.map((id) => new Option(id, id)));
      sel.value = ids.includes(keep) ? keep : (n.default_model || ids[0] || "");
    }
  }

  function renderCharts(now) {
    // The last hour, or since the node started (five minutes at least): a young node's points are not a sliver.
    const h = state.history, every = state.last ? state.last.sample_every_s : 5;
    const from = Math.max(now - HOUR_S, Math.min(h.length ? h[0].t - every : now, now - 300));
    const series = (key) => h.map((s) => [s.t, s[key]]);
    const draw = (name, list, opts) =>
      window.Charts.draw(document.querySelector(`[data-chart="${name}"]`), list, Object.assign({from: from, to: now}, opts));
    draw("tokens", [{name: "tokens/s", values: series("tokens_per_s")}], {});
    draw("jobs", [{name: "running", values: series("running")}, {name: "queued", values: series("queued")}], {digits: 0});
    draw("ttft", [{name: "p50", values: series("ttft_p50_ms")}, {name: "p95", values: series("ttft_p95_ms")}], {digits: 0});
    draw("spec", [{name: "acceptance", values: series("acceptance")},
      {name: "tokens/forward", values: series("tokens_per_forward")}], {});
    draw("prefix", [{name: "hit share", values: series("prefix_hit_share")}], {max: 1});
  }

  function renderTrust(n) {
    const c = n.counters;
    set("commits", n.commits ? "every outcome carries one" : "off on this node");
    set("proofs-made", count(c.proofs_made), c.proofs_made);
    set("verify-jobs", count(c.verify_jobs), c.verify_jobs);
    set("verify-verdicts", c.verify_jobs ? `${count(c.verify_passed)} passed, ` +
      `${count(c.verify_jobs - c.verify_passed)} failed` : "none yet");
    const d = n.coordinator_session_detail, s = d && d.spot_checks;
    set("spot-checks", !d ? "none (no coordinator)" : s.passed + s.failed === 0 ? "none yet" :
      `${count(s.passed)} passed, ${count(s.failed)} failed` +
      (s.recent_failures.length ? `; latest failure: ${s.recent_failures[s.recent_failures.length - 1].reason}` : ""));
  }

  // --- the chat box ---
  const chat = {messages: []};

  function bubble(role, text) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    div.textContent = text;
    $("chat-log").appendChild(div);
    $("chat-log").scrollTop = $("chat-log").scrollHeight;
    return div;
  }

  function telemetryLine(t, usage) {
    const parts = [];
    if (usage) parts.push(`${usage.completion_tokens} tokens`);
    if (t) {
      if (t.ttft_ms !== null) parts.push(`first token ${t.ttft_ms.toFixed(0)} ms`);
      if (t.decode_tokens_per_s) parts.push(`${t.decode_tokens_per_s.toFixed(1)} tokens/s`);
      if (t.cached_prompt_tokens) parts.push(`${t.cached_prompt_tokens} prompt tokens cached`);
      const s = t.speculation;
      if (s) parts.push(s.mode === "off" ? `speculation off (${s.reason})` :
        `${s.mode} k ${s.k}, acceptance ${(100 * s.acceptance_rate).toFixed(0)} %, ` +
        `${s.tokens_per_target_forward.toFixed(2)} tokens/forward`);
      parts.push(`finish: ${t.finish_reason}`);
    }
    return parts.join(" · ");
  }

  async function send(ev) {
    ev.preventDefault();
    const input = document.getElementById("chat-input");
    const text = input.value.trim();
    if (!text || state.busy) return;
    input.value = "";
    chat.messages.push({role: "user", content: text});
    bubble("user", text);
    const out = bubble("assistant", "");
    out.setAttribute("aria-busy", "true");
    const body = document.createElement("span");
    out.appendChild(body);
    const controller = new AbortController();
    state.busy = controller;
    $("chat-send").disabled = true;
    $("chat-stop").disabled = false;
    let answer = "", usage = null, tele = null;
    try {
      const r = await fetch("/v1/chat/completions", {
        method: "POST", credentials: "same-origin", signal: controller.signal,
        headers: {"Content-Type": "application/json"},
        body: JSON.stringify({model: document.getElementById("chat-model").value, messages: chat.messages,
          stream: true, stream_options: {include_usage: true},
          max_tokens: Math.max(1, Math.min(4096, parseInt(document.getElementById("chat-max").value, 10) || 128))}),
      });
      if (!r.ok) {
        let msg = `${r.status}`;
        try { msg = (await r.json()).error.message; } catch (e) { /* not JSON */ }
        throw new Error(msg);
      }
      const reader = r.body.getReader(), dec = new TextDecoder();
      let buf = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buf += dec.decode(value, {stream: true});
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const event = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          for (const line of event.split("\n")) {
            if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
            const chunk = JSON.parse(line.slice(6));
            if (chunk.error) throw new Error(chunk.error.message);
            for (const c of chunk.choices || []) if (c.delta && c.delta.content) answer += c.delta.content;
            if (chunk.usage) usage = chunk.usage;
            if (chunk.telemetry) tele = chunk.telemetry;
          }
          body.textContent = answer;
          $("chat-log").scrollTop = $("chat-log").scrollHeight;
        }
      }
      chat.messages.push({role: "assistant", content: answer});
    } catch (e) {
      if (e.name === "AbortError") tele = tele || null;
      else { out.classList.add("error"); body.textContent = `${answer}${answer ? "\n" : ""}error: ${e.message}`; }
      chat.messages.pop();  // the turn without an answer is not sent again
    } finally {
      const t = document.createElement("small");
      t.className = "tele";
      t.dataset.field = "chat-telemetry";
      t.textContent = telemetryLine(tele, usage) || (controller.signal.aborted ? "stopped" : "");
      out.appendChild(t);
      $("chat-log").scrollTop = $("chat-log").scrollHeight;
      out.removeAttribute("aria-busy");
      state.busy = null;
      $("chat-send").disabled = false;
      $("chat-stop").disabled = true;
    }
  }

  function start() {
    $("chat-form").addEventListener("submit", send);
    $("chat-stop").addEventListener("click", () => state.busy && state.busy.abort());
    $("chat-clear").addEventListener("click", () => { chat.messages = []; $("chat-log").replaceChildren(); });
    document.getElementById("chat-input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("chat-form").requestSubmit(); }
    });
    poll();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
