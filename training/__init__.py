"""Training of image embeddings with supervised contrastive losses, and ONNX export (needs torch)."""
