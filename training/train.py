"""The training loop: class-balanced batches, a contrastive loss, atomic safetensors checkpoints."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2
from tqdm import tqdm

from retrieval.data import Item, Skipped, load_collection, load_image, split_by_class, write_skip_report
from retrieval.errors import ImageError, RetrievalError
from retrieval.metrics import retrieval_metrics
from retrieval.plots import plot_training_log
from retrieval.preprocess import Preprocessing
from retrieval.runs import RunDir, read_json, write_atomic, write_json
from training.config import TrainConfig
from training.losses import make_loss
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


class AugmentedImages(Dataset):
    """Items decoded on access, augmented, then put through the shared evaluation preprocessing."""

    def __init__(self, items: Sequence[Item], classes: Sequence[str], preprocessing: Preprocessing) -> None:
        self.items = list(items)
        codes = {label: code for code, label in enumerate(classes)}
        self.codes = [codes[item.label] for item in self.items]
        self.preprocessing = preprocessing
        size = preprocessing.image_size
        # Cross-style retrieval: the same concept in other colours, line weights and framings.
        # No flips: some classes are mirror images of each other.
        self.augment = v2.Compose(
            [
                v2.RandomResizedCrop(size, scale=(0.7, 1.0), ratio=(0.9, 1.1), antialias=True),
                v2.RandomApply([v2.ColorJitter(0.2, 0.2, 0.2, 0.05)], p=0.5),
            ]
        )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image: Image.Image = self.augment(load_image(self.items[index].path))
        return torch.from_numpy(self.preprocessing.normalise(image)), self.codes[index]


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
    """Leave-one-out recall@1 and MAP@R of the model on held-out classes (images decoded once)."""

    def __init__(self, items: Sequence[Item], preprocessing: Preprocessing, device: torch.device) -> None:
        self.labels = [item.label for item in items]
        self.images = torch.from_numpy(preprocessing([load_image(item.path) for item in items]))
        self.device = device

    def __call__(self, model: Encoder) -> dict:
        model.eval()
        with torch.no_grad():
            vectors = torch.cat([model(self.images[i : i + 256].to(self.device)).cpu() for i in range(0, len(self.images), 256)])
        model.train()
        return retrieval_metrics(vectors.numpy(), self.labels, ks=(1,))


def resolve_device(name: str) -> torch.device:
    """Returns the torch device for auto|cpu|cuda, refusing cuda where there is none."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RetrievalError(f"--device {name}: no CUDA device is available here; use --device cpu or auto")
    return torch.device(name)


