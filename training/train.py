"""The training loop: class-balanced batches, a contrastive loss, atomic safetensors checkpoints."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from retrieval.benchmarks import load_training_data
from retrieval.data import Item, Skipped, load_image, split_by_class, write_skip_report
from retrieval.errors import ImageError, RetrievalError
from retrieval.extras import require
from retrieval.metrics import embedding_diagnostics, retrieval_metrics
from retrieval.plots import plot_training_log
from retrieval.preprocess import Preprocessing
from retrieval.runs import RunDir, read_json, write_atomic, write_json
from training import distributed
from training.augment import make_augmentation
from training.config import TrainConfig
from training.losses import make_loss
from training.memory import MemoryQueue
from training.model import Encoder
from training.samplers import ClassBalancedBatchSampler


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

    def __init__(self, items: Sequence[Item], classes: Sequence[str], preprocessing: Preprocessing, augment: str) -> None:
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
    for item in tqdm(items, desc="checking images", unit="img", disable=not progress):
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


class Validator:
    """Leave-one-out recall@1 and MAP@R, alignment, uniformity and tolerance on held-out classes."""

    def __init__(self, items: Sequence[Item], preprocessing: Preprocessing, device: torch.device) -> None:
        self.labels = [item.label for item in items]
        self.images = torch.from_numpy(preprocessing([load_image(item.path) for item in items]))
        self.device = device

    def __call__(self, model: Encoder) -> dict:
        """Scores the embeddings; the diagnostics also of the projections the loss sees (prefixed loss_)."""
        model.eval()
        with torch.no_grad():
            batches = [model.embed_and_project(self.images[i : i + 256].to(self.device)) for i in range(0, len(self.images), 256)]
        model.train()
        vectors = torch.cat([embedded for embedded, _ in batches]).float().cpu().numpy()
        projections = torch.cat([projected for _, projected in batches]).float().cpu().numpy()
        scores = {**retrieval_metrics(vectors, self.labels, ks=(1,)), **embedding_diagnostics(vectors, self.labels)}
        scores.update({f"loss_{name}": value for name, value in embedding_diagnostics(projections, self.labels).items()})
        return scores


class _Projected(nn.Module):
    """The encoder as the loss sees it (its projection head's output), for DDP and torch.compile to wrap."""

    def __init__(self, encoder: Encoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.encoder.project(images)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of --precision (None: float32); auto is bf16 on a GPU that has it."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """Mixed precision in dtype on device, or nothing for float32 (dtype None)."""
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def make_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """AdamW, or SGD with Nesterov momentum 0.9, at the config's learning rate and weight decay."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=config.learning_rate, momentum=0.9, nesterov=True, weight_decay=config.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup: float) -> torch.optim.lr_scheduler.LambdaLR:
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
    ranks, device = distributed.start(config.device)
    try:
        return _train(config, run, progress and ranks.is_main, resume, ranks, device)
    finally:
        distributed.stop()


def _train(config: TrainConfig, run: RunDir, progress: bool, resume: bool, ranks: distributed.Ranks, device: torch.device) -> TrainResult:
    collection = load_training_data(config.data, config.benchmark)
    # process 0 decodes every image once; the others take its verdict rather than decoding them again
    checked = readable_items(collection.items, progress) if ranks.is_main else None
    readable, skipped = distributed.broadcast_object(checked)  # type: ignore[misc]
    skipped = collection.skipped + skipped
    items, validation = split_by_class(readable, config.val_classes, config.seed)
    classes = sorted({item.label for item in items})
    if len(classes) < 2:
        found = f"only class {classes[0]!r}" if classes else "no readable labeled image"
        raise RetrievalError(f"{config.data}: {found} to train on; training needs at least two labeled classes (ROOT/<label>/<image>)")
    if config.val_classes > 0 and len({item.label for item in validation}) < 2:
        total = len({item.label for item in readable})
        raise RetrievalError(f"--val-classes {config.val_classes} holds out fewer than two of the {total} classes; raise it or use 0")
    torch.manual_seed(config.seed + ranks.rank)  # the only global generator used: augmentation; sampler and split seed their own

    if ranks.is_main:
        run.root.mkdir(parents=True, exist_ok=True)
        write_json(run.config, config.to_dict(), sealed=True)
        write_skip_report(run.root / "skipped.json", skipped)
    validator = Validator(validation, config.preprocessing, device) if validation and ranks.is_main else None
    cuda = device.type == "cuda"
    memory_format = torch.channels_last if cuda else torch.contiguous_format

    model = Encoder(config.backbone, config.embedding_dim, config.pretrained, config.image_size, config.stem).to(device, memory_format=memory_format)
    queue = MemoryQueue(model, config.queue_size, config.momentum) if config.queue_size else None
    loss_fn = make_loss(config.loss, config.temperature)
    sampler = ClassBalancedBatchSampler([item.label for item in items], config.batch_size, config.images_per_class, config.seed, ranks.rank, ranks.world_size)
    # its own generator: starting an epoch's iterator must not draw from the augmentation's, or a run resumed mid-epoch would diverge
    generator = torch.Generator().manual_seed(config.seed)
    loader = DataLoader(AugmentedImages(items, classes, config.preprocessing, config.augment), batch_sampler=sampler, num_workers=config.workers, pin_memory=cuda, generator=generator)
    optimizer = make_optimizer(config, model)
    schedule = warmup_cosine(optimizer, config.epochs * len(sampler), config.warmup)
    dtype = autocast_dtype(config.precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)
    forward: nn.Module = _Projected(model)
    if ranks.world_size > 1:
        forward = DistributedDataParallel(forward, device_ids=[device.index] if cuda else None)
    if config.compile:
        forward = torch.compile(forward)
    state = TrainerState(run.trainer_state, model, optimizer, schedule, scaler, queue, ranks)
    record = {"epoch": 0, "batch": 0, "step": 0, "losses": [], "best_map": -1.0, "stale_epochs": 0}
    if resume:
        record = state.load()
        if ranks.is_main:
            lines = run.train_log.read_text(encoding="utf-8").splitlines()[: record["epoch"]] if run.train_log.is_file() else []
            write_atomic(run.train_log, "".join(line + "\n" for line in lines).encode())
        if progress:
            tqdm.write(f"resuming {run.root} at epoch {record['epoch'] + 1}, batch {record['batch']}")
    elif ranks.is_main:
        run.train_log.unlink(missing_ok=True)
        run.best_checkpoint.unlink(missing_ok=True)  # a best checkpoint of an earlier run would be taken for this one's
    board = _tensorboard(run) if config.tensorboard and ranks.is_main else None
    epoch_loss = float("nan")
    for epoch in range(record["epoch"], config.epochs):
        sampler.set_epoch(epoch, skip=record["batch"])
        model.train()
        started, seen = time.perf_counter(), 0
        bar = tqdm(loader, desc=f"epoch {epoch + 1}/{config.epochs}", unit="batch", disable=not progress, leave=False)
        for images, labels in bar:
            images = images.to(device, memory_format=memory_format, non_blocking=True)
            labels = distributed.gather_rows(labels.to(device, non_blocking=True))
            with autocast(device, dtype):
                queries = forward(images)
                keys = queue.encode(images) if queue is not None else None
            queries = distributed.gather_rows(queries.float())
            if queue is not None:
                loss = loss_fn(queries, labels, *queue.contents())
                queue.push(distributed.gather_rows(keys), labels)
            else:
                loss = loss_fn(queries, labels)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if config.clip_grad:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad)
            scaler.step(optimizer)
            scaler.update()
            schedule.step()
            if queue is not None:
                queue.follow(model)
            value, lr = loss.item(), schedule.get_last_lr()[0]
            record["losses"].append(value)
            record["step"] += 1
            record["batch"] += 1
            seen += len(labels)
            bar.set_postfix(loss=f"{value:.4f}", lr=f"{lr:.2e}", img_s=f"{seen / (time.perf_counter() - started):.0f}")
            if board is not None:
                board.add_scalar("train/loss", value, record["step"])
                board.add_scalar("train/lr", lr, record["step"])
            if config.checkpoint_every and record["step"] % config.checkpoint_every == 0 and record["batch"] < sampler.num_batches:
                state.save(record)
        epoch_loss = float(np.mean(record["losses"]))
        seconds = time.perf_counter() - started
        entry = {"epoch": epoch + 1, "step": record["step"], "loss": epoch_loss, "lr": schedule.get_last_lr()[0], "seconds": round(seconds, 2), "images_per_second": round(seen / seconds, 1)}
        record.update(epoch=epoch + 1, batch=0, losses=[])
        if ranks.is_main:
            metadata = {"epoch": str(epoch + 1), "step": str(record["step"])}
            save_checkpoint(run.last_checkpoint, model, metadata)
            if validator is not None:
                scores = validator(model)
                entry.update({f"val_{name}": value for name, value in scores.items() if name in VALIDATION_KEYS})
                if scores["map@r"] > record["best_map"]:
                    record.update(best_map=scores["map@r"], stale_epochs=0)
                    save_checkpoint(run.best_checkpoint, model, metadata)
                else:
                    record["stale_epochs"] += 1
            with run.train_log.open("a", encoding="utf-8") as log:
                log.write(json.dumps(entry) + "\n")
            if board is not None:
                for name, value in entry.items():
                    if name.startswith("val_"):
                        board.add_scalar(f"val/{name.removeprefix('val_')}", value, epoch + 1)
        record = distributed.broadcast_object(record)  # the validation record is process 0's
        state.save(record)
        if progress:
            validated = f"  val recall@1 {entry['val_recall@1']:.3f} MAP@R {entry['val_map@r']:.3f}" if validator else ""
            tqdm.write(f"epoch {epoch + 1}/{config.epochs}  loss {epoch_loss:.4f}{validated}  ({seconds:.1f}s, {entry['images_per_second']:.0f} img/s)")
        if config.patience and record["stale_epochs"] >= config.patience:
            if progress:
                tqdm.write(f"stopping early: validation MAP@R has not improved for {record['stale_epochs']} epochs (best {record['best_map']:.3f})")
            break
    if board is not None:
        board.close()
    if ranks.is_main:
        plot_training_log(run.train_log, run.loss_plot)
    return TrainResult(run, len(items), len(classes), skipped, epoch_loss, ranks.is_main)


VALIDATION_KEYS = ("recall@1", "map@r", "alignment", "uniformity", "tolerance", "loss_alignment", "loss_uniformity", "loss_tolerance")


def _tensorboard(run: RunDir) -> object:
    require("tensorboard", "tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(run.root / "tensorboard"))


def _weights(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    return {f"{prefix}{name}": tensor.detach().cpu().contiguous() for name, tensor in model.state_dict().items()}


def _prefixed(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors whose names start with prefix, under their names without it (the inverse of _weights' prefix)."""
    return {name.removeprefix(prefix): tensor for name, tensor in tensors.items() if name.startswith(prefix)}


DATA_SHA256 = "data_sha256"  # safetensors metadata key: the sha256 of the file's tensor bytes


def sealed_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """Serialises tensors as safetensors whose metadata holds the sha256 of the tensor bytes.

    The tensor bytes do not depend on the header, so they are serialised once to hash them and
    once more with the hash; read_sealed then refuses a file with any flipped or missing byte.
    """
    digest = hashlib.sha256(_tensor_bytes(save_safetensors(tensors, metadata=metadata))).hexdigest()
    return save_safetensors(tensors, metadata={**metadata, DATA_SHA256: digest})


def read_sealed(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Returns a sealed safetensors file's tensors and metadata, or raises RetrievalError naming what is wrong."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise RetrievalError(f"{path}: cannot be read ({error.strerror})") from None
    try:
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        metadata = dict(header.get("__metadata__") or {})
    except (ValueError, UnicodeDecodeError, AttributeError):
        raise RetrievalError(f"{path}: not a safetensors file (its header is damaged)") from None
    expected = metadata.pop(DATA_SHA256, None)
    if expected is None:
        raise RetrievalError(f"{path}: has no {DATA_SHA256} (damaged, or written by an older version); retrain the run")
    if hashlib.sha256(_tensor_bytes(data)).hexdigest() != expected:
        raise RetrievalError(f"{path}: its tensor bytes do not match their sha256 (the file is truncated or damaged); retrain, or resume from an intact copy")
    try:
        tensors = load_safetensors(data)
    except Exception as error:  # safetensors raises several untyped errors for a damaged header
        raise RetrievalError(f"{path}: not a readable safetensors file ({str(error).splitlines()[0]})") from None
    return tensors, metadata


def _tensor_bytes(data: bytes) -> bytes:
    return data[8 + int.from_bytes(data[:8], "little") :]


def save_checkpoint(path: Path, model: torch.nn.Module, metadata: dict[str, str]) -> None:
    """Writes the model's weights as sealed safetensors, atomically."""
    write_atomic(path, sealed_safetensors(_weights(model), metadata))


class TrainerState:
    """Everything a resumed run needs, in one safetensors file written atomically by process 0.

    Tensors: the model's weights, the optimizer's per-parameter state, the memory queue and its key
    encoder, and every process's torch random state; metadata (JSON): the progress record, the
    optimizer's parameter groups and the schedule's, loss scaler's and queue's counters.
    """

    def __init__(
        self,
        path: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler,
        queue: MemoryQueue | None,
        ranks: distributed.Ranks,
    ) -> None:
        self.path, self.model, self.optimizer, self.schedule, self.scaler, self.queue, self.ranks = path, model, optimizer, schedule, scaler, queue, ranks

    def save(self, record: dict) -> None:
        """Writes the state after record's step (a collective call: every process must make it)."""
        random_states = distributed.gather_objects(torch.get_rng_state())
        if not self.ranks.is_main:
            return
        tensors = _weights(self.model, prefix="model/")
        optimizer_state = self.optimizer.state_dict()
        for index, values in optimizer_state["state"].items():
            for name, value in values.items():
                tensors[f"optimizer/{index}/{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
        for rank, random_state in enumerate(random_states):
            tensors[f"rng/torch/{rank}"] = random_state
        metadata = {
            "record": json.dumps(record),
            "param_groups": json.dumps(optimizer_state["param_groups"]),
            "schedule": json.dumps(self.schedule.state_dict()),
            "scaler": json.dumps(self.scaler.state_dict()),
        }
        if self.queue is not None:
            queue_tensors, counters = self.queue.state()
            tensors.update({f"queue/{name}": t for name, t in queue_tensors.items()})
            tensors.update(_weights(self.queue.encoder, prefix="queue/encoder/"))
            metadata["queue"] = json.dumps(counters)
        write_atomic(self.path, sealed_safetensors(tensors, metadata))

    def load(self) -> dict:
        """Restores the state into the model, optimizer, schedule, scaler and queue; returns the record."""
        if not self.path.is_file():
            raise RetrievalError(f"{self.path}: nothing to resume (no trainer state); start the run without --resume")
        tensors, metadata = read_sealed(self.path)
        try:
            saved_ranks = sum(name.startswith("rng/torch/") for name in tensors)
            if saved_ranks != self.ranks.world_size:
                raise RetrievalError(f"{self.path}: saved by {saved_ranks} training processes; resume it with as many, not {self.ranks.world_size}")
            self.model.load_state_dict(_prefixed(tensors, "model/"))
            state: dict[int, dict[str, torch.Tensor]] = {}
            for name, tensor in _prefixed(tensors, "optimizer/").items():
                index, key = name.split("/", 1)
                state.setdefault(int(index), {})[key] = tensor
            self.optimizer.load_state_dict({"state": state, "param_groups": json.loads(metadata["param_groups"])})
            self.schedule.load_state_dict(json.loads(metadata["schedule"]))
            self.scaler.load_state_dict(json.loads(metadata["scaler"]))
            if self.queue is not None:
                if "queue" not in metadata:
                    raise RetrievalError(f"{self.path}: saved without a memory queue, but the run has --queue-size")
                self.queue.encoder.load_state_dict(_prefixed(tensors, "queue/encoder/"))
                self.queue.load_state(_prefixed(tensors, "queue/"), json.loads(metadata["queue"]))
            torch.set_rng_state(tensors[f"rng/torch/{self.ranks.rank}"])
            return json.loads(metadata["record"])
        except RetrievalError:
            raise
        except Exception as error:  # safetensors, torch and json raise several untyped errors for a damaged file
            raise RetrievalError(f"{self.path}: cannot resume from it ({str(error).splitlines()[0]}); start the run again without --resume") from None


def load_encoder(run: RunDir) -> tuple[Encoder, TrainConfig]:
    """Rebuilds the run's encoder from config.json and its best (else last) checkpoint (no unpickling)."""
    checkpoint = run.require_checkpoint()
    config = TrainConfig.from_dict(read_json(run.config))
    model = Encoder(config.backbone, config.embedding_dim, image_size=config.image_size, stem=config.stem)
    state, _ = read_sealed(checkpoint)
    try:
        model.load_state_dict(state)
    except Exception as error:  # safetensors and load_state_dict raise several untyped errors
        raise RetrievalError(f"{checkpoint}: not a checkpoint of this encoder ({str(error).splitlines()[0]}); retrain the run") from None
    return model.eval(), config
