"""Tokenizers, chat templates and models for the chat, streaming and ``qkv generate DIR``
tests, all built here (nothing is downloaded).

- ``SPECIALS``: the control tokens of the template families tested, added to every tokenizer
  as special tokens (so that a rendered template tokenizes them as one id each).
- ``byte_level_json`` / ``metaspace_json``: a GPT-2-style byte-level BPE and a
  SentencePiece-style (Metaspace) BPE, trained on a few sentences, as tokenizer.json text.
- ``TEMPLATES``: chat templates written from the text their model cards publish (Llama 3,
  Llama 3.2 without tools, Qwen2 ChatML, Qwen2.5 with tools, Gemma 2, Llama 2, Mistral
  v0.1) and one of our own that uses ``namespace``, ``{% continue %}`` and
  ``{% generation %}``.
- ``chain_gpt``: a ``qkv.models.GPT`` whose greedy next token depends only on the current
  token and follows given chains exactly (attention and FFN outputs zeroed, no positions,
  one-hot embeddings of the chain tokens, an LM head whose row for token n is the final
  norm of the token before it): its outputs are known in advance, so a test can check
  text character by character (multi-byte characters split over several tokens).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from qkv.models import GPT, GPTConfig

SPECIALS = ["<unk>", "<pad>", "<s>", "</s>", "<bos>", "<eos>", "<|begin_of_text|>",
            "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<start_of_turn>",
            "<end_of_turn>"]

CORPUS = ["Hello there, how are you? I am fine, thank you.",
          "You are a helpful assistant. Answer briefly.",
          "What is attention? Attention weighs the values by the queries and keys.",
          "system user assistant model tool function arguments weather city",
          "Über 日本語 😀 naïve café €"] * 4


def byte_level_json(vocab_size: int = 420) -> str:
    """A GPT-2-style byte-level BPE (any text, no <unk>) with ``SPECIALS``; with
    ``vocab_size`` = len(SPECIALS) + 256 it has no merges (one token per byte)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok.to_str()


def metaspace_json() -> str:
    """A SentencePiece-style BPE: spaces as ▁, one prepended to the text's first word, and
    <s> added in front of every encoding with special tokens (Llama 2's post-processor: a
    chat prompt must be encoded without it, the template writes its own)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok.to_str()


LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
          "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content "
          "%}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
          "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

LLAMA32 = r"""{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""  # noqa: E501

QWEN2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
         "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
         "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501

GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
         "not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == "
         "'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must "
         "alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == "
         "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
         "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
         "{{'<start_of_turn>model\n'}}{% endif %}")

LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set "
          "system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
          "{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if "
          "(message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception("
          "'Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + "
          "system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content "
          "= message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + "
          "'[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
          "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")

MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
           "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
           "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
           "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == "
           "'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only "
           "user and assistant roles are supported!') }}{% endif %}{% endfor %}")

OURS = """{%- set ns = namespace(system='', turns=0) -%}
{%- for message in messages -%}
  {%- if message.role == 'system' -%}
    {%- set ns.system = message.content -%}
    {%- continue -%}
  {%- endif -%}
  {%- set ns.turns = ns.turns + 1 -%}
  {{- '<|im_start|>' + message.role + ('[' + ns.system + ']' if ns.system else '') + '\\n' -}}
  {%- if message.role == 'assistant' -%}
    {% generation %}{{ message.content | tojson }}{% endgeneration %}
  {%- else -%}
    {{ message.content }}
  {%- endif -%}
  {{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant #' ~ ns.turns ~ '\\n' }}{%- endif -%}
"""

#: family -> (template, special tokens, whether it takes a system message)
TEMPLATES = {
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, True),
    "llama3.2": (LLAMA32, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, True),
    "qwen2": (QWEN2, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, True),
    "qwen2.5": (QWEN25, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, True),
    "gemma": (GEMMA, {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}, False),
    "llama2": (LLAMA2, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, True),
    "mistral": (MISTRAL, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, False),
    "ours": (OURS, {"eos_token": "<|im_end|>"}, True),
}


def chain_gpt(tokenizer: Tokenizer, chains: list[list[str]], *, dim: int = 64) -> GPT:
    """A GPT whose greedy continuation of any chain token is the next token of its chain:
    ``chains`` are lists of tokens (as ``tokenizer`` spells them); a token may start or
    continue several chains only if each time it is followed by the same token, and may be
    followed by itself (a loop). At most ``dim`` distinct tokens."""
    succ: dict[int, int] = {}
    for chain in chains:
        ids = [tokenizer.token_to_id(t) for t in chain]
        assert None not in ids, chain
        for a, b in itertools.pairwise(ids):
            assert succ.setdefault(a, b) == b, f"{chain}: two successors of {a}"
    tokens = sorted(set(succ) | set(succ.values()))
    assert len(tokens) <= dim
    vocab = tokenizer.get_vocab_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, max_len=128, dim=dim, num_layers=1, num_heads=4,
                          tie_embeddings=False, dropout=0.0)).eval()
    slot = {t: k for k, t in enumerate(tokens)}
    with torch.no_grad():
        emb = model.embed.weight
        for t, k in slot.items():
            emb[t] = 0.0
            emb[t, k] = 1.0
        model.positions.weight.zero_()
        for layer in model.layers:
            for p in (*layer.attn.out_proj.parameters(), *layer.ffn.fc_out.parameters()):
                p.zero_()
        normed = torch.layer_norm(emb[tokens], (dim,), model.norm.weight, model.norm.bias,
                                  model.config.norm_eps)  # (len(tokens), C)
        head = torch.zeros(vocab, dim)
        for a, b in succ.items():
            head[b] += normed[slot[a]]
        model.lm_head.weight.copy_(head)
    return model


def write_model_dir(path: Path, model: GPT, tokenizer_json: str, *,
                    tokenizer_config: dict | None = None,
                    generation_config: dict | None = None) -> Path:
    """A model directory: config.json + model.safetensors (qkv's), an HF tokenizer.json and
    the given tokenizer_config.json / generation_config.json."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    for name, data in (("tokenizer_config.json", tokenizer_config),
                       ("generation_config.json", generation_config)):
        if data is not None:
            (path / name).write_text(json.dumps(data), encoding="utf-8")
    return path
