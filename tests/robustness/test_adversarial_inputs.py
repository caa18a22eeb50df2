"""Every entry point (train, index, search, evaluate, the app's upload and API) given the adversarial
corpus: good files are used and correct, bad ones are skipped or refused with a reason, the job goes
on, and nothing already stored is lost."""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import pytest

from app.service import SearchService
from index.backends import open_index
from retrieval.commands import main
from retrieval.data import load_collection, load_image
from retrieval.errors import ImageError
from retrieval.runs import RunDir
from tests.conftest import copy_classes
from tests.robustness.corpus import LABEL, Corpus, write_corpus
from tests.test_cli import expect_error


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory, icons_root: Path) -> Corpus:
    """The adversarial corpus beside three real classes of the icons test split."""
    folder = tmp_path_factory.mktemp("adversarial") / "data"
    copy_classes(icons_root, folder, 3, split="test")
    return write_corpus(folder)


def real_images(corpus: Corpus) -> list[Path]:
    return sorted(path.resolve() for path in corpus.folder.rglob("*.png") if path.parent.name != LABEL)


def skipped_paths(report: Path) -> set[str]:
    return {row["path"] for row in json.loads(report.read_text())}


def test_every_bad_file_is_skipped_or_refused_and_every_good_one_read(corpus: Corpus) -> None:
    collection = load_collection(corpus.folder)
    listed = {item.path for item in collection.items}
    skipped = {s.path for s in collection.skipped}
    for kind, path in corpus.good.items():
        assert path.resolve() in listed, kind
        image = load_image(path)
        assert image.mode == "RGB" and min(image.size) >= 1, kind
    assert load_image(corpus.good["EXIF-rotated JPEG"]).size == (30, 60)
    for kind, path in corpus.bad.items():
        if path in skipped:
            assert next(s.reason for s in collection.skipped if s.path == path), kind
            continue
        with pytest.raises(ImageError) as error:
            load_image(path)
        assert str(path.name) in str(error.value) and error.value.reason, kind


