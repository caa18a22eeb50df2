"""The JSON search API, served beside the Gradio app on the same port (FastAPI, with the app mounted at /).

    POST /api/v1/search                  an image (multipart field "image", or the raw bytes as the body);
                                         query k, label (only that label), depth, rerank -> hits, took_ms;
                                         each hit's match: whether it reaches the run's match threshold
    GET  /api/v1/items/{id}/neighbours   the same for an indexed item (itself left out)
    GET  /api/v1/health                  ok, and what is served
    GET  /api/v1/stats                   the index and model in numbers
    GET  /docs                           the OpenAPI documentation

The routes call the one search path (index.search) through the app's SearchService; image queries
that arrive together, from here and from the app, are embedded in one call (app.batching). The app's
rules hold here too: the same user:password (HTTP Basic), the same upload limit (413), the same
re-ranking (`retrieval serve --rerank`, unless a request names its own), and a failure is the HTTP
status of its kind (STATUS: an unknown id 404, a bad image or label 422) with the same one-line
message, never a 500.
"""

from __future__ import annotations

import asyncio
import base64
import difflib
import logging
import re
import secrets
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.service import SearchService
from index.search import ImageQuery, QueryResult, search_item
from retrieval.errors import ErrorKind, ImageError, RetrievalError
from retrieval.rerank import Rerank, parse_rerank

MAX_K = 1000
UNITS = {"b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3}
STATUS = {  # the HTTP status of each kind of failure
    ErrorKind.INVALID: 422,
    ErrorKind.UNREADABLE_IMAGE: 422,
    ErrorKind.UNKNOWN_LABEL: 422,
    ErrorKind.UNKNOWN_ID: 404,
}
ROUTES = {  # each route's methods: any other method is a 405 (not a 404 from the app mounted beside them)
    "/api/v1/search": {"POST"},
    "/api/v1/items/{item_id}/neighbours": {"GET"},
    "/api/v1/health": {"GET"},
    "/api/v1/stats": {"GET"},
}
METHODS = {"GET", "POST", "PUT", "PATCH", "DELETE"}
RERANK_HELP = "none, qe, dba or kreciprocal, with parameters; default: the server's --rerank."
# the options both search routes take, described once for the OpenAPI page (/docs)
HitsWanted = Annotated[int, Query(ge=1, le=MAX_K, description="Hits to return.")]
OfLabel = Annotated[str | None, Query(description="Only gallery items with this label.")]
Depth = Annotated[
    int | None, Query(ge=1, description="nprobe (IVF) or efSearch (HNSW); left out: the depth tuned at the build.")
]
Reranking = Annotated[str | None, Query(description=RERANK_HELP)]
OPTIONS = frozenset({"k", "label", "depth", "rerank"})  # the search routes' query options
FORM_FIELDS = 'the form takes only the image (field "image"); options go in the query string: /api/v1/search?k=5'
_URLENCODED = "application/x-www-form-urlencoded"  # what curl -d and --data-binary declare
FORM_BODY = (
    "a body sent as a form (curl -d @query.jpg) loses the file's line breaks: send it with --data-binary @query.jpg"
)
ATTACH = "send the file itself (curl -F image=@query.jpg or --data-binary @query.jpg: the @ reads the file)"
_FORM_TEXT = re.compile(rb"[\w.\-\[\]]+=[^&\x00-\x1f]*(&[\w.\-\[\]]+=[^&\x00-\x1f]*)*")  # name=value&...: no image


class HitOut(BaseModel):
    """One gallery item found."""

    id: int
    score: float
    path: str
    label: str
    match: bool | None = None  # whether the score reaches the run's match threshold (null: the run has none)


class SearchOut(BaseModel):
    """The hits of one query, best first, how long it took on the server, and notes (e.g. an animated image)."""

    hits: list[HitOut]
    took_ms: float
    notes: list[str] = []
    itself: int | None = None  # the id of the gallery item with the query image's bytes, left out of the hits


def parse_size(text: str) -> int:
    """'20MB' -> 20971520 (B, KB, MB, GB, as Gradio reads --max-upload)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?b)\s*", text.lower())
    size = int(float(match.group(1)) * UNITS[match.group(2)]) if match else 0
    if size < 1:  # 0MB too: every upload would be refused
        raise RetrievalError(f"--max-upload: give a size such as 20MB or 500KB, got {text!r}")
    return size


def build_api(service: SearchService, credentials: tuple[str, str] | None, max_upload: str) -> FastAPI:
    """The FastAPI application with the JSON routes; the Gradio app is mounted on it afterwards (app.server)."""
    api = FastAPIOffline(  # /docs with Swagger UI's files served from the package: it shows offline too
        title="retrieval search API",
        version="1",
        description="Image search over the run's gallery index: the same index, model and rules as the app at /.",
    )
    _errors(api)
    # a body that is not multipart form data is answered with what to send (_form); the parser's own warning
    # ("Expected boundary character 45, got 103 at index 2") went to the server's terminal as well
    logging.getLogger("python_multipart").setLevel(logging.ERROR)
    allowed = [Depends(_basic_auth(credentials))]
    _search_routes(api, service, parse_size(max_upload), allowed)
    _info_routes(api, service, allowed)
    for path, methods in ROUTES.items():
        api.add_api_route(path, _not_allowed(methods), methods=sorted(METHODS - methods), include_in_schema=False)
    api.add_api_route(
        "/api/{rest:path}", _no_route, methods=sorted(METHODS), include_in_schema=False, dependencies=allowed
    )
    return api


def _errors(api: FastAPI) -> None:
    """Our errors and FastAPI's validation errors become one line in `detail`, with the status of their kind."""

    @api.exception_handler(RetrievalError)
    async def refused(request: Request, error: RetrievalError) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=STATUS[error.kind])

    @api.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or "request"
        return JSONResponse({"detail": f"{where}: {first.get('msg', 'invalid')}"}, status_code=422)


