"""The encoder: a torchvision (or timm) backbone, a projection head and L2 normalisation."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torchvision
from torch import nn
from torch.nn import functional as F

from retrieval.errors import RetrievalError, one_of
from retrieval.extras import require

BACKBONES = (
    "resnet18",
    "resnet34",
    "resnet50",
    "mobilenet_v3_small",
    "mobilenet_v3_large",
    "efficientnet_b0",
    "convnext_tiny",
    "vit_b_16",
)
TIMM_PREFIX = "timm:"  # "timm:<model name>" builds the model with timm.create_model

PROJECTION_DIM = 128
STEMS = ("imagenet", "small")
POOLINGS = ("avg", "gem")
RESNET_STAGES = (1, 2, 3, 4)
GEM_P = 3.0  # GeM's initial exponent (Radenović et al. 2018), learned with the rest


class GeM(nn.Module):
    """Generalised-mean pooling: (mean of x^p)^(1/p) over the spatial positions, p learned; p=1 is average pooling."""

    def __init__(self, p: float = GEM_P, eps: float = 1e-6) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(float(p)))
        self.eps = eps

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        p = self.p.float()
        pooled = features.float().clamp(min=self.eps).pow(p).mean(dim=(2, 3))
        return pooled.pow(1.0 / p)


def make_pool(pooling: str) -> nn.Module:
    """The spatial pooling of a feature map [N, C, H, W] -> [N, C]: average (torchvision's default) or GeM."""
    if pooling not in POOLINGS:
        raise RetrievalError(f"unknown pooling {pooling!r}; {one_of(pooling, POOLINGS)}")
    return GeM() if pooling == "gem" else nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(1))


def parse_layers(text: str) -> tuple[int, ...]:
    """--layers "3,4" -> (3, 4): the ResNet stages whose pooled features make the embedding."""
    try:
        stages = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        stages = ()
    if not stages or any(stage not in RESNET_STAGES for stage in stages):
        raise RetrievalError(f"--layers takes ResNet stages from 1 to 4 separated by commas (e.g. 3,4), got {text!r}")
    return stages


