"""CSS and JavaScript of the ``attention_html`` page (plain, inline, no external resource).

The script reads the JSON block ``#qkv-data`` (see ``html.page_data``) and only ever puts
tokens on the page through ``textContent``.
"""

CSS = """
body { font-family: system-ui, sans-serif; margin: 1.2em; color: #111; background: #fff; }
h1 { font-size: 1.3em; margin: 0 0 .6em 0; }
#controls label { margin-right: 1.2em; }
.hint { color: #555; font-size: .9em; }
.row { display: flex; align-items: flex-start; margin: .5em 0; }
.label { width: 9em; flex: none; font-weight: 600; padding-top: .3em; }
.tokens { display: flex; flex-wrap: wrap; gap: 3px; }
.tok { display: inline-flex; flex-direction: column; align-items: center; min-width: 1.6em;
       padding: 2px 4px; border: 1px solid #ccd; border-radius: 4px; cursor: pointer;
       white-space: pre; }
.tok .num { font-size: .7em; color: inherit; opacity: .85; min-height: 1em;
            font-variant-numeric: tabular-nums; }
.tok.active { outline: 2px solid #e11d48; }
.tok.pinned { outline: 3px solid #e11d48; }
/* one line of fixed height (the full text is its title): were it to wrap to more or fewer
   lines as the hover changes, the matrix below would move under a still cursor */
#info { margin: .6em 0; height: 1.4em; line-height: 1.4em; font-size: .9em; white-space: pre;
        overflow: hidden; text-overflow: ellipsis; }
#matrix-box { overflow: auto; max-height: 70vh; }
#matrix { border-collapse: collapse; font-size: .7em; }
#matrix td { width: 1.4em; height: 1.4em; border: 1px solid #eee; padding: 0; }
#matrix th { font-weight: normal; white-space: pre; padding: 0 3px; }
#matrix thead th { writing-mode: vertical-rl; transform: rotate(180deg); }
#matrix tr.active th { color: #e11d48; font-weight: 700; }
"""

