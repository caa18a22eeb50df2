"""A Milvus backend for the gallery index (`retrieval index RUN IMAGES --backend milvus --uri URI`).

The index directory keeps only `manifest.json` (backend, uri, collection, index type, dimension,
encoder, ...); the vectors and the items (id, path, label, sha256, added_at) live in one Milvus
collection. URI is a Milvus server or cluster (http://host:19530) or a local file for Milvus Lite
(gallery.db). The index type is index.choice's pick for the gallery, translated: Flat → FLAT,
IVFn,Flat → IVF_FLAT, IVFn,SQ8 → IVF_SQ8, OPQm,IVFn,PQm → IVF_PQ, HNSWm → HNSW; `--milvus-index`
forces any type the server has (GPU_CAGRA on a server with GPUs; Milvus Lite has FLAT, IVF_FLAT,
IVF_SQ8 and HNSW). An update removes, inserts and flushes, then rewrites the manifest atomically; the
collection is the record of what is indexed (a load counts its rows). One writer at a time, as for
FAISS (index.disk.writer_lock); a Milvus Lite file is opened by one process at a time (serve it with
`milvus-lite server` to share it).
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from index.choice import IndexChoice, choose_index
from index.types import (
    MANIFEST,
    Additions,
    Hit,
    HitArrays,
    IndexFacts,
    Manifest,
    ManifestFacts,
    Row,
    rebuild_advice,
    search_queries,
    storable,
    unknown_ids,
)
from retrieval.data import Item
from retrieval.errors import RetrievalError
from retrieval.extras import require
from retrieval.runs import write_json

BACKEND = "milvus"
FETCH = 1000  # rows per page when listing the collection
_clients: dict[str, object] = {}


@dataclass(frozen=True)
class MilvusOptions:
    """Where `retrieval index --backend milvus` keeps a new index."""

    uri: str  # http://host:19530, or a file for Milvus Lite
    index_type: str | None = None  # a Milvus index type instead of the automatic choice


def milvus_type(factory: str) -> tuple[str, dict]:
    """The Milvus index type and build parameters that match a FAISS factory string."""
    nlist = re.search(r"IVF(\d+)", factory)
    if factory == "Flat":
        return "FLAT", {}
    links = re.match(r"HNSW(\d*)", factory)
    if links:
        return "HNSW", {"M": int(links.group(1) or 32), "efConstruction": 200}
    if nlist is None:
        raise RetrievalError(
            f"{factory!r} has no Milvus counterpart; give --milvus-index "
            "(FLAT, IVF_FLAT, IVF_SQ8, IVF_PQ, HNSW, GPU_CAGRA, ...)"
        )
    lists = int(nlist.group(1))
    product = re.search(r"PQ(\d+)", factory)
    if product:
        return "IVF_PQ", {"nlist": lists, "m": int(product.group(1)), "nbits": 8}
    return ("IVF_SQ8" if "SQ8" in factory else "IVF_FLAT"), {"nlist": lists}


def default_depth(index_type: str, parameters: dict) -> dict:
    """The search depth a new collection is searched with unless a query says otherwise."""
    if index_type.startswith("IVF"):
        return {"nprobe": max(16, int(parameters.get("nlist", 256)) // 16)}
    if index_type.startswith("HNSW"):
        return {"efSearch": 128}
    return {}


def connect(uri: str) -> object:
    """A MilvusClient for uri (one per process and uri)."""
    pymilvus = require("pymilvus", "milvus")
    # Milvus Lite lacks a timestamp call pymilvus warns about on every listing
    logging.getLogger("pymilvus").setLevel(logging.ERROR)
    if uri not in _clients:
        try:
            _clients[uri] = pymilvus.MilvusClient(uri)
        except Exception as error:  # pymilvus raises its own untyped errors for unreachable servers
            raise RetrievalError(
                f"--uri {uri}: cannot connect to Milvus ({str(error).splitlines()[0][:200]})"
            ) from None
    return _clients[uri]


def resolve_uri(uri: str) -> str:
    """Server addresses as given; a Milvus Lite file as an absolute path (the manifest may be read from elsewhere)."""
    return uri if re.match(r"^[a-z]+://", uri) else str(Path(uri).expanduser().resolve())


class MilvusIndex(ManifestFacts):
    """The gallery index on a Milvus collection (a GalleryBackend, like index.store.GalleryIndex)."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.directory = directory
        self.manifest = manifest
        self.client = connect(str(manifest.uri))
        self.collection = str(manifest.collection)

    def __len__(self) -> int:
        return self.manifest.count

    @classmethod
    def create(
        cls,
        directory: Path,
        additions: Iterable[Additions],
        encoder_sha256: str,
        dim: int,
        uri: str,
        count: int,
        memory: int | None = None,
        index_type: str | None = None,
    ) -> MilvusIndex:
        """Creates the collection (dropping one of the same name) for count items, adds them and writes the manifest."""
        pymilvus = require("pymilvus", "milvus")
        uri = resolve_uri(uri)
        client = connect(uri)
        # one per index directory
        collection = f"retrieval_{hashlib.sha256(str(Path(directory).resolve()).encode()).hexdigest()[:16]}"
        choice = (
            IndexChoice(index_type, "given with --milvus-index") if index_type else choose_index(count, dim, memory)
        )
        milvus_index, parameters = (index_type, {}) if index_type else milvus_type(choice.factory)
        schema = pymilvus.MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        schema.add_field("id", pymilvus.DataType.INT64, is_primary=True)
        schema.add_field("embedding", pymilvus.DataType.FLOAT_VECTOR, dim=dim)
        for name, length in (("path", 4096), ("label", 1024), ("sha256", 64), ("added_at", 32)):
            schema.add_field(name, pymilvus.DataType.VARCHAR, max_length=length)
        index_params = client.prepare_index_params()
        index_params.add_index(field_name="embedding", index_type=milvus_index, metric_type="IP", params=parameters)
        try:
            if client.has_collection(collection):
                client.drop_collection(collection)
            client.create_collection(collection, schema=schema, index_params=index_params)
        except Exception as error:  # the server's refusal, e.g. an index type it does not have
            raise RetrievalError(
                f"Milvus at {uri} refused the collection "
                f"({str(error).splitlines()[0][:200]}); try another --milvus-index"
            ) from None
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        manifest = Manifest(
            dim=dim,
            count=0,
            next_id=1,
            encoder_sha256=encoder_sha256,
            created=now,
            updated=now,
            index_type=milvus_index,
            choice=choice.reason if not index_type else "given with --milvus-index",
            search=default_depth(milvus_index, parameters),
            backend=BACKEND,
            uri=uri,
            collection=collection,
            index_params=parameters,
        )
        return cls(Path(directory), manifest).update(additions, [])

    @classmethod
    def open(cls, directory: Path, manifest: Manifest) -> MilvusIndex:
        """Opens the collection a manifest names, counting its rows (Milvus is the record of what is indexed)."""
        index = cls(Path(directory), manifest)
        if not index.client.has_collection(index.collection):  # type: ignore[attr-defined]
            raise RetrievalError(
                f"{directory}: Milvus at {manifest.uri} has no collection "
                f"{index.collection}; {rebuild_advice(Path(directory))}"
            )
        rows = index.rows()
        index.manifest = replace(manifest, count=len(rows), next_id=max(manifest.next_id, max(rows, default=0) + 1))
        return index

    def update(self, additions: Iterable[Additions], remove_ids: Sequence[int]) -> MilvusIndex:
        """Removes and adds items, flushes, and saves the manifest; returns the index as it now is."""
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        next_id = self.manifest.next_id
        if len(remove_ids):
            self.client.delete(self.collection, ids=[int(i) for i in remove_ids])  # type: ignore[attr-defined]
        for chunk in additions:
            rows = [
                {
                    "id": next_id + offset,
                    "embedding": vector.tolist(),
                    "path": str(item.path),
                    "label": item.label,
                    "sha256": digest,
                    "added_at": now,
                }
                for offset, (vector, item, digest) in enumerate(
                    zip(np.asarray(chunk.vectors, np.float32), chunk.items, chunk.hashes)
                )
            ]
            if rows:
                self.client.insert(self.collection, rows)  # type: ignore[attr-defined]
            next_id += len(rows)
        self.client.flush(self.collection)  # type: ignore[attr-defined]
        count = self.count()
        if count == 0:
            raise RetrievalError(f"{self.directory}: nothing to index (no readable images)")
        manifest = replace(self.manifest, count=count, next_id=next_id, updated=now)
        write_json(self.directory / MANIFEST, manifest.to_dict(), sealed=True)
        return MilvusIndex(self.directory, manifest)

    def count(self) -> int:
        """The number of items in the collection, counted by Milvus (no listing)."""
        (row,) = self.client.query(self.collection, filter="", output_fields=["count(*)"])  # type: ignore[attr-defined]
        return int(row["count(*)"])

    def search(
        self,
        queries: np.ndarray,
        k: int = 10,
        depth: int | None = None,
        rerank: int | None = None,
        label: str | None = None,
    ) -> list[list[Hit]]:
        """The k nearest items of each query (depth: nprobe or efSearch for this search; label: only items with it).

        Hits are ordered by score, then by the lower id; rerank does not apply (Milvus scores exactly).
        """
        queries = search_queries(queries, k, self.dim)
        depth = depth or self.manifest.depth
        parameters = (
            {} if depth is None else {"nprobe": int(depth)} if self.kind == "ivf" else {"ef": max(int(depth), k)}
        )
        found = self.client.search(  # type: ignore[attr-defined]
            self.collection,
            data=queries.tolist(),
            limit=k,
            filter=f"label == {_quoted(label)}" if label is not None else "",
            search_params={"metric_type": "IP", "params": parameters},
            output_fields=["path", "label", "sha256"],
        )
        return [sorted((_hit(hit) for hit in hits), key=lambda hit: (-hit.score, hit.id)) for hits in found]

    def search_arrays(
        self,
        queries: np.ndarray,
        k: int = 10,
        depth: int | None = None,
        rerank: int | None = None,
        label: str | None = None,
    ) -> HitArrays:
        """search's hits as arrays (pymilvus returns them as Python objects already)."""
        return HitArrays.of(self.search(queries, k, depth, rerank, label), k)

    def vectors_of(self, ids: Sequence[int]) -> np.ndarray:
        """The stored vectors of indexed items, in the order of ids."""
        if not len(ids):
            return np.zeros((0, self.dim), np.float32)
        rows = {}
        client: Any = self.client
        for start in range(0, len(ids), FETCH):
            chunk = [int(i) for i in ids[start : start + FETCH]]
            for row in client.get(self.collection, ids=chunk, output_fields=["embedding"]):
                rows[int(row["id"])] = row["embedding"]
        missing = [i for i in ids if int(i) not in rows]
        if missing:
            raise unknown_ids(self.directory, missing)
        return np.asarray([rows[int(i)] for i in ids], np.float32)

    def rows(self, ids: Sequence[int] | None = None) -> dict[int, Row]:
        """id -> Row(path, label, sha256) of every item, or of the given ids that exist."""
        fields = list(Row._fields)
        if ids is not None:
            client: Any = self.client
            wanted = storable(ids)
            found = client.get(self.collection, ids=wanted, output_fields=fields) if wanted else []
            return {int(row["id"]): _row(row) for row in found}
        rows: dict[int, Row] = {}
        pages = self.client.query_iterator(self.collection, batch_size=FETCH, filter="id >= 0", output_fields=fields)  # type: ignore[attr-defined]
        while page := pages.next():
            rows.update({int(row["id"]): _row(row) for row in page})
        pages.close()
        return dict(sorted(rows.items()))

    def items(self) -> dict[int, Item]:
        """Every item, by id."""
        return {item_id: Item(Path(row.path), row.label) for item_id, row in self.rows().items()}

    def stored(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, vectors) of every item, as Milvus keeps them."""
        ids = np.array(sorted(self.rows()), np.int64)
        return ids, self.vectors_of(ids.tolist())

    def facts(self) -> IndexFacts:
        """The manifest's facts, as `retrieval index-stats` shows them."""
        manifest = self.manifest
        server = f"Milvus at {manifest.uri}, collection {self.collection}"
        return IndexFacts.of(manifest, len(self), server=server, parameters=manifest.index_params)


def _row(found: dict) -> Row:
    return Row(found["path"], found["label"], found["sha256"])


def _hit(found: dict) -> Hit:
    entity = found["entity"]
    return Hit(int(found["id"]), entity["path"], entity["label"], float(found["distance"]), entity["sha256"])


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
