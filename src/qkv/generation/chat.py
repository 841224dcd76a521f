"""Chat templates and stop tokens of a HuggingFace model directory: the prompt of a
conversation token for token as ``transformers``' ``tokenizer.apply_chat_template(messages,
add_generation_prompt=True)`` builds it, the eos ids ``generate`` should stop at, and
``chat`` (a conversation or a question in, the answer's text out).

Shapes: N prompt length, T new tokens.

**Files read** (a model directory as ``transformers`` 4.x/5.x saves it):

- ``tokenizer.json``: the tokenizer (``qkv.models.hub.load_tokenizer``, HF ``tokenizers``).
- ``chat_template.jinja`` (the default template) and ``additional_chat_templates/NAME.jinja``
  (named ones), as transformers 5 saves them; where any of them exists they replace the
  templates of tokenizer_config.json (transformers' priority).
- ``tokenizer_config.json``: ``chat_template``, one string or a list of ``{"name",
  "template"}``; the special tokens ``bos_token``, ``eos_token``, ``unk_token``,
  ``sep_token``, ``pad_token``, ``cls_token``, ``mask_token`` (a string or the
  ``{"content": ...}`` form of an added token). A legacy ``special_tokens_map.json`` overrides
  them where tokenizer_config.json has no ``added_tokens_decoder`` (as transformers reads it).
- ``generation_config.json`` (then ``config.json``): ``eos_token_id`` (an id or a list of
  ids), ``bos_token_id``, ``pad_token_id``.

**Rendering** (``render_chat``) is transformers' (``utils/chat_template_utils.py``): a Jinja2
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension and the ``{% generation %}`` block tag (rendered as its body), the
globals ``raise_exception(message)``, ``strftime_now(format)``, a ``dict`` constructor and a
``namespace`` that refuses underscore names, and a ``tojson`` filter that does not escape
HTML (``json.dumps`` with ``ensure_ascii=False``). The template sees ``messages``, ``tools``,
``documents``, ``add_generation_prompt`` and the special tokens (then any extra variables).
The messages are copied first: keys whose value is None are dropped, and a message's
reasoning (``reasoning_content``, ``thinking`` or ``reasoning``) is also passed as
``thinking`` and ``reasoning_content``, as transformers does. The rendered text is tokenized
without adding special tokens again (the template writes them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..files import CheckpointError, read_json
from ..models.hub import load_tokenizer

__all__ = ["SPECIAL_TOKEN_NAMES", "ChatTemplateError", "GenerationTokens", "chat",
           "chat_prompt_ids", "read_chat_template", "read_generation_config",
           "read_special_tokens", "render_chat", "special_token_id", "stop_token_ids"]

#: The special tokens a chat template sees by name (transformers' ``SPECIAL_TOKENS_ATTRIBUTES``).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")

_TEMPLATE_FILE = "chat_template.jinja"
_TEMPLATE_DIR = "additional_chat_templates"
_TOKENIZER_CONFIG = "tokenizer_config.json"
_SPECIAL_TOKENS_MAP = "special_tokens_map.json"
_GENERATION_CONFIG = "generation_config.json"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' order
_DEFAULT_MAX_NEW_TOKENS = 100


class ChatTemplateError(ValueError):
    """A chat template that does not compile, fails while rendering, or refuses the messages
    (its ``raise_exception``: the message is the template's own)."""


class _Refused(Exception):
    """What a template's ``raise_exception(message)`` raises (Jinja lets it through)."""


# --------------------------------------------------------------------------- directory files

def _read_json_file(path: Path) -> dict | None:
    return read_json(path) if path.exists() else None


def _templates(directory: Path) -> dict[str, str]:
    """Every chat template of a directory by name ("default" for the single one)."""
    found: dict[str, str] = {}
    if (directory / _TEMPLATE_FILE).is_file():
        found["default"] = (directory / _TEMPLATE_FILE).read_text(encoding="utf-8")
    extra = directory / _TEMPLATE_DIR
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            found[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if found:  # template files take priority over tokenizer_config.json (transformers')
        return found
    config = _read_json_file(directory / _TOKENIZER_CONFIG) or {}
    value = config.get("chat_template")
    where = directory / _TOKENIZER_CONFIG
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        for item in value:
            if (not isinstance(item, dict) or not isinstance(item.get("name"), str)
                    or not isinstance(item.get("template"), str)):
                raise CheckpointError(f"{where}: chat_template must be a string or a list of "
                                      f"{{\"name\": str, \"template\": str}}, got an item "
                                      f"{item!r:.80}")
        return {item["name"]: item["template"] for item in value}
    raise CheckpointError(f"{where}: chat_template must be a string or a list of named "
                          f"templates, got {type(value).__name__}")


def read_chat_template(directory: str | os.PathLike, name: str | None = None, *,
                       tools: bool = False) -> str | None:
    """The Jinja text of a directory's chat template, None when it has none (see the module
    docstring for the files), chosen as transformers' ``get_chat_template`` chooses it.

    Args:
        directory: a model directory.
        name: a named template (of the list form or ``additional_chat_templates/``); None:
            the "default" one ("tool_use" when ``tools`` and the directory has one).
        tools: the conversation passes tools.

    Raises:
        ValueError: ``name`` that the directory does not have, or several templates of which
        none is "default" and no ``name`` (naming the ones there are); CheckpointError: a
        malformed tokenizer_config.json.
    """
    templates = _templates(Path(directory))
    if name is not None:
        if name not in templates:
            raise ValueError(f"read_chat_template: {directory} has no chat template named "
                             f"{name!r}; it has {sorted(templates) or 'none'}")
        return templates[name]
    if not templates:
        return None
    if tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" not in templates:
        raise ValueError(f"read_chat_template: {directory} has several chat templates and "
                         f"none is 'default'; pass name= one of {sorted(templates)}")
    return templates["default"]


def _token_text(value: Any, where: str, key: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise CheckpointError(f"{where}: {key} must be a string, {{\"content\": str}} or null, "
                          f"got {value!r:.80}")


def read_special_tokens(directory: str | os.PathLike) -> dict[str, str]:
    """The named special tokens of a directory as text, e.g. ``{"bos_token": "<s>",
    "eos_token": "</s>"}`` (only those it sets; names: ``SPECIAL_TOKEN_NAMES``), from
    tokenizer_config.json and, where that has no ``added_tokens_decoder``, a legacy
    special_tokens_map.json over it (as transformers reads them). ``{}`` without either file.

    Raises:
        CheckpointError: a token that is neither a string nor ``{"content": str}``.
    """
    directory = Path(directory)
    config = _read_json_file(directory / _TOKENIZER_CONFIG) or {}
    found = {}
    for key in SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(key), str(directory / _TOKENIZER_CONFIG), key)
        if text is not None:
            found[key] = text
    legacy = _read_json_file(directory / _SPECIAL_TOKENS_MAP)
    if legacy is not None and "added_tokens_decoder" not in config:
        for key in SPECIAL_TOKEN_NAMES:
            if key in legacy:
                text = _token_text(legacy[key], str(directory / _SPECIAL_TOKENS_MAP), key)
                if text is None:
                    found.pop(key, None)
                else:
                    found[key] = text
    return found


@dataclasses.dataclass(frozen=True)
class GenerationTokens:
    """The token ids of a directory's generation_config.json (each None when unset).

    Args:
        eos_token_id: the stop tokens, one or several (a list in the file).
        bos_token_id, pad_token_id: single ids.
    """

    eos_token_id: tuple[int, ...] | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None


def _ids(value: Any, where: str, key: str, *, several: bool) -> tuple[int, ...] | None:
    def is_id(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if value is None:
        return None
    if is_id(value):
        return (value,)
    if several and isinstance(value, list) and value and all(is_id(v) for v in value):
        return tuple(value)
    want = "a token id >= 0, a non-empty list of them or null" if several else (
        "a token id >= 0 or null")
    raise CheckpointError(f"{where}: {key} must be {want}, got {value!r}")


def read_generation_config(directory: str | os.PathLike) -> GenerationTokens:
    """The token ids of ``directory/generation_config.json`` (``GenerationTokens``; all None
    when the file is absent). Other fields (sampling defaults, lengths) are not read.

    Raises:
        CheckpointError: an id that is not an int >= 0 (or, for ``eos_token_id``, a
        non-empty list of them), naming the file and the field.
    """
    path = Path(directory) / _GENERATION_CONFIG
    data = _read_json_file(path)
    if data is None:
        return GenerationTokens()
    eos = _ids(data.get("eos_token_id"), str(path), "eos_token_id", several=True)
    bos, pad = (_ids(data.get(k), str(path), k, several=False)
                for k in ("bos_token_id", "pad_token_id"))
    return GenerationTokens(eos_token_id=eos, bos_token_id=None if bos is None else bos[0],
                            pad_token_id=None if pad is None else pad[0])


def stop_token_ids(directory: str | os.PathLike, tokenizer: Any = None
                   ) -> tuple[int, ...] | None:
    """The ids generation should stop at for a model directory: generation_config.json's
    ``eos_token_id`` (one or several, e.g. Llama 3's ``<|end_of_text|>``, ``<|eom_id|>`` and
    ``<|eot_id|>``); else config.json's (what transformers' ``GenerationConfig
    .from_model_config`` takes); else the id of tokenizer_config.json's ``eos_token`` in the
    tokenizer (``tokenizer``, a ``tokenizers.Tokenizer``; default the directory's
    tokenizer.json). None when none of them says.

    Raises:
        CheckpointError: a malformed id, or an ``eos_token`` the tokenizer does not have.
    """
    directory = Path(directory)
    eos = read_generation_config(directory).eos_token_id
    if eos is not None:
        return eos
    config = directory / "config.json"
    if config.is_file():
        eos = _ids(read_json(config).get("eos_token_id"), str(config), "eos_token_id",
                   several=True)
        if eos is not None:
            return eos
    if read_special_tokens(directory).get("eos_token") is None:
        return None
    tokenizer = load_tokenizer(directory) if tokenizer is None else tokenizer
    if tokenizer is None:
        return None
    return (special_token_id(directory, "eos_token", tokenizer),)


def special_token_id(directory: str | os.PathLike, name: str, tokenizer: Any) -> int | None:
    """The id in ``tokenizer`` (a ``tokenizers.Tokenizer``) of the directory's special token
    ``name`` ("eos_token", "bos_token"... of ``read_special_tokens``), or None when the
    directory names none.

    Raises:
        CheckpointError: a token the tokenizer does not have."""
    directory = Path(directory)
    text = read_special_tokens(directory).get(name)
    if text is None:
        return None
    tid = tokenizer.token_to_id(text)
    if tid is None:
        raise CheckpointError(f"{directory / _TOKENIZER_CONFIG}: {name} {text!r} is not a "
                              f"token of the tokenizer")
    return tid


# --------------------------------------------------------------------------------- rendering

@functools.lru_cache(maxsize=32)
def _compile(template: str):
    """The compiled template in transformers' sandboxed environment (cached by its text)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask tag):
        rendered as its body."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise _Refused(str(message))

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class TemplateDict:
        """``dict(...)`` without the class itself (no attribute access to break out by)."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """Jinja's ``namespace`` refusing underscore-prefixed attribute names."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for key in attrs:
                TemplateNamespace.check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key, value):
            TemplateNamespace.check(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def check(key):
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a "
                    f"namespace, got {key!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=TemplateDict(), namespace=TemplateNamespace)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(f"render_chat: the chat template does not compile: {err} "
                                f"(line {err.lineno})") from err


def _plain(value: Any, where: str) -> Any:
    """A copy of JSON-like data made of exact built-in types (what the template sees)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, numpy scalars) lose their methods
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v, where) for v in value)
    raise TypeError(f"render_chat: {where} must hold only JSON-like values (str, numbers, "
                    f"bools, None, lists, dicts), got a {type(value).__name__}")


def _messages(messages: Any) -> list[dict]:
    """The messages as the template sees them (see the module docstring)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"render_chat: messages must be a list of {{\"role\": ..., "
                        f"\"content\": ...}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("render_chat: messages is empty; a conversation needs at least one "
                         "message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise TypeError(f"render_chat: messages[{i}] must be a dict with a str 'role' "
                            f"(and usually 'content'), got {message!r:.80}")
        plain = _plain({k: v for k, v in message.items() if v is not None}, f"messages[{i}]")
        reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None),
                         None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


