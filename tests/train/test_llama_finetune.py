"""``qkv train --init-from HF_DIR`` on Llama-style HuggingFace directories (issue 23): LoRA
and full fine-tuning through the command line, chat-formatted pairs (TSV and JSONL) with the
loss on the answers only, resume, and ``qkv peft merge`` of the result.

The bases are tiny HF ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` models with random weights
(tests/models/_hf_decoders.py) saved with a small BPE tokenizer built here with the
``tokenizers`` library and a tokenizer_config.json holding a ChatML template written here.

Oracles: transformers' own tokenizer of the directory (``AutoTokenizer``:
``apply_chat_template`` for the prompt ids, its encoding of the answer); HF's own model
classes — the step-1 loss of full fine-tuning against ``Qwen3ForCausalLM``'s loss with
``labels`` (fp32, rtol 1e-5), and the merged LoRA model's logits against
``LlamaForCausalLM`` in fp64 with W + (alpha / r) · B A written into its q_proj / v_proj by
this file (atol 1e-5 · max|logits|, rtol 1e-5, the bar of tests/peft for fp32 against fp64);
a resumed run against the uninterrupted one (bit-identical losses and adapter on the CPU).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from qkv.cli import main  # noqa: E402
from qkv.models import from_pretrained  # noqa: E402
from qkv.peft import disable_adapters  # noqa: E402
from qkv.train import TrainConfig, Trainer, load_run  # noqa: E402
from qkv.train.chat_data import read_conversations  # noqa: E402
from qkv.train.data import IGNORE, PairData  # noqa: E402
from qkv.train.hf_tokenizer import HFTokenizer, base_tokenizer, read_run_tokenizer  # noqa: E402
from qkv.train.kinds import get_kind  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "_hf_decoders", Path(__file__).resolve().parents[1] / "models" / "_hf_decoders.py")
_hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_hf)

#: a ChatML template (Qwen's layout)
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
#: ids 0..4 (Llama 2's first three, then ChatML's): not qkv's <pad> <bos> <eos> <unk>
SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
IM_END = 4
PAIRS = [("hello", "world"), ("how are you", "one two"), ("the cat", "sat on the mat"),
         ("abc", "def ghi"), ("one two", "three four"), ("five", "six seven"),
         ("seven", "eight nine ten"), ("who sat", "the cat")]
CONVERSATIONS = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": "world"}, {"role": "user", "content": "the cat"},
     {"role": "assistant", "content": "sat on the mat"}],
    [{"role": "user", "content": "one two"}, {"role": "assistant", "content": "three four"}],
    [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "def"},
     {"role": "user", "content": "five"}, {"role": "assistant", "content": "six seven"}],
    [{"role": "user", "content": "who sat"}, {"role": "assistant", "content": "the cat"}],
]
SMALL = ["--batch-size", "4", "--eval-every", "3", "--eval-examples", "2", "--warmup", "1",
         "--no-progress", "--device", "cpu"]


def write_tokenizer(directory: Path, *, chat: bool = True) -> None:
    """A Metaspace BPE of 90 ids (the models' vocabulary is 97) with the specials above,
    its tokenizer_config.json (eos_token <|im_end|>, the ChatML template) and a
    generation_config.json stopping at <|im_end|> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = [" ".join(p) for p in PAIRS] + ["user assistant system be brief"]
    trainer = trainers.BpeTrainer(vocab_size=90, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=list("abcdefghijklmnopqrstuvwxyz\n"))
    tok.train_from_iterator(corpus * 10, trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "<|im_end|>", "unk_token": "<unk>"}
    if chat:
        config["chat_template"] = CHATML
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [IM_END, 2], "bos_token_id": 1}))


def hf_base(directory: Path, family: str, *, chat: bool = True) -> Path:
    _hf.save_hf(_hf.hf_model(family), directory)
    write_tokenizer(directory, chat=chat)
    return directory


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama-ft")
    tsv, jsonl = root / "pairs.tsv", root / "chats.jsonl"
    tsv.write_text("".join(f"{s}\t{t}\n" for s, t in PAIRS))
    jsonl.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    return {"root": root, "llama": hf_base(root / "llama", "llama"), "tsv": tsv,
            "jsonl": jsonl}


