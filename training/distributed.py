"""Training on several processes under torchrun: the process group, and rows gathered across ranks.

torchrun sets WORLD_SIZE, RANK and LOCAL_RANK; with WORLD_SIZE > 1 the trainer joins the group
(NCCL on CUDA, gloo on CPU), wraps the encoder in DistributedDataParallel, and computes the loss on
the batches of all ranks together, so that every anchor sees every rank's negatives.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
from torch import distributed as dist

from retrieval.errors import RetrievalError


@dataclass(frozen=True)
class Ranks:
    """This process's place among the training processes."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """The process that validates, logs and writes the run directory."""
        return self.rank == 0


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """Returns the torch device for auto|cpu|cuda[:N], refusing cuda where there is none.

    Under torchrun, auto and cuda mean this process's GPU, cuda:LOCAL_RANK.
    """
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RetrievalError(f"--device {name}: no CUDA device is available here; use --device cpu or auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(name)


def start(device_name: str) -> tuple[Ranks, torch.device]:
    """Joins the torchrun process group when there is one, and returns this process's ranks and device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Ranks(), resolve_device(device_name)
    ranks = Ranks(int(os.environ["RANK"]), world_size, int(os.environ.get("LOCAL_RANK", "0")))
    device = resolve_device(device_name, ranks.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return ranks, device


def stop() -> None:
    """Leaves the process group, if this process joined one.

    DistributedDataParallel wrappers that are no longer referenced may still sit in reference
    cycles; their reducers must be freed before the group they hold, or gloo aborts the process at
    exit ("terminate called without an active exception"), so a collection runs first.
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class _GatherRows(torch.autograd.Function):
    """all_gather along dim 0 whose backward hands each rank the gradient of its own rows.

    Every rank computes the same loss on the gathered rows, so the gradients of a rank's rows are
    summed over ranks (all_reduce); DistributedDataParallel then averages the parameter gradients,
    which together give exactly the gradient of one process holding the whole batch.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        ctx.rows, ctx.rank = len(tensor), dist.get_rank()
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows]


def gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenates the tensor of every rank in rank order (itself when there is one process).

    Gradients flow back to the local rows only; tensors must have the same shape on every rank.
    """
    if _world() == 1:
        return tensor
    if tensor.requires_grad:
        return _GatherRows.apply(tensor)
    parts = [torch.empty_like(tensor) for _ in range(_world())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def gather_objects(value: object) -> list:
    """Returns every rank's value (rank order); [value] with one process."""
    if _world() == 1:
        return [value]
    values: list = [None] * _world()
    dist.all_gather_object(values, value)
    return values


def broadcast_object(value: object) -> object:
    """Returns rank 0's value on every rank."""
    if _world() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]