def test_train_skips_the_bad_files_and_trains_on_the_rest(corpus: Corpus, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main(["train", str(corpus.folder), "--run", str(run), "--epochs", "1", "--batch-size", "16", "--image-size", "32"]) == 0
    out = capsys.readouterr().out
    good = len(corpus.good) + len(real_images(corpus))
    assert f"trained on {good} images of 4 classes" in " ".join(out.split())
    assert {Path(p).name for p in skipped_paths(run / "skipped.json")} >= {p.name for p in corpus.bad.values()}


def test_index_holds_exactly_the_good_files_and_loses_nothing_on_a_second_pass(corpus: Corpus, demo_run: RunDir, tmp_path: Path) -> None:
    directory = tmp_path / "index"
    assert main(["index", str(demo_run.root), str(corpus.folder), "--index", str(directory)]) == 0
    index = open_index(directory)
    stored = {path for path, _, _ in index.rows().values()}
    assert stored == {str(p.resolve()) for p in [*corpus.good.values(), *real_images(corpus)]}
    assert {Path(p).name for p in skipped_paths(directory / "skipped.json")} >= {p.name for p in corpus.bad.values()}
    before = index.rows()
    assert main(["index", str(demo_run.root), str(corpus.folder), "--index", str(directory)]) == 0
    assert open_index(directory).rows() == before  # the same ids, paths, labels and hashes


def test_search_answers_good_queries_and_refuses_bad_ones(corpus: Corpus, demo_run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    for kind, path in corpus.good.items():
        assert main(["search", str(demo_run.root), str(path), "-k", "3"]) == 0, kind
    capsys.readouterr()
    for kind, path in corpus.bad.items():
        expect_error(["search", str(demo_run.root), str(path)], capsys, path.name[:20] if path.name.isascii() else "not valid UTF-8")


def test_evaluate_scores_the_good_files_and_reports_the_bad(corpus: Corpus, demo_run: RunDir, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    for name in ("model.onnx", "model.json", "config.json"):
        shutil.copy(demo_run.root / name, run.root / name)
    assert main(["evaluate", str(run.root), str(corpus.folder)]) == 0
    metrics = json.loads(run.metrics.read_text())
    assert metrics["num_queries"] == len(corpus.good) + len(real_images(corpus))
    assert f"skipped {len(corpus.bad)} files" in capsys.readouterr().err


def test_the_app_answers_good_uploads_refuses_bad_ones_and_adds_only_good_files(corpus: Corpus, demo_run: RunDir, tmp_path: Path) -> None:
    index_dir = tmp_path / "index"
    shutil.copytree(demo_run.index, index_dir)
    service = SearchService(demo_run, index_dir, allow_write=True, cache=tmp_path / "cache")
    kinds = list(corpus.all)
    paths = [corpus.all[kind] for kind in kinds]
    results = service.search_images(paths, [3] * len(paths), [""] * len(paths), [None] * len(paths))
    for kind, result in zip(kinds, results):
        assert result.error == (kind in corpus.bad), kind
        assert result.hits if kind in corpus.good else "⚠️" in result.summary, kind
    before = open_index(index_dir).rows()
    added = service.add_images(paths, label='odd, "quoted" label')
    ids, skipped = added.ids, added.skipped
    assert len(ids) == len(corpus.good) and len(skipped) == len(corpus.bad)
    assert all(reason for _, reason in ((s.path, s.reason) for s in skipped))
    after = open_index(index_dir).rows()
    assert {i: after[i] for i in before} == before  # nothing stored before is lost or changed
    assert {after[i][1] for i in ids} == {'odd, "quoted" label'}


def test_the_app_api_answers_every_uploadable_file(corpus: Corpus, demo_run: RunDir, tmp_path: Path) -> None:
    """The same through HTTP (gradio_client), as a browser or a script sends them: /search, then /add."""
    from gradio_client import Client, handle_file

    from app.server import launch
    from tests.test_app import free_port

    index_dir = tmp_path / "index"
    shutil.copytree(demo_run.index, index_dir)
    service = SearchService(demo_run, index_dir, allow_write=True, cache=tmp_path / "cache")
    uploadable = {kind: path for kind, path in corpus.all.items() if path.is_file() and not path.is_symlink() and os.access(path, os.R_OK) and path.name.isprintable()}
    assert len(uploadable) >= len(corpus.all) - 5  # all but the pipe, the links and the non-UTF-8 name, which cannot be uploaded
    port = free_port()
    demo = launch(service, port=port, block=False)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        for kind, path in uploadable.items():
            gallery, summary = client.predict(handle_file(str(path)), 3, "", 0, api_name="/search")
            assert (len(gallery) == 3) if kind in corpus.good else (gallery == [] and "⚠️" in summary), (kind, summary)
        message, _ = client.predict([handle_file(str(path)) for path in uploadable.values()], "api", api_name="/add")
        good = sum(kind in corpus.good for kind in uploadable)
        assert message.startswith(f"added {good} image" + ("" if good == 1 else "s")) and message.count(": ") >= len(uploadable) - good, message
    finally:
        demo.close()
        service.close()


def test_a_csv_with_duplicates_and_labels_with_commas_and_quotes(corpus: Corpus, demo_run: RunDir, tmp_path: Path) -> None:
    images = real_images(corpus)[:4]
    listing = tmp_path / "gallery.csv"
    with listing.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "label"])
        writer.writerows([[images[0], 'gear, "large"'], [images[1], "plain"], [images[0], "again"], [images[2], "plain"], [images[3], 'say "hi"']])
    collection = load_collection(listing)
    assert [item.label for item in collection.items] == ['gear, "large"', "plain", "plain", 'say "hi"']
    assert [s.reason for s in collection.skipped] == ["listed in the CSV again with the label 'again'; the first row's 'gear, \"large\"' is used"]
    assert main(["index", str(demo_run.root), str(listing), "--index", str(tmp_path / "index")]) == 0
    labels = sorted(label for _, label, _ in open_index(tmp_path / "index").rows().values())
    assert labels == sorted(['gear, "large"', "plain", "plain", 'say "hi"'])
    missing = tmp_path / "missing.csv"
    missing.write_text("file,class\na.png,x\n")
    assert main(["index", str(demo_run.root), str(missing), "--index", str(tmp_path / "index2")]) == 2
