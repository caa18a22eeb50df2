"""The JSON search API, served beside the Gradio app on the same port (FastAPI, with the app mounted at /).

    POST /api/v1/search                  an image (multipart field "image", or the raw bytes as the body);
                                         query k, label (only that label), depth, rerank -> hits, took_ms
    GET  /api/v1/items/{id}/neighbours   the same for an indexed item (itself left out)
    GET  /api/v1/health                  ok, and what is served
    GET  /api/v1/stats                   the index and model in numbers
    GET  /docs                           the OpenAPI documentation

The routes call the one search path (index.search) through the app's SearchService; image queries
that arrive together are embedded in one call (`Batcher`). The app's rules hold here too: the same
user:password (HTTP Basic), the same upload limit (413), and a bad image or label is a 422 with the
same one-line message, never a 500.
"""

from __future__ import annotations

import asyncio
import base64
import queue
import re
import secrets
import threading
from concurrent.futures import Future
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from app.service import SearchService
from index.search import Query as SearchQuery
from index.search import QueryResult, search_image_bytes, search_item
from retrieval.errors import ImageError, RetrievalError
from retrieval.rerank import parse_rerank

MAX_K = 1000
UNITS = {"b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3}


class HitOut(BaseModel):
    """One gallery item found."""

    id: int
    score: float
    path: str
    label: str


class SearchOut(BaseModel):
    """The hits of one query, best first, how long it took on the server, and notes (e.g. an animated image)."""

    hits: list[HitOut]
    took_ms: float
    notes: list[str] = []


def parse_size(text: str) -> int:
    """'20MB' -> 20971520 (B, KB, MB, GB, as Gradio reads --max-upload)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?b)\s*", text.lower())
    if not match:
        raise RetrievalError(f"--max-upload: give a size such as 20MB or 500KB, got {text!r}")
    return int(float(match.group(1)) * UNITS[match.group(2)])


class Batcher:
    """Image queries from concurrent requests, answered in batches: one embedding call for all that queued up."""

    def __init__(self, service: SearchService, max_batch: int) -> None:
        self.service, self.max_batch = service, max_batch
        self.waiting: queue.Queue[tuple[str, bytes, SearchQuery, Future]] = queue.Queue()
        self.worker = threading.Thread(target=self._loop, name="api-batcher", daemon=True)
        self.worker.start()

    def submit(self, name: str, data: bytes, query: SearchQuery) -> Future:
        future: Future = Future()
        self.waiting.put((name, data, query, future))
        return future

    def _loop(self) -> None:
        while True:
            batch = [self.waiting.get()]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self.waiting.get_nowait())
                except queue.Empty:
                    break
            try:
                snapshot = self.service.snapshot
                images = [(name, data) for name, data, _, _ in batch]
                found = search_image_bytes(snapshot.index, self.service.embedder, images, [q for _, _, q, _ in batch])
                for (_, _, _, future), result in zip(batch, found):
                    future.set_result(result)
            except Exception as error:  # handed to each request, which words it; the worker lives on
                for _, _, _, future in batch:
                    future.set_exception(error)


def build_api(service: SearchService, credentials: tuple[str, str] | None, max_upload: str, max_batch: int) -> FastAPI:
    """The FastAPI application with the JSON routes; the Gradio app is mounted on it afterwards (app.server)."""
    api = FastAPI(
        title="retrieval search API",
        version="1",
        description="Image search over the run's gallery index: the same index, model and rules as the app at /.",
    )
    limit = parse_size(max_upload)
    batcher = Batcher(service, max_batch)
    allowed = _basic_auth(credentials)

    @api.exception_handler(RetrievalError)
    async def refused(request: Request, error: RetrievalError) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=422)

    @api.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or "request"
        return JSONResponse({"detail": f"{where}: {first.get('msg', 'invalid')}"}, status_code=422)

    @api.post("/api/v1/search", response_model=SearchOut, dependencies=[Depends(allowed)])
    async def search(
        request: Request,
        k: Annotated[int, Query(ge=1, le=MAX_K, description="Hits to return.")] = 10,
        label: Annotated[str | None, Query(description="Only gallery items with this label.")] = None,
        depth: Annotated[int | None, Query(ge=1, description="nprobe (IVF) or efSearch (HNSW).")] = None,
        rerank: Annotated[str, Query(description="none, qe, dba or kreciprocal, with parameters.")] = "none",
    ) -> SearchOut:
        """The k nearest gallery items to an image: multipart field "image", or the image's bytes as the body."""
        name, data = await _upload(request, limit)
        query = SearchQuery(k, depth, label, parse_rerank(rerank))
        result: QueryResult = await asyncio.wrap_future(batcher.submit(name, data, query))
        return _answer(result)

    @api.get("/api/v1/items/{item_id}/neighbours", response_model=SearchOut, dependencies=[Depends(allowed)])
    def neighbours(
        item_id: int,
        k: Annotated[int, Query(ge=1, le=MAX_K)] = 10,
        label: Annotated[str | None, Query()] = None,
        depth: Annotated[int | None, Query(ge=1)] = None,
        rerank: Annotated[str, Query()] = "none",
    ) -> SearchOut:
        """The k nearest gallery items to an indexed item, itself left out (404 for an unknown id)."""
        result = search_item(service.snapshot.index, item_id, SearchQuery(k, depth, label, parse_rerank(rerank)))
        if result.error is not None and result.error.startswith("no item with id"):
            raise HTTPException(404, result.error)
        return _answer(result)

    @api.get("/api/v1/health", dependencies=[Depends(allowed)])
    def health() -> dict:
        """ok, with the number of items and the model's fingerprint."""
        snapshot = service.snapshot
        return {"status": "ok", "items": len(snapshot.items), "encoder": service.embedder.fingerprint}

    @api.get("/api/v1/stats", dependencies=[Depends(allowed)])
    def stats() -> dict:
        """The index (type, size, labels, tuned depth) and the model (precision, dimension, re-ranking)."""
        snapshot = service.snapshot
        manifest = snapshot.index.manifest
        return {
            "items": len(snapshot.items),
            "labels": len({item.label for item in snapshot.items.values() if item.label}),
            "dim": service.embedder.dim,
            "index_type": manifest.get("index_type", "Flat"),
            "search": manifest.get("search", {}),
            "encoder": service.embedder.fingerprint,
            "precision": service.embedder.card.get("precision", "float32"),
            "rerank": service.rerank.describe(),
            "run": str(service.run.root),
        }

    return api


def _answer(result: QueryResult) -> SearchOut:
    if result.error is not None:
        raise HTTPException(422, result.error)
    hits = [HitOut(id=hit.id, score=hit.score, path=hit.path, label=hit.label) for hit in result.hits]
    return SearchOut(hits=hits, took_ms=round(result.seconds * 1000, 2), notes=result.notes)


async def _upload(request: Request, limit: int) -> tuple[str, bytes]:
    """The uploaded image: a multipart "image" field, or the raw body; refused over the upload limit."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + 4096:
        raise HTTPException(413, f"the upload is over this server's limit of {limit:,} bytes (--max-upload)")
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        form = await request.form()
        upload = form.get("image")
        if upload is None or isinstance(upload, str):
            raise HTTPException(422, 'send the image as the multipart field "image", or as the raw request body')
        name, data = upload.filename or "image", await upload.read()
    else:
        name, data = "image", await request.body()
    if len(data) > limit:
        raise HTTPException(413, f"the upload is over this server's limit of {limit:,} bytes (--max-upload)")
    if not data:
        raise HTTPException(422, str(ImageError(name, "empty file")))
    return name, data


def _basic_auth(credentials: tuple[str, str] | None):  # noqa: ANN202  (a FastAPI dependency)
    """A dependency that asks for the app's user:password as HTTP Basic, when the app has one."""

    async def check(request: Request) -> None:  # async: FastAPI would run a plain def in its thread pool
        if credentials is None:
            return
        scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
        try:
            user, _, password = base64.b64decode(encoded).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            user, password = "", ""
        good = scheme.lower() == "basic" and secrets.compare_digest(f"{user}:{password}", ":".join(credentials))
        if not good:
            raise HTTPException(401, "give the app's user:password (HTTP Basic)", {"WWW-Authenticate": "Basic"})

    return check
