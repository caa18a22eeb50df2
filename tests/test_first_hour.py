"""What a new user trips over in the first hour, each reproduced: the terminal, the app and its API."""

from __future__ import annotations

import json
import logging
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from app.server import launch
from app.service import SearchService
from retrieval.errors import RetrievalError
from retrieval.runs import RunDir
from tests.conftest import as_in_a_terminal, ctrl_c_when, prints
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


def test_every_endpoint_says_what_it_takes_and_gives_on_the_api_page(demo_run: RunDir) -> None:
    """The app's "Use via API" page (and gradio_client's view_api) described /search with its handler's notes on
    Gradio's batching and clear_unreadable, the other endpoints with nothing, and /search_id's id as parameter_21:
    each now says what it does, names every parameter it takes, and labels them."""
    from app.tabs import build_app

    service = SearchService(demo_run, allow_write=True)
    try:
        with build_app(service) as blocks:
            endpoints = blocks.get_api_info()["named_endpoints"]
    finally:
        service.close()
    assert {"/search", "/search_id", "/labels", "/browse", "/add", "/remove", "/evaluate", "/embedding_map", "/audit"} <= set(endpoints)
    for name, endpoint in endpoints.items():
        said = endpoint.get("description") or ""
        assert said.startswith(("Search", "The", "Add", "Remove", "Evaluate", "Suspected")) and "Returns" in said, name
        assert not re.search(r"Gradio|clear_unreadable|Batched|handler", said), name  # not the code's notes
        for parameter in endpoint["parameters"]:
            assert parameter["parameter_name"] in said, (name, parameter["parameter_name"])
            assert not parameter["label"].startswith("parameter_"), (name, parameter["label"])


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


