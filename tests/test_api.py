"""The JSON API beside the app: search by upload or raw bytes, neighbours of an item, health and stats, its
errors (one line each, never a 500), the upload limit, HTTP Basic auth, and batching of concurrent queries."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.api import SearchOut
from app.server import launch
from app.service import SearchService
from index.search import Query, search_images, search_item
from retrieval.runs import RunDir
from tests.conftest import write_bad_files
from tests.test_app import free_port


@pytest.fixture(scope="module")
def served(demo_run: RunDir) -> Iterator[tuple[SearchService, str]]:
    service = SearchService(demo_run)
    port = free_port()
    server = launch(service, port=port, max_upload="1MB", block=False)
    try:
        yield service, f"http://127.0.0.1:{port}"
    finally:
        server.close()
        service.close()


def query_image(service: SearchService) -> Path:
    return next(iter(service.items.values())).path


def test_search_by_upload_and_by_raw_bytes_is_the_one_search_path(served: tuple[SearchService, str]) -> None:
    service, url = served
    image = query_image(service)
    expected = search_images(service.index, service.embedder, [image], [Query(5)])[0].hits
    uploaded = httpx.post(f"{url}/api/v1/search", params={"k": 5}, files={"image": (image.name, image.read_bytes())})
    raw = httpx.post(f"{url}/api/v1/search", params={"k": 5}, content=image.read_bytes())
    for response in (uploaded, raw):
        assert response.status_code == 200
        body = response.json()
        assert [hit["id"] for hit in body["hits"]] == [hit.id for hit in expected]
        assert set(body["hits"][0]) == {"id", "score", "path", "label", "match"} and body["took_ms"] > 0
        assert SearchOut.model_validate(body).model_dump() == body  # the documented schema, field for field
        own = next(item_id for item_id, item in service.items.items() if item.path == image)
        assert body["itself"] == own and f"the query is gallery item {own}, {image.name}, left out of its hits" in body["notes"]


def test_neighbours_of_an_item_and_the_label_filter(served: tuple[SearchService, str]) -> None:
    service, url = served
    item_id, item = next(iter(service.items.items()))
    expected = search_item(service.index, item_id, Query(3, label=item.label)).hits
    response = httpx.get(f"{url}/api/v1/items/{item_id}/neighbours", params={"k": 3, "label": item.label})
    assert response.status_code == 200
    hits = response.json()["hits"]
    assert [hit["id"] for hit in hits] == [hit.id for hit in expected] and {hit["label"] for hit in hits} == {item.label}
    reranked = httpx.get(f"{url}/api/v1/items/{item_id}/neighbours", params={"k": 3, "rerank": "dba:n=1"})
    assert reranked.status_code == 200 and item_id not in [hit["id"] for hit in reranked.json()["hits"]]
    assert SearchOut.model_validate(reranked.json()).model_dump() == reranked.json()


def test_health_stats_and_docs(served: tuple[SearchService, str]) -> None:
    service, url = served
    assert httpx.get(f"{url}/api/v1/health").json() == {"status": "ok", "items": len(service.items), "encoder": service.embedder.fingerprint}
    stats = httpx.get(f"{url}/api/v1/stats").json()
    assert stats["items"] == len(service.items) and stats["dim"] == service.embedder.dim and stats["index_type"] == "Flat"
    assert stats["precision"] == "float32" and stats["int8_gate"] is None  # the demo run has no int8 model
    paths = httpx.get(f"{url}/openapi.json").json()["paths"]
    assert "/api/v1/search" in paths
    assert httpx.get(f"{url}/docs").status_code == 200 and httpx.get(f"{url}/").status_code == 200
    for path, operations in paths.items():  # the neighbours route's id, k, label and depth had no word on /docs
        for method, operation in operations.items():
            assert operation.get("description"), (method, path)
            assert all(parameter.get("description") for parameter in operation.get("parameters", [])), (method, path)


def test_mistakes_get_one_line_and_the_right_status(served: tuple[SearchService, str], tmp_path: Path) -> None:
    service, url = served
    bad = write_bad_files(tmp_path / "bad")
    image = query_image(service).read_bytes()
    cases = [
        (httpx.post(f"{url}/api/v1/search", content=bad["truncated"].read_bytes()), 422, "image: "),
        (httpx.post(f"{url}/api/v1/search", files={"image": ("notes.jpg", bad["text"].read_bytes())}), 422, "notes.jpg: "),
        (httpx.post(f"{url}/api/v1/search", content=b""), 422, "empty file"),
        (httpx.post(f"{url}/api/v1/search", json={"image": "query.jpg"}), 415, "the body is application/json, not an image: send the image's bytes"),
        (httpx.post(f"{url}/api/v1/search", files={"file": ("a.png", image)}), 422, 'multipart field "image" (not file)'),
        # the file's name sent instead of the file (curl -F image=q.jpg, -d image=q.jpg: no @) read "send one image as
        # the multipart field image" (it was that field) and "image: not a readable image"
        (httpx.post(f"{url}/api/v1/search", files={"image": (None, b"photos/q.jpg")}), 422, "the field \"image\" holds text ('photos/q.jpg'), not a file: send the file itself (curl -F image=@query.jpg"),
        (httpx.post(f"{url}/api/v1/search", data={"image": "my photos/q.jpg"}), 422, "the body is a form's text ('image=my+photos%2Fq.jpg'), not an image: send the file itself"),
        (httpx.post(f"{url}/api/v1/search", content=b"image=my photos/q.jpg", headers={"content-type": "application/x-www-form-urlencoded"}), 422, "form's text ('image=my photos/q.jpg')"),
        # curl -d @query.png drops the file's line breaks: the image that is left says how to send it whole
        (httpx.post(f"{url}/api/v1/search", content=image.replace(b"\r", b"").replace(b"\n", b""), headers={"content-type": "application/x-www-form-urlencoded"}), 422, "image: not a readable image (not a format Pillow recognises); a body sent as a form (curl -d @query.jpg) loses the file's line breaks: send it with --data-binary @query.jpg"),
        # options sent as form fields or misspelt in the query were ignored, the defaults answered as if heard
        (httpx.post(f"{url}/api/v1/search", files={"image": ("a.png", image)}, data={"k": "3"}), 422, "k: the form takes only the image"),
        (httpx.post(f"{url}/api/v1/search", files=[("image", ("a.png", image)), ("image", ("b.png", image))]), 422, "send one image"),
        (httpx.post(f"{url}/api/v1/search", params={"top_k": 3}, content=image), 422, "top_k: not an option of /api/v1/search; it takes depth, k, label, rerank"),
        (httpx.get(f"{url}/api/v1/items/1/neighbours", params={"K": 3}), 422, "K: not an option of /api/v1/items/1/neighbours"),
        (httpx.post(f"{url}/api/v1/search", params=[("k", 3), ("k", 5)], content=image), 422, "k: given 2 times (3, 5); give it once"),
        (httpx.get(f"{url}/api/v1/items/1/neighbours", params=[("label", "a"), ("label", "b")]), 422, "label: given 2 times (a, b)"),
        (httpx.post(f"{url}/api/v1/search", params={"label": "no-such"}, content=image), 422, "has the label 'no-such'"),
        (httpx.post(f"{url}/api/v1/search", params={"k": 0}, content=image), 422, "k: Input should be greater than or equal to 1"),
        (httpx.post(f"{url}/api/v1/search", params={"rerank": "magic"}, content=image), 422, "unknown re-ranker 'magic'"),
        (httpx.post(f"{url}/api/v1/search", content=b"x" * (2 * 1024 * 1024)), 413, "over this server's limit of 1,048,576 bytes"),
        (httpx.get(f"{url}/api/v1/items/987654/neighbours"), 404, "no item with id 987654"),
        (httpx.get(f"{url}/api/v1/items/99999999999999999999/neighbours"), 404, "no item with id 99999999999999999999"),  # a 500: SQLite's OverflowError
        # a form body that is not one said only "Invalid multipart data." (Starlette's)
        (httpx.post(f"{url}/api/v1/search", content=b"garbage", headers={"content-type": "multipart/form-data; boundary=x"}), 400, "the body is not multipart form data that can be read (Invalid multipart data): send the image as the multipart field"),
        (httpx.post(f"{url}/api/v1/search", content=b"garbage", headers={"content-type": "multipart/form-data"}), 400, "(Missing boundary in multipart)"),
    ]
    for response, status, words in cases:
        assert response.status_code == status, response.text
        detail = response.json()["detail"]
        assert isinstance(detail, str) and "\n" not in detail and words in detail, detail
    assert "--data-binary" not in cases[0][0].json()["detail"]  # a raw body not declared a form: its own reason only
    declared = {"content-type": "application/x-www-form-urlencoded"}  # as curl --data-binary @query.jpg sends it
    assert httpx.post(f"{url}/api/v1/search", content=image, headers=declared).json()["hits"]


def test_concurrent_queries_share_embedding_calls(served: tuple[SearchService, str], monkeypatch: pytest.MonkeyPatch) -> None:
    service, url = served
    sizes: list[int] = []
    embed = service.embedder.embed

    def counted(images: list) -> object:
        sizes.append(len(images))
        return embed(images)

    monkeypatch.setattr(service.embedder, "embed", counted)
    image = query_image(service).read_bytes()
    statuses: list[int] = []
    start = threading.Barrier(16)

    def one() -> None:
        start.wait()
        statuses.append(httpx.post(f"{url}/api/v1/search", content=image, timeout=60).status_code)

    threads = [threading.Thread(target=one) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert statuses == [200] * 16 and sum(sizes) == 16 and len(sizes) < 16 and max(sizes) > 1


def test_the_api_asks_for_the_apps_password(demo_run: RunDir) -> None:
    service = SearchService(demo_run)
    port = free_port()
    server = launch(service, port=port, auth="ann:secret", block=False)
    try:
        url = f"http://127.0.0.1:{port}/api/v1/health"
        refused = httpx.get(url)
        assert refused.status_code == 401 and refused.json()["detail"] == "give the app's user:password (HTTP Basic)"
        assert httpx.get(url, auth=("ann", "wrong")).status_code == 401
        assert httpx.get(url, auth=("ann", "secret")).json()["status"] == "ok"
    finally:
        server.close()
        service.close()


def test_the_docs_page_needs_nothing_from_outside(served: tuple[SearchService, str]) -> None:
    """/docs loads Swagger UI's script and style from the app itself (fastapi-offline), so it renders offline."""
    import re

    _, url = served
    page = httpx.get(f"{url}/docs").text
    sources = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert sources and all(source.startswith("/") for source in sources), sources
    assert all(httpx.get(f"{url}{source}").status_code == 200 for source in sources)