@pytest.fixture(scope="module")
def lora_run(files) -> Path:
    out = files["root"] / "lora"
    assert main(["train", "--init-from", str(files["llama"]), "--lora", "r=4,targets=q+v",
                 "--chat", "--data", str(files["tsv"]), "--steps", "3", "--lr", "0.05",
                 "--out", str(out), *SMALL]) == 0
    return out


def hf_tokenizer(directory: Path):
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def hf_prompt_ids(tok, messages: list[dict]) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_the_gpt_kind_owns_the_llama_style_model_types():
    from qkv.models import registry
    from qkv.train.kinds import kind_of_model_type

    families = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")
    assert set(families) <= set(registry.entry_for("qkv-gpt").hf_model_types)
    for model_type in ("qkv-gpt", "gpt2", *families):
        assert kind_of_model_type(model_type) is get_kind("gpt")


def test_the_base_tokenizer_keeps_the_directory_s_own_special_ids(files, tmp_path):
    tok = base_tokenizer(files["llama"])
    assert isinstance(tok, HFTokenizer)
    assert (tok.eos_id, tok.bos_id, tok.unk_id, tok.pad_id, tok.stop_ids) == (
        IM_END, 1, 0, IM_END, (IM_END, 2))
    tok.save(tmp_path / "tokenizer.json")  # the HF layout: transformers reads it back
    again = read_run_tokenizer(tmp_path)
    assert (again.eos_id, again.bos_id, again.unk_id, again.pad_id, again.stop_ids) == (
        tok.eos_id, tok.bos_id, tok.unk_id, tok.pad_id, tok.stop_ids)
    assert again.chat_template == CHATML
    messages = CONVERSATIONS[0][:2]
    assert hf_prompt_ids(hf_tokenizer(tmp_path), messages) == \
        hf_prompt_ids(hf_tokenizer(files["llama"]), messages)


@pytest.mark.parametrize("data", ["tsv", "jsonl"])
def test_chat_targets_are_minus_100_exactly_on_the_prompt(files, data):
    """Each row: ids = transformers' apply_chat_template prompt + the answer's tokens (as
    transformers encodes them) + <|im_end|>; targets -100 on the prompt's positions, the
    next token elsewhere, -100 on padding."""
    kind, tok, oracle = get_kind("gpt"), base_tokenizer(files["llama"]), hf_tokenizer(
        files["llama"])
    items = read_conversations(str(files[data]))
    batch = kind.make_batch(items, tok)
    ids, targets = batch["ids"], batch["targets"]  # (B, N)
    expected_count = 0
    for b, (conversation, answer) in enumerate(items):
        prompt = hf_prompt_ids(oracle, list(conversation.messages))
        tail = oracle(answer, add_special_tokens=False)["input_ids"] + [IM_END]
        seq = prompt + tail
        n = len(seq) - 1
        assert ids[b, :n].tolist() == seq[:-1]
        assert targets[b, :len(prompt) - 1].tolist() == [IGNORE] * (len(prompt) - 1)
        assert targets[b, len(prompt) - 1:n].tolist() == tail
        assert (targets[b, n:] == IGNORE).all()
        expected_count += len(tail)
    assert int(kind.loss_count(batch)) == expected_count
    assert kind.batch_tokens(batch, tok) == sum(
        len(hf_prompt_ids(oracle, list(c.messages))) + len(oracle(a, add_special_tokens=False)[
            "input_ids"]) for c, a in items)