def _search_routes(api: FastAPI, service: SearchService, limit: int, allowed: list) -> None:
    """POST /api/v1/search and GET /api/v1/items/{id}/neighbours."""

    def reranked(spec: str | None) -> Rerank | None:
        return None if spec is None else parse_rerank(spec)  # None: the server's

    @api.post("/api/v1/search", response_model=SearchOut, dependencies=allowed)
    async def search(
        request: Request,
        k: HitsWanted = 10,
        label: OfLabel = None,
        depth: Depth = None,
        rerank: Reranking = None,
    ) -> JSONResponse:
        """The k nearest gallery items to an image: multipart field "image", or the image's bytes as the body."""
        _known_options(request)
        image = await _upload(request, limit)
        query = service.query(k, depth, label, reranked(rerank))
        result: QueryResult = await asyncio.wrap_future(service.batcher.submit(image, query))
        return _answer(result, FORM_BODY if _kind(request) == _URLENCODED else "")

    @api.get("/api/v1/items/{item_id}/neighbours", response_model=SearchOut, dependencies=allowed)
    def neighbours(
        request: Request,
        item_id: Annotated[int, Path(description="The item's id, as a search's hits give it.")],
        k: HitsWanted = 10,
        label: OfLabel = None,
        depth: Depth = None,
        rerank: Reranking = None,
    ) -> JSONResponse:
        """The k nearest gallery items to an indexed item, itself left out (404 for an unknown id)."""
        _known_options(request)
        return _answer(search_item(service.snapshot.index, item_id, service.query(k, depth, label, reranked(rerank))))


def _info_routes(api: FastAPI, service: SearchService, allowed: list) -> None:
    """GET /api/v1/health and /api/v1/stats."""

    @api.get("/api/v1/health", dependencies=allowed)
    def health() -> dict:
        """ok, with the number of items and the model's fingerprint."""
        snapshot = service.snapshot
        return {"status": "ok", "items": len(snapshot.items), "encoder": service.embedder.fingerprint}

    @api.get("/api/v1/stats", dependencies=allowed)
    def stats() -> dict:
        """The index (type, size, labels, tuned depth) and the model (precision, dimension, re-ranking; served int8,
        the figures of the quality gate it passed)."""
        snapshot, card = service.snapshot, service.embedder.card
        manifest, precision = snapshot.index.manifest, card.get("precision", "float32")
        return {
            "items": len(snapshot.items),
            "labels": len({item.label for item in snapshot.items.values() if item.label}),
            "dim": service.embedder.dim,
            "index_type": manifest.index_type,
            "search": manifest.search,
            "encoder": service.embedder.fingerprint,
            "precision": precision,
            "int8_gate": card["int8"]["gate"] if precision == "int8" else None,
            "rerank": service.rerank.describe(),
            "match_threshold": service.query().threshold,
            "run": str(service.run.root),
        }


def _known_options(request: Request) -> None:
    """Refuses query options the search routes do not take (?K=5, ?top_k=5, ?threshold=0.8): they were ignored, and
    the defaults answered as if they had been heard; and options given twice (?k=3&k=5)."""
    unknown = sorted(set(request.query_params) - OPTIONS)
    if unknown:
        taken = ", ".join(sorted(OPTIONS))
        raise HTTPException(422, f"{', '.join(unknown)}: not an option of {request.url.path}; it takes {taken}")
    for name in request.query_params:  # ?k=3&k=5: one of them was answered, the other ignored
        values = request.query_params.getlist(name)
        if len(values) > 1:
            raise HTTPException(422, f"{name}: given {len(values)} times ({', '.join(values)}); give it once")


def _not_allowed(methods: set[str]):  # noqa: ANN202  (a FastAPI endpoint)
    """An endpoint that answers 405, naming the methods the route takes."""

    async def refuse(request: Request) -> JSONResponse:
        allow = ", ".join(sorted(methods))
        detail = f"{request.method} is not allowed on {request.url.path}; use {allow}"
        return JSONResponse({"detail": detail}, status_code=405, headers={"Allow": allow})

    return refuse


