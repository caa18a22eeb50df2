"""The Gradio search app: query by image, see the top-k with similarity, label and hit/miss, and the run's metrics."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from index.store import GalleryIndex, Hit
from retrieval.data import decode_image, read_image_bytes
from retrieval.embedders import OnnxEmbedder
from retrieval.errors import RetrievalError
from retrieval.runs import RunDir, read_json

SAMPLES_PER_PAGE = 60


@dataclass
class SearchResult:
    """The hits of one query and a one-line summary for people."""

    hits: list[Hit]
    summary: str


class SearchService:
    """An ONNX encoder and the gallery index it built, ready to answer image queries."""

    def __init__(self, run: RunDir, index_dir: Path | None = None, mmap: bool = False) -> None:
        self.run = run
        self.embedder = OnnxEmbedder.from_run(run)
        self.index = GalleryIndex.load(index_dir or run.index, self.embedder.fingerprint, self.embedder.dim, mmap=mmap)
        self.items = self.index.items()
        self.metrics = read_json(run.metrics) if run.metrics.is_file() else None

    def search(self, image_path: str | Path, k: int = 10, query_label: str = "", depth: int | None = None) -> SearchResult:
        """Embeds the image at image_path and returns its k nearest gallery items (depth: nprobe/efSearch).

        Gallery items with the query's exact bytes (the query itself, when picked from the gallery)
        are left out, as in leave-one-out evaluation.
        """
        data, digest = read_image_bytes(Path(image_path))
        image = decode_image(data, image_path)
        hits = [hit for hit in self.index.search(self.embedder.embed([image]), k + 1, depth)[0] if hit.sha256 != digest][:k]
        summary = f"{len(hits)} results"
        if query_label:
            correct = sum(hit.label == query_label for hit in hits)
            summary += f" for label **{query_label}**: {correct}/{len(hits)} hits, first hit at rank {_first_hit(hits, query_label)}"
        return SearchResult(hits, summary)

    def search_item(self, item_id: int, k: int = 10, depth: int | None = None) -> SearchResult:
        """Returns the k nearest gallery items to an indexed item (itself left out), by its id."""
        hits = self.index.search_items([item_id], k, depth)[0]
        return SearchResult(hits, f"{len(hits)} results for item {item_id}")

    def samples(self) -> list[tuple[str, str]]:
        """Returns one gallery image per label (up to SAMPLES_PER_PAGE) as (path, label), to pick queries from."""
        first: dict[str, str] = {}
        for item in self.items.values():
            first.setdefault(item.label, item.path.as_posix())
        return [(path, label) for label, path in first.items()][:SAMPLES_PER_PAGE]

    def served_folders(self) -> list[str]:
        """The only folders whose files the app serves: those holding gallery images."""
        return sorted({item.path.parent.as_posix() for item in self.items.values()})


def _first_hit(hits: list[Hit], label: str) -> str:
    return next((str(rank) for rank, hit in enumerate(hits, 1) if hit.label == label), "none")


def result_gallery(result: SearchResult, query_label: str) -> list[tuple[str, str]]:
    """Returns gallery entries (path, caption): rank, similarity, label, file name and a hit/miss mark."""
    entries = []
    for rank, hit in enumerate(result.hits, 1):
        mark = "" if not query_label else ("HIT · " if hit.label == query_label else "miss · ")
        entries.append((hit.path, f"{mark}#{rank} · {hit.score:.3f} · {hit.label} · {Path(hit.path).name}"))
    return entries


def metrics_rows(metrics: dict | None) -> list[list[str]]:
    """Returns the run's metrics.json as rows of (metric, value) for a table."""
    if not metrics:
        return [["(no metrics yet)", "run `retrieval evaluate RUN IMAGES`"]]
    return [[key, f"{value:.4f}" if isinstance(value, float) else str(value)] for key, value in metrics.items() if not isinstance(value, (dict, list))]


def build_app(service: SearchService) -> gr.Blocks:
    """Returns the Gradio interface over a search service."""
    samples = service.samples()
    labels = sorted({item.label for item in service.items.values() if item.label})

    def run_search(image_path: str | None, k: float, query_label: str | None) -> tuple[list[tuple[str, str]], str]:
        if not image_path:
            return [], "Upload an image or pick one from the gallery below."
        try:
            result = service.search(image_path, int(k), query_label or "")
        except RetrievalError as error:
            return [], f"⚠️ {error}"
        return result_gallery(result, query_label or ""), result.summary

    def pick(event: gr.SelectData) -> tuple[str, str]:
        path, label = samples[event.index]
        return path, label

    with gr.Blocks(title="retrieval · image search") as demo:
        gr.Markdown(f"# Image search\nRun `{service.run.root}` · {len(service.index)} gallery images · {len(labels)} labels")
        with gr.Row():
            with gr.Column(scale=1):
                query = gr.Image(label="Query image", type="filepath", sources=["upload", "clipboard"], height=256)
                query_label = gr.Dropdown(labels, value="", label="Query label (optional: marks hits and misses)", allow_custom_value=True)
                k = gr.Slider(1, 50, value=10, step=1, label="k")
                button = gr.Button("Search", variant="primary")
            with gr.Column(scale=2):
                summary = gr.Markdown()
                results = gr.Gallery(label="Nearest neighbours", columns=5, height=480, object_fit="contain")
        with gr.Tab("Pick a query from the gallery"):
            picker = gr.Gallery(value=samples, label="Gallery (click an image to query with it)", columns=10, height=360, allow_preview=False)
        with gr.Tab("Metrics"):
            with gr.Row():
                gr.Dataframe(metrics_rows(service.metrics), headers=["metric", "value"], interactive=False)
                if service.run.loss_plot.is_file():
                    gr.Image(str(service.run.loss_plot), label="training loss", interactive=False)
        inputs = [query, k, query_label]
        button.click(run_search, inputs, [results, summary], api_name="search")
        picker.select(pick, None, [query, query_label], api_name=False).then(run_search, inputs, [results, summary], api_name=False)
        query.upload(lambda: "", None, query_label, api_name=False)  # an uploaded image's label is unknown
    return demo


def serve(run: RunDir, host: str = "127.0.0.1", port: int = 7860, index_dir: Path | None = None) -> None:
    """Starts the app on host:port and blocks until interrupted."""
    service = SearchService(run, index_dir)
    demo = build_app(service)
    demo.queue(default_concurrency_limit=2).launch(
        server_name=host,
        server_port=port,
        allowed_paths=service.served_folders(),
        show_error=True,
        max_file_size="20mb",
        inbrowser=False,
    )