def test_lora_run_on_a_llama_directory_and_its_merge(files, lora_run, tmp_path):
    ckpt = lora_run / "checkpoint"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "config.json").exists()
    info = json.loads((lora_run / "run.json").read_text())
    assert info["chat"] is True and info["model"] == "gpt" and info["peft"]["r"] == 4

    merged = tmp_path / "merged"
    assert main(["peft", "merge", str(lora_run), "--out", str(merged)]) == 0
    model = from_pretrained(merged)
    adapted, tok = load_run(lora_run)
    assert isinstance(tok, HFTokenizer) and tok.chat_template == CHATML
    ids = torch.tensor([[1, 3, 20, 45, 7, 4, 60, 33, 12, 5, 88, 2]])  # (1, 12)
    with torch.no_grad():
        got = model(ids).double()
        want_adapted = adapted(ids).double()

    # the oracle: HF's LlamaForCausalLM in fp64 with W + (alpha / r) B A in q_proj / v_proj
    hf = transformers.LlamaForCausalLM.from_pretrained(str(files["llama"])).double().eval()
    base_logits = _hf.hf_logits(hf, ids)
    lora = load_file(str(ckpt / "adapter_model.safetensors"))
    scale = 16 / 4  # alpha (default 16) / r
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            for role, proj in (("q", layer.self_attn.q_proj), ("v", layer.self_attn.v_proj)):
                a = lora[f"layers.{i}.attn.in_proj.A_{role}"].double()  # (r, C)
                b = lora[f"layers.{i}.attn.in_proj.B_{role}"].double()  # (rows, r)
                proj.weight += scale * b @ a
    want = _hf.hf_logits(hf, ids)
    atol = 1e-5 * want.abs().max().item()
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-5)
    torch.testing.assert_close(want_adapted, want, atol=atol, rtol=1e-5)
    assert (base_logits - want).abs().max() > 100 * atol  # the adapter moved the logits

    # the merged directory is a chat model directory: transformers' tokenizer reads it
    messages = [{"role": "user", "content": "hello"}]
    assert hf_prompt_ids(hf_tokenizer(merged), messages) == \
        hf_prompt_ids(hf_tokenizer(files["llama"]), messages)
    assert main(["generate", str(merged), "--chat", "hello", "--max-new-tokens", "3"]) == 0


@pytest.mark.parametrize("flag,value,kind", [("--adapters", "reduction_factor=4", "bottleneck"),
                                             ("--prefix", "2", "prefix")])
def test_adapters_and_a_prefix_on_a_llama_directory(files, tmp_path, flag, value, kind):
    out = tmp_path / "run"
    assert main(["train", "--init-from", str(files["llama"]), flag, value, "--chat", "--data",
                 str(files["tsv"]), "--steps", "1", "--out", str(out), *SMALL]) == 0
    assert json.loads((out / "checkpoint/adapter_config.json").read_text())["kind"] == kind
    model, tok = load_run(out)  # the base (from its recorded path) + the adapter
    assert isinstance(tok, HFTokenizer) and tok.chat_template == CHATML
    ids = torch.tensor([[1, 3, 20, 45, 7, 4, 60]])  # (1, 7)
    with torch.no_grad():
        adapted = model(ids)  # (1, 7, V)
        with disable_adapters(model):
            plain = model(ids)
        base = from_pretrained(files["llama"])(ids)
    assert torch.equal(plain, base) and not torch.equal(adapted, base)


def test_plain_text_fine_tuning_reads_the_file_as_transformers_tokenizes_it(files, tmp_path):
    words = [w for pair in PAIRS for text in pair for w in text.split()]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(words[i % len(words)] for i in range(0, 2000, 7)))
    config = TrainConfig(model="gpt", task=None, data=str(corpus), max_len=16,
                         init_from=str(files["llama"]))
    data, _, window = get_kind("gpt").prepare_base_data(config, base_tokenizer(files["llama"]),
                                                        64)
    expected = hf_tokenizer(files["llama"])(corpus.read_text(), add_special_tokens=False)
    assert window == 16 and torch.cat([data.ids, data.held]).tolist() == expected["input_ids"]
    out = tmp_path / "run"
    assert main(["train", "--init-from", str(files["llama"]), "--data", str(corpus),
                 "--max-len", "16", "--lora", "r=2", "--steps", "1", "--out", str(out),
                 *SMALL]) == 0
    assert json.loads((out / "run.json").read_text())["chat"] is False


