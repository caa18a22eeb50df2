"""`retrieval train` and `retrieval analyze`: learn an embedding; sweep the temperature."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.table import Table

from retrieval.commands.output import BENCHMARK_HELP, DATA_HELP, console, report_skipped, stopped_by_ctrl_c
from retrieval.data import COLLECTION_HINT, LABELED_COLLECTION_HINT, load_collection, require_source
from retrieval.errors import RetrievalError, one_of
from retrieval.extras import require
from retrieval.runs import RunDir, read_json, shell_path, writable_folder
from retrieval.wording import counted

if TYPE_CHECKING:
    from training.config import TrainConfig


@dataclass(frozen=True)
class Option:
    """An option of `retrieval train` that sets the training.config.TrainConfig field of its name.

    Each defaults to None: what is not given takes TrainConfig's default, the one place defaults are set.
    """

    name: str
    type: type
    help: str
    flags: tuple[str, ...] = ()  # default: --name-with-dashes

    def parameter(self) -> inspect.Parameter:
        """The command's keyword parameter for it, as typer reads it."""
        flags = self.flags or (f"--{self.name.replace('_', '-')}",)
        option = typer.Option(*flags, help=self.help, show_default=False)
        annotation = Annotated[self.type | None, option]  # type: ignore[name-defined]
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