def render_chat(template: str, messages: Sequence[Mapping[str, Any]], *,
                add_generation_prompt: bool = True, tools: Sequence[Mapping] | None = None,
                documents: Sequence[Mapping] | None = None, **variables: Any) -> str:
    """A conversation as the text of a chat template, as transformers renders it (module
    docstring): ``tokenizer.apply_chat_template(messages, tokenize=False,
    add_generation_prompt=...)``.

    Args:
        template: the Jinja text (``read_chat_template``).
        messages: ``[{"role": "system" | "user" | "assistant" | ..., "content": ...}, ...]``.
        add_generation_prompt: end with the header that opens the assistant's turn (the
            template decides what it is; True here, unlike transformers' default).
        tools, documents: JSON schemas of tools, documents for retrieval: passed to the
            templates that read them.
        variables: the special tokens (``bos_token="<s>"``, ... ``read_special_tokens``) and
            any other variable a template reads (``enable_thinking=False``, ``date_string``).

    Raises:
        TypeError: messages that are not a list of dicts with a str role, or values that are
        not JSON-like; ValueError: no messages; ChatTemplateError: the template does not
        compile, fails, or refuses the messages (e.g. roles that do not alternate).
    """
    import jinja2

    if not isinstance(template, str):
        raise TypeError(f"render_chat: template must be the template's text (str), got "
                        f"{type(template).__name__}")
    if not isinstance(add_generation_prompt, bool):
        raise TypeError(f"render_chat: add_generation_prompt must be a bool, got "
                        f"{add_generation_prompt!r}")
    compiled = _compile(template)
    chat = _messages(messages)
    try:
        return compiled.render(messages=chat, tools=_plain(tools, "tools"),
                               documents=_plain(documents, "documents"),
                               add_generation_prompt=add_generation_prompt,
                               **_plain(variables, "variables"))
    except _Refused as err:
        raise ChatTemplateError(f"render_chat: the chat template refused the messages: "
                                f"{err}") from err
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"render_chat: the chat template failed: "
                                f"{type(err).__name__}: {err}") from err


