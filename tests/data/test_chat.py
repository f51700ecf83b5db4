"""The chat template: ids, the loss mask, the Jinja form, and the checks on conversations."""

import jinja2
import numpy as np
import pytest

from gptforge.tokens.chat import (
    CHAT_TEMPLATE,
    ConversationError,
    Message,
    conversation_from_row,
    format_chat,
    parse_messages,
    with_chat,
)
from gptforge.tokens.fim import with_fim
from gptforge.tokens.tokenizer import GPT2Tokenizer

MESSAGES = [
    Message("system", "You write Python."),
    Message("user", "Add two numbers."),
    Message("assistant", "def add(a, b):\n    return a + b"),
    Message("user", "  Now subtract, please.\n"),
    Message("assistant", "def sub(a, b):\n    return a - b\n"),
]


@pytest.fixture(scope="module")
def tok():
    return with_chat(GPT2Tokenizer())


def test_the_special_tokens_follow_the_vocabulary_and_text_never_encodes_to_them(tok):
    assert (tok.im_start, tok.im_end, tok.vocab_size) == (50257, 50258, 50259)
    assert max(tok.encode("<|im_start|>user\nhi<|im_end|>")) < 50257
    fim_chat = with_chat(with_fim(GPT2Tokenizer(), 0.5))
    assert (fim_chat.im_start, fim_chat.im_end, fim_chat.sentinels.prefix) == (50260, 50261, 50257)


def test_the_mask_counts_exactly_each_assistant_reply_and_its_end(tok):
    chat = format_chat(tok, MESSAGES, add_generation_prompt=False)
    assert chat.ids.shape == chat.mask.shape and chat.mask.dtype == np.uint8
    learned = chat.ids[chat.mask == 1]
    replies = [m.content for m in MESSAGES if m.role == "assistant"]
    assert tok.decode(learned) == "".join(r + "<|im_end|>" for r in replies)
    assert (learned == tok.im_end).sum() == 2  # each reply ends with the token that stops generation
    ends = np.flatnonzero(chat.ids == tok.im_end)
    assert chat.mask[ends].tolist() == [0, 0, 1, 0, 1]  # a system's or user's end is context


def test_a_token_across_the_header_s_newline_counts_as_the_reply_s(tok):
    chat = format_chat(tok, [Message("assistant", "\n\ndef sub")], add_generation_prompt=False)
    assert [tok.decode([i]) for i in chat.ids[chat.mask == 1]] == ["\n\n", "\n", "def", " sub", "<|im_end|>"]


def test_the_ids_decode_to_the_jinja_template_s_text(tok):
    render = jinja2.Environment().from_string(CHAT_TEMPLATE).render
    rows = [{"role": m.role, "content": m.content} for m in MESSAGES]
    for prompt in (False, True):
        ids = format_chat(tok, MESSAGES, add_generation_prompt=prompt).ids
        assert tok.decode(ids) == render(messages=rows, add_generation_prompt=prompt)
    prompt_ids = format_chat(tok, MESSAGES[:2], add_generation_prompt=True).ids
    assert tok.decode(prompt_ids).endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "messages, param",
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"role": "user", "content": "a"}, "b"], "messages[1]"),
        ([{"role": "tool", "content": "a"}], "messages[0].role"),
        ([{"role": ["developer"], "content": "a"}], "messages[0].role"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content"),
        ([{"role": "user", "content": "a\ud800"}], "messages[0].content"),
    ],
)
def test_a_bad_message_names_its_field(messages, param):
    with pytest.raises(ConversationError) as e:
        parse_messages(messages)
    assert e.value.param == param and str(e.value).startswith(param)


def test_a_developer_message_is_a_system_message():
    """OpenAI's SDK sends the instructions as 'developer' for its newer models."""
    turns = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "a"}]
    assert parse_messages(turns) == [Message("system", "Be brief."), Message("user", "a")]


def test_rows_in_openai_or_alpaca_form_and_rows_without_a_reply():
    alpaca = conversation_from_row({"instruction": "Sort it.", "input": "[3, 1]", "output": "[1, 3]"})
    assert alpaca == [Message("user", "Sort it.\n\n[3, 1]"), Message("assistant", "[1, 3]")]
    assert conversation_from_row({"instruction": "Hi.", "input": "", "output": "Hello."})[0].content == "Hi."
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert conversation_from_row({"messages": turns})[1] == Message("assistant", "b")
    no_reply = {"messages": turns[:1]}
    for row in (no_reply, {"text": "a"}, ["a"], {"instruction": 1, "output": "b"}):
        with pytest.raises(ConversationError):
            conversation_from_row(row)


def test_text_parts_are_joined_as_they_are_for_training_and_serving():
    """Parts joined with a space passed every data test: training rows and served prompts would change."""
    parts = [{"type": "text", "text": "def add(a, b):"}, {"type": "text", "text": "\n    return a + b"}]
    row = {"messages": [{"role": "user", "content": "Write add."}, {"role": "assistant", "content": parts}]}
    assert conversation_from_row(row)[1] == Message("assistant", "def add(a, b):\n    return a + b")
    assert parse_messages([{"role": "user", "content": parts[:1] * 2}])[0].content == "def add(a, b):def add(a, b):"


def test_the_chat_template_is_one_object_a_base_model_has_none():
    from gptforge.config import load_config
    from gptforge.tokens.chat import CHATML, TEMPLATES, chat_template
    from gptforge.tokens.tokenizer import GPT2Tokenizer

    base = GPT2Tokenizer()
    chat = with_chat(base)
    assert chat_template(base) is None and chat_template(chat) is CHATML is TEMPLATES["chatml"]
    assert chat.texts == CHATML.texts and chat.decode([chat.im_start, chat.im_end]) == "".join(CHATML.texts)
    assert load_config("tiny", ["data.chat_template=chatml"]).data.chat_template == "chatml"
