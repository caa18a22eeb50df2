"""Index save -> load -> search round trip, and refusal of damaged or mismatched indexes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from index.backends import open_index
from index.store import GalleryIndex
from index.types import MANIFEST
from retrieval.data import Item
from retrieval.embedders import l2_normalise
from retrieval.errors import RetrievalError


def build(directory: Path, n: int = 20, dim: int = 8, encoder: str = "enc-a") -> tuple[GalleryIndex, np.ndarray]:
    vectors = l2_normalise(np.random.default_rng(0).standard_normal((n, dim)))
    items = [Item(Path(f"/gallery/{i % 3}/img{i}.png"), f"label{i % 3}") for i in range(n)]
    return GalleryIndex.build(directory, vectors, items, [f"sha{i}" for i in range(n)], encoder), vectors


def test_round_trip(tmp_path: Path) -> None:
    built, vectors = build(tmp_path / "index")
    loaded = open_index(tmp_path / "index", "enc-a", 8)
    assert len(loaded) == 20 and loaded.manifest == built.manifest
    hits = loaded.search(vectors[[3, 7]], k=4)
    assert [row[0].id for row in hits] == [4, 8]  # ids are SQLite row ids, 1-based in item order
    assert hits[0][0].path == "/gallery/0/img3.png" and hits[0][0].label == "label0"
    assert hits[0][0].score == pytest.approx(1.0, abs=1e-5)
    assert all(a.score >= b.score for row in hits for a, b in zip(row, row[1:]))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]  # no staging directory left behind


def test_rebuild_replaces_the_previous_index(tmp_path: Path) -> None:
    build(tmp_path / "index", n=20)
    build(tmp_path / "index", n=5)
    assert len(open_index(tmp_path / "index")) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"]


def test_mismatched_encoder_and_dimension_are_refused(tmp_path: Path) -> None:
    build(tmp_path / "index")
    with pytest.raises(RetrievalError, match=f"built with encoder enc-a.*rebuild the index with `retrieval index {tmp_path} IMAGES --rebuild`"):
        open_index(tmp_path / "index", "enc-b")  # the run's own path in the command, not RUN
    with pytest.raises(RetrievalError, match="8-dimensional vectors, the encoder makes 16"):
        open_index(tmp_path / "index", "enc-a", 16)
    (tmp_path / "model.json").write_text(json.dumps({"sha256": "enc-a", "int8": {"sha256": "enc-a8"}}))
    with pytest.raises(RetrievalError, match=f"it is {tmp_path}'s own index, built by that run's model: use {tmp_path}, or index"):
        open_index(tmp_path / "index", "enc-b")  # another run's model given: rebuilding this run's index would not help
    with pytest.raises(RetrievalError, match=r"use the model it was built with \(--model float32\), or rebuild"):
        open_index(tmp_path / "index", "enc-a8")  # the run's own int8 model: the other precision, named
    (tmp_path / "model.json").write_text(json.dumps({"sha256": "enc-c"}))  # exported again since the index was built
    with pytest.raises(RetrievalError, match=f"no model of {tmp_path} built it \\(exported again since\\?\\): rebuild the index"):
        open_index(tmp_path / "index", "enc-c")  # it said to use the model it was built with: the run has it no more
    (tmp_path / "model.json").write_text("{")  # a damaged card: the advice of an index of no known run
    with pytest.raises(RetrievalError, match="built with encoder enc-a.*rebuild the index with"):
        open_index(tmp_path / "index", "enc-b")


@pytest.mark.parametrize("damage", ["truncate-vectors", "drop-items", "garble-manifest", "no-manifest"])
def test_damaged_indexes_are_refused(tmp_path: Path, damage: str) -> None:
    directory = tmp_path / "index"
    build(directory)
    if damage == "truncate-vectors":
        data = (directory / "vectors.faiss").read_bytes()
        (directory / "vectors.faiss").write_bytes(data[: len(data) // 2])
    elif damage == "drop-items":
        (directory / "items.sqlite").write_bytes(b"garbage" * 100)
    elif damage == "garble-manifest":
        (directory / "manifest.json").write_text("{not json")
    else:
        (directory / "manifest.json").unlink()
    with pytest.raises(RetrievalError, match=str(directory)) as refused:
        open_index(directory)
    assert f"`retrieval index {tmp_path} IMAGES" in str(refused.value)  # the command to run names the run


def test_empty_gallery_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RetrievalError, match="nothing to index"):
        GalleryIndex.build(tmp_path / "index", np.zeros((0, 4), np.float32), [], [], "enc")


@pytest.mark.parametrize("in_memory", [True, False])
def test_batch_arrays_agree_with_the_hits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_memory: bool) -> None:
    if not in_memory:
        monkeypatch.setattr("index.store.COLUMN_LIMIT", 0)  # items looked up in SQLite once per batch
    built, vectors = build(tmp_path / "index", n=30)
    index = built.update([], [5, 6])  # removed ids leave "" in the columns, never a hit
    found = index.search_arrays(vectors[:4], k=6)
    assert found.ids.shape == found.paths.shape == found.labels.shape == found.sha256.shape == (4, 6)
    assert (index.columns is not None) == in_memory
    hits = index.search(vectors[:4], k=6)
    assert [[hit.id for hit in row] for row in hits] == found.ids.tolist()
    assert [[(hit.path, hit.label, hit.sha256) for hit in row] for row in hits] == [
        list(zip(*columns)) for columns in zip(found.paths.tolist(), found.labels.tolist(), found.sha256.tolist())
    ]
    assert found.hits() == hits and not {5, 6} & set(found.ids.ravel().tolist())
    assert found.paths[0, 0] == "/gallery/0/img0.png" and found.sha256[1, 0] == "sha1"
    only = index.search_arrays(vectors[:2], k=20, label="label1")
    assert set(only.labels[only.ids >= 0].tolist()) == {"label1"} and (only.paths[only.ids < 0] == "").all()
    none = index.search_arrays(vectors[:2], k=3, label="no such label")
    assert none.ids.shape == (2, 0) and none.hits() == [[], []]


def test_a_folder_of_other_files_or_the_one_worked_in_is_never_an_index_swapped_away(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`retrieval index RUN IMAGES --index photos` replaced the folder photos whole: its files were deleted. With
    `--index .` it would have swapped away the folder the command ran in."""
    from index.disk import writer_lock

    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "notes.txt").write_text("kept")
    with pytest.raises(RetrievalError, match=r"holds files that are not an index's \(notes.txt\), which building it there would delete"):
        with writer_lock(mine):
            pass
    assert (mine / "notes.txt").read_text() == "kept"
    monkeypatch.chdir(mine)
    for given in (Path("."), Path(".."), tmp_path):
        with pytest.raises(RetrievalError, match="the folder you are in \\(or one above it\\); an index replaces its folder whole"):
            with writer_lock(given):
                pass
    build(tmp_path / "index")
    (tmp_path / "index" / MANIFEST).unlink()  # a damaged index: rebuilding it in place is what its error advises
    with writer_lock(tmp_path / "index"):
        pass
    (tmp_path / "empty").mkdir()
    with writer_lock(tmp_path / "empty"):
        pass


