"""The chunked output projection + cross-entropy (titanlite/components/loss.py) in one process: the plain loss's
value and gradients for any chunk size, with ignored rows, and the auto setting's choice."""

import pytest
import torch

from titanlite.components.loss import (
    IGNORE,
    ChunkedCrossEntropy,
    chunk_tokens,
    cross_entropy,
    fused_softmax_cross_entropy,
    softmax_cross_entropy,
)
from titanlite.config import Compile, Training
from titanlite.models.common.head import OutputHead


def plain_and_chunked(chunk: int, ignored_rows: int = 0, softcap: float = 0.0):
    torch.manual_seed(0)
    head = OutputHead(24, 301, softcap)
    hidden = torch.randn(3, 17, 24, requires_grad=True)
    labels = torch.randint(0, 301, (3, 17))
    labels.view(-1)[:ignored_rows] = IGNORE
    results = []
    for loss_fn in (
        lambda h: cross_entropy(head(h), labels),
        lambda h: ChunkedCrossEntropy(head, chunk)(head(h, project=False), labels),
    ):
        hidden.grad = head.weight.grad = None
        loss = loss_fn(hidden)
        (2.5 * loss).backward()  # an incoming gradient other than 1 is applied too
        results.append((loss.detach(), hidden.grad.clone(), head.weight.grad.clone()))
    return results


def relative(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("chunk", [1, 7, 17, 51, 4096])
@pytest.mark.parametrize("ignored_rows", [0, 5])
def test_chunked_equals_plain_for_any_chunk_size(chunk, ignored_rows):
    (loss, grad_h, grad_w), (c_loss, c_grad_h, c_grad_w) = plain_and_chunked(chunk, ignored_rows)
    assert relative(c_loss, loss) < 1e-6
    assert relative(c_grad_h, grad_h) < 1e-5 and relative(c_grad_w, grad_w) < 1e-5
    if ignored_rows:  # padding rows get no gradient
        assert c_grad_h.view(-1, 24)[:ignored_rows].abs().max() == 0


@pytest.mark.parametrize("chunk", [7, 4096])
def test_a_capped_head_chunks_as_its_plain_loss(chunk):
    """Gemma's final_logit_softcapping, softcap * tanh(z / softcap), in the chunked loss: the capped logits' loss and
    the gradients through the cap. The head's weights scaled so the cap bites (|z| near and past the cap)."""
    (loss, grad_h, grad_w), (c_loss, c_grad_h, c_grad_w) = plain_and_chunked(chunk, 5, softcap=0.5)
    (uncapped, _, _), _ = plain_and_chunked(chunk, 5)
    assert relative(loss, uncapped) > 1e-2  # the cap changes the loss
    assert relative(c_loss, loss) < 1e-6
    assert relative(c_grad_h, grad_h) < 1e-5 and relative(c_grad_w, grad_w) < 1e-5


def test_all_rows_ignored_is_nan_like_the_plain_loss():
    head = OutputHead(8, 50)
    with torch.no_grad():
        loss = ChunkedCrossEntropy(head, 4)(torch.randn(1, 6, 8), torch.full((1, 6), IGNORE))
    assert torch.isnan(loss)


def test_the_compile_friendly_chunk_computes_the_same():
    logits, target = torch.randn(9, 40), torch.randint(0, 40, (9,))
    keep = torch.ones(9, dtype=torch.bool)
    keep[4] = False
    (a, grad_a), (b, grad_b) = (
        softmax_cross_entropy(logits, target, keep, True),
        fused_softmax_cross_entropy(logits, target, keep, True),
    )
    assert torch.allclose(a, b) and torch.allclose(grad_a, grad_b)


def test_auto_chunks_unless_compile_fuses_the_plain_loss():
    auto = Training()
    assert auto.loss_chunk_tokens == -1
    assert chunk_tokens(auto, Compile(enable=False), loss_parallel=False) == 4096
    assert chunk_tokens(auto, Compile(enable=True), loss_parallel=False) == (
        0 if "loss" in Compile().components else 4096
    )
    assert chunk_tokens(auto, Compile(enable=True), loss_parallel=True) == 4096  # the plain loss stays eager there
    assert chunk_tokens(Training(loss_chunk_tokens=0), Compile(enable=False), loss_parallel=False) == 0
    assert chunk_tokens(Training(loss_chunk_tokens=512), Compile(enable=True), loss_parallel=False) == 512
