"""Every block of README.md and README.zh-CN.md works when pasted in order on a fresh clone.

- ```python blocks run as written, in order, in one namespace per README, in a temporary
  working directory. One exception, in the fast test: "Python in ten lines" trains the full
  dates demo (~1.5 min on 2 cores), so it runs there with the demo's ``QUICK_TRAINING``
  (seconds) in place of ``DEMO_TRAINING``, and as written in a slow test, where the session's
  full ``qkv demo`` run (the same training, built once: tests/shared_runs.py) is the run
  its training line makes.
- ```bash blocks and the commands in the output blocks, one command at a time (see
  ``_plan``): ``qkv`` commands run in-process through ``qkv.cli.main`` in the temporary
  directory, training ones with few steps (a full run takes minutes; every other argument
  as written); other shell commands run in bash; commands that cannot run here (``make``,
  whose targets are the full demo and this very suite; ``torchrun`` over GPUs, nodes or
  several processes; the benchmarks, minutes each) are at least parsed: by the Makefile
  (``make -n``), torch's and qkv's argument parsers, or the benchmark script's own flags.
- README.zh-CN.md is a translation: the same blocks, the code the same but for comments.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tokenize
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest_plugins = ["shared_runs"]  # full_dates_demo: tests/shared_runs.py

ROOT = Path(__file__).resolve().parents[1]
READMES = ("README.md", "README.zh-CN.md")
TRAINS = "DEMO_TRAINING"  # the marker of the block that trains the full demo
#: training settings of the shell blocks' ``qkv train`` commands here (see ``_plan``)
SHORT_STEPS, SHORT_RESUME_STEPS = "2", "4"


@dataclass(frozen=True)
class Block:
    readme: str
    line: int  # of the opening fence
    lang: str  # "python", "bash" or "" (output)
    code: str

    def __str__(self) -> str:
        return f"{self.readme}:{self.line}"


def readme_blocks(name: str) -> list[Block]:
    text = (ROOT / name).read_text(encoding="utf-8")
    return [Block(name, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2))
            for m in re.finditer(r"^```(\w*)\n(.*?)^```\n", text, re.S | re.M)]


BLOCKS = {name: readme_blocks(name) for name in READMES}


def test_the_blocks_are_found():
    for name, blocks in BLOCKS.items():
        langs = [b.lang for b in blocks]
        assert set(langs) <= {"python", "bash", ""}, (name, langs)
        assert langs.count("python") >= 10 and langs.count("bash") >= 3, (name, langs)
        assert sum(TRAINS in b.code for b in blocks) == 1, name


# ------------------------------------------------------------------- the translation


def _python_code(code: str) -> list[str]:
    """The code's lines without comments or trailing space (tokenize: a # in a string stays)."""
    lines = code.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col]
    return [line.rstrip() for line in lines if line.strip()]


def _shell_code(code: str) -> list[str]:
    return [c for c in (re.sub(r"(^|\s)#.*$", "", line).rstrip() for line in code.splitlines())
            if c.strip()]


def _output(code: str) -> list[str]:
    """An output block's lines; a block of formulas (every line ``label = formula (note)``,
    labels and notes translated) by its formulas."""
    lines = [line.rstrip() for line in code.splitlines() if line.strip()]
    if all(" = " in line for line in lines):
        return [re.sub(r"\s{2,}[(（].*$", "", line.split(" = ", 1)[1]).strip()
                for line in lines]
    return lines


def test_the_translation_has_the_same_blocks():
    en, zh = BLOCKS["README.md"], BLOCKS["README.zh-CN.md"]
    assert [b.lang for b in en] == [b.lang for b in zh]
    strip = {"python": _python_code, "bash": _shell_code, "": _output}
    for a, b in zip(en, zh, strict=True):
        assert strip[a.lang](a.code) == strip[b.lang](b.code), f"{a} vs {b}"


# ------------------------------------------------------------------- python blocks


def _run_python(readme: str, where: Path, monkeypatch, *, quick: bool) -> tuple[dict, dict]:
    """Every python block of ``readme`` in order in one namespace, in ``where``: (the
    namespace at the end, a copy of it after the block that trains the demo)."""
    monkeypatch.chdir(where)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    scope: dict = {"__name__": "__readme__"}
    ten_lines: dict = {}
    try:
        for block in BLOCKS[readme]:
            if block.lang != "python":
                continue
            code = block.code.replace(TRAINS, "QUICK_TRAINING") if quick else block.code
            try:
                exec(compile(code, str(block), "exec"), scope)  # our own README, as written
            except Exception as exc:
                raise AssertionError(f"the python block at {block} failed: {exc!r}") from exc
            if TRAINS in block.code:
                ten_lines = dict(scope)
    finally:
        torch.set_num_threads(threads)
    return scope, ten_lines