def test_one_query_serves_every_vector_and_a_list_of_another_length_is_refused(tmp_path: Path) -> None:
    """search_vectors(index, five_vectors, [Query(3)]) answered the first vector and dropped four without a word;
    search_images(index, embedder, "query.jpg", ...) read "9 images for 1 queries"."""
    from index.search import Query, search_images, search_vectors

    index, vectors = build(tmp_path / "index")
    each = search_vectors(index, vectors[:5], Query(3))
    assert [hits[0].id for hits in each] == [1, 2, 3, 4, 5] and all(len(hits) == 3 for hits in each)
    assert each == search_vectors(index, vectors[:5], [Query(3)] * 5)
    with pytest.raises(RetrievalError) as refused:
        search_vectors(index, vectors[:5], [Query(3)])
    assert str(refused.value) == "5 vectors for 1 queries: give one Query for all of them, or a list of one per item"
    with pytest.raises(RetrievalError) as refused:
        search_images(index, None, "query.jpg", [Query(3)])  # type: ignore[arg-type]
    assert str(refused.value) == "images: a list of image files, not one file; write ['query.jpg']"
    with pytest.raises(RetrievalError, match=r"^images: a Image object is not an image file's path; give paths, or search an"):
        search_images(index, None, [Image.new("RGB", (8, 8))], Query(3))  # type: ignore[arg-type]  # a TypeError
    with pytest.raises(RetrievalError, match="^2 images for 3 queries"):
        search_images(index, None, ["a.jpg", "b.jpg"], [Query(3)] * 3)  # type: ignore[arg-type]
    # without queries, each is answered as Query() is (10 hits), as search_items answers; a k or None given
    # for the queries failed in "object of type 'int' has no len()"
    assert search_vectors(index, vectors[:2]) == search_vectors(index, vectors[:2], Query())
    assert [len(hits) for hits in search_vectors(index, vectors[:2])] == [10, 10]
    for wrong, named in ((5, "int"), (None, "NoneType"), ([Query(3), 5], "int"), ("k=5", "str")):
        with pytest.raises(RetrievalError) as refused:
            search_vectors(index, vectors[:2], wrong)  # type: ignore[arg-type]
        assert str(refused.value) == f"queries: a {named} is not a Query; give one Query for all (e.g. Query(k=5)), or a list of one per item"


