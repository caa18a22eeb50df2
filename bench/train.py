"""Training throughput in images/s: the encoder's step on synthetic batches, and the whole trainer on real images.

The step (forward, SupCon loss, backward, AdamW) is timed in each precision on random images, so
that it measures the model, not the disk; its FLOPs are counted with torch's FlopCounterMode and
set against this device's own measured matmul throughput (the utilisation a user can expect). The
trainer row runs `train()` for one epoch on the embedded icons dataset (decoding, augmentation,
sampler and all) and reads images/s from its log. With --photos N, the same trainer on N seeded 4000 x 3000
JPEGs (5 classes, quality 90: the shape of a folder of camera photos), one epoch each way in alternated
rounds: decoded at the reduced DCT scale training uses (training.images.DECODED_SIDES) and at full size.

    python bench/train.py                       # CPU: resnet18 at 64 px, fp32 and bf16
    python bench/train.py --no-trainer --precisions fp32 --photos 60 --rounds 3   # photos: decoding's share
    bash bench/gpu_train.sh                     # GPU: resnet50 at 224 px, bf16, channels_last
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch.utils.flop_counter import FlopCounterMode

from retrieval.datasets import icons
from retrieval.runs import RunDir
from training.config import TrainConfig
from training.losses import SupConLoss
from training.model import Encoder
from training.loop import autocast, autocast_dtype, train


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """The device's measured dense matmul throughput in TFLOP/s (best of a few square products)."""
    n = 8192 if device.type == "cuda" else 2048
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        started = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * n**3 / best / 1e12


def step_rate(args: argparse.Namespace, device: torch.device, precision: str) -> tuple[float, float]:
    """Returns (images/s, FLOPs per image) of training steps on random images."""
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    model = Encoder(args.backbone, image_size=args.image_size, pooling=args.pooling, layers=args.layers)
    model = model.to(device, memory_format=memory_format).train()
    forward = torch.compile(model.project) if args.compile else model.project
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = SupConLoss(0.1)
    dtype = autocast_dtype(precision, device)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device).to(memory_format=memory_format)
    labels = torch.arange(args.batch_size // 4, device=device).repeat_interleave(4)

    def step() -> None:
        with autocast(device, dtype):
            projected = forward(images)
        loss = loss_fn(projected.float(), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    with FlopCounterMode(display=False) as counter:
        step()
    for _ in range(args.warmup):
        step()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    synchronize(device)
    return args.steps * args.batch_size / (time.perf_counter() - started), counter.get_total_flops() / args.batch_size


def trainer_rate(args: argparse.Namespace, device: torch.device, precision: str) -> float:
    """Images/s of one epoch of the real trainer on the icons training split (as logged by train())."""
    with tempfile.TemporaryDirectory() as scratch:
        config = TrainConfig(
            data=str(icons() / "train"), epochs=1, batch_size=args.batch_size, image_size=args.image_size,
            backbone=args.backbone, precision=precision, device=str(device), workers=args.workers,
        )
        run = RunDir(Path(scratch) / "run")
        train(config, run, progress=False)
        return json.loads(run.train_log.read_text().splitlines()[-1])["images_per_second"]


def photos(folder: Path, count: int) -> Path:
    """count seeded 4000 x 3000 JPEGs in 5 class folders under folder (smooth colour fields, as photos compress)."""
    from PIL import Image

    rng = torch.Generator().manual_seed(0)
    for number in range(count):
        label = folder / f"class-{number % 5}"
        label.mkdir(parents=True, exist_ok=True)
        small = (torch.rand(30, 40, 3, generator=rng) * 255).to(torch.uint8).numpy()
        Image.fromarray(small).resize((4000, 3000), Image.BILINEAR).save(label / f"IMG_{number:04d}.JPG", quality=90)
    return folder


def photo_rates(args: argparse.Namespace, device: torch.device, precision: str) -> dict[str, list[float]]:
    """Images/s of one trainer epoch on --photos JPEGs, at the reduced decoding scale and at full size, alternated."""
    import training.images

    reduced = training.images.DECODED_SIDES
    rates: dict[str, list[float]] = {"reduced-scale decode": [], "full-size decode": []}
    with tempfile.TemporaryDirectory() as scratch:
        data = photos(Path(scratch) / "photos", args.photos)
        for _ in range(args.rounds):
            for name, sides in (("full-size decode", 0), ("reduced-scale decode", reduced)):
                training.images.DECODED_SIDES = sides
                config = TrainConfig(
                    data=str(data), epochs=1, batch_size=min(args.batch_size, args.photos), precision=precision,
                    image_size=args.image_size, backbone=args.backbone, device=str(device), workers=args.workers,
                )
                run = RunDir(Path(scratch) / name.replace(" ", "-"))
                train(config, run, progress=False)
                rates[name].append(json.loads(run.train_log.read_text().splitlines()[-1])["images_per_second"])
                shutil.rmtree(run.root)
    training.images.DECODED_SIDES = reduced
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backbone", default="resnet18")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--pooling", default="avg", help="avg or gem (training.model)")
    parser.add_argument("--layers", default="4", help="resnet stages pooled into the embedding, e.g. 3,4")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0, help="data-loading processes of the trainer row")
    parser.add_argument("--no-trainer", action="store_true", help="skip the real-trainer row")
    parser.add_argument("--photos", type=int, default=0, help="also the trainer on this many 12-megapixel JPEGs")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds of the --photos rows")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)

    peaks = {name: matmul_tflops(device, dtype) for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    table = Table(title=f"training throughput: {args.backbone} ({args.pooling} pooling of stages {args.layers}), {args.image_size} px, batch {args.batch_size}, {device}" + (", channels_last" if args.channels_last else ""))
    for column in ("what", "precision", "images/s", "vs fp32 step", "model TFLOP/s", "matmul TFLOP/s", "utilisation"):
        table.add_column(column, justify="right" if column != "what" else "left")
    base = None
    for precision in args.precisions.split(","):
        rate, flops = step_rate(args, device, precision)
        base = base or rate
        achieved = rate * flops / 1e12
        peak = peaks["bf16" if precision in ("bf16", "fp16") else "fp32"]
        table.add_row("encoder step (synthetic)", precision, f"{rate:.0f}", f"{rate / base:.2f}x", f"{achieved:.2f}", f"{peak:.2f}", f"{achieved / peak:.0%}")
    if not args.no_trainer:
        precision = args.precisions.split(",")[0]
        rate = trainer_rate(args, device, precision)
        table.add_row("whole trainer, icons epoch", precision, f"{rate:.0f}", f"{rate / base:.2f}x", "", "", "")
    if args.photos:
        precision = args.precisions.split(",")[0]
        for name, rates in photo_rates(args, device, precision).items():
            middle = sorted(rates)[len(rates) // 2]
            shown = f"{middle:.0f} (rounds {', '.join(f'{rate:.0f}' for rate in rates)})"
            table.add_row(f"whole trainer, {args.photos} photos, {name}", precision, shown, f"{middle / base:.2f}x", "", "", "")
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