@pytest.mark.parametrize("readme", READMES)
def test_python_blocks_run_in_order(readme, tmp_path, monkeypatch):
    scope, ten_lines = _run_python(readme, tmp_path, monkeypatch, quick=True)
    src, ids, maps = ten_lines["src"], ten_lines["ids"], ten_lines["maps"]
    assert src.dim() == 2 and src.shape[0] == 1  # (B, S)
    assert ids.shape[0] == 1  # (B, 1 + T)
    assert maps["cross"].shape[-2:] == (ids.shape[1], src.shape[1])  # (L, H, T, S)
    assert (tmp_path / "run" / "model.safetensors").is_file()  # the Models block saved
    # the from_hf block writes HF's layout by hand: transformers must read it as the same GPT-2
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf-gpt2").eval()
    x = torch.randint(0, scope["V"], (2, scope["P"]))  # (B, N)
    with torch.no_grad():
        torch.testing.assert_close(scope["gpt2"](x), hf(x).logits, atol=5e-5, rtol=5e-6)


class _SharedRunTrainer:
    """Stands in for ``qkv.train.Trainer`` in the training block: checks that the block asks
    for the shared run's training (the same settings, ``run.json``) and ``run()`` copies the
    files that training wrote (checkpoint/, run.json, metrics.jsonl) into the block's
    directory; ``made`` records each (config, directory)."""

    def __init__(self, run_dir: Path, made: list) -> None:
        self.run_dir, self.made = run_dir, made

    def __call__(self, config, out_dir):
        recorded = json.loads((self.run_dir / "run.json").read_text(encoding="utf-8"))
        assert json.loads(json.dumps(config.to_dict())) == recorded, (config, recorded)
        self.made.append((config, Path(out_dir)))
        return self

    def run(self) -> None:
        _, out = self.made[-1]
        shutil.copytree(self.run_dir, out, ignore=shutil.ignore_patterns(*DEMO_FILES))


#: what ``qkv demo`` writes beside its Trainer's files (qkv.demos.dates)
DEMO_FILES = ("demo.json", "cross_attention.png")


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~1.5 min on 2 idle cores; several times that on one loaded core
def test_training_block_runs_as_written(tmp_path, monkeypatch, capsys, full_dates_demo):
    """README.md's "Python in ten lines" with the full demo training (the README.zh-CN.md
    block is the same code, see test_the_translation_has_the_same_blocks). Its training line
    trains the run of the full ``qkv demo`` (the same TrainConfig, compared with that run's
    run.json here; two such trainings gave bit-identical model.safetensors,
    tests/demos/test_lora_demo.py::test_the_base_is_the_dates_demo_run), so that run, built
    once per session (tests/shared_runs.py: test_dates_demo.py checks its bar), stands in for
    the 1.5-minute training: ``Trainer(...).run()`` puts its files into "runs/dates"; every
    other line runs as written on them."""
    import qkv.train

    block = next(b for b in BLOCKS["README.md"] if TRAINS in b.code)
    run = full_dates_demo()
    made: list = []
    monkeypatch.setattr(qkv.train, "Trainer", _SharedRunTrainer(run.path, made))
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    exec(compile(block.code, str(block), "exec"), {"__name__": "__readme__"})
    assert [out for _, out in made] == [Path("runs/dates")]  # one training, where it says
    assert "['1976-07-04']" in capsys.readouterr().out


# ------------------------------------------------------------------- shell commands


def shell_commands(block: Block) -> list[str]:
    """The commands of a block: a bash block's, or an output block's lines that are commands
    (``python benchmarks/...``, perhaps after ``VAR=value``); continuation lines joined."""
    if block.lang == "python":
        return []
    commands, pending, continued = [], "", False
    for line in block.code.splitlines():
        if not pending and not line.strip():
            continue
        if not pending and block.lang == "" and not re.match(
                r"([A-Z_]+=\S+ )*python benchmarks/", line):
            continue
        # a backslash-newline joins lines (as bash does); inside an open quote, the newline stays
        pending = f"{pending} {line.lstrip()}" if continued else (
            f"{pending}\n{line}" if pending else line)
        continued = pending.endswith("\\")
        if continued:
            pending = pending[:-1].rstrip()
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on
            continue
        if words:
            commands.append(pending)
        pending = ""
    assert not pending, f"{block}: unterminated command {pending!r}"
    return commands


def _words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


def _qkv_parse(argv: list[str]):
    from qkv.cli import build_parser

    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"qkv {shlex.join(argv)}: the CLI refuses it") from exc


