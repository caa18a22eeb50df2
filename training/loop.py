"""The training loop: class-balanced batches, a contrastive loss, checkpoints after every epoch.

`train` prepares the data (checked once, held-out classes split off), then a `Trainer` holds the
model, loader, optimizer, schedule and memory queue and runs epochs of steps; checkpoints and the
resumable trainer state are training.checkpoints', validation training.validation's.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, Dataset

from retrieval.benchmarks import load_training_data
from retrieval.data import Item, Skipped, load_image, split_by_class, write_skip_report
from retrieval.errors import ImageError, RetrievalError
from retrieval.extras import require
from retrieval.plots import plot_training_log
from retrieval.preprocess import Preprocessing
from retrieval.progress import progress as progress_bar
from retrieval.progress import say
from retrieval.runs import RunDir, write_atomic, write_json
from training.augment import make_augmentation
from training.checkpoints import Progress, TrainerState, save_checkpoint
from training.config import TrainConfig
from training.distributed import Ranks, broadcast_object, gather_rows, start, stop
from training.losses import make_loss
from training.memory import MemoryQueue
from training.model import Encoder
from training.samplers import ClassBalancedBatchSampler
from training.validation import VALIDATION_KEYS, Validator


@dataclass
class TrainResult:
    """What a finished run produced."""

    run: RunDir
    num_images: int
    num_classes: int
    skipped: list[Skipped]
    final_loss: float
    reporting: bool = True  # False in the torchrun processes other than process 0, which reports for all


class AugmentedImages(Dataset):
    """Items decoded on access, augmented (training.augment) and normalised as at evaluation."""

    def __init__(
        self, items: Sequence[Item], classes: Sequence[str], preprocessing: Preprocessing, augment: str
    ) -> None:
        self.items = list(items)
        codes = {label: code for code, label in enumerate(classes)}
        self.codes = [codes[item.label] for item in self.items]
        self.augment = make_augmentation(augment, preprocessing)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.augment(load_image(self.items[index].path)), self.codes[index]


def readable_items(items: Sequence[Item], progress: bool = True) -> tuple[list[Item], list[Skipped]]:
    """Splits items into those that decode and those skipped (with the reason)."""
    good: list[Item] = []
    skipped: list[Skipped] = []
    for item in progress_bar(items, desc="checking images", unit="img", enabled=progress):
        if not item.label:
            skipped.append(Skipped(item.path, "no label (put it in a label folder or give it a label in the CSV)"))
            continue
        try:
            load_image(item.path)
        except ImageError as error:
            skipped.append(Skipped(item.path, error.reason))
            continue
        good.append(item)
    return good, skipped


class _Projected(nn.Module):
    """The encoder as the loss sees it (its projection head's output), for DDP and torch.compile to wrap."""

    def __init__(self, encoder: Encoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.encoder.project(images)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of --precision (None: float32); auto is bf16 on a GPU or a CPU that computes it natively."""
    if precision == "auto":
        native = torch.cuda.is_bf16_supported() if device.type == "cuda" else cpu_has_bf16()
        precision = "bf16" if native else "fp32"
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def cpu_has_bf16() -> bool:
    """Whether this CPU has bfloat16 instructions (AVX-512 BF16 or AMX; Linux's /proc/cpuinfo flags).

    Elsewhere bf16 would be emulated, slower than float32, so auto stays fp32 there.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Mixed precision in dtype on device, or nothing for float32 (dtype None)."""
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def make_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW, or SGD with Nesterov momentum 0.9, at the config's learning rate and weight decay."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(
            model.parameters(), lr=config.learning_rate, momentum=0.9, nesterov=True, weight_decay=config.weight_decay
        )
    return torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)


def warmup_cosine(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A linear warm-up over the first `warmup` fraction of the steps, then a cosine decay to 0."""
    warm = round(warmup * total_steps)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total_steps - warm))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train(config: TrainConfig, run: RunDir, progress: bool = True, resume: bool = False) -> TrainResult:
    """Trains an encoder on config.data and writes config, log, skip report and checkpoints to run.

    With resume, training continues from the last saved trainer state of run (the model, optimizer,
    schedule, memory queue, random state and validation record of checkpoints/trainer.safetensors,
    written after each epoch and every config.checkpoint_every steps), and reaches the same weights
    as a run that was never interrupted. Under torchrun, each process trains on its own batches and
    the loss sees the batches of all of them; process 0 validates and writes the run directory.
    """
    ranks, device = start(config.device)
    try:
        data = prepare_data(config, run, progress and ranks.is_main, ranks)
        trainer = Trainer(config, run, data, ranks, device, progress and ranks.is_main)
        return trainer.fit(resume)
    finally:
        stop()


@dataclass
class TrainingData:
    """The readable items split into training and validation classes, and the files skipped."""

    items: list[Item]
    validation: list[Item]
    classes: list[str]
    skipped: list[Skipped]


def prepare_data(config: TrainConfig, run: RunDir, progress: bool, ranks: Ranks) -> TrainingData:
    """Checks every image once, splits off the validation classes, and writes config.json and skipped.json."""
    collection = load_training_data(config.data, config.benchmark)
    # process 0 decodes every image once; the others take its verdict rather than decoding them again
    checked = readable_items(collection.items, progress) if ranks.is_main else None
    readable, skipped = broadcast_object(checked)  # type: ignore[misc]
    skipped = collection.skipped + skipped
    items, validation = split_by_class(readable, config.val_classes, config.seed)
    classes = sorted({item.label for item in items})
    if len(classes) < 2:
        found = f"only class {classes[0]!r}" if classes else "no readable labeled image"
        raise RetrievalError(
            f"{config.data}: {found} to train on; training needs at least two labeled classes (ROOT/<label>/<image>)"
        )
    if config.val_classes > 0 and len({item.label for item in validation}) < 2:
        total = len({item.label for item in readable})
        raise RetrievalError(
            f"--val-classes {config.val_classes} holds out fewer than two of the {total} classes; raise it or use 0"
        )
    if ranks.is_main:
        run.root.mkdir(parents=True, exist_ok=True)
        write_json(run.config, config.to_dict(), sealed=True)
        write_skip_report(run.root / "skipped.json", skipped)
    return TrainingData(items, validation, classes, skipped)


def make_loader(
    data: TrainingData,
    preprocessing: Preprocessing,
    augment: str,
    sampler: ClassBalancedBatchSampler,
    workers: int,
    seed: int,
    pin_memory: bool,
) -> DataLoader:
    """The training images, decoded and augmented on access, in the sampler's batches."""
    # its own generator: starting an epoch's iterator must not draw from the augmentation's, or a run resumed
    # mid-epoch would diverge
    generator = torch.Generator().manual_seed(seed)
    images = AugmentedImages(data.items, data.classes, preprocessing, augment)
    return DataLoader(images, batch_sampler=sampler, num_workers=workers, pin_memory=pin_memory, generator=generator)


def make_average(model: nn.Module, decay: float) -> AveragedModel | None:
    """An exponential moving average of the model's weights and buffers with this decay per step (0: none)."""
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True) if decay else None


