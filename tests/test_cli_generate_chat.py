"""``qkv generate`` on model directories (config.json + weights + a HuggingFace
tokenizer.json): --prompt and --chat, the eos ids of generation_config.json (then
tokenizer_config.json), and the output of one prompt written as it is generated.

Oracles: ``_chat_models.chain_gpt`` models, whose greedy text is known character by character
(so the pieces written can be checked exactly: each is stable text, a multi-byte character
is never cut), and, for a random model, transformers' own ``apply_chat_template`` and
``decode`` around ``qkv.generate``. What is checked is the text written and in how many
pieces, never a time.
"""

from __future__ import annotations

import io
import json
import re
import sys

import pytest
import torch
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

import qkv
from _chat_models import SPECIALS, TEMPLATES, byte_level_json, chain_gpt, write_model_dir
from qkv.cli import main
from qkv.data import CharTokenizer
from qkv.models import GPT, GPTConfig

QWEN2 = TEMPLATES["qwen2"][0]
TEXT = "aé€😀b"  # 1, 2, 3 and 4 bytes: with one token per byte, 10 tokens
SPEED = re.compile(r"^qkv: (\d+) tokens in [\d.]+ s \([\d.]+ tokens/s, the first after "
                   r"[\d.]+ s\)$", re.M)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Pieces(io.StringIO):
    """stdout that remembers each write."""

    def __init__(self):
        super().__init__()
        self.pieces: list[str] = []

    def write(self, text):
        self.pieces.append(text)
        return super().write(text)


@pytest.fixture
def pieces(monkeypatch, capsys):
    """Records stdout's writes; replaces sys.stdout when called, in the test (capsys puts its
    own in place after the fixtures are set up)."""
    out = Pieces()

    def start():
        monkeypatch.setattr(sys, "stdout", out)
        return out

    return start


@pytest.fixture(scope="module")
def byte_tok():
    return byte_level_json(len(SPECIALS) + 256)  # no merges: one token per byte


@pytest.fixture(scope="module")
def chain(byte_tok):
    """x -> a é € 😀 b <|eot_id|> Z Z ...; a chat prompt's last "\\n" -> O K <|im_end|> Z."""
    tok = Tokenizer.from_str(byte_tok)

    def spell(s):
        return tok.encode(s, add_special_tokens=False).tokens

    return chain_gpt(tok, [[*spell("x" + TEXT), "<|eot_id|>", "Z", "Z"],
                           [*spell("\nOK"), "<|im_end|>", "Z"]]), tok


def _dir(tmp_path, name, chain, byte_tok, *, config=None, generation=None):
    return str(write_model_dir(tmp_path / name, chain[0], byte_tok, tokenizer_config=config,
                               generation_config=generation))


def test_one_prompt_is_written_as_generated_and_stops_at_the_eos_list(tmp_path, capsys,
                                                                     pieces, chain, byte_tok):
    """Each piece written is the text that became stable: a character waits for all its
    bytes. generation_config.json's eos list (its second id here) ends the output."""
    pieces = pieces()  # stdout from here on
    tok = chain[1]
    d = _dir(tmp_path, "m", chain, byte_tok, generation={
        "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|eot_id|>")]})
    assert main(["generate", d, "--prompt", "x", "--max-new-tokens", "20"]) == 0
    assert pieces.pieces == ["xa", "é", "€", "😀", "b", "\n"]
    assert [int(n) for n in SPEED.findall(capsys.readouterr().err)] == [12]  # eos included


def test_eos_falls_back_to_tokenizer_config_and_stop_adds(tmp_path, capsys, pieces, chain,
                                                          byte_tok):
    pieces = pieces()  # stdout from here on
    d = _dir(tmp_path, "fallback", chain, byte_tok, config={"eos_token": "<|eot_id|>"})
    assert main(["generate", d, "--prompt", "x", "--max-new-tokens", "20"]) == 0
    # no eos anywhere: the chain runs on through <|eot_id|> (special: not shown) into Z's
    bare = _dir(tmp_path, "bare", chain, byte_tok)
    assert main(["generate", bare, "--prompt", "x", "--max-new-tokens", "14"]) == 0
    # --stop adds a stop token, kept in the output
    assert main(["generate", d, "--prompt", "x", "--stop", "a", "--max-new-tokens", "20"]) == 0
    assert "".join(pieces.pieces).splitlines() == [f"x{TEXT}", f"x{TEXT}ZZ", "xa"]
    assert [int(n) for n in SPEED.findall(capsys.readouterr().err)] == [12, 14, 1]
    assert main(["generate", d, "--prompt", "x", "--stop", "€"]) == 2
    assert "--stop '€' is 3 tokens of this model's tokenizer" in capsys.readouterr().err


def test_chat_answers_through_the_template(tmp_path, capsys, pieces, chain, byte_tok):
    pieces = pieces()  # stdout from here on
    tok = chain[1]
    d = _dir(tmp_path, "chat", chain, byte_tok,
             config={"chat_template": QWEN2, "eos_token": "<|im_end|>",
                     "tokenizer_class": "PreTrainedTokenizerFast"})
    assert main(["generate", d, "--chat", "How are you?", "--system", "Be brief."]) == 0
    assert "".join(pieces.pieces) == "OK\n"
    assert [int(n) for n in SPEED.findall(capsys.readouterr().err)] == [3]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "How are you?"}]
    assert qkv.generation.chat(chain[0], d, messages) == "OK"
    # the oracle's prompt: transformers' apply_chat_template ends where the chain starts
    hf = PreTrainedTokenizerFast.from_pretrained(d)
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids[-1] == tok.token_to_id("Ċ")  # "\n"


