"""Conversations as tokens: the ChatML template, its two special tokens, and the loss mask.

    <|im_start|>system\\n{content}<|im_end|>\\n<|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n...

The special tokens take the two ids just past the base tokenizer's vocabulary (after FIM's sentinels when the base
has them), so text never encodes to them. The loss counts an assistant turn's content and its `<|im_end|>` (the
model learns to stop); everything else is context. One formatter serves training data, `serve`, `sample --chat`
and `gptforge chat`; `CHAT_TEMPLATE` is the same format in Jinja for Hugging Face and GGUF exports.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from gptforge.errors import GptforgeError
from gptforge.tokens.fim import with_fim
from gptforge.tokens.tokenizer import ExtendedTokenizer, Tokenizer

CHAT_TEXTS = ("<|im_start|>", "<|im_end|>")
ROLES = ("system", "user", "assistant")
SAME_AS = {"developer": "system"}  # OpenAI's newer name for the instructions (its SDK sends it for newer models)
TOOL_KEYS = ("tool_calls", "function_call")  # an assistant's call of a tool, in OpenAI's newer and older form
TEMPLATE_NAME = "chatml"
# Exported templates mark every '<|' of a message's content with a noncharacter (Unicode keeps them for a program's
# own use), and the exported tokenizer's normalizer removes the marks: the content's special-token text stays
# text, as `format_chat` encodes it, and no message can close its turn or open a system turn. A mark in the content
# itself is doubled first, so the normalizer gives back exactly what was sent.
MARK = "\ufdd0"
# The Jinja form of `format_chat` and `parse_messages` (a developer message is a system one; text parts are joined),
# as Hugging Face's `apply_chat_template` and llama.cpp's Jinja read it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% set role = 'system' if message['role'] == 'developer' else message['role'] %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% else %}{% set content = message['content'] | map(attribute='text') | join('') %}{% endif %}"
    f"{{{{ '<|im_start|>' + role + '\\n' + content | replace('{MARK}', '{MARK * 2}') | replace('<|', '<{MARK}|')"
    " + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
UNMARKED = ((f"<{MARK}|", "<|"), (MARK * 2, MARK))
"""What the exported normalizer replaces, in order: the marks the template put in, back to the content sent."""


class ConversationError(GptforgeError):
    """A conversation that cannot be formatted; `param` names the field as OpenAI's 400 bodies do."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class ChatTokens:
    """A formatted conversation: its ids, and 1 where the loss counts (an assistant's token)."""

    ids: np.ndarray
    mask: np.ndarray


@dataclass(frozen=True)
class ChatTemplate:
    """A conversation format, saved with a checkpoint by its name (`data.chat_template`): the tokens it appends,
    and its Jinja twin, which exports carry. `format_chat` renders it; `ChatTokenizer.stop_ids` end a reply."""

    name: str
    texts: tuple[str, ...]
    jinja: str


CHATML = ChatTemplate(TEMPLATE_NAME, CHAT_TEXTS, CHAT_TEMPLATE)
TEMPLATES = {template.name: template for template in (CHATML,)}


class ChatTokenizer(ExtendedTokenizer):
    """A tokenizer with its chat template's tokens (`<|im_start|>`, `<|im_end|>`) appended past its vocabulary."""

    template = CHATML

    def __init__(self, base: Tokenizer) -> None:
        super().__init__(base, self.template.texts)
        self.im_start, self.im_end = base.vocab_size, base.vocab_size + 1
        self.sentinels = getattr(base, "sentinels", None)  # a FIM base keeps infilling
        # A reply ends with its turn, or where the model opens another (that header is no text of the reply).
        self.stop_ids = (self.im_end, self.im_start)


def chat_template(tokenizer: Tokenizer) -> ChatTemplate | None:
    """The template a model speaks in, None for a base model: the one question "is this a chat model?"."""
    return tokenizer.template if isinstance(tokenizer, ChatTokenizer) else None


def added_tokens(tokenizer: Tokenizer) -> dict[int, str]:
    """Every special token a tokenizer appends past its base vocabulary (FIM's sentinels, the chat template's), by
    id: what exports declare as added tokens."""
    found: dict[int, str] = {}
    while isinstance(tokenizer, ExtendedTokenizer):
        found.update({tokenizer.base.vocab_size + i: t for i, t in enumerate(tokenizer.texts)})
        tokenizer = tokenizer.base
    return dict(sorted(found.items()))


def model_tokenizer(base: Tokenizer, fim_rate: float, chat_template: str) -> Tokenizer:
    """The tokenizer a model trained with these data settings speaks: FIM's sentinels when it trained with FIM,
    then the chat template's tokens when it speaks in conversations."""
    tokenizer = with_fim(base, fim_rate)
    return with_chat(tokenizer) if chat_template else tokenizer


