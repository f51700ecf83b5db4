"""Built-in verifiable tasks: seeded, split by phrasing and parameters, and their tests pass the reference."""

import re

import pytest

from gptforge.eval.humaneval import run_programs
from gptforge.tasks.builtin import DRILLS, FAMILIES, OPENERS, TESTS_PER_TASK, builtin_tasks, drill_tasks


def test_the_same_seed_gives_the_same_tasks_and_another_seed_others():
    assert builtin_tasks("train", 14, seed=1) == builtin_tasks("train", 14, seed=1)
    assert builtin_tasks("train", 14, seed=1) != builtin_tasks("train", 14, seed=2)


def test_every_family_comes_and_each_task_names_its_function_and_has_distinct_tests():
    tasks = builtin_tasks("val", 2 * len(FAMILIES))
    assert {t.family for t in tasks} == {f.name for f in FAMILIES}
    for task in tasks:
        assert f"`{task.entry_point}(" in task.request, task.request
        assert len(task.tests) == len(set(task.tests)) and 2 <= len(task.tests) <= TESTS_PER_TASK, task
        assert all(t.startswith(f"assert {task.entry_point}(") for t in task.tests)


def test_held_out_tasks_share_no_phrasing_and_no_parameters_with_training_ones():
    """A held-out task that reappeared among the training ones, reworded or not, would measure memory."""
    train, val = builtin_tasks("train", 700), builtin_tasks("val", 700)

    def shape(task):  # the request with the function's name taken out: its phrasing and parameters
        return task.request.replace(task.entry_point, "NAME")

    assert not {shape(t) for t in train} & {shape(t) for t in val}
    for index, opener in enumerate(OPENERS):  # each opener starts the requests of its split alone
        start = opener.split("{sig}")[0]
        own, other = (train, val) if index % 2 == 0 else (val, train)
        assert any(t.request.startswith(start) for t in own) and not any(t.request.startswith(start) for t in other)
    for family in FAMILIES:  # and each description, as its split's parameters fill it, its split's alone
        for index, body in enumerate(family.bodies):
            words = max(re.split(r"\{\w*\}", body), key=len)  # its longest stretch without a parameter
            own, other = (train, val) if index % 2 == 0 else (val, train)
            assert any(words in t.request for t in own if t.family == family.name)
            assert not any(words in t.request for t in other if t.family == family.name), (family.name, words)
    parameters = {  # the solution's constants, per family and split
        split: {(t.family, t.solution.split("\n", 1)[1]) for t in tasks}
        for split, tasks in (("train", train), ("val", val))
    }
    parametric = {"count_char", "keep_multiples", "clamp", "parse_pairs"}
    assert not {p for p in parameters["train"] & parameters["val"] if p[0] in parametric}


def test_drills_are_training_data_alone_in_training_openers_and_seeded():
    """A drill's wording or a held-out opener in the other split would make held-out requests familiar."""
    drills = drill_tasks(4000)  # the demo's count: a rare draw (one task in 30) comes too
    assert drills == drill_tasks(4000) and drills != drill_tasks(4000, seed=1)
    assert [t.family for t in drills[: len(DRILLS)]] == [d.name for d in DRILLS]
    val = builtin_tasks("val", 700)
    assert not {d.name for d in DRILLS} & {t.family for t in val + builtin_tasks("train", 700)}
    held_out_openers = [o.split("{sig}")[0] for o in OPENERS[1::2]]
    assert not any(t.request.startswith(start) for t in drills for start in held_out_openers)
    held_out_phrases = {  # every four words in a row of a held-out description
        " ".join(words[i : i + 4])
        for f in FAMILIES
        for body in f.bodies[1::2]
        for stretch in re.split(r"\{\w*\}", body)
        for words in [stretch.split()]
        for i in range(len(words) - 3)
    }
    assert not {p for t in drills for p in held_out_phrases if p in " ".join(t.request.split())}
    held_out = {t.solution.split("\n", 1)[1] for t in val if t.family in ("keep_multiples", "parse_pairs")}
    divisors = {re.search(r"% (\d+)", s).group(1) for s in held_out if "%" in s}
    marks = {m for s in held_out for m in re.findall(r"split\('([^']+)'\)", s)} - {"="}  # '=' is a training mark too
    assert divisors == {"5", "6", "7"} and marks == {"->", "|", "&"}
    assert not any(re.search(rf"\b{d}\b", t.request) for t in drills for d in divisors if "%" in t.solution)
    assert not any(f"'{m}'" in t.request for t in drills for m in marks)  # no held-out value is ever copied here
    for task in drills:  # neither a constant nor the argument passes a drill's tests
        answers = [test.rsplit(" == ", 1)[1] for test in task.tests]
        assert len(set(answers)) > 1 and answers != [t.split("(", 1)[1].rsplit(") == ", 1)[0] for t in task.tests]
        if task.family == "join_with":  # and the separator is tested between two items
            separator = re.search(r"'(.+)'\.join", task.solution).group(1)
            assert any(separator in answer for answer in answers), task
    for family in DRILLS:  # every description is used: no drill is ever held out
        for body in family.bodies:
            assert any(max(re.split(r"\{\w*\}", body), key=len) in t.request for t in drills if t.family == family.name)


