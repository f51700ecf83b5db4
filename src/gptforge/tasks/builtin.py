"""Seeded families of small Python tasks over integers, strings, lists and dicts, each phrased several ways, with
tests computed by a reference solution. The held-out split differs from the training one in its phrasings and in
its families' parameters (a training task never reappears reworded, nor a held-out one with other words). Drills,
training-only families, add fine-tuning data whose answers copy a value of the request."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

SPLITS = ("train", "val")


@dataclass(frozen=True)
class Task:
    """A request, the function it names, and the hidden tests (assert statements calling it)."""

    name: str
    family: str
    request: str
    entry_point: str
    tests: tuple[str, ...]
    solution: str  # a reference solution: the tests' source of truth, never shown to a model


@dataclass(frozen=True)
class Family:
    """How one kind of task is made: its signature ({name} filled in), the ways of saying what it does ({a}, {b}
    filled in), its parameters per split, a reference solution per parameters, and inputs to test it on."""

    name: str
    signature: str
    bodies: tuple[str, ...]
    params: Callable[[random.Random, str], dict]
    solution: Callable[[str, dict], str]
    inputs: Callable[[random.Random, dict], tuple]
    names: tuple[str, ...]


# How a request opens ({sig}: the signature) before it says what the function does ({body}). A request is an
# opener and a body of one split: even-numbered ones are the training split's, odd-numbered ones held out.
OPENERS = (
    "Write a Python function `{sig}` that {body}.",
    "I need `{sig}`; it {body}.",
    "Define `{sig}`, which {body}.",
    "Please write `{sig}` in Python so that it {body}.",
    "Implement `{sig}`: it {body}.",
    "Give me a Python function `{sig}` which {body}.",
    "Create the function `{sig}`. It {body}.",
    "Could you code `{sig}`? It {body}.",
)


def _word(rng: random.Random, letters: str = "abcdefghij", size: tuple[int, int] = (0, 8)) -> str:
    return "".join(rng.choice(letters) for _ in range(rng.randint(*size)))


def _ints(rng: random.Random, size: tuple[int, int] = (0, 7)) -> list[int]:
    return [rng.randint(-20, 20) for _ in range(rng.randint(*size))]


# The (key-value, item) separators of parse_pairs, per split.
PAIR_MARKS = {"train": (("=", ";"), (":", ",")), "val": (("->", "|"), ("=", "&"))}


# A split's parameters come from disjoint ranges: (train, val).
def _split_range(split: str, train: range, val: range) -> range:
    return train if split == "train" else val


FAMILIES = (
    Family(
        "reverse",
        "{name}(s: str) -> str",
        (
            "returns the string s reversed",
            "gives back the characters of s in reverse order",
            "returns s read from right to left",
            "returns s backwards, its last character first",
        ),
        lambda rng, split: {},
        lambda name, p: f"def {name}(s):\n    return s[::-1]\n",
        lambda rng, p: (_word(rng),),
        ("reverse", "reversed_text", "flip", "backwards"),
    ),
    Family(
        "count_char",
        "{name}(s: str) -> int",
        (
            "counts how many times the character '{a}' occurs in s",
            "returns the number of '{a}' characters in the string s",
            "returns how often '{a}' appears in s",
            "gives the count of the letter '{a}' in s",
        ),
        lambda rng, split: {"a": rng.choice("abcdeklmno" if split == "train" else "fghij")},
        lambda name, p: f"def {name}(s):\n    return s.count({p['a']!r})\n",
        lambda rng, p: (_word(rng, "abcdefghij", (0, 12)),),
        ("count_letter", "occurrences", "how_many", "tally"),
    ),
    Family(
        "keep_multiples",
        "{name}(xs: list[int]) -> list[int]",
        (
            "keeps only the numbers of xs divisible by {a}, in order",
            "returns the elements of xs that are multiples of {a}",
            "returns, in their original order, the items of xs divisible by {a}",
            "filters xs down to the multiples of {a}",
        ),
        lambda rng, split: {"a": rng.choice((2, 3, 4, 8, 9) if split == "train" else (5, 6, 7))},
        lambda name, p: f"def {name}(xs):\n    return [x for x in xs if x % {p['a']} == 0]\n",
        lambda rng, p: (_ints(rng, (0, 9)),),
        ("multiples", "keep_divisible", "filter_by", "only_multiples"),
    ),
    Family(
        "clamp",
        "{name}(x: int) -> int",
        (
            "returns x clamped to the range [{a}, {b}]",
            "returns {a} if x is below {a}, {b} if x is above {b}, else x",
            "returns x limited to lie between {a} and {b} inclusive",
            "forces x into the interval from {a} to {b}",
        ),
        lambda rng, split: (lambda lo: {"a": lo, "b": lo + rng.choice(_split_range(split, range(3, 8), range(8, 13)))})(
            rng.randint(-5, 5)
        ),
        lambda name, p: f"def {name}(x):\n    return max({p['a']}, min({p['b']}, x))\n",
        lambda rng, p: (rng.randint(p["a"] - 6, p["b"] + 6),),
        ("clamp", "bounded", "limit", "clip_value"),
    ),
    Family(
        "merge_dicts",
        "{name}(a: dict, b: dict) -> dict",
        (
            "merges the two dicts, b's value winning for a key in both",
            "returns a new dict with every key of a and b, using the value from b where both have a key",
            "combines dicts a and b into one, values of b overriding those of a",
            "returns a merged copy of a and b where b takes precedence",
        ),
        lambda rng, split: {},
        lambda name, p: f"def {name}(a, b):\n    return {{**a, **b}}\n",
        lambda rng, p: tuple(
            {_word(rng, "wxyz", (1, 2)): rng.randint(0, 9) for _ in range(rng.randint(0, 4))} for _ in range(2)
        ),  # fmt: skip
        ("merge", "combine", "merged", "union_of"),
    ),
    Family(
        "running_sum",
        "{name}(xs: list[int]) -> list[int]",
        (
            "returns the running sums of xs (the i-th item is the sum of xs[0..i])",
            "returns the prefix sums of xs, as a list of the same length",
            "returns the cumulative totals of the list xs",
            "returns a list whose each item is the total of xs up to there",
        ),
        lambda rng, split: {},
        lambda name, p: (
            f"def {name}(xs):\n    out, total = [], 0\n    for x in xs:\n        total += x\n"
            "        out.append(total)\n    return out\n"
        ),
        lambda rng, p: (_ints(rng),),
        ("running_sum", "prefix_sums", "cumulative", "totals"),
    ),
    Family(
        "parse_pairs",
        "{name}(text: str) -> dict",
        (
            "parses text like 'a{a}1{b}b{a}2' (pairs separated by '{b}', key and integer value by '{a}') into a dict "
            "of str to int; empty text gives {{}}",
            "reads key{a}value items joined by '{b}', values integers, into a dict (an empty string gives an empty "
            "dict)",
            "reads 'key{a}number' entries separated by '{b}' into a dict with int values",
            "turns a '{b}'-separated list of key{a}int pairs into a dict (empty text: an empty dict)",
        ),
        lambda rng, split: dict(zip("ab", rng.choice(PAIR_MARKS[split]), strict=True)),
        lambda name, p: (
            f"def {name}(text):\n    if not text:\n        return {{}}\n    out = {{}}\n"
            f"    for item in text.split({p['b']!r}):\n        key, value = item.split({p['a']!r})\n"
            "        out[key] = int(value)\n    return out\n"
        ),
        lambda rng, p: (
            p["b"].join(f"{_word(rng, 'klmn', (1, 3))}{p['a']}{rng.randint(-9, 99)}" for _ in range(rng.randint(0, 4))),
        ),
        ("parse_pairs", "read_settings", "to_dict", "parse_config"),
    ),
)
# Training-only families whose whole answer is a value of the request written into code (a number, a
# separator): drawn from wide ranges, so that copying it pays and recalling one does not. No drill divides by a
# held-out divisor (keep_multiples') or splits on a held-out mark (parse_pairs'). Their tests check the reference
# alone: fine-tuning reads a drill's answer, and RL and the evaluations never draw a drill.
DRILL_DIVISORS = tuple(a for a in range(2, 41) if a not in (5, 6, 7))
DRILL_SEPARATORS = ("=", ";", ":", ",", "/", "#", "@", "~", "+", "*", "^", "::", "=>", "--", "..", "%", "!", "$")
DRILLS = (
    Family(
        "modulo",
        "{name}(x: int) -> int",
        (
            "returns the remainder of x divided by {a}",
            "returns x modulo {a}",
            "returns x % {a}",
            "returns x mod {a}, as Python's % gives it",
        ),
        lambda rng, split: {"a": rng.choice(DRILL_DIVISORS)},
        lambda name, p: f"def {name}(x):\n    return x % {p['a']}\n",
        lambda rng, p: (rng.randint(-50, 50),),
        ("remainder", "mod", "modulo", "rest"),
    ),
    Family(
        "divisible",
        "{name}(x: int) -> bool",
        (
            "returns True if x is divisible by {a}, else False",
            "tells whether x divides by {a} with no remainder",
            "returns whether {a} divides x evenly",
            "checks that {a} goes into x evenly",
        ),
        lambda rng, split: {"a": rng.choice(DRILL_DIVISORS)},
        lambda name, p: f"def {name}(x):\n    return x % {p['a']} == 0\n",
        lambda rng, p: (rng.randint(-60, 60) * rng.choice((1, p["a"])),),
        ("is_divisible", "divides", "divisible", "check"),
    ),
    Family(
        "at_least",
        "{name}(x: int) -> int",
        (
            "returns the larger of x and {a}",
            "returns x, but never less than {a}",
            "returns max of x and {a}",
            "returns x, or {a} when x is smaller",
        ),
        lambda rng, split: {"a": rng.randint(-40, 40)},
        lambda name, p: f"def {name}(x):\n    return max({p['a']}, x)\n",
        lambda rng, p: (rng.randint(p["a"] - 10, p["a"] + 10),),
        ("at_least", "floor_at", "lower_bound", "atleast"),
    ),
    Family(
        "at_most",
        "{name}(x: int) -> int",
        (
            "returns the smaller of x and {a}",
            "returns x, but never more than {a}",
            "returns min of x and {a}",
            "returns x capped at {a}",
        ),
        lambda rng, split: {"a": rng.randint(-40, 40)},
        lambda name, p: f"def {name}(x):\n    return min({p['a']}, x)\n",
        lambda rng, p: (rng.randint(p["a"] - 10, p["a"] + 10),),
        ("at_most", "cap", "upper_bound", "atmost"),
    ),
    Family(
        "split_on",
        "{name}(text: str) -> list[str]",
        (
            "returns the parts of text split on '{a}'",
            "splits text at every '{a}' into a list of strings",
            "returns text cut into pieces at '{a}'",
            "breaks text on the separator '{a}'",
        ),
        lambda rng, split: {"a": rng.choice(DRILL_SEPARATORS)},
        lambda name, p: f"def {name}(text):\n    return text.split({p['a']!r})\n",
        lambda rng, p: (p["a"].join(_word(rng, "klmn", (0, 3)) for _ in range(rng.randint(1, 4))),),
        ("split_on", "pieces", "parts", "cut"),
    ),
    Family(
        "join_with",
        "{name}(items: list[str]) -> str",
        (
            "joins the strings of items with '{a}' between them",
            "returns the strings of items glued with '{a}'",
            "glues the strings in items together, separated by '{a}'",
            "returns the items with '{a}' between each two",
        ),
        lambda rng, split: {"a": rng.choice(DRILL_SEPARATORS)},
        lambda name, p: f"def {name}(items):\n    return {p['a']!r}.join(items)\n",
        lambda rng, p: ([_word(rng, "klmn", (1, 3)) for _ in range(rng.choice((0, 2, 3, 4)))],),
        ("join_with", "glue", "joined", "concat"),
    ),
    Family(
        "add_const",
        "{name}(x: int) -> int",
        ("returns x plus {a}", "adds {a} to x", "returns the sum of x and {a}", "returns x increased by {a}"),
        lambda rng, split: {"a": rng.randint(1, 60)},
        lambda name, p: f"def {name}(x):\n    return x + {p['a']}\n",
        lambda rng, p: (rng.randint(-50, 50),),
        ("add", "plus", "shift", "increase"),
    ),
)
BY_NAME = {family.name: family for family in FAMILIES}
TESTS_PER_TASK = 5


def builtin_tasks(split: str, count: int, seed: object = 0) -> list[Task]:
    """`count` tasks of `split`, cycling through the families; the same seed and split give the same tasks. Train
    uses the even-numbered openers and bodies and one range of each family's parameters, val the odd ones and
    another: a held-out request shares no opener, no description and no parameter with a training one."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {', '.join(SPLITS)}")
    rng = random.Random(f"gptforge-tasks-{seed}-{split}")
    mine = slice(0, None, 2) if split == "train" else slice(1, None, 2)
    return [
        _task(FAMILIES[i % len(FAMILIES)], rng, split=split, index=i, openers=OPENERS[mine], bodies=mine)
        for i in range(count)
    ]