def losses(run: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


def test_a_resumed_chat_run_continues_to_the_same_losses(files, tmp_path, monkeypatch):
    """JSONL conversations, LoRA with dropout: killed during step 5 after the step-3
    checkpoint, resumed by `qkv train --resume`, == the uninterrupted run."""
    args = ["train", "--init-from", str(files["llama"]), "--chat", "--data",
            str(files["jsonl"]), "--lora", "r=4,targets=q+v,dropout=0.1", "--steps", "6",
            "--lr", "0.02", *SMALL]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    real_step = Trainer.train_step

    def crash_at_5(self):
        if self.step == 4:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", crash_at_5)
    assert main([*args, "--out", str(tmp_path / "cut")]) == 130
    monkeypatch.setattr(Trainer, "train_step", real_step)
    assert len(losses(tmp_path / "cut")) == 4
    assert main(["train", "--resume", str(tmp_path / "cut"), "--no-progress",
                 "--device", "cpu"]) == 0
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole")
    a = load_file(str(tmp_path / "whole/checkpoint/adapter_model.safetensors"))
    b = load_file(str(tmp_path / "cut/checkpoint/adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_full_fine_tuning_of_a_qwen3_directory(files, tmp_path):
    """One step of full fine-tuning (no label smoothing): its loss is HF Qwen3's loss with
    ``labels`` (-100 on the prompt) on the same training pairs; then every weight moved."""
    base = hf_base(tmp_path / "qwen3", "qwen3")
    train = PairData.from_file(read_conversations(str(files["tsv"])), seed=0).pairs
    out = tmp_path / "run"
    assert main(["train", "--init-from", str(base), "--chat", "--data", str(files["tsv"]),
                 "--steps", "1", "--batch-size", str(len(train)), "--label-smoothing", "0",
                 "--lr", "0.01", "--warmup", "0", "--eval-every", "1", "--eval-examples", "1",
                 "--no-progress", "--device", "cpu", "--out", str(out)]) == 0
    oracle, hf = hf_tokenizer(base), transformers.Qwen3ForCausalLM.from_pretrained(str(base))
    total, count = 0.0, 0
    for conversation, answer in train:  # one example at a time: no padding in the oracle
        prompt = hf_prompt_ids(oracle, list(conversation.messages))
        tail = oracle(answer, add_special_tokens=False)["input_ids"] + [IM_END]
        labels = torch.tensor([[IGNORE] * len(prompt) + tail])
        with torch.no_grad():
            loss = hf(torch.tensor([prompt + tail]), labels=labels).loss
        total, count = total + loss.item() * len(tail), count + len(tail)
    first = losses(out)[0]
    assert first[0] == 1 and first[1] == pytest.approx(total / count, rel=1e-5)

    ckpt = out / "checkpoint"
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "qkv-gpt"
    tuned, start = from_pretrained(ckpt).state_dict(), from_pretrained(base).state_dict()
    assert tuned.keys() == start.keys()
    assert all(not torch.equal(tuned[k], start[k]) for k in tuned)


def test_what_cannot_be_trained_is_refused_before_anything_is_written(files, tmp_path,
                                                                     capsys):
    plain = hf_base(tmp_path / "plain", "llama", chat=False)
    no_bos = hf_base(tmp_path / "no-bos", "qwen2")  # as Qwen's: no bos token at all
    config = json.loads((no_bos / "tokenizer_config.json").read_text())
    (no_bos / "tokenizer_config.json").write_text(json.dumps(
        {k: v for k, v in config.items() if k != "bos_token"}))
    (no_bos / "generation_config.json").write_text(json.dumps({"eos_token_id": IM_END}))
    cases = [
        (["--init-from", str(plain), "--chat", "--data", str(files["tsv"])],
         "has no chat template"),
        (["--model", "gpt", "--chat", "--data", str(files["tsv"])], "--chat: chat-formatted "
                                                                   "pairs are rendered"),
        (["--init-from", str(files["llama"]), "--chat", "--task", "copy"], "come from --data"),
        (["--init-from", str(no_bos), "--task", "copy"], "has no bos token"),
        (["--init-from", str(hf_base(tmp_path / "mistral", "mistral")), "--prefix", "2",
          "--chat", "--data", str(files["tsv"])], "sliding-window attention"),
    ]
    for i, (argv, says) in enumerate(cases):
        out = tmp_path / f"run{i}"
        assert main(["train", *argv, "--out", str(out), *SMALL]) == 2
        assert says in capsys.readouterr().err
        assert not out.exists()
