"""The request parser on its own: the server's limits, and any JSON value either parsed or refused as a 400."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gptforge.serve.protocol import ApiError, Limits, parse_completion

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
    ],
)
def test_values_that_used_to_raise_or_to_pass_unchecked_are_400s_naming_the_argument(args, param):
    error = refusal(**args)
    assert error.param == param and len(error.message) < 200, error.body()


TEXT = st.text(st.characters() | st.characters(categories=["Cs"]), max_size=8)  # lone surrogates too, as JSON allows
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(10**300, 10**400) | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
KEYS = [
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream", "echo",
    "stream_options", "best_of", "user", "logprobs", "suffix", "logit_bias", "presence_penalty", "frequency_penalty",
]  # fmt: skip
VALID = {"model": "run", "prompt": "def"}


@settings(max_examples=400, deadline=None)
@given(
    st.one_of(
        JSON,
        st.dictionaries(st.sampled_from(KEYS), JSON, max_size=6).map(lambda d: {**VALID, **d}),
        st.dictionaries(st.sampled_from(KEYS) | TEXT, JSON, max_size=4),
    )
)
def test_any_json_value_is_parsed_or_refused_in_openai_form(body):
    try:
        req = parse_completion(body, LIMITS)
    except ApiError as e:
        assert e.status == 400 and e.message
        json.dumps(e.body(), allow_nan=False)  # what the server sends: the error must be JSON
        return
    assert 1 <= req.max_tokens <= LIMITS.max_tokens and 1 <= req.n <= LIMITS.max_n and 0 <= req.temperature <= 2
    for text in [*req.prompts, *req.stop]:
        assert isinstance(text, list) or text.encode()  # what the tokenizer gets: valid Unicode
