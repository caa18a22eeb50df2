"""`retrieval index --backend milvus` on Milvus Lite: the same items and, for exact indexes, the same
neighbours as FAISS; add, remove, label filters; the app and `retrieval search` unchanged on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from app.service import SearchService
from index.build import build_index
from index.milvus import MilvusIndex, MilvusOptions, milvus_type
from index.backends import open_index
from index.search import Query, search_items
from index.store import Additions, GalleryIndex
from retrieval.commands import main
from retrieval.data import Item, load_collection
from retrieval.embedders import OnnxEmbedder
from retrieval.errors import RetrievalError
from retrieval.runs import RunDir
from tests.conftest import copy_classes, write_bad_files


def test_milvus_lite_agrees_with_faiss(demo_run: RunDir, icons_root: Path, tmp_path: Path) -> None:
    data = copy_classes(icons_root, tmp_path / "data", 5)
    write_bad_files(data / "broken")
    embedder = OnnxEmbedder.from_run(demo_run)
    flat = build_index(embedder, load_collection(data), tmp_path / "faiss", progress=False)
    lite = build_index(embedder, load_collection(data), tmp_path / "milvus", progress=False, milvus=MilvusOptions(str(tmp_path / "gallery.db")))
    assert isinstance(lite.index, MilvusIndex) and lite.index.manifest.index_type == "FLAT"
    assert lite.index.rows() == flat.index.rows() and len(lite.skipped) == len(flat.skipped) == 3
    ids = sorted(flat.index.rows())
    assert np.allclose(lite.index.vectors_of(ids), flat.index.vectors_of(ids), atol=1e-6)
    queries = flat.index.vectors_of(ids[:20])
    for ours, theirs in zip(lite.index.search(queries, 10), flat.index.search(queries, 10)):  # the same up to ties (a 2-epoch model's similarities are close)
        assert np.allclose([hit.score for hit in ours], [hit.score for hit in theirs], atol=1e-5)
        assert ours[0].id == theirs[0].id

    loaded = open_index(tmp_path / "milvus", embedder.fingerprint, embedder.dim)
    assert isinstance(loaded, MilvusIndex) and len(loaded) == len(flat.index)
    again = build_index(embedder, load_collection(data), tmp_path / "milvus", progress=False)  # keeps its backend
    assert again.embedded == 0 and isinstance(again.index, MilvusIndex)
    updated = loaded.update([Additions(queries[:1], [load_collection(data).items[0]], ["f" * 64])], ids[:2])
    assert len(updated) == len(flat.index) - 1 and ids[0] not in updated.rows() and max(updated.rows()) == ids[-1] + 1
    with pytest.raises(RetrievalError, match="no item with id"):
        updated.vectors_of([ids[0]])
    with pytest.raises(RetrievalError, match="FAISS index; add --rebuild"):
        build_index(embedder, load_collection(data), tmp_path / "faiss", progress=False, milvus=MilvusOptions(str(tmp_path / "gallery.db")))


def test_exact_milvus_and_faiss_find_the_same_neighbours(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((3000, 64)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    items = [Item(Path(f"/gallery/{row}.png"), f"c{row % 7}") for row in range(len(vectors))]
    chunks = [Additions(vectors[start : start + 1000], items[start : start + 1000], ["0" * 64] * 1000) for start in range(0, 3000, 1000)]
    lite = MilvusIndex.create(tmp_path / "milvus", chunks, "enc", 64, str(tmp_path / "lite.db"), len(items))
    flat = GalleryIndex.create(tmp_path / "faiss", chunks, "enc", 64)
    queries = rng.standard_normal((50, 64)).astype(np.float32)
    assert [[hit.id for hit in hits] for hits in lite.search(queries, 10)] == [[hit.id for hit in hits] for hits in flat.search(queries, 10)]
    assert [[hit.id for hit in hits] for hits in search_items(lite, [1, 2, 3], Query(5))] == [[hit.id for hit in hits] for hits in search_items(flat, [1, 2, 3], Query(5))]
    assert {hit.label for hit in lite.search(queries[:1], 20, label="c3")[0]} == {"c3"}


def test_the_app_and_search_work_on_milvus(demo_run: RunDir, icons_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = copy_classes(icons_root, tmp_path / "data", 3)
    directory = tmp_path / "milvus"
    uri = str(tmp_path / "gallery.db")
    assert main(["index", str(demo_run.root), str(data), "--index", str(directory), "--backend", "milvus", "--uri", uri, "--milvus-index", "HNSW"]) == 0
    assert "HNSW" in (directory / "manifest.json").read_text()
    service = SearchService(demo_run, directory, allow_write=True, cache=tmp_path / "cache")  # its evaluation plots stay out of /tmp
    query = next(iter(service.items.values())).path
    result = service.search(query, k=3)
    assert len(result.hits) == 3 and all(hit.path != str(query) for hit in result.hits)
    ids = service.add_images([write_bad_files(tmp_path / "new")["empty"].with_name("good.png")], "red").ids
    assert ids and ids[0] in service.items and service.remove_items(ids) == 1 and ids[0] not in service.items
    evaluation = service.evaluate_now().evaluation
    assert evaluation.metrics["num_queries"] == len(service.items)
    assert main(["search", str(demo_run.root), str(query), "--index", str(directory), "-k", "2"]) == 0
    assert main(["index-stats", str(directory), "--sample", "20"]) == 0
    shown = capsys.readouterr().out
    assert "Milvus at" in shown and "HNSW" in shown and "recall@10 (now, 20 own vectors left out)" in shown
    assert main(["index", str(demo_run.root), str(data), "--index", str(tmp_path / "other"), "--backend", "milvus"]) == 2
    assert "--uri" in capsys.readouterr().err
    assert main(["index", str(demo_run.root), str(data), "--index", str(tmp_path / "x"), "--backend", "milvus", "--uri", "http://127.0.0.1:9"]) == 2
    assert "cannot connect to Milvus" in capsys.readouterr().err


def test_factory_strings_map_to_milvus_types() -> None:
    assert milvus_type("Flat") == ("FLAT", {})
    assert milvus_type("HNSW32") == ("HNSW", {"M": 32, "efConstruction": 200})
    assert milvus_type("IVF4096,Flat") == ("IVF_FLAT", {"nlist": 4096})
    assert milvus_type("IVF1024,SQ8") == ("IVF_SQ8", {"nlist": 1024})
    assert milvus_type("OPQ32,IVF4096,PQ32") == ("IVF_PQ", {"nlist": 4096, "m": 32, "nbits": 8})
    with pytest.raises(RetrievalError, match="--milvus-index"):
        milvus_type("LSH")