def test_a_value_of_the_wrong_shape_is_one_log_line_not_a_traceback(
    served: tuple[object, SearchService], capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A gradio_client call with a number for the image (or one file where a list goes) failed in Gradio's own
    validation, with a traceback in the server's log."""
    client, _ = served
    with caplog.at_level(logging.WARNING, logger="retrieval.app"), pytest.raises(Exception, match="ImageData value"):
        client.predict(image=5, k=3, api_name="/search")
    assert "Traceback" not in capfd.readouterr().err
    assert [record.getMessage() for record in caplog.records if record.name == "retrieval.app"] == [
        "refused a request: the request's ImageData value: Input should be a valid dictionary or instance of ImageData"
    ]
    with pytest.raises(Exception, match=r"a file given as the text 'query.jpg': send the file itself, e.g. image=handle_file\('query.jpg'\)"):
        client.predict(image="query.jpg", k=3, api_name="/search")  # the path without handle_file


def first_test_image(run: RunDir) -> str:
    return (run.root / "demo-test.csv").read_text().splitlines()[1].split(",")[0]


def test_search_into_a_pipe_prints_ids_and_whole_paths(demo_run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    from retrieval.commands import main

    assert main(["search", str(demo_run.root), first_test_image(demo_run), "-k", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# nearest to ") and lines[1].startswith("# note: the query is gallery item ")  # it is
    assert lines[2].split("\t") == ["rank", "id", "similarity", "label", "path"]
    lines = lines[2:]
    assert len(lines) == 4
    for line in lines[1:]:
        rank, item_id, score, label, path = line.split("\t")
        assert Path(path).is_file() and int(item_id) >= 1 and 0 < float(score) <= 1.0001


def test_a_tab_or_newline_in_a_label_or_path_stays_in_its_field(capsys: pytest.CaptureFixture[str]) -> None:
    """A folder named with a tab or a newline (Linux allows both) split a hit into more fields or lines when piped."""
    from index.search import QueryResult
    from index.types import Hit
    from retrieval.commands.search import _print_hits

    hits = [Hit(7, "/g/a\nb.png", "cat\tdog", 0.5, ""), Hit(8, "/g/c\rd.png", "back\\slash", 0.25, "")]
    _print_hits(QueryResult(hits, notes=["a note\nover two lines"]), "/q/new\nline.png", None)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "# nearest to /q/new\\nline.png",
        "# note: a note\\nover two lines",
        "rank\tid\tsimilarity\tlabel\tpath",
        "1\t7\t0.5000\tcat\\tdog\t/g/a\\nb.png",
        "2\t8\t0.2500\tback\\\\slash\t/g/c\\rd.png",
    ]


def test_search_as_json(demo_run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    from retrieval.commands import main

    assert main(["search", str(demo_run.root), first_test_image(demo_run), "-k", "2", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)["hits"]
    assert [hit["rank"] for hit in hits] == [1, 2] and {"id", "score", "label", "path"} <= hits[0].keys()


def test_search_with_several_images_answers_each_and_reports_the_unreadable(demo_run: RunDir, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`retrieval search RUN a.png b.png` (a shell glob) was refused as "unexpected extra argument"; now each image is
    answered, embedded together, and one that cannot be read is reported without stopping the others."""
    from retrieval.commands import main

    images = sorted(Path(first_test_image(demo_run)).parent.parent.rglob("*.png"))[:2]
    (tmp_path / "notes.png").write_text("not a picture")
    queries = [str(images[0]), str(tmp_path / "notes.png"), str(images[1])]
    assert main(["search", str(demo_run.root), *queries, "-k", "2", "--json"]) == 0
    captured = capsys.readouterr()
    answers = json.loads(captured.out)
    assert [answer["query"] for answer in answers] == queries and [len(answers[i]["hits"]) for i in (0, 2)] == [2, 2]
    assert answers[1]["error"] == {"kind": "unreadable image", "message": f"{queries[1]}: not a readable image (not a format Pillow recognises)"}
    assert "1 of 3 query images skipped" in captured.err and answers[0]["hits"] != answers[2]["hits"]
    assert main(["search", str(demo_run.root), *queries, "-k", "1"]) == 0  # piped: a block per query
    assert capsys.readouterr().out.count("# nearest to ") == 2
    assert main(["search", str(demo_run.root), str(tmp_path / "notes.png"), str(tmp_path / "notes.png")]) == 2
    assert "none of the 2 query images could be read" in capsys.readouterr().err
    assert main(["search", str(demo_run.root), str(images[0]), str(tmp_path / "typo.png")]) == 2  # before the model loads
    assert f"{tmp_path / 'typo.png'}: no such file or folder; give an image file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "options,message",
    [
        (["-k", "0"], "k must be at least 1, got 0"),
        (["--label", "dialog-eror"], "has the label 'dialog-eror'; the closest labels are dialog-error"),
        (["--id", "99999"], "no item with id 99999 in"),
        ([], "a folder, not an image file; give an image file"),
    ],
)
def test_search_refuses_what_finds_nothing(demo_run: RunDir, options: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from retrieval.commands import main

    query = [] if "--id" in options else [first_test_image(demo_run)] if options else [str(Path(first_test_image(demo_run)).parent)]
    assert main(["search", str(demo_run.root), *query, *options]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    if "--id" in options:
        assert "id column of `retrieval search`" in err
    if not options:  # a folder: its images are searched with a glob
        assert err.strip().endswith(f"a folder, not an image file; give an image file, or the folder's images as {query[0]}/*")


def test_search_of_a_web_address_says_to_download_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A URL as the query read "https:/example.com/cat.jpg: cannot be read (No such file or directory)"."""
    from retrieval.commands import main

    assert main(["search", str(tmp_path), "https://example.com/cat.jpg"]) == 2
    assert capsys.readouterr().err == (
        "error: https://example.com/cat.jpg: a web address; files on this machine are read: download it first\n"
    )


def test_search_says_when_the_hits_files_are_gone(demo_run: RunDir, small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A gallery moved after indexing: search printed paths that led nowhere, without a word."""
    from retrieval.commands import main

    index = tmp_path / "ix"
    assert main(["index", str(demo_run.root), str(small_folder), "--index", str(index)]) == 0
    small_folder.rename(tmp_path / "moved")
    capsys.readouterr()
    assert main(["search", str(demo_run.root), "--index", str(index), "--id", "1", "-k", "2", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["hits"]  # the JSON on stdout is whole; the note goes to stderr
    assert f"note: the files of 2 hits are no longer there (e.g. {small_folder}/" in captured.err
    assert "index their folder again with --sync" in captured.err


def test_a_quoted_pattern_says_the_shell_expands_it_without_quotes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`retrieval search RUN "photos/*.jpg"` said "photos/*.jpg: no such file or folder", as if photos/ were missing."""
    from retrieval.commands import main

    (tmp_path / "photos").mkdir()
    collection = "an image folder ROOT/<label>/<image>, a CSV with columns path,label or a .txt list of paths"
    labeled = "an image folder ROOT/<label>/<image> or a CSV with columns path,label"  # a sweep needs labels
    for command, hint in ((["search", str(tmp_path)], "an image file"), (["train", "--run", str(tmp_path / "run")], collection), (["analyze"], labeled)):
        assert main([*command, f"{tmp_path}/photos/*.jpg"]) == 2
        assert capsys.readouterr().err == (
            f"error: {tmp_path}/photos/*.jpg: no such file; a pattern is expanded by the shell when it is not in quotes: "
            f"write it without them, or give {hint}\n"
        )


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


TINY = ["--epochs", "1", "--batch-size", "8", "--image-size", "32"]


def test_a_run_directory_is_resumed_or_overwritten_never_silently_replaced(small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from retrieval.commands import main
    from retrieval.runs import read_json, write_json

    run = RunDir(tmp_path / "run")
    assert main(["train", str(small_folder), "--run", str(run.root), *TINY]) == 0
    capsys.readouterr()
    assert main(["train", str(small_folder), "--run", str(run.root), *TINY]) == 2
    assert "already holds a run (1 epoch trained)" in capsys.readouterr().err
    assert main(["train", "--run", str(run.root), "--resume"]) == 2  # no DATA needed, and nothing left to do
    assert "is finished (1 of 1 epochs trained): nothing to resume" in capsys.readouterr().err
    write_json(run.config, {**read_json(run.config), "epochs": 2}, sealed=True)  # one more epoch to go
    # options that differ from the run's were ignored beside --resume (--epochs 5 trained 2); how to run it applies
    assert main(["train", "--run", str(run.root), "--resume", "--epochs", "5", "--loss", "npair", "--embedding-dim", "64"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--resume continues {run.root} with the options it started with: --loss npair (it has supcon), --epochs 5 (it has 2), --embedding-dim 64 (it has the default) would not apply" in err
    assert main(["train", str(small_folder), "--run", str(run.root), *TINY, "--resume", "--epochs", "2", "--device", "cpu"]) == 0
    assert len(run.train_log.read_text().splitlines()) == 2
    assert main(["train", str(small_folder), "--run", str(run.root), *TINY, "--overwrite"]) == 0
    assert len(run.train_log.read_text().splitlines()) == 1


def test_output_folders_that_cannot_be_folders_are_one_line_and_a_file_there_is_kept(demo_run: RunDir, small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--run, --index and the demo's --run on a file, or under one (no folder can be made there): one line each, before
    any work, and the file is left as it was (an index was once swapped into its place)."""
    from retrieval.commands import main

    taken = tmp_path / "notes.txt"
    taken.write_text("mine")
    cases = {
        "train --run on a file": (["train", str(small_folder), "--run", str(taken)], "a file is there"),
        "train --run under a file": (["train", str(small_folder), "--run", str(taken / "run")], "cannot be made"),
        "index --index on a file": (["index", str(demo_run.root), str(small_folder), "--index", str(taken)], "a file is there"),
        "index --index under a file": (["index", str(demo_run.root), str(small_folder), "--index", str(taken / "ix")], "cannot be"),
        "demo --run under a file": (["demo", "--run", str(taken / "demo"), "--no-serve"], "cannot be made"),
    }
    for name, (arguments, said) in cases.items():
        assert main(arguments) == 2, name
        captured = capsys.readouterr()
        assert said in captured.err and len(captured.err.strip().splitlines()) == 1, (name, captured.err)
        assert taken.read_text() == "mine" and not list(tmp_path.glob(".notes.txt.*")), name


@pytest.mark.parametrize("command", ["demo", "train", "python"])
def test_a_folder_of_images_given_as_the_run_is_refused_before_anything_is_written(
    command: str, small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`retrieval demo --run photos` wrote config.json, checkpoints/, train_log.jsonl and demo.json among the user's
    images, as did `retrieval train photos/train --run photos/test` (only the images trained on were refused)."""
    from retrieval.commands import main
    from training import TrainConfig, train

    photos = tmp_path / "my photos"
    (photos / "cat").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(photos / "cat" / "a.jpg")
    said = f"--run {photos}: a folder of images (cat/a.jpg, ...), and training would write among them; give the run a folder of its own, e.g. 'runs/my photos'"
    if command == "python":
        with pytest.raises(RetrievalError, match=f"^{re.escape(said)}$"):
            train(TrainConfig(data=str(small_folder), epochs=1), photos)
    else:
        argv = ["demo", "--run", str(photos), "--no-serve"] if command == "demo" else ["train", str(small_folder), "--run", str(photos)]
        assert main(argv) == 2
        assert capsys.readouterr().err == f"error: {said}\n"
    assert [path.relative_to(photos).as_posix() for path in sorted(photos.rglob("*"))] == ["cat", "cat/a.jpg"]


def test_the_demo_does_not_train_over_a_run_that_is_not_a_demos(demo_run: RunDir, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`retrieval demo --run runs/photos` replaced the user's own run (trained with `retrieval train`) without a word."""
    import shutil

    from retrieval.commands import main

    run = tmp_path / "photos"
    shutil.copytree(demo_run.root, run, ignore=shutil.ignore_patterns("demo.json"))
    before = (run / "checkpoints" / "last.safetensors").read_bytes()
    assert main(["demo", "--no-serve", "--run", str(run), "--classes", "2", "--epochs", "1"]) == 2
    assert capsys.readouterr().err == f"error: --run {run} holds a run that is not a demo's; give the demo another --run (the default is runs/demo), or add --retrain to train the demo over it\n"
    assert (run / "checkpoints" / "last.safetensors").read_bytes() == before


def test_a_file_the_system_refuses_where_no_command_words_it_is_still_one_line(demo_run: RunDir, small_folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import retrieval.commands.audit as audit_command
    from retrieval.commands import main

    def refused(source: Path, option: str = "") -> Path:
        raise PermissionError(13, "Permission denied", str(source))

    monkeypatch.setattr(audit_command, "require_source", refused)
    assert main(["audit", str(demo_run.root), str(small_folder)]) == 2
    said = capsys.readouterr().err.strip()
    assert said == f"error: {small_folder}: Permission denied; check the path and its permissions"


def test_ctrl_c_in_a_command_without_a_line_of_its_own_still_says_it_stopped(demo_run: RunDir, small_folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """audit, evaluate, export and search write nothing part-way: Ctrl+C there says it stopped (it was silent), exit 130."""
    import retrieval.commands.audit as audit_command
    from retrieval.commands import INTERRUPTED, main

    def ctrl_c(source: Path, option: str = "") -> Path:
        raise KeyboardInterrupt

    monkeypatch.setattr(audit_command, "require_source", ctrl_c)
    assert main(["audit", str(demo_run.root), str(small_folder)]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == INTERRUPTED and "Traceback" not in err


def test_ctrl_c_during_training_says_how_to_resume(small_folder: Path, tmp_path: Path) -> None:
    import sys

    run = tmp_path / "run"
    command = [sys.executable, "-m", "retrieval", "train", str(small_folder), "--run", str(run), "--epochs", "200", "--batch-size", "8", "--image-size", "32"]
    status, err = ctrl_c_when(command, prints("epoch 2/200"))
    assert status == 130, err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert re.match(r"interrupted: the trainer state after \d+ finished epochs?( and \d+ batch(es)? of the next)? is kept in ", line), line
    assert f"resume with `retrieval train --run {run} --resume`" in line


def test_ctrl_c_during_the_demo_says_what_is_kept_and_the_same_command_goes_on_from_it(tmp_path: Path) -> None:
    """The first thing a new user may do to a five-minute demo: Ctrl+C in its training. One line, exit 130; the same
    command then resumes the training from its last saved epoch (it started over before) and finishes the demo."""
    import sys

    run = tmp_path / "demo"
    command = [sys.executable, "-m", "retrieval", "demo", "--run", str(run), "--no-serve", "--classes", "4", "--epochs", "4"]
    status, err = ctrl_c_when(command, prints("epoch 2/4"))
    assert status == 130 and "Traceback" not in err, err
    said = re.fullmatch(
        rf"interrupted: the demo in {re.escape(str(run))} has (\d) epochs? trained and saved; the same command again "
        r"goes on from there \(--retrain starts over\)",
        err.strip().splitlines()[-1],
    )
    assert said, err
    again = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=600)
    assert again.returncode == 0, again.stderr
    assert f"resuming {run} at epoch {int(said.group(1)) + 1}, batch 0" in again.stdout.replace("\n", " ")
    assert json.loads((run / "demo.json").read_text())["outcome"]["model_metrics"]["recall@1"] > 0


def busy_port() -> tuple[object, int]:
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder, holder.getsockname()[1]


@pytest.mark.parametrize("command", ["demo", "serve", "make demo", "make serve"])
def test_a_busy_port_fails_in_one_line_before_any_work(
    command: str, demo_run: RunDir, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One line naming a free port; the make variable to give it only where `make demo` started the demo (MAKELEVEL):
    `retrieval serve` was told to run `make demo PORT=N`, also from a Makefile of its user's."""
    from retrieval.commands import main

    monkeypatch.delenv("MAKELEVEL", raising=False)
    if command.startswith("make"):
        monkeypatch.setenv("MAKELEVEL", "1")  # as make sets it for the commands of its recipes
    holder, port = busy_port()
    try:
        arguments = ["serve", str(demo_run.root)] if command.endswith("serve") else ["demo", "--run", str(tmp_path / "run")]
        assert main([*arguments, "--port", str(port)]) == 2
    finally:
        holder.close()  # type: ignore[attr-defined]
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is in use: give another with --port" in err and err.count("\n") == 1
    assert ("through make: make demo PORT=" in err) == (command == "make demo")
    assert not (tmp_path / "run").exists()  # nothing trained


@pytest.mark.parametrize(
    ("host", "message"),
    [
        ("nonexistent.invalid", "--host nonexistent.invalid: not a name this machine knows"),
        ("192.0.2.1", "--host 192.0.2.1: not an address of this machine; give 127.0.0.1"),  # TEST-NET-1, never local
    ],
)
def test_a_host_this_machine_cannot_bind_is_one_line(host: str, message: str, demo_run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    """It said "Name or service not known; check the path and its permissions" (there was no path), or "port ... is
    Cannot assign requested address"."""
    from retrieval.commands import main

    assert main(["serve", str(demo_run.root), "--host", host, "--port", "7860"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_finished_demo_is_reused_and_its_plots_and_figures_are_there(demo_run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    from retrieval.commands import main

    before = demo_run.model.stat().st_mtime_ns
    assert main(["demo", "--no-serve", "--run", str(demo_run.root), "--classes", "8", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "holds a finished demo: reusing it (train it again with --retrain)" in out
    assert f"reopen the app later with: retrieval serve {demo_run.root}" in " ".join(out.split())
    assert demo_run.model.stat().st_mtime_ns == before
    assert {"recall_at_k.png", "similarities.png"} <= {path.name for path in demo_run.plots.glob("*.png")}


def test_a_finished_demo_exported_again_with_other_options_is_indexed_with_its_model_again(demo_run: RunDir, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It reused the index built with the first export, which the app then refused (built with another encoder)."""
    import shutil

    from index.disk import read_manifest
    from retrieval.commands import main

    run = RunDir(tmp_path / "demo")
    shutil.copytree(demo_run.root, run.root)
    assert main(["export", str(run.root), "--whiten", "none"]) == 0
    capsys.readouterr()
    assert main(["demo", "--no-serve", "--run", str(run.root), "--classes", "8", "--epochs", "2"]) == 0
    assert "exported again since the index was built: indexing and evaluating with it anew" in capsys.readouterr().out
    assert read_manifest(run.index).encoder_sha256 == json.loads(run.model_card.read_text())["sha256"]
    service = SearchService(run)  # the app opens it
    try:
        assert len(service.items) == read_manifest(demo_run.index).count
    finally:
        service.close()


def test_the_demo_output_has_its_steps_and_the_time_left(tmp_path: Path) -> None:
    import sys

    command = [sys.executable, "-m", "retrieval", "demo", "--no-serve", "--run", str(tmp_path / "run"), "--classes", "4", "--epochs", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    steps = [line.split()[0] for line in done.stdout.splitlines() if line[:2] in ("1/", "2/", "3/", "4/", "5/")]
    assert steps == ["1/5", "2/5", "3/5", "4/5", "5/5"]  # (with serving: 1/6 ... 6/6 serve)
    assert "no labels, 2" in done.stdout  # the self-supervised column beside the trained model's
    assert "about" in next(line for line in done.stdout.splitlines() if line.startswith("epoch 1/2")) and "left)" in done.stdout
    assert "max |Δ|" in done.stdout  # the export's parity figures


def test_serve_says_where_the_app_is_without_gradios_launch_advice(demo_run: RunDir) -> None:
    import signal
    import sys

    from tests.test_app import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "retrieval", "serve", str(demo_run.root), "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).parents[1], preexec_fn=as_in_a_terminal)
    assert server.stdout is not None
    try:
        first = server.stdout.readline()
        server.send_signal(signal.SIGINT)
        rest = server.communicate(timeout=60)[0]
    finally:
        server.kill()  # no server left behind when the test fails
    url = f"http://127.0.0.1:{port}"
    assert first.strip() == f"serving the search app at {url}, its JSON API at {url}/docs  (Ctrl+C to stop)"
    assert "share=True" not in first + rest and "Traceback" not in rest and server.returncode == 0
    assert rest.strip().splitlines()[-1] == f"stopped the search app at {url}"  # a stop of a second or two, said


def test_each_evaluated_set_keeps_its_metrics_and_the_app_shows_them_all(demo_run: RunDir, small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    from app.handlers import Handlers
    from retrieval.commands import main
    from retrieval.runs import read_json

    run = RunDir(tmp_path / "run")
    shutil.copytree(demo_run.root, run.root)
    test_set = demo_run.root / "demo-test.csv"
    assert main(["evaluate", str(run.root), str(test_set)]) == 0
    assert main(["evaluate", str(run.root), str(small_folder)]) == 0  # a scratch folder, evaluated last
    assert f"wrote {run.root / 'metrics' / 'images.json'}" in " ".join(capsys.readouterr().out.split())
    sets = {path.stem: read_json(path) for path in (run.root / "metrics").glob("*.json")}
    assert {"demo-test", "images", "icons-demo-test"} <= set(sets)
    assert read_json(run.metrics) == sets["images"]  # metrics.json: the latest
    service = SearchService(run)
    try:
        assert list(service.metric_sets)[0] == "images" and next(iter(service.metric_sets.values())) == sets["images"]
        rows, source = Handlers(service).metric_set("demo-test")
        assert ["num_queries", str(sets["demo-test"]["num_queries"])] in rows and str(test_set) in source
    finally:
        service.close()


def test_the_depth_field_says_what_zero_means(demo_run: RunDir) -> None:
    from app.components import BoundedNumber
    from app.tabs import build_app

    service = SearchService(demo_run)
    try:
        with build_app(service) as blocks:
            fields = [block for block in blocks.blocks.values() if isinstance(block, BoundedNumber)]
        assert fields and all(not field.label.endswith(" )") and "0: " in field.label for field in fields), [f.label for f in fields]
    finally:
        service.close()


def test_an_unknown_label_fails_only_its_own_query(demo_run: RunDir) -> None:
    service = SearchService(demo_run)
    try:
        query = first_test_image(demo_run)
        label = next(iter(service.items.values())).label
        results = service.search_images([query, query], [3, 3], ["", ""], [None, None], ["no-such-label", label])
        assert results[0].error and "has the label 'no-such-label'" in results[0].summary
        assert not results[1].error and len(results[1].hits) == 3
    finally:
        service.close()


def test_make_says_what_the_install_takes_and_takes_a_cpu_torch_and_a_port() -> None:
    """`make demo TORCH=cpu PORT=8080` (dry run): the size note first, PyTorch's CPU wheels from PyTorch's own index,
    pinned as pyproject.toml pins them, then the package, then the demo on that port."""
    root = Path(__file__).parents[1]
    plan = subprocess.run(["make", "--no-print-directory", "-n", "-W", "pyproject.toml", "demo", "TORCH=cpu", "PORT=8080"], cwd=root, capture_output=True, text=True, check=True).stdout.splitlines()
    assert "about 7 GB" in plan[0] and "TORCH=cpu" in plan[1]
    pins = re.findall(r'"(torch(?:vision)?==[^"]+)"', (root / "pyproject.toml").read_text())
    assert plan[2].endswith(f"{' '.join(pins)} --index-url https://download.pytorch.org/whl/cpu") and "-e " in plan[3]
    assert plan[-1].endswith("retrieval demo --port 8080")
    default = subprocess.run(["make", "--no-print-directory", "-n", "-W", "pyproject.toml", "demo"], cwd=root, capture_output=True, text=True, check=True).stdout
    assert "--index-url" not in default and "--port 7860" in default


@pytest.mark.parametrize(("setting", "told"), [("TORCH=CPU", "give TORCH=cpu"), ("DEVICE=cuda", "give DEVICE=cpu (the default) or DEVICE=gpu")])
def test_make_refuses_a_value_it_does_not_know(setting: str, told: str) -> None:
    """`make demo TORCH=CPU` installed PyTorch's 7 GB default wheel, `DEVICE=cuda` neither faiss nor onnxruntime: one
    line naming the value and the ones make knows, before anything is planned."""
    root = Path(__file__).parents[1]
    plan = subprocess.run(["make", "--no-print-directory", "-n", "demo", setting], cwd=root, capture_output=True, text=True)
    assert plan.returncode == 2 and plan.stdout == ""
    assert re.fullmatch(rf"Makefile:\d+: \*\*\* {setting}: {re.escape(told)}.*Stop\.\n", plan.stderr)


def make_install(venv: Path, *settings: str) -> subprocess.CompletedProcess[str]:
    """The Makefile's install of the demo's dependencies into venv (settings: make variables such as PIP=true)."""
    target = f"{venv}/.installed-run-cpu"
    command = ["make", "--no-print-directory", "-C", str(Path(__file__).parents[1]), f"VENV={venv}", target, *settings]
    return subprocess.run(command, capture_output=True, text=True)


def test_make_refuses_an_install_the_disk_cannot_hold_before_pip_runs(tmp_path: Path) -> None:
    """A disk too small for PyTorch's default wheel: one line naming what it needs, what is free and TORCH=cpu, and pip
    never runs (PIP=false would fail the install otherwise); with room (TORCH_MB=1) the install goes on to pip."""
    venv = tmp_path / ".venv"
    refused = make_install(venv, "TORCH_MB=1000000000", "PIP=false")
    assert refused.returncode != 0 and not (venv / ".installed-run-cpu").exists()
    line = refused.stderr.splitlines()[0]
    assert re.fullmatch(rf"error: PyTorch's default wheel needs \d+ MB more on the disk of {re.escape(str(venv))}, which has \d+ MB free: free some space, or run 'make demo TORCH=cpu' .*", line)
    room = make_install(venv, "TORCH_MB=1", "PIP=true")
    assert room.returncode == 0 and "error" not in room.stderr and (venv / ".installed-run-cpu").exists()


def test_make_makes_the_venv_again_where_debians_python_stopped_without_python3_venv(tmp_path: Path) -> None:
    """Debian's python3 without python3-venv stops after writing .venv/bin/python; once the package is in, `make demo`
    again makes the venv (it went on to a pip that was not there)."""
    venv = tmp_path / ".venv"
    debian = tmp_path / "python3"
    debian.write_text(
        '#!/bin/sh\nmkdir -p "$3/bin" && ln -s "$(command -v python3)" "$3/bin/python"\n'
        'echo "The virtual environment was not created successfully because ensurepip is not available." >&2\nexit 1\n'
    )
    debian.chmod(0o755)
    stopped = make_install(venv, "PIP=true", f"PYTHON={debian}")
    assert stopped.returncode != 0 and "ensurepip is not available" in stopped.stderr and (venv / "bin/python").exists()
    again = make_install(venv, "PIP=true", "TORCH_MB=1")
    assert again.returncode == 0, again.stderr
    assert (venv / "bin/pip").exists() and (venv / ".installed-run-cpu").exists()


def test_the_parsers_own_mistakes_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from retrieval.commands import main

    assert main(["train", "photos/train"]) == 2
    said = "error: missing option --run: the run directory is given as an option, `retrieval train photos/train --run RUN`\n"
    assert capsys.readouterr().err == said
    assert main(["search", "run", "q.jpg", "-k", "many"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Invalid value for '-k'" in err and "╭" not in err


@pytest.mark.parametrize(
    ("words", "command"),
    [
        (["PHOTOS", "runs/new one"], "retrieval train PHOTOS --run 'runs/new one'"),
        (["runs/new one", "PHOTOS"], "retrieval train PHOTOS --run 'runs/new one'"),  # the run named first
        (["RUN", "PHOTOS", "--epochs", "3"], "retrieval train PHOTOS --run RUN"),  # a run there, named first
        (["--resume", "RUN"], "retrieval train --run RUN --resume"),
    ],
)
def test_the_run_given_by_position_as_other_commands_take_it_gets_the_command_to_type(
    words: list[str], command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`retrieval train photos runs/x` read "Missing option '--run'", and once --run was added, that runs/x was an
    extra argument: one line with the command as it should have been typed, the paths in the order they mean."""
    from retrieval.commands import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "PHOTOS" / "cat").mkdir(parents=True)
    (tmp_path / "RUN").mkdir()
    (tmp_path / "RUN" / "train_log.jsonl").write_text("")
    assert main(["train", *words]) == 2
    said = "to resume" if "--resume" in words else "directory"
    assert capsys.readouterr().err == f"error: missing option --run: the run {said} is given as an option, `{command}`\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["PHOTOS", "RUN"]  # nothing made


@pytest.mark.parametrize(
    "arguments",
    [
        ["serve", "run", "--port", "99999"],  # was a traceback from the port check's socket
        ["demo", "--port", "0"],
        ["demo", "--classes", "0"],  # trained, then failed on an empty CSV
        ["demo", "--classes", "1"],  # wrote runs/demo/, then "only class ... is labeled" of a CSV the user never wrote
        ["index", "run", "images", "--batch-size", "-3"],  # was "nothing to index (no readable images)"
        ["index", "run", "images", "--threads", "0"],  # was silently all cores
        ["audit", "run", "images", "--shown", "-1"],
    ],
)
def test_numbers_out_of_range_are_one_line_before_any_work(arguments: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from retrieval.commands import main

    assert main(arguments) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"Invalid value for '{arguments[-2]}'" in err and "Traceback" not in err


def test_skipped_files_are_listed_with_absolute_paths(small_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from retrieval.commands import main
    from tests.conftest import write_bad_files

    write_bad_files(small_folder / "broken")
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(small_folder.relative_to(tmp_path)), "--run", "run", *TINY]) == 0
    paths = [entry["path"] for entry in json.loads((tmp_path / "run" / "skipped.json").read_text())]
    assert paths and all(Path(path).is_absolute() for path in paths)


@pytest.mark.parametrize(
    "options,message",
    [
        (["--int8", "--calibration", "minmx"], "--calibration 'minmx': did you mean 'minmax'? choose one of minmax, entropy, percentile"),
        (["--calibration", "entropy"], "--calibration entropy sets how --int8 quantises: add --int8"),
    ],
)
def test_a_calibration_mistake_is_said_before_the_export_writes_anything(demo_run: RunDir, options: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """It was said after the float32 export (seconds later), or, without --int8, not at all."""
    from retrieval.commands import main

    written = demo_run.model.stat().st_mtime_ns
    assert main(["export", str(demo_run.root), *options]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert demo_run.model.stat().st_mtime_ns == written


def test_the_command_to_run_next_names_the_users_own_run_quoted(demo_run: RunDir, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The hint said `retrieval index RUN IMAGES` (the user had to work out RUN), and a path with a space in it was
    printed unquoted in a command to copy."""
    import shutil

    from retrieval.commands import main

    run = tmp_path / "my run"
    shutil.copytree(demo_run.root, run, ignore=shutil.ignore_patterns("index"))
    query = first_test_image(demo_run)
    assert main(["search", str(run), query]) == 2
    assert capsys.readouterr().err == f"error: {run}/index: not an index (no manifest.json); build one with `retrieval index '{run}' IMAGES`\n"
    assert main(["index-stats", str(run)]) == 2  # a run not indexed yet: its index/ is meant, not the run as an index
    assert capsys.readouterr().err == f"error: {run}/index: not an index (no manifest.json); build one with `retrieval index '{run}' IMAGES`\n"
    assert main(["search", str(run), query, "--index", str(tmp_path / "elsewhere")]) == 2
    assert f"build one with `retrieval index RUN IMAGES --index {tmp_path / 'elsewhere'}`" in capsys.readouterr().err
    assert main(["search", str(tmp_path / "no run"), query]) == 2
    assert f"train one with `retrieval train DATA --run '{tmp_path / 'no run'}'`" in capsys.readouterr().err


def test_an_image_folder_or_an_index_given_as_the_run_says_what_to_give(demo_run: RunDir, small_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`retrieval serve photos` said to run `retrieval export photos`, and `serve runs/x/index` to export the index."""
    from retrieval.commands import main

    query = first_test_image(demo_run)
    for argv in (["serve", str(small_folder)], ["search", str(small_folder), query], ["export", str(small_folder)]):
        assert main(argv) == 2
        assert capsys.readouterr().err == f"error: {small_folder}: a folder of images, not a run; give the run directory, or make one with `retrieval train {small_folder} --run runs/NAME`\n"
    assert main(["search", str(demo_run.index), query]) == 2
    assert capsys.readouterr().err == f"error: {demo_run.index}: an index, not a run; give its run ({demo_run.root})\n"


def test_the_python_entry_points_take_a_run_or_a_collection_as_a_path(small_folder: Path, tmp_path: Path) -> None:
    """train(config, "runs/x"), export("runs/x"), OnnxEmbedder.from_run("runs/x") and evaluate_collection(embedder,
    "photos/test") ended in AttributeError ('str' object has no attribute 'root'); open_index("runs/x") said to build
    an index with --index runs/x, the run itself."""
    from index import build_index, open_index
    from retrieval import OnnxEmbedder, evaluate_collection, load_collection
    from retrieval.errors import RetrievalError
    from training import TrainConfig, export, train

    run = str(tmp_path / "run")
    train(TrainConfig(data=str(small_folder), epochs=1, batch_size=8, image_size=32), run, progress=False)
    export(run, whiten=None)
    embedder = OnnxEmbedder.from_run(run)
    assert RunDir(run).root == Path(run) and evaluate_collection(embedder, str(small_folder), progress=False).metrics["num_queries"] > 0
    assert build_index(embedder, str(small_folder), RunDir(run).index, progress=False).embedded == len(load_collection(small_folder).items)
    with pytest.raises(RetrievalError) as refused:
        open_index(run)
    assert str(refused.value) == f"{run}: a run, not an index; its index is {run}/index"
    service = SearchService(run)  # the app's service, as a script serves it
    try:
        assert len(service.items) == len(load_collection(small_folder).items)
    finally:
        service.close()
    config = TrainConfig(data=str(small_folder), epochs=1, batch_size=8, image_size=32)
    model = (RunDir(run).model).read_bytes()
    with pytest.raises(RetrievalError) as refused:  # a notebook cell run again trained over the run, its model kept
        train(config, run, progress=False)
    assert str(refused.value).startswith(f"{run} already holds a run (1 epoch trained); continue it with")
    assert str(refused.value).endswith("(from Python: train(..., resume=True) or overwrite=True)")
    assert RunDir(run).model.read_bytes() == model and RunDir(run).last_checkpoint.is_file()
    assert train(config, run, progress=False, overwrite=True).final_loss > 0


def test_classes_beyond_the_icons_are_all_of_them_said_once(capsys: pytest.CaptureFixture[str]) -> None:
    """`demo --classes 100000` used every class without a word, and was not reused by a later `make demo` (its
    settings differed); now it is the whole demo, said in one line."""
    from retrieval.commands.demo import _all_or
    from retrieval.datasets import icons

    available = sum(1 for path in (icons() / "train").iterdir() if path.is_dir())
    assert _all_or(None) is None and _all_or(available - 1) == available - 1 and capsys.readouterr().out == ""
    assert _all_or(100_000) is None and _all_or(available) is None
    said = capsys.readouterr().out.splitlines()
    assert said == [f"--classes {n}: the icons have {available} training classes; all are used" for n in (100_000, available)]


@pytest.mark.parametrize("command", ["train", "evaluate", "index", "audit"])
def test_a_collection_of_unreadable_images_says_which_and_why(demo_run: RunDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str) -> None:
    """Two labeled folders whose files are all broken: training said "0 images for the self-supervised loss", indexing
    "nothing to index (no readable images)" and left its journal behind, evaluating "fewer than two classes have readable
    images"; each now names how many could not be read, the first and why."""
    from retrieval.commands import main

    for label in ("cats", "dogs"):
        (tmp_path / "broken" / label).mkdir(parents=True)
        (tmp_path / "broken" / label / "1.jpg").write_text("saved from a web page, not a picture")
    monkeypatch.chdir(tmp_path)
    arguments = {
        "train": ["train", "broken", "--run", "run", *TINY],
        "evaluate": ["evaluate", str(demo_run.root), "broken"],
        "index": ["index", str(demo_run.root), "broken", "--index", "gallery"],
        "audit": ["audit", str(demo_run.root), "broken"],
    }[command]
    assert main(arguments) == 2
    err = capsys.readouterr().err
    first = tmp_path / "broken" / "cats" / "1.jpg"
    assert err.endswith(f"none of its 2 images could be read (the first, {first}: not a readable image (not a format Pillow recognises)); replace or remove them, or point at the right folder\n")
    assert err.count("error:") == 1 and "Traceback" not in err
    left = sorted(path.name for path in tmp_path.iterdir() if not path.name.endswith(".lock"))  # a folder's lock stays
    assert left == ["broken"]  # no run, index or journal


def test_a_query_that_cannot_be_read_is_named_as_it_was_given(demo_run: RunDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Two broken queries of the same name in two folders were both reported as "1.jpg"."""
    from retrieval.commands import main

    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "1.jpg").write_text("not a picture")
    monkeypatch.chdir(tmp_path)
    assert main(["search", str(demo_run.root), "a/1.jpg", "b/1.jpg"]) == 2
    err = capsys.readouterr().err
    assert "error: a/1.jpg: not a readable image" in err and "error: b/1.jpg: not a readable image" in err


def test_an_empty_folder_given_as_the_run_says_to_train_not_to_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`retrieval serve runs/new` of an empty folder (a typo'd or not yet trained run) said to run `retrieval export`,
    which then said to train: the first step is training."""
    from retrieval.commands import main

    (tmp_path / "new").mkdir()
    assert main(["serve", str(tmp_path / "new")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'new'}: no exported model (model.onnx + model.json) and no checkpoint; run `retrieval train DATA --run {tmp_path / 'new'}` first\n"


def test_too_few_classes_to_evaluate_names_the_files_not_found(demo_run: RunDir, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A CSV of two classes whose second class's file is not there said only "needs at least two labeled classes"."""
    from retrieval.commands import main

    (tmp_path / "listed.csv").write_text(f"path,label\n{first_test_image(demo_run)},cats\nmoved/away.png,dogs\n")
    assert main(["evaluate", str(demo_run.root), str(tmp_path / "listed.csv")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"(1 listed file skipped; the first, {tmp_path / 'moved' / 'away.png'}: listed in the CSV but not found)" in err
