"""`sample --chat` and `gptforge chat`: a chat checkpoint's replies in the terminal; a base model is refused."""

import io
import subprocess
import sys

import pytest
from tests.helpers import chat_checkpoint

import gptforge.model.generate
from gptforge.checkpoint import load_checkpoint
from gptforge.cli import main
from gptforge.model.generate import generate
from gptforge.sample import ChatSettings, chat_session
from gptforge.tokens.chat import Message, format_chat, with_chat
from gptforge.tokens.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt", chat=True)


def test_a_chat_checkpoint_loads_with_its_template_tokens_and_sample_chat_prints_the_greedy_reply(chat_ckpt, capsys):
    model, tok, _, _ = load_checkpoint(chat_ckpt)
    assert (tok.im_start, tok.im_end) == (50257, 50258)
    prompt = format_chat(tok, [Message("user", "hello")], add_generation_prompt=True).ids.tolist()
    reply = tok.decode(generate(model, prompt, 8, temperature=0.0, eot=tok.im_end)[0])
    args = ["sample", str(chat_ckpt), "--chat", "--prompt", "hello", "--temperature", "0", "--max-new-tokens", "8"]
    assert main(args) == 0
    assert capsys.readouterr().out == f"--- sample 0\nuser> hello\nassistant> {reply}\n"  # the message shown too


def test_the_terminal_chat_keeps_the_conversation_and_resets_on_request(chat_ckpt, monkeypatch):
    model, tok, _, _ = load_checkpoint(chat_ckpt)
    said, lines = [], iter(["hi", "and again", "/reset", "hi", "/exit"])
    monkeypatch.setattr("gptforge.sample.format_chat", _spy := SpyFormat(format_chat))
    chat_session(
        str(chat_ckpt),
        ChatSettings(system="Be brief.", temperature=0.0, max_new_tokens=6),
        read=lambda prompt: next(lines),
        write=lambda *a, **k: said.append(a[0] if a else ""),
    )
    seen = [[m.role for m in conversation] for conversation in _spy.calls]
    assert seen == [
        ["system", "user"],  # the opening's size, measured at the start
        ["system", "user"],
        ["system", "user", "assistant", "user"],
        ["system", "user"],  # after /reset
    ]
    assert "(a new conversation)" in said
    first = "".join(said[1 : said.index("", 1)])
    prompt = format_chat(tok, [Message("system", "Be brief."), Message("user", "hi")], True).ids.tolist()
    assert first == tok.decode(generate(model, prompt, 6, temperature=0.0, eot=tok.im_end)[0])


class SpyFormat:
    def __init__(self, real):
        self.real, self.calls = real, []

    def __call__(self, tok, messages, add_generation_prompt):
        self.calls.append(list(messages))
        return self.real(tok, messages, add_generation_prompt)


def test_the_oldest_turns_leave_a_full_context_and_an_overlong_message_is_said(chat_ckpt):
    said, lines = [], iter(["word " * 200, "word " * 30, "word " * 40, "short", "/exit"])
    chat_session(
        str(chat_ckpt),
        ChatSettings(temperature=0.0, max_new_tokens=256),
        read=lambda prompt: next(lines),
        write=lambda *a, **k: said.append(a[0] if a else ""),
    )
    notes = [s for s in said if s.startswith("(that message takes")]
    # 48 tokens of context: 200 words do not fit at all; 30 words (40 tokens) fit it but not beside the 24 tokens
    # kept for the reply (it was said to be longer than the context)
    assert notes[0] == "(that message takes 210 tokens, the model's context 48; say it in fewer words)"
    assert notes[1] == (
        "(that message takes 40 tokens and 24 of the model's 48 are kept for the reply: say it in fewer words, or "
        "lower --max-new-tokens)"
    )
    assert notes[2] == "(that message takes 50 tokens, the model's context 48; say it in fewer words)"
    assert len(notes) == 3 and said[-1] == ""  # "short" was answered


def test_a_base_model_is_refused_in_one_line(tmp_path, capsys):
    base = chat_checkpoint(tmp_path / "base", chat=False)
    assert main(["sample", str(base), "--chat", "--prompt", "hi"]) == 1
    assert main(["chat", str(base)]) == 1
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all("is a base model without the chat template" in e for e in errors)
    assert errors[1].startswith(f"gptforge chat: error: {base} is a base model")  # named once


def test_sample_chat_with_a_suffix_is_refused_in_one_line(chat_ckpt, capsys):
    """It was refused as a model "trained without fill-in-the-middle", which a chat model of a FIM base is not."""
    assert main(["sample", str(chat_ckpt), "--chat", "--suffix", ")", "--prompt", "hi"]) == 1
    assert (
        capsys.readouterr().err
        == "gptforge sample: error: --suffix: not with --chat (a chat reply is an answer, not a gap to fill)\n"
    )