def with_chat(tokenizer: Tokenizer) -> ChatTokenizer:
    """The tokenizer a chat model uses: the template's tokens appended unless they already are."""
    return tokenizer if isinstance(tokenizer, ChatTokenizer) else ChatTokenizer(tokenizer)


def parse_messages(messages: object, where: str = "messages") -> list[Message]:
    """OpenAI's `messages` list, checked: each a {role, content} object with a known role and string content (or a
    list of text parts, [{"type": "text", "text": ...}], joined) that is valid Unicode."""
    if not isinstance(messages, list) or not messages:
        raise ConversationError(f"{where}: expected a non-empty list of messages", where)
    out = []
    for i, message in enumerate(messages):
        field = f"{where}[{i}]"
        if not isinstance(message, dict):
            raise ConversationError(f"{field}: expected an object with 'role' and 'content'", field)
        role, content = message.get("role"), _joined(message.get("content"))
        tools = f"{field}.role" if role == "tool" else next((f"{field}.{k}" for k in TOOL_KEYS if message.get(k)), None)
        if tools:
            raise ConversationError(f"{tools}: tool calls are not supported (these models have no tools)", tools)
        role = SAME_AS.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise ConversationError(f"{field}.role: {role!r} is not one of {', '.join(ROLES)}", f"{field}.role")
        if not isinstance(content, str):
            raise ConversationError(f"{field}.content: expected a string or text parts", f"{field}.content")
        try:
            content.encode()
        except UnicodeEncodeError:  # JSON's escapes can make a lone surrogate, which no tokenizer can encode
            bad = f"{field}.content"
            raise ConversationError(f"{bad}: holds a lone surrogate, not valid Unicode", bad) from None
        out.append(Message(role, content))
    return out


def _joined(content: object) -> object:
    """Content given as text parts (as clients and datasets in OpenAI's form send it), joined; else as it came."""
    parts = content if isinstance(content, list) and content else None
    if parts and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        return "".join(p["text"] for p in parts)
    return content


def conversation_from_row(row: object) -> list[Message]:
    """A JSONL row in OpenAI's form ({"messages": [...]}) or Alpaca's (instruction, input, output), checked to hold
    an assistant turn to learn from."""
    if isinstance(row, dict) and "messages" in row:
        messages = parse_messages(row["messages"])
    elif isinstance(row, dict) and "instruction" in row and "output" in row:
        parts = [row["instruction"], row.get("input") or ""]
        if not all(isinstance(p, str) for p in (*parts, row["output"])):
            raise ConversationError("instruction, input and output must be strings", "instruction")
        prompt = "\n\n".join(p for p in parts if p)
        messages = parse_messages(
            [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
        )
    else:
        raise ConversationError("expected {'messages': [...]} or Alpaca's instruction/input/output", "messages")
    if not any(m.role == "assistant" for m in messages):
        raise ConversationError("no assistant turn to learn from", "messages")
    return messages


def format_chat(tokenizer: ChatTokenizer, messages: Iterable[Message], add_generation_prompt: bool) -> ChatTokens:
    """The template's ids for `messages` (plus `<|im_start|>assistant\\n` when a reply is to follow) and the loss
    mask. Text between special tokens is encoded as one piece, as `apply_chat_template` then tokenizing does."""
    ids, mask = [], []
    for m in messages:
        header = f"{m.role}\n"
        piece = tokenizer.encode(header + m.content)
        learn = m.role == "assistant"
        start = _content_start(tokenizer, piece, header) if learn else len(piece)
        ids += [tokenizer.im_start, *piece, tokenizer.im_end]
        mask += [0] * (1 + start) + [int(learn)] * (len(piece) - start + 1)
        newline = tokenizer.encode("\n")
        ids += newline
        mask += [0] * len(newline)
    if add_generation_prompt:
        prompt = [tokenizer.im_start, *tokenizer.encode("assistant\n")]
        ids += prompt
        mask += [0] * len(prompt)
    return ChatTokens(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8))


def _content_start(tokenizer: Tokenizer, piece: list[int], header: str) -> int:
    """Index of the first token of `piece` that holds content rather than the role header. GPT-2's
    pre-tokenization splits at the header's newline, so its ids are a prefix; otherwise the first token whose text
    reaches past the header starts the content (the header stays out of the loss either way)."""
    head = tokenizer.encode(header)
    if piece[: len(head)] == head:
        return len(head)
    reaches_past = (i for i in range(len(piece)) if len(tokenizer.decode(piece[: i + 1])) > len(header))
    return next(reaches_past, len(piece))
