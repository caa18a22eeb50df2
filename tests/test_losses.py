"""SupCon against a brute-force reference loop and against pytorch-metric-learning."""

from __future__ import annotations

import math

import pytest
import torch
from pytorch_metric_learning import losses as pml_losses
from torch.nn import functional as F

from retrieval.errors import RetrievalError
from training.losses import SupConLoss, make_loss
from training.samplers import ClassBalancedBatchSampler


def reference_supcon(embeddings: torch.Tensor, labels: torch.Tensor, temperature: float) -> float:
    """L_out of Khosla et al. 2020, one anchor and one positive at a time, in float64."""
    z = F.normalize(embeddings.double(), dim=1)
    total, anchors = 0.0, 0
    for i in range(len(z)):
        positives = [p for p in range(len(z)) if p != i and labels[p] == labels[i]]
        if not positives:
            continue
        denominator = sum(math.exp(float(z[i] @ z[a]) / temperature) for a in range(len(z)) if a != i)
        total += -sum(math.log(math.exp(float(z[i] @ z[p]) / temperature) / denominator) for p in positives) / len(positives)
        anchors += 1
    return total / anchors


def random_batch(seed: int, n: int = 24, dim: int = 16, classes: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=generator)
    labels[-1] = classes + 3  # an anchor without a positive: left out of the mean
    return torch.randn(n, dim, generator=generator), labels


@pytest.mark.parametrize("temperature", [0.05, 0.1, 0.5, 1.0])
def test_supcon_matches_the_reference_loop(temperature: float) -> None:
    embeddings, labels = random_batch(1)
    ours = SupConLoss(temperature)(embeddings, labels)
    assert ours.item() == pytest.approx(reference_supcon(embeddings, labels, temperature), rel=1e-5)


@pytest.mark.parametrize("temperature", [0.07, 0.1, 0.3, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_supcon_matches_pytorch_metric_learning(temperature: float, seed: int) -> None:
    embeddings, labels = random_batch(seed)
    ours = SupConLoss(temperature)(embeddings, labels)
    theirs = pml_losses.SupConLoss(temperature=temperature)(embeddings, labels)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-6)


def test_supcon_is_finite_with_gradients_at_small_temperature() -> None:
    embeddings, labels = random_batch(3)
    embeddings.requires_grad_(True)
    loss = SupConLoss(0.01)(embeddings * 100, labels)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(embeddings.grad).all()


def test_supcon_refuses_a_batch_without_positive_pairs() -> None:
    with pytest.raises(RetrievalError, match="no positive pair"):
        SupConLoss()(torch.randn(4, 8), torch.arange(4))


def test_unknown_loss_and_bad_temperature_are_refused() -> None:
    with pytest.raises(RetrievalError, match="unknown loss 'triplet'"):
        make_loss("triplet", 0.1)
    with pytest.raises(RetrievalError, match="temperature must be positive"):
        SupConLoss(0.0)


def test_class_balanced_batches() -> None:
    labels = [f"c{i % 7}" for i in range(50)] + ["lonely"]
    sampler = ClassBalancedBatchSampler(labels, batch_size=12, images_per_class=4, seed=5)
    sampler.set_epoch(0)
    first = list(sampler)
    assert len(first) == len(sampler) == 51 // 12
    for batch in first:
        classes = [labels[i] for i in batch]
        assert len(batch) == 12 and len(set(classes)) == 3
        assert all(classes.count(c) == 4 for c in set(classes))
    assert list(sampler) == first  # the same epoch draws the same batches
    sampler.set_epoch(1)
    assert list(sampler) != first


def test_sampler_refuses_batches_without_positives() -> None:
    with pytest.raises(RetrievalError, match="at least two classes"):
        ClassBalancedBatchSampler(["a"] * 10, batch_size=8)
    with pytest.raises(RetrievalError, match="at least 2"):
        ClassBalancedBatchSampler(["a", "b"] * 5, batch_size=8, images_per_class=1)
