"""`retrieval train` and `retrieval analyze`: learn an embedding; sweep the temperature."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from retrieval.commands.output import DATA_HELP, BenchmarkOption, DataArg, console, errors, report_skipped
from retrieval.errors import RetrievalError
from retrieval.extras import require
from retrieval.runs import RunDir, read_json

# Options default to None: what is not given takes training.config.TrainConfig's default, the one place they are set.
HELP = {
    "run": "Run directory to create (config, checkpoints, log).",
    "loss": "Loss: supcon (Khosla et al. 2020), infonce (NT-Xent), npair (Sohn 2016), hcl (Robinson et al. 2021), "
    "hard (Wang & Liu 2021); default supcon.",
    "temperature": "Softmax temperature of the loss "
    "(default: supcon 0.05, infonce 0.07, npair 1.0, hcl 0.5, hard 0.2).",
    "epochs": "Passes over the data (default 50, or 15 from pretrained weights).",
    "batch_size": "Images per batch (classes x images per class).",
    "images_per_class": "Images of each class in a batch.",
    "backbone": "torchvision backbone (resnet18, resnet34, resnet50, mobilenet_v3_small, mobilenet_v3_large, "
    "efficientnet_b0, convnext_tiny, vit_b_16) or timm:<model> with timm installed.",
    "pretrained": "--pretrained: start from ImageNet weights (torchvision downloads them once); --scratch: "
    "random weights. Default: the weights when they are already cached, then 128-px inputs (224 on a GPU) and 15 "
    "epochs; else from scratch at 64 px for 50 epochs (docs/recipe.md).",
    "image_size": "Input size in pixels, square (default 64, or 128 from pretrained weights; 224 on a GPU).",
    "stem": "imagenet, or small: a ResNet's first convolution 3x3 stride 1 for small inputs (4x the compute).",
    "augment": "Augmentation steps, comma-separated, from crop, color, hue, grayscale, invert, blur, affine, erase; "
    "or none (default: the recipe's, see docs/recipe.md).",
    "embedding_dim": "Embedding dimension (default: the backbone's feature width, e.g. 512 for resnet18).",
    "pooling": "Spatial pooling of the resnet features: avg, or gem (generalised mean, its exponent learned).",
    "layers": "The resnet stages pooled into the embedding, comma-separated (e.g. 3,4: each L2-normalised, "
    "concatenated); default 4, the last.",
    "ema": "Export an exponential moving average of the weights with this decay per step (e.g. 0.99; 0: none).",
    "learning_rate": "Peak learning rate, reached after the warm-up, then decayed to 0 along a cosine.",
    "weight_decay": "Weight decay of the optimizer.",
    "optimizer": "adamw, or sgd (Nesterov momentum 0.9; give it a larger --learning-rate, e.g. 0.1).",
    "warmup": "Fraction of the steps spent warming the learning rate up linearly.",
    "clip_grad": "Clip the gradient norm to this value (0: no clipping).",
    "precision": "Autocast precision: fp32, bf16, fp16 (with loss scaling), or auto (bf16 on a GPU, or a CPU with "
    "AVX-512 BF16 or AMX, that has it; else fp32). channels_last is used on GPUs.",
    "compile": "Compile the encoder with torch.compile (slow start, faster steps on GPUs).",
    "queue_size": "MoCo memory: keys of earlier batches from a momentum encoder, contrasted as extra rows "
    "(supcon and infonce; 0: none).",
    "momentum": "Momentum of the key encoder that fills the queue.",
    "checkpoint_every": "Also save the resumable trainer state every this many steps (0: after each epoch only).",
    "tensorboard": "Also log loss, learning rate and validation metrics to RUN/tensorboard "
    "(needs the tensorboard extra).",
    "resume": "Continue an interrupted run from its last saved trainer state, with its own config.json and data "
    "(DATA may be left out).",
    "overwrite": "Train into a run directory that already holds a run, starting it over.",
    "val_classes": "Fraction of the classes held out to validate each epoch (recall@1, MAP@R); "
    "the best epoch is exported.",
    "patience": "Stop after this many epochs without a better validation MAP@R (0: never).",
    "device": "auto, cpu or cuda.",
    "seed": "Random seed.",
}
NO_DEFAULT = {"show_default": False}


OptionalDataArg = Annotated[
    Path | None, typer.Argument(help=DATA_HELP + " Not needed with --resume.", show_default=False)
]


def train(
    data: OptionalDataArg = None,
    *,
    run: Annotated[Path, typer.Option("--run", help=HELP["run"])],
    loss: Annotated[str | None, typer.Option(help=HELP["loss"], **NO_DEFAULT)] = None,
    temperature: Annotated[float | None, typer.Option(help=HELP["temperature"], **NO_DEFAULT)] = None,
    epochs: Annotated[int | None, typer.Option(help=HELP["epochs"], **NO_DEFAULT)] = None,
    batch_size: Annotated[int | None, typer.Option(help=HELP["batch_size"], **NO_DEFAULT)] = None,
    images_per_class: Annotated[int | None, typer.Option(help=HELP["images_per_class"], **NO_DEFAULT)] = None,
    backbone: Annotated[str | None, typer.Option(help=HELP["backbone"], **NO_DEFAULT)] = None,
    pretrained: Annotated[
        bool | None, typer.Option("--pretrained/--scratch", help=HELP["pretrained"], **NO_DEFAULT)
    ] = None,
    image_size: Annotated[int | None, typer.Option(help=HELP["image_size"], **NO_DEFAULT)] = None,
    stem: Annotated[str | None, typer.Option(help=HELP["stem"], **NO_DEFAULT)] = None,
    augment: Annotated[str | None, typer.Option(help=HELP["augment"], **NO_DEFAULT)] = None,
    embedding_dim: Annotated[int | None, typer.Option(help=HELP["embedding_dim"], **NO_DEFAULT)] = None,
    pooling: Annotated[str | None, typer.Option(help=HELP["pooling"], **NO_DEFAULT)] = None,
    layers: Annotated[str | None, typer.Option(help=HELP["layers"], **NO_DEFAULT)] = None,
    ema: Annotated[float | None, typer.Option(help=HELP["ema"], **NO_DEFAULT)] = None,
    learning_rate: Annotated[float | None, typer.Option(help=HELP["learning_rate"], **NO_DEFAULT)] = None,
    weight_decay: Annotated[float | None, typer.Option(help=HELP["weight_decay"], **NO_DEFAULT)] = None,
    optimizer: Annotated[str | None, typer.Option(help=HELP["optimizer"], **NO_DEFAULT)] = None,
    warmup: Annotated[float | None, typer.Option(help=HELP["warmup"], **NO_DEFAULT)] = None,
    clip_grad: Annotated[float | None, typer.Option(help=HELP["clip_grad"], **NO_DEFAULT)] = None,
    precision: Annotated[str | None, typer.Option(help=HELP["precision"], **NO_DEFAULT)] = None,
    compile: Annotated[bool | None, typer.Option("--compile", help=HELP["compile"], **NO_DEFAULT)] = None,
    queue_size: Annotated[int | None, typer.Option(help=HELP["queue_size"], **NO_DEFAULT)] = None,
    momentum: Annotated[float | None, typer.Option(help=HELP["momentum"], **NO_DEFAULT)] = None,
    checkpoint_every: Annotated[int | None, typer.Option(help=HELP["checkpoint_every"], **NO_DEFAULT)] = None,
    tensorboard: Annotated[bool | None, typer.Option("--tensorboard", help=HELP["tensorboard"], **NO_DEFAULT)] = None,
    resume: Annotated[bool, typer.Option("--resume", help=HELP["resume"])] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help=HELP["overwrite"])] = False,
    val_classes: Annotated[float | None, typer.Option(help=HELP["val_classes"], **NO_DEFAULT)] = None,
    patience: Annotated[int | None, typer.Option(help=HELP["patience"], **NO_DEFAULT)] = None,
    device: Annotated[str | None, typer.Option(help=HELP["device"], **NO_DEFAULT)] = None,
    seed: Annotated[int | None, typer.Option(help=HELP["seed"], **NO_DEFAULT)] = None,
    benchmark: BenchmarkOption = None,
) -> None:
    """Train an embedding model on a labeled image collection (or a benchmark's training split)."""
    given = {name: value for name, value in locals().items() if name not in NOT_CONFIG and value is not None}
    run_training(data, RunDir(run), resume, overwrite, given)


def run_training(data: Path | None, run_dir: RunDir, resume: bool, overwrite: bool, given: dict) -> None:
    """Builds the run's TrainConfig (its own, to resume) from the options given, trains, and reports."""
    require("torch", "train")
    from training.config import TrainConfig
    from training.loop import train

    if resume:
        config = TrainConfig.from_dict(read_json(run_dir.config))
        if data is not None and Path(config.data) != data.expanduser().resolve():
            raise RetrievalError(
                f"--resume continues {run_dir.root} on its own data ({config.data}); leave DATA out or give that path"
            )
    else:
        if data is None:
            raise RetrievalError(
                "give DATA: an image folder ROOT/<label>/<image> or a CSV path,label (or --resume a run)"
            )
        _refuse_existing(run_dir, overwrite)
        config = TrainConfig(data=str(data.expanduser().resolve()), **given)
    try:
        result = train(config, run_dir, resume=resume)
    except KeyboardInterrupt:
        _interrupted(run_dir)
    if not result.reporting:
        return  # under torchrun, process 0 reports
    report_skipped(result.skipped, run_dir.root / "skipped.json")
    console.print(
        f"trained on {result.num_images} images of {result.num_classes} classes; final loss {result.final_loss:.4f}; "
        f"checkpoint {run_dir.last_checkpoint}"
    )


NOT_CONFIG = ("data", "run", "resume", "overwrite")


def _refuse_existing(run: RunDir, overwrite: bool) -> None:
    """A run directory that holds a run is continued (--resume) or started over (--overwrite), never silently."""
    if overwrite or not (run.trainer_state.is_file() or run.last_checkpoint.is_file()):
        return  # nothing trained yet (a run killed before its first save): nothing to lose
    trained = len(run.train_log.read_text(encoding="utf-8").splitlines()) if run.train_log.is_file() else 0
    raise RetrievalError(
        f"{run.root} already holds a run ({trained} epoch(s) trained); continue it with "
        f"`retrieval train --run {run.root} --resume`, or start over with --overwrite"
    )


def _interrupted(run: RunDir) -> None:
    """Ctrl+C: one line saying where the last saved state is and how to go on from it; exit status 130."""
    from training.checkpoints import saved_record

    record = saved_record(run.trainer_state)
    if record is None:
        line = "interrupted before the first epoch ended, nothing saved; start again with --overwrite"
    else:
        line = (
            f"interrupted: the trainer state of epoch {record['epoch']}, batch {record['batch']} is kept in "
            f"{run.trainer_state}; resume with `retrieval train --run {run.root} --resume`"
        )
    errors.print(line, soft_wrap=True, highlight=False, markup=False)
    raise typer.Exit(130)


SWEEP_COLUMNS = (
    "uniformity (loss space)",
    "tolerance (loss space)",
    "uniformity (embedding)",
    "tolerance (embedding)",
    "recall@1",
    "MAP@R",
)
SWEEP_KEYS = ("loss_uniformity", "loss_tolerance", "uniformity", "tolerance", "recall@1", "map@r")


def analyze(
    data: DataArg,
    out: Annotated[
        Path,
        typer.Option("--out", help="Directory for temperature_sweep.json, temperature_sweep.png and the sweep's runs."),
    ] = Path("runs/analyze"),
    temperatures: Annotated[
        str, typer.Option(help="Comma-separated temperatures to train at.")
    ] = "0.05,0.1,0.2,0.5,1.0",
    losses: Annotated[
        str, typer.Option(help="Comma-separated losses to sweep (any of supcon, infonce, npair, hcl, hard).")
    ] = "supcon,hard",
    epochs: Annotated[int, typer.Option(help="Epochs of each run (short runs show the trend).")] = 5,
    batch_size: Annotated[int, typer.Option(help="Images per batch.")] = 128,
    image_size: Annotated[int, typer.Option(help="Input size in pixels.")] = 64,
    backbone: Annotated[str, typer.Option(help="Backbone, as for train.")] = "resnet18",
    val_classes: Annotated[
        float, typer.Option(help="Fraction of the classes held out, on which uniformity and tolerance are measured.")
    ] = 0.25,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    seed: Annotated[int, typer.Option(help="Random seed (the same for every run).")] = 0,
) -> None:
    """Sweep the temperature of SupCon and the hard contrastive loss; plot uniformity and tolerance against it."""
    require("torch", "train")
    from training.analyze import temperature_sweep
    from training.config import TrainConfig

    if not 0 < val_classes < 1:
        raise RetrievalError(
            "--val-classes must be between 0 and 1 (uniformity and "
            f"tolerance are measured on held-out classes), got {val_classes}"
        )
    try:
        values = [float(part) for part in temperatures.split(",") if part.strip()]
    except ValueError:
        raise RetrievalError(
            f"--temperatures {temperatures!r}: give numbers separated by commas, e.g. 0.05,0.1,0.5"
        ) from None
    names = [part.strip() for part in losses.split(",") if part.strip()]
    settings = {
        "epochs": epochs,
        "batch_size": batch_size,
        "image_size": image_size,
        "backbone": backbone,
        "device": device,
        "seed": seed,
    }
    base = TrainConfig(data=str(data.expanduser().resolve()), val_classes=val_classes, **settings)
    for name in names:  # every loss and temperature is checked before hours of training
        for value in values:
            TrainConfig(data=base.data, loss=name, temperature=value)
    rows = temperature_sweep(base, out, values, names)
    table = Table(title="temperature sweep (held-out classes)")
    for column in ("loss", "temperature", *SWEEP_COLUMNS):
        table.add_column(column)
    for row in rows:
        table.add_row(row["loss"], f"{row['temperature']:g}", *(f"{row[key]:.3f}" for key in SWEEP_KEYS))
    console.print(table)
    console.print(f"wrote {out / 'temperature_sweep.png'} and {out / 'temperature_sweep.json'}")