RESUME_MAY_CHANGE = ("device", "workers", "tensorboard")  # how a run is run, not what it learns: --resume takes them
ANALYZE_DATA_HELP = f"Labeled images: {LABELED_COLLECTION_HINT}."
SWEEP_CLASSES = 4  # analyze trains on some classes and measures on at least two held-out ones
LOSS_HELP = (
    "Loss: supcon (Khosla et al. 2020), infonce (NT-Xent), npair (Sohn 2016), hcl (Robinson et al. 2021), "
    "hard (Wang & Liu 2021); default supcon. Without labels: simclr (default), moco, instdisc, hcl, hard."
)
PRETRAINED_HELP = (
    "--pretrained: start from ImageNet weights (torchvision downloads them once); --scratch: random weights. "
    "Default: the weights when they are already cached, then 128-px inputs (224 on a GPU) and 15 epochs; else from "
    "scratch at 64 px for 50 epochs (docs/recipe.md)."
)
BACKBONE_HELP = (
    "torchvision backbone (resnet18, resnet34, resnet50, mobilenet_v3_small, mobilenet_v3_large, efficientnet_b0, "
    "convnext_tiny, vit_b_16) or timm:<model> with timm installed."
)
AUGMENT_HELP = "Augmentation steps, comma-separated: crop, color, hue, grayscale, invert, blur, affine, erase; or none."
LAYERS_HELP = "The resnet stages pooled into the embedding, e.g. 3,4 (each L2-normalised, concatenated); default 4."
PRECISION_HELP = (
    "Autocast precision: fp32, bf16, fp16 (with loss scaling), or auto (bf16 on a GPU, or a CPU with AVX-512 BF16 "
    "or AMX, that has it; else fp32). channels_last is used on GPUs."
)
QUEUE_HELP = "MoCo memory: keys of earlier batches from a momentum encoder, as extra rows (supcon, infonce; 0: none)."
TEMPERATURE_HELP = "Softmax temperature of the loss (default: supcon 0.05, infonce 0.07, npair 1, hcl 0.5, hard 0.2)."
SELF_SUPERVISED_HELP = (
    "Learn without the labels of DATA (a collection without labels trains so anyway); --loss then names the "
    "method: simclr (default), moco, instdisc, hcl or hard."
)
ADAPT_HELP = (
    "A gallery (folder, CSV or .txt list; its labels ignored) whose images join the self-supervised loss: the "
    "model adapts to the images it will search."
)
# Every TrainConfig field but data and mode (resolved from the data), once each (tests/test_cli.py holds the two lists
# together).
OPTIONS = (
    Option("loss", str, LOSS_HELP),
    Option("temperature", float, TEMPERATURE_HELP),
    Option("epochs", int, "Passes over the data (default 50, or 15 from pretrained weights)."),
    Option("batch_size", int, "Images per batch (classes x images per class)."),
    Option("images_per_class", int, "Images of each class in a batch."),
    Option("backbone", str, BACKBONE_HELP),
    Option("pretrained", bool, PRETRAINED_HELP, ("--pretrained/--scratch",)),
    Option("image_size", int, "Square input, 32 to 1024 px (default 64; pretrained: 128, or 224 on GPUs)."),
    Option("stem", str, "imagenet, or small: a ResNet's first convolution 3x3 stride 1, for small inputs."),
    Option("augment", str, AUGMENT_HELP),
    Option("embedding_dim", int, "Embedding dimension (default: the backbone's width, e.g. 512 for resnet18)."),
    Option("pooling", str, "Pooling of the resnet features: avg, or gem (generalised mean, exponent learned)."),
    Option("layers", str, LAYERS_HELP),
    Option("ema", float, "Export a moving average of the weights with this decay per step (e.g. 0.99; 0: none)."),
    Option(
        "learning_rate",
        float,
        "Peak learning rate, reached after the warm-up, then decayed to 0 along a cosine.",
        ("--learning-rate", "--lr"),
    ),
    Option("weight_decay", float, "Weight decay of the optimizer."),
    Option("optimizer", str, "adamw, or sgd (Nesterov momentum 0.9; give it a larger --learning-rate)."),
    Option("warmup", float, "Fraction of the steps spent warming the learning rate up linearly."),
    Option("clip_grad", float, "Clip the gradient norm to this value (0: no clipping)."),
    Option("precision", str, PRECISION_HELP),
    Option("compile", bool, "Compile the encoder with torch.compile (slow start, faster GPU steps).", ("--compile",)),
    Option("queue_size", int, QUEUE_HELP),
    Option("momentum", float, "Momentum of the key encoder that fills the queue."),
    Option("checkpoint_every", int, "Also save the trainer state every this many steps (0: after each epoch only)."),
    Option("tensorboard", bool, "Also log to RUN/tensorboard (needs the tensorboard extra).", ("--tensorboard",)),
    Option("val_classes", float, "Fraction of the classes held out to validate each epoch; the best epoch is kept."),
    Option("patience", int, "Stop after this many epochs without a better validation MAP@R (0: never)."),
    Option("device", str, "auto, cpu or cuda."),
    Option("seed", int, "Random seed."),
    Option("workers", int, "Processes that decode and augment the images (0: the training process itself)."),
    Option("benchmark", str, BENCHMARK_HELP.format("DATA", "train on its training split")),
    Option("self_supervised", bool, SELF_SUPERVISED_HELP, ("--self-supervised",)),
    Option("adapt", str, ADAPT_HELP),
    Option(
        "ssl_loss",
        str,
        (
            "The self-supervised method beside a supervised loss: simclr, moco, instdisc, hcl, hard, or joint "
            "(the images without labels join the supervised loss's batch, each its own class)."
        ),
    ),
    Option("ssl_temperature", float, "Its temperature (simclr 0.1, moco 0.2, instdisc 0.07, hcl 0.5, hard 0.2)."),
    Option("ssl_weight", float, "Weight of the self-supervised loss beside the supervised one (default 1)."),
    Option("ssl_batch", int, "Images a batch adds for the self-supervised loss (default: half of --batch-size)."),
    Option("ssl_augment", str, "Augmentation of the two views (default strongcrop,jitter,grayscale,blur)."),
    Option("bank_momentum", float, "instdisc: the share of a memory bank row kept when its image comes again."),
    Option("nce_negatives", int, "instdisc: negatives sampled for its NCE estimate (0: a softmax over every image)."),
    Option("proximal", float, "instdisc: weight of the proximal term ||v - bank row||^2 (Wu et al. 2018)."),
)
SWEEP_SELF_SUPERVISED_HELP = "Train each run without labels (the labels only pick the held-out classes)."
RUN_OPTION_HELP = "Run directory to create (config, checkpoints, log)."
RESUME_HELP = (
    "Continue an interrupted run from its last saved trainer state, with its own config.json and data "
    "(DATA may be left out)."
)
OVERWRITE_HELP = "Train into a run directory that already holds a run, starting it over."
OptionalDataArg = Annotated[
    Path | None, typer.Argument(help=DATA_HELP + " Not needed with --resume.", show_default=False)
]


