"""The encoder: a torchvision backbone, a projection head and L2 normalisation."""

from __future__ import annotations

import torch
import torchvision
from torch import nn
from torch.nn import functional as F

from retrieval.errors import RetrievalError

BACKBONES = ("resnet18", "resnet34", "resnet50", "mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0")


class Encoder(nn.Module):
    """images [N, 3, H, W] (normalised float32) -> unit-norm embeddings [N, embedding_dim]."""

    def __init__(self, backbone: str = "resnet18", embedding_dim: int = 128, pretrained: bool = False) -> None:
        super().__init__()
        self.backbone, width = make_backbone(backbone, pretrained)
        self.head = nn.Sequential(nn.Linear(width, width), nn.ReLU(inplace=True), nn.Linear(width, embedding_dim))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.head(self.backbone(images)), dim=1)


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