def test_queries_no_search_can_answer_are_refused(tmp_path: Path) -> None:
    """A NaN query found no hit without a word, search_arrays(k=0) answered one hit, search_items(index, 3) failed
    with "'int' object is not iterable"."""
    from index.search import Query, search_items, search_vectors

    index, vectors = build(tmp_path / "index")
    broken = vectors[:3].copy()
    broken[1, 2] = np.nan
    with pytest.raises(RetrievalError, match=r"^query row 1 holds NaN or infinite values; give finite vectors$"):
        search_vectors(index, broken, Query(3))
    broken[1, 2] = np.inf
    with pytest.raises(RetrievalError, match="^query row 1 holds NaN or infinite"):
        index.search_arrays(broken, 3)
    for k in (0, -2):
        with pytest.raises(RetrievalError, match=f"^k must be at least 1, got {k}$"):
            index.search_arrays(vectors[:2], k)
    with pytest.raises(RetrievalError, match=r"^queries have dimension 3, the index 8$"):
        index.search_arrays(vectors[:2, :3], 2)
    with pytest.raises(RetrievalError, match=r"^ids: a list of item ids, not one id; write \[3\]$"):
        search_items(index, 3)  # type: ignore[arg-type]
    assert [hits[0].id for hits in search_items(index, [3], Query(1))] != [3]  # the item itself is left out