def test_a_full_context_drops_the_oldest_exchange_whole_and_keeps_the_system_message():
    from types import SimpleNamespace

    from gptforge.sample import _fit

    tok = with_chat(load_tokenizer("gpt2"))
    system = [Message("system", "Be brief.")]
    turns = [Message(r, f"{r} turn {i} " + "word " * 10) for i, r in enumerate(["user", "assistant"] * 3 + ["user"])]
    whole = len(format_chat(tok, [*system, *turns], True).ids)
    ids, kept = _fit(SimpleNamespace(tokenizer=tok), system, turns, whole - 1)
    assert kept == turns[2:] and kept[0].role == "user"  # the oldest question goes with its answer
    assert ids == format_chat(tok, [*system, *kept], True).ids.tolist()


def test_blank_lines_are_not_messages_and_a_system_message_that_fills_the_context_is_refused(chat_ckpt):
    from gptforge.errors import GptforgeError

    said, lines = [], iter(["", "   ", "/exit"])
    sent = SpyFormat(format_chat)
    import gptforge.sample

    gptforge.sample.format_chat, real = sent, gptforge.sample.format_chat
    try:
        chat_session(str(chat_ckpt), ChatSettings(), read=lambda p: next(lines), write=lambda *a, **k: said.append(a))
    finally:
        gptforge.sample.format_chat = real
    assert len(sent.calls) == 1  # only the opening's measure: no blank line was sent
    with pytest.raises(GptforgeError, match="^--system: "):
        chat_session(str(chat_ckpt), ChatSettings(system="word " * 40), read=lambda p: "/exit", write=print)


def test_ctrl_c_stops_a_reply_and_the_conversation_goes_on_from_what_was_shown(chat_ckpt, monkeypatch):
    """Ctrl-C mid-reply ended the whole chat, its `interrupted` on the reply's line."""
    said, lines, pieces = [], iter(["hi", "and you?", "/exit"]), []

    def write(*args, end="\n", **kwargs):
        text = args[0] if args else ""
        if end == "" and text != " (stopped)":
            pieces.append(text)
            if len(pieces) == 2:  # the first reply's second piece: the user presses Ctrl-C
                raise KeyboardInterrupt
        said.append(text + end)

    monkeypatch.setattr("gptforge.sample.format_chat", spy := SpyFormat(format_chat))
    settings = ChatSettings(temperature=0.0, max_new_tokens=6)
    chat_session(str(chat_ckpt), settings, read=lambda prompt: next(lines), write=write)
    assert said[1:4] == [pieces[0], " (stopped)", "\n"]
    sent = [(m.role, m.content) for m in spy.calls[-1]]
    assert sent == [("user", "hi"), ("assistant", pieces[0]), ("user", "and you?")]


@pytest.mark.parametrize(("command", "stream"), [("chat", "stdout"), ("chat", "stdin"), ("sample", "stdout")])
def test_a_closed_stdout_or_stdin_is_one_line_not_a_traceback_or_silence(
    chat_ckpt, monkeypatch, capsys, command, stream
):
    """`chat RUN >&-` ended in input()'s traceback, `sample RUN >&-` printed nothing and exited 0."""
    monkeypatch.setattr(sys, stream, None)  # what Python makes of a descriptor closed at start (`>&-`, `<&-`)
    assert main([command, str(chat_ckpt), "--max-new-tokens", "2"]) == 1
    assert (
        capsys.readouterr().err
        == f"gptforge {command}: error: {stream} is closed: give it a terminal, a file or /dev/null\n"
    )


class ClosedPipe(io.StringIO):
    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("command", ["chat", "sample"])
