"""``qkv train --fsdp`` of a BERT, and its resume on one process, print no torch UserWarning that
"FSDP2-wrapped module (FSDPBERT) returned a view tensor" (BERT's last hidden state is a view of
its token rows; only the MLM head's out-of-place ops read it, so the warning is noise there).

Oracle: the warnings Python records while the commands run (every warning shown: "always"),
and the command's own exit status. That the sharded BERT's gradients are right is
tests/train/test_sharding.py's (sharded == unsharded).
"""

from __future__ import annotations

import warnings

from qkv.cli import main

BERT = ["--model", "bert-mlm", "--preset", "bert-tiny", "--task", "copy", "--set",
        "attn_dropout=0.0", "--batch-size", "8", "--warmup", "1", "--eval-every", "2",
        "--eval-examples", "8", "--no-progress", "--device", "cpu"]


def test_a_sharded_bert_run_and_its_resume_warn_of_no_view(tmp_path, capsys):
    run = tmp_path / "bert"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(["train", *BERT, "--fsdp", "--steps", "2", "--out", str(run)]) == 0
        assert main(["train", "--resume", str(run), "--steps", "4", "--no-progress",
                     "--device", "cpu"]) == 0
    assert "steps 2 -> 4" in capsys.readouterr().out
    views = [str(w.message) for w in seen if "returned a view tensor" in str(w.message)]
    assert views == []
