"""Chat-formatted pairs for the gpt kind (``TrainConfig.chat``, ``qkv train --chat``): each
example is a conversation and its answer, rendered with the base's chat template
(``qkv.generation.chat``), and the loss counts the answer's tokens only.

Shapes: B batch, N sequence length, P prompt tokens, A answer tokens, E end tokens.

**Files** (``--data``): a ``.jsonl`` file of ``{"messages": [{"role": ..., "content":
...}, ...]}`` objects, one a line (HuggingFace's conversational format: the last message is
the assistant's answer, the ones before it the prompt; any other keys of a message are
passed to the template as they are), or else a TSV of ``input<TAB>output`` lines (one user
message and its answer, ``qkv.data.read_pairs``).

**One example** (``render_pair``), with the base's template T and special tokens:

- prompt (P,): ``T(messages, add_generation_prompt=True)`` tokenized without adding special
  tokens — ``qkv.generation.chat.chat_prompt_ids``, the ids of transformers'
  ``apply_chat_template(messages, add_generation_prompt=True)``;
- answer (A,): the tokens of what T writes for the assistant's message after that prompt,
  less the text it writes after every answer (found by rendering a placeholder answer: the
  text after it); this includes any text T puts before the answer in its turn (Qwen3's empty
  ``<think>`` block, Llama 2's space);
- end (E,): the tokens of that closing text up to and including the first stop token (the
  base's eos ids: ``HFTokenizer.stop_ids``; ChatML's ``<|im_end|>``, Llama 3's
  ``<|eot_id|>``, Gemma's ``<end_of_turn>``), or the eos id alone when it holds none.

The sequence is prompt + answer + end; the batch holds ``ids`` (B, N) = the sequence less
its last token and ``targets`` (B, N) = the next tokens, -100 at the P - 1 positions whose
next token is still the prompt's (and on padding), so the loss counts the A + E tokens of
the answer and its end. A template whose assistant turn does not begin with its generation
prompt, or that drops the answer, is refused (the prompt's tokens could not be told apart).

Evaluation: the token loss of held-out examples, and exact match of greedy answers (the
prompt's ids continued until a stop token, decoded, less the text T puts before the answer)
against the answer as given. The kind that reads these pairs is gpt (docs/ARCHITECTURE.md:
Trainer kinds).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor, nn

from .data import IGNORE, PairData, pad_rows

__all__ = ["ChatExample", "ChatPair", "Conversation", "chat_batch", "chat_data", "chat_decode",
           "read_conversations", "render_pair"]

#: the placeholder answer that shows what a template writes around an answer (no spaces at
#: its ends, so that a template trimming the content keeps it whole)
_PLACEHOLDER = "\ue000qkv-answer\ue001"


@dataclass(frozen=True, eq=False)
class Conversation:
    """The messages before an answer: ``({"role": ..., "content": ...}, ...)``."""

    messages: tuple[dict[str, Any], ...]


class ChatPair(NamedTuple):
    """One chat example: the ``conversation`` before the answer and the ``answer`` (the
    assistant's content as given). A (source, target) pair as the evaluation reads it."""

    conversation: Conversation
    answer: str


@dataclass(frozen=True)
class ChatExample:
    """One example as the model sees it (``render_pair``): ``prompt`` (P,), ``answer``
    (A,) and ``end`` (E,) token ids, and ``lead``: the text the template writes before the
    answer in its turn ("" for most)."""

    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    end: tuple[int, ...]
    lead: str

    @property
    def ids(self) -> list[int]:
        """The whole sequence (P + A + E,)."""
        return [*self.prompt, *self.answer, *self.end]


def _check_tokenizer(tokenizer: Any, base: Any) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"--chat: the base {base} has no chat template (no chat_template in "
                         f"its tokenizer_config.json, no chat_template.jinja): chat-formatted "
                         f"pairs are rendered with the base's own template; start from a chat "
                         f"model's directory, or train on the pairs without --chat")


