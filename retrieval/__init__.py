"""Image retrieval and metric learning: the shared core (data, preprocessing, embedders, metrics, CLI)."""

__version__ = "0.1.0"
