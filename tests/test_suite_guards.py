"""The suite's own guards (tests/conftest.py): a test that leaks thread-local state fails,
a hang becomes one failed test, and every subprocess a test starts is bounded.

Oracles: inner pytest sessions (pytester) with the real conftest, and the tests' own source
(every ``subprocess.run``/``check_output``/``communicate``/``wait`` call carries a timeout).
"""

from __future__ import annotations

import ast
import sys
import time
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
TESTS = Path(__file__).parent
CONFTEST = (TESTS / "conftest.py").read_text()


def _inner(pytester, body: str, *args: str):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner=body)
    return pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", *args, timeout=120)


@pytest.mark.parametrize("leak", [
    "torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t).__enter__()",
    "torch.overrides.TorchFunctionMode().__enter__()",
    "torch.set_grad_enabled(False)",
    "torch.set_default_dtype(torch.float64)",
])
def test_a_test_that_leaks_thread_state_fails_and_the_next_one_runs_clean(pytester, leak):
    result = _inner(pytester, f"""
import torch

def test_leaks():
    {leak}

def test_after_sees_a_clean_thread():
    assert torch._C._len_torch_function_stack() == 0
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32
""")
    result.assert_outcomes(passed=2, errors=1)  # the leak is reported at test_leaks' teardown
    result.stdout.fnmatch_lines(["*left thread-local state behind*"])


def test_a_clean_test_passes(pytester):
    result = _inner(pytester, """
import torch

def test_scoped():
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        torch.ones(2) * 2
""")
    result.assert_outcomes(passed=1)


def test_a_python_level_hang_fails_with_its_stack(pytester):
    result = _inner(pytester, """
import time, pytest

@pytest.mark.timeout(1)
def test_sleeps():
    time.sleep(60)
""")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*time.sleep(60)*", "*Timeout (>1.0s) from pytest-timeout*"])


_STARTS = ("run", "check_output", "check_call")  # subprocess.X(cmd, ..., timeout=...)
_WAITS = ("communicate", "wait")  # proc.X(timeout) or proc.X(timeout=...)


def test_every_subprocess_a_test_starts_is_bounded():
    """``subprocess.run(..., timeout=...)`` and friends: a child that hangs fails its test."""
    unbounded = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            name, owner = node.func.attr, node.func.value
            timed = any(k.arg == "timeout" for k in node.keywords)
            if name in _STARTS and isinstance(owner, ast.Name) and owner.id == "subprocess":
                bounded = timed
            elif name in _WAITS and _looks_like_a_process(owner):
                bounded = timed or bool(node.args)
            else:
                continue
            if not bounded:
                unbounded.append(f"{path.relative_to(TESTS)}:{node.lineno} {name}()")
    assert not unbounded, unbounded


def _looks_like_a_process(owner: ast.expr) -> bool:
    text = ast.unparse(owner)
    return any(w in text for w in ("proc", "child", "process", "Popen"))



_HANGS_WITH_A_CHILD = """
import pathlib, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
pathlib.Path("grandchild.pid").write_text(str(child.pid))
def waiting_forever():
    time.sleep(600)
waiting_forever()
"""


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_a_hanging_child_fails_with_its_stacks_and_leaves_no_process(tmp_path):
    from conftest import run_bounded

    with pytest.raises(pytest.fail.Exception) as failed:
        run_bounded([sys.executable, "-c", _HANGS_WITH_A_CHILD], timeout=5, cwd=tmp_path)
    message = str(failed.value)
    assert "still ran after 5 s" in message
    assert "waiting_forever" in message  # the child's own stack, dumped by faulthandler
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)  # its whole session was ended
