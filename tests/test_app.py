"""The search app on a real index: the search function, bad uploads, and the served page answering a query."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from app.server import SearchService, build_app, metrics_rows, result_gallery
from retrieval.runs import RunDir
from tests.conftest import write_bad_files


@pytest.fixture(scope="module")
def service(demo_run: RunDir) -> SearchService:
    return SearchService(demo_run)


def test_search_returns_neighbours_without_the_query_itself(service: SearchService, tmp_path: Path) -> None:
    item = service.items[1]
    copy = tmp_path / "upload.png"  # the app sees a copy of a picked gallery image
    copy.write_bytes(item.path.read_bytes())
    result = service.search(copy, k=5, query_label=item.label)
    assert len(result.hits) == 5
    assert all(hit.path != item.path.as_posix() for hit in result.hits)
    assert [hit.score for hit in result.hits] == sorted((hit.score for hit in result.hits), reverse=True)
    captions = [caption for _, caption in result_gallery(result, item.label)]
    assert all(c.startswith("HIT") == (hit.label == item.label) for c, hit in zip(captions, result.hits))
    assert f"label **{item.label}**" in result.summary


def test_samples_cover_every_label(service: SearchService) -> None:
    labels = {label for _, label in service.samples()}
    assert labels == {item.label for item in service.items.values()}


def test_metrics_table_shows_the_runs_metrics(service: SearchService) -> None:
    rows = dict(metrics_rows(service.metrics))
    assert "recall@1" in rows and "map@r" in rows
    assert metrics_rows(None)[0][0] == "(no metrics yet)"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_served_page_answers_a_query_and_survives_a_bad_upload(service: SearchService, tmp_path: Path) -> None:
    from gradio_client import Client, handle_file

    demo = build_app(service)
    port = free_port()
    demo.queue().launch(
        server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, allowed_paths=service.served_folders(), quiet=True, show_error=True
    )
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        item = service.items[2]
        gallery, summary = client.predict(handle_file(str(item.path)), 4, item.label, api_name="/search")
        assert len(gallery) == 4 and "4 results" in summary
        bad = write_bad_files(tmp_path)
        gallery, summary = client.predict(handle_file(str(bad["truncated"])), 4, "", api_name="/search")
        assert gallery == [] and "image file is truncated" in summary
        with pytest.raises(Exception, match="cannot identify image file"):  # refused by Gradio's upload check, shown to the user
            client.predict(handle_file(str(bad["text"])), 4, "", api_name="/search")
        gallery, summary = client.predict(handle_file(str(item.path)), 3, "", api_name="/search")
        assert len(gallery) == 3  # still serving
    finally:
        demo.close()
