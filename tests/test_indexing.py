"""Batch indexing: incremental by content hash, --sync, .txt lists, and resuming after SIGKILL."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from index.backends import open_index
from index.build import build_index, journal_path
from index.journal import pending_rows
from retrieval.data import load_collection, load_image
from retrieval.embedders import OnnxEmbedder, PixelEmbedder, iter_embedded
from retrieval.errors import RetrievalError
from retrieval.runs import RunDir
from tests.conftest import copy_classes, ctrl_c_when, icon_copies, write_bad_files


@pytest.fixture(scope="module")
def embedder(demo_run: RunDir) -> OnnxEmbedder:
    return OnnxEmbedder.from_run(demo_run)


def indexed_paths(directory: Path) -> list[str]:
    return sorted(item.path.name for item in open_index(directory).items().values())


def test_incremental_runs_embed_only_new_or_changed_files(embedder: OnnxEmbedder, icons_root: Path, tmp_path: Path) -> None:
    gallery = copy_classes(icons_root, tmp_path / "gallery", 3, split="test")
    directory = tmp_path / "index"
    first = build_index(embedder, load_collection(gallery), directory, progress=False)
    total = len(first.index)
    assert (first.embedded, first.unchanged, first.removed) == (total, 0, 0)
    ids_before = {item.path.name: item_id for item_id, item in first.index.items().items()}

    again = build_index(embedder, load_collection(gallery), directory, progress=False)
    assert (again.embedded, again.unchanged, again.removed) == (0, total, 0)

    files = sorted(gallery.rglob("*.png"))
    Image.new("RGB", (64, 64), (10, 200, 10)).save(files[0])  # changed content
    shutil.copy(files[1], files[1].with_name("copy.png"))  # new file
    third = build_index(embedder, load_collection(gallery), directory, progress=False)
    assert (third.embedded, third.unchanged, third.removed) == (2, total - 1, 1)
    after = {item.path.name: item_id for item_id, item in third.index.items().items()}
    assert len(after) == total + 1
    assert all(after[name] == ids_before[name] for name in ids_before if name != files[0].name)  # ids stay stable
    assert after[files[0].name] > max(ids_before.values())  # a changed file gets a new id, never a reused one

    files[2].unlink()
    kept = build_index(embedder, load_collection(gallery), directory, progress=False)
    assert files[2].name in indexed_paths(directory) and kept.removed == 0
    synced = build_index(embedder, load_collection(gallery), directory, sync=True, progress=False)
    assert synced.removed == 1 and files[2].name not in indexed_paths(directory)
    assert not journal_path(directory).exists()


def test_sync_with_another_gallery_is_refused_not_emptying_the_index(embedder: OnnxEmbedder, icons_root: Path, tmp_path: Path) -> None:
    """`index RUN other --sync` (a command from the history, another folder) removed every entry of the first
    gallery, whose files were all still there; a gallery that was moved away still syncs."""
    from retrieval.errors import RetrievalError

    first = copy_classes(icons_root, tmp_path / "first", 2, split="test")
    other = copy_classes(icons_root, tmp_path / "other", 1, split="train")
    directory = tmp_path / "index"
    count = len(build_index(embedder, load_collection(first), directory, progress=False).index)
    with pytest.raises(RetrievalError, match=rf"--sync would remove all {count} entries, whose files are still there .* leave out --sync"):
        build_index(embedder, load_collection(other), directory, sync=True, progress=False)
    assert len(open_index(directory)) == count and not journal_path(directory).exists()
    shutil.move(first, tmp_path / "moved")
    moved = build_index(embedder, load_collection(tmp_path / "moved"), directory, sync=True, progress=False)
    assert moved.removed == count and len(moved.index) == count


def test_an_indexed_file_broken_since_is_noted_kept_and_removed_by_sync_unless_none_can_be_read(embedder: OnnxEmbedder, icons_root: Path, tmp_path: Path) -> None:
    """A file truncated after it was indexed kept its entry without a word, also with --sync (the index said 20
    images, and search found the broken file)."""
    gallery = copy_classes(icons_root, tmp_path / "gallery", 2, split="test")
    directory = tmp_path / "index"
    count = len(build_index(embedder, load_collection(gallery), directory, progress=False).index)
    files = sorted(gallery.rglob("*.png"))
    files[0].write_bytes(files[0].read_bytes()[:100])
    kept = build_index(embedder, load_collection(gallery), directory, progress=False)
    assert kept.stale == [str(files[0].resolve())] and kept.removed == 0 and len(kept.index) == count
    synced = build_index(embedder, load_collection(gallery), directory, sync=True, progress=False)
    assert synced.stale == [] and synced.removed == 1 and files[0].name not in indexed_paths(directory)
    for image in files[1:]:  # none can be read (a disk gone, not the files): --sync keeps every entry
        os.chmod(image, 0)
    if os.access(files[1], os.R_OK):  # root reads whatever the mode says: the files are broken instead
        for image in files[1:]:
            image.write_bytes(b"")
    blind = build_index(embedder, load_collection(gallery), directory, sync=True, progress=False)
    assert blind.removed == 0 and len(blind.index) == count - 1 and len(blind.stale) == count - 1


def test_a_txt_list_indexes_unlabeled_images(embedder: OnnxEmbedder, icons_root: Path, tmp_path: Path) -> None:
    files = sorted((icons_root / "test").rglob("*.png"))[:5]
    listing = tmp_path / "gallery.txt"
    listing.write_text("# my gallery\n" + "\n".join(os.path.relpath(f, tmp_path) for f in files) + "\nmissing.png\n")
    report = build_index(embedder, load_collection(listing), tmp_path / "index", progress=False)
    assert len(report.index) == 5 and {item.label for item in report.index.items().values()} == {""}
    assert [s.path.name for s in report.skipped] == ["missing.png"]


def test_an_index_of_another_encoder_needs_rebuild(embedder: OnnxEmbedder, icons_root: Path, tmp_path: Path) -> None:
    from retrieval.embedders import PixelEmbedder
    from retrieval.errors import RetrievalError

    gallery = copy_classes(icons_root, tmp_path / "gallery", 2, split="test")
    build_index(PixelEmbedder(), load_collection(gallery), tmp_path / "index", progress=False)
    with pytest.raises(RetrievalError, match="built with encoder"):
        build_index(embedder, load_collection(gallery), tmp_path / "index", progress=False)
    rebuilt = build_index(embedder, load_collection(gallery), tmp_path / "index", rebuild=True, progress=False)
    assert rebuilt.index.encoder_sha256 == embedder.fingerprint


def test_indexing_killed_with_sigkill_resumes_and_indexes_every_image_once(demo_run: RunDir, icons_root: Path, tmp_path: Path) -> None:
    gallery = icon_copies(icons_root, tmp_path / "gallery", 4)  # about 2,000 files: long enough to be killed part-way
    bad = write_bad_files(gallery / "broken")
    directory = tmp_path / "index"
    command = [sys.executable, "-m", "retrieval", "index", str(demo_run.root), str(gallery), "--index", str(directory), "--batch-size", "16"]
    worker = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=Path(__file__).parents[1])
    deadline = time.monotonic() + 120
    while pending_rows(journal_path(directory)) < 200 and worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait()
    done_before_kill = pending_rows(journal_path(directory))
    assert 0 < done_before_kill, "the job was killed before embedding anything"
    assert not (directory / "manifest.json").exists()  # nothing half-written is visible as an index

    finished = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=300)
    assert finished.returncode == 0, finished.stderr
    good = [p for p in gallery.rglob("*.png") if p.name not in {b.name for b in bad.values()}]
    names = [item.path for item in open_index(directory).items().values()]
    assert len(names) == len(set(names)) == len(good)  # every readable image exactly once
    assert f"resumed {done_before_kill}" in finished.stdout.replace("\n", " ")
    assert not journal_path(directory).exists()


def test_ctrl_c_during_indexing_says_what_is_kept_and_the_same_command_goes_on(demo_run: RunDir, icons_root: Path, tmp_path: Path) -> None:
    """Ctrl+C part-way: exit 130, no traceback, one line with the number of embedded images the journal keeps; the
    same command then resumes them."""
    gallery = icon_copies(icons_root, tmp_path / "gallery", 4)
    directory = tmp_path / "index"
    command = [sys.executable, "-m", "retrieval", "index", str(demo_run.root), str(gallery), "--index", str(directory), "--batch-size", "16"]
    status, err = ctrl_c_when(command, lambda _: pending_rows(journal_path(directory)) >= 100)
    kept = pending_rows(journal_path(directory))
    assert status == 130 and "Traceback" not in err, err
    kept_words, them = ("1 embedded image is", "it") if kept == 1 else (f"{kept:,} embedded images are", "them")
    assert err.strip().splitlines()[-1] == (
        f"interrupted: {kept_words} kept in {journal_path(directory)}; run the same command again "
        f"to go on from {them} (the index is not changed until a job ends)"
    )
    finished = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=300)
    assert finished.returncode == 0 and f"resumed {kept}" in finished.stdout.replace("\n", " "), finished.stderr


def test_ctrl_c_before_any_image_is_embedded_says_nothing_was_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import typer

    from retrieval.commands.indexing import _interrupted

    with pytest.raises(typer.Exit) as stopped:
        _interrupted(tmp_path / "index")
    assert stopped.value.exit_code == 130
    assert capsys.readouterr().err.strip() == "interrupted before any image was embedded; nothing was kept and the index is not changed"


def test_a_journal_resumes_and_ignores_files_no_longer_listed(embedder: OnnxEmbedder, icons_root: Path, tmp_path: Path) -> None:
    from index.journal import Journal
    from retrieval.embedders import embed_items

    gallery = copy_classes(icons_root, tmp_path / "gallery", 2, split="test")
    collection = load_collection(gallery)
    earlier = embed_items(embedder, collection.items[:3] + collection.items[-1:], progress=False)
    journal = Journal(journal_path(tmp_path / "index"), embedder.fingerprint, embedder.dim)
    journal.add(earlier.items, earlier.hashes, earlier.vectors)  # as left by a job killed part-way
    journal.connection.close()
    collection.items[-1].path.unlink()
    collection = load_collection(gallery)
    report = build_index(embedder, collection, tmp_path / "index", progress=False)
    assert (report.resumed, report.embedded) == (3, len(collection.items) - 3)
    names = indexed_paths(tmp_path / "index")
    assert len(names) == len(collection.items) and earlier.items[-1].path.name not in names


def test_a_journal_keeps_many_vectors_a_page_and_one_left_with_small_pages_still_resumes(tmp_path: Path) -> None:
    """New journals use PAGE_SIZE pages (a 512-d row is over half of SQLite's default 4 KiB page, so that page held one
    row); a journal written with the default pages, as a killed job of an earlier version left it, keeps them."""
    from index import journal as journal_module
    from index.journal import PAGE_SIZE, Journal
    from retrieval.data import Item

    vectors = np.random.default_rng(0).standard_normal((200, 512)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)  # an embedder's unit rows, which Additions keeps as they are
    items = [Item(tmp_path / f"{n}.png", "x") for n in range(200)]
    digests = [f"{n:064x}" for n in range(200)]
    for name, page in (("new.sqlite", PAGE_SIZE), ("old.sqlite", 4096)):
        journal_module.PAGE_SIZE = page
        try:
            written = Journal(tmp_path / name, "encoder", 512)
        finally:
            journal_module.PAGE_SIZE = PAGE_SIZE
        written.add(items, digests, vectors)
        written.connection.close()
        reopened = Journal(tmp_path / name, "encoder", 512)
        assert reopened.connection.execute("PRAGMA page_size").fetchone()[0] == page
        (chunk,) = list(reopened.chunks())
        np.testing.assert_array_equal(chunk.vectors, vectors)
        assert chunk.items == items and chunk.hashes == digests
        reopened.discard()
    assert PAGE_SIZE >= 16 * (512 * 4 + 200)  # at least 16 rows of a 512-d vector a page


def test_a_journal_row_for_content_that_changed_back_is_not_used(embedder: OnnxEmbedder, icons_root: Path, tmp_path: Path) -> None:
    from index.journal import Journal

    gallery = copy_classes(icons_root, tmp_path / "gallery", 2, split="test")
    directory = tmp_path / "index"
    build_index(embedder, load_collection(gallery), directory, progress=False)
    target = sorted(gallery.rglob("*.png"))[0]
    original = target.read_bytes()
    Image.new("RGB", (64, 64), (0, 0, 255)).save(target)  # changed, embedded by a job that is then killed
    changed = load_collection(gallery)
    from retrieval.embedders import embed_items

    stale = embed_items(embedder, [item for item in changed.items if item.path == target.resolve()], progress=False)
    journal = Journal(journal_path(directory), embedder.fingerprint, embedder.dim)
    journal.add(stale.items, stale.hashes, stale.vectors)
    journal.connection.close()
    target.write_bytes(original)  # and changed back before the next run
    report = build_index(embedder, load_collection(gallery), directory, progress=False)
    assert (report.embedded, report.removed) == (0, 0)
    query = embed_items(embedder, [item for item in changed.items if item.path == target.resolve()], progress=False).vectors
    best = report.index.search(query, k=1)[0][0]
    assert best.path == target.resolve().as_posix() and best.score > 0.9999  # the indexed vector is the original's


def test_one_pipeline_per_core_gives_the_same_vectors_in_order(embedder: OnnxEmbedder, icons_root: Path, tmp_path: Path) -> None:
    """iter_embedded with a thread per core (each on a one-thread copy of the model) keeps the items' order, skips
    bad files and gives the vectors of the whole-machine session."""
    gallery = copy_classes(icons_root, tmp_path / "gallery", 4, split="test")
    (gallery / "bad.png").write_bytes(b"not a picture")
    items = load_collection(gallery).items
    batches = list(iter_embedded(embedder, items, batch_size=5, workers=3, progress=False))
    assert [len(batch.items) + len(batch.skipped) for batch in batches] == [min(5, len(items) - s) for s in range(0, len(items), 5)]
    good = [item for batch in batches for item in batch.items]
    assert good == [item for item in items if item.path.name != "bad.png"]
    assert [skip.path.name for batch in batches for skip in batch.skipped] == ["bad.png"]
    whole = embedder.embed([load_image(item.path) for item in good])
    np.testing.assert_allclose(np.concatenate([batch.vectors for batch in batches]), whole, atol=1e-5)
    single = embedder.one_core()
    assert single is embedder.one_core() and single.threads == 1 and single.one_core() is single and embedder.threads == os.cpu_count()


class _SlowPixels(PixelEmbedder):
    """Raw pixels embedded in a set time a batch, the stand-in for an encoder."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.batch_size, self.seconds = 4, seconds

    def embed_prepared(self, batch: np.ndarray) -> np.ndarray:
        time.sleep(self.seconds)
        return super().embed_prepared(batch)


