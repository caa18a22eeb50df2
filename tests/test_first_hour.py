"""What a new user trips over in the first hour, each reproduced: the terminal, the app and its API."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.server import launch
from app.service import SearchService
from retrieval.runs import RunDir
from tests.test_app import free_port


@pytest.fixture(scope="module")
def served(demo_run: RunDir) -> Iterator[tuple[object, SearchService]]:
    from gradio_client import Client

    service = SearchService(demo_run)
    port = free_port()
    demo = launch(service, port=port, block=False)
    try:
        yield Client(f"http://127.0.0.1:{port}/", verbose=False), service
    finally:
        demo.close()
        service.close()


def test_the_search_endpoint_takes_the_documented_names(served: tuple[object, SearchService]) -> None:
    from gradio_client import handle_file

    client, service = served
    names = [parameter["parameter_name"] for parameter in client.view_api(return_format="dict")["named_endpoints"]["/search"]["parameters"]]
    assert names == ["image", "k", "label", "depth", "only"]
    item = next(iter(service.items.values()))
    results, summary = client.predict(image=handle_file(str(item.path)), k=3, label=item.label, api_name="/search")
    assert len(results) == 3 and f"label **{item.label}**" in summary


@pytest.mark.parametrize("k", [0, 5000])
def test_out_of_range_api_input_is_one_log_line_not_a_traceback(
    served: tuple[object, SearchService], k: int, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    from gradio_client import handle_file

    client, service = served
    item = next(iter(service.items.values()))
    with caplog.at_level(logging.WARNING, logger="retrieval.app"), pytest.raises(Exception, match="minimum value|maximum value"):
        client.predict(image=handle_file(str(item.path)), k=k, api_name="/search")
    assert "Traceback" not in capfd.readouterr().err
    assert [record.getMessage() for record in caplog.records if record.name == "retrieval.app"] == [
        f"refused a request: Value {k} is {'less than minimum value 1' if k == 0 else 'greater than maximum value 50'}."
    ]


def first_test_image(run: RunDir) -> str:
    return (run.root / "demo-test.csv").read_text().splitlines()[1].split(",")[0]


def test_search_into_a_pipe_prints_ids_and_whole_paths(demo_run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    from retrieval.commands import main

    assert main(["search", str(demo_run.root), first_test_image(demo_run), "-k", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("\t") == ["rank", "id", "similarity", "label", "path"] and len(lines) == 4
    for line in lines[1:]:
        rank, item_id, score, label, path = line.split("\t")
        assert Path(path).is_file() and int(item_id) >= 1 and 0 < float(score) <= 1.0001


def test_search_as_json(demo_run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    from retrieval.commands import main

    assert main(["search", str(demo_run.root), first_test_image(demo_run), "-k", "2", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)["hits"]
    assert [hit["rank"] for hit in hits] == [1, 2] and {"id", "score", "label", "path"} <= hits[0].keys()


@pytest.mark.parametrize(
    "options,message",
    [
        (["-k", "0"], "k must be at least 1, got 0"),
        (["--label", "dialog-eror"], "has the label 'dialog-eror'; the closest labels are dialog-error"),
        (["--id", "99999"], "no item with id 99999 in"),
    ],
)
def test_search_refuses_what_finds_nothing(demo_run: RunDir, options: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from retrieval.commands import main

    query = [] if "--id" in options else [first_test_image(demo_run)]
    assert main(["search", str(demo_run.root), *query, *options]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    if "--id" in options:
        assert "id column of `retrieval search`" in err


def test_help_shows_flags_bare_and_paragraphs_whole(capsys: pytest.CaptureFixture[str]) -> None:
    from retrieval.commands import main

    assert main(["--version"]) == 0 and capsys.readouterr().out.strip().startswith("retrieval 0.")
    assert main(["index", "--help"]) == 0
    text = capsys.readouterr().out
    assert "<bool>" not in text
    description = text.split("Usage:")[1].split("╭")[0].strip().splitlines()[1:]
    paragraphs = "\n".join(line.strip() for line in description).strip().split("\n\n")
    for paragraph in paragraphs:
        lines = paragraph.splitlines()
        assert all(len(line) > 50 for line in lines[:-1]), lines  # broken only where the width ends