def render_pair(tokenizer: Any, conversation: Conversation, answer: str) -> ChatExample:
    """The token ids of one chat example (the module docstring), with ``tokenizer``'s chat
    template, special tokens and stop ids (a ``qkv.train.hf_tokenizer.HFTokenizer``).

    Raises:
        ValueError: the tokenizer has no chat template; the template refuses the messages
        (``qkv.generation.chat.ChatTemplateError``) or renders the assistant's turn in a way
        that does not extend the generation prompt, or drops the answer."""
    from ..generation.chat import chat_prompt_ids, render_chat

    _check_tokenizer(tokenizer, "tokenizer")
    template, specials = tokenizer.chat_template, tokenizer.special_tokens
    messages = list(conversation.messages)

    def turn(content: str) -> str:
        return render_chat(template, [*messages, {"role": "assistant", "content": content}],
                           add_generation_prompt=False, **specials)

    head = render_chat(template, messages, add_generation_prompt=True, **specials)
    whole, probe = turn(answer), turn(_PLACEHOLDER)
    if not (whole.startswith(head) and probe.startswith(head)):
        raise ValueError(f"--chat: the chat template writes the assistant's turn in a way that "
                         f"does not begin with its generation prompt ({head[-40:]!r}), so the "
                         f"prompt's tokens cannot be told from the answer's")
    lead, found, tail = probe[len(head):].partition(_PLACEHOLDER)
    rest = whole[len(head):]
    if not found or not rest.startswith(lead) or not rest.endswith(tail):
        raise ValueError(f"--chat: the chat template does not write the assistant's answer as "
                         f"given (after the prompt it writes {rest[:60]!r}), so the answer's "
                         f"tokens cannot be found")
    prompt = chat_prompt_ids(tokenizer.hf, messages, chat_template=template, **specials)
    if not prompt:
        raise ValueError("--chat: the chat template writes no prompt for the messages")
    closing = tokenizer.encode(tail)
    stops = set(tokenizer.stop_ids)
    cut = next((i + 1 for i, t in enumerate(closing) if t in stops), None)
    end = closing[:cut] if cut is not None else [tokenizer.eos_id]
    return ChatExample(tuple(prompt), tuple(tokenizer.encode(rest[:len(rest) - len(tail)])),
                       tuple(end), lead)


def _messages(value: Any, where: str) -> tuple[tuple[dict[str, Any], ...], str]:
    """(the messages before the answer, the answer) of one JSONL object."""
    from ..data.files import DataError

    if not isinstance(value, Mapping) or not isinstance(value.get("messages"), list):
        raise DataError(f"{where}: expected an object {{\"messages\": [{{\"role\": ..., "
                        f"\"content\": ...}}, ...]}}, got {str(value)[:60]!r}")
    messages = value["messages"]
    for i, message in enumerate(messages):
        if (not isinstance(message, Mapping) or not isinstance(message.get("role"), str)
                or not isinstance(message.get("content", ""), (str, list))):
            raise DataError(f"{where}: messages[{i}] must be an object with a string \"role\" "
                            f"and its \"content\", got {str(message)[:60]!r}")
    if len(messages) < 2:
        raise DataError(f"{where}: a conversation needs at least one message before the "
                        f"answer (the last message), got {len(messages)} message(s)")
    last = messages[-1]
    if last["role"] != "assistant" or not isinstance(last.get("content"), str) or not (
            last["content"].strip()):
        raise DataError(f"{where}: the last message is the answer: role \"assistant\" with a "
                        f"non-empty string \"content\", got {str(last)[:60]!r}")
    return tuple(dict(m) for m in messages[:-1]), last["content"]


