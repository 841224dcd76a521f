"""``qkv.generation.explain`` names the backend that actually runs (docs/ARCHITECTURE.md:
Decode backends): for models and row counts that land on different backends, the one
``explain`` marks as running is the one ``qkv.generate`` built its stepper with, and every
backend tried before it is listed with its refusal.
"""

from __future__ import annotations

import pytest
import torch
from _fast_gpt_models import tiny_gpt

import qkv
from qkv.generation import api, explain
from qkv.generation.backends import BACKENDS


def _ran(monkeypatch, model, ids, **kw) -> str:
    """The backend of the stepper ``qkv.generate`` builds for ``model`` on ``ids``."""
    seen = []
    real = api.decoder_stepper

    def spy(*a, **k):
        st = real(*a, **k)
        seen.append(st.backend)
        return st

    monkeypatch.setattr(api, "decoder_stepper", spy)
    qkv.generate(model, ids, max_new_tokens=2, **kw)
    monkeypatch.setattr(api, "decoder_stepper", real)
    assert len(seen) == 1
    return seen[0]


def _marked(text: str) -> str:
    (line,) = [ln for ln in text.splitlines() if ln.startswith("  * ")]
    return line[4:].split(":")[0]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", ["fp32-1", "fp32-4", "int8-2", "rms-1", "hooked-1",
                                  "beams-2x3"])
def test_explain_marks_the_backend_generate_runs(case, threads, monkeypatch):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kind, rows = case.split("-")
        model = tiny_gpt(norm="rmsnorm") if kind == "rms" else tiny_gpt()
        if kind == "int8":
            model = qkv.quantize(model, "int8")
        handle = (model.layers[0].register_forward_pre_hook(lambda m, a: None)
                  if kind == "hooked" else None)
        beams = 1
        if "x" in rows:
            rows, beams = rows.split("x")
        batch, beams = int(rows), int(beams)
        ids = torch.randint(3, 48, (batch, 5))
        text = explain(model, batch=batch, num_beams=beams)
        ran = _ran(monkeypatch, model, ids, num_beams=beams)
        assert _marked(text) == ran
        if handle is not None:
            assert ran == "modules" and "has hooks" in text
            handle.remove()
        names = [b.name for b in BACKENDS]
        for name in names[:names.index(ran)]:  # every earlier backend says why not
            (line,) = [ln for ln in text.splitlines() if ln.strip().startswith(name + ":")]
            assert "not tried" not in line and len(line.split(":", 1)[1].strip()) > 5
        for name in names[names.index(ran) + 1:]:
            assert f"{name}: not tried" in text or f"{name}: measured slower" in text
    finally:
        torch.set_num_threads(before)


def test_explain_names_the_plan_or_why_there_is_none():
    text = explain(tiny_gpt(positions="rope", num_kv_heads=2, norm="rmsnorm",
                            activation="swiglu"))
    assert "2 layers, width 32, 4 heads (2 kv), rmsnorm, gated silu, rope positions" in text
    assert "plan: none: config.attention_window=3" in explain(tiny_gpt(attention_window=3))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("c_faster", [True, False])
def test_the_accepting_backends_are_measured_against_each_other(c_faster, threads,
                                                                monkeypatch):
    """With measuring on, every accepting backend but ``modules`` is timed (here the C layer
    and torch at one row) and the faster runs, at any thread count; the outcome is
    remembered (timed once for explain and generate) and ``explain`` shows the figures. With
    ``QKV_DECODE_MEASURE=0`` nothing is timed and the first accepting backend runs."""
    from qkv.generation import engine
    monkeypatch.setattr(engine, "_MEASURED", {})
    monkeypatch.setenv("QKV_DECODE_MEASURE", "1")
    timed = []

    def fake(backend, plan, rows):
        timed.append(backend.name)
        return {"c-layer-fp32": 1e-3 if c_faster else 3e-3, "torch": 2e-3}[backend.name]

    monkeypatch.setattr(engine, "step_seconds", fake)
    model = tiny_gpt()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        if engine.choose(model, 1, measure=False).backend.name != "c-layer-fp32":
            pytest.skip("the C layer kernel does not build here")
        want = "c-layer-fp32" if c_faster else "torch"
        text = explain(model, batch=1)
        assert _marked(text) == want
        assert "2.00 ms/step" in text and ("1.00 ms/step" if c_faster else "3.00 ms/step") in text
        loser = "torch" if c_faster else "c-layer-fp32"
        assert f"{loser}" in text and "measured slower here" in text
        assert _ran(monkeypatch, model, torch.randint(3, 48, (1, 4))) == want
        assert sorted(timed) == ["c-layer-fp32", "torch"]  # once, for explain and generate
        monkeypatch.setenv("QKV_DECODE_MEASURE", "0")
        monkeypatch.setattr(engine, "_MEASURED", {})
        assert engine.choose(model, 1).backend.name == "c-layer-fp32"
        assert sorted(timed) == ["c-layer-fp32", "torch"]
    finally:
        torch.set_num_threads(before)


def test_step_seconds_times_a_real_decode_step():
    from qkv.generation import engine
    from qkv.generation.engine import named_backend
    from qkv.generation.plan import decode_plan
    sec = engine.step_seconds(named_backend("torch"), decode_plan(tiny_gpt()), 2)
    assert 0 < sec < 5


def test_prompt_lookup_runs_on_a_backend_that_verifies_in_one_pass(monkeypatch, one_torch_thread):
    """At one fp32 row the C layer decodes plain greedy, but it feeds one token per call:
    prompt lookup (several tokens per pass) runs on the next backend, which ``explain(...,
    multi_token=True)`` names, with the C layer's refusal."""
    model = tiny_gpt()
    ids = torch.randint(3, 48, (1, 5))
    if _marked(explain(model)) != "c-layer-fp32":
        pytest.skip("the C layer kernel does not build here")
    text = explain(model, multi_token=True)
    assert "c-layer-fp32: feeds one token per call" in text
    assert _ran(monkeypatch, model, ids, prompt_lookup_num_tokens=3) == _marked(text) == "torch"
