"""The ``attention_html`` page opened in a real browser (Debian's chromium via playwright).

Shapes: L layers, H heads, N query length, S key length; T target, S source tokens.

Pages are built from tiny random-weight models (an encoder-decoder ``Transformer`` with
hostile token labels, and a ``GPT``) whose attention maps we hold as fp64 tensors. The
browser switches every map, layer and head (and "mean of heads"), hovers queries, keys and
matrix cells, pins and releases tokens, toggles relative colours, and reads back what the
page shows: the numbers under the tokens, in the matrix cell titles and in the "attends
most to" line must equal the weights at the page's stated rounding (4 decimals:
|error| <= 0.5e-4); shading alpha must equal the weight (times 1 / the largest weight shown
when relative colours are on) within 1/255 (Chromium stores alpha in 8 bits) + 5e-4 (the
page writes 3 decimals). Any console error, uncaught page error, failed request, or request
for anything but the page itself fails the test.

No browser is downloaded: playwright drives the system ``chromium`` (``make test`` installs
it with apt-get when missing; ``QKV_CHROMIUM`` may name another binary). Without one the
tests skip locally, and FAIL when ``CI`` is set.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch

from qkv.models import GPT, GPTConfig, Transformer, TransformerConfig
from qkv.viz import attention_html, attention_maps, token_labels

DECIMALS = 4
ROUND = 0.5 * 10.0 ** -DECIMALS + 1e-9  # the page's stated rounding
SHADE = 1 / 255 + 5e-4  # + ROUND * scale: 8-bit alpha in Chromium, 3 decimals in the page
SRC_TOKENS = ["<b>x</b>", "&amp;", " ", "猫", '"q\'', "a", "a", "b", "<eos>"]  # S = 9
TGT_TOKENS = ["<bos>", "</script>", "a-rather-long-subword-token", "d", "e"]  # T = 5
GPT_TOKENS = ["<bos>", "t", "h", "e", " ", "c", "a"]  # N = 7
INSTALL = ("install it with `apt-get install -y --no-install-recommends chromium` (Debian; "
           "`make test` does this when run as root) or set QKV_CHROMIUM to a Chromium binary")


# ---------------------------------------------------------------------------------------
# the browser


def _chromium() -> str | None:
    env = os.environ.get("QKV_CHROMIUM")
    if env:
        return env
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _missing(reason: str) -> None:
    """A missing browser fails under CI (the test must not silently pass) and skips locally."""
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{reason}; the browser test must run in CI: {INSTALL}", pytrace=False)
    pytest.skip(f"{reason} ({INSTALL}; under CI=true this is a failure)")


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as err:  # pragma: no cover - playwright is a dev dependency
        _missing(f"playwright is not importable ({err}); pip install -e '.[dev]'")
    exe = _chromium()
    if exe is None:
        _missing("no chromium binary on PATH")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, args=[
            "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"])
        yield b
        b.close()


class Tab:
    """One page in a fresh context, recording every console error, page error, failed
    request and request for anything but the page itself."""

    def __init__(self, browser, path, *, width: int = 1800, height: int = 1400) -> None:
        self.url = path.resolve().as_uri()
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.context.new_page()
        self.page.set_default_timeout(10_000)
        self.problems: list[str] = []
        self.page.on("console", lambda m: m.type in ("error", "assert") and
                     self.problems.append(f"console {m.type}: {m.text} @ {m.location}"))
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("requestfailed", lambda r: self.problems.append(
            f"request failed: {r.url} ({r.failure})"))
        self.page.on("request", lambda r: r.url != self.url and self.problems.append(
            f"request for something other than the page: {r.url}"))
        self.page.on("dialog", lambda d: (self.problems.append(f"dialog: {d.message}"),
                                          d.dismiss()))
        self.page.goto(self.url)

    def assert_clean(self) -> None:
        assert self.problems == [], self.problems

    # --- actions: real mouse events and real <select> changes, so the page's own
    # listeners run (the viewport is large enough that nothing scrolls)
    def _centre(self, selector: str, index: int, cell: int | None = None) -> tuple:
        box = self.page.evaluate(CENTRE, [selector, index, cell])
        assert box is not None, (selector, index, cell)
        return box[0], box[1]

    def select(self, control: str, value: int) -> None:
        self.page.mouse.move(2, 2)  # off every token first, as a user reaching a control
        self.page.select_option(f"#{control}", str(value))

    def hover_query(self, i: int) -> None:
        self.page.mouse.move(*self._centre("#queries > .tok", i))

    def hover_key(self, j: int) -> None:
        self.page.mouse.move(*self._centre("#keys > .tok", j))

    def hover_cell(self, i: int, j: int) -> None:
        self.page.mouse.move(*self._centre("#matrix tbody tr", i, j))

    def click_query(self, i: int) -> None:
        self.page.mouse.click(*self._centre("#queries > .tok", i))

    def click_key(self, j: int) -> None:
        self.page.mouse.click(*self._centre("#keys > .tok", j))

    def state(self) -> dict:
        return self.page.evaluate(SNAPSHOT)


# The centre of the index-th element matching a selector (or of its cell-th <td>), and
# that it is what the browser hits there and lies inside the viewport.
CENTRE = r"""([selector, index, cell]) => {
  let e = document.querySelectorAll(selector)[index];
  if (e && cell !== null) { e = e.querySelectorAll("td")[cell]; }
  if (!e) { return null; }
  const r = e.getBoundingClientRect(), x = r.left + r.width / 2, y = r.top + r.height / 2;
  if (x < 0 || y < 0 || x > window.innerWidth || y > window.innerHeight) { return null; }
  const hit = document.elementFromPoint(x, y);
  return hit === e || e.contains(hit) ? [x, y] : null;
}"""


# Everything the page shows, read from the live DOM in one call.
SNAPSHOT = r"""() => {
  const $ = id => document.getElementById(id);
  const opts = sel => Array.from(sel.options).map(o => [o.value, o.textContent]);
  const tok = s => ({ text: s.children[0].textContent, num: s.children[1].textContent,
                      bg: s.style.backgroundColor, color: s.style.color, cls: s.className,
                      tags: s.querySelectorAll("*").length });
  return {
    title: document.title, h1: document.querySelector("h1").textContent,
    map: $("map").value, layer: $("layer").value, head: $("head").value,
    mapOptions: opts($("map")), layerOptions: opts($("layer")), headOptions: opts($("head")),
    relative: $("relative").checked,
    queryLabel: $("query-label").textContent, keyLabel: $("key-label").textContent,
    queries: Array.from($("queries").children).map(tok),
    keys: Array.from($("keys").children).map(tok),
    info: $("info").textContent,
    header: Array.from($("matrix").querySelectorAll("thead th")).map(th => th.textContent),
    rowHeads: Array.from($("matrix").querySelectorAll("tbody th")).map(th => th.textContent),
    rowClasses: Array.from($("matrix").querySelectorAll("tbody tr")).map(tr => tr.className),
    cells: Array.from($("matrix").querySelectorAll("tbody tr")).map(tr =>
      Array.from(tr.querySelectorAll("td")).map(td => [td.style.backgroundColor, td.title])),
  };
}"""


# ---------------------------------------------------------------------------------------
# the pages and their weights


def _sharpen(model: torch.nn.Module) -> torch.nn.Module:
    """Scale every q/k/v projection by 2 (logits by 4) so maps differ clearly per head."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("in_proj.weight"):
                p.mul_(2.0)
    return model.eval()


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """{page name: (path, maps {name: (L, H, N, S) fp64}, labels {name: (queries, keys)})}"""
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("browser")
    t5 = _sharpen(Transformer(TransformerConfig.from_name("transformer-tiny")))
    src = torch.randint(3, 32, (len(SRC_TOKENS),))
    tgt = torch.randint(3, 32, (len(TGT_TOKENS),))
    gpt = _sharpen(GPT(GPTConfig.from_name("gpt-tiny", vocab_size=32, max_len=32, dim=32)))
    ids = torch.randint(3, 32, (len(GPT_TOKENS),))
    result = {}
    for name, maps, labels in [
        ("transformer", attention_maps(t5, src, target_ids=tgt),
         dict(input_tokens=SRC_TOKENS, target_tokens=TGT_TOKENS)),
        ("gpt", attention_maps(gpt, ids), dict(input_tokens=GPT_TOKENS)),
    ]:
        tokens = token_labels(maps, **labels)
        path = attention_html(maps, tokens=tokens, path=out / f"{name}.html",
                              title=f"<i>{name}</i> & co", decimals=DECIMALS)
        result[name] = (path, {k: v.double() for k, v in maps.items()}, tokens)
    assert list(result["transformer"][1]) == ["encoder", "decoder", "cross"]
    assert list(result["gpt"][1]) == ["decoder"]
    return result


