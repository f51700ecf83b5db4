"""The request parser on its own: the server's limits, and any JSON value either parsed or refused as a 400."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gptforge.serve.protocol import MAX_CHOICES, ApiError, Limits, parse_completion

LIMITS = Limits(max_tokens=50, max_n=3)


def parse(**body):
    return parse_completion({"model": "run", "prompt": "def", **body}, LIMITS)


def refusal(**body) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(**body)
    assert caught.value.status == 400 and caught.value.message, caught.value.body()
    return caught.value


def test_the_limits_are_accepted_up_to_their_value_and_refused_past_it_naming_the_argument():
    req = parse(max_tokens=50, n=3, best_of=3, stop=["a", "b", "c", "d"], temperature=2, top_p=1, top_k=0)
    assert (req.max_tokens, req.n, req.stop, req.temperature, req.top_p, req.top_k) == (50, 3, list("abcd"), 2, 1, None)
    for args, param in [
        ({"max_tokens": 51}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 4}, "n"),
        ({"n": 0}, "n"),
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": -1e-9}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": 2**63}, "seed"),
        ({"stop": list("abcde")}, "stop"),
    ]:
        error = refusal(**args)
        assert error.param == param and param in error.message, (args, error.body())
    assert "[1, 50]" in refusal(max_tokens=51).message  # says what the limit is
    assert refusal(n=2, best_of=3).param == "best_of"


@pytest.mark.parametrize(
    ("args", "param"),
    [
        ({"max_tokens": 10**4000}, "max_tokens"),  # an int too large for a float: was OverflowError
        ({"temperature": 10**400}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),  # json.loads reads NaN and Infinity
        ({"top_p": float("inf")}, "top_p"),
        ({"max_tokens": 16.0}, "max_tokens"),
        ({"stream": 1}, "stream"),
        ({"stop": {"a": 1}}, "stop"),
        ({"prompt": "x\ud800y"}, "prompt"),  # a lone surrogate, from the JSON escape \ud800
        ({"prompt": ["ok", "\udfff"]}, "prompt"),
        ({"stop": ["\ud83d"]}, "stop"),
        ({"best_of": True}, "best_of"),  # True == 1 == n in Python
        ({"best_of": 1.0}, "best_of"),
        ({"presence_penalty": False}, "presence_penalty"),  # False == 0 in Python
        ({"stream": True, "stream_options": {"include_usage": "no"}}, "stream_options.include_usage"),  # read as true
        ({"stream": True, "stream_options": {"include_usage": 0}}, "stream_options.include_usage"),
        ({"stream": True, "stream_options": []}, "stream_options"),  # falsy: was read as no options
        ({"stream": True, "stream_options": False}, "stream_options"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # not streamed: OpenAI's 400, was ignored
        ({"stream": False, "stream_options": {}}, "stream_options"),
    ],
)
def test_values_that_used_to_raise_or_to_pass_unchecked_are_400s_naming_the_argument(args, param):
    error = refusal(**args)
    assert error.param == param and len(error.message) < 200, error.body()


def test_prompts_times_n_past_the_cap_is_a_400_naming_the_prompt():
    """200,000 prompts were answered 200 with 198,927 empty choices, holding the batch past every other client."""
    limits = Limits(max_n=8)
    req = parse_completion({"model": "run", "prompt": ["x"] * (MAX_CHOICES // 8), "n": 8}, limits)
    assert len(req.prompts) * req.n == MAX_CHOICES
    for prompt, n in [(["x"] * (MAX_CHOICES + 1), 1), ([[1]] * 200_000, 8), (["x"] * (MAX_CHOICES // 2 + 1), 2)]:
        with pytest.raises(ApiError) as caught:
            parse_completion({"model": "run", "prompt": prompt, "n": n}, limits)
        error = caught.value
        assert (error.status, error.param) == (400, "prompt") and f"at most {MAX_CHOICES} a request" in error.message
    assert parse(stream=True, stream_options={"include_usage": False}).include_usage is False


SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)  # JSON's "\\ud800" alone makes one
TEXT = st.text(max_size=8) | st.lists(st.characters() | SURROGATE, max_size=8).map("".join)
EDGES = st.sampled_from([10**400, -(10**400), 2**63, float("nan"), float("inf"), 1e308, -0.0, "\ud800", "x\udfff", ""])
JSON = st.recursive(
    EDGES | st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
PROMPT = TEXT | st.lists(TEXT | st.lists(st.integers(-1, 60_000), max_size=3), max_size=3)
NEAR = {  # values mostly valid, some just past a limit: whole requests parse too, or fail on one argument
    "stop": st.text(min_size=1, max_size=3) | st.lists(TEXT, max_size=5),
    "max_tokens": st.integers(1, 55),
    "n": st.integers(1, 4),
    "temperature": st.floats(0, 2.1),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(0, 100),
    "seed": st.integers(),
    "stream": st.booleans(),
    "echo": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
}
REQUESTS = st.fixed_dictionaries(
    {"model": TEXT, "prompt": PROMPT}, optional={key: value | EDGES for key, value in NEAR.items()}
)


def parsed_or_refused(body) -> None:
    """parse_completion's promise: a request within the limits, its text valid Unicode; or a 400 in OpenAI's form."""
    try:
        req = parse_completion(body, LIMITS)
    except ApiError as e:
        assert e.status == 400 and e.message
        json.dumps(e.body(), allow_nan=False)  # what the server sends: the error must be JSON
        return
    assert 1 <= req.max_tokens <= LIMITS.max_tokens and 1 <= req.n <= LIMITS.max_n and 0 <= req.temperature <= 2
    for text in [*req.prompts, *req.stop]:
        if isinstance(text, str):
            text.encode()  # what the tokenizer gets is valid Unicode: this raises for a lone surrogate


@settings(max_examples=300, deadline=None)
@given(JSON | st.dictionaries(st.sampled_from(list(NEAR)) | TEXT, JSON, max_size=4))
def test_any_json_value_is_parsed_or_refused_in_openai_form(body):
    parsed_or_refused(body)


@settings(max_examples=300, deadline=None)
@given(REQUESTS)
def test_requests_near_valid_ones_are_parsed_within_the_limits_or_refused(body):
    parsed_or_refused(body)
