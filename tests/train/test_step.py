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


def test_the_gpu_profile_sorts_kernels_by_kind_and_times_the_parts_on_the_stream(monkeypatch):
    """benchmarks/profile_step.py on a GPU: the profiler charged backward's kernels to forward (1,392 ms of device
    time in a 1,125-ms step, backward 0.02 ms), so each part is timed by events recorded around its label."""
    import importlib.util
    from pathlib import Path

    import gptforge.train.step as step_module

    path = Path(__file__).parents[2] / "benchmarks" / "profile_step.py"
    spec = importlib.util.spec_from_file_location("profile_step", path)
    profile_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_step)
    names = {  # kernels of gpt2-124m's compiled step on an H100 (torch 2.11, CUDA 13)
        "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN": "matmul",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1": "attention",
        "triton_red_fused__to_copy_div_exp_fill_full_like_lift_fresh_mul_prepare_softmax_online_sca": "loss",
        "triton_per_fused__to_copy_add_native_layer_norm_backward_view_9": "normalisation/elementwise",
        "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "Memcpy HtoD (Pageable -> Device)": "other",
    }
    assert {name: profile_step.kernel_kind(name) for name in names} == names
    kinds = profile_step._kinds([{"op": name, "ms": 10.0} for name in names], step_ms=100.0)
    assert kinds["matmul"] == 10.0 and kinds["other"] == 10.0 and kinds["idle"] == 40.0
    clock = profile_step.PhaseClock()
    with profile_step._timed_parts(clock):
        assert step_module.record_function is clock  # train_step's labels now record events around their work
    assert step_module.record_function is profile_step.record_function