@pytest.fixture
def open_tab(browser):
    tabs = []

    def make(path, **viewport) -> Tab:
        tabs.append(Tab(browser, path, **viewport))
        return tabs[-1]

    yield make
    for tab in tabs:
        problems = list(tab.problems)
        tab.context.close()
        assert problems == [], problems


# ---------------------------------------------------------------------------------------
# oracles


def shown(tok: str) -> str:
    """How the page writes a token: blank ones as their JSON string."""
    return tok if tok.strip() else json.dumps(tok, ensure_ascii=False)


def matrix(maps: dict, name: str, layer: int, head: int) -> torch.Tensor:
    """(N, S) fp64: one head, or the mean over heads for head -1."""
    w = maps[name][layer]  # (H, N, S)
    return w.mean(0) if head < 0 else w[head]


def alpha(css: str) -> float:
    """The alpha of an inline background colour ('' = none = 0)."""
    if css == "":
        return 0.0
    m = re.fullmatch(r"rgba?\(\s*37,\s*99,\s*235(?:,\s*([0-9.]+))?\)", css)
    assert m, css
    return 1.0 if m.group(1) is None else float(m.group(1))


def top3(pairs: list[tuple[str, float]]) -> str:
    """The page's "attends most to" list: the 3 largest stored (rounded) weights, ties in
    token order, each as JSON token + weight at the page's decimals."""
    scale = 10.0 ** DECIMALS
    stored = [(tok, float(torch.round(torch.tensor(w, dtype=torch.float64) * scale) / scale))
              for tok, w in pairs]
    best = sorted(stored, key=lambda p: -p[1])[:3]
    return ", ".join(f"{json.dumps(t, ensure_ascii=False)} {w:.{DECIMALS}f}" for t, w in best)


