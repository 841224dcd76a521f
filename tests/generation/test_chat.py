"""Chat templates (``qkv.generation.chat``) against transformers' own ``apply_chat_template``
(the oracle: ``PreTrainedTokenizerFast`` over the same tokenizer.json, and its
``from_pretrained`` on the same directory), the stop tokens of a directory against
``transformers.GenerationConfig``, and ``chat`` end to end. Templates are written in
``_chat_models`` from their published text; tokenizers are trained here. Token ids are
compared exactly (lists of ints).
"""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer
from transformers import GenerationConfig, PreTrainedTokenizerFast

import qkv
from _chat_models import SPECIALS, TEMPLATES, byte_level_json, chain_gpt, metaspace_json
from _chat_models import write_model_dir as _write_dir
from qkv.files import CheckpointError
from qkv.generation.chat import (
    ChatTemplateError,
    chat_prompt_ids,
    read_chat_template,
    read_generation_config,
    read_special_tokens,
    render_chat,
    stop_token_ids,
)

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
TURNS = [{"role": "user", "content": "Hello there, how are you?  "},
         {"role": "assistant", "content": " I am fine, thank you."},
         {"role": "user", "content": "What is attention? Über 日本語 😀"}]


@pytest.fixture(scope="module")
def tokenizers_json():
    return {"byte-level": byte_level_json(), "metaspace": metaspace_json()}


def _hf(text: str, template=None, **specials) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(text),
                                   chat_template=template, **specials)


def _hf_ids(tok: PreTrainedTokenizerFast, messages, **kwargs) -> list[int]:
    return tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)


def _conversations(system: bool):
    convs = [TURNS[:1], TURNS]
    return convs + ([[SYSTEM, *TURNS[:1]], [SYSTEM, *TURNS]] if system else [])


@pytest.mark.parametrize("kind", ["byte-level", "metaspace"])
@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_prompt_ids_equal_apply_chat_template(tokenizers_json, kind, family):
    """Every family, single and multi-turn, with a system message where it takes one: the
    text equals transformers' tokenize=False rendering and the ids its tokenize=True ids,
    with and without the generation prompt."""
    template, specials, takes_system = TEMPLATES[family]
    text = tokenizers_json[kind]
    hf = _hf(text, template, **specials)
    ours = Tokenizer.from_str(text)
    for messages in _conversations(takes_system):
        for gen in (True, False):
            want = _hf_ids(hf, messages, add_generation_prompt=gen)
            got = chat_prompt_ids(ours, messages, chat_template=template,
                                  add_generation_prompt=gen, **specials)
            assert got == want, (family, kind, gen, messages)
            assert render_chat(template, messages, add_generation_prompt=gen, **specials) == \
                hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    # the default is add_generation_prompt=True: the prompt ends where the answer starts
    assert chat_prompt_ids(ours, TURNS[:1], chat_template=template, **specials) == \
        _hf_ids(hf, TURNS[:1], add_generation_prompt=True)


def test_tools_tojson_and_tool_calls_render_as_transformers(tokenizers_json):
    """Qwen2.5's tools branch: ``tojson`` keeps non-ASCII and <, > unescaped, tool calls and
    tool responses, None values dropped from a message (as transformers)."""
    template, specials, _ = TEMPLATES["qwen2.5"]
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city <now> — ünïcode",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}
    messages = [SYSTEM, {"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "content": None, "tool_calls": [{"type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
                {"role": "tool", "content": "sunny, 21 °C"}]
    text = tokenizers_json["byte-level"]
    hf = _hf(text, template, **specials)
    want = _hf_ids(hf, messages, tools=[tool], add_generation_prompt=True)
    got = chat_prompt_ids(Tokenizer.from_str(text), messages, chat_template=template,
                          tools=[tool], **specials)
    assert got == want
    rendered = render_chat(template, messages, tools=[tool], **specials)
    assert '"Weather in a city <now> — ünïcode"' in rendered


def test_reasoning_fields_and_extra_variables_reach_the_template(tokenizers_json):
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content }}|{{ m.thinking }}|"
                "{{ m.reasoning_content }};{% endfor %}{{ enable_thinking }}{{ bos_token }}")
    messages = [{"role": "assistant", "content": "x", "reasoning": "because"},
                {"role": "assistant", "content": "y", "thinking": "t",
                 "reasoning_content": "r"}]
    hf = _hf(tokenizers_json["byte-level"], template, bos_token="<s>")
    want = hf.apply_chat_template(messages, tokenize=False, enable_thinking=False)
    assert render_chat(template, messages, add_generation_prompt=False, enable_thinking=False,
                       bos_token="<s>") == want