def chat_prompt_ids(source: Any, messages: Sequence[Mapping[str, Any]], *,
                    add_generation_prompt: bool = True, chat_template: str | None = None,
                    tools: Sequence[Mapping] | None = None, **variables: Any) -> list[int]:
    """The prompt ids (N,) of a conversation: ``render_chat`` then the tokenizer without
    special tokens added (the template writes them), equal to transformers'
    ``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``.

    Args:
        source: a model directory (its tokenizer.json, chat template and special tokens;
            ``chat_template`` may name one of its templates or replace it), or a
            ``tokenizers.Tokenizer`` (then ``chat_template`` is the template's text and the
            special tokens come as ``variables``).
        messages, add_generation_prompt, tools, variables: as ``render_chat``; variables
            override the directory's special tokens.

    Raises:
        ValueError: a directory with no chat template; CheckpointError: a directory without
        tokenizer.json; TypeError: another kind of ``source``, or a tokenizer without
        ``chat_template``; what ``render_chat`` raises.
    """
    from tokenizers import Tokenizer

    if isinstance(source, Tokenizer):
        if chat_template is None:
            raise TypeError("chat_prompt_ids: with a tokenizers.Tokenizer, pass "
                            "chat_template= (the template's text)")
        tokenizer, template, specials = source, chat_template, {}
    elif isinstance(source, (str, os.PathLike)):
        directory = Path(source)
        tokenizer = load_tokenizer(directory)
        if tokenizer is None:
            raise CheckpointError(f"chat_prompt_ids: {directory} has no tokenizer.json")
        template = _directory_template(directory, chat_template, tools is not None)
        specials = read_special_tokens(directory)
    else:
        raise TypeError(f"chat_prompt_ids: source must be a model directory or a "
                        f"tokenizers.Tokenizer, got {type(source).__name__}")
    text = render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                       tools=tools, **{**specials, **variables})
    return tokenizer.encode(text, add_special_tokens=False).ids