def test_several_chat_questions_equal_transformers_prompts(tmp_path, capsys):
    """A random model, two questions (one line each, not streamed): each answer is
    qkv.generate on transformers' apply_chat_template ids, cut at the eos list, decoded by
    transformers without special tokens."""
    text = byte_level_json()
    tok = Tokenizer.from_str(text)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.get_vocab_size(), max_len=128, dim=32,
                          num_layers=2, num_heads=4)).eval()
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    d = str(write_model_dir(tmp_path / "r", model, text,
                            tokenizer_config={"chat_template": QWEN2, "eos_token": "<|im_end|>",
                                              "tokenizer_class": "PreTrainedTokenizerFast"},
                            generation_config={"eos_token_id": eos}))
    questions = ["Hello there?", "What is attention? 日本語"]
    assert main(["generate", d, "--chat", questions[0], "--chat", questions[1],
                 "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr()
    hf = PreTrainedTokenizerFast.from_pretrained(d)
    want = []
    for q in questions:
        ids = hf.apply_chat_template([{"role": "user", "content": q}],
                                     add_generation_prompt=True, return_dict=False)
        new = qkv.generate(model, torch.tensor([ids]), max_new_tokens=12,
                           eos_token_id=eos)[0, len(ids):].tolist()
        cut = next((i for i, t in enumerate(new) if t in eos), len(new))
        want.append(hf.decode(new[:cut], skip_special_tokens=True))
    assert out.out == "\n".join(want) + "\n"
    assert "tokens/s" not in out.err


def test_several_prompts_print_one_line_each(tmp_path, capsys, chain, byte_tok):
    d = _dir(tmp_path, "two", chain, byte_tok, config={"eos_token": "<|eot_id|>"})
    assert main(["generate", d, "--prompt", "x", "--prompt", "ax", "--max-new-tokens",
                 "20"]) == 0
    out = capsys.readouterr()
    assert out.out == f"x{TEXT}\nax{TEXT}\n" and "tokens/s" not in out.err


def test_a_run_streams_its_one_prompt(tmp_path, capsys, pieces):
    """A `qkv train` run (qkv's own tokenizer.json): one prompt is written token by token,
    and the whole is the text it printed before streaming (prompt + continuation)."""
    pieces = pieces()  # stdout from here on
    tok = CharTokenizer("abcdefgh ")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, max_len=32, dim=32, num_layers=2,
                          num_heads=4)).eval()
    run = tmp_path / "run"
    model.save_pretrained(run)
    tok.save(run / "tokenizer.json")
    (run / "run.json").write_text(json.dumps({"model": "gpt", "task": None}))
    assert main(["generate", str(run), "--prompt", "abc", "--max-new-tokens", "8"]) == 0
    ids = qkv.generate(model, torch.tensor([tok.encode("abc")]), max_new_tokens=8,
                       eos_token_id=tok.eos_id)[0, 3:].tolist()
    new = ids[:ids.index(tok.eos_id)] if tok.eos_id in ids else ids
    assert "".join(pieces.pieces) == "abc" + tok.decode(new) + "\n"
    shown = [tok.decode([t]) for t in new]  # one piece per shown token, the first with "abc"
    assert pieces.pieces == ["abc" + shown[0], *shown[1:], "\n"]
    assert len(SPEED.findall(capsys.readouterr().err)) == 1


@pytest.mark.parametrize("args, message", [
    (["--chat", "hi"], "has no chat template"),
    (["--prompt", "x", "--system", "s"], "--system applies only with --chat"),
    (["--chat", "hi", "--prompt", "x"], "not allowed with argument"),
])
def test_chat_refusals(tmp_path, capsys, chain, byte_tok, args, message):
    d = _dir(tmp_path, "plain", chain, byte_tok, config={"eos_token": "<|eot_id|>"})
    try:
        code = main(["generate", d, *args])
    except SystemExit as exc:  # argparse refused the combination
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_chat_on_a_run_is_refused(tmp_path, capsys):
    tok = CharTokenizer("abc")
    run = tmp_path / "run"
    GPT(GPTConfig(vocab_size=tok.vocab_size, max_len=16, dim=16, num_layers=1,
                  num_heads=2)).save_pretrained(run)
    tok.save(run / "tokenizer.json")
    assert main(["generate", str(run), "--chat", "hi"]) == 2
    assert "--chat needs a model directory with a chat template" in capsys.readouterr().err


def test_hf_gpt2_directory_stops_where_transformers_generate_stops(tmp_path, capsys):
    """A transformers GPT-2 directory (random weights): ``qkv generate DIR --prompt`` prints
    the prompt and the text of transformers' own greedy ``generate``, which reads the same
    generation_config.json eos list (one of its ids chosen where greedy produces it)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    text = byte_level_json()
    tok = Tokenizer.from_str(text)
    end = tok.token_to_id("<|endoftext|>")
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=64, n_embd=32,
                                    n_layer=2, n_head=4, initializer_range=0.3,
                                    bos_token_id=end, eos_token_id=end)).eval()
    prompt = "Hello there, how"
    ids = torch.tensor([tok.encode(prompt).ids])
    free = hf.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None,
                       pad_token_id=end)[0, ids.shape[1]:].tolist()
    hf.generation_config.eos_token_id = [end, free[4]]  # greedy stops after 5 tokens
    d = tmp_path / "gpt2"
    hf.save_pretrained(d)
    (d / "tokenizer.json").write_text(text, encoding="utf-8")
    want = hf.generate(ids, max_new_tokens=10, do_sample=False,
                       pad_token_id=end)[0, ids.shape[1]:].tolist()  # its own eos list
    assert want[-1] == free[4] and len(want) <= 5
    cut = next(i for i, t in enumerate(want) if t in (end, free[4]))
    assert main(["generate", str(d), "--prompt", prompt, "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out == prompt + tok.decode(want[:cut]) + "\n"