@pytest.mark.parametrize("family, messages, message", [
    ("gemma", [SYSTEM, *TURNS[:1]], "System role not supported"),
    ("gemma", [TURNS[0], TURNS[0]], "Conversation roles must alternate"),
    ("llama2", [SYSTEM, TURNS[1]], "Conversation roles must alternate"),
    ("mistral", [SYSTEM, *TURNS[:1]], "Conversation roles must alternate"),
    ("mistral", [*TURNS, {"role": "tool", "content": "x"}],
     "Only user and assistant roles are supported!"),
])
def test_raise_exception_refuses_as_transformers(tokenizers_json, family, messages, message):
    """A template's raise_exception: transformers raises a TemplateError with the message,
    qkv a ChatTemplateError (a ValueError) quoting it."""
    import jinja2

    template, specials, _ = TEMPLATES[family]
    hf = _hf(tokenizers_json["byte-level"], template, **specials)
    with pytest.raises(jinja2.TemplateError, match=message.replace("!", "")):
        hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ChatTemplateError, match=f"refused the messages: {message}"):
        render_chat(template, messages, **specials)


def test_bad_input_is_a_clear_error():
    template = TEMPLATES["qwen2"][0]
    with pytest.raises(ValueError, match="messages is empty"):
        render_chat(template, [])
    with pytest.raises(TypeError, match=r"messages\[1\] must be a dict with a str 'role'"):
        render_chat(template, [TURNS[0], {"content": "no role"}])
    with pytest.raises(TypeError, match="must be a list"):
        render_chat(template, "hello")
    with pytest.raises(TypeError, match=r"messages\[0\] must hold only JSON-like values"):
        render_chat(template, [{"role": "user", "content": torch.zeros(2)}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat("{% for m in messages %}", TURNS)
    with pytest.raises(ChatTemplateError, match="failed: UndefinedError"):
        render_chat("{{ messages[0].content.nope.deeper }}", TURNS)
    # the sandbox: no attribute of a Python internal, no underscore names on a namespace
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        render_chat("{{ messages.__class__.__subclasses__() }}", TURNS)
    with pytest.raises(ChatTemplateError, match="underscore"):
        render_chat("{% set ns = namespace(_x=1) %}", TURNS)
    with pytest.raises(TypeError, match="chat_template="):
        chat_prompt_ids(Tokenizer.from_str(byte_level_json(300)), TURNS)
    with pytest.raises(TypeError, match="source must be a model directory"):
        chat_prompt_ids(3, TURNS)


# ------------------------------------------------------------------------ directory files

def _tiny_dir(path, text, files=()):
    """A directory with tokenizer.json and ``files`` (name -> JSON data or text)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(text, encoding="utf-8")
    for name, data in dict(files).items():
        (path / name).write_text(data if isinstance(data, str) else json.dumps(data),
                                 encoding="utf-8")
    return path


def test_directory_saved_by_transformers_5(tmp_path, tokenizers_json):
    """A directory written by transformers 5's ``save_pretrained`` (chat_template.jinja,
    special tokens in tokenizer_config.json): the same ids as the tokenizer it reloads."""
    template, specials, _ = TEMPLATES["llama3"]
    _hf(tokenizers_json["byte-level"], template, **specials).save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    hf = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    messages = [SYSTEM, *TURNS]
    assert chat_prompt_ids(tmp_path, messages) == _hf_ids(hf, messages,
                                                          add_generation_prompt=True)
    assert read_chat_template(tmp_path) == template
    assert read_special_tokens(tmp_path) == hf.special_tokens_map


def test_named_templates_and_token_dicts_in_tokenizer_config(tmp_path, tokenizers_json):
    """The list form of chat_template (default + tool_use), special tokens in the
    {"content": ...} form, a legacy special_tokens_map.json: as transformers reads them."""
    default = TEMPLATES["qwen2"][0]
    tool_use = TEMPLATES["qwen2.5"][0]
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              "chat_template": [{"name": "default", "template": default},
                                {"name": "tool_use", "template": tool_use}],
              "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False,
                            "normalized": False, "rstrip": False, "single_word": False},
              "pad_token": "<|endoftext|>"}
    d = _tiny_dir(tmp_path / "d", tokenizers_json["byte-level"], {
        "tokenizer_config.json": config,
        "special_tokens_map.json": {"bos_token": {"content": "<s>"}}})
    hf = PreTrainedTokenizerFast.from_pretrained(d)
    assert read_special_tokens(d) == hf.special_tokens_map == {
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": "<s>"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    for kwargs in ({}, {"tools": [tool]}, {"chat_template": "tool_use"}):
        want = _hf_ids(hf, TURNS, add_generation_prompt=True, **kwargs)
        assert chat_prompt_ids(d, TURNS, **kwargs) == want, kwargs
    assert read_chat_template(d, tools=True) == tool_use
    assert read_chat_template(d, "tool_use") == tool_use
    with pytest.raises(ValueError, match=r"no chat template named 'nope'; it has \['default'"):
        read_chat_template(d, "nope")


def test_template_files_take_priority_and_need_a_default(tmp_path, tokenizers_json):
    text = tokenizers_json["byte-level"]
    d = _tiny_dir(tmp_path / "files", text, {
        "tokenizer_config.json": {"chat_template": TEMPLATES["gemma"][0],
                                  "eos_token": "<|im_end|>"},
        "chat_template.jinja": TEMPLATES["qwen2"][0]})
    assert read_chat_template(d) == TEMPLATES["qwen2"][0]
    hf = PreTrainedTokenizerFast.from_pretrained(d)
    assert chat_prompt_ids(d, TURNS) == _hf_ids(hf, TURNS, add_generation_prompt=True)
    extra = _tiny_dir(tmp_path / "extra", text)
    (extra / "additional_chat_templates").mkdir()
    for name in ("a", "b"):
        (extra / "additional_chat_templates" / f"{name}.jinja").write_text(name + "{{ 1 }}")
    with pytest.raises(ValueError, match=r"none is 'default'; pass name= one of \['a', 'b'\]"):
        read_chat_template(extra)
    assert read_chat_template(extra, "b") == "b{{ 1 }}"
    none = _tiny_dir(tmp_path / "none", text, {"tokenizer_config.json": {"eos_token": "</s>"}})
    assert read_chat_template(none) is None
    with pytest.raises(ValueError, match="has no chat template"):
        chat_prompt_ids(none, TURNS)
    bad = _tiny_dir(tmp_path / "bad", text,
                    {"tokenizer_config.json": {"chat_template": 3, "bos_token": 5}})
    with pytest.raises(CheckpointError, match="chat_template must be a string"):
        read_chat_template(bad)
    with pytest.raises(CheckpointError, match=r"bos_token must be a string.*got 5"):
        read_special_tokens(bad)


# ---------------------------------------------------------------------------- stop tokens

@pytest.mark.parametrize("eos", [7, [7], [3, 10, 12]])
def test_generation_config_ids_as_transformers_reads_them(tmp_path, eos):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos, "bos_token_id": 2, "pad_token_id": 1, "do_sample": True}))
    hf = GenerationConfig.from_pretrained(tmp_path)
    want = tuple(hf.eos_token_id) if isinstance(hf.eos_token_id, list) else (hf.eos_token_id,)
    ours = read_generation_config(tmp_path)
    assert ours.eos_token_id == want
    assert (ours.bos_token_id, ours.pad_token_id) == (hf.bos_token_id, hf.pad_token_id)
    assert stop_token_ids(tmp_path) == want


@pytest.mark.parametrize("value", [True, -1, [], [1, "2"], "3", 2.0])
def test_bad_generation_config_ids_are_refused(tmp_path, value):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id must be"):
        read_generation_config(tmp_path)


def test_stop_ids_fall_back_to_config_then_tokenizer_config(tmp_path, tokenizers_json):
    text = tokenizers_json["byte-level"]
    tok = Tokenizer.from_str(text)
    d = _tiny_dir(tmp_path / "d", text, {"tokenizer_config.json": {"eos_token": "<|eot_id|>"}})
    assert read_generation_config(d).eos_token_id is None
    assert stop_token_ids(d) == (tok.token_to_id("<|eot_id|>"),)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": [4, 5]}))
    assert stop_token_ids(d) == (4, 5)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert stop_token_ids(d) == (4, 5)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert stop_token_ids(d) == (9,)
    unknown = _tiny_dir(tmp_path / "u", text,
                        {"tokenizer_config.json": {"eos_token": "<nope>"}})
    with pytest.raises(CheckpointError, match="eos_token '<nope>' is not a token"):
        stop_token_ids(unknown)
    assert stop_token_ids(_tiny_dir(tmp_path / "empty", text)) is None


# ----------------------------------------------------------------------------------- chat

def test_chat_answers_through_the_template_and_stops_at_eos(tmp_path):
    """``chat`` on a model whose greedy answer is known (``chain_gpt``): the prompt is
    transformers' apply_chat_template, generation stops at generation_config.json's eos list
    (not the tokenizer_config eos_token), the answer is decoded without special tokens."""
    text = byte_level_json(len(SPECIALS) + 256)  # one token per byte
    tok = Tokenizer.from_str(text)

    def spell(s):
        return tok.encode(s, add_special_tokens=False).tokens

    # Qwen2's generation prompt ends in "\n": the answer is "OK é" then <|im_end|>
    model = chain_gpt(tok, [[*spell("\nOK é"), "<|im_end|>", "Z", "Z"]])
    template = TEMPLATES["qwen2"][0]
    d = _write_dir(tmp_path / "m", model, text,
                   tokenizer_config={"chat_template": template, "eos_token": "<|endoftext|>",
                                     "tokenizer_class": "PreTrainedTokenizerFast"},
                   generation_config={"eos_token_id": [tok.token_to_id("<|endoftext|>"),
                                                       tok.token_to_id("<|im_end|>")]})
    messages = [SYSTEM, {"role": "user", "content": "How are you?"}]
    assert qkv.generation.chat(model, d, messages, max_new_tokens=20) == "OK é"
    # the oracle: transformers' prompt, qkv.generate, transformers' decoding
    hf = PreTrainedTokenizerFast.from_pretrained(d)
    ids = torch.tensor([_hf_ids(hf, messages, add_generation_prompt=True)])
    out = qkv.generate(model, ids, max_new_tokens=20)[0, ids.shape[1]:].tolist()
    end = out.index(tok.token_to_id("<|im_end|>"))
    assert hf.decode(out[:end], skip_special_tokens=True) == "OK é"
    assert hf.decode(out, skip_special_tokens=True).startswith("OK éZZ")  # eos matters
    # one question is one user message (Qwen2 adds its default system message)
    assert qkv.generation.chat(model, d, "How are you?", max_new_tokens=20) == "OK é"
    # eos_token_id given replaces the directory's: <unk> never comes, so the answer runs to
    # max_new_tokens (O K Ġ Ã © <|im_end|> Z Z; the special token is not shown)
    assert qkv.generation.chat(model, d, messages, max_new_tokens=8,
                               eos_token_id=tok.token_to_id("<unk>")) == "OK éZZ"
