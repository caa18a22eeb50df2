"""The gallery index: FAISS vectors with SQLite metadata, saved atomically. Never imports torch."""

from index.store import GalleryIndex, Hit

__all__ = ["GalleryIndex", "Hit"]
