"""SupCon against a brute-force reference loop and against pytorch-metric-learning."""

from __future__ import annotations

import math

import pytest
import torch
from pytorch_metric_learning import losses as pml_losses
from torch.nn import functional as F

from retrieval.errors import RetrievalError
from training.losses import HardContrastiveLoss, HCLLoss, InfoNCELoss, NPairLoss, SupConLoss, make_loss
from training.samplers import ClassBalancedBatchSampler


def reference_supcon(embeddings: torch.Tensor, labels: torch.Tensor, temperature: float, queue: torch.Tensor | None = None, queue_labels: torch.Tensor | None = None) -> float:
    """L_out of Khosla et al. 2020, one anchor and one positive at a time, in float64; queue keys join the contrast set."""
    z = F.normalize(embeddings.double(), dim=1)
    members, member_labels = z, labels
    if queue is not None:
        members, member_labels = torch.cat([z, F.normalize(queue.double(), dim=1)]), torch.cat([labels, queue_labels])
    total, anchors = 0.0, 0
    for i in range(len(z)):
        positives = [p for p in range(len(members)) if p != i and member_labels[p] == labels[i]]
        if not positives:
            continue
        denominator = sum(math.exp(float(z[i] @ members[a]) / temperature) for a in range(len(members)) if a != i)
        total += -sum(math.log(math.exp(float(z[i] @ members[p]) / temperature) / denominator) for p in positives) / len(positives)
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