class Trainer:
    """One training run: the model, its loader, optimizer, schedule and queue, stepped epoch by epoch."""

    def __init__(
        self,
        config: TrainConfig,
        run: RunDir,
        data: TrainingData,
        ranks: Ranks,
        device: torch.device,
        progress: bool,
    ) -> None:
        torch.manual_seed(config.seed + ranks.rank)  # the only global generator used: augmentation's
        self.config, self.run, self.data = config, run, data
        self.ranks, self.device, self.progress = ranks, device, progress
        cuda = device.type == "cuda"
        self.memory_format = torch.channels_last if cuda else torch.contiguous_format
        main = ranks.is_main
        self.validator = Validator(data.validation, config.preprocessing, device) if data.validation and main else None
        self.model = Encoder.build(config.architecture, bool(config.pretrained))
        self.model.to(device, memory_format=self.memory_format)
        self.queue = MemoryQueue(self.model, config.queue_size, config.momentum) if config.queue_size else None
        self.loss_fn = make_loss(config.loss, config.temperature)
        labels = [item.label for item in data.items]
        self.sampler = ClassBalancedBatchSampler(
            labels, config.batch_size, config.images_per_class, config.seed, ranks.rank, ranks.world_size
        )
        self.loader = make_loader(
            data, config.preprocessing, str(config.augment), self.sampler, config.workers, config.seed, cuda
        )
        self.optimizer = make_optimizer(config, self.model)
        self.average = make_average(self.model, config.ema)
        self.schedule = warmup_cosine(self.optimizer, int(config.epochs) * len(self.sampler), config.warmup)
        self.dtype = autocast_dtype(config.precision, device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.dtype is torch.float16)
        self.forward = self._wrapped()
        self.state = TrainerState(
            run.trainer_state, self.model, self.optimizer, self.schedule, self.scaler, self.queue, ranks, self.average
        )
        self.board = _tensorboard(run) if config.tensorboard and main else None
        self.record = Progress()
        self.epoch_seconds: list[float] = []  # of this process's epochs: the estimate of the time left

    def _wrapped(self) -> nn.Module:
        """The encoder as the loss sees it, under DDP with several processes and compiled with --compile."""
        forward: nn.Module = _Projected(self.model)
        if self.ranks.world_size > 1:
            forward = DistributedDataParallel(
                forward, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        return torch.compile(forward) if self.config.compile else forward

    def fit(self, resume: bool) -> TrainResult:
        """Trains from the start (or from the saved trainer state) to the last epoch, or until patience runs out."""
        self._begin(resume)
        epoch_loss = float("nan")
        for epoch in range(self.record.epoch, int(self.config.epochs)):
            epoch_loss = self.epoch(epoch)
            if self.config.patience and self.record.stale_epochs >= self.config.patience:
                if self.progress:
                    say(
                        "stopping early: validation MAP@R has not improved for "
                        f"{self.record.stale_epochs} epochs (best {self.record.best_map:.3f})"
                    )
                break
        if self.board is not None:
            self.board.close()
        if self.ranks.is_main:
            plot_training_log(self.run.train_log, self.run.loss_plot)
        return TrainResult(
            self.run, len(self.data.items), len(self.data.classes), self.data.skipped, epoch_loss, self.ranks.is_main
        )

    def _begin(self, resume: bool) -> None:
        """Restores the trainer state (keeping the log up to its epoch), or clears what an earlier run left."""
        run = self.run
        if resume:
            self.record = self.state.load()
            self._refuse_finished()
            if self.ranks.is_main:
                lines = (
                    run.train_log.read_text(encoding="utf-8").splitlines()[: self.record.epoch]
                    if run.train_log.is_file()
                    else []
                )
                write_atomic(run.train_log, "".join(line + "\n" for line in lines).encode())
            if self.progress:
                say(f"resuming {run.root} at epoch {self.record.epoch + 1}, batch {self.record.batch}")
        elif self.ranks.is_main:
            run.train_log.unlink(missing_ok=True)
            # a best checkpoint of an earlier run would be taken for this one's
            run.best_checkpoint.unlink(missing_ok=True)

    def _refuse_finished(self) -> None:
        """A resumed run with nothing left to do (all epochs, or stopped early) says so instead of training nothing."""
        record, epochs, patience = self.record, int(self.config.epochs), self.config.patience
        if record.epoch >= epochs or (patience and record.stale_epochs >= patience):
            raise RetrievalError(
                f"{self.run.root} is finished ({record.epoch} of {epochs} epochs trained): nothing to resume; "
                f"export it with `retrieval export {self.run.root}`, or train more in a new run"
            )

    def epoch(self, epoch: int) -> float:
        """One pass over the batches, then checkpoint, validation, log and trainer state; returns the loss."""
        config, record = self.config, self.record
        self.sampler.set_epoch(epoch, skip=record.batch)
        self.model.train()
        started, seen = time.perf_counter(), 0
        bar = progress_bar(
            self.loader, desc=f"epoch {epoch + 1}/{config.epochs}", unit="batch", enabled=self.progress, leave=False
        )
        for images, labels in bar:
            value, lr, count = self.step(images, labels)
            seen += count
            bar.set_postfix(loss=f"{value:.4f}", lr=f"{lr:.2e}", img_s=f"{seen / (time.perf_counter() - started):.0f}")
            every = config.checkpoint_every
            if every and record.step % every == 0 and record.batch < self.sampler.num_batches:
                self.state.save(record)
        seconds = time.perf_counter() - started
        entry = {
            "epoch": epoch + 1,
            "step": record.step,
            "loss": float(np.mean(record.losses)),
            "lr": self.schedule.get_last_lr()[0],
            "seconds": round(seconds, 2),
            "images_per_second": round(seen / seconds, 1),
        }
        record.epoch, record.batch, record.losses = epoch + 1, 0, []
        if self.ranks.is_main:
            self._finish_epoch(entry)
        # the validation record is process 0's
        self.record = record = Progress.from_dict(broadcast_object(record.to_dict()))  # type: ignore[arg-type]
        self.state.save(record)
        if self.progress:
            self._report(entry, seconds)
        return entry["loss"]

    def _report(self, entry: dict, seconds: float) -> None:
        """The epoch's line: loss, validation, time and the time left."""
        epochs = int(self.config.epochs)
        validated = (
            f"  val recall@1 {entry['val_recall@1']:.3f} MAP@R {entry['val_map@r']:.3f}" if self.validator else ""
        )
        self.epoch_seconds.append(seconds)
        left = float(np.mean(self.epoch_seconds)) * (epochs - entry["epoch"])
        remaining = f", about {_duration(left)} left" if entry["epoch"] < epochs else ""
        say(
            f"epoch {entry['epoch']}/{epochs}  loss {entry['loss']:.4f}{validated} "
            f" ({seconds:.1f}s, {entry['images_per_second']:.0f} img/s{remaining})"
        )

    def step(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[float, float, int]:
        """One optimisation step on a batch; returns the loss, the learning rate and the images seen (all processes)."""
        queue, record = self.queue, self.record
        images = images.to(self.device, memory_format=self.memory_format, non_blocking=True)
        labels = gather_rows(labels.to(self.device, non_blocking=True))
        with autocast(self.device, self.dtype):
            queries = self.forward(images)
            keys = queue.encode(images) if queue is not None else None
        queries = gather_rows(queries.float())
        if queue is not None:
            loss = self.loss_fn(queries, labels, *queue.contents())
            queue.push(gather_rows(keys), labels)
        else:
            loss = self.loss_fn(queries, labels)
        self._optimise(loss)
        if queue is not None:
            queue.follow(self.model)
        if self.average is not None:
            self.average.update_parameters(self.model)
        value, lr = loss.item(), self.schedule.get_last_lr()[0]
        record.losses.append(value)
        record.step += 1
        record.batch += 1
        if self.board is not None:
            self.board.add_scalar("train/loss", value, record.step)
            self.board.add_scalar("train/lr", lr, record.step)
        return value, lr, len(labels)

    def _optimise(self, loss: torch.Tensor) -> None:
        """The backward pass and the optimizer's and schedule's step (loss scaling, gradient clipping)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.config.clip_grad:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.schedule.step()

    @property
    def exported(self) -> Encoder:
        """The weights that are checkpointed, validated and exported: their moving average with --ema."""
        return self.average.module if self.average is not None else self.model  # type: ignore[return-value]

    def _finish_epoch(self, entry: dict) -> None:
        """Process 0: the last (and best) checkpoint, validation, the log line and TensorBoard's scalars."""
        run, record, model = self.run, self.record, self.exported
        metadata = {"epoch": str(entry["epoch"]), "step": str(record.step)}
        save_checkpoint(run.last_checkpoint, model, metadata)
        if self.validator is not None:
            scores = self.validator(model)
            entry.update({f"val_{name}": value for name, value in scores.items() if name in VALIDATION_KEYS})
            if scores["map@r"] > record.best_map:
                record.best_map, record.stale_epochs = scores["map@r"], 0
                save_checkpoint(run.best_checkpoint, model, metadata)
            else:
                record.stale_epochs += 1
        with run.train_log.open("a", encoding="utf-8") as log:
            log.write(json.dumps(entry) + "\n")
        if self.board is not None:
            for name, value in entry.items():
                if name.startswith("val_"):
                    self.board.add_scalar(f"val/{name.removeprefix('val_')}", value, entry["epoch"])


def _duration(seconds: float) -> str:
    """A time left as people say it: 40 s, 3 min, 1 h 5 min."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds // 3600:.0f} h {seconds % 3600 / 60:.0f} min"


def _tensorboard(run: RunDir) -> object:
    require("tensorboard", "tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(run.root / "tensorboard"))
