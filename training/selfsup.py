"""Self-supervised losses: learning from images without labels, by the methods the supervised losses come from.

Each image of a batch is seen as two augmented views, and each image is its own class (its instance id):

- `simclr`: NT-Xent over the two views (Chen et al. 2020), SupContrast's SupConLoss without labels:
  SupConLoss over instance ids (one positive per anchor, the other view).
- `moco`: MoCo v2 (He et al. 2020; Chen et al. 2020; facebookresearch/moco builder.py): queries from
  the encoder, keys of the other view from a momentum copy of it (training.memory.MemoryQueue), a
  first-in first-out queue of earlier keys as the negatives: logits [q.k+, q.queue] / t, cross-entropy
  with the positive first. Symmetrised over the two views (each view queries the other's key).
- `instdisc`: instance discrimination with a memory bank (Wu et al. 2018; lemniscate.pytorch): a
  bank of every image's last embedding, moved towards each new one with momentum; the softmax over
  all instances (LinearAverage), or its NCE estimate with sampled negatives (NCEAverage,
  NCECriterion), plus the paper's proximal term lambda ||v - bank row||^2.
- `hcl`: Robinson et al. 2021 in its own setting: debiased (tau_plus) and hardness-weighted (beta)
  negatives without labels (training.losses.HCLLoss over instance ids, as joshr17/HCL computes it).
- `hard`: Wang & Liu 2021's hard contrastive loss over instance ids.

Beside a supervised loss (partly labeled and adapted runs) one more: `joint`, the pool's images joining
the supervised loss's own batch, each image a class of its own whose two views are its positives, so
that labeled images and pool images are each other's negatives (`JointObjective`).

`make_objective` gives the trainer one object per method: `encode(views)` (MoCo's keys, under the
trainer's autocast), `loss(z, instances, keys)` on the projections z [U, 2, P] of U images' two
views, and `follow(model)` after the step (the key encoder, the memory bank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from retrieval.errors import RetrievalError, one_of
from training.distributed import gather_rows
from training.losses import HardContrastiveLoss, HCLLoss, SupConLoss
from training.memory import MemoryQueue

SSL_LOSSES = ("simclr", "moco", "instdisc", "hcl", "hard")
JOINT = "joint"  # beside a supervised loss only: the pool's images as classes of the supervised loss's batch
BESIDE_LABELS = (*SSL_LOSSES, JOINT)  # what --ssl-loss takes in a partly labeled or adapted run
# Each method's temperature (the papers': MoCo v2 0.2, instance discrimination 0.07, HCL 0.5, Wang & Liu 0.2;
# SimCLR's 0.5 is for batches of thousands, 0.1 did better on the icons' held-out classes: docs/recipe.md)
SSL_TEMPERATURES = {"simclr": 0.1, "moco": 0.2, "instdisc": 0.07, "hcl": 0.5, "hard": 0.2}
MEMORY_DIM = 128  # the projection head's width: what the bank and the queue keep


class MoCoLoss(nn.Module):
    """MoCo's InfoNCE (builder.py): queries q [N, P], their positive keys k [N, P], a queue of negatives [K, P].

        logits = [q.k_i, q.queue] / t,   loss = mean_i -log softmax(logits_i)[0]

    All are L2-normalised here. Defaults: temperature=0.2 (MoCo v2).
    """

    def __init__(self, temperature: float = 0.2) -> None:
        super().__init__()
        if temperature <= 0:
            raise RetrievalError(f"temperature must be positive, got {temperature}")
        self.temperature = temperature

    def forward(self, queries: Tensor, keys: Tensor, queue: Tensor) -> Tensor:
        dtype = torch.promote_types(queries.dtype, torch.float32)  # float32 under autocast; float64 stays
        q, k = F.normalize(queries.to(dtype), dim=1), F.normalize(keys.to(dtype).detach(), dim=1)
        negatives = F.normalize(queue.to(dtype).detach(), dim=1)
        logits = torch.cat([(q * k).sum(dim=1, keepdim=True), q @ negatives.T], dim=1) / self.temperature
        return F.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long, device=q.device))


class MemoryBank:
    """Each image's last embedding [N, P], moved towards every new one: v = normalise(m v + (1 - m) f).

    Starts as lemniscate.pytorch's: uniform in [-s, s] with s = 1 / sqrt(P / 3). `normaliser` is the NCE
    estimate's constant Z, set on its first batch and kept (NCEAverage).
    """

    def __init__(self, size: int, dim: int, momentum: float, device: torch.device) -> None:
        bound = 1.0 / math.sqrt(dim / 3)
        self.memory = torch.rand(size, dim, device=device).mul_(2 * bound).sub_(bound)
        self.momentum = momentum
        self.normaliser = -1.0  # NCE's Z; < 0 until the first batch sets it

    @torch.no_grad()
    def update(self, indices: Tensor, features: Tensor) -> None:
        """Moves the rows of indices towards the features (one per index)."""
        moved = self.memory[indices] * self.momentum + features.detach().float() * (1 - self.momentum)
        self.memory[indices] = F.normalize(moved, dim=1)

    def state(self) -> tuple[dict[str, Tensor], dict[str, float]]:
        return {"memory": self.memory.cpu()}, {"normaliser": self.normaliser}

    def load_state(self, tensors: dict[str, Tensor], counters: dict[str, float]) -> None:
        self.memory.copy_(tensors["memory"])
        self.normaliser = float(counters["normaliser"])


class InstanceDiscrimination(nn.Module):
    """Non-parametric instance discrimination (Wu et al. 2018) against a memory bank: each feature f_i (unit) of
    image i is classified among all N instances by the bank's rows,

        full softmax (negatives=0):  loss = mean_i -log( exp(f_i.v_i / t) / sum_j exp(f_i.v_j / t) )
        NCE (K negatives, uniform noise P_n = 1/N, Z = N * mean exp(f.v / t) of the first batch):
            P(i|f) = exp(f.v / t) / Z;  loss = -(sum log P/(P + K P_n) over the positives
                                                + sum log K P_n/(P + K P_n) over the negatives) / B

    plus proximal * mean_i ||f_i - v_i||^2 (the paper's proximal regularisation). Defaults: temperature=0.07.
    """

    def __init__(self, temperature: float = 0.07, negatives: int = 0, proximal: float = 0.0) -> None:
        super().__init__()
        self.temperature, self.negatives, self.proximal = temperature, negatives, proximal

    def forward(self, features: Tensor, indices: Tensor, bank: MemoryBank) -> Tensor:
        memory = bank.memory
        f = F.normalize(features.to(memory.dtype), dim=1)
        if self.negatives:
            loss = self._nce(f, indices, bank)
        else:
            loss = F.cross_entropy(f @ memory.T / self.temperature, indices)
        if self.proximal:
            loss = loss + self.proximal * (f - memory[indices]).pow(2).sum(dim=1).mean()
        return loss

    def _nce(self, f: Tensor, indices: Tensor, bank: MemoryBank) -> Tensor:
        count, k = len(bank.memory), self.negatives
        drawn = torch.randint(0, count, (len(f), k + 1), device=f.device)  # the global generator: resumable
        drawn[:, 0] = indices
        out = torch.exp(torch.einsum("bkd,bd->bk", bank.memory[drawn], f) / self.temperature)
        if bank.normaliser < 0:
            bank.normaliser = float(out.mean().detach()) * count
        return nce_criterion(out / bank.normaliser, count)


def nce_criterion(probabilities: Tensor, count: int, eps: float = 1e-7) -> Tensor:
    """NCECriterion of lemniscate.pytorch: probabilities [B, K+1] of the data (column 0) and of K noise samples."""
    k, noise = probabilities.shape[1] - 1, 1.0 / count
    positive = probabilities[:, 0]
    data = torch.log(positive / (positive + k * noise + eps))
    noise_terms = torch.log((k * noise) / (probabilities[:, 1:] + k * noise + eps))
    return -(data.sum() + noise_terms.sum()) / len(probabilities)


class PairObjective:
    """simclr, hcl and hard: a contrastive loss over the two views, each image its own class."""

    def __init__(self, loss: nn.Module) -> None:
        self.criterion = loss

    def encode(self, views: Tensor) -> None:
        """No keys."""

    def loss(self, z: Tensor, instances: Tensor, keys: Tensor | None) -> Tensor:
        labels = instances.repeat_interleave(z.shape[1])
        return self.criterion(z.reshape(-1, z.shape[-1]), labels)

    def follow(self, model: nn.Module) -> None:
        """Nothing moves with the encoder."""


class MoCoObjective:
    """moco: each view's query against the momentum encoder's key of the other view and the queue of keys."""

    def __init__(self, queue: MemoryQueue, temperature: float) -> None:
        """queue starts full of random unit keys, as MoCo's does."""
        self.queue, self.criterion = queue, MoCoLoss(temperature)
        queue.keys.copy_(F.normalize(torch.randn_like(queue.keys), dim=1))
        queue.filled = len(queue.keys)

    def encode(self, views: Tensor) -> Tensor:
        """The momentum encoder's keys of this process's views [U, 2, ...] -> [2U, P] (no gradient)."""
        return self.queue.encode(views.flatten(0, 1))

    def loss(self, z: Tensor, instances: Tensor, keys: Tensor | None) -> Tensor:
        assert keys is not None
        keys = gather_rows(keys.float()).view(z.shape)  # every rank's
        negatives, _ = self.queue.contents()
        loss = (self.criterion(z[:, 0], keys[:, 1], negatives) + self.criterion(z[:, 1], keys[:, 0], negatives)) / 2
        self.queue.push(keys[:, 1], instances)
        return loss

    def follow(self, model: nn.Module) -> None:
        self.queue.follow(model)


class BankObjective:
    """instdisc: each view's feature classified among every image by the memory bank, which then moves."""

    def __init__(self, bank: MemoryBank, criterion: InstanceDiscrimination) -> None:
        self.bank, self.criterion = bank, criterion
        self.pending: tuple[Tensor, Tensor] | None = None

    def encode(self, views: Tensor) -> None:
        """No keys."""

    def loss(self, z: Tensor, instances: Tensor, keys: Tensor | None) -> Tensor:
        loss = sum(self.criterion(z[:, view], instances, self.bank) for view in range(z.shape[1])) / z.shape[1]
        self.pending = instances, F.normalize(F.normalize(z.detach().float(), dim=2).mean(dim=1), dim=1)
        return loss  # type: ignore[return-value]

    def follow(self, model: nn.Module) -> None:
        """The bank moves after the step (the gradient was taken against it as it was)."""
        if self.pending is not None:
            self.bank.update(*self.pending)
            self.pending = None


class JointObjective:
    """joint: the supervised loss over the labeled images and the pool's views together, each pool image a class
    of its own (numbered after the labeled classes), so that the two kinds of image repel each other."""

    def __init__(self, criterion: nn.Module, classes: int) -> None:
        self.criterion, self.classes = criterion, classes

    def encode(self, views: Tensor) -> None:
        """No keys."""

    def loss(self, z: Tensor, instances: Tensor, keys: Tensor | None, labeled: tuple[Tensor, Tensor]) -> Tensor:
        """The criterion over labeled = (projections [B, P], class indices [B]) and the pool's views z [U, 2, P]."""
        embeddings, labels = labeled
        ids = instances.repeat_interleave(z.shape[1]) + self.classes
        return self.criterion(torch.cat([embeddings, z.reshape(-1, z.shape[-1])]), torch.cat([labels, ids]))

    def follow(self, model: nn.Module) -> None:
        """Nothing moves with the encoder."""


Objective = PairObjective | MoCoObjective | BankObjective | JointObjective


@dataclass(frozen=True)
class Objectives:
    """A run's self-supervised objective (None: labels alone) and the MoCo queue or memory bank it keeps, which the
    trainer state saves and restores."""

    objective: Objective | None
    queue: MemoryQueue | None = None
    bank: MemoryBank | None = None


def make_objective(
    method: str,
    temperature: float,
    model: nn.Module,
    pool: int,
    queue_size: int,
    momentum: float,
    bank_momentum: float,
    negatives: int,
    proximal: float,
) -> Objectives:
    """The method's objective over a pool of `pool` images, with the queue or bank it keeps (for the trainer state)."""
    device = next(model.parameters()).device
    if method == "moco":
        queue = MemoryQueue(model, queue_size or default_queue(pool), momentum)  # type: ignore[arg-type]
        return Objectives(MoCoObjective(queue, temperature), queue=queue)
    if method == "instdisc":
        if negatives >= pool:
            raise RetrievalError(f"--nce-negatives {negatives}: the collection has {pool} images; give fewer, or 0")
        bank = MemoryBank(pool, MEMORY_DIM, bank_momentum, device)
        return Objectives(BankObjective(bank, InstanceDiscrimination(temperature, negatives, proximal)), bank=bank)
    losses = {"simclr": SupConLoss, "hcl": HCLLoss, "hard": HardContrastiveLoss}
    if method not in losses:
        raise RetrievalError(f"unknown self-supervised method {method!r}; {one_of(method, SSL_LOSSES)}")
    return Objectives(PairObjective(losses[method](temperature=temperature)))


def default_queue(pool: int) -> int:
    """MoCo's queue when none is asked for: 4,096 keys (the icons' 1,004 images: half of them), so that an image's
    own earlier keys rarely stand among its negatives."""
    return max(16, min(4096, pool // 2))