@pytest.mark.parametrize("text", ["0MB", "0", "-5MB", "lots"])
def test_an_upload_limit_of_nothing_is_refused(text: str) -> None:
    """--max-upload 0MB served an app that refused every upload as over its limit of 0 bytes."""
    from app.api import parse_size
    from retrieval.errors import RetrievalError

    with pytest.raises(RetrievalError, match=f"--max-upload: give a size such as 20MB or 500KB, got '{text}'"):
        parse_size(text)
    assert parse_size("1.5KB") == 1536


def test_a_path_the_api_does_not_have_names_its_routes_and_the_one_meant(served: tuple[SearchService, str]) -> None:
    """/api/v1/items/1/neighbors (the American spelling) and /api/search (no v1) were a bare "Not Found"."""
    _, url = served
    spelled = httpx.get(f"{url}/api/v1/items/1/neighbors")
    assert spelled.status_code == 404
    assert spelled.json()["detail"].startswith("no route /api/v1/items/1/neighbors; did you mean GET /api/v1/items/1/neighbours? the API's routes: POST /api/v1/search, GET /api/v1/items/{item_id}/neighbours")
    assert "did you mean POST /api/v1/search?" in httpx.post(f"{url}/api/search").json()["detail"]
    unknown = httpx.get(f"{url}/api/v1/everything")
    assert unknown.status_code == 404 and unknown.json()["detail"].startswith("no route /api/v1/everything; the API's routes:")
    assert httpx.get(f"{url}/api/v1/health").json()["status"] == "ok" and httpx.get(f"{url}/").status_code == 200  # the rest as it was


def test_a_body_that_is_not_a_form_leaves_the_servers_terminal_quiet(served: tuple[SearchService, str], caplog: pytest.LogCaptureFixture) -> None:
    """Beside its answer (what to send), the server printed the parser's "Expected boundary character 45, got 103"."""
    _, url = served
    response = httpx.post(f"{url}/api/v1/search", content=b"garbage", headers={"content-type": "multipart/form-data; boundary=x"})
    assert response.status_code == 400 and "send the image as the multipart field" in response.json()["detail"]
    assert not [record for record in caplog.records if record.name.startswith("python_multipart")]
