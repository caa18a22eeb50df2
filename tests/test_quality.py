"""The retrieval-quality levers: GeM and multi-stage pooling, whitening in the ONNX graph, the weight average,
the re-rankers (against hand-computed cases and Zhong et al.'s reference code), their agreement across
evaluation and the index's search, and the pretrained default."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from safetensors.torch import load_file

from index.search import Query, search_items
from index.store import GalleryIndex
from retrieval.commands import main
from retrieval.data import Item
from retrieval.embedders import OnnxEmbedder
from retrieval.errors import RetrievalError
from retrieval.metrics import score_queries
from retrieval.rerank import parse_rerank, rerank
from retrieval.runs import RunDir, read_json, write_json
from tests.conftest import copy_classes
from training.config import TrainConfig
from training.exporting import export
from training.model import Encoder, GeM
from training.whitening import fit_whitening


def test_gem_with_p_1_is_average_pooling_and_higher_p_leans_to_the_maximum() -> None:
    features = torch.rand(3, 5, 4, 4)
    assert torch.allclose(GeM(p=1.0)(features), features.mean(dim=(2, 3)), atol=1e-6)
    cubic = GeM(p=3.0)(features)
    assert torch.allclose(cubic, features.pow(3).mean(dim=(2, 3)).pow(1 / 3), atol=1e-6)
    assert torch.all(features.mean(dim=(2, 3)) < cubic) and torch.all(cubic < features.amax(dim=(2, 3)))


@pytest.mark.parametrize(("pooling", "layers", "width"), [("avg", "4", 512), ("gem", "4", 512), ("gem", "3,4", 768), ("avg", "2,3,4", 896)])
def test_pooling_and_stages_give_the_embedding_its_width(pooling: str, layers: str, width: int) -> None:
    model = Encoder("resnet18", pooling=pooling, layers=layers, image_size=64).eval()
    images = torch.randn(2, 3, 64, 64)
    embeddings = model(images)
    assert embeddings.shape == (2, width) and torch.allclose(embeddings.norm(dim=1), torch.ones(2), atol=1e-5)
    assert model.project(images).shape == (2, 128)


def test_stages_are_each_normalised_before_they_are_joined() -> None:
    model = Encoder("resnet18", layers="3,4", image_size=64).eval()
    with torch.no_grad():
        joined = model.backbone(torch.randn(2, 3, 64, 64))
    assert torch.allclose(joined[:, :256].norm(dim=1), torch.ones(2), atol=1e-5)
    assert torch.allclose(joined[:, 256:].norm(dim=1), torch.ones(2), atol=1e-5)


@pytest.mark.parametrize(("options", "message"), [({"layers": "3,5"}, "stages from 1 to 4"), ({"layers": "x"}, "stages from 1 to 4"), ({"pooling": "max"}, "pooling"), ({"backbone": "mobilenet_v3_small", "pooling": "gem"}, "resnet backbones"), ({"ema": 1.0}, "--ema")])
def test_bad_pooling_stage_and_ema_options_are_refused(options: dict, message: str) -> None:
    with pytest.raises(RetrievalError, match=message):
        config = TrainConfig(data="x", **options)
        Encoder(config.backbone, pooling=config.pooling, layers=config.layers)


def test_full_whitening_makes_the_training_covariance_the_identity() -> None:
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((500, 6)) @ rng.standard_normal((6, 6))
    mean, projection = fit_whitening(vectors, shrinkage=0.0)
    whitened = (vectors - mean) @ projection
    assert np.allclose(np.cov(whitened.T, bias=True), np.eye(6), atol=1e-3)
    _, reduced = fit_whitening(vectors, shrinkage=0.5, dim=3)
    assert reduced.shape == (6, 3)
    with pytest.raises(RetrievalError, match="shrinkage"):
        fit_whitening(vectors, shrinkage=1.5)


@pytest.fixture(scope="module")
def gem_run(icons_root: Path, tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    """A short run with GeM over stages 3 and 4 and a weight average."""
    folder = copy_classes(icons_root, tmp_path_factory.mktemp("data"), 4)
    run = tmp_path_factory.mktemp("runs") / "run"
    options = ["--epochs", "2", "--batch-size", "16", "--image-size", "32", "--pooling", "gem", "--layers", "3,4", "--ema", "0.5"]
    assert main(["train", str(folder), "--run", str(run), *options]) == 0
    return RunDir(run)


def test_whitening_is_exported_in_the_graph_and_matches_pytorch(gem_run: RunDir) -> None:
    parity = export(gem_run, whiten=0.2, whiten_dim=32)  # 4 classes: about 38 training images, 37 directions
    assert parity.ok, parity.describe()
    card = json.loads(gem_run.model_card.read_text())
    assert card["whitening"]["shrinkage"] == 0.2 and card["embedding_dim"] == 32
    assert card["whitening"]["fitted_on_images"] > 10
    embedder = OnnxEmbedder.from_run(gem_run)
    assert embedder.dim == 32


def test_export_says_what_to_do_when_the_training_images_for_whitening_are_gone(gem_run: RunDir, tmp_path: Path) -> None:
    config = read_json(gem_run.config)
    moved = RunDir(tmp_path / "moved")
    moved.root.mkdir()
    (moved.checkpoints).mkdir()
    (moved.checkpoints / "last.safetensors").write_bytes(gem_run.last_checkpoint.read_bytes())
    write_json(moved.config, {**config, "data": str(tmp_path / "gone")}, sealed=True)
    with pytest.raises(RetrievalError, match="--whiten none"):
        export(moved, whiten=0.2)


def test_the_checkpoint_holds_the_weight_average(gem_run: RunDir) -> None:
    last = load_file(str(gem_run.last_checkpoint))
    state = load_file(str(gem_run.trainer_state))
    averaged = {name.removeprefix("average/module."): tensor for name, tensor in state.items() if name.startswith("average/module.")}
    raw = {name.removeprefix("model/"): tensor for name, tensor in state.items() if name.startswith("model/")}
    weight = "backbone.stages.3.1.conv2.weight"
    assert torch.equal(last[weight], averaged[weight]) and not torch.equal(last[weight], raw[weight])
    assert "backbone.pools.0.p" in last  # GeM's exponent is learned and saved


# A hand-computed case: 2-d unit vectors at angles; gallery 0..3, query at 0 degrees
ANGLES = np.deg2rad([10.0, 40.0, 45.0, 100.0])
GALLERY = np.stack([np.cos(ANGLES), np.sin(ANGLES)], axis=1).astype(np.float32)
QUERY = np.array([[1.0, 0.0]], np.float32)


def gallery_search(ids: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    similarities = GALLERY[ids] @ GALLERY.T
    similarities[np.arange(len(ids)), ids] = -np.inf
    order = np.argsort(-similarities, axis=1, kind="stable")[:, :n]
    return order, np.take_along_axis(similarities, order, axis=1)


def shortlist() -> tuple[np.ndarray, np.ndarray]:
    scores = (QUERY @ GALLERY.T)[0]
    order = np.argsort(-scores, kind="stable")
    return order[None], scores[order][None]


def test_query_expansion_matches_the_hand_computed_case() -> None:
    ids, scores = shortlist()  # 0 (10°), 1 (40°), 2 (45°), 3 (100°)
    new_ids, new_scores = rerank(parse_rerank("qe:n=1,alpha=1"), QUERY, ids, scores, lambda i: GALLERY[i], gallery_search)
    expanded = QUERY[0] + np.cos(np.deg2rad(10)) * GALLERY[0]  # the query plus its top hit, weighted by its similarity
    expanded /= np.linalg.norm(expanded)
    assert new_ids[0].tolist() == [0, 1, 2, 3]
    assert np.allclose(new_scores[0], GALLERY[[0, 1, 2, 3]] @ expanded, atol=1e-6)


def test_database_augmentation_matches_the_hand_computed_case() -> None:
    ids, scores = shortlist()
    new_ids, new_scores = rerank(parse_rerank("dba:n=1,alpha=1"), QUERY, ids, scores, lambda i: GALLERY[i], gallery_search)
    # each item averaged with its nearest other item: 0 with 1, 1 with 2, 2 with 1, 3 with 2
    partner = {0: 1, 1: 2, 2: 1, 3: 2}
    expected = {}
    for item, other in partner.items():
        augmented = GALLERY[item] + float(GALLERY[item] @ GALLERY[other]) * GALLERY[other]
        expected[item] = float(QUERY[0] @ augmented / np.linalg.norm(augmented))
    order = sorted(expected, key=lambda item: -expected[item])
    assert new_ids[0].tolist() == order
    assert np.allclose(new_scores[0], [expected[item] for item in order], atol=1e-6)


def test_database_augmentation_passes_over_the_query_itself() -> None:
    ids, scores = np.array([[1, 2, 3]]), (GALLERY[0:1] @ GALLERY[[1, 2, 3]].T)
    with_own, _ = rerank(parse_rerank("dba:n=1,alpha=1"), GALLERY[0:1], ids, scores, lambda i: GALLERY[i], gallery_search, own=np.array([0]))
    _, own_scores = rerank(parse_rerank("dba:n=1,alpha=1"), GALLERY[0:1], ids, scores, lambda i: GALLERY[i], gallery_search, own=np.array([0]))
    # item 1's nearest other item is 2 (5°), not the query 0 (30°): unchanged; no candidate may lean on item 0
    augmented_1 = GALLERY[1] + float(GALLERY[1] @ GALLERY[2]) * GALLERY[2]
    assert np.isclose(own_scores[0][with_own[0].tolist().index(1)], GALLERY[0] @ augmented_1 / np.linalg.norm(augmented_1), atol=1e-6)


def zhong_reference(q_g: np.ndarray, q_q: np.ndarray, g_g: np.ndarray, k1: int, k2: int, lambda_value: float) -> np.ndarray:
    """Zhong et al.'s re_ranking (github.com/zhunzhong07/person-re-ranking, python), transcribed without its inverted index."""
    original_dist = np.concatenate([np.concatenate([q_q, q_g], axis=1), np.concatenate([q_g.T, g_g], axis=1)], axis=0)
    original_dist = np.power(original_dist, 2).astype(np.float32)
    original_dist = np.transpose(1.0 * original_dist / np.max(original_dist, axis=0))
    V = np.zeros_like(original_dist).astype(np.float32)
    initial_rank = np.argsort(original_dist, kind="stable").astype(np.int32)
    query_num, all_num = q_g.shape[0], original_dist.shape[0]
    for i in range(all_num):
        forward_k_neigh_index = initial_rank[i, : k1 + 1]
        backward_k_neigh_index = initial_rank[forward_k_neigh_index, : k1 + 1]
        fi = np.where(backward_k_neigh_index == i)[0]
        k_reciprocal_index = forward_k_neigh_index[fi]
        k_reciprocal_expansion_index = k_reciprocal_index
        for candidate in k_reciprocal_index:
            candidate_forward_k_neigh_index = initial_rank[candidate, : int(np.around(k1 / 2.0)) + 1]
            candidate_backward_k_neigh_index = initial_rank[candidate_forward_k_neigh_index, : int(np.around(k1 / 2.0)) + 1]
            fi_candidate = np.where(candidate_backward_k_neigh_index == candidate)[0]
            candidate_k_reciprocal_index = candidate_forward_k_neigh_index[fi_candidate]
            if len(np.intersect1d(candidate_k_reciprocal_index, k_reciprocal_index)) > 2.0 / 3 * len(candidate_k_reciprocal_index):
                k_reciprocal_expansion_index = np.append(k_reciprocal_expansion_index, candidate_k_reciprocal_index)
        k_reciprocal_expansion_index = np.unique(k_reciprocal_expansion_index)
        weight = np.exp(-original_dist[i, k_reciprocal_expansion_index])
        V[i, k_reciprocal_expansion_index] = 1.0 * weight / np.sum(weight)
    original_dist = original_dist[:query_num,]
    if k2 != 1:
        V = np.stack([np.mean(V[initial_rank[i, :k2], :], axis=0) for i in range(all_num)])
    jaccard_dist = np.zeros_like(original_dist, dtype=np.float32)
    for i in range(query_num):
        temp_min = np.minimum(V[i : i + 1], V).sum(axis=1)
        jaccard_dist[i] = 1 - temp_min / (2.0 - temp_min)
    final_dist = jaccard_dist * (1 - lambda_value) + original_dist * lambda_value
    return final_dist[:query_num, query_num:]


