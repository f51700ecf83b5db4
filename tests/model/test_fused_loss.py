import pytest
import torch
import torch.nn.functional as F

from gptforge.model.fused_loss import linear_cross_entropy


@pytest.mark.parametrize("chunk_rows", [1, 100, 128, 512, 0])  # 128: 300 rows = 128 + 128 + 44
def test_chunked_loss_and_gradients_equal_plain_cross_entropy(chunk_rows):
    """Any chunking (uneven last chunk included) gives the loss and gradients of the full logits' cross-entropy."""
    torch.manual_seed(0)
    n, c, v, real = 300, 16, 128, 120
    h = torch.randn(n, c, requires_grad=True)
    w = torch.randn(v, c, requires_grad=True)
    t = torch.randint(0, real, (n,))
    ref = F.cross_entropy((h @ w.T)[:, :real], t)
    ref_h, ref_w = torch.autograd.grad(3 * ref, (h, w))
    loss = linear_cross_entropy(h, w, t, real, chunk_rows)
    got_h, got_w = torch.autograd.grad(3 * loss, (h, w))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(got_h, ref_h)
    torch.testing.assert_close(got_w, ref_w)
    assert got_w[real:].abs().max() == 0


def test_without_gradients_only_the_loss_is_computed():
    torch.manual_seed(0)
    h, w, t = torch.randn(50, 8), torch.randn(40, 8), torch.randint(0, 40, (50,))
    with torch.no_grad():
        loss = linear_cross_entropy(h.requires_grad_(), w, t, 40, 7)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, F.cross_entropy(h.detach() @ w.T, t))
