"""The gallery index: build, open, search, add and remove (FAISS + SQLite, or Milvus). Never imports torch.

from index import build_index, open_index, search_images, Query
"""

from index.backends import create_index, open_index
from index.build import IndexReport, build_index
from index.edit import Added, add_images, remove_items
from index.search import Query, QueryResult, search_images, search_item, search_items, search_vectors
from index.store import GalleryIndex
from index.types import GalleryBackend, Hit, HitArrays

__all__ = [
    "Added",
    "GalleryBackend",
    "GalleryIndex",
    "Hit",
    "HitArrays",
    "IndexReport",
    "Query",
    "QueryResult",
    "add_images",
    "build_index",
    "create_index",
    "open_index",
    "remove_items",
    "search_images",
    "search_item",
    "search_items",
    "search_vectors",
]
