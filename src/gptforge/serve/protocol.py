"""The OpenAI completions protocol: a request checked against the server's limits, errors in OpenAI's body,
and the response and stream-chunk objects; the Host names a request may give (imported by the CLI's flag check
too, which must work without the serve extra)."""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, field
from typing import Any

from gptforge.tokens.chat import ConversationError, parse_messages

# Accepted only at the value that means "off": clients send them, gptforge does not implement them.
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": None, "logit_bias": {}}
IGNORED = {"user", "best_of"}  # best_of is checked to equal n below
MAX_PARALLEL = 1024  # --parallel: rows of one KV cache (each a block_size of keys and values per layer)
MAX_CHOICES = 128  # completions (prompts × n) a request may ask: more would hold the batch past other clients' time


class ApiError(Exception):
    """An error answered with `status` and OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What keeps one machine healthy: caps per request, and how many requests may be in flight."""

    max_tokens: int = 1024
    max_n: int = 8  # at most MAX_CHOICES (and --parallel at most MAX_PARALLEL)
    max_body_bytes: int = 1 << 20
    parallel: int = 8  # choices generated together (continuous batching); also requests let in beside the queue
    queue: int = 8  # requests waiting beyond those; more are answered 429
    request_timeout: float = 120.0  # seconds from arrival, waiting included; then the text so far ends as "length"
    read_timeout: float = 30.0  # seconds to send a request's head, and then its body: a stalled one is cut off (408)


@dataclass
class CompletionRequest:
    model: str
    prompts: list[str | list[int]]
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    suffix: str | None = None
    """Infill: the text after the gap; the completion is what goes between prompt and suffix (FIM models)."""
    middle: str = ""
    """Infill: the start of the middle already typed (llama.cpp's /infill `prompt`); the completion continues it."""
    messages: list | None = None
    """Chat: the conversation (tokens.chat.Message), formatted with the model's chat template as one prompt."""


def _number(body: dict, key: str, default, low: float, high: float, integer: bool = False):
    value = body.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    # the comparison rejects NaN and the infinities, and compares an int of any size exactly (no float conversion)
    if isinstance(value, bool) or not ok or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise ApiError(400, f"'{key}' must be {kind} in [{low}, {high}], got {_shown(value)}", key, "invalid_value")
    return value


