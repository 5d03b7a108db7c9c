// pagellm dashboard: the block map (canvas), the queues and the charts, fed by /dashboard/events.
// State bytes per block, as pagellm/core/kv_cache_snapshot.py sends them:
//   0 free, 1 cached (free, still findable by prefix hash), n + 1 held by n requests (2 one, 3+ shared).
// A hybrid model's recurrent state slots (the snapshot's `state`), one byte per slot:
//   0 free, 1 checkpoint (a saved state, evictable), 2 live (a running request's), 3 being saved.
(() => {
  'use strict';

  const STATE_NAMES = ['free', 'cached', 'used', 'shared'];
  const stateOf = (code) => (code < 2 ? code : code === 2 ? 2 : 3);
  const HISTORY = 480;

  // One colour per state byte; shared blocks darken with their number of owners.
  const PALETTE = (() => {
    const colors = new Array(256);
    colors[0] = '#e6e9ee';
    colors[1] = '#9ecae1';
    colors[2] = '#41ab5d';
    const shades = ['#fdae6b', '#fd8d3c', '#f16913', '#e6550d', '#d94801', '#a63603', '#7f2704'];
    for (let c = 3; c < 256; c++) colors[c] = shades[Math.min(shades.length - 1, c - 3)];
    return colors;
  })();

  const $ = (id) => document.getElementById(id);
  const S = {
    version: -1, numBlocks: 0, blockSize: 0, showText: false,
    codes: new Uint8Array(0), counts: {}, tables: new Map(), requests: [],
    // A hybrid model's other KV cache groups: group id -> (request id -> block ids), and what each group is.
    groupTables: new Map(), groups: null,
    // A hybrid model's state slots (null otherwise): codes, request id -> live slot, counts.
    state: null,
    cell: 8, cols: 1, rows: 1, gap: 1, connected: false, events: 0,
  };
  window.dashboard = S; // for tests and the curious: the page's whole state

  // ---- block map ---------------------------------------------------------------------------------

  const canvas = $('map');
  const ctx = canvas.getContext('2d', { alpha: false });
  const wrap = $('map-wrap');

  function layout() {
    const n = Math.max(1, S.numBlocks);
    const width = Math.max(200, wrap.clientWidth);
    const targetHeight = Math.max(160, Math.min(window.innerHeight * 0.45, 520));
    let cell = Math.floor(Math.sqrt((width * targetHeight) / n));
    cell = Math.max(1, Math.min(22, cell));
    S.cell = cell;
    S.gap = cell >= 6 ? 1 : 0;
    S.cols = Math.max(1, Math.floor(width / cell));
    S.rows = Math.ceil(n / S.cols);
    const dpr = window.devicePixelRatio || 1;
    canvas.width = Math.round(S.cols * cell * dpr);
    canvas.height = Math.round(S.rows * cell * dpr);
    canvas.style.width = S.cols * cell + 'px';
    canvas.style.height = S.rows * cell + 'px';
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  }

  function drawCell(i) {
    const code = S.codes[i];
    const { cell, gap, cols } = S;
    const x = (i % cols) * cell, y = Math.floor(i / cols) * cell;
    ctx.fillStyle = '#ffffff';
    if (gap) ctx.fillRect(x, y, cell, cell);
    ctx.fillStyle = PALETTE[code];
    ctx.fillRect(x, y, cell - gap, cell - gap);
    if (code >= 3 && cell >= 14) {
      ctx.fillStyle = '#fff';
      ctx.font = `${Math.floor(cell * 0.6)}px sans-serif`;
      ctx.textAlign = 'center';
      ctx.textBaseline = 'middle';
      ctx.fillText(String(code - 1), x + (cell - gap) / 2, y + (cell - gap) / 2 + 0.5);
    }
  }

  function drawAll() {
    const t0 = performance.now();
    ctx.fillStyle = '#ffffff';
    ctx.fillRect(0, 0, S.cols * S.cell, S.rows * S.cell);
    const { cell, gap, cols, codes } = S;
    const size = cell - gap;
    let last = -1;
    for (let i = 0; i < S.numBlocks; i++) {
      const code = codes[i];
      if (code >= 3 && cell >= 14) { drawCell(i); last = -1; continue; }
      if (code !== last) { ctx.fillStyle = PALETTE[code]; last = code; }
      ctx.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, size, size);
    }
    S.lastDrawMs = performance.now() - t0;
  }

  // ---- state slot map (a hybrid model's recurrent state) -------------------------------------------

  const SLOT_NAMES = ['free', 'checkpoint', 'live', 'saving'];
  const SLOT_PALETTE = ['#e6e9ee', '#9ecae1', '#41ab5d', '#ffd43b'];
  const slotCanvas = $('slots');
  const slotCtx = slotCanvas.getContext('2d', { alpha: false });
  const slotWrap = $('slots-wrap');
  const slotGeom = { cell: 16, cols: 1, rows: 1, gap: 1 };

  function layoutSlots() {
    const n = Math.max(1, S.state.numSlots);
    const width = Math.max(120, slotWrap.clientWidth);
    let cell = Math.floor(Math.sqrt((width * 200) / n));
    cell = Math.max(2, Math.min(28, cell));
    slotGeom.cell = cell;
    slotGeom.gap = cell >= 6 ? 1 : 0;
    slotGeom.cols = Math.max(1, Math.min(n, Math.floor(width / cell)));
    slotGeom.rows = Math.ceil(n / slotGeom.cols);
    const dpr = window.devicePixelRatio || 1;
    slotCanvas.width = Math.round(slotGeom.cols * cell * dpr);
    slotCanvas.height = Math.round(slotGeom.rows * cell * dpr);
    slotCanvas.style.width = slotGeom.cols * cell + 'px';
    slotCanvas.style.height = slotGeom.rows * cell + 'px';
    slotCtx.setTransform(dpr, 0, 0, dpr, 0, 0);
  }

  function drawSlot(i) {
    const { cell, gap, cols } = slotGeom;
    const x = (i % cols) * cell, y = Math.floor(i / cols) * cell;
    slotCtx.fillStyle = '#ffffff';
    slotCtx.fillRect(x, y, cell, cell);
    slotCtx.fillStyle = SLOT_PALETTE[S.state.codes[i]] || '#000';
    slotCtx.fillRect(x, y, cell - gap, cell - gap);
  }

  function drawSlots() {
    slotCtx.fillStyle = '#ffffff';
    slotCtx.fillRect(0, 0, slotGeom.cols * slotGeom.cell, slotGeom.rows * slotGeom.cell);
    for (let i = 0; i < S.state.numSlots; i++) drawSlot(i);
  }

  function fmtBytes(b) {
    if (b === null || b === undefined) return '–';
    const units = ['B', 'KiB', 'MiB', 'GiB'];
    let k = 0;
    while (b >= 1024 && k < units.length - 1) { b /= 1024; k++; }
    return `${k ? b.toFixed(b < 10 ? 2 : 1) : b} ${units[k]}`;
  }

  function renderStateCounts() {
    const st = S.state;
    if (!st) return;
    const c = st.counts;
    for (const name of SLOT_NAMES) $('slot-count-' + name).textContent = c[name];
    $('slot-item-saving').hidden = !c.saving;
    const parts = [
      `saved <b>${c.written}</b> · resumed from <b>${c.restored}</b>`,
      `<b>${fmtBytes(c.slot_bytes)}</b> per slot · checkpoints hold <b>${fmtBytes(c.checkpoint_bytes)}</b>`,
    ];
    $('state-stats').innerHTML = parts.map((p) => `<div>${p}</div>`).join('');
    $('state-sub').textContent = `${st.numSlots} slots, a checkpoint every ${st.interval} tokens`;
  }

  function applyStateFull(state) {
    const panel = $('state-panel');
    if (!state) { S.state = null; panel.hidden = true; return; }
    panel.hidden = false;
    S.state = {
      numSlots: state.num_slots, interval: state.checkpoint_interval, codes: decodeCodes(state.codes),
      owners: new Map(Object.entries(state.owners)), counts: state.counts,
    };
    layoutSlots();
    drawSlots();
    renderStateCounts();
  }

  function applyStateDiff(d) {
    const st = S.state;
    if (!st) return;
    for (const [id, code] of d.slots || []) { st.codes[id] = code; drawSlot(id); }
    for (const [rid, slot] of Object.entries(d.owners || {})) st.owners.set(rid, slot);
    for (const rid of d.owners_removed || []) st.owners.delete(rid);
    if (d.counts) st.counts = d.counts;
    renderStateCounts();
  }

  function slotOwner(id) {
    for (const [rid, slot] of S.state.owners) if (slot === id) return rid;
    return null;
  }

  // ---- the stream ----------------------------------------------------------------------------------

  function decodeCodes(b64) {
    const bin = atob(b64);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  function applyFull(full) {
    const resized = full.num_blocks !== S.numBlocks;
    S.version = full.v;
    S.numBlocks = full.num_blocks;
    S.blockSize = full.block_size;
    S.showText = full.show_text;
    S.codes = decodeCodes(full.codes);
    S.tables = new Map(Object.entries(full.tables));
    S.groups = full.groups || null;
    S.groupTables = new Map(Object.entries(full.group_tables || {}).map(([g, t]) => [g, new Map(Object.entries(t))]));
    S.requests = full.requests;
    S.counts = full.counts;
    const hadState = S.state !== null;
    applyStateFull(full.state || null);  // first: the panel beside the map takes its width
    if (resized || !S.laidOut || hadState !== (S.state !== null)) { layout(); S.laidOut = true; }
    drawAll();
    renderCounts();
    renderQueues();
    const cache = full.cache || {};
    const held = cache.dtype ? ` · ${cache.dtype}, ${(cache.bytes / 2 ** 30).toFixed(2)} GiB` : '';
    $('summary').textContent = `${S.numBlocks.toLocaleString()} blocks × ${S.blockSize} tokens${held}`;
    $('privacy').textContent = S.showText
      ? 'Showing request text (--dashboard-show-text).'
      : 'Request text hidden: token counts and hashes only (start the server with --dashboard-show-text to show it).';
  }

  function applyDiff(d) {
    if (d.v !== S.version + 1) console.warn(`dashboard: diff ${d.v} after ${S.version}`);
    S.version = d.v;
    if (d.blocks) {
      for (const [id, code] of d.blocks) { S.codes[id] = code; drawCell(id); }
    }
    if (d.tables) applyTables(S.tables, d.tables);
    if (d.tables_removed) for (const rid of d.tables_removed) S.tables.delete(rid);
    for (const [g, changed] of Object.entries(d.group_tables || {})) {
      if (!S.groupTables.has(g)) S.groupTables.set(g, new Map());
      applyTables(S.groupTables.get(g), changed);
    }
    for (const [g, removed] of Object.entries(d.group_tables_removed || {})) {
      const tables = S.groupTables.get(g);
      if (tables) for (const rid of removed) tables.delete(rid);
    }
    if (d.requests) S.requests = d.requests;
    if (d.state) applyStateDiff(d.state);
    S.counts = d.counts;
    renderCounts();
    scheduleQueues();
  }

  // Each changed table is [start, ids...]: from `start` on it holds those ids.
  function applyTables(tables, changed) {
    for (const [rid, [start, ...ids]] of Object.entries(changed)) {
      const t = (tables.get(rid) || []).slice(0, start);
      for (const id of ids) t.push(id);
      tables.set(rid, t);
    }
  }

  // A group's label beside its row of blocks: its window, or "full".
  function groupLabel(g) {
    const spec = S.groups && S.groups[Number(g)];
    return spec && spec.window ? `W${spec.window}` : 'full';
  }

  function renderCounts() {
    const c = S.counts;
    for (const name of STATE_NAMES) $('count-' + name).textContent = c[name];
    $('engine-used').textContent = c.engine_used;
    $('engine-free').textContent = c.engine_free;
    $('engine-usage').textContent = S.numBlocks ? (100 * c.engine_used / S.numBlocks).toFixed(1) + '%' : '–';
    document.body.dataset.version = S.version;
  }

  // ---- queues --------------------------------------------------------------------------------------

  let queuesPending = false;
  function scheduleQueues() {
    if (queuesPending) return;
    queuesPending = true;
    requestAnimationFrame(() => { queuesPending = false; renderQueues(); });
  }

  const MAX_ROW_CELLS = 96;
  function tableCanvas(ids) {
    const cell = 6;
    const shown = Math.min(ids.length, MAX_ROW_CELLS);
    const c = document.createElement('canvas');
    c.className = 'row';
    c.width = Math.max(1, shown * cell);
    c.height = cell + 2;
    const g = c.getContext('2d');
    for (let k = 0; k < shown; k++) {
      g.fillStyle = PALETTE[S.codes[ids[k]]];
      g.fillRect(k * cell, 1, cell - 1, cell);
    }
    c.title = `${ids.length} blocks: ${ids.slice(0, 24).join(' ')}${ids.length > 24 ? ' …' : ''}`;
    return c;
  }

  // Request ids can be long (cmpl-<32 hex>): shown shortened, in full on hover.
  const shortId = (id) => (id.length > 18 ? id.slice(0, 14) + '…' + id.slice(-4) : id);

  function td(text, cls) {
    const el = document.createElement('td');
    el.textContent = text;
    if (cls) el.className = cls;
    return el;
  }

  function renderQueues() {
    const groups = { running: [], waiting: [] };
    for (const r of S.requests) groups[r.queue === 'running' ? 'running' : 'waiting'].push(r);
    for (const [name, reqs] of Object.entries(groups)) {
      $('n-' + name).textContent = reqs.length;
      const body = $(name);
      const frag = document.createDocumentFragment();
      for (const r of reqs.slice(0, 256)) {
        const tr = document.createElement('tr');
        if (r.preemptions > 0 || r.status === 'preempted') tr.className = 'preempted';
        const idCell = td(shortId(r.id) + (r.status === 'preempted' ? ' (preempted)' : ''));
        idCell.title = r.id;
        tr.append(idCell, td(r.prompt, 'num'), td(r.output, 'num'),
          td(r.computed, 'num'), td(r.preemptions, 'num'));
        const cellTd = document.createElement('td');
        const rows = [['0', S.tables.get(r.id) || []]];
        for (const [g, tables] of S.groupTables) rows.push([g, tables.get(r.id) || []]);
        for (const [g, ids] of rows) {
          // One group: the canvas and its count as always; several: a labelled line per group.
          const line = rows.length > 1 ? document.createElement('div') : cellTd;
          if (rows.length > 1) {
            line.className = 'group-row';
            const label = document.createElement('span');
            label.className = 'group-label';
            label.textContent = groupLabel(g);
            line.append(label);
            cellTd.append(line);
          }
          line.append(tableCanvas(ids));
          const n = document.createElement('span');
          n.textContent = ` ${ids.length}`;
          line.append(n);
        }
        const slot = S.state ? S.state.owners.get(r.id) : undefined;
        if (slot !== undefined) {
          const tag = document.createElement('span');
          tag.className = 'slot-tag';
          tag.textContent = ` · state slot ${slot}`;
          cellTd.append(tag);
        }
        tr.append(cellTd);
        frag.append(tr);
        if (r.text !== undefined) {
          const tt = document.createElement('tr');
          const cell = td(r.text, 'text');
          cell.colSpan = 6;
          tt.append(cell);
          frag.append(tt);
        }
      }
      body.replaceChildren(frag);
    }
  }

  // ---- hover -----------------------------------------------------------------------------------------

  const tip = $('tip');
  let hoverId = -1, hoverTimer = 0;

  function ownersOf(id) {
    const owners = [];
    const groups = [['0', S.tables], ...S.groupTables];
    for (const [g, tables] of groups) {
      for (const [rid, ids] of tables) {
        const k = ids.indexOf(id);
        if (k >= 0) owners.push(`${shortId(rid)}[${k}]${groups.length > 1 ? ' ' + groupLabel(g) : ''}`);
      }
    }
    return owners;
  }

  function line(key, value) {
    const div = document.createElement('div');
    const k = document.createElement('span');
    k.className = 'k';
    k.textContent = key + ': ';
    div.append(k, document.createTextNode(value));
    return div;
  }

  function showTip(id, detail) {
    const code = S.codes[id];
    const rows = [line('block', `#${id}  ${STATE_NAMES[stateOf(code)]}${code >= 2 ? `, ${code - 1} owner${code > 2 ? 's' : ''}` : ''}`)];
    const owners = ownersOf(id);
    if (owners.length) rows.push(line('requests', owners.slice(0, 4).join(', ') + (owners.length > 4 ? `, +${owners.length - 4} more` : '')));
    if (detail) {
      if (detail.hash) rows.push(line('hash', detail.hash + '…'));
      if (detail.num_tokens !== undefined) rows.push(line('tokens', `${detail.num_written} of ${S.blockSize} written`));
      if (detail.text !== undefined) rows.push(line('text', JSON.stringify(detail.text)));
      else if (code >= 1 && !S.showText) rows.push(line('text', 'hidden (--dashboard-show-text)'));
    }
    tip.replaceChildren(...rows);
    tip.hidden = false;
  }

  canvas.addEventListener('mousemove', (ev) => {
    const rect = canvas.getBoundingClientRect();
    const x = ev.clientX - rect.left, y = ev.clientY - rect.top;
    const col = Math.floor(x / S.cell), row = Math.floor(y / S.cell);
    const id = row * S.cols + col;
    if (col >= S.cols || id < 0 || id >= S.numBlocks) { tip.hidden = true; hoverId = -1; return; }
    tip.style.left = Math.min(x + 14, wrap.clientWidth - 300) + 'px';
    tip.style.top = y + 14 + 'px';
    if (id === hoverId) return;
    hoverId = id;
    showTip(id, null);
    clearTimeout(hoverTimer);
    hoverTimer = setTimeout(async () => {
      try {
        const resp = await fetch(`/dashboard/api/block/${id}`, { credentials: 'same-origin' });
        if (resp.ok && hoverId === id) showTip(id, await resp.json());
      } catch (e) { /* the tooltip keeps what it had */ }
    }, 120);
  });
  canvas.addEventListener('mouseleave', () => { tip.hidden = true; hoverId = -1; });

  const slotTip = $('slot-tip');
  let hoverSlot = -1, slotTimer = 0;

  function showSlotTip(id, detail) {
    const code = S.state.codes[id];
    const rows = [line('state slot', `#${id}  ${SLOT_NAMES[code] || code}`)];
    const owner = slotOwner(id);
    if (owner !== null) rows.push(line('request', shortId(owner)));
    if (detail) {
      if (detail.hash) rows.push(line('saved at block', detail.hash + '…' + (detail.kv_block !== null ? ` (KV block #${detail.kv_block})` : ' (KV evicted)')));
    }
    slotTip.replaceChildren(...rows);
    slotTip.hidden = false;
  }

  slotCanvas.addEventListener('mousemove', (ev) => {
    if (!S.state) return;
    const rect = slotCanvas.getBoundingClientRect();
    const x = ev.clientX - rect.left, y = ev.clientY - rect.top;
    const col = Math.floor(x / slotGeom.cell), row = Math.floor(y / slotGeom.cell);
    const id = row * slotGeom.cols + col;
    if (col >= slotGeom.cols || id < 0 || id >= S.state.numSlots) { slotTip.hidden = true; hoverSlot = -1; return; }
    slotTip.style.left = Math.max(0, Math.min(x + 14, slotWrap.clientWidth - 220)) + 'px';
    slotTip.style.top = y + 14 + 'px';
    if (id === hoverSlot) return;
    hoverSlot = id;
    showSlotTip(id, null);
    clearTimeout(slotTimer);
    slotTimer = setTimeout(async () => {
      try {
        const resp = await fetch(`/dashboard/api/slot/${id}`, { credentials: 'same-origin' });
        if (resp.ok && hoverSlot === id) showSlotTip(id, await resp.json());
      } catch (e) { /* the tooltip keeps what it had */ }
    }, 120);
  });
  slotCanvas.addEventListener('mouseleave', () => { slotTip.hidden = true; hoverSlot = -1; });

  // ---- charts ----------------------------------------------------------------------------------------

  const series = { t: [] };
  const CHARTS = [
    { el: 'chart-kv', keys: [['kv_usage', 'KV usage', '#2f9e44', 100], ['prefix_hit_share', 'prefix hits', '#1c7ed6', 100]], range: [0, 100] },
    { el: 'chart-tps', keys: [['gen_tps', 'generated', '#e8590c', 1], ['prompt_tps', 'prompt', '#7048e8', 1]] },
    { el: 'chart-batch', keys: [['running', 'running', '#2f9e44', 1], ['waiting', 'waiting', '#f08c00', 1]] },
    { el: 'chart-ttft', keys: [['ttft_p50', 'p50', '#1c7ed6', 1], ['ttft_p90', 'p90', '#f08c00', 1], ['ttft_p99', 'p99', '#e03131', 1]] },
    { el: 'chart-tpot', keys: [['tpot_p50', 'p50', '#1c7ed6', 1], ['tpot_p90', 'p90', '#f08c00', 1], ['tpot_p99', 'p99', '#e03131', 1]] },
    { el: 'chart-spec', keys: [['spec_acceptance', 'accepted %', '#2f9e44', 100], ['spec_tokens_per_verification', 'tokens / step', '#e8590c', 1]] },
    { el: 'chart-tier', keys: [['tier_hit_tps', 'tokens/s from tier', '#1c7ed6', 1], ['tier_read_mbps', 'MB/s read', '#2f9e44', 1], ['tier_write_mbps', 'MB/s written', '#e8590c', 1]] },
  ];
  for (const c of CHARTS) for (const [k] of c.keys) series[k] = [];

  function makeCharts() {
    for (const c of CHARTS) {
      const el = $(c.el);
      const opts = {
        width: Math.max(220, el.clientWidth - 4), height: 150,
        legend: { show: true, live: false },
        cursor: { drag: { x: false, y: false } },
        scales: { x: { time: true }, y: c.range ? { range: c.range } : { range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1] } },
        axes: [{ size: 30, font: '11px sans-serif' }, { size: 46, font: '11px sans-serif' }],
        series: [{}, ...c.keys.map(([, label, stroke]) => ({ label, stroke, width: 1.5, spanGaps: true, points: { show: false } }))],
      };
      c.plot = new uPlot(opts, [[], ...c.keys.map(() => [])], el);
    }
  }

  function pushPoint(p) {
    series.t.push(p.t);
    if (p.spec_acceptance !== undefined) $('panel-spec').hidden = false;  // only an engine that speculates
    if (p.tier_hit_tps !== undefined) $('panel-tier').hidden = false;  // only an engine with an offloading tier
    for (const c of CHARTS) for (const [k, , , scale] of c.keys) series[k].push(p[k] === null || p[k] === undefined ? null : p[k] * scale);
    if (series.t.length > HISTORY) for (const k in series) series[k].splice(0, series[k].length - HISTORY);
  }

  function redrawCharts() {
    for (const c of CHARTS) if (c.plot) c.plot.setData([series.t, ...c.keys.map(([k]) => series[k])]);
  }

  // ---- connection -------------------------------------------------------------------------------------

  function setConn(text, cls) {
    const el = $('conn');
    el.textContent = text;
    el.className = 'conn ' + cls;
  }

  function connect() {
    const es = new EventSource('/dashboard/events');
    S.source = es;
    es.addEventListener('full', (e) => { applyFull(JSON.parse(e.data)); S.events++; setConn('live', 'conn-ok'); S.connected = true; });
    es.addEventListener('diff', (e) => { if (S.version >= 0) applyDiff(JSON.parse(e.data)); S.events++; });
    es.addEventListener('history', (e) => {
      for (const k in series) series[k].length = 0;
      for (const p of JSON.parse(e.data)) pushPoint(p);
      redrawCharts();
    });
    es.addEventListener('stats', (e) => { pushPoint(JSON.parse(e.data)); redrawCharts(); });
    es.onerror = () => { setConn('reconnecting…', 'conn-bad'); S.connected = false; };
  }

  window.addEventListener('resize', () => {
    if (!S.laidOut) return;
    layout();
    drawAll();
    if (S.state) { layoutSlots(); drawSlots(); }
    for (const c of CHARTS) if (c.plot) c.plot.setSize({ width: Math.max(220, $(c.el).clientWidth - 4), height: 150 });
  });

  S.applyFull = applyFull; // tests draw synthetic maps with it (e.g. 100k+ blocks)
  S.applyDiff = applyDiff;
  makeCharts();
  connect();
})();
