"""Contrastive losses: plain `nn.Module`s taking (embeddings [N, D], labels [N])."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from retrieval.errors import RetrievalError


class SupConLoss(nn.Module):
    """Supervised contrastive loss, the L_out form of Khosla et al. 2020 (eq. 2).

    For anchor i with positives P(i) (other rows with its label) and A(i) (all rows but i):

        L = mean_i  -1/|P(i)| * sum_{p in P(i)} log( exp(z_i.z_p / t) / sum_{a in A(i)} exp(z_i.z_a / t) )

    Embeddings are L2-normalised here; several views of an image are simply rows sharing its label.
    Anchors without a positive are left out of the mean; a batch with no positive pair at all raises
    RetrievalError rather than returning 0. Computed in log space with the row maximum removed.

    Defaults: temperature=0.1.
    """

    def __init__(self, temperature: float = 0.1) -> None:
        super().__init__()
        if temperature <= 0:
            raise RetrievalError(f"temperature must be positive, got {temperature}")
        self.temperature = temperature

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        z = F.normalize(embeddings.float(), dim=1)
        logits = z @ z.T / self.temperature
        n = len(labels)
        self_mask = torch.eye(n, dtype=torch.bool, device=z.device)
        positives = (labels[:, None] == labels[None, :]) & ~self_mask
        logits = logits.masked_fill(self_mask, float("-inf"))
        log_prob = logits - torch.logsumexp(logits, dim=1, keepdim=True)
        counts = positives.sum(dim=1)
        anchors = counts > 0
        if not anchors.any():
            raise RetrievalError("SupConLoss: the batch has no positive pair; sample at least two images per class (class-balanced batches)")
        mean_log_prob = log_prob.masked_fill(~positives, 0.0).sum(dim=1)[anchors] / counts[anchors]
        return -mean_log_prob.mean()


LOSSES = {"supcon": SupConLoss}


def make_loss(name: str, temperature: float) -> nn.Module:
    """Returns the loss called name, with its temperature."""
    if name not in LOSSES:
        raise RetrievalError(f"unknown loss {name!r}; choose one of {', '.join(sorted(LOSSES))}")
    return LOSSES[name](temperature=temperature)
