"""SupCon forward + backward: ours against pytorch-metric-learning's, time and peak memory, side by side.

Same random embeddings (dim 128) and labels (4 per class) for both, at batch 256, 1024 and 4096.
Time is the best of several runs in this process; peak memory is measured in a fresh process per
case (VmHWM after resetting it, minus the resident size before the call), since CPU tensors are
invisible to Python's allocator tracing.

    python bench/losses.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch
from pytorch_metric_learning import losses as pml_losses
from rich.console import Console
from rich.table import Table

from training.losses import SupConLoss

BATCHES = (256, 1024, 4096)
TEMPERATURE = 0.1
PEAK = """
import sys, torch
sys.path.insert(0, "bench")
from losses import make_inputs, make_loss
def status(key):
    return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1])
embeddings, labels = make_inputs(int(sys.argv[2]))
loss = make_loss(sys.argv[1])
before = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current resident size
loss(embeddings, labels).backward()
print(status("VmHWM:") - before)
"""


def make_inputs(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random embeddings that need gradients, and labels with 4 rows per class."""
    generator = torch.Generator().manual_seed(batch)
    return torch.randn(batch, 128, generator=generator, requires_grad=True), torch.arange(batch) // 4


def make_loss(which: str) -> torch.nn.Module:
    return SupConLoss(TEMPERATURE) if which == "ours" else pml_losses.SupConLoss(temperature=TEMPERATURE)


def seconds(which: str, batch: int, repeats: int) -> float:
    embeddings, labels = make_inputs(batch)
    loss = make_loss(which)
    best = float("inf")
    for _ in range(repeats):
        embeddings.grad = None
        started = time.perf_counter()
        loss(embeddings, labels).backward()
        best = min(best, time.perf_counter() - started)
    return best


def peak_mib(which: str, batch: int) -> float:
    done = subprocess.run([sys.executable, "-c", PEAK, which, str(batch)], capture_output=True, text=True, check=True)
    return int(done.stdout.strip()) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    table = Table(title=f"SupCon forward+backward, dim 128, t={TEMPERATURE}, {torch.get_num_threads()} threads")
    for column in ("batch", "ours ms", "PML ms", "ours / PML time", "ours peak MiB", "PML peak MiB", "ours / PML memory"):
        table.add_column(column, justify="right")
    for batch in BATCHES:
        ours, theirs = seconds("ours", batch, args.repeats), seconds("pml", batch, args.repeats)
        our_peak, their_peak = peak_mib("ours", batch), peak_mib("pml", batch)
        table.add_row(str(batch), f"{ours * 1e3:.1f}", f"{theirs * 1e3:.1f}", f"{ours / theirs:.2f}x", f"{our_peak:.0f}", f"{their_peak:.0f}", f"{our_peak / their_peak:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