def read_conversations(path: str) -> list[ChatPair]:
    """The chat examples of a ``--data`` file: a ``.jsonl`` of ``{"messages": [...]}``
    objects or a TSV of ``input<TAB>output`` lines (the module docstring).

    Raises:
        DataError (a ValueError): naming the file and line of a malformed example, or a
        file with none."""
    from ..data import read_pairs
    from ..data.files import DataError, read_utf8

    if not str(path).endswith(".jsonl"):
        return [ChatPair(Conversation(({"role": "user", "content": s},)), t)
                for s, t in read_pairs(path)]
    pairs = []
    for number, line in enumerate(read_utf8(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{number}: not JSON ({exc.msg})") from None
        messages, answer = _messages(value, f"{path}:{number}")
        pairs.append(ChatPair(Conversation(messages), answer))
    if not pairs:
        raise DataError(f"{path}: no conversations in the file")
    return pairs


def chat_data(config: Any, tokenizer: Any, limit: int | None) -> tuple[PairData, int]:
    """The chat examples of ``config.data`` split into training and held-out parts
    (``PairData``), and the tokens the longest needs (prompt + answer + end), every
    example rendered once here (so that a template refusing one is refused before
    training).

    Raises:
        ValueError: no chat template; a malformed file (naming the line); an example the
        template refuses, longer than ``limit`` (the base's max_len) or than a given
        ``config.max_len``, or holding text the tokenizer reads as unknown."""
    _check_tokenizer(tokenizer, config.init_from)
    pairs = read_conversations(config.data)
    need = 0
    unk = getattr(tokenizer, "unk_id", None)
    for number, pair in enumerate(pairs, start=1):
        try:
            ids = render_pair(tokenizer, *pair).ids
        except ValueError as exc:
            raise ValueError(f"--data {config.data}, example {number}: {exc}") from None
        if unk is not None and unk in ids:
            raise ValueError(f"--data {config.data}, example {number}: the base's tokenizer "
                             f"reads part of it as unknown (id {unk}); fine-tuning keeps the "
                             f"base's vocabulary")
        need = max(need, len(ids))
    for bound, what in ((limit, f"the base's max_len={limit} ({config.init_from})"),
                        (config.max_len, f"max_len={config.max_len}")):
        if bound is not None and need > bound:
            raise ValueError(f"--data {config.data}: the longest example needs {need} tokens "
                             f"(its chat-formatted prompt, answer and end), beyond {what}")
    return PairData.from_file(pairs, seed=config.seed), need


def chat_batch(items: Sequence[ChatPair], tokenizer: Any) -> dict[str, Tensor]:
    """``ids`` (B, N) and ``targets`` (B, N) of chat examples (the module docstring):
    right-padded with ``tokenizer.pad_id`` / -100; the targets -100 except at the answer's
    and its end's tokens."""
    rows, targets = [], []
    for pair in items:
        ex = render_pair(tokenizer, *pair)
        seq = ex.ids
        rows.append(seq[:-1])
        targets.append([IGNORE] * (len(ex.prompt) - 1) + seq[len(ex.prompt):])
    return {"ids": pad_rows(rows, tokenizer.pad_id), "targets": pad_rows(targets, IGNORE)}


def chat_decode(model: nn.Module, tokenizer: Any, conversations: Sequence[Conversation], *,
                batch_size: int) -> list[str]:
    """Greedy answers to ``conversations``: each prompt's ids (``render_pair``'s) continued
    until a stop token (at most 100 new tokens, or what ``max_len`` leaves), decoded
    without special tokens, less the text the template writes before an answer.

    Raises:
        ValueError: a prompt that leaves no room in the model's ``max_len``."""
    from ..generation.text import DEFAULT_MAX_NEW_TOKENS, complete_ids

    stops = set(tokenizer.stop_ids)
    out: list[str] = []
    for start in range(0, len(conversations), batch_size):
        part = [render_pair(tokenizer, c, _PLACEHOLDER)
                for c in conversations[start:start + batch_size]]
        width = max(len(ex.prompt) for ex in part)
        room = model.config.max_len - width + 1
        if room < 1:
            raise ValueError(f"a chat prompt of {width} tokens does not fit the model's "
                             f"max_len={model.config.max_len}")
        news = complete_ids(model, [list(ex.prompt) for ex in part], pad_id=tokenizer.pad_id,
                            eos_id=tokenizer.eos_id,
                            max_new_tokens=min(DEFAULT_MAX_NEW_TOKENS, room),
                            stop_tokens=tuple(stops - {tokenizer.eos_id}))
        for ex, new in zip(part, news, strict=True):
            new = new[:next((i for i, t in enumerate(new) if t in stops), len(new))]
            text = tokenizer.decode(new)
            shown = tokenizer.decode(tokenizer.encode(ex.lead)) if ex.lead else ""
            out.append(text[len(shown):] if shown and text.startswith(shown) else text)
    return out