def check_numbers(spans: list[dict], weights: torch.Tensor, scale: float) -> None:
    """Each span shows its weight as text (4 decimals) and as shading alpha."""
    assert len(spans) == len(weights)
    for span, w in zip(spans, weights.tolist(), strict=True):
        assert re.fullmatch(rf"\d\.\d{{{DECIMALS}}}", span["num"]), span
        assert float(span["num"]) == pytest.approx(w, abs=ROUND), (span, w)
        assert alpha(span["bg"]) == pytest.approx(min(1.0, w * scale),
                                                  abs=SHADE + ROUND * scale), (span, w)
        a = min(1.0, w * scale)  # text turns white on dark shades (page: alpha > 0.55)
        if abs(a - 0.55) > SHADE + ROUND * scale:
            assert span["color"] == ("rgb(255, 255, 255)" if a > 0.55 else ""), (span, w)


def check_blank(spans: list[dict]) -> None:
    for span in spans:
        assert (span["num"], span["bg"], span["cls"]) == ("", "", "tok"), span


def check_matrix(st: dict, w: torch.Tensor, queries: list[str], keys: list[str],
                 scale: float) -> None:
    """The heatmap table: one row per query, one cell per key, title and shade = weight."""
    assert st["header"] == ["", *map(shown, keys)]
    assert st["rowHeads"] == [shown(q) for q in queries]
    assert [len(r) for r in st["cells"]] == [len(keys)] * len(queries)
    for i, row in enumerate(st["cells"]):
        for j, (bg, title) in enumerate(row):
            want = float(w[i, j])
            prefix = f"{json.dumps(queries[i], ensure_ascii=False)} -> " \
                     f"{json.dumps(keys[j], ensure_ascii=False)}: "
            assert title.startswith(prefix), (title, prefix)
            assert float(title[len(prefix):]) == pytest.approx(want, abs=ROUND), (i, j, title)
            assert alpha(bg) == pytest.approx(min(1.0, want * scale),
                                              abs=SHADE + ROUND * scale), (i, j, bg)


