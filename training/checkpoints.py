"""Checkpoints and trainer state: sealed safetensors files, written atomically, never unpickled.

A checkpoint holds the encoder's weights (`save_checkpoint`, read back by `load_encoder`, which the
ONNX export uses without the trainer); the trainer state (`TrainerState`) holds everything a resumed
run needs. Every file carries the sha256 of its tensor bytes in its metadata, so a truncated or
damaged file is refused with a message instead of loading wrong weights.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from retrieval.errors import RetrievalError
from retrieval.runs import RunDir, read_json, write_atomic
from training.config import TrainConfig
from training.distributed import Ranks, gather_objects
from training.memory import MemoryQueue
from training.model import Encoder
from training.selfsup import MemoryBank


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
        raise RetrievalError(
            f"{path}: its tensor bytes do not match their sha256 (the file is "
            "truncated or damaged); retrain, or resume from an intact copy"
        )
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


@dataclass
class Progress:
    """Where a run stands: what the trainer state records after each save, and a resumed run continues from."""

    epoch: int = 0  # epochs finished
    batch: int = 0  # batches of the current epoch done
    step: int = 0  # optimisation steps in all
    losses: list[float] = field(default_factory=list)  # the current epoch's batch losses so far
    best_map: float = -1.0  # the best validation MAP@R (-1: none yet)
    stale_epochs: int = 0  # epochs since it last improved

    def to_dict(self) -> dict:
        """The record as JSON values (the trainer state's metadata, and what process 0 broadcasts)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> Progress:
        """The record that to_dict wrote, refusing keys it does not know."""
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise RetrievalError(f"a progress record with unknown keys {sorted(unknown)}: written by another version")
        return cls(**values)


@dataclass
class TrainerState:
    """Everything a resumed run needs, in one safetensors file written atomically by process 0.

    Tensors: the model's weights, the optimizer's per-parameter state, the memory queue and its key
    encoder, the weight average (--ema), and every process's torch random state; metadata (JSON): the
    progress record, the optimizer's parameter groups and the schedule's, loss scaler's and queue's counters.
    """

    path: Path
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    queue: MemoryQueue | None
    ranks: Ranks
    average: nn.Module | None = None  # the moving average of the weights (--ema), with its count of averaged steps
    bank: MemoryBank | None = None  # instdisc's memory bank, with its NCE constant

    def save(self, record: Progress) -> None:
        """Writes the state after record's step (a collective call: every process must make it)."""
        random_states = gather_objects(torch.get_rng_state())
        if not self.ranks.is_main:
            return
        tensors = _weights(self.model, prefix="model/")
        optimizer_state = self.optimizer.state_dict()
        for index, values in optimizer_state["state"].items():
            for name, value in values.items():
                tensors[f"optimizer/{index}/{name}"] = torch.as_tensor(value).detach().cpu().contiguous()
        if self.average is not None:
            tensors.update(_weights(self.average, prefix="average/"))
        for rank, random_state in enumerate(random_states):
            tensors[f"rng/torch/{rank}"] = random_state
        metadata = {
            "record": json.dumps(record.to_dict()),
            "param_groups": json.dumps(optimizer_state["param_groups"]),
            "schedule": json.dumps(self.schedule.state_dict()),
            "scaler": json.dumps(self.scaler.state_dict()),
        }
        if self.queue is not None:
            queue_tensors, counters = self.queue.state()
            tensors.update({f"queue/{name}": t for name, t in queue_tensors.items()})
            tensors.update(_weights(self.queue.encoder, prefix="queue/encoder/"))
            metadata["queue"] = json.dumps(counters)
        if self.bank is not None:
            bank_tensors, bank_counters = self.bank.state()
            tensors.update({f"bank/{name}": t for name, t in bank_tensors.items()})
            metadata["bank"] = json.dumps(bank_counters)
        write_atomic(self.path, sealed_safetensors(tensors, metadata))

    def load(self) -> Progress:
        """Restores the state into the model, optimizer, schedule, scaler and queue; returns the record."""
        if not self.path.is_file():
            raise RetrievalError(f"{self.path}: nothing to resume (no trainer state); start the run without --resume")
        tensors, metadata = read_sealed(self.path)
        try:
            saved_ranks = sum(name.startswith("rng/torch/") for name in tensors)
            if saved_ranks != self.ranks.world_size:
                raise RetrievalError(
                    f"{self.path}: saved by {saved_ranks} training processes; "
                    f"resume it with as many, not {self.ranks.world_size}"
                )
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
            if self.bank is not None:
                if "bank" not in metadata:
                    raise RetrievalError(f"{self.path}: saved without a memory bank, but the run keeps one")
                self.bank.load_state(_prefixed(tensors, "bank/"), json.loads(metadata["bank"]))
            if self.average is not None:
                averaged = _prefixed(tensors, "average/")
                if not averaged:
                    raise RetrievalError(f"{self.path}: saved without a weight average, but the run has --ema")
                self.average.load_state_dict(averaged)
            torch.set_rng_state(tensors[f"rng/torch/{self.ranks.rank}"])
            return Progress.from_dict(json.loads(metadata["record"]))
        except RetrievalError:
            raise
        except Exception as error:  # safetensors, torch and json raise several untyped errors for a damaged file
            raise RetrievalError(
                f"{self.path}: cannot resume from it ({str(error).splitlines()[0]}); "
                "start the run again without --resume"
            ) from None


def saved_record(path: Path) -> Progress | None:
    """The progress record (epoch, batch, ...) of a trainer state, checked against its seal; None if there is none.

    A damaged file raises RetrievalError naming it (read_sealed), as resuming from it would.
    """
    if not path.is_file():
        return None
    _, metadata = read_sealed(path)
    try:
        return Progress.from_dict(json.loads(metadata["record"]))
    except (KeyError, ValueError, TypeError):
        raise RetrievalError(f"{path}: has no progress record; start the run again with --overwrite") from None


def load_encoder(run: RunDir) -> tuple[Encoder, TrainConfig]:
    """Rebuilds the run's encoder from config.json and its best (else last) checkpoint (no unpickling)."""
    checkpoint = run.require_checkpoint()
    config = TrainConfig.from_dict(read_json(run.config))
    model = Encoder.build(config.architecture)
    state, _ = read_sealed(checkpoint)
    try:
        model.load_state_dict(state)
    except Exception as error:  # safetensors and load_state_dict raise several untyped errors
        raise RetrievalError(
            f"{checkpoint}: not a checkpoint of this encoder ({str(error).splitlines()[0]}); retrain the run"
        ) from None
    return model.eval(), config