def _shown(value: Any) -> str:
    """A client's value in a message, cut short: JSON allows an integer of 4,300 digits."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text):,} characters)"


def _prompts(value: Any) -> list[str | list[int]]:
    """prompt: a string, a list of strings, a list of token ids or a list of such lists."""

    def is_ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    if isinstance(value, str) or is_ids(value):
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) or is_ids(v) for v in value):
        prompts = list(value)
    else:
        raise ApiError(400, "'prompt' must be a string, a list of strings or a list of token ids", "prompt")
    _check_unicode(prompts, "prompt")
    return prompts


def _stop(value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else value if value is not None else []
    if not (isinstance(stops, list) and len(stops) <= 4 and all(isinstance(s, str) and s for s in stops)):
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    _check_unicode(stops, "stop")
    return stops


def _check_unicode(values: list, key: str) -> None:
    """JSON's escapes can make a lone surrogate (a "\\ud800" without its pair): not text that UTF-8 can encode, so
    a tokenizer would fail on it or change it."""
    for value in (v for v in values if isinstance(v, str)):  # not token ids
        try:
            value.encode()
        except UnicodeEncodeError as e:
            bad = ascii(value[e.start : e.end])
            raise ApiError(400, f"'{key}' holds a lone surrogate ({bad}), which is not valid Unicode", key) from None


def _check_arguments(body: Any, known: set[str]) -> None:
    """A JSON object of known arguments, unsupported ones at their neutral value, and a model named."""
    if not isinstance(body, dict):
        raise ApiError(400, "expected a JSON object as the request body")
    extra = set(body) - known - {"stream_options"} - set(NEUTRAL) - IGNORED
    if extra:
        raise ApiError(400, f"unrecognized request argument supplied: {', '.join(sorted(extra))}", sorted(extra)[0])
    for key, neutral in NEUTRAL.items():
        value = body.get(key)
        if key == "logprobs" and value is False:  # the chat API's default, which SDKs send
            continue
        if value is not None and (isinstance(value, bool) or value != neutral):  # false == 0 in Python, not in JSON
            raise ApiError(400, f"'{key}' is not supported by gptforge serve (leave it unset)", key, "unsupported")
    if not isinstance(body.get("model"), str):
        raise ApiError(400, "'model' must be a string (GET /v1/models lists them)", "model")


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is not None and not _flag(body, "stream"):  # as OpenAI answers: it would be silently ignored
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true", "stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    return _flag(options, "include_usage", "stream_options.include_usage")


def parse_completion(body: Any, limits: Limits) -> CompletionRequest:
    """A /v1/completions body, checked: an unknown argument or a value out of range is a 400 naming it."""
    _check_arguments(
        body, set(CompletionRequest.__dataclass_fields__) - {"prompts", "include_usage", "messages"} | {"prompt"}
    )
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required", "prompt")
    req = CompletionRequest(
        model=body["model"],
        prompts=_prompts(body["prompt"]),
        max_tokens=_number(body, "max_tokens", 16, 1, limits.max_tokens, integer=True),
        temperature=_number(body, "temperature", 1.0, 0, 2),
        top_p=_number(body, "top_p", None, 1e-9, 1),
        top_k=_number(body, "top_k", None, 0, 1 << 30, integer=True) or None,
        n=_number(body, "n", 1, 1, limits.max_n, integer=True),
        stop=_stop(body.get("stop")),
        seed=_number(body, "seed", None, -(2**63), 2**63 - 1, integer=True),
        stream=_flag(body, "stream"),
        echo=_flag(body, "echo"),
    )
    req.suffix = _text(body, "suffix", None)
    if req.suffix is not None and (req.echo or any(isinstance(p, list) for p in req.prompts)):
        raise ApiError(400, "'suffix' needs text prompts and no 'echo'", "suffix", "unsupported")
    best_of = body.get("best_of")
    if best_of is not None and (type(best_of) is not int or best_of != req.n):  # true == 1, 1.0 == 1 in Python
        raise ApiError(400, "'best_of' other than n is not supported", "best_of", "unsupported")
    choices = len(req.prompts) * req.n
    if choices > MAX_CHOICES:
        raise ApiError(
            400,
            f"'prompt' × 'n' asks for {choices:,} completions; at most {MAX_CHOICES} a request (send more requests)",
            "prompt",
            "invalid_value",
        )
    req.include_usage = _include_usage(body)
    return req


CHAT_ARGUMENTS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop"}
CHAT_ARGUMENTS |= {"seed", "stream"}


def parse_chat(body: Any, limits: Limits) -> CompletionRequest:
    """A /v1/chat/completions body, checked as a completion's is; each message is an object with a known role and
    string content (or text parts), a bad one a 400 naming its field (`messages[1].role`)."""
    _check_arguments(body, CHAT_ARGUMENTS)
    if "messages" not in body:
        raise ApiError(400, "'messages' is required", "messages")
    try:
        messages = parse_messages(body["messages"])
    except ConversationError as e:
        raise ApiError(400, str(e), e.param, "invalid_value") from None
    # each checked; the newer name wins where both are given
    max_tokens = _number(body, "max_tokens", limits.max_tokens, 1, limits.max_tokens, integer=True)
    max_tokens = _number(body, "max_completion_tokens", max_tokens, 1, limits.max_tokens, integer=True)
    return CompletionRequest(
        model=body["model"],
        prompts=[""],
        messages=messages,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0, 2),
        top_p=_number(body, "top_p", None, 1e-9, 1),
        n=_number(body, "n", 1, 1, limits.max_n, integer=True),
        stop=_stop(body.get("stop")),
        seed=_number(body, "seed", None, -(2**63), 2**63 - 1, integer=True),
        stream=_flag(body, "stream"),
        include_usage=_include_usage(body),
    )


def _text(body: dict, key: str, default: str | None) -> str | None:
    value = body.get(key, default)
    if value is not None and not isinstance(value, str):
        raise ApiError(400, f"'{key}' must be a string, got {_shown(value)}", key)
    _check_unicode([value], key)
    return value


def parse_infill(body: Any, limits: Limits) -> CompletionRequest:
    """A llama.cpp /infill body (`input_prefix`, `input_suffix`, `input_extra`, `prompt`, `n_predict`, ...) as a
    completion request. Options llama.cpp has and gptforge does not are ignored, as editor plugins send many."""
    if not isinstance(body, dict):
        raise ApiError(400, "expected a JSON object as the request body")
    extra = body.get("input_extra")
    extra = [] if extra is None else extra
    if not isinstance(extra, list) or not all(isinstance(c, dict) and isinstance(c.get("text"), str) for c in extra):
        raise ApiError(400, '\'input_extra\' must be a list of {"filename", "text"} objects', "input_extra")
    _check_unicode([c["text"] for c in extra], "input_extra")
    context = "".join(c["text"] if c["text"].endswith("\n") else c["text"] + "\n" for c in extra)
    model = body.get("model", "")
    if not isinstance(model, str):
        raise ApiError(400, "'model' must be a string (GET /v1/models lists them)", "model")
    n_predict = body.get("n_predict", -1)
    if type(n_predict) is not int or not (n_predict == -1 or n_predict >= 1):
        raise ApiError(400, f"'n_predict' must be -1 (up to the cap) or a positive integer, got {_shown(n_predict)}",
                       "n_predict")  # fmt: skip
    return CompletionRequest(
        model=model,
        prompts=[context + (_text(body, "input_prefix", "") or "")],
        suffix=_text(body, "input_suffix", "") or "",
        middle=_text(body, "prompt", "") or "",
        max_tokens=limits.max_tokens if n_predict == -1 else min(limits.max_tokens, n_predict),
        temperature=_number(body, "temperature", 0.8, 0, 2),
        top_p=_number(body, "top_p", 0.95, 1e-9, 1),
        top_k=_number(body, "top_k", 40, 0, 1 << 30, integer=True) or None,
        stop=_stop(body.get("stop")),
        seed=None if body.get("seed") == -1 else _number(body, "seed", None, -(2**63), 2**63 - 1, integer=True),
        stream=_flag(body, "stream"),
    )


def _flag(body: dict, key: str, name: str | None = None) -> bool:
    """A boolean `key` of `body`, named `name` (its path from the request's top) in an error."""
    value, name = body.get(key, False), name or key
    if value is not None and not isinstance(value, bool):  # "no" or 0 would be read as on or off by chance
        raise ApiError(400, f"'{name}' must be true or false, got {_shown(value)}", name)
    return bool(value)


@dataclass(frozen=True)
class Shape:
    """How an answer is written: OpenAI's text completion, or its chat completion (a message, streamed as deltas)."""

    id_prefix: str
    whole: str
    chunk: str
    chat: bool

    def answer(self, rid: str, model: str, fingerprint: str, choices: list[dict], usage: dict | None, streamed: bool):
        """The whole response, or one streamed chunk."""
        out = {
            "id": rid,
            "object": self.chunk if streamed else self.whole,
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": fingerprint,
            "choices": choices,
        }
        if usage is not None:
            out["usage"] = usage
        return out

    def choice(self, index: int, text: str, finish_reason: str | None, streamed: bool) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        part = ("delta", {"content": text} if text else {}) if streamed else ("message", assistant(text))
        return {"index": index, part[0]: part[1], "logprobs": None, "finish_reason": finish_reason}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


COMPLETION = Shape("cmpl", "text_completion", "text_completion", chat=False)
CHAT = Shape("chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)


HOST_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-._")  # a DNS name's, and the '_' some LANs use


def host_name(header: str) -> str:
    """A Host header's name, without its port: 'Example.org:8000' -> 'example.org', '[::1]:8000' -> '::1'; ''
    for a malformed one ('127.0.0.1:80@evil.example', '[::1', 'localhost:abc'), which no browser sends."""
    header = header.strip()
    if header.startswith("["):
        name, closed, port = header[1:].partition("]")
        if not closed:
            return ""
    else:
        name, colon, port = header.partition(":")
        port = colon + port
    if port and not (port[0] == ":" and port[1:].isdigit() and port[1:].isascii()):
        return ""
    return name.strip().lower().removesuffix(".")


def host_arg(value: str) -> str:
    """A --host or --allow-host value as host_name gives it (an IPv6 address may come without its brackets)."""
    return host_name(f"[{value}]" if value.count(":") > 1 and not value.startswith("[") else value)


def allowed_host(value: str) -> str:
    """An --allow-host value as host_name gives it ('*': any), else ValueError: a name no Host header can carry (a
    space, a control character, none at all) would match no request, and its users would all be refused."""
    name = value if value == "*" else host_arg(value)
    if name == "*" or (name and set(name) <= HOST_NAME_CHARS):
        return name
    try:
        ipaddress.ip_address(name)
    except ValueError:
        raise ValueError(
            "expected a host name such as myhost.lan (letters, digits, '-', '.', '_'; a :PORT is ignored), "
            "an IP address or '*' (any)"
        ) from None
    return name
