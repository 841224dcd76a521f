"""Learning-rate schedules against their closed forms (the paper's formula for inverse_sqrt)."""

from __future__ import annotations

import itertools
import math

import pytest

from qkv.train import lr_multiplier


@pytest.mark.parametrize("warmup", [1, 4000])
def test_inverse_sqrt_is_the_paper_schedule_up_to_its_peak(warmup):
    d_model = 512
    peak = (d_model * warmup) ** -0.5
    for step in (1, warmup // 2 + 1, warmup, warmup + 1, 10 * warmup, 100_000):
        paper = d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
        ours = peak * lr_multiplier(step, schedule="inverse_sqrt", warmup=warmup, total=1)
        assert ours == pytest.approx(paper, rel=1e-12)


def test_cosine_warms_up_then_decays_to_the_floor():
    kw = dict(schedule="cosine", warmup=10, total=110, min_ratio=0.1)
    assert lr_multiplier(5, **kw) == pytest.approx(0.5)
    assert lr_multiplier(10, **kw) == pytest.approx(1.0)
    assert lr_multiplier(60, **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_multiplier(110, **kw) == pytest.approx(0.1)
    assert lr_multiplier(500, **kw) == pytest.approx(0.1)  # past the end: the floor
    values = [lr_multiplier(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))


def test_constant_and_no_warmup():
    assert lr_multiplier(1, schedule="constant", warmup=0, total=5) == 1.0
    assert lr_multiplier(3, schedule="constant", warmup=4, total=5) == 0.75
    assert lr_multiplier(1, schedule="inverse_sqrt", warmup=0, total=5) == 1.0


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(step=1, schedule="linear", warmup=1, total=1), "schedule"),
    (dict(step=0, schedule="cosine", warmup=1, total=1), "step"),
    (dict(step=1, schedule="cosine", warmup=-1, total=1), "warmup"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lr_multiplier(**kwargs)