def test_every_reference_solution_passes_its_tests_in_the_sandbox_and_a_wrong_one_fails():
    tasks = builtin_tasks("train", len(FAMILIES), seed=3) + builtin_tasks("val", len(FAMILIES), seed=3)
    tasks += drill_tasks(2 * len(DRILLS), seed=3)
    programs = [t.solution + "\n" + "\n".join(t.tests) + "\n" for t in tasks]
    assert [ok for ok, _ in run_programs(programs)] == [True] * len(tasks)
    wrong = [f"def {t.entry_point}(*args):\n    return None\n" + "\n".join(t.tests) + "\n" for t in tasks]
    assert [ok for ok, _ in run_programs(wrong)] == [False] * len(tasks)


def test_an_unknown_split_is_refused():
    with pytest.raises(ValueError, match="split='test': expected one of train, val"):
        builtin_tasks("test", 1)


KNOWN = {  # family: (parameters, arguments, the answer worked out by hand)
    "reverse": ({}, ("abc",), "cba"),
    "count_char": ({"a": "b"}, ("abcbb",), 3),
    "keep_multiples": ({"a": 3}, ([3, 4, 6, -9, 10],), [3, 6, -9]),
    "clamp": ({"a": 0, "b": 5}, (9,), 5),
    "merge_dicts": ({}, ({"x": 1, "z": 0}, {"x": 2, "y": 3}), {"x": 2, "z": 0, "y": 3}),
    "running_sum": ({}, ([1, 2, 3, -4],), [1, 3, 6, 2]),
    "parse_pairs": ({"a": "->", "b": "|"}, ("a->1|bc->-20",), {"a": 1, "bc": -20}),
    "modulo": ({"a": 7}, (-3,), 4),
    "divisible": ({"a": 9}, (-18,), True),
    "at_least": ({"a": -4}, (-9,), -4),
    "at_most": ({"a": -4}, (-2,), -4),
    "split_on": ({"a": "->"}, ("a->->b",), ["a", "", "b"]),
    "join_with": ({"a": "::"}, (["k", "lm", ""],), "k::lm::"),
    "add_const": ({"a": 13}, (-20,), -7),
}


@pytest.mark.parametrize("family", FAMILIES + DRILLS, ids=lambda f: f.name)
def test_each_reference_solution_gives_the_answer_worked_out_by_hand(family):
    """The tests are the reference's answers: a wrong reference would make every task wrong and self-consistent."""
    params, args, answer = KNOWN[family.name]
    scope: dict = {}
    exec(family.solution("f", params), scope)
    assert scope["f"](*args) == answer
    if family.name == "clamp":
        assert (scope["f"](-1), scope["f"](3)) == (0, 3)
    if family.name == "parse_pairs":
        assert scope["f"]("") == {}
    if family.name == "divisible":
        assert scope["f"](-17) is False
    if family.name == "at_least":
        assert scope["f"](0) == 0
    if family.name == "at_most":
        assert scope["f"](-6) == -6