def test_vectors_not_of_unit_length_are_scaled_and_zeros_refused(tmp_path: Path) -> None:
    """A query vector of length 3 scored 3 (above any match threshold), a row of zeros was answered with score-0 hits,
    an index built from raw vectors scored by their lengths, and search_item(index, "3") said item 3 did not exist."""
    from index.search import Query, search_item, search_vectors

    index, vectors = build(tmp_path / "index")
    (scaled,) = search_vectors(index, 3 * vectors[[4]], Query(3))
    assert scaled == search_vectors(index, vectors[[4]], Query(3))[0] and scaled[0].score == pytest.approx(1.0, abs=1e-5)
    assert search_vectors(index, vectors[[4]], Query(3))[0][0].score == index.search(vectors[[4]], 1)[0][0].score
    with pytest.raises(RetrievalError, match=r"^query row 1 is all zeros: it has no direction to search by$"):
        search_vectors(index, np.stack([vectors[0], np.zeros(8, np.float32)]), Query(3))
    with pytest.raises(RetrievalError, match=r"^queries: a matrix of one row per query, not an array of shape \(1, 1, 8\)$"):
        search_vectors(index, vectors[None, :1], Query(3))
    with pytest.raises(RetrievalError, match=r"^ids: '3' is not an item id; give whole numbers"):
        search_item(index, "3", Query(3))  # type: ignore[arg-type]
    items = [Item(Path(f"/gallery/img{i}.png"), "a") for i in range(20)]
    raw = GalleryIndex.build(tmp_path / "raw", 5 * vectors, items, [f"sha{i}" for i in range(20)], "enc-a")
    assert raw.search(vectors[[2]], 1)[0][0].score == pytest.approx(1.0, abs=1e-5)
    broken = vectors.copy()
    broken[6] = 0
    with pytest.raises(RetrievalError, match=r"^the vector of /gallery/img6.png holds only zeros; it cannot be indexed$"):
        GalleryIndex.build(tmp_path / "broken", broken, items, [f"sha{i}" for i in range(20)], "enc-a")
    broken[6] = np.nan
    with pytest.raises(RetrievalError, match=r"^the vector of /gallery/img6.png holds NaN or infinite values"):
        GalleryIndex.build(tmp_path / "broken", broken, items, [f"sha{i}" for i in range(20)], "enc-a")


def test_an_image_indexed_twice_leaves_one_copy_out_and_k_hits(tmp_path: Path) -> None:
    """A query whose bytes the gallery held twice lost both copies from its hits: k=3 answered 2, and the copy that
    was not the query itself was hidden."""
    from index.search import Query, search_vectors

    vectors = l2_normalise(np.random.default_rng(0).standard_normal((20, 8)))
    vectors[7] = vectors[3]  # the same picture twice
    items = [Item(Path(f"/gallery/img{i}.png"), "a") for i in range(20)]
    digests = ["dup" if i in (3, 7) else f"sha{i}" for i in range(20)]
    index = GalleryIndex.build(tmp_path / "index", vectors, items, digests, "enc-a")
    (hits,) = search_vectors(index, vectors[[3]], Query(3), itself=[lambda hit: hit.sha256 == "dup"])
    assert len(hits) == 3 and hits[0].id == 8 and hits[0].score == pytest.approx(1.0, abs=1e-5)  # item 4 is its own
    assert 4 not in [hit.id for hit in hits]


def test_a_query_of_the_wrong_type_is_refused_where_it_is_made(tmp_path: Path) -> None:
    """Query(k="5") failed with "'<' not supported between 'str' and 'int'", Query(k=2.5) inside numpy and
    Query(label=5) inside difflib; numpy's whole numbers are taken."""
    from index.search import Query, search_vectors

    for given, said in [({"k": "5"}, "Query k='5': give a whole number"), ({"k": 2.5}, "Query k=2.5: give a whole number"), ({"k": True}, "Query k=True: give a whole number"), ({"depth": 1.5}, "Query depth=1.5: give a whole number"), ({"label": 5}, "Query label=5: give the label as text, or None for any label"),
                        ({"rerank": "qe"}, "Query rerank='qe': give a Rerank, e.g. retrieval.rerank.parse_rerank('qe')"),  # no attribute 'active'
                        ({"threshold": "0.5"}, "--threshold '0.5': give a cosine similarity between -1 and 1"),  # failed comparing a score with text
                        ({"threshold": 5}, "--threshold 5: give a cosine similarity between -1 and 1"), ({"threshold": float("nan")}, "--threshold nan: give")]:
        with pytest.raises(RetrievalError) as refused:
            Query(**given)
        assert str(refused.value).startswith(said)
    index, vectors = build(tmp_path / "index")
    query = Query(k=np.int64(3))
    assert type(query.k) is int and [len(hits) for hits in search_vectors(index, vectors[:2], query)] == [3, 3]


