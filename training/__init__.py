"""Training of image embeddings with supervised contrastive losses, and ONNX export (needs torch).

from training import TrainConfig, export, train

run = RunDir(Path("runs/photos"))
train(TrainConfig(data="photos/train"), run)
export(run)
"""

from training.config import TrainConfig
from training.exporting import export
from training.loop import train

__all__ = ["TrainConfig", "export", "train"]
