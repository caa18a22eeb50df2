"""A MoCo-style memory (He et al. 2020): a momentum key encoder and a labelled FIFO queue of its keys.

The queue lets a small batch contrast against thousands of earlier keys; the slowly moving key
encoder keeps those keys consistent with each other while the query encoder learns.
"""

from __future__ import annotations

import copy

import torch
from torch.nn import functional as F

from training.model import PROJECTION_DIM, Encoder


class MemoryQueue:
    """Keys [size, PROJECTION_DIM] with their class codes, filled first-in first-out."""

    def __init__(self, model: Encoder, size: int, momentum: float) -> None:
        device = next(model.parameters()).device
        self.encoder = copy.deepcopy(model).requires_grad_(False)
        self.momentum = momentum
        self.keys = torch.zeros(size, PROJECTION_DIM, device=device)
        self.labels = torch.full((size,), -1, dtype=torch.long, device=device)
        self.filled = self.position = 0

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Returns the key encoder's unit projections of images."""
        return F.normalize(self.encoder.project(images).float(), dim=1)

    @torch.no_grad()
    def follow(self, model: Encoder) -> None:
        """Moves the key encoder's weights towards the query encoder's: k = m k + (1 - m) q."""
        for key, query in zip(self.encoder.parameters(), model.parameters()):
            key.mul_(self.momentum).add_(query.detach(), alpha=1 - self.momentum)

    @torch.no_grad()
    def push(self, keys: torch.Tensor, labels: torch.Tensor) -> None:
        """Enqueues keys with their class codes, overwriting the oldest once the queue is full."""
        size = len(self.keys)
        keys, labels = keys[-size:], labels[-size:]
        slots = (self.position + torch.arange(len(keys), device=self.keys.device)) % size
        self.keys[slots], self.labels[slots] = keys.to(self.keys.dtype), labels.to(self.labels.device)
        self.position = (self.position + len(keys)) % size
        self.filled = min(size, self.filled + len(keys))

    def contents(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the filled part of the queue: keys and their class codes."""
        return self.keys[: self.filled], self.labels[: self.filled]

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Returns the queue's tensors and counters a resumed run needs (the key encoder is a module of its own)."""
        return {"keys": self.keys.cpu(), "labels": self.labels.cpu()}, {
            "filled": self.filled,
            "position": self.position,
        }

    def load_state(self, tensors: dict[str, torch.Tensor], counters: dict[str, int]) -> None:
        """Restores what state() returned."""
        self.keys.copy_(tensors["keys"])
        self.labels.copy_(tensors["labels"])
        self.filled, self.position = counters["filled"], counters["position"]