def drill_tasks(count: int, seed: object = 0) -> list[Task]:
    """`count` training-only tasks cycling through the drills, in the training split's openers and any of a
    drill's descriptions (no drill is held out); fine-tuning data alone: RL and the evaluations use `builtin_tasks`."""
    rng = random.Random(f"gptforge-drills-{seed}")
    return [
        _task(
            DRILLS[i % len(DRILLS)], rng, split="drill", index=i, openers=OPENERS[::2], bodies=slice(None), varied=True
        )
        for i in range(count)
    ]


def _task(
    family: Family,
    rng: random.Random,
    *,
    split: str,
    index: int,
    openers: tuple[str, ...],
    bodies: slice,
    varied: bool = False,
) -> Task:
    """Task `index` of `split`: `family`'s parameters, a function name, and a request from `openers` and the
    family's `bodies`; `varied`: tests that neither a constant nor returning the argument passes."""
    params = family.params(rng, split)
    name = rng.choice(family.names)
    body = rng.choice(family.bodies[bodies]).format(**params)
    request = rng.choice(openers).format(sig=family.signature.format(name=name), body=body)
    solution = family.solution(name, params)
    tests = _tests(family, name, params, solution, rng)
    for _ in range(20):
        if not varied or not _trivial(tests):
            break
        tests = _tests(family, name, params, solution, rng)
    return Task(f"{split}/{index}", family.name, request, name, tests, solution)


def _trivial(tests: tuple[str, ...]) -> bool:
    """A constant, or the function returning its argument, would pass every one of `tests`."""
    answers = [test.rsplit(" == ", 1)[1] for test in tests]
    arguments = [test.split("(", 1)[1].rsplit(") == ", 1)[0] for test in tests]
    return len(set(answers)) == 1 or answers == arguments


def _tests(family: Family, name: str, params: dict, solution: str, rng: random.Random) -> tuple[str, ...]:
    """Assertions of what the reference solution returns on random inputs (distinct calls)."""
    scope: dict = {}
    exec(solution, scope)  # our own reference code, written above
    calls: dict[str, str] = {}
    for _ in range(20 * TESTS_PER_TASK):
        args = family.inputs(rng, params)
        call = f"{name}({', '.join(map(repr, args))})"
        calls.setdefault(call, f"assert {call} == {scope[name](*args)!r}")
        if len(calls) == TESTS_PER_TASK:
            break
    return tuple(calls.values())