def train(
    data: OptionalDataArg = None,
    *,
    run: Annotated[Path, typer.Option("--run", help=RUN_OPTION_HELP)],
    resume: Annotated[bool, typer.Option("--resume", help=RESUME_HELP)] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help=OVERWRITE_HELP)] = False,
    **options: object,
) -> None:
    """Train an embedding model on an image collection: labeled, partly labeled or without labels (or a benchmark's
    training split); --adapt adds the images of the gallery it will search, without their labels."""
    given = {option.name: options[option.name] for option in OPTIONS if options.get(option.name) is not None}
    run_training(data, RunDir(run), resume, overwrite, given)


_own = inspect.signature(train, eval_str=True)
train.__signature__ = _own.replace(  # type: ignore[attr-defined]  # the OPTIONS join the command's own parameters
    parameters=[*list(_own.parameters.values())[:-1], *(option.parameter() for option in OPTIONS)]
)


def run_training(data: Path | None, run_dir: RunDir, resume: bool, overwrite: bool, given: dict) -> None:
    """Builds the run's TrainConfig (its own, to resume) from the options given, trains, and reports."""
    if data is not None and not given.get("benchmark"):  # a mistyped path is said before torch loads (seconds)
        require_source(data)
    if given.get("adapt") is not None:
        require_source(given["adapt"], "--adapt", "the gallery's image folder or a .txt list")
    for images in (data, given.get("adapt")):
        if images is not None and not given.get("benchmark"):
            _refuse_run_as_data(run_dir.root, Path(images))
    if resume and not run_dir.config.is_file():
        what = f"{run_dir.config}: missing" if run_dir.root.is_dir() else f"--run {run_dir.root}: no such run directory"
        raise RetrievalError(f"{what}; nothing to resume (start the run without --resume)")
    run_dir.refuse_foreign_folder()  # a file, images or an index there, or no folder to be made: before torch loads
    require("torch", "train")
    from training.config import TrainConfig
    from training.loop import train

    if given.get("adapt") is not None:  # kept as a full path: a resumed run (or export) may start elsewhere
        given["adapt"] = str(Path(given["adapt"]).expanduser().resolve())
    if resume:
        config = _resumed(run_dir, data, given)
    else:
        if data is None:
            raise RetrievalError(f"give DATA: {COLLECTION_HINT} (or --resume a run)")
        config = TrainConfig(data=str(data.expanduser().resolve()), **given)
    try:
        result = train(config, run_dir, resume=resume, overwrite=overwrite)
    except KeyboardInterrupt:
        _interrupted(run_dir)
    if not result.reporting:
        return  # under torchrun, process 0 reports
    report_skipped(result.skipped, run_dir.root / "skipped.json")
    console.print(f"{result.describe()}; final loss {result.final_loss:.4f}; checkpoint {run_dir.last_checkpoint}")


def _resumed(run_dir: RunDir, data: Path | None, given: dict) -> TrainConfig:
    """The run's own config, to continue it; options given beside --resume that differ from it are refused (they
    were ignored), except those of how to run it (RESUME_MAY_CHANGE), which apply."""
    from training.config import TrainConfig

    config = TrainConfig.from_dict(read_json(run_dir.config))
    if data is not None and Path(config.data) != data.expanduser().resolve():
        raise RetrievalError(
            f"--resume continues {run_dir.root} on its own data ({config.data}); leave DATA out or give that path"
        )
    changed = [
        name for name, value in given.items() if name not in RESUME_MAY_CHANGE and getattr(config, name) != value
    ]
    if changed:
        theirs = {name: "the default" if getattr(config, name) is None else getattr(config, name) for name in changed}
        listed = ", ".join(f"--{name.replace('_', '-')} {given[name]} (it has {theirs[name]})" for name in changed)
        raise RetrievalError(
            f"--resume continues {run_dir.root} with the options it started with: {listed} would not apply; leave "
            f"{'it' if len(changed) == 1 else 'them'} out, or train a new run (another --run)"
        )
    from training.checkpoints import saved_record
    from training.loop import refuse_finished

    record = saved_record(run_dir.trainer_state)
    if record is not None:  # said before every image is checked again
        refuse_finished(run_dir, record, config)
    return replace(config, **{name: given[name] for name in RESUME_MAY_CHANGE if name in given})