@pytest.mark.parametrize("temperature", [0.05, 0.1, 0.3, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_supcon_matches_pytorch_metric_learning(temperature: float, seed: int) -> None:
    embeddings, labels = random_batch(seed)
    ours, our_grad = gradient(SupConLoss(temperature), embeddings, labels)
    theirs, their_grad = gradient(pml_losses.SupConLoss(temperature=temperature), embeddings, labels)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6) and torch.allclose(our_grad, their_grad, atol=1e-5)


def random_queue(seed: int, size: int = 40, dim: int = 16, classes: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and labels of a memory queue; its labels overlap those of random_batch."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, dim, generator=generator), torch.randint(0, classes, (size,), generator=generator)


def test_supcon_with_a_queue_matches_the_reference_loop() -> None:
    embeddings, labels = random_batch(6)
    queue, queue_labels = random_queue(10)
    ours = SupConLoss(0.1)(embeddings, labels, queue, queue_labels)
    assert ours.item() == pytest.approx(reference_supcon(embeddings, labels, 0.1, queue, queue_labels), rel=1e-5)
    with pytest.raises(RetrievalError, match="one label per key"):
        SupConLoss(0.1)(embeddings, labels, queue, queue_labels[:3])


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


def reference_infonce(embeddings: torch.Tensor, labels: torch.Tensor, t: float, queue: torch.Tensor | None = None, queue_labels: torch.Tensor | None = None) -> float:
    """NT-Xent, one positive pair at a time, in float64; queue keys of other labels add negatives."""
    z = F.normalize(embeddings.double(), dim=1)
    keys = F.normalize(queue.double(), dim=1) if queue is not None else torch.zeros(0, z.shape[1], dtype=torch.float64)
    key_labels = queue_labels if queue_labels is not None else torch.zeros(0, dtype=labels.dtype)
    terms = []
    for i in range(len(z)):
        negatives = [math.exp(float(z[i] @ z[n]) / t) for n in range(len(z)) if labels[n] != labels[i]]
        negatives += [math.exp(float(z[i] @ keys[n]) / t) for n in range(len(keys)) if key_labels[n] != labels[i]]
        for p in range(len(z)):
            if p != i and labels[p] == labels[i]:
                positive = math.exp(float(z[i] @ z[p]) / t)
                terms.append(-math.log(positive / (positive + sum(negatives))))
    return sum(terms) / len(terms)


def reference_npair(embeddings: torch.Tensor, labels: torch.Tensor, l2_reg: float, t: float) -> float:
    """Sohn 2016: the first two rows of each class form a pair; log(1 + sum_j exp(f.f+_j - f.f+_i))."""
    x = embeddings.double()
    pairs = []
    for label in sorted(set(labels.tolist())):
        rows = [i for i in range(len(labels)) if labels[i] == label]
        if len(rows) >= 2:
            pairs.append((rows[0], rows[1]))
    total = 0.0
    for i, (anchor, positive) in enumerate(pairs):
        own = float(x[anchor] @ x[positive]) / t
        total += math.log(1 + sum(math.exp(float(x[anchor] @ x[other]) / t - own) for j, (_, other) in enumerate(pairs) if j != i))
    return total / len(pairs) + l2_reg * float(x.pow(2).sum(dim=1).mean())


def reference_hcl(embeddings: torch.Tensor, labels: torch.Tensor, t: float, beta: float, tau_plus: float) -> float:
    """The estimator of joshr17/HCL written out per pair, in float64, outside log space."""
    z = F.normalize(embeddings.double(), dim=1)
    terms = []
    for i in range(len(z)):
        negatives = [math.exp(float(z[i] @ z[n]) / t) for n in range(len(z)) if labels[n] != labels[i]]
        m = len(negatives)
        weights = [value**beta for value in negatives]
        reweighted = sum(w * value for w, value in zip(weights, negatives)) / (sum(weights) / m)
        for p in range(len(z)):
            if p != i and labels[p] == labels[i]:
                positive = math.exp(float(z[i] @ z[p]) / t)
                ng = max((-tau_plus * m * positive + reweighted) / (1 - tau_plus), m * math.exp(-1 / t))
                terms.append(-math.log(positive / (positive + ng)))
    return sum(terms) / len(terms)


def gradient(loss: torch.nn.Module, embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[float, torch.Tensor]:
    x = embeddings.clone().requires_grad_(True)
    value = loss(x, labels)
    value.backward()
    return value.item(), x.grad


@pytest.mark.parametrize("temperature", [0.05, 0.1, 0.5, 1.0])
def test_infonce_matches_pml_ntxent_and_the_reference(temperature: float) -> None:
    embeddings, labels = random_batch(4)
    ours, our_grad = gradient(InfoNCELoss(temperature), embeddings, labels)
    theirs, their_grad = gradient(pml_losses.NTXentLoss(temperature=temperature), embeddings, labels)
    assert ours == pytest.approx(theirs, rel=1e-5) and torch.allclose(our_grad, their_grad, atol=1e-5)
    assert ours == pytest.approx(reference_infonce(embeddings, labels, temperature), rel=1e-5)


def test_infonce_with_a_queue_of_negatives() -> None:
    embeddings, labels = random_batch(5)
    queue, queue_labels = random_queue(9)
    ours = InfoNCELoss(0.1)(embeddings, labels, queue, queue_labels)
    assert ours.item() == pytest.approx(reference_infonce(embeddings, labels, 0.1, queue, queue_labels), rel=1e-5)
    assert ours.item() > InfoNCELoss(0.1)(embeddings, labels).item()  # more negatives, larger loss


@pytest.mark.parametrize("temperature", [0.05, 0.5, 1.0])
def test_npair_matches_pml_and_the_reference(temperature: float) -> None:
    from pytorch_metric_learning.distances import DotProductSimilarity

    embeddings, labels = random_batch(6)
    embeddings = embeddings * 0.3
    pml = pml_losses.NPairsLoss(distance=DotProductSimilarity(normalize_embeddings=False))
    ours, our_grad = gradient(NPairLoss(l2_reg=0.0, temperature=1.0), embeddings, labels)
    theirs, their_grad = gradient(pml, embeddings, labels)
    assert ours == pytest.approx(theirs, rel=1e-5) and torch.allclose(our_grad, their_grad, atol=1e-5)
    assert NPairLoss(0.02, temperature)(embeddings, labels).item() == pytest.approx(reference_npair(embeddings, labels, 0.02, temperature), rel=1e-5)


@pytest.mark.parametrize("beta,tau_plus,temperature", [(1.0, 0.1, 0.5), (0.5, 0.05, 0.2), (2.0, 0.3, 0.1), (1.0, 0.6, 0.5)])
def test_hcl_matches_the_reference_code(beta: float, tau_plus: float, temperature: float) -> None:
    embeddings, labels = random_batch(7)
    ours = HCLLoss(temperature, beta, tau_plus)(embeddings, labels)
    assert ours.item() == pytest.approx(reference_hcl(embeddings, labels, temperature, beta, tau_plus), rel=1e-4)


def test_hcl_without_hardness_or_debiasing_is_ntxent_on_two_views() -> None:
    generator = torch.Generator().manual_seed(11)
    views = torch.randn(2, 12, 16, generator=generator)
    embeddings, labels = views.reshape(24, 16), torch.arange(12).repeat(2)
    hcl = HCLLoss(temperature=0.5, beta=0.0, tau_plus=0.0)(embeddings, labels)
    assert hcl.item() == pytest.approx(pml_losses.NTXentLoss(temperature=0.5)(embeddings, labels).item(), rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("loss", [InfoNCELoss(0.01), HCLLoss(0.01), SupConLoss(0.01), HardContrastiveLoss(0.01), NPairLoss(temperature=0.01)], ids=lambda loss: type(loss).__name__)
def test_finite_at_small_temperature_under_autocast(loss: torch.nn.Module, dtype: torch.dtype) -> None:
    embeddings, labels = random_batch(8)
    weights = torch.randn(16, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=dtype):
        value = loss(embeddings @ weights, labels)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(weights.grad).all()


def test_each_loss_gets_its_own_default_temperature() -> None:
    from training.config import TrainConfig

    assert [TrainConfig(data="d", loss=name).temperature for name in ("supcon", "infonce", "npair", "hcl", "hard")] == [0.05, 0.07, 1.0, 0.5, 0.2]
    assert TrainConfig(data="d", loss="hcl", temperature=0.2).temperature == 0.2
    with pytest.raises(RetrievalError, match="unknown loss 'arcface'"):
        TrainConfig(data="d", loss="arcface")


def reference_hard(embeddings: torch.Tensor, labels: torch.Tensor, t: float, threshold: float, top_k: int | None) -> float:
    z = F.normalize(embeddings.double(), dim=1)
    terms = []
    for i in range(len(z)):
        sims = sorted((float(z[i] @ z[n]) for n in range(len(z)) if labels[n] != labels[i]), reverse=True)
        hard = [s for s in sims if s >= threshold][: top_k or len(sims)]
        for p in range(len(z)):
            if p != i and labels[p] == labels[i]:
                positive = math.exp(float(z[i] @ z[p]) / t)
                terms.append(-math.log(positive / (positive + sum(math.exp(s / t) for s in hard))))
    return sum(terms) / len(terms)


@pytest.mark.parametrize("threshold,top_k", [(0.0, None), (-1.0, 3), (0.1, 2), (0.9, None)])
def test_hard_contrastive_matches_the_reference(threshold: float, top_k: int | None) -> None:
    embeddings, labels = random_batch(12)
    ours = HardContrastiveLoss(0.2, threshold, top_k)(embeddings, labels)
    assert ours.item() == pytest.approx(reference_hard(embeddings, labels, 0.2, threshold, top_k), rel=1e-5, abs=1e-7)


def test_hard_contrastive_over_all_negatives_is_ntxent() -> None:
    embeddings, labels = random_batch(13)
    assert HardContrastiveLoss(0.3, threshold=-1.0)(embeddings, labels).item() == pytest.approx(InfoNCELoss(0.3)(embeddings, labels).item(), rel=1e-6)


@pytest.mark.parametrize("make", [InfoNCELoss, SupConLoss, HardContrastiveLoss], ids=lambda make: make.__name__)
def test_lower_temperature_puts_more_of_the_gradient_on_the_hardest_negative(make: type) -> None:
    """Wang & Liu 2021's hardness-aware property, on one anchor, its positive and five negatives."""
    angles = torch.tensor([0.0, 0.3, 0.6, 0.8, 1.0, 1.2, 1.4])  # anchor, positive, negatives from hardest to easiest
    base = torch.stack([torch.cos(angles), torch.sin(angles)], dim=1)
    labels = torch.tensor([0, 0, 1, 2, 3, 4, 5])
    shares = []
    for temperature in (1.0, 0.5, 0.2, 0.1, 0.05):
        x = base.clone().requires_grad_(True)
        make(temperature)(x, labels).backward()
        norms = x.grad[2:].norm(dim=1)
        shares.append(float(norms[0] / norms.sum()))
    assert all(a < b for a, b in zip(shares, shares[1:])), shares


def test_every_loss_is_defined_on_a_batch_of_one_label() -> None:
    """No negatives at all: NT-Xent, HCL and the hard loss give 0 (every term is -log 1), SupCon stays finite."""
    import torch

    from training.losses import LOSSES

    embeddings = torch.randn(8, 16, requires_grad=True)
    labels = torch.zeros(8, dtype=torch.long)
    for name in ("supcon", "infonce", "hcl", "hard"):
        loss = LOSSES[name]()(embeddings, labels)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(embeddings.grad).all(), name
        if name != "supcon":
            assert loss.item() == 0.0, name
        embeddings.grad = None