JS = """
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("qkv-data").textContent);
  var mapSel = document.getElementById("map");
  var layerSel = document.getElementById("layer");
  var headSel = document.getElementById("head");
  var relative = document.getElementById("relative");
  var qBox = document.getElementById("queries");
  var kBox = document.getElementById("keys");
  var info = document.getElementById("info");
  var table = document.getElementById("matrix");
  var MATRIX_MAX = 40000;
  var state = { qSpans: [], kSpans: [], kNums: [], qNums: [], rows: [], pinned: null };

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) { e.className = cls; }
    if (text !== undefined) { e.textContent = text; }
    return e;
  }
  function clear(node) { while (node.firstChild) { node.removeChild(node.firstChild); } }
  function option(sel, value, text) {
    var o = el("option", null, text);
    o.value = String(value);
    sel.appendChild(o);
  }
  function shown(tok) { return tok.trim() === "" ? JSON.stringify(tok) : tok; }
  function onHover(node, show) {
    node.addEventListener("mouseenter", function () { if (state.pinned === null) { show(); } });
  }
  function say(text) { info.textContent = text; info.title = text; }
  function fmt(w) { return w.toFixed(data.decimals); }
  function currentMap() { return data.maps[Number(mapSel.value)]; }
  function matrix() {
    var m = currentMap(), l = Number(layerSel.value), h = Number(headSel.value);
    return h < 0 ? m.mean[l] : m.w[l][h];
  }
  function scaleOf(mat) {
    if (!relative.checked) { return 1; }
    var top = 0;
    for (var i = 0; i < mat.length; i++) {
      for (var j = 0; j < mat[i].length; j++) { if (mat[i][j] > top) { top = mat[i][j]; } }
    }
    return top > 0 ? 1 / top : 1;
  }
  function shade(node, w, scale) {
    var a = Math.min(1, w * scale);
    node.style.backgroundColor = a > 0 ? "rgba(37, 99, 235, " + a.toFixed(3) + ")" : "";
    node.style.color = a > 0.55 ? "#fff" : "";
  }
  function fillControls(keepLayer, keepHead) {
    var m = currentMap();
    clear(layerSel);
    clear(headSel);
    for (var l = 0; l < m.layers; l++) { option(layerSel, l, String(l)); }
    option(headSel, -1, "mean of heads");
    for (var h = 0; h < m.heads; h++) { option(headSel, h, String(h)); }
    layerSel.value = String(Math.min(keepLayer, m.layers - 1));
    headSel.value = String(Math.min(keepHead, m.heads - 1));
  }
  function tokenSpan(tok, index, kind) {
    var s = el("span", "tok");
    s.appendChild(el("span", "text", shown(tok)));
    var num = el("span", "num", "");
    // room for "0.dddd" from the start: a token must not change width when its number
    // appears, or the token under the cursor would change (and take the hover) under it
    num.style.minWidth = (data.decimals + 2) + "ch";
    s.appendChild(num);
    s.title = kind + " " + index + ": " + JSON.stringify(tok);
    return { span: s, num: num };
  }
  function render() {
    var m = currentMap();
    state.pinned = null;
    document.getElementById("query-label").textContent = m.query_label;
    document.getElementById("key-label").textContent = m.key_label;
    clear(qBox);
    clear(kBox);
    state.qSpans = []; state.qNums = []; state.kSpans = []; state.kNums = [];
    m.queries.forEach(function (tok, i) {
      var t = tokenSpan(tok, i, "query");
      onHover(t.span, function () { showQuery(i); });
      t.span.addEventListener("click", function () { pin("q", i); });
      qBox.appendChild(t.span);
      state.qSpans.push(t.span); state.qNums.push(t.num);
    });
    m.keys.forEach(function (tok, j) {
      var t = tokenSpan(tok, j, "key");
      onHover(t.span, function () { showKey(j); });
      t.span.addEventListener("click", function () { pin("k", j); });
      kBox.appendChild(t.span);
      state.kSpans.push(t.span); state.kNums.push(t.num);
    });
    renderMatrix(m);
    reset();
  }
  function renderMatrix(m) {
    clear(table);
    state.rows = [];
    var mat = matrix();
    if (m.queries.length * m.keys.length > MATRIX_MAX) {
      say("(matrix view skipped: more than " + MATRIX_MAX + " cells)");
      return;
    }
    var scale = relative.checked ? scaleOf(mat) : 1;
    var head = el("thead"), hr = el("tr");
    hr.appendChild(el("th", null, ""));
    m.keys.forEach(function (tok) { hr.appendChild(el("th", null, shown(tok))); });
    head.appendChild(hr);
    table.appendChild(head);
    var body = el("tbody");
    m.queries.forEach(function (tok, i) {
      var tr = el("tr");
      tr.appendChild(el("th", null, shown(tok)));
      mat[i].forEach(function (w, j) {
        var td = el("td");
        shade(td, w, scale);
        td.title = JSON.stringify(tok) + " -> " + JSON.stringify(m.keys[j]) + ": " + fmt(w);
        onHover(td, function () { showQuery(i); });
        tr.appendChild(td);
      });
      body.appendChild(tr);
      state.rows.push(tr);
    });
    table.appendChild(body);
  }
  function reset() {
    var i;
    for (i = 0; i < state.qSpans.length; i++) {
      shade(state.qSpans[i], 0, 1); state.qNums[i].textContent = "";
      state.qSpans[i].className = "tok";
    }
    for (i = 0; i < state.kSpans.length; i++) {
      shade(state.kSpans[i], 0, 1); state.kNums[i].textContent = "";
      state.kSpans[i].className = "tok";
    }
    for (i = 0; i < state.rows.length; i++) { state.rows[i].className = ""; }
  }
  function top3(pairs) {
    pairs.sort(function (a, b) { return b[1] - a[1]; });
    return pairs.slice(0, 3).map(function (p) {
      return JSON.stringify(p[0]) + " " + fmt(p[1]);
    }).join(", ");
  }
  function showQuery(i) {
    var m = currentMap(), mat = matrix(), row = mat[i], scale = scaleOf(mat);
    reset();
    state.qSpans[i].className = state.pinned === null ? "tok active" : "tok pinned";
    if (state.rows[i]) { state.rows[i].className = "active"; }
    for (var j = 0; j < row.length; j++) {
      shade(state.kSpans[j], row[j], scale);
      state.kNums[j].textContent = fmt(row[j]);
    }
    say(m.query_label + " " + i + " " + JSON.stringify(m.queries[i]) +
      " attends most to: " + top3(row.map(function (w, j) { return [m.keys[j], w]; })));
  }
  function showKey(j) {
    var m = currentMap(), mat = matrix(), scale = scaleOf(mat);
    reset();
    state.kSpans[j].className = state.pinned === null ? "tok active" : "tok pinned";
    for (var i = 0; i < mat.length; i++) {
      shade(state.qSpans[i], mat[i][j], scale);
      state.qNums[i].textContent = fmt(mat[i][j]);
    }
    say(m.key_label + " " + j + " " + JSON.stringify(m.keys[j]) +
      " is attended most by: " + top3(mat.map(function (r, i) { return [m.queries[i], r[j]]; })));
  }
  function pin(kind, index) {
    if (state.pinned !== null && state.pinned[0] === kind && state.pinned[1] === index) {
      state.pinned = null;
      reset();
      return;
    }
    state.pinned = [kind, index];
    if (kind === "q") { showQuery(index); } else { showKey(index); }
  }
  function redraw() {
    var pinned = state.pinned;
    renderMatrix(currentMap());
    reset();
    state.pinned = pinned;
    if (pinned !== null) {
      if (pinned[0] === "q") { showQuery(pinned[1]); } else { showKey(pinned[1]); }
    }
  }

  data.maps.forEach(function (m, index) { option(mapSel, index, m.name); });
  mapSel.value = String(data.initial.map);
  fillControls(data.initial.layer, data.initial.head);
  mapSel.addEventListener("change", function () {
    fillControls(Number(layerSel.value), Number(headSel.value));
    render();
  });
  layerSel.addEventListener("change", redraw);
  headSel.addEventListener("change", redraw);
  relative.addEventListener("change", redraw);
  render();
  window.qkvAttention = { data: data, showQuery: showQuery, showKey: showKey, pin: pin };
})();
"""