@pytest.mark.parametrize(("decoding", "embedding", "in_turn"), [(0.01, 0.04, True), (0.04, 0.005, False)])
def test_pipelines_take_turns_decoding_while_it_is_the_shorter_part(
    decoding: float, embedding: float, in_turn: bool, icons_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pipelines started together stayed in step, every core decoding at once (small pictures: Python, under the
    interpreter lock) and then every core embedding; now they take turns while decoding is shorter than embedding,
    and decode at once where it is longer (large photos: C, without the lock) or before a batch is embedded."""
    import retrieval.embedders as embedders

    spans: list[tuple[float, float]] = []
    real = embedders._decoded

    def decoded(*args: object) -> object:
        started = time.perf_counter()
        time.sleep(decoding)  # the interpreter lock is free meanwhile, as in Pillow's C decoders
        result = real(*args)
        spans.append((started, time.perf_counter()))
        return result

    embedded: list[float] = []
    recorded = embedders._Turns.embedded

    def record(turns: object, seconds: float) -> None:
        recorded(turns, seconds)
        embedded.append(time.perf_counter())

    monkeypatch.setattr(embedders, "_decoded", decoded)
    monkeypatch.setattr(embedders._Turns, "embedded", record)
    items = load_collection(copy_classes(icons_root, tmp_path / "gallery", 8, split="test")).items[:40]
    batches = list(iter_embedded(_SlowPixels(embedding), items, workers=2, progress=False))
    assert [item for batch in batches for item in batch.items] == items
    later = sorted(span for span in spans if span[0] > min(embedded))  # begun once a batch's embedding was timed
    overlaps = sum(second[0] < first[1] for first, second in zip(later, later[1:]))
    assert len(later) >= 6 and (overlaps == 0) == in_turn, (len(later), overlaps)


def test_embedding_refuses_batch_sizes_workers_and_thumbnails_it_cannot_use(embedder: OnnxEmbedder, icons_root: Path, tmp_path: Path) -> None:
    """embed_items(..., batch_size=-1) returned no vectors and no word (a range with a negative step is empty),
    batch_size=0 stood for the default, 2.5 failed in range() and thumbnail=-1 inside Pillow."""
    from retrieval.embedders import embed_items

    paths = sorted(copy_classes(icons_root, tmp_path / "gallery", 1, split="test").glob("*/*"))
    for options, said in (
        ({"batch_size": -1}, "batch_size must be at least 1, got -1"),
        ({"batch_size": 0}, "batch_size must be at least 1, got 0"),
        ({"batch_size": 2.5}, "batch_size=2.5: give a whole number"),
        ({"thumbnail": -1}, "thumbnail must be at least 0, got -1"),
        ({"thumbnail": True}, "thumbnail=True: give a whole number"),
    ):
        with pytest.raises(RetrievalError) as refused:
            embed_items(embedder, paths, progress=False, **options)  # type: ignore[arg-type]
        assert str(refused.value) == said
    with pytest.raises(RetrievalError, match="^workers must be at least 1, got 0$"):
        list(iter_embedded(embedder, load_collection(tmp_path / "gallery").items, workers=0, progress=False))
    assert len(embed_items(embedder, paths, batch_size=np.int64(2), progress=False).vectors) == len(paths)
    with pytest.raises(RetrievalError, match="^threads must be at least 0, got -1$"):  # ONNX Runtime took -1
        OnnxEmbedder(embedder.model_path, embedder.card, threads=-1)


def test_the_core_takes_image_paths_and_collection_paths(embedder: OnnxEmbedder, icons_root: Path, tmp_path: Path) -> None:
    """embed_items(embedder, ["a.png"]) failed with "'str' object has no attribute 'path'", and
    evaluate_query_gallery(embedder, "queries", "gallery") with "'str' object has no attribute 'items'"."""
    from retrieval.embedders import embed_items
    from retrieval.evaluation import evaluate_query_gallery

    gallery = copy_classes(icons_root, tmp_path / "gallery", 2, split="test")
    collection = load_collection(gallery)
    expected = embed_items(embedder, collection.items, progress=False)
    by_paths = embed_items(embedder, [str(item.path) for item in collection.items], progress=False)
    assert np.array_equal(by_paths.vectors, expected.vectors) and [item.path for item in by_paths.items] == [item.path for item in expected.items]
    assert all(item.label == "" for item in by_paths.items)  # paths alone carry no label
    assert np.array_equal(embed_items(embedder, gallery, progress=False).vectors, expected.vectors)
    assert np.array_equal(embed_items(embedder, collection, progress=False).vectors, expected.vectors)
    first = sorted(gallery.iterdir())[0]
    queries = tmp_path / "queries"
    (queries / first.name).mkdir(parents=True)
    for image in sorted(first.iterdir())[:2]:  # queries of one class, out of the gallery
        shutil.move(image, queries / first.name / image.name)
    scored = evaluate_query_gallery(embedder, str(queries), gallery, progress=False)
    assert scored.metrics["queries"] == str(queries.resolve()) and 0 <= scored.metrics["recall@1"] <= 1


def test_build_index_from_python_takes_memory_as_written_and_refuses_a_list(embedder: OnnxEmbedder, icons_root: Path, tmp_path: Path) -> None:
    """build_index(embedder, ["a.png"], ...) failed with "expected str, bytes or os.PathLike object, not list", and
    memory="4GB" was taken as it was (a budget compared with numbers only for large galleries)."""
    gallery = copy_classes(icons_root, tmp_path / "gallery", 2, split="test")
    with pytest.raises(RetrievalError, match="^collection: a Collection or its path .*not a list; to index a list of files, write them into a .txt list$"):
        build_index(embedder, [str(path) for path in gallery.glob("*/*")], tmp_path / "index", progress=False)  # type: ignore[arg-type]
    with pytest.raises(RetrievalError, match="^--memory 'lots': give a size such as 4GB"):
        build_index(embedder, gallery, tmp_path / "index", memory="lots", progress=False)
    with pytest.raises(RetrievalError, match="^source: a collection's path .*not a list; to read a list of files, write them into a .txt list$"):
        load_collection([str(gallery)])  # type: ignore[arg-type]  # it failed inside pathlib
    with pytest.raises(RetrievalError, match="^batch_size must be at least 1, got 0$"):
        build_index(embedder, gallery, tmp_path / "index", batch_size=0, progress=False)
    with pytest.raises(RetrievalError, match="^batch_size=2.5: give a whole number$"):  # a TypeError from range()
        build_index(embedder, gallery, tmp_path / "index", batch_size=2.5, progress=False)  # type: ignore[arg-type]
    assert not (tmp_path / "index").exists()
    assert build_index(embedder, gallery, tmp_path / "index", memory="4GB", progress=False).embedded == len(list(gallery.glob("*/*")))
