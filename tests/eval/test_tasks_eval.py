import json

import pytest
import torch
from tests.helpers import chat_checkpoint

from gptforge.checkpoint import load_checkpoint
from gptforge.errors import GptforgeError
from gptforge.eval import tasks as chat_eval
from gptforge.eval.humaneval import truncate
from gptforge.eval.suite import evaluate_checkpoint, format_results
from gptforge.eval.tasks import Reply, evaluate_tasks, sample_replies, summarize, task_prompt
from gptforge.model.sampling import Sampling
from gptforge.tasks.builtin import Task, builtin_tasks
from gptforge.tasks.score import Score


def task(name, family, tests):
    return Task(name, family, f"Write `f` ({name}).", "f", tests, "")


ADD = task("a", "add", ("assert f(1) == 2", "assert f(2) == 3"))
NEG = task("b", "neg", ("assert f(1) == -1", "assert f(0) == 0"))
RIGHT = {"a": "```python\ndef f(x):\n    return x + 1\n```", "b": "```python\ndef f(x):\n    return -x\n```"}
WRONG = "```python\ndef f(x):\n    return x\n```"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt", block_size=128)
    model, tok, _, _ = load_checkpoint(path)
    return path, model, tok


def test_pass_at_k_parse_and_define_rates_match_a_hand_count(chat_model, monkeypatch):
    _, model, tok = chat_model
    texts = {"a": [RIGHT["a"], WRONG, "def f(x) return", RIGHT["a"]], "b": [WRONG, "no code", WRONG, WRONG]}

    def canned(model, tok, tasks, n, **_):
        return [[Reply(t, [], [], text) for text in texts[t.name][:n]] for t in tasks]

    monkeypatch.setattr(chat_eval, "sample_replies", canned)
    result = evaluate_tasks(model, tok, [ADD, NEG], n=4, ks=[1, 2])
    add, neg, both = (result["families"][name] for name in ("add", "neg", "all"))
    assert add == {"tasks": 1, "parses": 0.75, "defines": 0.75, "pass@1": 0.5, "pass@2": pytest.approx(5 / 6)}
    assert neg == {"tasks": 1, "parses": 0.75, "defines": 0.75, "pass@1": 0.0, "pass@2": 0.0}
    assert both["pass@1"] == 0.25 and both["parses"] == 6 / 8 and both["defines"] == 6 / 8
    assert result["examples"][0] == {"request": ADD.request, "reply": RIGHT["a"]}


def test_a_task_passes_when_one_reply_of_n_passes_at_n_and_pass_at_one_is_the_share():
    solved, failed = Score(True, True, 2, 2, True), Score(True, True, 1, 2, True)
    assert summarize([[solved, failed, failed], [failed] * 3], [1, 3]) == {
        "tasks": 2,
        "parses": 1.0,
        "defines": 1.0,
        "pass@1": pytest.approx(1 / 6),
        "pass@3": 0.5,
    }


def test_each_reply_draws_the_same_tokens_whatever_is_sampled_beside_it(chat_model):
    _, model, tok = chat_model
    tasks = builtin_tasks("val", 3)
    rule = Sampling(1.0)
    together = sample_replies(model, tok, tasks, n=3, rule=rule, seed=7, max_new_tokens=12, rows=4)
    alone = sample_replies(model, tok, tasks[1:2], n=3, rule=rule, seed=7, max_new_tokens=12, rows=1)
    other = sample_replies(model, tok, tasks[1:2], n=3, rule=rule, seed=8, max_new_tokens=12)
    assert [r.ids for r in together[1]] == [r.ids for r in alone[0]]
    assert [r.ids for r in other[0]] != [r.ids for r in alone[0]]
    assert len({tuple(r.ids) for r in together[1]}) == 3  # the n samples of one task differ
    for group, t in zip(together, tasks, strict=True):
        for reply in group:
            assert reply.prompt == task_prompt(tok, t.request) and len(reply.ids) <= 12
            assert reply.text == tok.decode([i for i in reply.ids if i not in (tok.im_end, tok.im_start, tok.eot)])