def check_query(st: dict, w: torch.Tensor, i: int, labels: tuple, qlabel: str,
                scale: float = 1.0, cls: str = "tok active") -> None:
    """Query i shown: keys shaded and numbered by row i, the query marked, its matrix row
    highlighted, and the top-3 line."""
    queries, keys = labels
    assert st["info"] == (f"{qlabel} {i} {json.dumps(queries[i], ensure_ascii=False)} "
                          f"attends most to: " + top3([*zip(keys, w[i].tolist(), strict=True)]))
    assert [q["cls"] for q in st["queries"]] == [cls if k == i else "tok"
                                                 for k in range(len(queries))]
    assert all(q["num"] == "" and q["bg"] == "" for q in st["queries"])
    assert st["rowClasses"] == ["active" if k == i else "" for k in range(len(queries))]
    check_numbers(st["keys"], w[i], scale)


def check_key(st: dict, w: torch.Tensor, j: int, labels: tuple, klabel: str,
              scale: float = 1.0, cls: str = "tok active") -> None:
    """Key j shown: queries shaded and numbered by column j, the key marked."""
    queries, keys = labels
    assert st["info"] == (f"{klabel} {j} {json.dumps(keys[j], ensure_ascii=False)} "
                          f"is attended most by: " +
                          top3([*zip(queries, w[:, j].tolist(), strict=True)]))
    assert [k["cls"] for k in st["keys"]] == [cls if k == j else "tok"
                                              for k in range(len(keys))]
    assert all(k["num"] == "" and k["bg"] == "" for k in st["keys"])
    check_numbers(st["queries"], w[:, j], scale)


LABELS = {"encoder": ("queries", "keys"), "decoder": ("queries", "keys"),
          "cross": ("target (queries)", "source (keys)")}


