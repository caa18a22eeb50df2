"""The training loop: class-balanced batches, a contrastive loss, checkpoints after every epoch.

`train` prepares the data (training.inputs: checked once, the mode decided, held-out classes split
off), then a `Trainer` holds the model, loader, optimizer, schedule, memory queue or bank and runs
epochs of steps: the supervised loss on class-balanced batches, the self-supervised one
(training.selfsup) on two views of each pool image, or both, weighted (--ssl-weight); checkpoints
and the resumable trainer state are training.checkpoints', validation training.validation's.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader

from retrieval.data import Skipped
from retrieval.errors import RetrievalError
from retrieval.extras import require
from retrieval.plots import plot_training_log
from retrieval.progress import progress as progress_bar
from retrieval.progress import say
from retrieval.runs import RunDir, folder_lock, shell_path, write_atomic
from training.checkpoints import Progress, TrainerState, save_checkpoint
from training.config import SELF_SUPERVISED, TrainConfig, refuse_unused
from training.distributed import Ranks, broadcast_object, gather_rows, start, stop
from training.images import VIEWS, AugmentedImages, Batch, ViewedImages, collate
from training.inputs import TrainingData, prepare_data, write_inputs
from training.losses import make_loss
from training.memory import MemoryQueue
from training.model import Encoder
from training.samplers import ClassBalancedBatchSampler, InstanceBatchSampler, MixedBatchSampler
from training.selfsup import JOINT, JointObjective, Objectives, make_objective
from training.validation import VALIDATION_KEYS, Validator

Batches = ClassBalancedBatchSampler | InstanceBatchSampler | MixedBatchSampler


OUT_OF_MEMORY = re.compile(r"can't allocate memory|out of memory", re.IGNORECASE)  # torch's CPU and CUDA words


@dataclass
class TrainResult:
    """What a finished run produced."""

    run: RunDir
    num_images: int  # labeled images the supervised loss trained on
    num_classes: int
    skipped: list[Skipped]
    final_loss: float
    reporting: bool = True  # False in the torchrun processes other than process 0, which reports for all
    mode: str = "supervised"  # training.config.MODES
    pool: int = 0  # images of the self-supervised loss

    def describe(self) -> str:
        """What was trained on, in a few words."""
        if self.mode == SELF_SUPERVISED:
            return f"trained self-supervised on {self.pool} images"
        own = f"trained on {self.num_images} images of {self.num_classes} classes"
        return own + (f", self-supervised on {self.pool} images ({self.mode})" if self.pool else "")


def refuse_finished(run: RunDir, record: Progress, config: TrainConfig) -> None:
    """A resumed run with nothing left to do (all epochs, or stopped early) says so instead of training nothing."""
    epochs, patience = int(config.epochs), config.patience
    if record.epoch >= epochs or (patience and record.stale_epochs >= patience):
        raise RetrievalError(
            f"{run.root} is finished ({record.epoch} of {epochs} epochs trained): nothing to resume; "
            f"export it with `retrieval export {shell_path(run.root)}`, or train more in a new run"
        )


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


def train(
    config: TrainConfig, run: RunDir | str | Path, progress: bool = True, resume: bool = False, overwrite: bool = False
) -> TrainResult:
    """Trains an encoder on config.data and writes config, log, skip report and checkpoints to run; a run that holds
    a trained run is continued (resume) or started over (overwrite), never replaced silently.

    With resume, training continues from the last saved trainer state of run (the model, optimizer,
    schedule, memory queue, random state and validation record of checkpoints/trainer.safetensors,
    written after each epoch and every config.checkpoint_every steps), and reaches the same weights
    as a run that was never interrupted. Under torchrun, each process trains on its own batches and
    the loss sees the batches of all of them; process 0 validates and writes the run directory.
    """
    if not isinstance(config, TrainConfig):  # a dict failed in "'dict' object has no attribute 'device'"
        raise RetrievalError(
            f"config: a TrainConfig, not a {type(config).__name__}; write TrainConfig(data=..., epochs=...)"
            + (" or TrainConfig(**values)" if isinstance(config, dict) else "")
        )
    run = RunDir.of(run)
    run.refuse_foreign_folder()
    if not (resume or overwrite):
        run.refuse_trained()
    ranks, device = start(config.device)
    try:
        with training_lock(run) if ranks.is_main else contextlib.nullcontext():
            data = prepare_data(config, progress and ranks.is_main, ranks)
            if not resume:
                refuse_unused(data.config)
            trainer = Trainer(data.config, run, data, ranks, device, progress and ranks.is_main)
            if ranks.is_main:
                write_inputs(run, data)
            return trainer.fit(resume)
    except (MemoryError, RuntimeError) as error:  # torch's CPU allocator and CUDA raise RuntimeErrors
        if not isinstance(error, MemoryError) and not OUT_OF_MEMORY.search(str(error)):
            raise
        raise _out_of_memory(error, config) from None
    finally:
        stop()


def _out_of_memory(error: BaseException, config: TrainConfig) -> RetrievalError:
    """One line for a model or batch that does not fit (train, the demo, analyze, --folds alike): how much was asked
    for, and the options that shrink it."""
    asked = re.search(r"allocate (\d+) bytes|allocate ([\d.]+ [KMGT]iB)", str(error))
    size = ""
    if asked:
        size = f" (it asked for {int(asked.group(1)) / 2**30:.1f} GiB)" if asked.group(1) else f" ({asked.group(2)})"
    dim = config.embedding_dim or "the backbone's width"
    return RetrievalError(
        f"out of memory while training{size}; lower --batch-size ({config.batch_size}), --image-size "
        f"({config.image_size}) or --embedding-dim ({dim}); what the run saved before is kept"
    )


def training_lock(run: RunDir) -> contextlib.AbstractContextManager[None]:
    """One trainer per run directory: a second (a `make demo` in another terminal, a --resume while the run trains)
    would write the same checkpoints and log every epoch twice."""
    busy = (
        f"{run.root}: another process is training this run; wait for it to end, or stop it (Ctrl+C there) and "
        f"continue with `retrieval train --run {shell_path(run.root)} --resume`"
    )
    return folder_lock(run.root, "--run", busy)


def make_batches(config: TrainConfig, data: TrainingData, ranks: Ranks, pin_memory: bool) -> tuple[Batches, DataLoader]:
    """The sampler and loader of the run's mode: class-balanced batches of labeled images, batches of pool images
    (two views each), or both at once."""
    # its own generator: starting an epoch's iterator must not draw from the augmentation's, or a run resumed
    # mid-epoch would diverge
    generator = torch.Generator().manual_seed(config.seed)
    loading = {"num_workers": config.workers, "pin_memory": pin_memory, "generator": generator}
    preprocessing = config.preprocessing
    labeled = AugmentedImages(data.items, data.classes, preprocessing, str(config.augment)) if data.items else None
    balanced = (
        ClassBalancedBatchSampler(
            [item.label for item in data.items],
            config.batch_size,
            config.images_per_class,
            config.seed,
            ranks.rank,
            ranks.world_size,
        )
        if data.items
        else None
    )
    if not data.pool:
        return balanced, DataLoader(labeled, batch_sampler=balanced, **loading)  # type: ignore[arg-type,return-value]
    if balanced is not None:
        extra = config.ssl_batch or config.batch_size // 2
        sampler: Batches = MixedBatchSampler(balanced, len(data.items), len(data.pool), extra, config.seed)
    else:
        sampler = InstanceBatchSampler(len(data.pool), config.batch_size, config.seed, ranks.rank, ranks.world_size)
    images = ViewedImages(labeled, data.pool, preprocessing, str(config.ssl_augment))
    return sampler, DataLoader(images, batch_sampler=sampler, collate_fn=collate, **loading)


def make_average(model: nn.Module, decay: float) -> AveragedModel | None:
    """An exponential moving average of the model's weights and buffers with this decay per step (0: none)."""
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True) if decay else None