def test_a_run_given_where_its_index_goes(tmp_path: Path) -> None:
    """open_index(RunDir) failed in pathlib ("expected str, bytes or os.PathLike object, not RunDir"); building an
    index into the run's own folder said it held "files that are not an index's (.index.lock, ...)"."""
    from index.build import build_index
    from retrieval.embedders import PixelEmbedder
    from retrieval.runs import RunDir
    from tests.conftest import write_bad_files

    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.config.write_text("{}")
    images = write_bad_files(tmp_path / "images" / "red")["text"].parent
    with pytest.raises(RetrievalError) as refused:
        build_index(PixelEmbedder(8), images, run.root, progress=False)
    assert str(refused.value) == f"index {run.root}: a run, not an index's folder; its index is {run.index}"
    report = build_index(PixelEmbedder(8), images, run, progress=False)  # the run's own index
    assert (run.index / MANIFEST).is_file() and len(report.skipped) == 3
    assert len(open_index(run)) == 1 == len(open_index(str(run.index)))


def test_a_run_given_where_its_encoder_goes_says_how_to_load_it(tmp_path: Path) -> None:
    """A run goes by its path where a RunDir goes, so search_images(index, "runs/photos", ...) is an easy slip: it
    failed with "'str' object has no attribute 'input_size'", and build_index, add_images, remove_items,
    embed_items and evaluate_collection each with an AttributeError of their own."""
    from index.build import build_index
    from index.edit import add_images, remove_items
    from index.search import Query, search_images
    from index.stats import index_stats
    from retrieval.embedders import PixelEmbedder, embed_items
    from retrieval.evaluation import evaluate_collection
    from retrieval.runs import RunDir
    from tests.conftest import write_bad_files

    run = RunDir(tmp_path / "run")
    images = write_bad_files(tmp_path / "images" / "red")["text"].parent
    build_index(PixelEmbedder(8), images, run, progress=False)
    picture = next(images.glob("*.png"))
    calls = {
        "build_index": lambda given: build_index(given, images, tmp_path / "other", progress=False),
        "search_images": lambda given: search_images(open_index(run), given, [picture], Query(3)),
        "add_images": lambda given: add_images(run, given, [picture], "red", tmp_path / "uploads"),
        "remove_items": lambda given: remove_items(run, given, [0]),
        "embed_items": lambda given: embed_items(given, [picture], progress=False),
        "evaluate_collection": lambda given: evaluate_collection(given, images, progress=False),
        "index_stats": lambda given: index_stats(run.index, embedder=given),
    }
    said = {
        str(run.root): f"embedder: {str(run.root)!r} is a run, not its encoder; load it first: OnnxEmbedder.from_run({str(run.root)!r})",
        "None": "embedder: None is not an encoder; give an Embedder, e.g. OnnxEmbedder.from_run(RUN)",
    }
    for name, call in calls.items():
        for given, message in [(run, said[str(run.root)]), (str(run.root), said[str(run.root)]), (run.root, said[str(run.root)]), (None, said["None"])]:
            if given is None and name == "index_stats":  # None there: no copies measured
                continue
            with pytest.raises(RetrievalError) as refused:
                call(given)
            assert str(refused.value) == message, name
    assert not (tmp_path / "other").exists() and not (tmp_path / "uploads").exists()
    assert len(open_index(run)) == 1
    with pytest.raises(RetrievalError) as refused:  # a file, not a run: no from_run of it advised
        embed_items(run.root / "model.onnx", [picture], progress=False)  # type: ignore[arg-type]
    assert str(refused.value) == f"embedder: '{run.root}/model.onnx' is not an encoder; give an Embedder, e.g. OnnxEmbedder.from_run(RUN)"


