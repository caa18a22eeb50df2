"""The encoder: a torchvision backbone, a projection head and L2 normalisation."""

from __future__ import annotations

import torch
import torchvision
from torch import nn
from torch.nn import functional as F

from retrieval.errors import RetrievalError

BACKBONES = ("resnet18", "resnet34", "resnet50", "mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0")


PROJECTION_DIM = 128


class Encoder(nn.Module):
    """images [N, 3, H, W] (normalised float32) -> unit-norm embeddings [N, embedding_dim].

    The embedding is the backbone's pooled features, or a linear map of them to embedding_dim when
    one is given. The loss sees a projection of the embedding (an MLP, as in SimCLR and SupCon)
    that is dropped after training: the layer before the projection head generalises better to
    classes never seen in training.
    """

    def __init__(self, backbone: str = "resnet18", embedding_dim: int | None = None, pretrained: bool = False) -> None:
        super().__init__()
        self.backbone, width = make_backbone(backbone, pretrained)
        self.embedding_dim = embedding_dim or width
        self.embedding = nn.Identity() if self.embedding_dim == width else nn.Linear(width, self.embedding_dim)
        self.projection = nn.Sequential(
            nn.Linear(self.embedding_dim, self.embedding_dim), nn.ReLU(inplace=True), nn.Linear(self.embedding_dim, PROJECTION_DIM)
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Returns the L2-normalised embeddings (what is exported and indexed)."""
        return F.normalize(self.embedding(self.backbone(images)), dim=1)

    def project(self, images: torch.Tensor) -> torch.Tensor:
        """Returns the projection-head output that the training loss sees."""
        return self.projection(self.embedding(self.backbone(images)))


def make_backbone(name: str, pretrained: bool) -> tuple[nn.Module, int]:
    """Returns a torchvision classifier with its classification layer removed, and its feature width.

    pretrained=True loads ImageNet weights through torchvision (needs a network the first time).
    """
    if name not in BACKBONES:
        raise RetrievalError(f"unknown backbone {name!r}; choose one of {', '.join(BACKBONES)}")
    weights = "DEFAULT" if pretrained else None
    try:
        model = torchvision.models.get_model(name, weights=weights)
    except (OSError, RuntimeError) as error:  # urllib errors are OSErrors
        raise RetrievalError(f"cannot load pretrained weights for {name} ({error}); check the network or train without --pretrained") from None
    if name.startswith("resnet"):
        width = model.fc.in_features
        model.fc = nn.Identity()
    else:  # mobilenet and efficientnet end in a `classifier` Sequential
        width = next(m for m in model.classifier.modules() if isinstance(m, nn.Linear)).in_features
        model.classifier = nn.Identity()
    return model, width