class MultiStage(nn.Module):
    """A ResNet whose stages `stages` are pooled and L2-normalised one by one, then concatenated.

    Mid-level stages keep more of what transfers to classes and styles never seen in training; each
    part is normalised so that no stage dominates by the scale of its activations.
    """

    def __init__(self, resnet: nn.Module, stages: tuple[int, ...], pooling: str) -> None:
        super().__init__()
        self.stem = nn.Sequential(resnet.conv1, resnet.bn1, resnet.relu, resnet.maxpool)
        self.stages = nn.ModuleList(getattr(resnet, f"layer{n}") for n in range(1, max(stages) + 1))
        self.pooled = tuple(stages)
        self.pools = nn.ModuleList(make_pool(pooling) for _ in stages)
        self.width = sum(_stage_width(self.stages[n - 1]) for n in stages)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x, parts = self.stem(images), []
        for number, stage in enumerate(self.stages, start=1):
            x = stage(x)
            if number in self.pooled:
                parts.append(F.normalize(self.pools[len(parts)](x), dim=1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _stage_width(stage: nn.Sequential) -> int:
    """The output channels of a ResNet stage (its last block's last batch norm)."""
    norms = [module for module in stage[-1].modules() if isinstance(module, nn.BatchNorm2d)]
    return norms[-1].num_features


@dataclass(frozen=True)
class Architecture:
    """What an encoder is made of (the TrainConfig fields that decide its shape): enough to rebuild it for its
    weights."""

    backbone: str = "resnet18"
    embedding_dim: int | None = None
    image_size: int = 224
    stem: str = "imagenet"
    pooling: str = "avg"
    layers: str = "4"


class Encoder(nn.Module):
    """images [N, 3, H, W] (normalised float32) -> unit-norm embeddings [N, embedding_dim].

    The embedding is the backbone's pooled features, or a linear map of them to embedding_dim when
    one is given. The loss sees a projection of the embedding (an MLP, as in SimCLR and SupCon)
    that is dropped after training: the layer before the projection head generalises better to
    classes never seen in training.
    """

    def __init__(
        self,
        backbone: str = "resnet18",
        embedding_dim: int | None = None,
        pretrained: bool = False,
        image_size: int = 224,
        stem: str = "imagenet",
        pooling: str = "avg",
        layers: str = "4",
    ) -> None:
        super().__init__()
        self.backbone, width = make_backbone(backbone, pretrained, image_size, stem)
        if pooling != "avg" or layers != "4":
            self.backbone, width = _pooled_stages(self.backbone, backbone, pooling, layers)
        self.embedding_dim = embedding_dim or width
        self.embedding = nn.Identity() if self.embedding_dim == width else nn.Linear(width, self.embedding_dim)
        self.projection = nn.Sequential(
            nn.Linear(self.embedding_dim, self.embedding_dim),
            nn.ReLU(inplace=True),
            nn.Linear(self.embedding_dim, PROJECTION_DIM),
        )

    @classmethod
    def build(cls, architecture: Architecture, pretrained: bool = False) -> Encoder:
        """The encoder of an architecture, from ImageNet weights (pretrained) or random ones."""
        shape = architecture
        return cls(
            shape.backbone, shape.embedding_dim, pretrained, shape.image_size, shape.stem, shape.pooling, shape.layers
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Returns the L2-normalised embeddings (what is exported and indexed)."""
        return F.normalize(self.embedding(self.backbone(images)), dim=1)

    def project(self, images: torch.Tensor) -> torch.Tensor:
        """Returns the projection-head output that the training loss sees."""
        return self.projection(self.embedding(self.backbone(images)))

    def embed_and_project(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the unit embeddings and the unit projections of images, from one pass of the backbone."""
        features = self.embedding(self.backbone(images))
        return F.normalize(features, dim=1), F.normalize(self.projection(features), dim=1)


def _pooled_stages(model: nn.Module, name: str, pooling: str, layers: str) -> tuple[nn.Module, int]:
    """A ResNet backbone rebuilt to pool with `pooling` the stages `layers` (e.g. "3,4"); other backbones refuse."""
    stages = parse_layers(layers)
    make_pool(pooling)  # refuses an unknown pooling before the backbone check
    if not name.startswith("resnet"):
        raise RetrievalError(f"--pooling gem and --layers are for the resnet backbones, not {name!r}")
    backbone = MultiStage(model, stages, pooling)
    return backbone, backbone.width


def require_backbone(name: str) -> None:
    """Refuses a backbone this product cannot build (said when the options are read, before the images are checked);
    a timm:<model> is looked up when it is built."""
    if not name.startswith(TIMM_PREFIX) and name not in BACKBONES:
        raise RetrievalError(
            f"unknown backbone {name!r}; {one_of(name, BACKBONES)}, or timm:<model> with timm installed"
        )


def make_backbone(name: str, pretrained: bool, image_size: int = 224, stem: str = "imagenet") -> tuple[nn.Module, int]:
    """Returns a backbone that maps images to pooled features, and its feature width.

    name is a torchvision classifier (its classification layer removed) or "timm:<model>" (timm
    installed, built with num_classes=0). pretrained=True loads ImageNet weights through the
    library's own loading code, which needs a network the first time. stem="small" gives a ResNet
    a 3x3 stride-1 first convolution instead of the 7x7 stride-2 one made for 224-pixel images, so
    that a small input keeps 4x the feature-map area (a 64-pixel image ends as 4x4, not 2x2).
    """
    if stem not in STEMS:
        raise RetrievalError(f"unknown stem {stem!r}; {one_of(stem, STEMS)}")
    if stem == "small" and not name.startswith("resnet"):
        raise RetrievalError(f"--stem small is for the resnet backbones, not {name!r}")
    if stem == "small" and pretrained:
        raise RetrievalError(
            "--stem small replaces the first convolution, so it cannot start from pretrained weights; drop one of them"
        )
    if name.startswith(TIMM_PREFIX):
        return _timm_backbone(name.removeprefix(TIMM_PREFIX), pretrained)
    require_backbone(name)
    options: dict = {}
    if name.startswith("vit_"):
        if image_size % 16:
            raise RetrievalError(
                f"{name} cuts images into 16-pixel patches; --image-size must be a multiple of 16, got {image_size}"
            )
        if pretrained and image_size != 224:
            raise RetrievalError(
                f"{name}'s pretrained weights are for 224-pixel images; "
                "use --image-size 224 or train without --pretrained"
            )
        options["image_size"] = image_size
    try:
        model = torchvision.models.get_model(name, weights="DEFAULT" if pretrained else None, **options)
    except (OSError, RuntimeError) as error:  # urllib errors are OSErrors
        raise RetrievalError(
            f"cannot load pretrained weights for {name} ({error}); check the network or train without --pretrained"
        ) from None
    if name.startswith("resnet"):
        width = model.fc.in_features
        model.fc = nn.Identity()
        if stem == "small":
            model.conv1 = nn.Conv2d(3, model.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
    elif name.startswith("vit_"):
        width = model.hidden_dim
        model.heads = nn.Identity()
    elif name.startswith("convnext"):  # classifier = LayerNorm2d, Flatten, Linear: keep the norm
        width = model.classifier[-1].in_features
        model.classifier[-1] = nn.Identity()
    else:  # mobilenet and efficientnet end in a `classifier` Sequential of dropout and linear layers
        width = next(m for m in model.classifier.modules() if isinstance(m, nn.Linear)).in_features
        model.classifier = nn.Identity()
    return model, width


def weights_cached(name: str) -> bool:
    """Whether torchvision's ImageNet weights for backbone `name` are already on disk (TORCH_HOME's hub cache).

    The default recipe uses them only then, so that no run downloads anything unasked; --pretrained fetches them.
    """
    if name not in BACKBONES:
        return False
    url = torchvision.models.get_model_weights(name).DEFAULT.url
    return (Path(torch.hub.get_dir()) / "checkpoints" / Path(url).name).is_file()


def _timm_backbone(name: str, pretrained: bool) -> tuple[nn.Module, int]:
    timm = require("timm", "timm")
    if not timm.list_models(name):
        raise RetrievalError(f"timm has no model {name!r}; see timm.list_models() for the names")
    try:
        model = timm.create_model(name, pretrained=pretrained, num_classes=0)
    except Exception as error:  # timm and huggingface_hub raise many error types when weights cannot be fetched
        raise RetrievalError(
            f"cannot build timm model {name!r} ({str(error).splitlines()[0]}); "
            "check the network or train without --pretrained"
        ) from None
    return model, model.num_features
