"""``qkv.viz.attention_html``: one self-contained page holding the weights it claims.

Shapes: L layers, H heads, N query length, S key length.

Checks: no network reference (no URL, CDN, external script/style/font/image), the inline
JSON equals the tensors at the stored rounding (4 decimals: |error| <= 0.5e-4), hostile
tokens neither break the page nor get interpreted as HTML, and — where node is installed —
the page's own script, run on a minimal DOM, shades each key with its weight on hover.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
import torch

from qkv.models import Transformer, TransformerConfig
from qkv.viz import attention_html, attention_maps, token_labels

HOSTILE = ["</script>", "<b>bold</b>", "&amp;", '"quote\'', "<!--", "\u2028", "猫", " "]
ROUND = 0.5e-4 + 1e-9  # 4 decimals


class Page(HTMLParser):
    """Collects tags with their attributes, and the text of each <script> element."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.scripts: list[tuple[dict, str]] = []
        self._in_script: dict | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "script":
            self._in_script = dict(attrs)
            self.scripts.append((self._in_script, ""))

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = None

    def handle_data(self, data):
        if self._in_script is not None:
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)

    def data(self) -> dict:
        (payload,) = [t for a, t in self.scripts if a.get("id") == "qkv-data"]
        return json.loads(payload)


@pytest.fixture(scope="module")
def example():
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.from_name("transformer-tiny"))
    src_tokens = [*HOSTILE, "<eos>"]
    tgt_tokens = ["<bos>", "a", "</script>", "c"]
    src = torch.randint(3, 32, (len(src_tokens),))
    tgt = torch.tensor([1, 4, 5, 6])
    maps = attention_maps(model, src, target_ids=tgt)
    labels = token_labels(maps, input_tokens=src_tokens, target_tokens=tgt_tokens)
    return maps, labels


@pytest.fixture(scope="module")
def page(example, tmp_path_factory):
    maps, labels = example
    path = tmp_path_factory.mktemp("html") / "sub" / "attention.html"
    assert attention_html(maps, tokens=labels, path=path,
                          title="</title><script>alert(1)</script>") == path
    return path


def test_page_is_self_contained(page):
    text = page.read_text(encoding="utf-8")
    for needle in ("http://", "https://", "//cdn", "@import", "url(", "<iframe", "<img"):
        assert needle not in text.lower(), needle
    parsed = Page(text)
    for tag, attrs in parsed.tags:
        assert tag != "link", attrs
        assert "src" not in attrs and "href" not in attrs, (tag, attrs)
    assert [a.get("type") for a, _ in parsed.scripts] == ["application/json", None]


def test_inline_json_holds_the_weights(example, page):
    maps, labels = example
    data = Page(page.read_text(encoding="utf-8")).data()
    assert [m["name"] for m in data["maps"]] == list(maps)
    assert data["decimals"] == 4
    for m in data["maps"]:
        w = maps[m["name"]].double()
        assert (m["layers"], m["heads"]) == tuple(w.shape[:2])
        torch.testing.assert_close(torch.tensor(m["w"], dtype=torch.float64), w, atol=ROUND,
                                   rtol=0)
        torch.testing.assert_close(torch.tensor(m["mean"], dtype=torch.float64), w.mean(1),
                                   atol=ROUND, rtol=0)
        assert (m["queries"], m["keys"]) == labels[m["name"]]
    cross = data["maps"][2]
    assert (cross["query_label"], cross["key_label"]) == ("target (queries)", "source (keys)")
    assert data["initial"] == {"map": 0, "layer": 1, "head": -1}  # last layer, mean of heads


def test_hostile_tokens_and_title_are_escaped(page):
    text = page.read_text(encoding="utf-8")
    assert text.count("</script>") == 2  # the closing tags of the two script elements
    assert "<b>" not in text and "<!--" not in text and "\u2028" not in text
    assert "<title>&lt;/title&gt;&lt;script&gt;alert(1)&lt;/script&gt;</title>" in text
    data = Page(text).data()
    assert data["maps"][0]["queries"][:len(HOSTILE)] == HOSTILE  # round trip, unchanged
    assert data["title"] == "</title><script>alert(1)</script>"