class Trainer:
    """One training run: the model, its loader, optimizer, schedule and queue or bank, stepped epoch by epoch."""

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
        supervised = config.mode != SELF_SUPERVISED
        self.loss_fn = make_loss(str(config.loss), float(config.temperature)) if supervised else None
        made = self._self_supervised()
        self.objective, self.queue, self.bank = made.objective, made.queue, made.bank
        self.sampler, self.loader = make_batches(config, data, ranks, cuda)
        self.optimizer = make_optimizer(config, self.model)
        self.average = make_average(self.model, config.ema)
        self.schedule = warmup_cosine(self.optimizer, int(config.epochs) * len(self.sampler), config.warmup)
        self.dtype = autocast_dtype(config.precision, device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.dtype is torch.float16)
        self.forward = self._wrapped()
        self.state = TrainerState(
            run.trainer_state, self.model, self.optimizer, self.schedule, self.scaler, self.queue, ranks, self.average
        )
        self.state.bank = self.bank
        self.board = _tensorboard(run) if config.tensorboard and main else None
        self.record = Progress()
        self.epoch_seconds: list[float] = []  # of this process's epochs: the estimate of the time left

    def _self_supervised(self) -> Objectives:
        """The self-supervised objective and the queue (MoCo's, or the supervised loss's) or bank it keeps."""
        config, model = self.config, self.model
        method = config.ssl_method
        if method is None:
            queue = MemoryQueue(model, config.queue_size, config.momentum) if config.queue_size else None
            return Objectives(None, queue=queue)
        if method == JOINT:  # the supervised loss itself, over both kinds of image
            assert self.loss_fn is not None
            return Objectives(JointObjective(self.loss_fn, len(self.data.classes)))
        temperature = config.temperature if config.mode == SELF_SUPERVISED else config.ssl_temperature
        return make_objective(
            method,
            float(temperature),
            model,
            len(self.data.pool),
            config.queue_size,
            config.momentum,
            config.bank_momentum,
            config.nce_negatives,
            config.proximal,
        )

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
        data = self.data
        return TrainResult(
            self.run,
            len(data.items),
            len(data.classes),
            data.skipped,
            epoch_loss,
            self.ranks.is_main,
            str(self.config.mode),
            len(data.pool),
        )

    def _begin(self, resume: bool) -> None:
        """Restores the trainer state (keeping the log up to its epoch), or clears what an earlier run left."""
        run = self.run
        if resume:
            self.record = self.state.load()
            refuse_finished(run, self.record, self.config)
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

    def epoch(self, epoch: int) -> float:
        """One pass over the batches, then checkpoint, validation, log and trainer state; returns the loss."""
        config, record = self.config, self.record
        self.sampler.set_epoch(epoch, skip=record.batch)
        self.model.train()
        started, seen = time.perf_counter(), 0
        bar = progress_bar(
            self.loader, desc=f"epoch {epoch + 1}/{config.epochs}", unit="batch", enabled=self.progress, leave=False
        )
        for batch in bar:
            value, lr, count = self.step(batch) if isinstance(batch, Batch) else self.step_supervised(*batch)
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

    def step_supervised(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[float, float, int]:
        """One optimisation step on a batch; returns the loss, the learning rate and the images seen (all processes)."""
        queue = self.queue
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
        return self._stepped(loss, len(labels))

    def step(self, batch: Batch) -> tuple[float, float, int]:
        """One step on a batch with a self-supervised part: the supervised loss on its labeled images (if any) and,
        weighted, the self-supervised one on its pool images' two views (joint: one loss over both); returns as
        step_supervised."""
        assert self.objective is not None
        labeled = batch.images.to(self.device, memory_format=self.memory_format, non_blocking=True)
        views = batch.views.to(self.device, non_blocking=True)
        flat = views.flatten(0, 1).contiguous(memory_format=self.memory_format)
        with autocast(self.device, self.dtype):
            z = self.forward(torch.cat([labeled, flat]) if len(labeled) else flat)
            keys = self.objective.encode(views)
        z = z.float()
        instances = gather_rows(batch.instances.to(self.device, non_blocking=True))
        pooled = gather_rows(z[len(labeled) :]).view(len(instances), VIEWS, -1)
        if not len(labeled):
            loss = self.objective.loss(pooled, instances, keys)
        else:
            labels = gather_rows(batch.labels.to(self.device, non_blocking=True))
            supervised = gather_rows(z[: len(labeled)])
            if isinstance(self.objective, JointObjective):
                loss = self.objective.loss(pooled, instances, keys, (supervised, labels))
            else:
                own = self.objective.loss(pooled, instances, keys)
                loss = self.loss_fn(supervised, labels) + self.config.ssl_weight * own  # type: ignore[misc]
        self._optimise(loss)
        self.objective.follow(self.model)
        return self._stepped(loss, (len(batch.labels) + len(batch.instances)) * self.ranks.world_size)

    def _stepped(self, loss: torch.Tensor, images: int) -> tuple[float, float, int]:
        """After a step: the weight average, the record, TensorBoard; the loss, learning rate and images seen."""
        record = self.record
        if self.average is not None:
            self.average.update_parameters(self.model)
        value, lr = loss.item(), self.schedule.get_last_lr()[0]
        record.losses.append(value)
        record.step += 1
        record.batch += 1
        if self.board is not None:
            self.board.add_scalar("train/loss", value, record.step)
            self.board.add_scalar("train/lr", lr, record.step)
        return value, lr, images

    def _optimise(self, loss: torch.Tensor) -> None:
        """The backward pass and the optimizer's and schedule's step (loss scaling, gradient clipping)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.config.clip_grad:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        with warnings.catch_warnings():  # fp16's scaler skips a step whose gradients overflow (the first ones, as it
            # finds its scale); the schedule counts every step all the same, as a resumed run does: PyTorch's warning
            # that the optimizer did not step first is not for this
            warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"), UserWarning)
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