def _directory_template(directory: Path, chat_template: str | None, tools: bool) -> str:
    """``chat_template`` as a name of the directory's templates, or as a template's text;
    the directory's own (``read_chat_template``) when None."""
    if chat_template is not None:
        return _templates(directory).get(chat_template, chat_template)
    template = read_chat_template(directory, tools=tools)
    if template is None:
        raise ValueError(f"{directory} has no chat template (no chat_template in "
                         f"{_TOKENIZER_CONFIG}, no {_TEMPLATE_FILE}): it is not a chat model, "
                         f"or its template was not saved with it")
    return template


# -------------------------------------------------------------------------------------- chat

def chat(model: nn.Module, directory: str | os.PathLike,
         messages: str | Sequence[Mapping[str, Any]], *, max_new_tokens: int | None = None,
         **generate_kwargs: Any) -> str:
    """The answer of a chat model to a conversation, as text.

    The prompt is ``chat_prompt_ids(directory, messages, add_generation_prompt=True)``; the
    model generates with ``qkv.generate`` until one of ``stop_token_ids(directory)`` (unless
    ``eos_token_id`` is passed) or ``max_new_tokens``; the answer is the new tokens before
    the first stop token, decoded without special tokens.

    Args:
        model: a decoder-only model (e.g. ``qkv.models.from_pretrained(directory)``).
        directory: the model directory holding tokenizer.json and the chat template.
        messages: ``[{"role": ..., "content": ...}, ...]``, or one question (a str: one user
            message).
        max_new_tokens: T; default the model's generation settings' (``max_new_tokens``,
            or ``max_length`` less the prompt), else 100, within what the model's
            ``max_len`` leaves after the prompt.
        generate_kwargs: ``qkv.generate`` options (``do_sample``, ``temperature``,
            ``generator``, ``eos_token_id``, ``streamer``, ``settings``...); those left out
            take the model's generation settings (``model.generation_settings``), as in
            ``qkv.generate``.

    Raises:
        ValueError: a directory without a chat template, or a prompt that leaves no room in
        ``max_len``; what ``chat_prompt_ids`` and ``qkv.generate`` raise.
    """
    from .api import generate
    from .defaults import FROM_MODEL, model_settings

    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    directory = Path(directory)
    tokenizer = load_tokenizer(directory)
    if tokenizer is None:
        raise CheckpointError(f"chat: {directory} has no tokenizer.json")
    ids = chat_prompt_ids(tokenizer, messages,
                          chat_template=_directory_template(directory, None, False),
                          **read_special_tokens(directory))
    eos = generate_kwargs.pop("eos_token_id", None)
    eos = stop_token_ids(directory, tokenizer) if eos is None else eos
    if max_new_tokens is None:
        max_len = getattr(getattr(model, "config", None), "max_len", None)
        room = _DEFAULT_MAX_NEW_TOKENS if max_len is None else max_len - len(ids) + 1
        if room < 1:
            raise ValueError(f"chat: a prompt of {len(ids)} tokens does not fit the model's "
                             f"max_len={max_len}")
        settings = model_settings(model, generate_kwargs.get("settings", FROM_MODEL))
        wanted = None if settings is None or settings.refused is not None else \
            settings.generate_kwargs(False, prompt_length=len(ids)).get("max_new_tokens")
        max_new_tokens = min(wanted or _DEFAULT_MAX_NEW_TOKENS, room)
    device = next(model.parameters()).device
    out = generate(model, torch.tensor([ids], device=device), max_new_tokens=max_new_tokens,
                   eos_token_id=eos, **generate_kwargs)  # (1, N + T)
    new = out[0, len(ids):].tolist()
    stops = set((eos,) if isinstance(eos, int) else eos or ())
    cut = next((i for i, t in enumerate(new) if t in stops), len(new))
    return tokenizer.decode(new[:cut], skip_special_tokens=True)