def test_a_reply_ends_at_the_end_of_its_turn(tmp_path):
    model, tok, _, _ = load_checkpoint(chat_checkpoint(tmp_path / "c", ends_every_reply=True, block_size=128))
    [[reply]] = sample_replies(model, tok, [ADD], n=1, rule=Sampling(0.0), seed=0, max_new_tokens=20)
    assert reply.ids == [tok.im_end] and reply.text == ""


def test_eval_tasks_from_a_file_prints_a_line_a_family(chat_model, tmp_path):
    path, _, _ = chat_model
    rows = [{"request": "Write f.", "entry_point": "f", "tests": ["assert f() == 1"], "family": "one"}]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = evaluate_checkpoint(str(path), tasks=str(tmp_path / "t.jsonl"), samples=2, temperature=0.0)
    assert result["tasks"]["families"]["one"]["pass@1"] == 0.0  # a random model writes no function
    lines = format_results(result).splitlines()
    assert lines[0].startswith("step 1 tasks all: pass@1 0.0000 | parses")
    assert lines[0].endswith("(1 tasks x 2 samples)")
    assert lines[1].startswith("step 1 tasks one: pass@1 0.0000")


def test_a_bad_tasks_flag_is_refused_before_the_model_loads(tmp_path, chat_model):
    path, _, _ = chat_model
    with pytest.raises(GptforgeError, match="--tasks .*missing"):
        evaluate_checkpoint("no-such-checkpoint", tasks=str(tmp_path / "missing"))
    with pytest.raises(GptforgeError, match="--k 5: pass@k"):
        evaluate_checkpoint("no-such-checkpoint", tasks="builtin", samples=2, ks=(5,))
    with pytest.raises(GptforgeError, match="--tasks: empty"):
        evaluate_checkpoint("no-such-checkpoint", tasks="")
    rows = [{"request": "word " * 200, "entry_point": "f", "tests": ["assert f() == 1"]}]
    (tmp_path / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    says = r"--tasks .*long.jsonl: task .*long.jsonl:1: its request takes \d+ tokens, the context 128"
    with pytest.raises(GptforgeError, match=says):
        evaluate_checkpoint(str(path), tasks=str(tmp_path / "long.jsonl"))


def test_a_base_model_continues_the_request_as_comments_and_its_code_ends_at_top_level_code(tmp_path):
    model, tok, _, _ = load_checkpoint(chat_checkpoint(tmp_path / "base", chat=False, block_size=128))
    task = Task("t", "f", "Write `f`.\nIt adds one.", "f", ("assert f(1) == 2",), "")
    assert task_prompt(tok, task.request) == tok.encode("# Write `f`.\n# It adds one.\n")
    [[reply]] = sample_replies(model, tok, [task], n=1, rule=Sampling(0.0), seed=0, max_new_tokens=30)
    whole = tok.decode([t for t in reply.ids if t != tok.eot])
    assert reply.text == truncate(whole) and whole.startswith(reply.text)


def test_a_request_longer_than_the_context_names_its_task(chat_model):
    _, model, tok = chat_model
    long = Task("long/0", "x", "word " * 200, "f", ("assert f() == 1",), "")
    with pytest.raises(GptforgeError, match="task long/0: its request takes"):
        sample_replies(model, tok, [long], n=1, rule=Sampling(0.0), seed=0, max_new_tokens=4)


def test_greedy_replies_are_the_model_s_own_argmax(chat_model):
    _, model, tok = chat_model
    [[reply]] = sample_replies(model, tok, [ADD], n=1, rule=Sampling(0.0), seed=0, max_new_tokens=3)
    ids = task_prompt(tok, ADD.request)
    for token in reply.ids:
        with torch.no_grad():
            assert model(torch.tensor([ids]))[0][0, -1].argmax().item() == token
        ids.append(token)


def test_a_reply_ends_where_the_context_does(chat_model):
    _, model, tok = chat_model
    request = "Write `f`. " + "It adds one. " * 25  # a prompt near the 128-token context
    task = Task("near", "f", request, "f", ("assert f(1) == 2",), "")
    prompt = task_prompt(tok, request)
    assert 100 < len(prompt) < 128
    [[reply]] = sample_replies(model, tok, [task], n=1, rule=Sampling(0.0), seed=0, max_new_tokens=100)
    assert len(prompt) + len(reply.ids) == 129  # the last token is taken from a full context's logits
