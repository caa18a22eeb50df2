"""The training configuration: one typed dataclass, resolved once and written to the run directory."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from retrieval.errors import RetrievalError
from retrieval.preprocess import IMAGENET_MEAN, IMAGENET_STD, Preprocessing
from training.losses import DEFAULT_TEMPERATURES


@dataclass
class TrainConfig:
    """Everything that decides a training run (written to RUN/config.json)."""

    data: str
    loss: str = "supcon"
    temperature: float | None = None  # None: the loss's default (training.losses.DEFAULT_TEMPERATURES)
    epochs: int = 50
    batch_size: int = 128
    images_per_class: int = 4
    backbone: str = "resnet18"
    pretrained: bool = False
    image_size: int = 64
    embedding_dim: int | None = None  # None: the backbone's feature width
    learning_rate: float = 3e-3
    weight_decay: float = 1e-4
    val_classes: float = 0.0  # fraction of the classes held out to validate each epoch (0: none)
    patience: int = 0  # epochs without a better validation MAP@R before stopping early (0: never)
    device: str = "auto"
    seed: int = 0
    workers: int = 0

    def __post_init__(self) -> None:
        if self.loss not in DEFAULT_TEMPERATURES:
            raise RetrievalError(f"unknown loss {self.loss!r}; choose one of {', '.join(sorted(DEFAULT_TEMPERATURES))}")
        if self.temperature is None:
            self.temperature = DEFAULT_TEMPERATURES[self.loss]
        for name in ("epochs", "batch_size", "image_size", "embedding_dim"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise RetrievalError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.image_size < 32:
            raise RetrievalError(f"--image-size must be at least 32 pixels, got {self.image_size}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise RetrievalError(f"--device must be auto, cpu or cuda, got {self.device!r}")

    @property
    def preprocessing(self) -> Preprocessing:
        return Preprocessing(self.image_size, IMAGENET_MEAN, IMAGENET_STD)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        """Rebuilds a config, refusing keys it does not know (rather than silently dropping them)."""
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise RetrievalError(f"config.json has unknown keys {sorted(unknown)}; it was written by another version")
        return cls(**values)
