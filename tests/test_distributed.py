"""Distributed training: the gathered loss and gradients equal one process's, and torchrun trains end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import distributed as dist
from torch.nn.parallel import DistributedDataParallel

from retrieval.runs import RunDir
from training import distributed
from training.losses import LOSSES
from training.samplers import ClassBalancedBatchSampler

ROOT = Path(__file__).parents[1]
WORLD = 2


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(24, 16, generator=generator), torch.arange(6).repeat_interleave(2).repeat(2)


def model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(16, 8)


def gathered_losses_and_gradients(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Every loss on the rows gathered from all ranks, with the weight gradient DDP leaves on this rank."""
    images, labels = batch()
    rows = slice(rank * len(images) // world, (rank + 1) * len(images) // world)
    results = {}
    for name, loss_class in LOSSES.items():
        net = DistributedDataParallel(model())
        loss = loss_class(temperature=0.2)(distributed.gather_rows(net(images[rows])), distributed.gather_rows(labels[rows]))
        loss.backward()
        results[f"{name}/loss"], results[f"{name}/grad"] = loss.detach().reshape(1), net.module.weight.grad
    return results


def losses_and_gradients(rank: int, world: int, out: Path) -> None:
    """Runs on each rank: writes the losses and gradients, then leaves the group as the trainer does."""
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=world)
    save_file(gathered_losses_and_gradients(rank, world), str(out / f"rank{rank}.safetensors"))
    dist.barrier()  # no rank leaves while another is still talking to it
    distributed.stop()


def test_two_gloo_processes_match_one_process_on_the_whole_batch(tmp_path: Path) -> None:
    mp.spawn(losses_and_gradients, args=(WORLD, tmp_path), nprocs=WORLD)
    images, labels = batch()
    for rank in range(WORLD):
        results = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        for name, loss_class in LOSSES.items():
            net = model()
            loss = loss_class(temperature=0.2)(net(images), labels)
            loss.backward()
            torch.testing.assert_close(results[f"{name}/loss"], loss.detach().reshape(1), rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(results[f"{name}/grad"], net.weight.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_ranks_get_distinct_batches_covering_the_classes() -> None:
    labels = [f"c{i % 12}" for i in range(96)]
    per_rank = [list(ClassBalancedBatchSampler(labels, 16, 4, seed=1, rank=rank, world_size=WORLD)) for rank in range(WORLD)]
    single = list(ClassBalancedBatchSampler(labels, 16, 4, seed=1))
    assert len(per_rank[0]) == len(per_rank[1]) == len(single) // WORLD
    assert not {tuple(b) for b in per_rank[0]} & {tuple(b) for b in per_rank[1]}
    assert all(len(b) == 16 and len({labels[i] for i in b}) == 4 for batches in per_rank for b in batches)


@pytest.mark.parametrize("extra", [[], ["--self-supervised", "--loss", "moco"], ["--adapt", "{gallery}"]], ids=["supervised", "self-supervised-moco", "adapted"])
def test_torchrun_trains_with_two_processes(small_folder: Path, tmp_path: Path, extra: list[str]) -> None:
    # "--" ends torchrun's own options: its parser would take `--run` for an abbreviation of --run-path
    run = RunDir(tmp_path / "run")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD), "-m", "retrieval", "--", "train", str(small_folder)]
    options = ["--run", str(run.root), "--epochs", "2", "--batch-size", "8", "--image-size", "32", "--device", "cpu"]
    options += [option.replace("{gallery}", str(small_folder)) for option in extra]  # adapting to its own images
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    finished = subprocess.run([*command, *options], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    log = [json.loads(line) for line in run.train_log.read_text().splitlines()]
    assert [entry["epoch"] for entry in log] == [1, 2]
    assert run.last_checkpoint.is_file()
    assert sum(name.startswith("rng/torch/") for name in load_file(str(run.trainer_state))) == WORLD
    assert finished.stdout.count("trained ") == 1  # only process 0 reports
