"""`gptforge sample`: continuations of prompts from a checkpoint, as printable text while the tokens arrive."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from gptforge.checkpoint import Inference, load_for_inference
from gptforge.errors import GptforgeError
from gptforge.inputs import not_utf8
from gptforge.model.engine import FLOAT_ROWS, Decoding
from gptforge.model.generate import stream
from gptforge.runtime.device import autocast
from gptforge.tokens.chat import Message, chat_template, format_chat
from gptforge.tokens.fim import FIMTokenizer, end_ids, infill_prompt
from gptforge.tokens.text_stream import TextStream

# How an infilled middle stands out on a terminal: reverse video, an attribute rather than characters, so what is
# copied from the screen is the code itself. Piped output stays the plain text.
REVERSE, NORMAL = "\x1b[7m", "\x1b[27m"


def sample_texts(
    checkpoint: str,
    prompts: list[str],
    num_samples: int = 1,
    max_new_tokens: int = 128,
    temperature: float = 0.8,
    top_k: int | None = 50,
    top_p: float | None = None,
    seed: int = 0,
    device: str = "auto",
    use_cache: bool = True,
    dtype: str = "auto",
    suffix: str | None = None,
    chat: bool = False,
    decoding: Decoding = FLOAT_ROWS,
) -> Iterator[str]:
    """Load the checkpoint (a bad one fails here), then yield text to print as it is generated: a
    `--- sample N` line, the prompt, its continuation (with `suffix`: the middle, in reverse video on a terminal,
    then the suffix; with `chat`: the reply to the prompt as a user's message) and a newline, for each sample of
    each prompt."""
    if chat and suffix is not None:  # the flags conflict, whatever the model (its tokenizer is a chat one, not FIM's)
        raise GptforgeError("--suffix: not with --chat (a chat reply is an answer, not a gap to fill)")
    run = load_for_inference(checkpoint, device, dtype, decoding)
    if chat:
        check_chat_model(run, checkpoint, "--chat")
    if suffix is not None and not isinstance(run.tokenizer, FIMTokenizer):
        raise GptforgeError(
            f"--suffix: {checkpoint} was trained without fill-in-the-middle (data.fim_rate=0), so it cannot infill; "
            "train with --set data.fim_rate=0.5"
        )
    g = torch.Generator(device=run.device).manual_seed(seed)
    settings = (max_new_tokens, 1, temperature, top_k, top_p, run.tokenizer.eot, g, use_cache)
    return _pieces(run, prompts, num_samples, settings, suffix, chat)


def check_chat_model(run: Inference, checkpoint: str, flag: str = "") -> None:
    """Refuse a model that was never taught the chat template: its vocabulary has no <|im_start|> to read."""
    if chat_template(run.tokenizer) is None:
        raise GptforgeError(
            f"{flag + ': ' if flag else ''}{checkpoint} is a base model without the chat template; fine-tune it on "
            f"conversations first (prepare --chat, then train with --set train.init_from={checkpoint})"
        )


def _pieces(
    run: Inference, prompts: list[str], num_samples: int, settings: tuple, suffix: str | None, chat: bool
) -> Iterator[str]:
    tok, index = run.tokenizer, 0
    for prompt in prompts:
        if chat:
            ids = format_chat(tok, [Message("user", prompt)], add_generation_prompt=True).ids.tolist()
        else:  # an empty prompt starts a fresh document, as training documents start after EOT
            ids = infill_prompt(tok, prompt, suffix) if suffix is not None else tok.encode(prompt) or [tok.eot]
        # Past the context the start would slide out: the sentinels of an infill, the template's start of a chat.
        if len(ids) > run.model.config.block_size - int(chat) and (suffix is not None or chat):
            flags, kind = ("--prompt", "chat") if chat else ("--prompt/--suffix", "infill")
            raise GptforgeError(
                f"{flags}: the {kind} prompt has {len(ids):,} tokens, the model's context "
                f"{run.model.config.block_size:,}; shorten {'it' if chat else 'the prefix or the suffix'}"
            )
        steps = settings
        if suffix is not None or chat:  # it ends where the context does: its sentinels, or its opening, stay in
            steps = (min(settings[0], run.model.config.block_size - len(ids) + 1), *settings[1:])
        mark = _reverse if suffix is not None and sys.stdout.isatty() else str
        for _ in range(num_samples):
            yield f"--- sample {index}\n" + (f"user> {prompt}\nassistant> " if chat else prompt)
            for piece in reply_pieces(run, ids, steps):
                yield mark(piece)
            yield (suffix or "") + "\n"
            index += 1


def reply_pieces(run: Inference, ids: list[int], steps: tuple) -> Iterator[str]:
    """The text generated after `ids`, in printable pieces as tokens arrive, up to an end token (EOT, an infill's
    sentinel, a chat turn's end) or `steps[0]` tokens."""
    ends, text = end_ids(run.tokenizer), TextStream(run.tokenizer)
    shown = 0
    tokens = stream(run.model, ids, *steps, decode=run.decoding.step)
    while True:
        with autocast(run.device, run.dtype):  # around the model only, not around our caller's code
            nxt = next(tokens, None)
        if nxt is None or int(nxt) in ends:
            break
        if text.add(int(nxt)):  # else wait for the rest of a multi-byte character
            yield text.text[shown:]
            shown = len(text.text)
    yield text.whole()[shown:]


def _reverse(text: str) -> str:
    """`text` in reverse video, each piece on its own, so an error mid-sample leaves the terminal as it was."""
    return f"{REVERSE}{text}{NORMAL}" if text else ""


@dataclass(frozen=True)
class ChatSettings:
    system: str = ""
    max_new_tokens: int = 256
    temperature: float = 0.7
    top_k: int | None = 50
    top_p: float | None = None
    seed: int = 0


def chat_session(
    checkpoint: str,
    settings: ChatSettings,
    read=input,
    write=print,
    device: str = "auto",
    dtype: str = "auto",
    decoding: Decoding = FLOAT_ROWS,
) -> None:
    """`gptforge chat`: a conversation in the terminal. Each line is the user's message and the reply streams as
    it comes (Ctrl-C stops it); /reset forgets the conversation, /exit or end of input ends it. The oldest turns
    leave the context first (a system message stays)."""
    run = load_for_inference(checkpoint, device, dtype, decoding)
    check_chat_model(run, checkpoint)
    block, budget = run.model.config.block_size, settings.max_new_tokens
    system = [Message("system", settings.system)] if settings.system else []
    opening = len(format_chat(run.tokenizer, [*system, Message("user", "")], add_generation_prompt=True).ids)
    if opening > block // 2:  # no room left for a message and its reply
        raise GptforgeError(f"--system: {opening:,} tokens with the template, half the model's context or more")
    g = torch.Generator(device=run.device).manual_seed(settings.seed)
    steps = (budget, 1, settings.temperature, settings.top_k, settings.top_p, run.tokenizer.eot, g, True)
    write(f"{checkpoint}: {block:,} tokens of context. /reset starts over, /exit (or Ctrl-D) ends.")
    turns: list[Message] = []
    while True:
        try:
            line = read("you> ")
        except (EOFError, KeyboardInterrupt):
            write("")
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if not line.strip():  # a blank line is not a message
            continue
        if line.strip() == "/reset":
            turns = []
            write("(a new conversation)")
            continue
        if not_utf8(line):  # bytes that are not UTF-8: no tokenizer encodes them; the conversation goes on
            write(f"(that message is {not_utf8(line)}; type it again)")
            continue
        turns.append(Message("user", line))
        reserve = min(budget, block // 2)  # kept for the reply
        ids, kept = _fit(run, system, turns, block - reserve)
        if ids is None:
            write(_too_long(run, [*system, turns.pop()], reserve, budget))
            continue
        turns = kept
        reply = []
        try:
            for piece in reply_pieces(run, ids, (min(budget, block - len(ids)), *steps[1:])):
                write(piece, end="", flush=True)
                reply.append(piece)
        except KeyboardInterrupt:  # Ctrl-C stops the reply, not the conversation (it ended it, mid-line)
            write(" (stopped)", end="")
        write("")
        turns.append(Message("assistant", "".join(reply)))  # what was shown, as the conversation goes on from it


def _too_long(run: Inference, opening: list[Message], reserve: int, budget: int) -> str:
    """Why a message alone does not fit: the context itself, or the room kept for the reply."""
    block = run.model.config.block_size
    n = len(format_chat(run.tokenizer, opening, add_generation_prompt=True).ids)
    if n >= block:
        return f"(that message takes {n:,} tokens, the model's context {block:,}; say it in fewer words)"
    return (
        f"(that message takes {n:,} tokens and {reserve:,} of the model's {block:,} are kept for the reply: say it "
        f"in fewer words{', or lower --max-new-tokens' if budget >= block // 2 else ''})"
    )


def echoed(prompt: str) -> str:
    """`input` for messages piped in: the message shows after its prompt, as a terminal echoes what is typed (the
    reply followed 'you> ' on the same line)."""
    line = input(prompt)
    print(line)
    return line


def _fit(run: Inference, system: list[Message], turns: list[Message], room: int) -> tuple[list[int] | None, list]:
    """The prompt ids of the conversation, its oldest turns dropped until it fits `room` tokens (None: the last
    message alone does not), and the turns kept."""
    while turns:
        ids = format_chat(run.tokenizer, [*system, *turns], add_generation_prompt=True).ids.tolist()
        if len(ids) <= room:
            return ids, turns
        if len(turns) == 1:
            return None, []
        turns = turns[2:] if turns[0].role == "user" and len(turns) > 2 else turns[1:]
    return None, []