async def _no_route(request: Request) -> JSONResponse:
    """A 404 under /api/ that names the routes and the one meant, where a path is close to one (neighbors, a missing
    v1): the app's plain "Not Found" said neither."""
    path = request.url.path.rstrip("/")
    parts = path.split("/")
    filled = {}  # each route as this request would have written it: {item_id} given the request's own segment
    for route in ROUTES:
        segments = route.split("/")
        if len(segments) == len(parts):
            segments = [part if segment.startswith("{") else segment for segment, part in zip(segments, parts)]
        filled["/".join(segments)] = route
    meant = difflib.get_close_matches(path, filled, n=1, cutoff=0.75)
    routes = ", ".join(f"{' '.join(sorted(methods))} {route}" for route, methods in ROUTES.items())
    hint = f"did you mean {sorted(ROUTES[filled[meant[0]]])[0]} {meant[0]}? " if meant else ""
    return JSONResponse({"detail": f"no route {request.url.path}; {hint}the API's routes: {routes} (and /docs)"}, 404)


def _answer(result: QueryResult, unreadable: str = "") -> JSONResponse:
    """The result as SearchOut's JSON, written straight from the hits: a returned response is not validated
    against the model again (SearchOut stays the documented schema, and a test holds the two together).
    unreadable: what to add to the message of an image that could not be read."""
    if result.error is not None:
        added = f"; {unreadable}" if unreadable and result.error.kind is ErrorKind.UNREADABLE_IMAGE else ""
        raise HTTPException(STATUS[result.error.kind], result.error.message + added)
    hits = [
        {"id": int(hit.id), "score": float(hit.score), "path": hit.path, "label": hit.label, "match": hit.match}
        for hit in result.hits
    ]
    itself = result.itself.id if result.itself is not None else None
    took = round(result.seconds * 1000, 2)
    return JSONResponse({"hits": hits, "took_ms": took, "notes": result.notes, "itself": itself})


def _too_large(limit: int) -> HTTPException:
    return HTTPException(413, f"the upload is over this server's limit of {limit:,} bytes (--max-upload)")


async def _upload(request: Request, limit: int) -> ImageQuery:
    """The uploaded image: a multipart "image" field, or the raw body; refused over the upload limit."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + 4096:
        raise _too_large(limit)
    kind = _kind(request)
    if kind == "multipart/form-data":
        form = await _form(request)
        files = sorted({name for name, value in form.multi_items() if not isinstance(value, str)} - {"image"})
        options = sorted({name for name, value in form.multi_items() if isinstance(value, str)})
        uploads = form.getlist("image")
        if files or len(uploads) != 1:
            named = f" (not {', '.join(files)})" if files else ""
            raise HTTPException(
                422, f'send one image as the multipart field "image"{named}, or as the raw request body'
            )
        if isinstance(uploads[0], str):  # curl -F image=query.jpg, without the @
            raise HTTPException(422, f'the field "image" holds text ({_shown(uploads[0])}), not a file: {ATTACH}')
        if options:  # curl -F k=5: the options are the query's (they were ignored)
            raise HTTPException(422, f"{', '.join(options)}: {FORM_FIELDS}")
        upload = uploads[0]
        name, data = upload.filename or "image", await upload.read()
    else:
        name, data = "image", await request.body()
        _refuse_text_body(kind, data)
    if len(data) > limit:
        raise _too_large(limit)
    if not data:
        raise ImageError(name, "empty file")
    return ImageQuery(name, data)


async def _form(request: Request) -> FormData:
    """The multipart form, or what to send when it cannot be parsed (Starlette said "Invalid multipart data.")."""
    try:
        return await request.form()
    except StarletteHTTPException as error:
        raise HTTPException(
            400,
            f"the body is not multipart form data that can be read ({str(error.detail).rstrip('.')}): send the image "
            'as the multipart field "image" (curl -F image=@query.jpg), or its bytes as the body',
        ) from None


def _shown(text: str) -> str:
    """A text value quoted for an error line: its first 60 characters."""
    return repr(text if len(text) <= 60 else text[:57] + "...")


def _kind(request: Request) -> str:
    """The request's content type, without its parameters."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def _refuse_text_body(kind: str, body: bytes) -> None:
    """A JSON body (`requests.post(json={"image": ...})`, `-d '{"image": ...}'`) or a form's text fields (`curl -d
    image=query.jpg`) is no image: both read "image: not a readable image", which did not say what to send instead.
    (`curl --data-binary @query.jpg` declares a form body but sends the image's bytes: still taken.)"""
    if kind == "application/json":
        raise HTTPException(
            415,
            f'the body is {kind}, not an image: send the image\'s bytes as the body, or as the multipart field "image" '
            "(curl -F image=@query.jpg)",
        )
    if kind == _URLENCODED and _FORM_TEXT.fullmatch(body[:4096]):
        fields = body[:4096].decode("ascii", "replace")
        raise HTTPException(422, f"the body is a form's text ({_shown(fields)}), not an image: {ATTACH}")


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