def test_k_reciprocal_matches_the_reference_code() -> None:
    rng = np.random.default_rng(3)
    gallery = rng.standard_normal((30, 8)).astype(np.float32)
    gallery /= np.linalg.norm(gallery, axis=1, keepdims=True)
    query = gallery[:1] + 0.3 * rng.standard_normal((1, 8)).astype(np.float32)
    query /= np.linalg.norm(query)

    def euclidean(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.sqrt(np.maximum(2 - 2 * a @ b.T, 0))

    expected = zhong_reference(euclidean(query, gallery), euclidean(query, query), euclidean(gallery, gallery), 6, 3, 0.3)[0]
    scores = (query @ gallery.T)[0]
    ids = np.argsort(-scores, kind="stable")[None]
    new_ids, new_scores = rerank(parse_rerank("kreciprocal:k1=6,k2=3,lambda=0.3"), query, ids, scores[ids], lambda i: gallery[i], gallery_search)
    assert new_ids[0].tolist() == np.argsort(expected, kind="stable").tolist()
    assert np.allclose(1 - new_scores[0], expected[new_ids[0]], atol=1e-4)


@pytest.mark.parametrize("spec", ["none", "qe:n=2", "dba:n=1", "kreciprocal:k1=4,k2=2"])
def test_index_search_and_evaluation_rank_alike(tmp_path: Path, spec: str) -> None:
    rng = np.random.default_rng(1)
    labels = [f"c{n % 6}" for n in range(60)]
    vectors = rng.standard_normal((60, 16)).astype(np.float32) + 2 * np.eye(16, dtype=np.float32)[[n % 6 for n in range(60)]]
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    items = [Item(tmp_path / f"{n}.png", label) for n, label in enumerate(labels)]
    index = GalleryIndex.build(tmp_path / "index", vectors, items, [f"{n:064x}" for n in range(60)], "0" * 64)
    reranker = parse_rerank(spec + ("" if spec == "none" else ",shortlist=20"))
    evaluated = score_queries(vectors, labels, ks=(5,), rerank=reranker)
    searched = search_items(index, list(range(1, 61)), Query(5, rerank=reranker))
    assert [[hit.id - 1 for hit in hits] for hits in searched] == evaluated.neighbours.tolist()


@pytest.mark.parametrize("spec", ["qe:n=2", "dba:n=1", "dba:n=500", "kreciprocal:k1=4,k2=2"])
def test_a_batch_of_queries_with_shortlists_of_two_lengths_is_reranked_as_each_alone(tmp_path: Path, spec: str) -> None:
    """An indexed image searched beside a new one (its shortlist one shorter: itself left out), or dba with more
    neighbours than the gallery holds, failed: "no item with id(s) 0 in this index" (the lists' padding read as an id)."""
    from index.search import search_vectors

    rng = np.random.default_rng(2)
    vectors = rng.standard_normal((30, 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    items = [Item(tmp_path / f"{n}.png", f"c{n % 3}") for n in range(30)]
    index = GalleryIndex.build(tmp_path / "index", vectors, items, [f"{n:064x}" for n in range(30)], "0" * 64)
    query = Query(5, rerank=parse_rerank(spec))  # the shortlist (100) is longer than the gallery
    fresh = rng.standard_normal((1, 8)).astype(np.float32)
    own = lambda hit: hit.id == 4  # noqa: E731
    together = search_vectors(index, np.concatenate([vectors[3:4], fresh]), query, [own, None])
    alone = [search_vectors(index, vectors[3:4], query, [own])[0], search_vectors(index, fresh, query)[0]]
    assert [[hit.id for hit in hits] for hits in together] == [[hit.id for hit in hits] for hits in alone]
    assert all(len(hits) == 5 for hits in together) and 4 not in [hit.id for hit in together[0]]


def test_rerank_specs_are_read_and_bad_ones_refused() -> None:
    assert parse_rerank("dba:n=2").describe() == "dba:n=2,alpha=3,shortlist=100"
    for bad, message in [("mqe", "unknown re-ranker"), ("qe:k=2", "no parameter k"), ("qe:n", "name=number"), ("dba:n=0", "whole number"), ("qe:n=inf", "whole number"),
                           ("qe:alpha=-1", "alpha .* must be 0 or more, got -1"), ("dba:alpha=nan", "must be 0 or more, got nan"),
                           ("kreciprocal:lambda=2", "lambda .* between 0 and 1, got 2"),
                           ("qe:shortlist=inf", "shortlist must be a whole number of at least 1, got inf"), ("dba:shortlist=nan", "got nan"),
                           ("qe:shortlist=2.5", "got 2.5")]:
        with pytest.raises(RetrievalError, match=message):
            parse_rerank(bad)


def test_search_and_evaluate_take_rerank_on_the_command_line(demo_run: RunDir, icons_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["search", str(demo_run.root), "--id", "3", "-k", "3", "--rerank", "dba:n=1", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)["hits"]
    assert len(hits) == 3 and 3 not in [hit["id"] for hit in hits]
    assert main(["evaluate", str(demo_run.root), str(icons_root / "test"), "--rerank", "qe:n=1"]) == 0
    saved = json.loads((demo_run.metric_sets / "test-qe.json").read_text())
    assert saved["rerank"] == "qe:n=1,alpha=3,shortlist=100" and "map" not in saved
    assert main(["search", str(demo_run.root), "--id", "3", "--rerank", "fancy"]) == 2
    assert "unknown re-ranker 'fancy'" in capsys.readouterr().err


def test_the_default_uses_cached_imagenet_weights_and_never_downloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    assert not TrainConfig(data="x").pretrained  # nothing cached: from scratch, the CPU recipe
    assert (TrainConfig(data="x").image_size, TrainConfig(data="x").epochs) == (64, 50)
    weights = torchvision.models.ResNet18_Weights.DEFAULT
    cached = tmp_path / "torch" / "hub" / "checkpoints" / Path(weights.url).name
    cached.parent.mkdir(parents=True)
    state = torchvision.models.resnet18().state_dict()
    torch.save(state, cached)
    config = TrainConfig(data="x", device="cpu")
    assert config.pretrained and (config.image_size, config.epochs) == (128, 15)
    assert not TrainConfig(data="x", pretrained=False).pretrained  # --scratch
    model = Encoder(config.backbone, pretrained=True, image_size=config.image_size)
    assert torch.equal(model.backbone.conv1.weight, state["conv1.weight"])


def test_auto_precision_is_bf16_on_cpus_that_compute_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import training.loop as loop

    cpu = torch.device("cpu")
    monkeypatch.setattr(loop, "cpu_has_bf16", lambda: True)
    assert loop.autocast_dtype("auto", cpu) is torch.bfloat16 and loop.autocast_dtype("fp32", cpu) is None
    monkeypatch.setattr(loop, "cpu_has_bf16", lambda: False)
    assert loop.autocast_dtype("auto", cpu) is None  # emulated bf16 would be slower than float32
    monkeypatch.undo()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    assert loop.cpu_has_bf16() == ("avx512_bf16" in flags.split() or "amx_bf16" in flags.split())


def test_the_default_export_is_whitened(gem_run: RunDir) -> None:
    assert main(["export", str(gem_run.root)]) == 0
    card = json.loads(gem_run.model_card.read_text())
    assert card["whitening"]["shrinkage"] == 0.8 and card["embedding_dim"] == 768
    assert main(["export", str(gem_run.root), "--whiten", "none"]) == 0
    assert json.loads(gem_run.model_card.read_text())["whitening"] is None
