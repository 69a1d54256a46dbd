// kvtierd dashboard (docs/DASHBOARD.md). Polls this daemon's /metrics (Prometheus text),
// /v1/policy and /v1/whatif, keeps the last MAX_POINTS samples per chart in memory and draws
// them with Dygraphs. The admin token, when typed in, lives only in this page's memory and
// is sent as "Authorization: Bearer"; it unlocks per-tenant series and the policy switch.
//
// For tests, every chart's element carries data-points (rows drawn), and
// window.kvtierDashboard exposes { points(id), polls, errors, whatifSeq, policy }.
'use strict';

(function () {
  const POLL_MS = 1000;         // /metrics and /v1/policy
  const WHATIF_POLL_MS = 5000;  // /v1/whatif (recomputed by the daemon at most every interval_ms)
  const MAX_POINTS = 300;       // samples kept per chart (5 minutes at POLL_MS)
  const TIERS = ['hbm', 'dram', 'ssd'];
  const MISS_REASONS = ['never_stored', 'evicted', 'expired', 'checksum_failure', 'io_error'];
  const ENGRAM = [
    ['rows_requested', 'kvtier_engram_fetch_rows_requested_total'],
    ['rows_read', 'kvtier_engram_fetch_rows_read_total'],
    ['hot_cache_hits', 'kvtier_engram_fetch_hot_cache_hits_total'],
    ['late_rows', 'kvtier_engram_fetch_late_rows_total'],
    ['stalls', 'kvtier_engram_fetch_stalls_total'],
    ['retries', 'kvtier_engram_fetch_retries_total'],
    ['failures', 'kvtier_engram_fetch_failures_total'],
  ];

  const state = { token: '', polls: 0, errors: 0, whatifSeq: 0, policy: null, prev: null,
    cluster: null };
  const haveLib = typeof Dygraph !== 'undefined';
  const $ = (id) => document.getElementById(id);

  // ---- Prometheus text: name -> [{labels, value}] ----
  function parseMetrics(text) {
    const out = new Map();
    const line = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
    const label = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
    for (const l of text.split('\n')) {
      if (l === '' || l[0] === '#') continue;
      const m = line.exec(l);
      if (!m) continue;
      const labels = {};
      if (m[2]) for (const lm of m[2].matchAll(label)) labels[lm[1]] = lm[2];
      if (!out.has(m[1])) out.set(m[1], []);
      out.get(m[1]).push({ labels, value: Number(m[3]) });
    }
    return out;
  }
  // Sum of a metric's samples whose labels match `want` (all samples when want is empty).
  function sum(metrics, name, want) {
    let s = 0;
    let seen = false;
    for (const x of metrics.get(name) || []) {
      if (want && !Object.keys(want).every((k) => x.labels[k] === want[k])) continue;
      s += x.value;
      seen = true;
    }
    return seen ? s : null;
  }

  // ---- charts: a bounded window of rows {t, values: {series: number}} ----
  function bytes(v) {
    const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
    let i = 0;
    while (Math.abs(v) >= 1024 && i < u.length - 1) { v /= 1024; ++i; }
    return v.toFixed(i === 0 ? 0 : 1) + ' ' + u[i];
  }
  const pct = (v) => (100 * v).toFixed(1) + '%';
  const num = (v) => (Math.abs(v) >= 100 ? v.toFixed(0) : v.toFixed(2));

  class Chart {
    constructor(id, fmt, extra) {
      this.el = $(id);
      this.fmt = fmt;
      this.extra = extra || {};
      this.rows = [];
      this.names = [];
      this.graph = null;
    }
    push(t, values) {
      for (const k of Object.keys(values)) if (!this.names.includes(k)) this.names.push(k);
      this.rows.push({ t, values });
      if (this.rows.length > MAX_POINTS) this.rows.shift();
      this.draw();
    }
    draw() {
      this.el.dataset.points = String(this.rows.length);
      if (!haveLib || this.names.length === 0) return;
      const file = this.rows.map((r) => [r.t, ...this.names.map((n) =>
        (r.values[n] === undefined ? null : r.values[n]))]);
      const opts = { file, labels: ['time', ...this.names] };
      if (!this.graph) {
        this.graph = new Dygraph(this.el, file, Object.assign({
          labels: opts.labels, legend: 'always', connectSeparatedPoints: true,
          axes: { y: { valueFormatter: this.fmt, axisLabelFormatter: this.fmt,
                       axisLabelWidth: 70 } },
          labelsSeparateLines: false, labelsKMB: false,
        }, this.extra));
      } else {
        this.graph.updateOptions(opts);
      }
    }
  }

  const charts = {
    occupancy: new Chart('chart-occupancy', pct, { valueRange: [0, 1.02] }),
    hits: new Chart('chart-hits', pct, { valueRange: [0, 1.02] }),
    misses: new Chart('chart-misses', num),
    ssd: new Chart('chart-ssd', (v) => bytes(v) + '/s'),
    tenants: new Chart('chart-tenants', bytes),
    engram: new Chart('chart-engram', num),
  };

  function authHeaders() {
    return state.token ? { Authorization: 'Bearer ' + state.token } : {};
  }

  // Rate of a counter between two polls (null on the first poll or after a restart).
  function rate(now, prev, name, want, dt) {
    if (!prev) return null;
    const a = sum(now, name, want);
    const b = sum(prev, name, want);
    if (a === null || b === null || a < b) return null;
    return (a - b) / dt;
  }

  function onMetrics(m, t) {
    const prev = state.prev;
    const dt = prev ? (t - prev.t) / 1000 : 0;
    const pm = prev ? prev.m : null;

    const occ = {};
    for (const tier of TIERS) {
      const cap = sum(m, 'kvtier_tier_capacity_bytes', { tier });
      if (cap) occ[tier] = sum(m, 'kvtier_tier_used_bytes', { tier }) / cap;
    }
    charts.occupancy.push(t, occ);

    if (pm && dt > 0) {
      // Hit ratio of reads in the interval: tier hits / (all hits + all misses).
      const hits = {};
      let reads = 0;
      for (const tier of TIERS) {
        hits[tier] = rate(m, pm, 'kvtier_tier_hits_total', { tier }, dt) || 0;
        reads += hits[tier];
      }
      reads += rate(m, pm, 'kvtier_misses_total', null, dt) || 0;
      const hr = {};
      for (const tier of TIERS) if (sum(m, 'kvtier_tier_capacity_bytes', { tier })) {
        hr[tier] = reads > 0 ? hits[tier] / reads : null;
      }
      charts.hits.push(t, hr);

      const miss = {};
      for (const reason of MISS_REASONS) {
        miss[reason] = rate(m, pm, 'kvtier_misses_total', { reason }, dt);
      }
      charts.misses.push(t, miss);

      const ssd = { written: rate(m, pm, 'kvtier_tier_written_bytes_total', { tier: 'ssd' }, dt) };
      const budget = sum(m, 'kvtier_admission_budget_bytes');
      const windowS = sum(m, 'kvtier_admission_budget_window_seconds');
      if (budget !== null && windowS) {
        ssd['budget (average)'] = budget / windowS;
        $('ssd-note').textContent = 'spent in this budget window: ' +
          bytes(sum(m, 'kvtier_admission_budget_spent_bytes') || 0) + ' of ' + bytes(budget);
      } else {
        $('ssd-note').textContent = 'No admission budget exported by this kvtierd ' +
          '(kvtier_admission_budget_bytes absent): SSD write rate only.';
      }
      charts.ssd.push(t, ssd);

      if (m.has('kvtier_engram_fetch_rows_requested_total')) {
        const e = {};
        for (const [label, name] of ENGRAM) e[label] = rate(m, pm, name, null, dt);
        charts.engram.push(t, e);
        $('engram-note').textContent = '';
      } else {
        $('engram-note').textContent = 'No Engram fetch reports yet.';
      }
    }

    const tenants = {};
    for (const x of m.get('kvtier_tenant_used_bytes') || []) tenants[x.labels.tenant] = x.value;
    if (Object.keys(tenants).length > 0) {
      charts.tenants.push(t, tenants);
      $('tenants-note').textContent = '';
    } else {
      $('tenants-note').textContent = state.token ? 'No tenant holds data yet.'
        : 'Per-tenant figures need an admin token (type it above).';
    }
    state.prev = { t, m };
  }

  async function pollMetrics() {
    const t = new Date();
    try {
      const r = await fetch('/metrics', { headers: authHeaders(), cache: 'no-store' });
      if (r.status === 401) {
        $('status').textContent = 'token refused (401): showing nothing until it is fixed';
        $('status').className = 'error';
        ++state.errors;
        return;
      }
      if (!r.ok) throw new Error('/metrics: HTTP ' + r.status);
      onMetrics(parseMetrics(await r.text()), t);
      ++state.polls;
      $('status').textContent = 'live, updated ' + t.toLocaleTimeString() +
        (state.token ? ' (with token)' : '');
      $('status').className = 'ok';
    } catch (e) {
      ++state.errors;
      $('status').textContent = 'unreachable: ' + e.message;
      $('status').className = 'error';
    }
  }

  // ---- policy ----
  function showPolicy(p) {
    state.policy = p;
    const dl = $('policy-now');
    dl.replaceChildren();
    const params = Object.entries(p.params || {}).map(([k, v]) => k + '=' + v).join(', ');
    for (const [k, v] of [['eviction', p.eviction], ['admission', p.admission],
      ['params', params || '(defaults)'], ['seed', String(p.seed)]]) {
      const dt = document.createElement('dt');
      dt.textContent = k;
      const dd = document.createElement('dd');
      dd.textContent = v;
      dd.id = 'policy-now-' + k;
      dl.append(dt, dd);
    }
  }
  async function pollPolicy() {
    try {
      const r = await fetch('/v1/policy', { cache: 'no-store' });
      if (r.ok) showPolicy(await r.json());
    } catch (e) { ++state.errors; }
  }
  async function switchPolicy(ev) {
    ev.preventDefault();
    const msg = $('policy-msg');
    const body = JSON.stringify({ eviction: $('policy-eviction').value,
                                  admission: $('policy-admission').value });
    try {
      const r = await fetch('/v1/policy', {
        method: 'POST', body, cache: 'no-store',
        headers: Object.assign({ 'Content-Type': 'application/json' }, authHeaders()) });
      const j = await r.json().catch(() => ({}));
      if (r.ok) {
        showPolicy(j);
        msg.textContent = 'switched: eviction ' + j.eviction + ', admission ' + j.admission;
        msg.className = 'note ok';
      } else {
        msg.textContent = 'refused (' + r.status + '): ' + (j.error || r.statusText);
        msg.className = 'note error';
      }
    } catch (e) {
      msg.textContent = 'failed: ' + e.message;
      msg.className = 'note error';
    }
  }

  // ---- what-if curves ----
  let whatifGraph = null;
  function drawWhatif(w) {
    const el = $('chart-whatif');
    const note = $('whatif-note');
    if (w.state !== 'ready') {
      note.textContent = (w.state === 'off' ? 'Off: ' : w.state + ': ') + (w.reason || '');
      return;
    }
    state.whatifSeq = w.seq;
    const curves = w.curves.filter((c) => !c.error);
    const caps = w.capacity_units;
    el.dataset.points = String(caps.length);
    el.dataset.curves = String(curves.length);
    const live = w.live || {};
    const win = w.window || {};
    note.textContent = 'Simulated over the newest ' + win.records + ' recorded requests (' +
      w.unique_units + ' distinct units of ~' + bytes(w.unit_bytes) + '; ' +
      (win.records_dropped ? win.records_dropped + ' older ones outside the window' :
        'the whole recording') + '). Live: ' + live.policy + ' at ' + live.capacity_units +
      ' units (' + bytes(live.dram_capacity_bytes) + ' DRAM), the dashed line. ' +
      'Recomputed at most every ' + w.interval_ms / 1000 + ' s (took ' + w.compute_ms + ' ms).';
    if (!haveLib || caps.length === 0) return;
    const file = caps.map((c, i) => [c, ...curves.map((k) => k.miss_ratio[i])]);
    const labels = ['capacity (units)', ...curves.map((k) =>
      (k.policy === live.policy ? k.policy + ' (live)' : k.policy))];
    const series = {};
    for (const k of curves) if (k.policy === live.policy) {
      series[k.policy + ' (live)'] = { strokeWidth: 3.5 };
    }
    const opts = {
      file, labels, series, logscale: false, legend: 'always', drawPoints: true,
      valueRange: [0, 1.02], axes: { x: { logscale: true }, y: { valueFormatter: pct,
        axisLabelFormatter: pct } },
      xlabel: 'DRAM capacity (units, log scale)',
      underlayCallback: (ctx, area, g) => {
        if (!live.capacity_units) return;
        const x = g.toDomXCoord(live.capacity_units);
        ctx.save();
        ctx.setLineDash([6, 4]);
        ctx.strokeStyle = '#b3261e';
        ctx.beginPath();
        ctx.moveTo(x, area.y);
        ctx.lineTo(x, area.y + area.h);
        ctx.stroke();
        ctx.restore();
      },
    };
    if (!whatifGraph) whatifGraph = new Dygraph(el, file, opts);
    else whatifGraph.updateOptions(opts);
  }
  async function pollWhatif() {
    try {
      const r = await fetch('/v1/whatif', { headers: authHeaders(), cache: 'no-store' });
      if (r.ok) drawWhatif(await r.json());
    } catch (e) { ++state.errors; }
  }

  // ---- cluster (/v1/cluster: members of this node's view, every kvtier_cluster_* sample) ----
  function showCluster(c) {
    state.cluster = c;
    const note = $('cluster-note');
    const table = $('cluster-members');
    const dl = $('cluster-metrics');
    if (!c.clustered) {
      note.textContent = 'Not applicable: single node (no [cluster] in the config).';
      table.classList.add('hidden');
      dl.replaceChildren();
      return;
    }
    note.textContent = 'node ' + c.node_id + ': ' + c.members.length + ' members, etcd ' +
      (c.etcd_reachable ? 'reachable' : 'UNREACHABLE (serving what this node holds)');
    note.className = c.etcd_reachable ? 'note' : 'note error';
    const body = table.querySelector('tbody');
    body.replaceChildren();
    for (const m of c.members) {
      const tr = document.createElement('tr');
      tr.dataset.node = m.node_id;
      for (const v of [m.node_id + (m.self ? ' (this node)' : ''), m.peer_endpoint,
        m.failure_domain || '-', bytes(m.dram_bytes), bytes(m.ssd_bytes),
        m.draining ? 'draining' : 'serving']) {
        const td = document.createElement('td');
        td.textContent = v;
        tr.append(td);
      }
      body.append(tr);
    }
    table.classList.remove('hidden');
    dl.replaceChildren();
    for (const [series, s] of Object.entries(c.metrics || {})) {
      const dt = document.createElement('dt');
      dt.textContent = series.replace(/^kvtier_cluster_/, '');
      const dd = document.createElement('dd');
      dd.textContent = String(s.value);
      dl.append(dt, dd);
    }
  }
  async function pollCluster() {
    try {
      const r = await fetch('/v1/cluster', { headers: authHeaders(), cache: 'no-store' });
      if (r.ok) showCluster(await r.json());
    } catch (e) { ++state.errors; }
  }

  // ---- wiring ----
  $('token-form').addEventListener('submit', (ev) => {
    ev.preventDefault();
    state.token = $('token').value.trim();
    state.prev = null;
    pollMetrics();
  });
  $('token-clear').addEventListener('click', () => {
    state.token = '';
    $('token').value = '';
    state.prev = null;
    pollMetrics();
  });
  $('policy-form').addEventListener('submit', switchPolicy);
  if (!haveLib) $('nolib').classList.remove('hidden');

  window.kvtierDashboard = {
    points: (id) => Number($(id).dataset.points),
    get polls() { return state.polls; },
    get errors() { return state.errors; },
    get whatifSeq() { return state.whatifSeq; },
    get policy() { return state.policy; },
    get cluster() { return state.cluster; },
  };

  pollMetrics();
  pollPolicy();
  pollWhatif();
  pollCluster();
  setInterval(() => { pollMetrics(); pollPolicy(); pollCluster(); }, POLL_MS);
  setInterval(pollWhatif, WHATIF_POLL_MS);
}());