def test_bad_arguments(example, tmp_path):
    maps, labels = example
    p = tmp_path / "x.html"
    with pytest.raises(ValueError, match="no entry for map 'cross'"):
        attention_html(maps, tokens={k: v for k, v in labels.items() if k != "cross"},
                       path=p)
    with pytest.raises(ValueError, match="1 query and 1 key tokens"):
        attention_html({"encoder": maps["encoder"]}, tokens={"encoder": (["a"], ["b"])},
                       path=p)
    with pytest.raises(ValueError, match="layer must be in"):
        attention_html(maps, tokens=labels, path=p, layer=2)
    with pytest.raises(ValueError, match=r"\(L, H, N, S\)"):
        attention_html({"encoder": maps["encoder"][0]}, tokens=labels, path=p)
    assert not p.exists()


# A minimal DOM: enough for the page's script (createElement, getElementById, children,
# textContent, className, style, value, addEventListener). Prints what a hover shows.
HARNESS = r"""
const fs = require("fs");
const html = fs.readFileSync(process.argv[2], "utf8");
const json = html.match(/<script type="application\/json" id="qkv-data">([\s\S]*?)<\/script>/)[1];
const code = html.match(/<script>([\s\S]*?)<\/script>/)[1];
class El {
  constructor(tag) { this.tag = tag; this.children = []; this.style = {}; this.className = "";
                     this.listeners = {}; this._text = ""; this.value = ""; this.checked = false; }
  get firstChild() { return this.children[0] || null; }
  get textContent() {
    return this.children.length ? this.children.map(c => c.textContent).join("") : this._text;
  }
  set textContent(v) { this.children = []; this._text = String(v); }
  appendChild(c) { this.children.push(c); return c; }
  removeChild(c) { this.children.splice(this.children.indexOf(c), 1); return c; }
  addEventListener(type, f) { (this.listeners[type] = this.listeners[type] || []).push(f); }
  fire(type) { (this.listeners[type] || []).forEach(f => f()); }
}
const ids = {};
for (const id of ["map", "layer", "head", "relative", "queries", "keys", "info", "matrix",
                  "query-label", "key-label"]) { ids[id] = new El(id); }
ids["qkv-data"] = new El("script"); ids["qkv-data"].textContent = json;
global.document = { getElementById: id => ids[id] || null, createElement: t => new El(t) };
global.window = global;
new Function(code)();
const [mapIndex, layer, head, query] = process.argv.slice(3).map(Number);
ids.map.value = String(mapIndex); ids.map.fire("change");
ids.layer.value = String(layer); ids.layer.fire("change");
ids.head.value = String(head); ids.head.fire("change");
ids.queries.children[query].fire("mouseenter");
const alpha = ids.keys.children.map(s => {
  const m = /rgba\([^)]*,\s*([0-9.]+)\)/.exec(s.style.backgroundColor || "");
  return m ? Number(m[1]) : 0; });
console.log(JSON.stringify({
  alpha, numbers: ids.keys.children.map(s => s.children[1].textContent),
  keys: ids.keys.children.map(s => s.children[0].textContent),
  queryLabel: ids["query-label"].textContent, info: ids.info.textContent,
  rows: ids.matrix.children[1].children.length }));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
@pytest.mark.parametrize(("name", "layer", "head", "query"),
                         [("cross", 1, 2, 2), ("decoder", 0, -1, 3), ("encoder", 1, 0, 0)])
def test_hover_shades_keys_by_weight(example, page, tmp_path, name, layer, head, query):
    maps, labels = example
    script = tmp_path / "harness.js"
    script.write_text(HARNESS)
    index = list(maps).index(name)
    run = subprocess.run(["node", str(script), str(page), str(index), str(layer), str(head),
                          str(query)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    shown = json.loads(run.stdout)
    w = maps[name][layer]  # (H, N, S)
    row = (w.double().mean(0) if head < 0 else w[head].double())[query]  # (S,)
    # intensity = weight (alpha printed with 3 decimals of the 4-decimal weight)
    torch.testing.assert_close(torch.tensor(shown["alpha"], dtype=torch.float64), row,
                               atol=5e-4 + ROUND, rtol=0)
    assert [float(x) for x in shown["numbers"]] == pytest.approx(row.tolist(), abs=ROUND)
    q_tokens, k_tokens = labels[name]
    assert shown["keys"] == [t if t.strip() else json.dumps(t, ensure_ascii=False)
                             for t in k_tokens]
    assert shown["rows"] == len(q_tokens)  # the matrix view has one row per query
    assert json.dumps(q_tokens[query], ensure_ascii=False) in shown["info"]
    if name == "cross":
        assert shown["queryLabel"] == "target (queries)"
