"""Image retrieval and metric learning: the shared core (data, preprocessing, embedders, k-NN, metrics, evaluation).

from retrieval import OnnxEmbedder, RunDir, evaluate_collection, load_collection
"""

from retrieval.calibration import MatchThreshold, run_threshold
from retrieval.data import Collection, Item, load_collection
from retrieval.embedders import Embedder, OnnxEmbedder, embed_items
from retrieval.errors import ImageError, RetrievalError
from retrieval.evaluation import Evaluation, calibrate_run, evaluate_collection, evaluate_query_gallery
from retrieval.knn import nearest_neighbours
from retrieval.metrics import retrieval_metrics
from retrieval.runs import RunDir

__version__ = "0.1.0"
__all__ = [
    "Collection",
    "Embedder",
    "Evaluation",
    "ImageError",
    "Item",
    "MatchThreshold",
    "OnnxEmbedder",
    "RetrievalError",
    "RunDir",
    "calibrate_run",
    "embed_items",
    "evaluate_collection",
    "evaluate_query_gallery",
    "load_collection",
    "nearest_neighbours",
    "retrieval_metrics",
    "run_threshold",
]
