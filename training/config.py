"""The training configuration: one typed dataclass, resolved once and written to the run directory."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import get_args, get_type_hints

import torch

from retrieval.errors import RetrievalError, one_of
from retrieval.preprocess import IMAGENET_MEAN, IMAGENET_STD, Preprocessing
from training.augment import DEFAULT_AUGMENT, SSL_AUGMENT, parse_augment
from training.losses import DEFAULT_TEMPERATURES, LOSSES
from training.model import POOLINGS, STEMS, Architecture, parse_layers, require_backbone, weights_cached
from training.selfsup import BESIDE_LABELS, JOINT, SSL_LOSSES, SSL_TEMPERATURES

OPTIMIZERS = ("adamw", "sgd")
MAX_IMAGE_SIZE = 1024  # pixels a side: a batch of larger inputs does not fit in memory
NOT_NEGATIVE = (
    "clip_grad",
    "queue_size",
    "checkpoint_every",
    "nce_negatives",
    "proximal",
    "weight_decay",
    "patience",
    "workers",
    "seed",
)  # options whose range starts at 0
# The default recipe, by whether ImageNet weights are used (docs/recipe.md): from scratch, small inputs and long
# training; from pretrained weights, larger inputs and a short fine-tuning (the weights' own 224 px on a GPU).
# Self-supervised runs see two views of each image, so their epochs cost twice as much: fewer of them.
RECIPE = {"scratch": {"image_size": 64, "epochs": 50}, "pretrained": {"image_size": 128, "epochs": 15}}
SSL_EPOCHS = {"scratch": 35, "pretrained": 10}
GPU_IMAGE_SIZE = 224
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
QUEUE_LOSSES = ("supcon", "infonce")
# What a run learns from (decided from the data, or by --self-supervised and --adapt; docs/guide.md):
SUPERVISED = "supervised"  # every image labeled: the supervised loss alone
SELF_SUPERVISED = "self-supervised"  # no labels used: the self-supervised loss (--loss names its method)
PARTLY_LABELED = "partly labeled"  # some images unlabeled: supervised on the labeled, self-supervised on all
ADAPTED = "adapted"  # supervised on the labeled images, self-supervised on the gallery's (--adapt)
MODES = (SUPERVISED, SELF_SUPERVISED, PARTLY_LABELED, ADAPTED)
SSL_DEFAULT = "simclr"  # the self-supervised method of the recipe (chosen on held-out classes, docs/recipe.md)
MODE_DEPENDENT = ("loss", "temperature", "epochs", "ssl_loss", "ssl_temperature")  # their defaults depend on it


@dataclass
class TrainConfig:
    """Everything that decides a training run (written to RUN/config.json).

    Defaults that depend on what the run learns from (`mode`: the losses, their temperatures, the epochs) are
    resolved for the mode given or expected (`expected_mode`), and again by `for_mode` once the data has shown
    which it is (a collection without labels trains self-supervised).
    """

    data: str
    benchmark: str | None = None  # cub, cars196, sop or inshop: data is that archive, trained on its training split
    loss: str | None = None  # the supervised loss (default supcon); in a self-supervised run, its method
    temperature: float | None = None  # None: the loss's default (training.losses.DEFAULT_TEMPERATURES)
    epochs: int | None = None  # None: the recipe's (RECIPE, SSL_EPOCHS)
    batch_size: int = 128  # images per batch (a self-supervised run: each seen as two views)
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
    queue_size: int = 0  # keys of earlier batches kept as extra contrast (MoCo memory; moco: 0 sizes it to the data)
    momentum: float = 0.999  # momentum of the key encoder that fills the queue
    checkpoint_every: int = 0  # also save the trainer state every this many steps (0: after each epoch only)
    tensorboard: bool = False  # also log to RUN/tensorboard
    val_classes: float = 0.0  # fraction of the classes held out to validate each epoch (0: none)
    patience: int = 0  # epochs without a better validation MAP@R before stopping early (0: never)
    device: str = "auto"
    seed: int = 0
    workers: int = 0
    self_supervised: bool = False  # learn without the labels of a labeled collection
    adapt: str | None = None  # a gallery (folder or list) whose images join the self-supervised loss, labels ignored
    ssl_loss: str | None = None  # the self-supervised method beside a supervised loss (None: SSL_DEFAULT)
    ssl_temperature: float | None = None  # its temperature (None: the method's default)
    ssl_weight: float = 1.0  # weight of the self-supervised loss beside the supervised one
    ssl_batch: int | None = None  # images a batch adds for the self-supervised loss beside a supervised one
    ssl_augment: str | None = None  # augmentation of the two views (None: training.augment.SSL_AUGMENT)
    bank_momentum: float = 0.5  # instdisc: how much of a memory bank row is kept when its image is seen again
    nce_negatives: int = 0  # instdisc: sampled negatives of its NCE estimate (0: the softmax over every image)
    proximal: float = 0.0  # instdisc: weight of the proximal term ||v - bank row||^2 (Wu et al. 2018)
    mode: str | None = None  # what the run learns from (MODES); None: decided from the data

    def __post_init__(self) -> None:
        for name in ("data", "adapt"):  # a collection may be given as a Path, as everywhere else
            if isinstance(getattr(self, name), Path):
                setattr(self, name, os.fspath(getattr(self, name)))
        _check_types(self)
        for name in ("loss", "ssl_loss"):  # SupCon, InfoNCE, as the papers write them
            if isinstance(getattr(self, name), str):
                setattr(self, name, getattr(self, name).lower())
        if not hasattr(self, "asked"):  # the mode-dependent values as given, to resolve again for another mode
            self.asked = {name: getattr(self, name) for name in MODE_DEPENDENT}
        if self.pretrained is None:
            self.pretrained = self.stem == "imagenet" and weights_cached(self.backbone)
        scratch = "pretrained" if self.pretrained else "scratch"
        if self.image_size is None:
            on_gpu = self.device != "cpu" and gpu_available()
            self.image_size = GPU_IMAGE_SIZE if self.pretrained and on_gpu else RECIPE[scratch]["image_size"]
        mode = self.mode or self.expected_mode()
        if self.epochs is None:
            self.epochs = SSL_EPOCHS[scratch] if mode == SELF_SUPERVISED else RECIPE[scratch]["epochs"]
        _resolve_losses(self, mode)
        if self.augment is None:
            self.augment = DEFAULT_AUGMENT
        if self.ssl_augment is None:
            self.ssl_augment = SSL_AUGMENT
        _check(self)

    def expected_mode(self) -> str:
        """The mode the options ask for, before the data is read (a collection without labels may change it)."""
        return self.mode or (SELF_SUPERVISED if self.self_supervised else ADAPTED if self.adapt else SUPERVISED)

    def for_mode(self, mode: str) -> TrainConfig:
        """This config for a run of that mode, its mode-dependent defaults resolved again from the values asked."""
        return replace(self, mode=mode, **self.asked)

    @property
    def mixed(self) -> bool:
        """Whether the run has a supervised and a self-supervised loss."""
        return self.expected_mode() in (PARTLY_LABELED, ADAPTED)

    @property
    def ssl_method(self) -> str | None:
        """The self-supervised method the run uses (None in a supervised run)."""
        mode = self.expected_mode()
        return self.loss if mode == SELF_SUPERVISED else self.ssl_loss if mode != SUPERVISED else None

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


def _resolve_losses(config: TrainConfig, mode: str) -> None:
    """Fills in the losses and temperatures of the mode; strict (a mode given) refuses what cannot apply to it."""
    if mode not in MODES:
        raise RetrievalError(f"unknown training mode {mode!r}; one of {', '.join(MODES)}")
    strict = config.mode is not None
    for option, name, known in (
        ("--loss", config.loss, {*LOSSES, *SSL_LOSSES}),
        ("--ssl-loss", config.ssl_loss, BESIDE_LABELS),
    ):
        if name is not None and name not in LOSSES and name not in BESIDE_LABELS:
            raise RetrievalError(f"{option}: unknown loss {name!r}; {one_of(name, sorted(known))}")
    if mode == SELF_SUPERVISED:
        if config.loss is not None and config.ssl_loss is not None and config.loss != config.ssl_loss:
            given = f"--loss {config.loss} and --ssl-loss {config.ssl_loss}"
            raise RetrievalError(f"{given}: a self-supervised run has one method; give it with --loss")
        method = config.loss or config.ssl_loss or SSL_DEFAULT
        if method == JOINT:
            raise RetrievalError(
                f"{JOINT} joins images without labels to a supervised loss's batch; a self-supervised run has no "
                f"labeled images: use one of {', '.join(SSL_LOSSES)}"
            )
        if method not in SSL_LOSSES:
            raise RetrievalError(
                f"--loss {method} needs labels; a self-supervised run takes one of {', '.join(SSL_LOSSES)}"
            )
        config.temperature = config.temperature or config.ssl_temperature or SSL_TEMPERATURES[method]
        config.loss, config.ssl_loss, config.ssl_temperature = method, None, None
        return
    config.loss = config.loss or "supcon"
    if config.loss not in LOSSES and (strict or config.loss not in SSL_LOSSES):
        raise RetrievalError(
            f"--loss {config.loss} is a self-supervised method: add --self-supervised to train without labels, or "
            f"give it as --ssl-loss beside a supervised loss ({', '.join(LOSSES)}) with --adapt GALLERY"
        )
    if config.temperature is None:
        config.temperature = DEFAULT_TEMPERATURES.get(config.loss, SSL_TEMPERATURES.get(config.loss, 0.1))
    if mode == SUPERVISED:
        if strict and (config.ssl_loss is not None or config.ssl_temperature is not None):
            raise RetrievalError(
                "--ssl-loss and --ssl-temperature need a self-supervised part: --adapt GALLERY, unlabeled images, "
                "or --self-supervised"
            )
        return
    config.ssl_loss = config.ssl_loss or SSL_DEFAULT
    if config.ssl_loss not in BESIDE_LABELS:
        raise RetrievalError(f"--ssl-loss {config.ssl_loss}: choose one of {', '.join(BESIDE_LABELS)}")
    if config.ssl_loss == JOINT:  # the supervised loss itself, at its temperature
        if config.ssl_temperature not in (None, config.temperature):
            raise RetrievalError(
                "--ssl-loss joint uses the supervised loss and its --temperature; drop --ssl-temperature"
            )
        if config.ssl_weight != 1.0:
            raise RetrievalError("--ssl-loss joint is one loss over both kinds of images; drop --ssl-weight")
        config.ssl_temperature = config.temperature
        return
    config.ssl_temperature = config.ssl_temperature or SSL_TEMPERATURES[config.ssl_loss]


def _check_types(config: TrainConfig) -> None:
    """Refuses a value of the wrong type (epochs="5" from a script's argv, 1.5 epochs) in one line naming the field,
    before it fails deep inside training or in writing config.json."""
    for name, hint in get_type_hints(TrainConfig).items():
        value = getattr(config, name)
        allowed = get_args(hint) or (hint,)
        if value is None and type(None) in allowed:
            continue
        if float in allowed and isinstance(value, int) and not isinstance(value, bool):
            continue
        if isinstance(value, bool) != (bool in allowed) or not isinstance(value, allowed):
            wanted = {bool: "True or False", int: "a whole number", float: "a number", str: "text"}
            what = " or ".join(wanted[kind] for kind in allowed if kind in wanted)
            raise RetrievalError(f"TrainConfig {name}: give {what}, got {value!r}")


def _check(config: TrainConfig) -> None:
    """Refuses values out of their range, naming the option (the losses are _resolve_losses')."""
    for entry in fields(TrainConfig):
        value = getattr(config, entry.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise RetrievalError(f"--{entry.name.replace('_', '-')} must be a finite number, got {value}")
    for name in ("epochs", "batch_size", "image_size", "embedding_dim", "ssl_batch"):
        if getattr(config, name) is not None and getattr(config, name) < 1:
            raise RetrievalError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(config, name)}")
    if not 32 <= int(config.image_size or 0) <= MAX_IMAGE_SIZE:
        raise RetrievalError(
            f"--image-size must be from 32 to {MAX_IMAGE_SIZE} pixels (each image is resized to it), "
            f"got {config.image_size}"
        )
    _one_of("optimizer", config.optimizer, OPTIMIZERS)
    _one_of("precision", config.precision, PRECISIONS)
    _one_of("stem", config.stem, STEMS)
    require_backbone(config.backbone)
    _one_of("pooling", config.pooling, POOLINGS)
    for name in ("temperature", "ssl_temperature", "ssl_weight"):
        if getattr(config, name) is not None and getattr(config, name) <= 0:
            raise RetrievalError(f"--{name.replace('_', '-')} must be positive, got {getattr(config, name)}")
    if not 0 <= config.warmup < 1:
        raise RetrievalError(f"--warmup is a fraction of the training steps in [0, 1), got {config.warmup}")
    if config.learning_rate <= 0:
        raise RetrievalError(f"--learning-rate must be positive, got {config.learning_rate}")
    for name in NOT_NEGATIVE:
        if getattr(config, name) < 0:
            raise RetrievalError(f"--{name.replace('_', '-')} must not be negative, got {getattr(config, name)}")
    if not 0 <= config.val_classes < 1:
        raise RetrievalError(f"--val-classes is a fraction of the classes in [0, 1), got {config.val_classes}")
    if config.patience and not config.val_classes:  # it was ignored: every epoch ran
        raise RetrievalError(
            f"--patience {config.patience} stops when the held-out classes' MAP@R stops improving: give --val-classes "
            "too (e.g. 0.2), or leave --patience out"
        )
    queued = "moco" in (config.ssl_method, config.loss) or config.loss in QUEUE_LOSSES
    if config.queue_size and not queued:
        raise RetrievalError(f"--queue-size works with the {' and '.join(QUEUE_LOSSES)} losses and moco")
    if config.queue_size and config.ssl_method not in (None, "moco"):
        raise RetrievalError(
            f"--queue-size beside the self-supervised method {config.ssl_method}: only --ssl-loss moco keeps a queue "
            "in a run with images without labels; drop --queue-size or use --ssl-loss moco"
        )
    for name in ("momentum", "bank_momentum", "ema"):
        if not 0 <= getattr(config, name) < 1:
            raise RetrievalError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(config, name)}")
    parse_layers(config.layers)
    parse_augment(str(config.augment))
    parse_augment(str(config.ssl_augment), "--ssl-augment")
    if config.device not in ("auto", "cpu", "cuda") and not config.device.startswith("cuda:"):
        raise RetrievalError(f"--device must be auto, cpu or cuda, got {config.device!r}")


def refuse_unused(config: TrainConfig) -> None:
    """Options of a part a new run does not have (they were ignored without a word), once its mode is known: a
    momentum without a queue, instdisc's bank options beside another method, and the self-supervised part's beside
    none. (Not in __post_init__: a run's config.json, read to export or resume it, is not refused.)"""
    defaults = {entry.name: entry.default for entry in fields(TrainConfig)}
    method, both = config.ssl_method, config.mode in (PARTLY_LABELED, ADAPTED)
    bank = "sets instdisc's memory bank: use --ssl-loss instdisc (or --loss instdisc --self-supervised)"
    beside = "a self-supervised part beside labels: add --adapt GALLERY (or give unlabeled images)"
    unused = [  # (option, given where it is not used, what it is for)
        ("--momentum", config.momentum != defaults["momentum"] and not (config.queue_size or method == "moco"),
         "moves the key encoder of a memory queue: add --queue-size (or use moco)"),
        ("--bank-momentum", config.bank_momentum != defaults["bank_momentum"] and method != "instdisc", bank),
        ("--nce-negatives", config.nce_negatives != defaults["nce_negatives"] and method != "instdisc", bank),
        ("--proximal", config.proximal != defaults["proximal"] and method != "instdisc", bank),
        ("--ssl-weight", config.ssl_weight != defaults["ssl_weight"] and not both, f"weighs {beside}"),
        ("--ssl-batch", config.ssl_batch is not None and not both, f"sizes {beside}"),
        ("--ssl-augment", config.ssl_augment not in (None, SSL_AUGMENT) and method is None,
         "makes the views of a self-supervised part: add --adapt GALLERY or --self-supervised"),
    ]  # fmt: skip
    for name, ignored, why in unused:
        if ignored:
            raise RetrievalError(f"{name} {why}, or leave {name} out")


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise RetrievalError(f"--{name} must be one of {', '.join(allowed)}, got {value!r}")


def gpu_available() -> bool:
    """Whether training would run on a GPU with --device auto."""
    return torch.cuda.is_available()