def train(config: TrainConfig, run: RunDir, progress: bool = True, resume: bool = False) -> TrainResult:
    """Trains an encoder on config.data and writes config, log, skip report and checkpoints to run.

    With resume, training continues after the last finished epoch of run (the model, optimizer,
    schedule, random state and validation record come from checkpoints/trainer.safetensors), and
    reaches the same weights as a run that was never interrupted.
    """
    collection = load_collection(config.data)
    readable, skipped = readable_items(collection.items, progress)
    skipped = collection.skipped + skipped
    items, validation = split_by_class(readable, config.val_classes, config.seed)
    classes = sorted({item.label for item in items})
    if len(classes) < 2:
        found = f"only class {classes[0]!r}" if classes else "no readable labeled image"
        raise RetrievalError(f"{config.data}: {found} to train on; training needs at least two labeled classes (ROOT/<label>/<image>)")
    if config.val_classes > 0 and len({item.label for item in validation}) < 2:
        total = len({item.label for item in readable})
        raise RetrievalError(f"--val-classes {config.val_classes} holds out fewer than two of the {total} classes; raise it or use 0")
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)  # the only global generator used: augmentation; sampler and split seed their own

    run.root.mkdir(parents=True, exist_ok=True)
    write_json(run.config, config.to_dict())
    write_skip_report(run.root / "skipped.json", skipped)
    validator = Validator(validation, config.preprocessing, device) if validation else None
    best_map, stale_epochs = -1.0, 0

    model = Encoder(config.backbone, config.embedding_dim, config.pretrained).to(device)
    loss_fn = make_loss(config.loss, config.temperature)
    sampler = ClassBalancedBatchSampler([item.label for item in items], config.batch_size, config.images_per_class, config.seed)
    loader = DataLoader(AugmentedImages(items, classes, config.preprocessing), batch_sampler=sampler, num_workers=config.workers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, config.learning_rate, total_steps=config.epochs * len(sampler), pct_start=0.1)
    epoch_loss = float("nan")
    step = start_epoch = 0
    if resume:
        record = load_trainer_state(run.trainer_state, model, optimizer, schedule)
        start_epoch, step, best_map, stale_epochs = record["epoch"], record["step"], record["best_map"], record["stale_epochs"]
        lines = run.train_log.read_text(encoding="utf-8").splitlines()[:start_epoch] if run.train_log.is_file() else []
        write_atomic(run.train_log, "".join(line + "\n" for line in lines).encode())
        if progress:
            tqdm.write(f"resuming {run.root} after epoch {start_epoch}")
    else:
        run.train_log.unlink(missing_ok=True)
        run.best_checkpoint.unlink(missing_ok=True)  # a best checkpoint of an earlier run would be taken for this one's
    for epoch in range(start_epoch, config.epochs):
        sampler.set_epoch(epoch)
        model.train()
        started, losses = time.perf_counter(), []
        for images, labels in tqdm(loader, desc=f"epoch {epoch + 1}/{config.epochs}", unit="batch", disable=not progress, leave=False):
            loss = loss_fn(model.project(images.to(device)), labels.to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            step += 1
        epoch_loss = float(np.mean(losses))
        entry = {"epoch": epoch + 1, "step": step, "loss": epoch_loss, "lr": schedule.get_last_lr()[0], "seconds": round(time.perf_counter() - started, 2)}
        metadata = {"epoch": str(epoch + 1), "step": str(step)}
        save_checkpoint(run.last_checkpoint, model, metadata)
        if validator is not None:
            scores = validator(model)
            entry.update({"val_recall@1": scores["recall@1"], "val_map@r": scores["map@r"]})
            if scores["map@r"] > best_map:
                best_map, stale_epochs = scores["map@r"], 0
                save_checkpoint(run.best_checkpoint, model, metadata)
            else:
                stale_epochs += 1
        with run.train_log.open("a", encoding="utf-8") as log:
            log.write(json.dumps(entry) + "\n")
        record = {"epoch": epoch + 1, "step": step, "best_map": best_map, "stale_epochs": stale_epochs}
        save_trainer_state(run.trainer_state, model, optimizer, schedule, record)
        if progress:
            validated = f"  val recall@1 {entry['val_recall@1']:.3f} MAP@R {entry['val_map@r']:.3f}" if validator else ""
            tqdm.write(f"epoch {epoch + 1}/{config.epochs}  loss {epoch_loss:.4f}{validated}  ({entry['seconds']:.1f}s)")
        if config.patience and stale_epochs >= config.patience:
            if progress:
                tqdm.write(f"stopping early: validation MAP@R has not improved for {stale_epochs} epochs (best {best_map:.3f})")
            break
    plot_training_log(run.train_log, run.loss_plot)
    return TrainResult(run, len(items), len(classes), skipped, epoch_loss)


def _weights(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    return {f"{prefix}{name}": tensor.detach().cpu().contiguous() for name, tensor in model.state_dict().items()}


def save_checkpoint(path: Path, model: torch.nn.Module, metadata: dict[str, str]) -> None:
    """Writes the model's weights as safetensors, atomically."""
    write_atomic(path, save_safetensors(_weights(model), metadata=metadata))


def save_trainer_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule: object, record: dict) -> None:
    """Writes everything a resumed run needs into one safetensors file, atomically.

    Tensors: the model's weights, the optimizer's per-parameter state and the torch random state;
    metadata (JSON): the epoch record, the optimizer's parameter groups and the schedule's state.
    """
    tensors = _weights(model, prefix="model/")
    optimizer_state = optimizer.state_dict()
    for index, values in optimizer_state["state"].items():
        for name, value in values.items():
            tensors[f"optimizer/{index}/{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
    tensors["rng/torch"] = torch.get_rng_state()
    metadata = {
        "record": json.dumps(record),
        "param_groups": json.dumps(optimizer_state["param_groups"]),
        "schedule": json.dumps(schedule.state_dict()),  # type: ignore[attr-defined]
    }
    write_atomic(path, save_safetensors(tensors, metadata=metadata))


def load_trainer_state(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule: object) -> dict:
    """Restores what save_trainer_state wrote and returns the epoch record."""
    if not path.is_file():
        raise RetrievalError(f"{path}: nothing to resume (no trainer state); start the run without --resume")
    try:
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata()
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
        model.load_state_dict({name.removeprefix("model/"): t for name, t in tensors.items() if name.startswith("model/")})
        state: dict[int, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            if name.startswith("optimizer/"):
                _, index, key = name.split("/", 2)
                state.setdefault(int(index), {})[key] = tensor
        optimizer.load_state_dict({"state": state, "param_groups": json.loads(metadata["param_groups"])})
        schedule.load_state_dict(json.loads(metadata["schedule"]))  # type: ignore[attr-defined]
        torch.set_rng_state(tensors["rng/torch"])
        return json.loads(metadata["record"])
    except RetrievalError:
        raise
    except Exception as error:  # safetensors, torch and json raise several untyped errors for a damaged file
        raise RetrievalError(f"{path}: cannot resume from it ({str(error).splitlines()[0]}); start the run again without --resume") from None


def load_encoder(run: RunDir) -> tuple[Encoder, TrainConfig]:
    """Rebuilds the run's encoder from config.json and its best (else last) checkpoint (no unpickling)."""
    checkpoint = run.require_checkpoint()
    config = TrainConfig.from_dict(read_json(run.config))
    model = Encoder(config.backbone, config.embedding_dim)
    try:
        state = load_safetensors(checkpoint.read_bytes())
        model.load_state_dict(state)
    except Exception as error:  # safetensors and load_state_dict raise several untyped errors
        raise RetrievalError(f"{checkpoint}: not a checkpoint of this encoder ({str(error).splitlines()[0]}); retrain the run") from None
    return model.eval(), config
