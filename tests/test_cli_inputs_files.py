"""Non-regular files given as data are refused up front, in one line naming the path and what it
is: ``translate --file /dev/zero`` (read 5 GB, then MemoryError), ``train --data /dev/zero``
(hung: its fingerprint read forever), ``--data <(cat f)`` (a pipe, consumed by the fingerprint;
then a ``/proc/.../pipe`` message), a FIFO (blocks on open), a FIFO or a link to a device in a
CLIP folder's ``captions.tsv`` (was "not found").

Oracles: what ``os.stat`` says the file is (the kernel's answer, not qkv's); the commands run
in a child process bounded in time and address space, so the old behaviour (read forever,
block, allocate without end) fails the test instead of taking the machine with it.
"""

from __future__ import annotations

import json
import os
import resource
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qkv.data import DataError, ImageFolderDataset
from qkv.data.files import file_kind, read_text, regular_file
from qkv.train.rundir import file_fingerprint

ZERO = Path("/dev/zero")
needs_posix = pytest.mark.skipif(not ZERO.exists() or not hasattr(os, "mkfifo"),
                                 reason="needs /dev/zero and FIFOs (POSIX)")


@needs_posix
def test_regular_file_names_what_each_kind_of_file_is(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "zero-link"
    link.symlink_to(ZERO)
    (tmp_path / "plain.txt").write_text("x")
    (tmp_path / "plain-link").symlink_to(tmp_path / "plain.txt")
    read, write = os.pipe()
    try:
        pipe = Path(f"/dev/fd/{read}")
        cases = {ZERO: "a character device", fifo: "a FIFO or pipe", tmp_path: "a directory",
                 link: "a character device", pipe: "a FIFO or pipe"}
        for path, what in cases.items():
            assert file_kind(os.stat(path).st_mode) == what  # the kernel's kind, in words
            with pytest.raises(DataError) as info:
                regular_file(path, name="--data")
            message = str(info.value)
            assert message.startswith(f"cannot read --data {path}: not a regular file but "
                                      f"{what}"), message
            assert "\n" not in message
        with pytest.raises(DataError, match=r"\(a link to /dev/zero\)"):
            regular_file(link)
        assert regular_file(tmp_path / "plain-link") == tmp_path / "plain-link"
        with pytest.raises(DataError, match=r"cannot read .*absent: No such file"):
            regular_file(tmp_path / "absent")
        with pytest.raises(DataError, match="a FIFO or pipe"):
            read_text(fifo)  # refused without opening it (opening would block)
        with pytest.raises(DataError, match="a character device"):
            file_fingerprint(ZERO)  # refused without reading it (it never ends)
        with pytest.raises(FileNotFoundError):
            file_fingerprint(tmp_path / "absent")  # a missing file stays an OSError
    finally:
        os.close(read)
        os.close(write)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # nothing consumed or replaced it


@needs_posix
def test_a_fifo_or_a_device_in_captions_tsv_is_named_not_missing(tmp_path):
    from PIL import Image

    Image.new("RGB", (4, 4)).save(tmp_path / "a.png")
    os.mkfifo(tmp_path / "pipe.png")
    (tmp_path / "zero.png").symlink_to(ZERO)
    for name, what in (("pipe.png", "a FIFO or pipe"), ("zero.png", "a character device")):
        (tmp_path / "captions.tsv").write_text(f"a.png\tfine\n{name}\tbad\n")
        with pytest.raises(DataError) as info:
            ImageFolderDataset(tmp_path)
        message = str(info.value)
        assert f"captions.tsv:2: image {name!r}" in message
        assert f"is not a regular file but {what}" in message and "not found" not in message


_CHILD = textwrap.dedent("""
    import contextlib, io, json, os, sys
    from qkv.cli import main
    from qkv.train import TrainConfig, Trainer
    tiny = ["--preset", "gpt-tiny", "--set", "dim=32", "--set", "num_heads=2", "--batch-size",
            "8", "--steps", "2", "--eval-every", "2", "--eval-examples", "8", "--no-progress",
            "--device", "cpu"]
    tmp, fifo, clip_dir = sys.argv[1:4]
    read, write = os.pipe()
    os.write(write, "a line of text to train on\\n".encode() * 50)
    os.close(write)
    cases = {
        "translate /dev/zero": ["translate", tmp + "/no-run", "--file", "/dev/zero"],
        "translate fifo": ["translate", tmp + "/no-run", "--file", fifo],
        "train /dev/zero": ["train", "--model", "gpt", "--data", "/dev/zero", *tiny,
                            "--out", tmp + "/r1"],
        "train fifo": ["train", "--model", "gpt", "--data", fifo, *tiny, "--out", tmp + "/r2"],
        "train pipe": ["train", "--model", "gpt", "--data", f"/dev/fd/{read}", *tiny,
                       "--out", tmp + "/r3"],
        "train clip fifo tsv": ["train", "--model", "clip", "--data", clip_dir, "--steps", "2",
                                "--no-progress", "--device", "cpu", "--out", tmp + "/r4"],
    }
    out = {}
    for name, argv in cases.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(argv)
        out[name] = [code, err.getvalue()]
    try:  # the library: Trainer itself, without the CLI's check
        Trainer(TrainConfig(model="gpt", task=None, data="/dev/zero", preset="gpt-tiny",
                            steps=2, batch_size=8), tmp + "/r5", progress=False)
        out["Trainer /dev/zero"] = [0, "accepted"]
    except ValueError as exc:
        out["Trainer /dev/zero"] = [2, str(exc)]
    print(json.dumps(out))
""")


def _limit_memory() -> None:  # in the child: the old `translate --file /dev/zero` read 5 GB
    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))


@needs_posix
@pytest.mark.slow
def test_non_regular_data_files_are_refused_before_they_are_read(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    clip_dir = tmp_path / "photos"
    clip_dir.mkdir()
    os.mkfifo(clip_dir / "captions.tsv")
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), str(fifo),
                           str(clip_dir)], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"},
                          preexec_fn=_limit_memory)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    expected = {"translate /dev/zero": ("--file /dev/zero", "a character device"),
                "translate fifo": (f"--file {fifo}", "a FIFO or pipe"),
                "train /dev/zero": ("--data /dev/zero", "a character device"),
                "train fifo": (f"--data {fifo}", "a FIFO or pipe"),
                "train pipe": ("--data /dev/fd/", "a FIFO or pipe"),
                "train clip fifo tsv": ("captions.tsv", "a FIFO or pipe"),
                "Trainer /dev/zero": ("/dev/zero", "a character device")}
    for name, (path, what) in expected.items():
        code, err = results[name]
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1, (name, code, err)
        assert path in lines[0] and f"not a regular file but {what}" in lines[0], (name, err)
    for run in ("r1", "r2", "r3", "r4", "r5"):
        assert not (tmp_path / run).exists()  # refused before anything was written