# ---------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("which", ["transformer", "gpt"])
def test_every_map_layer_and_head_shows_the_saved_weights(pages, open_tab, which):
    """Initial view (last layer, mean of heads), then every map x layer x head option: the
    controls, the token rows, the matrix, and a hovered query or key."""
    path, maps, labels = pages[which]
    tab = open_tab(path)
    st = tab.state()
    names = list(maps)
    assert st["title"] == st["h1"] == f"<i>{which}</i> & co"  # text, not markup
    assert st["mapOptions"] == [[str(k), n] for k, n in enumerate(names)]
    n_layers = maps[names[0]].shape[0]
    assert (st["map"], st["layer"], st["head"]) == ("0", str(n_layers - 1), "-1")
    check_blank(st["queries"] + st["keys"])
    check_matrix(st, matrix(maps, names[0], n_layers - 1, -1), *labels[names[0]], 1.0)
    step = 0
    for m, name in enumerate(names):
        tab.select("map", m)
        queries, keys = labels[name]
        L, H, N, S = maps[name].shape
        for layer in range(L):
            tab.select("layer", layer)
            for head in [-1, *range(H)]:
                tab.select("head", head)
                st = tab.state()
                assert st["layerOptions"] == [[str(k), str(k)] for k in range(L)]
                assert st["headOptions"] == [["-1", "mean of heads"],
                                             *[[str(k), str(k)] for k in range(H)]]
                assert (st["map"], st["layer"], st["head"]) == (str(m), str(layer), str(head))
                assert (st["queryLabel"], st["keyLabel"]) == LABELS[name]
                assert [q["text"] for q in st["queries"]] == [shown(q) for q in queries]
                assert [k["text"] for k in st["keys"]] == [shown(k) for k in keys]
                assert all(t["tags"] == 2 for t in st["queries"] + st["keys"])  # no markup
                w = matrix(maps, name, layer, head)  # (N, S)
                check_matrix(st, w, queries, keys, 1.0)
                if step % 2 == 0:  # a query or a key, a different one each time
                    i = (step // 2) % N
                    tab.hover_query(i)
                    check_query(tab.state(), w, i, labels[name], LABELS[name][0])
                else:
                    j = (step // 2) % S
                    tab.hover_key(j)
                    check_key(tab.state(), w, j, labels[name], LABELS[name][1])
                step += 1
    tab.assert_clean()


def test_cross_attention_alignment_on_hover(pages, open_tab):
    """On the cross map every target token, hovered, shades the source tokens by its row
    of the cross-attention weights; every source token, hovered, shades the targets."""
    path, maps, labels = pages["transformer"]
    tab = open_tab(path)
    tab.select("map", 2)
    layer, head = 0, 2
    tab.select("layer", layer)
    tab.select("head", head)
    w = matrix(maps, "cross", layer, head)  # (T, S)
    assert w.shape == (len(TGT_TOKENS), len(SRC_TOKENS))
    for i in range(len(TGT_TOKENS)):
        tab.hover_query(i)
        st = tab.state()
        assert (st["queryLabel"], st["keyLabel"]) == ("target (queries)", "source (keys)")
        check_query(st, w, i, labels["cross"], "target (queries)")
    for j in range(len(SRC_TOKENS)):
        tab.hover_key(j)
        check_key(tab.state(), w, j, labels["cross"], "source (keys)")
    for i in range(len(TGT_TOKENS)):  # a matrix cell shows its row (target token)
        tab.hover_cell(i, (2 * i + 1) % len(SRC_TOKENS))
        check_query(tab.state(), w, i, labels["cross"], "target (queries)")
    tab.assert_clean()


SETTLE = "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))"


@pytest.mark.parametrize("width", [1800, 420])
def test_the_token_under_the_cursor_is_the_one_shown(pages, open_tab, width):
    """Hovering changes what the page shows; it must not move the tokens or the matrix, or
    another token slides under a still cursor and takes the hover (Chromium fires
    mouseenter on it). Alternate queries and keys (their numbers come and go), then walk
    down matrix columns (the info line above changes length), let two frames pass after
    each move, and check the shown token is the one the cursor is on."""
    path, maps, labels = pages["transformer"]
    tab = open_tab(path, width=width, height=1000)
    tab.select("map", 2)
    w = matrix(maps, "cross", 1, -1)  # the initial layer and head
    T, S = w.shape
    for step in range(S):
        i, j = step % T, S - 1 - step
        tab.hover_query(i)
        tab.page.evaluate(SETTLE)
        check_query(tab.state(), w, i, labels["cross"], "target (queries)")
        tab.hover_key(j)
        tab.page.evaluate(SETTLE)
        check_key(tab.state(), w, j, labels["cross"], "source (keys)")
    for j in (0, S - 1):
        for i in range(T):
            tab.hover_cell(i, j)
            tab.page.evaluate(SETTLE)
            check_query(tab.state(), w, i, labels["cross"], "target (queries)")
    tab.assert_clean()


def test_pin_follows_layer_and_head_and_releases(pages, open_tab):
    """A click pins a token: hovering elsewhere changes nothing, switching layer/head keeps
    the pin and shows the new weights, a second click releases it, a map switch drops it."""
    path, maps, labels = pages["transformer"]
    tab = open_tab(path)
    tab.select("map", 2)
    tab.select("layer", 0)
    tab.select("head", 1)
    cross = labels["cross"]
    tab.click_query(2)
    pinned = tab.state()
    check_query(pinned, matrix(maps, "cross", 0, 1), 2, cross, "target (queries)",
                cls="tok pinned")
    tab.hover_query(0)
    tab.hover_key(4)
    tab.hover_cell(3, 3)
    assert tab.state() == pinned
    tab.select("head", 3)
    check_query(tab.state(), matrix(maps, "cross", 0, 3), 2, cross, "target (queries)",
                cls="tok pinned")
    tab.select("layer", 1)
    check_query(tab.state(), matrix(maps, "cross", 1, 3), 2, cross, "target (queries)",
                cls="tok pinned")
    tab.select("head", -1)
    check_query(tab.state(), matrix(maps, "cross", 1, -1), 2, cross, "target (queries)",
                cls="tok pinned")
    tab.click_query(2)  # release
    st = tab.state()
    check_blank(st["queries"] + st["keys"])
    assert st["rowClasses"] == [""] * len(TGT_TOKENS)
    tab.hover_query(1)  # hovering works again
    check_query(tab.state(), matrix(maps, "cross", 1, -1), 1, cross, "target (queries)")
    tab.click_key(5)  # pin a key, then move the pin to a query with one click
    check_key(tab.state(), matrix(maps, "cross", 1, -1), 5, cross, "source (keys)",
              cls="tok pinned")
    tab.hover_query(0)
    check_key(tab.state(), matrix(maps, "cross", 1, -1), 5, cross, "source (keys)",
              cls="tok pinned")
    tab.click_query(4)
    check_query(tab.state(), matrix(maps, "cross", 1, -1), 4, cross, "target (queries)",
                cls="tok pinned")
    tab.select("map", 0)  # a map switch drops the pin; the head choice is kept
    st = tab.state()
    assert (st["layer"], st["head"]) == ("1", "-1")
    check_blank(st["queries"] + st["keys"])
    enc = matrix(maps, "encoder", 1, -1)
    check_matrix(st, enc, *labels["encoder"], 1.0)
    tab.hover_key(0)
    check_key(tab.state(), enc, 0, labels["encoder"], "keys")
    tab.assert_clean()


def test_relative_colours_scale_by_the_largest_weight_shown(pages, open_tab):
    """With relative colours on, alpha = weight / the largest weight of the matrix shown;
    the numbers stay the weights."""
    path, maps, labels = pages["transformer"]
    tab = open_tab(path)
    tab.select("map", 0)
    tab.select("layer", 1)
    tab.select("head", 0)
    tab.page.check("#relative")
    w = matrix(maps, "encoder", 1, 0)
    scale = 1.0 / float(w.max())
    assert scale > 1.2  # otherwise relative == absolute and this test could not fail
    st = tab.state()
    assert st["relative"] is True
    check_matrix(st, w, *labels["encoder"], scale)
    tab.hover_query(3)
    check_query(tab.state(), w, 3, labels["encoder"], "queries", scale=scale)
    tab.select("head", -1)
    w = matrix(maps, "encoder", 1, -1)
    scale = 1.0 / float(w.max())
    tab.hover_key(6)
    check_key(tab.state(), w, 6, labels["encoder"], "keys", scale=scale)
    check_matrix(tab.state(), w, *labels["encoder"], scale)
    tab.page.uncheck("#relative")
    check_matrix(tab.state(), w, *labels["encoder"], 1.0)
    tab.assert_clean()


def test_browser_reports_page_errors(browser, tmp_path):
    """The harness itself: an uncaught error in a page's script is seen (so a clean run
    above means the attention page raised none)."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><img src=\"missing.png\"><script>"
                   "console.error('boom'); undefinedFunction();</script></body></html>",
                   encoding="utf-8")
    tab = Tab(browser, bad)
    try:
        problems = "\n".join(tab.problems)
        assert "console error: boom" in problems
        assert "page error: undefinedFunction is not defined" in problems
        assert "request for something other than the page: " in problems
        assert "request failed: " in problems and "missing.png" in problems
    finally:
        tab.context.close()


def test_a_missing_browser_fails_under_ci(monkeypatch):
    """Without chromium the browser tests skip locally but fail in CI (never pass)."""
    for value in ("true", "1"):
        monkeypatch.setenv("CI", value)
        with pytest.raises(pytest.fail.Exception, match="must run in CI"):
            _missing("no chromium binary on PATH")
    for value in (None, "false"):
        if value is None:
            monkeypatch.delenv("CI", raising=False)
        else:
            monkeypatch.setenv("CI", value)
        with pytest.raises(pytest.skip.Exception, match="under CI=true this is a failure"):
            _missing("no chromium binary on PATH")