def _plan(words: list[str]) -> tuple[str, str]:
    """(what to do, why) for one command: "qkv" (run in-process), "short" (train with few
    steps), "bash", or a parse-only kind ("make", "torchrun", "bench", "activate", "parse")."""
    if words[0] == "make":
        return "make", "make demo trains the full demo (~1.5 min) and make test runs this suite"
    if words[0] in (".", "source"):
        return "activate", "each command here runs with this interpreter's bin/ first on PATH"
    if words[0] == "torchrun":
        return "torchrun", ("several processes (~10 s to start; tests/train runs torchrun "
                            "itself), GPUs or nodes")
    if "benchmarks/" in " ".join(words[:3]):
        return "bench", "a benchmark takes minutes; tests/test_benchmarks.py runs its --quick"
    if words[0] == "qkv":
        if any(w.startswith("/shared/") for w in words):
            return "parse", "the run is the FSDP run of the torchrun lines, on a cluster's disk"
        if words[1] == "train":
            return "short", "a full training run takes minutes: few steps, otherwise as written"
        return "qkv", ""
    return "bash", ""


def _short_training(argv: list[str]) -> list[str]:
    """``qkv train`` arguments with few steps (and, for a new run, small evaluations)."""
    argv = list(argv)
    resume = "--resume" in argv
    if "--steps" in argv:
        argv[argv.index("--steps") + 1] = SHORT_RESUME_STEPS if resume else SHORT_STEPS
    else:
        argv += ["--steps", SHORT_RESUME_STEPS if resume else SHORT_STEPS]
    if not resume:
        argv += ["--eval-every", SHORT_STEPS, "--eval-examples", "4"]
    return [*argv, "--no-progress"]


def _check_make(words: list[str]) -> None:
    done = subprocess.run(["make", "-n", "-C", str(ROOT), *words[1:]], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _check_torchrun(words: list[str]) -> None:
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(words[1:])
    assert args.module and args.training_script == "qkv.cli", words
    _qkv_parse(args.training_script_args)


def _check_benchmark(words: list[str]) -> None:
    words = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]
    assert words[0] == "python", words
    script = ROOT / words[1]
    assert script.is_file(), script
    defined = set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", script.read_text()))
    used = {w.split("=")[0] for w in words[2:] if w.startswith("--")}
    assert used <= defined, f"{words[1]} has no {sorted(used - defined)}"


