"""The `retrieval` command line: train, export, index, search, evaluate, serve, and the demo.

Stages are imported inside their commands, so that `retrieval search` and `retrieval serve` run
without torch installed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from retrieval.data import Skipped, load_collection
from retrieval.errors import RetrievalError
from retrieval.extras import require
from retrieval.runs import RunDir, read_json, write_json

app = typer.Typer(
    name="retrieval",
    help="Train image embeddings with contrastive losses, export them to ONNX, index a gallery with FAISS, search it in the browser.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
errors = Console(stderr=True)

RunArg = Annotated[Path, typer.Argument(help="Run directory (holds config, checkpoints, model.onnx, index/).", show_default=False)]
DataArg = Annotated[Path, typer.Argument(help="An image folder ROOT/<label>/<image>, a CSV with columns path,label, or with --benchmark the extracted archive.", show_default=False)]
BenchmarkOption = Annotated[
    Optional[str],
    typer.Option(help="Read DATA as a standard benchmark's extracted archive: cub, cars196, sop or inshop (train: its training split; evaluate: its test protocol).", show_default=False),
]


@app.command()
def train(
    data: DataArg,
    run: Annotated[Path, typer.Option("--run", help="Run directory to create (config, checkpoints, log).")],
    loss: Annotated[str, typer.Option(help="Loss: supcon (Khosla et al. 2020), infonce (NT-Xent), npair (Sohn 2016), hcl (Robinson et al. 2021), hard (Wang & Liu 2021).")] = "supcon",
    temperature: Annotated[Optional[float], typer.Option(help="Softmax temperature of the loss (default: supcon 0.05, infonce 0.07, npair 1.0, hcl 0.5, hard 0.2).")] = None,
    epochs: Annotated[int, typer.Option(help="Passes over the data.")] = 50,
    batch_size: Annotated[int, typer.Option(help="Images per batch (classes x images per class).")] = 128,
    images_per_class: Annotated[int, typer.Option(help="Images of each class in a batch.")] = 4,
    backbone: Annotated[str, typer.Option(help="torchvision backbone (resnet18, resnet34, resnet50, mobilenet_v3_small, mobilenet_v3_large, efficientnet_b0, convnext_tiny, vit_b_16) or timm:<model> with timm installed.")] = "resnet18",
    pretrained: Annotated[bool, typer.Option(help="Start from ImageNet weights (downloaded by torchvision; needs a network once).")] = False,
    image_size: Annotated[int, typer.Option(help="Input size in pixels (square).")] = 64,
    stem: Annotated[str, typer.Option(help="imagenet, or small: a ResNet's first convolution 3x3 stride 1 for small inputs (4x the compute).")] = "imagenet",
    augment: Annotated[Optional[str], typer.Option(help="Augmentation steps, comma-separated, from crop, color, hue, grayscale, invert, blur, affine, erase; or none (default: the recipe's, see docs/recipe.md).", show_default=False)] = None,
    embedding_dim: Annotated[Optional[int], typer.Option(help="Embedding dimension (default: the backbone's feature width, e.g. 512 for resnet18).")] = None,
    learning_rate: Annotated[float, typer.Option(help="Peak learning rate, reached after the warm-up, then decayed to 0 along a cosine.")] = 1e-3,
    weight_decay: Annotated[float, typer.Option(help="Weight decay of the optimizer.")] = 1e-4,
    optimizer: Annotated[str, typer.Option(help="adamw, or sgd (Nesterov momentum 0.9; give it a larger --learning-rate, e.g. 0.1).")] = "adamw",
    warmup: Annotated[float, typer.Option(help="Fraction of the steps spent warming the learning rate up linearly.")] = 0.1,
    clip_grad: Annotated[float, typer.Option(help="Clip the gradient norm to this value (0: no clipping).")] = 0.0,
    precision: Annotated[str, typer.Option(help="Autocast precision: fp32, bf16, fp16 (with loss scaling), or auto (bf16 on a GPU that has it, else fp32). channels_last is used on GPUs.")] = "auto",
    compile_model: Annotated[bool, typer.Option("--compile", help="Compile the encoder with torch.compile (slow start, faster steps on GPUs).")] = False,
    queue_size: Annotated[int, typer.Option(help="MoCo memory: keys of earlier batches from a momentum encoder, contrasted as extra rows (supcon and infonce; 0: none).")] = 0,
    momentum: Annotated[float, typer.Option(help="Momentum of the key encoder that fills the queue.")] = 0.999,
    checkpoint_every: Annotated[int, typer.Option(help="Also save the resumable trainer state every this many steps (0: after each epoch only).")] = 0,
    tensorboard: Annotated[bool, typer.Option("--tensorboard", help="Also log loss, learning rate and validation metrics to RUN/tensorboard (needs the tensorboard extra).")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Continue an interrupted run from its last saved trainer state, with its own config.json.")] = False,
    val_classes: Annotated[float, typer.Option(help="Fraction of the classes held out to validate each epoch (recall@1, MAP@R); the best epoch is exported.")] = 0.0,
    patience: Annotated[int, typer.Option(help="Stop after this many epochs without a better validation MAP@R (0: never).")] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    benchmark: BenchmarkOption = None,
) -> None:
    """Train an embedding model on a labeled image collection (or a benchmark's training split)."""
    require("torch", "train")
    from training.config import TrainConfig
    from training.train import train as run_training

    if resume:
        config = TrainConfig.from_dict(read_json(RunDir(run).config))
        if Path(config.data) != data.expanduser().resolve():
            raise RetrievalError(f"--resume continues {run} on its own data ({config.data}); give that path, not {data}")
    else:
        config = TrainConfig(
            data=str(data.expanduser().resolve()),
            benchmark=benchmark,
            loss=loss,
            temperature=temperature,
            epochs=epochs,
            batch_size=batch_size,
            images_per_class=images_per_class,
            backbone=backbone,
            pretrained=pretrained,
            image_size=image_size,
            stem=stem,
            augment=augment,
            embedding_dim=embedding_dim,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            optimizer=optimizer,
            warmup=warmup,
            clip_grad=clip_grad,
            precision=precision,
            compile=compile_model,
            queue_size=queue_size,
            momentum=momentum,
            checkpoint_every=checkpoint_every,
            tensorboard=tensorboard,
            val_classes=val_classes,
            patience=patience,
            device=device,
            seed=seed,
        )
    result = run_training(config, RunDir(run), resume=resume)
    if not result.reporting:
        return  # under torchrun, process 0 reports
    report_skipped(result.skipped, RunDir(run).root / "skipped.json")
    console.print(f"trained on {result.num_images} images of {result.num_classes} classes; final loss {result.final_loss:.4f}; checkpoint {RunDir(run).last_checkpoint}")


@app.command()
def analyze(
    data: DataArg,
    out: Annotated[Path, typer.Option("--out", help="Directory for temperature_sweep.json, temperature_sweep.png and the sweep's runs.")] = Path("runs/analyze"),
    temperatures: Annotated[str, typer.Option(help="Comma-separated temperatures to train at.")] = "0.05,0.1,0.2,0.5,1.0",
    losses: Annotated[str, typer.Option(help="Comma-separated losses to sweep (any of supcon, infonce, npair, hcl, hard).")] = "supcon,hard",
    epochs: Annotated[int, typer.Option(help="Epochs of each run (short runs show the trend).")] = 5,
    batch_size: Annotated[int, typer.Option(help="Images per batch.")] = 128,
    image_size: Annotated[int, typer.Option(help="Input size in pixels.")] = 64,
    backbone: Annotated[str, typer.Option(help="Backbone, as for train.")] = "resnet18",
    val_classes: Annotated[float, typer.Option(help="Fraction of the classes held out, on which uniformity and tolerance are measured.")] = 0.25,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    seed: Annotated[int, typer.Option(help="Random seed (the same for every run).")] = 0,
) -> None:
    """Sweep the temperature of SupCon and the hard contrastive loss; plot uniformity and tolerance against it."""
    require("torch", "train")
    from training.analyze import temperature_sweep
    from training.config import TrainConfig

    if not 0 < val_classes < 1:
        raise RetrievalError(f"--val-classes must be between 0 and 1 (uniformity and tolerance are measured on held-out classes), got {val_classes}")
    try:
        values = [float(part) for part in temperatures.split(",") if part.strip()]
    except ValueError:
        raise RetrievalError(f"--temperatures {temperatures!r}: give numbers separated by commas, e.g. 0.05,0.1,0.5") from None
    names = [part.strip() for part in losses.split(",") if part.strip()]
    base = TrainConfig(data=str(data.expanduser().resolve()), epochs=epochs, batch_size=batch_size, image_size=image_size, backbone=backbone, val_classes=val_classes, device=device, seed=seed)
    for name in names:  # every loss and temperature is checked before hours of training
        for value in values:
            TrainConfig(data=base.data, loss=name, temperature=value)
    rows = temperature_sweep(base, out, values, names)
    table = Table(title="temperature sweep (held-out classes)")
    for column in ("loss", "temperature", "uniformity (loss space)", "tolerance (loss space)", "uniformity (embedding)", "tolerance (embedding)", "recall@1", "MAP@R"):
        table.add_column(column)
    for row in rows:
        cells = [f"{row[key]:.3f}" for key in ("loss_uniformity", "loss_tolerance", "uniformity", "tolerance", "recall@1", "map@r")]
        table.add_row(row["loss"], f"{row['temperature']:g}", *cells)
    console.print(table)
    console.print(f"wrote {out / 'temperature_sweep.png'} and {out / 'temperature_sweep.json'}")


@app.command()
def export(
    run: RunArg,
    fp16: Annotated[bool, typer.Option("--fp16", help="Export in float16 for GPUs (float32 inputs and outputs, normalisations kept in float32).")] = False,
) -> None:
    """Export the run's encoder to RUN/model.onnx and RUN/model.json, checked against PyTorch."""
    require("torch", "train")
    from training.export import export as run_export

    parity = run_export(RunDir(run), float16=fp16)
    console.print(f"wrote {RunDir(run).model} ({parity.precision}; vs PyTorch: {parity.describe()})")


@app.command()
def index(
    run: RunArg,
    images: Annotated[Path, typer.Argument(help="Images to index: a folder (labels from ROOT/<label>/ when present), a CSV path,label, or a .txt list of paths.", show_default=False)],
    index_dir: Annotated[Optional[Path], typer.Option("--index", help="Index directory (default: RUN/index).")] = None,
    sync: Annotated[bool, typer.Option("--sync", help="Also remove entries whose files are no longer in IMAGES.")] = False,
    rebuild: Annotated[bool, typer.Option("--rebuild", help="Ignore the existing index and build it anew.")] = False,
    batch_size: Annotated[Optional[int], typer.Option(help="Images per encoder call (default: 64 on CPU, 256 on CUDA).")] = None,
    threads: Annotated[Optional[int], typer.Option(help="ONNX Runtime intra-op threads (default: all cores).")] = None,
    faiss_type: Annotated[Optional[str], typer.Option("--faiss", help='FAISS factory string for a new index, e.g. "HNSW32", "IVF4096,Flat", "OPQ32,IVF4096,PQ32" (default: chosen from the size and --memory).', show_default=False)] = None,
    memory: Annotated[Optional[str], typer.Option("--memory", help="Memory budget of a new index, e.g. 4GB or 512MiB (default: half of this machine's memory).", show_default=False)] = None,
    engine: Annotated[str, typer.Option(help="Where to embed: local (this process) or ray (Ray Data: CPU decoding tasks, an actor pool of encoders).")] = "local",
    address: Annotated[Optional[str], typer.Option(help="With --engine ray: the cluster's address (default: start a local Ray).", show_default=False)] = None,
    workers: Annotated[Optional[int], typer.Option(min=1, help="With --engine ray: encoder actors (default: one per GPU, else one per two CPUs).", show_default=False)] = None,
    backend: Annotated[str, typer.Option(help="Where a new index lives: faiss (files in the index directory) or milvus (a collection at --uri).")] = "faiss",
    uri: Annotated[Optional[str], typer.Option(help="With --backend milvus: http://host:19530, or a file for Milvus Lite (e.g. gallery.db).", show_default=False)] = None,
    milvus_index: Annotated[Optional[str], typer.Option("--milvus-index", help="With --backend milvus: force a Milvus index type (FLAT, IVF_FLAT, IVF_SQ8, IVF_PQ, HNSW, GPU_CAGRA).", show_default=False)] = None,
) -> None:
    """Embed a gallery with the run's ONNX model and add it to its FAISS index (incremental and resumable).

    A new index is exact (Flat) up to 100,000 images, then IVF-Flat, IVF-SQ8 or OPQ+IVF-PQ as the
    memory budget allows, with its search depth tuned to recall@10 >= 0.95 (see `retrieval index-stats`).
    """
    from index.build import build_index
    from index.choice import parse_memory
    from index.milvus import MilvusOptions
    from index.ray_engine import RayOptions
    from retrieval.embedders import OnnxEmbedder

    run_dir = RunDir(run)
    budget = parse_memory(memory) if memory else None
    embedder = OnnxEmbedder.from_run(run_dir, threads)
    target = index_dir or run_dir.index
    if engine not in ("local", "ray"):
        raise RetrievalError(f"--engine {engine!r}: use local or ray")
    ray = RayOptions(address, workers) if engine == "ray" else None
    if ray is not None:
        require("ray", "ray")
    if backend not in ("faiss", "milvus") or (backend == "milvus") != (uri is not None):
        raise RetrievalError(f"--backend {backend!r}: use faiss, or milvus with --uri (a Milvus address, or a file for Milvus Lite)")
    milvus = MilvusOptions(uri, milvus_index) if uri is not None else None
    if milvus is not None:
        require("pymilvus", "milvus")
    report = build_index(
        embedder, load_collection(images), target, sync=sync, rebuild=rebuild, batch_size=batch_size, factory=faiss_type, memory=budget, ray=ray, milvus=milvus
    )
    report_skipped(report.skipped, target / "skipped.json")
    console.print(
        f"index {target}: {len(report.index)} images · embedded {report.embedded} · resumed {report.resumed} · "
        f"unchanged {report.unchanged} · removed {report.removed} · skipped {len(report.skipped)}"
    )


@app.command()
def search(
    run: RunArg,
    image: Annotated[Optional[Path], typer.Argument(help="Query image file (or give --id).", show_default=False)] = None,
    item_id: Annotated[Optional[int], typer.Option("--id", help="Query with an item already in the index, by its id (itself left out).", show_default=False)] = None,
    k: Annotated[int, typer.Option("-k", "--k", help="Number of neighbours.")] = 10,
    index_dir: Annotated[Optional[Path], typer.Option("--index", help="Index directory (default: RUN/index).")] = None,
    depth: Annotated[Optional[int], typer.Option("--depth", help="nprobe (IVF) or efSearch (HNSW) for this search (default: the value tuned at build time).", show_default=False)] = None,
    mmap: Annotated[bool, typer.Option("--mmap", help="Leave the index's vectors on disk, memory-mapped (galleries larger than memory).")] = False,
    label: Annotated[Optional[str], typer.Option("--label", help="Only gallery items with this label.", show_default=False)] = None,
) -> None:
    """Print the k nearest gallery images to a query image, or to an indexed item (--id)."""
    from app.service import SearchService

    if (image is None) == (item_id is None):
        raise RetrievalError("give a query IMAGE or --id of an indexed item (one of the two)")
    service = SearchService(RunDir(run), index_dir, mmap=mmap)
    result = service.search(image, k, depth=depth, only=label) if image is not None else service.search_item(int(item_id), k, depth, only=label)  # type: ignore[arg-type]
    if result.error:
        raise RetrievalError(result.summary.removeprefix("⚠️").strip())
    table = Table(title=f"nearest to {image if image is not None else f'item {item_id}'}")
    for column in ("rank", "similarity", "label", "path"):
        table.add_column(column)
    for rank, hit in enumerate(result.hits, 1):
        table.add_row(str(rank), f"{hit.score:.4f}", hit.label, hit.path)
    console.print(table)


@app.command("index-stats")
def index_stats(
    index_dir: Annotated[Path, typer.Argument(help="An index directory, or a run directory holding index/.", show_default=False)],
    sample: Annotated[int, typer.Option(help="Own vectors used as queries to measure recall@10 against exact search.")] = 1000,
    mmap: Annotated[bool, typer.Option("--mmap", help="Open the index memory-mapped.")] = False,
) -> None:
    """Show an index's size, type, parameters and memory, and measure its recall@10 against exact search."""
    from index.stats import index_stats as measure

    directory = index_dir / "index" if (index_dir / "index" / "manifest.json").is_file() else index_dir
    table = Table(title=f"index {directory}")
    table.add_column("")
    table.add_column("", overflow="fold")
    for key, value in measure(directory, sample, mmap).items():
        table.add_row(key, _format(value) if not isinstance(value, dict) else ", ".join(f"{name}={setting}" for name, setting in value.items()) or "none")
    console.print(table)


@app.command()
def evaluate(
    run: RunArg,
    images: Annotated[Optional[Path], typer.Argument(help="A labeled collection to score leave-one-out, or with --benchmark the extracted archive (omit it with --query/--gallery).", show_default=False)] = None,
    k: Annotated[str, typer.Option("-k", "--k", help="Comma-separated k values for recall@k and precision@k.")] = "1,5,10",
    query: Annotated[Optional[Path], typer.Option("--query", help="Query images, scored against --gallery (the In-Shop protocol).")] = None,
    gallery: Annotated[Optional[Path], typer.Option("--gallery", help="Gallery images for --query.")] = None,
    split_classes: Annotated[float, typer.Option(help="Score only a seeded, class-disjoint fraction of the classes of IMAGES (0: all).")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed of --split-classes.")] = 0,
    benchmark: BenchmarkOption = None,
    compare: Annotated[Optional[Path], typer.Option("--compare", help="A second run directory, scored on the same protocol and shown side by side.", show_default=False)] = None,
) -> None:
    """Score retrieval on labeled images; writes RUN/metrics.json and plots in RUN/plots/ (with --compare, also RUN/comparison.json)."""
    from retrieval.embedders import OnnxEmbedder
    from retrieval.evaluation import Evaluation, evaluate_collection, evaluate_query_gallery, write_plots
    from retrieval.plots import plot_recall_curves

    ks = parse_ks(k)
    if (query is None) != (gallery is None):
        raise RetrievalError("--query and --gallery go together: give both (or neither, with IMAGES)")
    if (images is None) == (query is None):
        raise RetrievalError("give either IMAGES (leave-one-out) or --query Q --gallery G, not both or neither")
    if split_classes and images is None:
        raise RetrievalError("--split-classes splits IMAGES; it does not apply to --query/--gallery")
    if benchmark and (images is None or split_classes):
        raise RetrievalError("--benchmark reads IMAGES as the extracted archive and scores its own test protocol; give IMAGES, without --query/--gallery or --split-classes")
    if benchmark:
        from retrieval.benchmarks import load_benchmark

        chosen = load_benchmark(benchmark, images)  # type: ignore[arg-type]
        test, queries, pool = chosen.test, chosen.query, chosen.gallery
    elif images is not None:
        test, queries, pool = load_collection(images), None, None
    else:
        test, queries, pool = None, load_collection(query), load_collection(gallery)  # type: ignore[arg-type]

    def score(run_path: Path) -> Evaluation:
        embedder = OnnxEmbedder.from_run(RunDir(run_path))
        if test is not None:
            return evaluate_collection(embedder, test, ks, split_classes=split_classes, seed=seed)
        assert queries is not None and pool is not None
        return evaluate_query_gallery(embedder, queries, pool, ks)

    run_dir = RunDir(run)
    evaluation = score(run)
    if benchmark:
        evaluation.metrics["benchmark"] = benchmark
    write_json(run_dir.metrics, evaluation.metrics)
    write_plots(evaluation, run_dir.plots)
    report_skipped(evaluation.skipped, None)
    columns = {run_dir.root.name: evaluation.metrics}
    if compare is not None:
        other = score(compare)
        names = (run_dir.root.name, compare.name) if compare.name != run_dir.root.name else (str(run), str(compare))
        columns = {names[0]: evaluation.metrics, names[1]: other.metrics}
        write_json(run_dir.root / "comparison.json", {"protocol": evaluation.metrics["protocol"], "runs": {str(run): evaluation.metrics, str(compare): other.metrics}})
        plot_recall_curves({label: metrics["cmc"] for label, metrics in columns.items()}, run_dir.plots / "compare_recall_at_k.png", f"recall@k ({evaluation.metrics['protocol']})")
        numbers = [key for key, value in evaluation.metrics.items() if isinstance(value, float) and isinstance(other.metrics.get(key), float)]
        columns[f"{names[1]} - {names[0]}"] = {key: other.metrics[key] - evaluation.metrics[key] for key in numbers}
    console.print(metrics_table(columns))
    console.print(f"wrote {run_dir.metrics}{' and comparison.json' if compare else ''} and the plots in {run_dir.plots}")


@app.command()
def serve(
    run: RunArg,
    host: Annotated[str, typer.Option(help="Address to bind; 127.0.0.1 keeps the app on this machine (any other address needs --auth).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 7860,
    index_dir: Annotated[Optional[Path], typer.Option("--index", help="Index directory (default: RUN/index).")] = None,
    allow_write: Annotated[bool, typer.Option("--allow-write", help="Let users add images (kept in the index's sibling uploads/ folder) and remove items.")] = False,
    auth: Annotated[Optional[str], typer.Option(help="user:password required to use the app (or set RETRIEVAL_AUTH); needed off loopback.")] = None,
    max_upload: Annotated[str, typer.Option(help="Largest upload accepted, e.g. 20MB.")] = "20MB",
    mmap: Annotated[bool, typer.Option("--mmap", help="Leave the index vectors on disk (memory-mapped).")] = False,
    max_batch: Annotated[int, typer.Option(min=1, help="Queued searches embedded together in one call.")] = 16,
) -> None:
    """Serve the search app for the run's index in the browser: search, browse, metrics, embedding map and an API."""
    from app.server import serve as run_server

    run_server(RunDir(run), host, port, index_dir, allow_write=allow_write, auth=auth, max_upload=max_upload, mmap=mmap, max_batch=max_batch)


@app.command()
def demo(
    run: Annotated[Path, typer.Option("--run", help="Run directory for the demo.")] = Path("runs/demo"),
    serve_app: Annotated[bool, typer.Option("--serve/--no-serve", help="Serve the app at the end.")] = True,
    epochs: Annotated[Optional[int], typer.Option(help="Training epochs (default: those of `retrieval train`).")] = None,
    classes: Annotated[Optional[int], typer.Option(help="Use only the first N classes of each split (a quicker look).")] = None,
    host: Annotated[str, typer.Option(help="Address to bind the app to.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port of the app.")] = 7860,
) -> None:
    """Train on the embedded icons dataset, export, index and evaluate its unseen test classes, then serve."""
    require("torch", "train")
    from retrieval.demo import run_demo

    outcome = run_demo(RunDir(run), epochs=epochs, classes=classes)
    console.print(metrics_table({"trained model": outcome.model_metrics, "raw pixels 16x16 gray": outcome.baseline_metrics}))
    console.print(f"run directory: {run}  (train {outcome.train_seconds:.0f}s, total {outcome.total_seconds:.0f}s)")
    if serve_app:
        console.print(f"serving the search app at http://{host}:{port}  (Ctrl+C to stop)")
        serve(run, host, port)


def parse_ks(text: str) -> list[int]:
    """Parses "1,5,10" into [1, 5, 10]."""
    try:
        ks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise RetrievalError(f"-k {text!r}: give whole numbers separated by commas, e.g. 1,5,10") from None
    if not ks or ks[0] < 1:
        raise RetrievalError(f"-k {text!r}: every k must be at least 1")
    return ks


def metrics_table(columns: dict[str, dict]) -> Table:
    """Returns a table with one row per metric and one column per evaluated model."""
    table = Table(title="retrieval metrics")
    table.add_column("metric")
    for name in columns:
        table.add_column(name, justify="right")
    first = next(iter(columns.values()))
    for key, value in first.items():
        if isinstance(value, (int, float)):
            table.add_row(key, *(_format(metrics.get(key)) for metrics in columns.values()))
    return table


def _format(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, float) else "" if value is None else str(value)


def report_skipped(skipped: list[Skipped], report: Path | None) -> None:
    """Tells how many files were skipped and where the list is (or prints the first few)."""
    if not skipped:
        return
    where = f"; the list is in {report}" if report else ""
    errors.print(f"skipped {len(skipped)} file(s){where}", soft_wrap=True)
    for entry in skipped[:5]:
        errors.print(f"  {entry.path}: {entry.reason}", highlight=False, soft_wrap=True, markup=False)
    if len(skipped) > 5:
        errors.print(f"  … and {len(skipped) - 5} more")


def main(argv: list[str] | None = None) -> int:
    """Runs the command line and returns its exit status; our own errors become one line on stderr and status 2."""
    for stream in (sys.stdout, sys.stderr):  # file names that are not valid UTF-8 are printed escaped, not a crash
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        app(args=argv, prog_name="retrieval")
    except RetrievalError as error:
        errors.print(f"error: {error}", highlight=False, soft_wrap=True, markup=False)
        return 2
    except SystemExit as exit_:  # the command line parser exits by itself, with 0 after --help
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