def _interrupted(run: RunDir) -> NoReturn:
    """Ctrl+C: one line saying where the last saved state is and how to go on from it; exit status 130."""
    from training.checkpoints import saved_record

    record = saved_record(run.trainer_state)
    if record is None:
        line = "interrupted before the first epoch ended, nothing saved; start again with --overwrite"
    else:
        done = counted(record.epoch, "finished epoch")  # it said "epoch 1, batch 0"
        done += f" and {counted(record.batch, 'batch', 'batches')} of the next" if record.batch else ""
        line = (
            f"interrupted: the trainer state after {done} is kept in {run.trainer_state}; "
            f"resume with `retrieval train --run {shell_path(run.root)} --resume`"
        )
    stopped_by_ctrl_c(line)


def _sweep_table(rows: list[dict]) -> Table:
    """The sweep's rows as a table: loss, temperature, uniformity and tolerance in both spaces, recall@1, MAP@R."""
    table = Table(title="temperature sweep (held-out classes)")
    for column in ("loss", "temperature", *SWEEP_COLUMNS):
        table.add_column(column)
    for row in rows:
        table.add_row(row["loss"], f"{row['temperature']:g}", *(f"{row[key]:.3f}" for key in SWEEP_KEYS))
    return table


def _sweep_losses(losses: str | None, self_supervised: bool) -> list[str]:
    """--losses "supcon,hard" -> the names (the mode's default when not given), or one line naming an unknown one."""
    from training.config import LOSSES, SSL_LOSSES

    given = ("simclr,hard" if self_supervised else "supcon,hard") if losses is None else losses  # "" is given: empty
    names = list(dict.fromkeys(part.strip().lower() for part in given.split(",")))  # SupCon; a name given twice: once
    unknown = [name for name in names if name and name not in LOSSES and name not in SSL_LOSSES]
    known = {*LOSSES, *SSL_LOSSES}
    choices = ", ".join(sorted(known))
    if unknown:
        raise RetrievalError(f"--losses {losses!r}: unknown loss {unknown[0]!r}; {one_of(unknown[0], sorted(known))}")
    if not any(names):
        raise RetrievalError(f"--losses {losses!r}: give losses separated by commas, from {choices}")
    usable = SSL_LOSSES if self_supervised else LOSSES  # every run of a sweep trains in its one mode (train's own
    wrong = [name for name in names if name and name not in usable]  # refusal named its options, not --losses)
    if wrong and self_supervised:
        raise RetrievalError(
            f"--losses {losses!r}: {wrong[0]} needs labels; with --self-supervised give {', '.join(usable)}"
        )
    if wrong:
        raise RetrievalError(
            f"--losses {losses!r}: {wrong[0]} learns without labels: add --self-supervised, or give {', '.join(usable)}"
        )
    return [name for name in names if name]


def _refuse_out_in_data(out: Path, data: Path) -> None:
    """--out inside the images swept on (or the folder itself): the sweep's plot would be read as one of them."""
    folder, images = out.expanduser().resolve(), data.expanduser().resolve()
    if images.is_dir() and folder.is_relative_to(images):
        raise RetrievalError(
            f"--out {out}: inside the images ({data}), where its plot would be read as one of them; give a folder "
            "outside them, e.g. runs/analyze"
        )


def _refuse_run_as_data(run: Path, data: Path) -> None:
    """--run the image folder itself: the run's files went among the images, and the folder was then read as a run,
    not a collection. (A run in a folder inside the images is left out of them when they are read.)"""
    if data.is_dir() and run.expanduser().resolve() == data.expanduser().resolve():
        raise RetrievalError(
            f"--run {run}: the image folder itself ({data}); give the run a folder of its own, e.g. runs/{run.name}"
        )


def _numbers(text: str) -> list[float]:
    """--temperatures "0.05,0.1" -> [0.05, 0.1] (a value given twice: once, not a second identical run), or one line
    saying what it takes."""
    try:
        values = list(dict.fromkeys(float(part) for part in text.split(",") if part.strip()))
    except ValueError:
        values = []
    if not values or not all(0 < value < math.inf for value in values):
        raise RetrievalError(f"--temperatures {text!r}: give positive numbers separated by commas, e.g. 0.05,0.1,0.5")
    return values


