"""Contrastive losses: plain `nn.Module`s taking (embeddings [N, D], labels [N])."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from retrieval.errors import RetrievalError, one_of


class SupConLoss(nn.Module):
    """Supervised contrastive loss, the L_out form of Khosla et al. 2020 (eq. 2).

    For anchor i with positives P(i) (other rows with its label) and A(i) (all rows but i):

        L = mean_i  -1/|P(i)| * sum_{p in P(i)} log( exp(z_i.z_p / t) / sum_{a in A(i)} exp(z_i.z_a / t) )

    Embeddings are L2-normalised here; several views of an image are simply rows sharing its label.
    With `queue` and `queue_labels` (keys of earlier batches from a momentum encoder, as in MoCo),
    the keys join A(i), and those sharing i's label join P(i); the anchors stay the batch's rows.
    Anchors without a positive are left out of the mean; a batch with no positive pair at all raises
    RetrievalError rather than returning 0. Computed in log space with the row maximum removed.

    Defaults: temperature=0.1.
    """

    def __init__(self, temperature: float = 0.1) -> None:
        super().__init__()
        _check_temperature(temperature)
        self.temperature = temperature

    def forward(
        self, embeddings: Tensor, labels: Tensor, queue: Tensor | None = None, queue_labels: Tensor | None = None
    ) -> Tensor:
        z = F.normalize(embeddings.float(), dim=1)
        keys, key_labels = _queue_keys(queue, queue_labels, z, "SupConLoss")
        all_labels = torch.cat([labels, key_labels]) if len(keys) else labels
        _, codes = torch.unique(all_labels, return_inverse=True)
        # mean over positives of log p(p | i) = (sum_p s_ip / t) / |P(i)| - logsumexp_{a != i} s_ia / t, and
        # sum_p z_i.z_p = z_i.(sum of i's class over batch and queue - z_i): no N x N mask is ever built
        members = torch.cat([z, keys]) if len(keys) else z
        class_sums = torch.zeros(int(codes.max()) + 1, z.shape[1], dtype=z.dtype, device=z.device).index_add(
            0, codes, members
        )
        counts = torch.bincount(codes)[codes[: len(labels)]] - 1  # positives of each anchor
        codes = codes[: len(labels)]
        anchors = counts > 0
        if not anchors.any():
            raise _no_positive_pair("SupConLoss")
        positive_logits = ((class_sums[codes] - z) * z).sum(dim=1) / self.temperature
        log_denominator = _ContrastLogSumExp.apply(z, members, self.temperature)
        return -(positive_logits[anchors] / counts[anchors] - log_denominator[anchors]).mean()


class _ContrastLogSumExp(torch.autograd.Function):
    """lse_i = log sum_{a != i} exp(z_i.m_a / t) over the members m (the batch z, then any queue keys).

    The same value as torch.logsumexp over the masked logits, with a hand-written backward: the
    exponentials of the forward pass are kept (N x M, as autograd would keep the logits) and reused,
    so exp runs once instead of twice and no mask or softmax copy is made; the gradient is
    d lse_i = sum_a p_ia (m_a dz_i + z_i dm_a) / t with p the row softmax. Always float32.
    """

    @staticmethod
    def forward(ctx, z: torch.Tensor, members: torch.Tensor, temperature: float) -> torch.Tensor:  # type: ignore[override]
        with torch.autocast(z.device.type, enabled=False):
            exponentials = (z / temperature) @ members.T  # scaling the rows, not the N x M product, saves a pass
            exponentials[:, : len(z)].fill_diagonal_(float("-inf"))  # self-contrast excluded
            row_max = exponentials.amax(dim=1, keepdim=True)
            totals = exponentials.sub_(row_max).exp_().sum(dim=1, keepdim=True)
        ctx.save_for_backward(z, members, exponentials, totals)
        ctx.temperature = temperature
        return (totals.log() + row_max).squeeze(1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        z, members, exponentials, totals = ctx.saved_tensors
        with torch.autocast(z.device.type, enabled=False):
            # softmax rows times the incoming gradient
            weights = exponentials * (grad[:, None] / (ctx.temperature * totals))
            return weights @ members, weights.T @ z, None


def _queue_keys(
    queue: torch.Tensor | None, queue_labels: torch.Tensor | None, z: torch.Tensor, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the unit queue keys and their labels (empty when there is no queue)."""
    if queue is None:
        return z.new_zeros(0, z.shape[1]), torch.zeros(0, dtype=torch.long, device=z.device)
    if queue_labels is None or len(queue_labels) != len(queue):
        raise RetrievalError(f"{name}: a queue needs one label per key (queue_labels)")
    return F.normalize(queue.detach().float(), dim=1), queue_labels


def _check_temperature(temperature: float) -> None:
    if temperature <= 0:
        raise RetrievalError(f"temperature must be positive, got {temperature}")


