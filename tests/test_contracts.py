"""The typed contracts between the rooms: a failure's kind mapped by the CLI, the app and the API alike; gallery
clicks read item ids from the data beside the gallery, not from captions; the API re-ranks as the server does;
validation keeps its held-out pixels within a memory budget."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gradio as gr
import httpx
import pytest
import torch

from app.handlers import Handlers, Shown, result_tiles, shown_at
from app.server import launch
from app.service import SearchService
from index.search import ImageQuery, Query, search_image_bytes, search_item, search_items
from retrieval.commands import main
from retrieval.data import load_collection, load_image
from retrieval.errors import ErrorKind, Failure
from retrieval.preprocess import Preprocessing
from retrieval.rerank import parse_rerank
from retrieval.runs import RunDir
from tests.conftest import write_bad_files
from tests.test_app import free_port
from training.validation import Validator


@pytest.fixture(scope="module")
def reranking(demo_run: RunDir) -> Iterator[tuple[SearchService, str]]:
    """The demo run served as `retrieval serve --rerank dba:n=1` would serve it."""
    service = SearchService(demo_run, rerank=parse_rerank("dba:n=1"))
    port = free_port()
    server = launch(service, port=port, block=False)
    try:
        yield service, f"http://127.0.0.1:{port}"
    finally:
        server.close()
        service.close()


def test_one_failure_of_each_kind_is_a_value_of_the_search_path(demo_run: RunDir, tmp_path: Path) -> None:
    service = SearchService(demo_run)
    try:
        index, item_id = service.index, next(iter(service.items))
        assert search_item(index, 987654).error.kind is ErrorKind.UNKNOWN_ID  # type: ignore[union-attr]
        assert service.search_item(987654).failure.kind is ErrorKind.UNKNOWN_ID  # type: ignore[union-attr]  # not raised
        assert search_item(index, item_id, Query(3, label="no-such")).error.kind is ErrorKind.UNKNOWN_LABEL  # type: ignore[union-attr]
        truncated = write_bad_files(tmp_path)["truncated"]
        images = [ImageQuery("t.png", truncated.read_bytes()), Failure(ErrorKind.UNREADABLE_IMAGE, "gone.png: missing")]
        results = search_image_bytes(index, service.embedder, images, [Query(3), Query(3)])
        assert [result.error.kind for result in results] == [ErrorKind.UNREADABLE_IMAGE] * 2  # type: ignore[union-attr]
        assert results[1].error.message == "gone.png: missing"  # type: ignore[union-attr]  # handed through as it came
    finally:
        service.close()


@pytest.mark.parametrize(
    "arguments,kind_words",
    [(["--id", "987654"], "no item with id 987654"), (["--label", "no-such"], "has the label 'no-such'")],
)
def test_the_command_line_maps_each_kind_to_one_line_and_status_2(
    demo_run: RunDir, arguments: list[str], kind_words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    query = [] if "--id" in arguments else [str(next(iter(load_collection(demo_run.root / "demo-test.csv").items)).path)]
    assert main(["search", str(demo_run.root), *query, *arguments]) == 2
    err = capsys.readouterr().err
    assert kind_words in err and err.count("\n") == 1


def test_the_api_maps_each_kind_to_its_status(reranking: tuple[SearchService, str], tmp_path: Path) -> None:
    service, url = reranking
    image = next(iter(service.items.values())).path.read_bytes()
    truncated = write_bad_files(tmp_path)["truncated"].read_bytes()
    statuses = {
        "unknown id": httpx.get(f"{url}/api/v1/items/987654/neighbours").status_code,
        "unknown label": httpx.post(f"{url}/api/v1/search", params={"label": "no-such"}, content=image).status_code,
        "unreadable image": httpx.post(f"{url}/api/v1/search", content=truncated).status_code,
        "invalid": httpx.post(f"{url}/api/v1/search", params={"rerank": "magic"}, content=image).status_code,
    }
    assert statuses == {"unknown id": 404, "unknown label": 422, "unreadable image": 422, "invalid": 422}
    wrong = [httpx.get(f"{url}/api/v1/search"), httpx.put(f"{url}/api/v1/health")]
    assert [response.status_code for response in wrong] == [405, 405] and wrong[0].headers["allow"] == "POST"
    assert "GET is not allowed on /api/v1/search; use POST" in wrong[0].json()["detail"]


def test_the_app_refuses_an_unknown_id_in_one_message(demo_run: RunDir) -> None:
    service = SearchService(demo_run)
    try:
        with pytest.raises(gr.Error, match="no item with id 987654"):
            Handlers(service).search_id(987654, 3, None)
    finally:
        service.close()


def test_every_route_re_ranks_as_the_server_does(reranking: tuple[SearchService, str]) -> None:
    service, url = reranking
    item_id, item = next(iter(service.items.items()))
    dba, none = parse_rerank("dba:n=1"), parse_rerank("none")
    expected = [hit.id for hit in search_items(service.index, [item_id], Query(5, rerank=dba))[0]]
    plain = [hit.id for hit in search_items(service.index, [item_id], Query(5, rerank=none))[0]]
    neighbours = httpx.get(f"{url}/api/v1/items/{item_id}/neighbours", params={"k": 5}).json()["hits"]
    assert [hit["id"] for hit in neighbours] == expected
    asked = httpx.get(f"{url}/api/v1/items/{item_id}/neighbours", params={"k": 5, "rerank": "none"}).json()["hits"]
    assert [hit["id"] for hit in asked] == plain  # a request that names its own re-ranking gets it
    found = httpx.post(f"{url}/api/v1/search", params={"k": 5}, content=item.path.read_bytes()).json()["hits"]
    scored = search_image_bytes(service.index, service.embedder, [ImageQuery("q", item.path.read_bytes())], [Query(5, rerank=dba)])
    assert [hit["id"] for hit in found] == [hit.id for hit in scored[0].hits]
    assert httpx.get(f"{url}/api/v1/stats").json()["rerank"] == dba.describe()
    tiles, _, shown, _ = Handlers(service).search(str(item.path), 5, "", 0, False)
    assert [tile["id"] for tile in shown] == [hit.id for hit in scored[0].hits] and len(tiles) == 5  # the app's too


def test_a_click_picks_the_item_from_the_data_beside_the_gallery_not_its_caption(
    demo_run: RunDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    import app.handlers as handlers

    monkeypatch.setattr(handlers, "caption", lambda rank, hit, mark: f"#{rank}")  # a caption that names no id
    service = SearchService(demo_run)
    try:
        on = Handlers(service)
        item_id, item = next(iter(service.items.items()))
        tiles, summary, shown, page = on.search(str(item.path), 4, item.label, 0, False)
        assert [caption for _, caption in tiles] == ["#1", "#2", "#3", "#4"]
        picked = shown_at(shown, 2)
        assert f'&quot;id&quot;: {picked.id}' in page  # the page script's data: the same tiles
        event = gr.SelectData(None, {"index": 2, "value": {"caption": "#3"}, "selected": True})
        path, label, _, _, summary, again, _ = on.pick(shown, 4, 0, False, event)
        assert Path(path).read_bytes() == service.items[picked.id].path.read_bytes() and label == service.items[picked.id].label
        assert picked.id not in [tile["id"] for tile in again] and f"label **{label}**" in summary  # it searched with it
        result = service.search(item.path, k=3, query_label=item.label)
        assert [tile.mark for tile in result_tiles(service, result)[1]] == [
            "hit" if hit.label == item.label else "miss" for hit in result.hits
        ]
        assert isinstance(shown_at(shown, 0), Shown) and shown_at(shown, 0).title.endswith(f"id {shown_at(shown, 0).id}")
    finally:
        service.close()


def test_a_missed_click_on_the_map_changes_nothing(demo_run: RunDir) -> None:
    service = SearchService(demo_run)
    try:
        event = gr.SelectData(None, {"index": [-500, -500], "value": None, "selected": True})
        answer = Handlers(service).pick_on_map("pca", None, 4, 0, False, event)
        assert len(answer) == 7 and all(value == gr.skip() for value in answer)
    finally:
        service.close()


def test_validation_keeps_pixels_within_its_budget_and_streams_beyond(small_folder: Path) -> None:
    items = load_collection(small_folder).items
    kept = Validator(items, Preprocessing(32), torch.device("cpu"))
    streamed = Validator(items, Preprocessing(32), torch.device("cpu"), memory=0)
    assert kept.pixels is not None and kept.pixels.dtype.name == "uint8" and streamed.pixels is None
    reference = torch.from_numpy(Preprocessing(32)([load_image(item.path) for item in items]))
    assert torch.equal(torch.cat(list(kept.batches())), reference)  # the same input as the float32 preprocessing
    assert torch.equal(torch.cat(list(streamed.batches())), reference)