def test_a_reader_that_goes_away_ends_the_command_quietly_with_status_141(chat_ckpt, monkeypatch, capsys, command):
    """`| head -1`: as other command-line tools, no message and 128 + SIGPIPE's number, as a shell reports it."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main([command, str(chat_ckpt), "--max-new-tokens", "2"]) == 141
    assert capsys.readouterr().err == ""


def test_a_message_that_is_not_utf8_is_asked_again_and_the_conversation_goes_on(chat_ckpt, monkeypatch):
    """A byte that is not UTF-8 (a lone surrogate to Python) crashed a trained BPE's tokenizer: the conversation was
    lost."""
    said, spy = converse(chat_ckpt, ["hi", "caf\udce9", "and you?", "/exit"], monkeypatch, max_new_tokens=4)
    assert "(that message is not valid UTF-8 text (byte 0xe9 at character 4); type it again)" in said
    assert [(m.role, m.content) for m in spy.calls[-1]][::2] == [("user", "hi"), ("user", "and you?")]


@pytest.mark.parametrize("flag", ["--prompt", "--system", "--suffix"])
def test_a_text_flag_that_is_not_utf8_is_one_line(chat_ckpt, flag):
    command = "chat" if flag == "--system" else "sample"
    done = subprocess.run(
        [sys.executable, "-m", "gptforge", command, str(chat_ckpt), flag.encode(), b"hi \xff"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        f"gptforge {command}: error: argument {flag}: not valid UTF-8 text (byte 0xff at character 4) "
        f"(see gptforge {command} --help)\n"
    )


def test_piped_chat_shows_each_message_after_its_prompt_and_asks_again_for_one_not_utf8(chat_ckpt):
    """Piped, the reply followed 'you> ' on its line (no terminal echoed the message)."""
    done = subprocess.run(
        [sys.executable, "-m", "gptforge", "chat", str(chat_ckpt), "--max-new-tokens", "3", "--temperature", "0"],
        input=b"hi \xff\nhello\n",
        capture_output=True,
        timeout=300,
    )
    lines = done.stdout.split(b"\n")
    assert done.returncode == 0 and done.stderr == b"", done.stderr
    assert lines[1:3] == [
        b"you> hi \xff",
        b"(that message is not valid UTF-8 text (byte 0xff at character 4); type it again)",
    ]
    assert lines[3] == b"you> hello" and lines[-2:] == [b"you> ", b""]


def test_a_reply_ends_at_the_end_of_its_turn_in_chat_and_sample_chat(tmp_path, capsys, monkeypatch):
    """A model whose every reply ends at once: dropping the stop at <|im_end|> would print it as text and go on."""
    ckpt = chat_checkpoint(tmp_path / "stops", ends_every_reply=True)
    args = ["sample", str(ckpt), "--chat", "--prompt", "hi", "--temperature", "0", "--max-new-tokens", "8"]
    assert main(args) == 0
    assert capsys.readouterr().out == "--- sample 0\nuser> hi\nassistant> \n"
    said, spy = converse(ckpt, ["hi", "and you?", "/exit"], monkeypatch, max_new_tokens=8)
    assert "<|im_end|>" not in "".join(said)
    assert [(m.role, m.content) for m in spy.calls[-1]] == [("user", "hi"), ("assistant", ""), ("user", "and you?")]


def converse(ckpt, lines: list[str], monkeypatch, **settings) -> tuple[list[str], SpyFormat]:
    """A greedy terminal chat fed `lines`: what it wrote, and the conversations it formatted."""
    said, typed = [], iter(lines)
    monkeypatch.setattr("gptforge.sample.format_chat", spy := SpyFormat(format_chat))
    chat_session(
        str(ckpt),
        ChatSettings(temperature=0.0, **settings),
        read=lambda prompt: next(typed),
        write=lambda *a, **k: said.append(a[0] if a else ""),
    )
    return said, spy


def test_sample_and_chat_decode_with_int8_weights_and_the_static_step_when_asked(chat_ckpt, capsys, monkeypatch):
    from gptforge.model.engine import Decoding
    from gptforge.model.quantize import quantize_int8

    model, tok, _, _ = load_checkpoint(chat_ckpt)
    quantize_int8(model)
    prompt = format_chat(tok, [Message("user", "hello")], add_generation_prompt=True).ids.tolist()
    reply = tok.decode(generate(model, prompt, 8, temperature=0.0, eot=tok.im_end)[0])
    args = ["sample", str(chat_ckpt), "--chat", "--prompt", "hello", "--temperature", "0", "--max-new-tokens", "8"]
    engines = []
    engine = gptforge.model.generate.Engine
    spy = lambda model, **kw: (engines.append((type(model.lm_head).__name__, kw["decode"])), engine(model, **kw))[1]  # noqa: E731
    monkeypatch.setattr(gptforge.model.generate, "Engine", spy)
    assert main([*args, "--weights", "int8", "--decode", "static"]) == 0
    assert capsys.readouterr().out == f"--- sample 0\nuser> hello\nassistant> {reply}\n"
    assert engines == [("Int8Linear", "static")]

    seen = {}
    monkeypatch.setattr("gptforge.sample.chat_session", lambda *a, **kwargs: seen.update(kwargs))
    assert main(["chat", str(chat_ckpt), "--weights", "int8", "--decode", "compiled"]) == 0
    assert seen["decoding"] == Decoding("int8", "compiled")