def _no_positive_pair(name: str) -> RetrievalError:
    return RetrievalError(
        f"{name}: the batch has no positive pair; sample at least two images per class (class-balanced batches)"
    )


def _normalised_pairs(
    embeddings: torch.Tensor, labels: torch.Tensor, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns unit embeddings and the masks of positive pairs (same label, not self) and negative pairs."""
    same = labels[:, None] == labels[None, :]
    positives = same & ~torch.eye(len(labels), dtype=torch.bool, device=labels.device)
    if not positives.any():
        raise _no_positive_pair(name)
    return F.normalize(embeddings.float(), dim=1), positives, ~same


class InfoNCELoss(nn.Module):
    """InfoNCE / NT-Xent (Oord et al. 2018; Chen et al. 2020), one term per positive pair.

    For each positive pair (i, p), with N(i) the rows of other labels (plus queue keys of other labels):

        l(i, p) = -log( exp(s_ip / t) / (exp(s_ip / t) + sum_{n in N(i)} exp(s_in / t)) )

    and the loss is the mean over positive pairs; s is cosine similarity. With `queue` and
    `queue_labels` (a memory of earlier keys), it is MoCo's loss generalised to labels: the queue only
    adds negatives. Defaults: temperature=0.07.
    """

    def __init__(self, temperature: float = 0.07) -> None:
        super().__init__()
        _check_temperature(temperature)
        self.temperature = temperature

    def forward(
        self, embeddings: Tensor, labels: Tensor, queue: Tensor | None = None, queue_labels: Tensor | None = None
    ) -> Tensor:
        z, positives, negatives = _normalised_pairs(embeddings, labels, "InfoNCELoss")
        logits = z @ z.T / self.temperature
        negative_logits = logits.masked_fill(~negatives, float("-inf"))
        keys, key_labels = _queue_keys(queue, queue_labels, z, "InfoNCELoss")
        if len(keys):
            queue_logits = (z @ keys.T / self.temperature).masked_fill(
                labels[:, None] == key_labels[None, :], float("-inf")
            )
            negative_logits = torch.cat([negative_logits, queue_logits], dim=1)
        log_negatives = torch.logsumexp(negative_logits, dim=1, keepdim=True)  # -inf where an anchor has none
        log_denominator = torch.logaddexp(logits, log_negatives)
        return -(logits - log_denominator)[positives].mean()


class NPairLoss(nn.Module):
    """Multi-class N-pair loss (Sohn 2016) with its L2 penalty on the (unnormalised) embeddings.

    From each class in the batch the first two rows form one (anchor, positive) pair; with f the
    anchors and f+ the positives of the N pairs,

        L = mean_i log(1 + sum_{j != i} exp((f_i.f+_j - f_i.f+_i) / t)) + l2_reg * mean_k ||x_k||^2

    i.e. cross-entropy over the anchor-positive dot products. Defaults: l2_reg=0.02, temperature=1.0
    (the paper has none; it scales the dot products).
    """

    def __init__(self, l2_reg: float = 0.02, temperature: float = 1.0) -> None:
        super().__init__()
        _check_temperature(temperature)
        self.l2_reg = l2_reg
        self.temperature = temperature

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = embeddings.float()
        order = torch.argsort(labels, stable=True)
        sorted_labels = labels[order]
        first = torch.ones_like(sorted_labels, dtype=torch.bool)
        first[1:] = sorted_labels[1:] != sorted_labels[:-1]
        starts = torch.nonzero(first).squeeze(1)
        has_pair = (starts + 1 < len(labels)) & (
            sorted_labels[(starts + 1).clamp(max=len(labels) - 1)] == sorted_labels[starts]
        )
        starts = starts[has_pair]
        if len(starts) == 0:
            raise _no_positive_pair("NPairLoss")
        anchors, positives = x[order[starts]], x[order[starts + 1]]
        logits = anchors @ positives.T / self.temperature
        loss = F.cross_entropy(logits, torch.arange(len(starts), device=x.device))
        return loss + self.l2_reg * x.pow(2).sum(dim=1).mean()


class HCLLoss(nn.Module):
    """Hard-negative contrastive loss of Robinson et al. 2021 ("Contrastive Learning with Hard Negative Samples").

    As in the reference code (joshr17/HCL), for each positive pair (i, p) with M negatives of i:

        w_in  = exp(beta * s_in / t) / mean_n exp(beta * s_in / t)        (importance weights)
        Ng_i  = (sum_n w_in exp(s_in / t) - tau_plus * M * exp(s_ip / t)) / (1 - tau_plus)
        Ng_i  = max(Ng_i, M * exp(-1 / t))
        l(i, p) = -log( exp(s_ip / t) / (exp(s_ip / t) + Ng_i) )

    averaged over positive pairs; with labels, the negatives are the other classes. Computed in log
    space. At beta=0 and tau_plus=0 it equals NT-Xent; like NT-Xent, a batch of one label (no
    negatives) gives 0. Defaults: temperature=0.5, beta=1.0, tau_plus=0.1.
    """

    def __init__(self, temperature: float = 0.5, beta: float = 1.0, tau_plus: float = 0.1) -> None:
        super().__init__()
        _check_temperature(temperature)
        if not 0 <= tau_plus < 1:
            raise RetrievalError(f"tau_plus must be in [0, 1), got {tau_plus}")
        self.temperature, self.beta, self.tau_plus = temperature, beta, tau_plus

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        z, positives, negatives = _normalised_pairs(embeddings, labels, "HCLLoss")
        t = self.temperature
        logits = z @ z.T / t
        if not negatives.any():  # one label in the batch: no negative, so every term is -log(1) = 0, as for NT-Xent
            return logits[positives].sum() * 0.0
        count = negatives.sum(dim=1, keepdim=True).float()
        weighted = torch.logsumexp(
            ((1 + self.beta) * logits).masked_fill(~negatives, float("-inf")), dim=1, keepdim=True
        )
        mean_weight = (
            torch.logsumexp((self.beta * logits).masked_fill(~negatives, float("-inf")), dim=1, keepdim=True)
            - count.log()
        )
        log_reweighted = weighted - mean_weight  # log sum_n w_in exp(s_in / t)
        log_debias = (
            math.log(self.tau_plus) + count.log() + logits
            if self.tau_plus > 0
            else torch.full_like(logits, float("-inf"))
        )
        # where the debiasing term exceeds the sum, the clamp below decides
        gap = (log_debias - log_reweighted).clamp(max=0.0)
        log_ng = torch.where(
            log_debias < log_reweighted,
            log_reweighted + torch.log1p(-torch.exp(gap).clamp(max=1 - 1e-7)) - math.log(1 - self.tau_plus),
            torch.full_like(logits, float("-inf")),
        )
        log_ng = torch.maximum(log_ng, count.log() - 1.0 / t)
        loss = -(logits - torch.logaddexp(logits, log_ng))
        return loss[positives].mean()


class HardContrastiveLoss(nn.Module):
    """The hard contrastive loss of Wang & Liu 2021 ("Understanding the Behaviour of Contrastive Loss").

    Only negatives in the informative interval enter the denominator: those with cosine similarity
    s_in >= threshold and, with top_k, only the k most similar ones of each anchor. For each positive
    pair (i, p), with H(i) those hard negatives,

        l(i, p) = -log( exp(s_ip / t) / (exp(s_ip / t) + sum_{n in H(i)} exp(s_in / t)) )

    averaged over positive pairs (a pair whose anchor has no hard negative contributes 0). With
    threshold=-1 and no top_k it is NT-Xent. Defaults: temperature=0.2, threshold=0.0 (negatives more
    similar than orthogonal), top_k=None.
    """

    def __init__(self, temperature: float = 0.2, threshold: float = 0.0, top_k: int | None = None) -> None:
        super().__init__()
        _check_temperature(temperature)
        if top_k is not None and top_k < 1:
            raise RetrievalError(f"top_k must be at least 1, got {top_k}")
        self.temperature, self.threshold, self.top_k = temperature, threshold, top_k

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        z, positives, negatives = _normalised_pairs(embeddings, labels, "HardContrastiveLoss")
        similarity = z @ z.T
        hard = negatives & (similarity >= self.threshold)
        if self.top_k is not None and self.top_k < len(labels):
            ranked = similarity.masked_fill(~hard, float("-inf")).topk(self.top_k, dim=1).indices
            hard = hard & torch.zeros_like(hard).scatter_(1, ranked, True)
        logits = similarity / self.temperature
        log_negatives = torch.logsumexp(logits.masked_fill(~hard, float("-inf")), dim=1, keepdim=True)
        return -(logits - torch.logaddexp(logits, log_negatives))[positives].mean()


LOSSES = {"supcon": SupConLoss, "infonce": InfoNCELoss, "npair": NPairLoss, "hcl": HCLLoss, "hard": HardContrastiveLoss}
# The temperature `retrieval train` uses when none is given: each paper's default, except SupCon's
# 0.05, which did better than the paper's 0.1 on the embedded dataset's training runs.
DEFAULT_TEMPERATURES = {"supcon": 0.05, "infonce": 0.07, "npair": 1.0, "hcl": 0.5, "hard": 0.2}


def make_loss(name: str, temperature: float) -> nn.Module:
    """Returns the loss called name, with its temperature."""
    if name not in LOSSES:
        raise RetrievalError(f"unknown loss {name!r}; {one_of(name, sorted(LOSSES))}")
    return LOSSES[name](temperature=temperature)
