"""constraints.txt pins every package the test environment holds, and `make test` builds
that environment with it: a release of a test oracle or tool elsewhere cannot change what
CI runs (docs/ARCHITECTURE.md: Reliability). pyproject.toml keeps ranges for users.

Oracles: the installed distributions' own metadata (importlib.metadata, the requirement
markers evaluated by ``packaging``), and the text of the repository's build files."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
#: torch is installed by the Makefile (its CPU wheel when none is present, TORCH_PIN) and a
#: torch already there is kept; the package itself is the editable checkout.
NOT_PINNED = {"torch", "qkv"}


def _pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for number, line in enumerate(CONSTRAINTS.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!-]*)", line)
        assert match, f"constraints.txt:{number}: not an exact pin: {line!r}"
        name = canonicalize_name(match[1])
        assert name not in pins, f"constraints.txt:{number}: {name} pinned twice"
        pins[name] = match[2]
    return pins


def _extras() -> dict[str, list[str]]:
    """qkv's requirements by extra ("" the plain dependencies), from the metadata that
    pip made of pyproject.toml when it installed the checkout."""
    extras: dict[str, list[str]] = {"": []}
    for text in metadata.requires("qkv") or []:
        req = Requirement(text)
        names = [e for e in metadata.metadata("qkv").get_all("Provides-Extra") or []
                 if req.marker is not None and req.marker.evaluate({"extra": e})]
        for extra in names or ([""] if req.marker is None else []):
            extras.setdefault(extra, []).append(str(req).split(";")[0])
    return extras


def _closure(root: str, extras: set[str]) -> dict[str, str]:
    """Every distribution ``root[extras]`` needs, transitively, as installed: name ->
    version (the requirements' markers evaluated for this interpreter)."""
    found: dict[str, str] = {}
    todo = [(root, frozenset(extras))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        dist = metadata.distribution(name)
        found[canonicalize_name(name)] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            envs = [{"extra": e} for e in wanted] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(env) for env in envs):
                todo.append((req.name, frozenset(req.extras)))
    return found


def test_constraints_are_exact_pins_of_every_named_package():
    pins = _pins()
    assert {"", "dev", "bench"} <= set(_extras())
    for extra, requirements in _extras().items():
        for text in requirements:
            name = canonicalize_name(Requirement(text).name)
            if name not in NOT_PINNED:
                assert name in pins, f"{name} (pyproject.toml [{extra or 'dependencies'}]) " \
                                     f"has no pin in constraints.txt"


def test_pyproject_keeps_ranges_for_users():
    for extra, requirements in _extras().items():
        for text in requirements:
            specifiers = Requirement(text).specifier
            assert specifiers, f"{text!r} ([{extra or 'dependencies'}]) has no lower bound"
            assert all(s.operator not in ("==", "===") for s in specifiers), \
                f"{text!r}: pyproject.toml keeps ranges; exact versions go in constraints.txt"


def test_the_environment_is_the_pinned_one():
    """Every distribution qkv[dev] needs is installed at its pinned version (make test
    installs it so; a mismatch means the environment was not built from constraints.txt)."""
    try:
        installed = _closure("qkv", {"dev"})
    except metadata.PackageNotFoundError as exc:
        pytest.fail(f"qkv[dev]'s environment is incomplete: {exc}")
    pins = _pins()
    wrong = {name: (version, pins.get(name)) for name, version in installed.items()
             if name not in NOT_PINNED and pins.get(name) != version}
    assert not wrong, f"installed (version, pin), not as constraints.txt pins them: {wrong}"
    assert len(installed) > 20  # the closure was walked, not just its root


def _recipe(makefile: str, target: str) -> list[str]:
    lines = makefile.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"{re.escape(target)}\s*:",
                                                                  line))
    body = []
    for line in lines[start + 1:]:
        if not line.startswith("\t") and not (body and body[-1].endswith("\\")):
            break
        body.append(line)
    return [re.sub(r"\\\n\s*", " ", cmd) for cmd in "\n".join(body).split("\n\t")]


def test_make_installs_every_package_with_the_constraints():
    """make test and make demo build $(STAMP): each pip install in its recipe takes the
    constraints file, or installs pip itself at its pin; the build is not isolated (an
    isolated build would fetch the newest setuptools)."""
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^test:.*\$\(STAMP\)", makefile, re.M)
    assert re.search(r"^demo:.*\$\(STAMP\)", makefile, re.M)
    installs = [cmd for cmd in _recipe(makefile, "$(STAMP)") if "pip install" in cmd]
    assert len(installs) >= 3
    for cmd in installs:
        assert "-c $(CONSTRAINTS)" in cmd or "$(call PIN,pip)" in cmd, cmd
        if "-e " in cmd:
            assert "--no-build-isolation" in cmd, cmd
    assert "$(CONSTRAINTS)" in re.search(r"^\$\(STAMP\):(.*)$", makefile, re.M)[1]
    assert re.search(r"^CONSTRAINTS := constraints\.txt$", makefile, re.M)


def test_the_oracle_marker_finds_the_tests_that_compare_against_outside_code():
    """make test-latest runs ``-m oracle``: a file importing an oracle itself (at the top,
    inside a test, through importorskip) or through a helper of the tests is marked; a file
    of qkv's own fp64 oracles is not."""
    from conftest import uses_oracle

    tests = ROOT / "tests"
    for marked in ("modules/test_positions.py",  # imports transformers inside a test
                   "data/test_seq2seq_tokenizer.py",  # importorskip of transformers
                   "models/test_hf_export.py",  # through models/_hf_decoders.py
                   "test_benchmarks.py"):  # the scripts it runs time against transformers
        assert uses_oracle(tests / marked), marked
    for unmarked in ("ops/test_chunked.py", "peft/test_lora.py", "test_pins.py"):
        assert not uses_oracle(tests / unmarked), unmarked