def test_a_file_or_an_image_folder_given_where_an_index_goes_says_what_to_give(tmp_path: Path) -> None:
    """open_index("run/model.json") said to build an index with `--index run/model.json`, which index refuses."""
    from retrieval.runs import RunDir

    run = RunDir(tmp_path / "run")
    build(run.index)
    (run.root / "model.json").write_text("{}")
    (tmp_path / "photo.png").write_bytes(b"x")
    said = {
        run.index / MANIFEST: f"{run.index / MANIFEST}: a file, not an index's folder; give its folder, {run.index}",
        run.root / "model.json": f"{run.root}/model.json: a file, not an index's folder; its run's index is {run.index}",
        tmp_path / "photo.png": f"{tmp_path}/photo.png: a file, not an index's folder; give the folder `retrieval index` "
        "wrote (a run's index/, or the one its --index named)",
    }
    for path, message in said.items():
        with pytest.raises(RetrievalError) as refused:
            open_index(path)
        assert str(refused.value) == message
    images = tmp_path / "photos" / "cats"
    images.mkdir(parents=True)
    (images / "a.jpg").write_bytes(b"x")
    with pytest.raises(RetrievalError) as refused:  # it said to build an index with --index photos, among them
        open_index(tmp_path / "photos")
    assert str(refused.value) == f"{tmp_path}/photos: a folder of images, not an index; index them with `retrieval index RUN {tmp_path}/photos`"


def test_an_embedder_given_paths_or_one_image_says_what_to_give() -> None:
    """embed(["a.png"]) failed with "'str' object has no attribute 'size'" deep in preprocessing, embed([]) in
    numpy's stack; an empty list now gives no rows."""
    from PIL import Image

    from retrieval.embedders import PixelEmbedder
    from retrieval.preprocess import Preprocessing

    embedder, image = PixelEmbedder(8), Image.new("RGB", (10, 10))
    for given, said in [(["a.png"], "images: 'a.png' is a str, not a PIL image; open it with PIL.Image.open, or embed files with retrieval.embed_items(embedder, paths)"), ("a.png", "images: 'a.png' is a path, not a list of PIL images; embed files with retrieval.embed_items(embedder, [path])"), (image, "images: a list of images, not one image; write [image]")]:
        for embed in (embedder.embed, Preprocessing(16)):
            with pytest.raises(RetrievalError) as refused:
                embed(given)
            assert str(refused.value) == said
    assert Preprocessing(16)([]).shape == (0, 3, 16, 16) and embedder.embed([]).shape == (0, 64)
    assert embedder.embed([image]).shape == (1, 64)


def test_the_query_behind_ties_with_copies_of_its_picture_is_still_named(tmp_path: Path) -> None:
    """A white picture among white pictures of other sizes (the same embedding, other bytes): the copies with lower
    ids filled its k + 1 candidates, so its own gallery item was not found and no note named it ("itself": null)."""
    from PIL import Image

    from index.build import build_index
    from index.search import Query, search_images, search_items
    from retrieval.embedders import PixelEmbedder

    folder = tmp_path / "images" / "white"
    folder.mkdir(parents=True)
    for side in range(1, 9):
        Image.new("RGB", (side, side), "white").save(folder / f"{side}.png")
    Image.linear_gradient("L").convert("RGB").save(folder / "x-gradient.png")
    build_index(PixelEmbedder(8), folder.parent, tmp_path / "index", progress=False)
    index = open_index(tmp_path / "index")
    own = next(i for i, row in index.rows().items() if row.path.endswith("8.png"))
    for k in (1, 3):
        [result] = search_images(index, PixelEmbedder(8), [folder / "8.png"], Query(k=k))
        assert result.itself is not None and result.itself.id == own and len(result.hits) == k
        assert own not in {hit.id for hit in result.hits} and all(hit.score > 0.999 for hit in result.hits)
        assert result.notes == [f"the query is gallery item {own}, 8.png, left out of its hits"]
    assert [len(hits) for hits in search_items(index, [own], Query(k=2))] == [2]
    [other] = search_images(index, PixelEmbedder(8), [folder / "x-gradient.png"], Query(k=2))
    assert other.itself is not None and other.itself.path.endswith("x-gradient.png")  # no tie: found at once
