"""One optimizer step over accumulated micro-batches equals one step over the whole batch."""

import pytest
import torch

from gptforge.train.step import train_step


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return None, ((self.linear(x) - y) ** 2).mean()


def one_step(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, torch.Tensor, dict]:
    model = Regression()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    it = iter(batches)
    loss, norm, applied = train_step(
        model, model, optimizer, scaler, lambda: next(it), len(batches), grad_clip=0.0, dtype=torch.float32
    )
    assert applied
    return loss.item(), norm, model.state_dict()


def test_accumulated_micro_batches_step_as_their_whole_batch():
    torch.manual_seed(1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    whole = one_step([(x, y)])
    parts = one_step([(x[i : i + 2], y[i : i + 2]) for i in range(0, 8, 2)])
    assert parts[0] == pytest.approx(whole[0], rel=1e-6)  # the mean loss
    torch.testing.assert_close(parts[1], whole[1])  # the gradient norm
    torch.testing.assert_close(parts[2], whole[2])  # the updated weights


def test_a_profile_of_the_step_names_each_part_around_its_work():
    """benchmarks/profile_step.py splits a step by these labels: each micro-step's forward and backward, then one
    clipping, one non-finite check and one optimizer step, each holding the ops that do that work."""
    from torch.profiler import profile

    from gptforge.train.step import BACKWARD, CLIP, FINITE_CHECK, FORWARD, OPTIMIZER

    torch.manual_seed(1)
    batches = [(torch.randn(2, 4), torch.randn(2, 1)) for _ in range(3)]
    with profile() as prof:
        one_step(batches)
    counts = {r.key: r.count for r in prof.key_averages()}
    assert [counts.get(p, 0) for p in (FORWARD, BACKWARD, CLIP, FINITE_CHECK, OPTIMIZER)] == [3, 3, 1, 1, 1]

    def below(event) -> set[str]:
        return {name for child in event.cpu_children for name in (child.name, *below(child))}

    inside = {e.name: below(e) for e in prof.events() if e.name in (FORWARD, CLIP, OPTIMIZER)}
    assert "aten::linear" in inside[FORWARD]
    assert any("norm" in name for name in inside[CLIP]), inside[CLIP]
    assert "Optimizer.step#SGD.step" in inside[OPTIMIZER], inside[OPTIMIZER]
