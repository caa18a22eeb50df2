"""The training configuration: one typed dataclass, resolved once and written to the run directory."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import torch

from retrieval.errors import RetrievalError
from retrieval.preprocess import IMAGENET_MEAN, IMAGENET_STD, Preprocessing
from training.augment import DEFAULT_AUGMENT, parse_augment
from training.losses import DEFAULT_TEMPERATURES
from training.model import POOLINGS, STEMS, Architecture, parse_layers, weights_cached

OPTIMIZERS = ("adamw", "sgd")
# The default recipe, by whether ImageNet weights are used (docs/recipe.md): from scratch, small inputs and long
# training; from pretrained weights, larger inputs and a short fine-tuning (the weights' own 224 px on a GPU).
RECIPE = {"scratch": {"image_size": 64, "epochs": 50}, "pretrained": {"image_size": 128, "epochs": 15}}
GPU_IMAGE_SIZE = 224
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
QUEUE_LOSSES = ("supcon", "infonce")


@dataclass
class TrainConfig:
    """Everything that decides a training run (written to RUN/config.json)."""

    data: str
    benchmark: str | None = None  # cub, cars196, sop or inshop: data is that archive, trained on its training split
    loss: str = "supcon"
    temperature: float | None = None  # None: the loss's default (training.losses.DEFAULT_TEMPERATURES)
    epochs: int | None = None  # None: the recipe's (RECIPE)
    batch_size: int = 128
    images_per_class: int = 4
    backbone: str = "resnet18"
    pretrained: bool | None = None  # None: ImageNet weights when torchvision has them cached (never downloads)
    image_size: int | None = None  # None: the recipe's (RECIPE)
    stem: str = "imagenet"  # imagenet, or small (resnets: a 3x3 stride-1 first convolution for small inputs)
    augment: str | None = None  # training.augment step names separated by commas, or none; None: DEFAULT_AUGMENT
    embedding_dim: int | None = None  # None: the backbone's feature width
    pooling: str = "avg"  # avg, or gem (generalised mean, p learned; resnets)
    layers: str = "4"  # the resnet stages pooled into the embedding, e.g. 3,4 (each part L2-normalised, concatenated)
    ema: float = 0.0  # decay of an exponential moving average of the weights, which is then exported (0: none)
    learning_rate: float = 1e-3
    weight_decay: float = 1e-4
    optimizer: str = "adamw"  # adamw, or sgd (momentum 0.9, Nesterov)
    warmup: float = 0.1  # fraction of the steps with a linear warm-up, before the cosine decay to 0
    clip_grad: float = 0.0  # maximum gradient norm (0: no clipping)
    precision: str = "auto"  # fp32, bf16 or fp16 autocast; auto: bf16 on a GPU or CPU that has it, else fp32
    compile: bool = False  # torch.compile the encoder
    queue_size: int = 0  # keys of earlier batches kept as extra contrast (MoCo memory; 0: none)
    momentum: float = 0.999  # momentum of the key encoder that fills the queue
    checkpoint_every: int = 0  # also save the trainer state every this many steps (0: after each epoch only)
    tensorboard: bool = False  # also log to RUN/tensorboard
    val_classes: float = 0.0  # fraction of the classes held out to validate each epoch (0: none)
    patience: int = 0  # epochs without a better validation MAP@R before stopping early (0: never)
    device: str = "auto"
    seed: int = 0
    workers: int = 0

    def __post_init__(self) -> None:
        if self.pretrained is None:
            self.pretrained = self.stem == "imagenet" and weights_cached(self.backbone)
        recipe = RECIPE["pretrained" if self.pretrained else "scratch"]
        if self.image_size is None:
            on_gpu = self.device != "cpu" and gpu_available()
            self.image_size = GPU_IMAGE_SIZE if self.pretrained and on_gpu else recipe["image_size"]
        if self.epochs is None:
            self.epochs = recipe["epochs"]
        if self.loss not in DEFAULT_TEMPERATURES:
            raise RetrievalError(f"unknown loss {self.loss!r}; choose one of {', '.join(sorted(DEFAULT_TEMPERATURES))}")
        if self.temperature is None:
            self.temperature = DEFAULT_TEMPERATURES[self.loss]
        if self.temperature <= 0:
            raise RetrievalError(f"--temperature must be positive, got {self.temperature}")
        for name in ("epochs", "batch_size", "image_size", "embedding_dim"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise RetrievalError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.image_size < 32:
            raise RetrievalError(f"--image-size must be at least 32 pixels, got {self.image_size}")
        if self.optimizer not in OPTIMIZERS:
            raise RetrievalError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.precision not in PRECISIONS:
            raise RetrievalError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not 0 <= self.warmup < 1:
            raise RetrievalError(f"--warmup is a fraction of the training steps in [0, 1), got {self.warmup}")
        if self.clip_grad < 0 or self.queue_size < 0 or self.checkpoint_every < 0:
            raise RetrievalError("--clip-grad, --queue-size and --checkpoint-every must not be negative")
        if self.queue_size and self.loss not in QUEUE_LOSSES:
            raise RetrievalError(f"--queue-size works with the {' and '.join(QUEUE_LOSSES)} losses, not {self.loss!r}")
        if not 0 <= self.momentum < 1:
            raise RetrievalError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.stem not in STEMS:
            raise RetrievalError(f"--stem must be one of {', '.join(STEMS)}, got {self.stem!r}")
        if self.pooling not in POOLINGS:
            raise RetrievalError(f"--pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        parse_layers(self.layers)
        if not 0 <= self.ema < 1:
            raise RetrievalError(f"--ema is a decay in [0, 1) (e.g. 0.99; 0: no averaging), got {self.ema}")
        if self.augment is None:
            self.augment = DEFAULT_AUGMENT
        parse_augment(self.augment)
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise RetrievalError(f"--device must be auto, cpu or cuda, got {self.device!r}")

    @property
    def architecture(self) -> Architecture:
        """The encoder's shape (what load_encoder rebuilds it from)."""
        assert self.image_size is not None  # resolved in __post_init__
        return Architecture(self.backbone, self.embedding_dim, self.image_size, self.stem, self.pooling, self.layers)

    @property
    def preprocessing(self) -> Preprocessing:
        assert self.image_size is not None  # resolved in __post_init__
        return Preprocessing(self.image_size, IMAGENET_MEAN, IMAGENET_STD)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> TrainConfig:
        """Rebuilds a config, refusing keys it does not know (rather than silently dropping them)."""
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise RetrievalError(f"config.json has unknown keys {sorted(unknown)}; it was written by another version")
        return cls(**values)


def gpu_available() -> bool:
    """Whether training would run on a GPU with --device auto."""
    return torch.cuda.is_available()