def _run_shell(readme: str, where: Path, monkeypatch, capsys) -> list[str]:
    """Every command of ``readme``'s blocks in order in ``where`` (a fresh clone's files that
    the commands read copied in); returns what was done, one line per command."""
    from qkv.cli import main

    for name in ("README.md", "BENCHMARKS.md"):  # what `cat ... > corpus.txt` reads
        (where / name).write_bytes((ROOT / name).read_bytes())
    monkeypatch.chdir(where)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "OMP_NUM_THREADS": "1"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    done = []
    try:
        for block in BLOCKS[readme]:
            for command in shell_commands(block):
                words = _words(command)
                kind, why = _plan(words)
                where_ = f"{block}: {command.splitlines()[0]}"
                if kind in ("qkv", "short", "parse"):
                    argv = _short_training(words[1:]) if kind == "short" else words[1:]
                    args = _qkv_parse(argv)
                    if kind != "parse":
                        capsys.readouterr()
                        rc = main(argv)
                        out, err = capsys.readouterr()
                        assert rc == 0, f"{where_}: exit {rc}\n{err[-2000:]}"
                        if getattr(args, "out", None):
                            assert Path(args.out).is_dir(), f"{where_}: no {args.out}"
                        assert (out + err).strip(), f"{where_}: printed nothing"
                elif kind == "bash":
                    ran = subprocess.run(["bash", "-c", command], capture_output=True,
                                         text=True, timeout=300, env=env, cwd=where)
                    assert ran.returncode == 0, f"{where_}: exit {ran.returncode}\n{ran.stderr}"
                elif kind == "make":
                    _check_make(words)
                elif kind == "activate":  # the virtualenv the Makefile makes
                    venv = re.search(r"^VENV := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
                    assert venv and words[1:] == [f"{venv.group(1)}/bin/activate"], where_
                elif kind == "torchrun":
                    _check_torchrun(words)
                elif kind == "bench":
                    _check_benchmark(words)
                done.append(f"{kind:8} {command.splitlines()[0]}" + (f"  ({why})" if why else ""))
    finally:
        torch.set_num_threads(threads)
    return done


# README.zh-CN.md's commands are README.md's (test_the_translation_has_the_same_blocks):
# they run again in the slow run only.
@pytest.mark.parametrize("readme", [READMES[0], pytest.param(READMES[1], marks=pytest.mark.slow)])
def test_shell_commands_run_in_order(readme, tmp_path, monkeypatch, capsys):
    done = _run_shell(readme, tmp_path, monkeypatch, capsys)
    kinds = [line.split()[0] for line in done]
    assert kinds.count("short") >= 6 and kinds.count("qkv") >= 3, done  # what ran
    assert {"make", "torchrun", "bench", "bash"} <= set(kinds), done
    pairs = (tmp_path / "pairs.tsv").read_text(encoding="utf-8").splitlines()
    assert len(pairs) == 5000 and all(line.count("\t") == 1 for line in pairs)
    assert (tmp_path / "runs/mine/attention/attention.html").is_file()
    assert (tmp_path / "models/opus-mt-en-zh/attention/attention.html").is_file()
    assert json.loads((tmp_path / "opus-hf/config.json").read_text())["model_type"] == "marian"


def test_shell_commands_are_found():
    """The blocks' commands as counted by hand: set-up (make ×2); your own data (activate,
    python -c over three lines, cat, 10 qkv/torchrun); the Llama checkpoint (python ×2, 5
    qkv); the Marian checkpoint (python -m, 7 qkv); FSDP (torchrun ×3, two of them over
    several lines, qkv export); the FSDP benchmark's output (2 commands)."""
    found = [shell_commands(b) for b in BLOCKS["README.md"]]
    found = [c for c in found if c]
    assert [len(c) for c in found] == [2, 13, 7, 8, 4, 2], found
    assert _words(found[3][0])[:3] == ["python", "-m", "qkv.demos.tiny_marian"]
    assert [_words(c)[1] for c in found[3][1:]] == [
        "translate", "translate", "attention", "train", "translate", "peft", "export"]
    assert found[1][1].startswith("python -c") and found[1][1].count("\n") == 2
    assert _words(found[1][4])[-2:] == ["--out", "runs/bpe"]  # a continued line, joined
    assert _words(found[4][0])[-2:] == ["--out", "runs/big"]


# ------------------------------------------------------------------- output blocks


def _columns(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


@pytest.mark.parametrize("readme", READMES)
def test_example_arrows_line_up(readme):
    """In the demos' printed examples ("  'source'   -> target"), consecutive lines put the
    arrow at one terminal column, Chinese sources included (wide characters: 2 columns)."""
    groups = 0
    for block in BLOCKS[readme]:
        if block.lang:
            continue
        run: list[int] = []
        for line in [*block.code.splitlines(), ""]:
            m = re.match(r"(  '[^']*' *) -> ", line)
            if m:
                run.append(_columns(m.group(1)))
                continue
            if len(run) > 1:
                assert len(set(run)) == 1, (block, run)
                groups += 1
            run = []
    assert groups >= 2  # the demo's training examples and its showcase


@pytest.mark.parametrize("readme", READMES)
def test_environment_variables_named_exist(readme):
    """The README names the kernel cache's variables, and every QKV_* it names is read by
    qkv's sources."""
    text = (ROOT / readme).read_text(encoding="utf-8")
    named = set(re.findall(r"\bQKV_[A-Z0-9_]+", text))
    assert {"QKV_CACHE_DIR", "QKV_INT8_KERNEL", "QKV_ATTN_KERNEL", "QKV_ROW_KERNEL",
            "QKV_GEMV_KERNEL"} <= named and "XDG_CACHE_HOME" in text
    sources = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "src/qkv").rglob("*.py"))
    assert {n for n in named if f'"{n}"' not in sources} == set()


def test_the_demo_time_is_stated_alike_everywhere():
    """README.md, README.zh-CN.md and ``qkv demo --help`` state one duration for the demo
    (BENCHMARKS.md measured 86 s on 2 cores: ~1.5 min)."""
    from qkv.cli.demo import EXAMPLES
    from qkv.demos import dates

    stated = {
        "README.md": re.search(r"trains the demo model \(~([\d.]+) min\)",
                               (ROOT / "README.md").read_text(encoding="utf-8")),
        "README.zh-CN.md": re.search(r"训练演示模型（约 ([\d.]+) 分钟）",
                                     (ROOT / "README.zh-CN.md").read_text(encoding="utf-8")),
        "qkv demo --help": re.search(r"train on dates \(~([\d.]+) min", EXAMPLES),
        "qkv.demos.dates": re.search(r"takes about ([\d.]+) minutes", dates.__doc__),
    }
    assert all(stated.values()), stated
    assert {k: float(m.group(1)) for k, m in stated.items()} == dict.fromkeys(stated, 1.5)
