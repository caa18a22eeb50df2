"""Fits the shape of a real encoder's embeddings for bench/index.py's generated galleries.

Embeds a labeled image folder with an exported run (model.onnx) and writes, as JSON: the variances
of the top --dim principal components (summing to 1), the share of the variance that lies between
class means (the rest is within classes, so a smaller share means more overlap between classes),
the share of the squared length taken by the mean vector (embeddings in a cone), and two measures
of intrinsic dimension of the real embeddings: the participation ratio of the spectrum and the
TwoNN estimate (Facco et al. 2017) from each vector's two nearest neighbours.

    python bench/spectrum.py RUN [--images ../shared/datasets/icons] [--dim 128] [--out bench/data/spectrum-NAME.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]

import numpy as np  # noqa: E402

from retrieval.data import load_collection  # noqa: E402
from retrieval.embedders import OnnxEmbedder, embed_items  # noqa: E402
from retrieval.runs import RunDir, read_json  # noqa: E402


def two_nn(vectors: np.ndarray) -> float:
    """TwoNN intrinsic dimension: n / Σ log(r2 / r1) over each vector's first and second neighbour distances."""
    similarity = vectors @ vectors.T
    np.fill_diagonal(similarity, -np.inf)
    nearest = -np.sort(-similarity, axis=1)[:, :2]
    distance = np.sqrt(np.maximum(2 - 2 * nearest, 1e-12))
    ratio = distance[:, 1] / distance[:, 0]
    ratio = ratio[ratio > 1]
    return float(len(ratio) / np.log(ratio).sum())


def fit(vectors: np.ndarray, labels: list[str], dim: int) -> dict:
    """The spectrum, the between-class and mean shares and the intrinsic dimensions of unit embeddings."""
    vectors = vectors.astype(np.float64)
    mean = vectors.mean(axis=0)
    variances = np.linalg.eigvalsh(np.cov((vectors - mean).T))[::-1]
    names = np.array(labels)
    centres = np.stack([vectors[names == label].mean(axis=0) for label in sorted(set(labels))])
    top = variances[:dim] / variances[:dim].sum()
    return {
        "images": len(vectors),
        "classes": len(centres),
        "between_class_share": float(((centres - mean) ** 2).sum(axis=1).mean() / variances.sum()),
        "mean_share": float(mean @ mean / (mean @ mean + variances.sum())),
        "participation_ratio": float(variances.sum() ** 2 / (variances**2).sum()),
        "two_nn": two_nn(vectors),
        "variance_in_top": float(variances[:dim].sum() / variances.sum()),
        "variances": [round(float(v), 7) for v in top],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="an exported run directory (model.onnx, model.json)")
    parser.add_argument("--images", type=Path, default=Path("../shared/datasets/icons"))
    parser.add_argument("--dim", type=int, default=128, help="principal components kept (the generated dimension)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    run = RunDir(args.run)
    if not run.model.is_file():
        raise SystemExit(f"{run.model}: not found; give an exported run (retrieval export RUN)")
    embedder = OnnxEmbedder(run.model, read_json(run.model_card))
    folders = [folder for folder in (args.images / "train", args.images / "test") if folder.is_dir()] or [args.images]
    items = [item for folder in folders for item in load_collection(folder).items]
    embedded = embed_items(embedder, items, progress=False)
    fitted = fit(embedded.vectors, [item.label for item in embedded.items], args.dim)
    card = read_json(run.model_card)
    fitted["encoder"] = {"backbone": card.get("backbone"), "whitening": card.get("whitening"), "sha256": card["sha256"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fitted, indent=1) + "\n")
    shown = {key: value for key, value in fitted.items() if key not in ("variances", "encoder")}
    print(f"wrote {args.out}: {shown}")


if __name__ == "__main__":
    main()