SWEEP_COLUMNS = (
    "uniformity (loss space)",
    "tolerance (loss space)",
    "uniformity (embedding)",
    "tolerance (embedding)",
    "recall@1",
    "MAP@R",
)
SWEEP_KEYS = ("loss_uniformity", "loss_tolerance", "uniformity", "tolerance", "recall@1", "map@r")


def _require_sweep_classes(data: Path) -> None:
    """Refuses data that is not there, or has fewer labeled classes than a sweep trains and measures on."""
    require_source(data, hint=LABELED_COLLECTION_HINT)
    classes = len(load_collection(data).class_counts())
    if classes < SWEEP_CLASSES:
        found = counted(classes, "labeled class", "labeled classes") if classes else "no labeled image"
        raise RetrievalError(
            f"{data}: {found}; the sweep trains on some classes and measures uniformity and tolerance on two or more "
            f"others (with --self-supervised too), so it needs {SWEEP_CLASSES} or more: give {LABELED_COLLECTION_HINT}"
        )


def analyze(
    data: Annotated[Path, typer.Argument(help=ANALYZE_DATA_HELP, show_default=False)],
    out: Annotated[
        Path,
        typer.Option("--out", help="Directory for temperature_sweep.json, temperature_sweep.png and the sweep's runs."),
    ] = Path("runs/analyze"),
    temperatures: Annotated[
        str, typer.Option(help="Comma-separated temperatures to train at.")
    ] = "0.05,0.1,0.2,0.5,1.0",
    losses: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated losses to sweep (supcon, infonce, npair, hcl, hard; with --self-supervised simclr, "
            "moco, instdisc, hcl, hard). Default supcon,hard, or simclr,hard.",
            show_default=False,
        ),
    ] = None,
    epochs: Annotated[int, typer.Option(help="Epochs of each run (short runs show the trend).")] = 5,
    batch_size: Annotated[int, typer.Option(help="Images per batch.")] = 128,
    image_size: Annotated[int, typer.Option(help="Input size in pixels.")] = 64,
    backbone: Annotated[str, typer.Option(help="Backbone, as for train.")] = "resnet18",
    val_classes: Annotated[
        float, typer.Option(help="Fraction of the classes held out, on which uniformity and tolerance are measured.")
    ] = 0.25,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    seed: Annotated[int, typer.Option(help="Random seed (the same for every run).")] = 0,
    self_supervised: Annotated[
        bool, typer.Option("--self-supervised", help=SWEEP_SELF_SUPERVISED_HELP, show_default=False)
    ] = False,
) -> None:
    """Sweep the temperature of SupCon and the hard contrastive loss; plot uniformity and tolerance against it.

    With --self-supervised, the runs learn without labels (Wang & Liu's own setting; --losses then
    names self-supervised methods, default simclr,hard); the labels only pick the held-out classes on
    which uniformity and tolerance are measured.
    """
    _require_sweep_classes(data)  # a mistyped path or too few classes is said before torch is loaded (seconds)
    require("torch", "train")
    from training.analyze import temperature_sweep
    from training.config import TrainConfig

    if not 0 < val_classes < 1:
        raise RetrievalError(
            "--val-classes must be between 0 and 1 (uniformity and "
            f"tolerance are measured on held-out classes), got {val_classes}"
        )
    values = _numbers(temperatures)
    names = _sweep_losses(losses, self_supervised)
    _refuse_out_in_data(out, data)
    writable_folder(out, "--out", make=False)
    settings = {"epochs": epochs, "batch_size": batch_size, "image_size": image_size, "backbone": backbone}
    settings.update(device=device, seed=seed, self_supervised=self_supervised)
    base = TrainConfig(data=str(data.expanduser().resolve()), val_classes=val_classes, **settings)
    for name in names:  # every loss and temperature is checked before hours of training
        for value in values:
            TrainConfig(data=base.data, loss=name, temperature=value, self_supervised=self_supervised)
    console.print(_sweep_table(temperature_sweep(base, out, values, names)))
    console.print(f"wrote {out / 'temperature_sweep.png'} and {out / 'temperature_sweep.json'}")
