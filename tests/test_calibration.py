"""The calibrated match threshold: its fit (ties, a target no similarity reaches), `evaluate --calibrate` storing it in
the model card, and search marking hits a match in the command line, the JSON API and the app."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from app.handlers import Handlers
from app.server import launch
from app.service import NO_MATCH, SearchService
from index.search import Query, search_vectors
from retrieval.calibration import calibrate, card_threshold, fit_similarity, match_similarity, precision_at, run_threshold
from retrieval.commands import main
from retrieval.data import load_collection
from retrieval.embedders import OnnxEmbedder
from retrieval.errors import RetrievalError
from retrieval.evaluation import calibrate_run, evaluate_collection
from retrieval.metrics import score_queries
from retrieval.rerank import parse_rerank
from retrieval.runs import RunDir, read_json, write_json
from tests.conftest import copy_classes
from tests.test_app import free_port
from tests.test_index import build


def test_the_threshold_is_the_lowest_similarity_that_keeps_the_target_precision() -> None:
    similarities = np.array([0.5, 0.9, 0.7, 0.8, 0.6])
    correct = np.array([False, True, False, True, True])  # by similarity: right, right, wrong, right, wrong
    assert fit_similarity(similarities, correct, 0.75) == (0.6, 0.75, 0.8)
    assert fit_similarity(similarities, correct, 0.9) == (0.8, 1.0, 0.4)
    assert precision_at(similarities, correct, 0.7) == (2 / 3, 0.6)


def test_a_threshold_never_splits_tied_similarities() -> None:
    similarities = np.array([0.9, 0.8, 0.8, 0.5])
    correct = np.array([True, True, False, True])
    # at 0.8 both tied hits are kept (precision 2/3): only 0.9 keeps 0.9 precision
    assert fit_similarity(similarities, correct, 0.9) == (0.9, 1.0, 0.25)


def test_a_target_no_similarity_reaches_marks_nothing_a_match() -> None:
    similarities = np.array([0.9, 0.8, 0.7])
    threshold, precision, coverage = fit_similarity(similarities, np.zeros(3, bool), 0.9)
    assert threshold == 1.0 and np.isnan(precision) and coverage == 0.0  # not 0.9 and a little: new images reach it
    assert precision_at(np.array([0.95, 0.91]), np.array([False, False]), threshold)[1] == 0.0  # none marked


def test_a_precision_of_a_few_hits_is_no_threshold() -> None:
    """On the icons, 4 hits out of 4 above a similarity set the threshold for a 0.9 target, and 0.125 of the hits
    above it were right on new images: a precision is measured on at least MIN_QUERIES hits, or not stored."""
    from retrieval.calibration import MIN_QUERIES, MatchThreshold

    rng = np.random.default_rng(0)
    similarities = np.sort(rng.uniform(0.2, 0.9, 100))[::-1].copy()
    correct = np.zeros(100, bool)
    correct[:4] = True  # the 4 highest right, then 1 in 3
    correct[5::3] = True
    assert fit_similarity(similarities, correct, 0.9) == (similarities[3], 1.0, 0.04)
    threshold, precision, coverage = fit_similarity(similarities, correct, 0.9, MIN_QUERIES)
    assert threshold > similarities[0] and np.isnan(precision) and coverage == 0.0
    correct[:MIN_QUERIES] = True  # 20 right: enough to measure
    assert fit_similarity(similarities, correct, 0.9, MIN_QUERIES)[2] >= MIN_QUERIES / 100
    none = MatchThreshold(threshold, 0.9, None, 0.0, None, 100, "held-out")
    assert none.describe() == (
        "no similarity gives top-1 precision 0.90 to at least 20 of the 100 queries of held-out: only a copy of the "
        "query (similarity 1) will be marked a match; lower --target-precision, or calibrate on more images"
    )


def test_a_threshold_that_does_not_hold_on_held_out_classes_says_so() -> None:
    """The icons at a 0.8 target: 0.810 on the fitting classes, 0.598 on held-out halves of them, and 0.346 on the
    test classes; evaluate --calibrate printed the 0.598 in passing and stored the threshold without a word."""
    from retrieval.calibration import MatchThreshold

    fitted = MatchThreshold(0.776, 0.8, 0.81, 0.094, 0.598, 224, "validation")
    assert fitted.caution() == (
        "on the classes it was not fitted on, the threshold held 0.60, below the target 0.80: on new classes fewer of "
        "its matches will be right; calibrate on more classes, or lower --target-precision"
    )
    for held in (0.76, 0.9, None):  # within 0.05 of the target, above it, or not checked
        assert MatchThreshold(0.776, 0.8, 0.81, 0.094, held, 224, "validation").caution() is None
    assert MatchThreshold(1.0, 0.9, None, 0.0, 0.2, 224, "validation").caution() is None  # no threshold: said already


def test_calibrate_stores_no_threshold_that_rests_on_a_few_hits() -> None:
    vectors, labels = clustered(classes=10, per_class=6, spread=1.5, seed=3)  # recall@1 0.5
    scores = score_queries(vectors, labels)
    best, correct = scores.similarities[:, 0], scores.first_hit == 0
    loose = fit_similarity(best.astype(np.float64), correct, 0.9)
    assert 0 < loose[2] * len(best) < 20  # without the rule: a threshold on a few hits
    fitted = calibrate(scores, labels, 0.9, "clusters")
    assert fitted.precision is None and fitted.coverage == 0.0 and fitted.similarity > best.max()


def clustered(classes: int = 8, per_class: int = 6, spread: float = 0.4, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, 16))
    vectors = np.repeat(centres, per_class, axis=0) + spread * rng.standard_normal((classes * per_class, 16))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors.astype(np.float32), [f"c{i // per_class}" for i in range(classes * per_class)]


def test_calibrate_fits_on_the_scores_and_checks_on_held_out_classes() -> None:
    vectors, labels = clustered(spread=0.9)
    scores = score_queries(vectors, labels)
    fitted = calibrate(scores, labels, 0.8, "clusters")
    best, correct = scores.similarities[:, 0], scores.first_hit == 0
    assert fitted.precision >= 0.8 and fitted.precision == precision_at(best, correct, fitted.similarity)[0]
    assert fitted.coverage == precision_at(best, correct, fitted.similarity)[1] and fitted.queries == len(labels)
    assert fitted.held_out_precision is not None and 0 <= fitted.held_out_precision <= 1
    assert card_threshold({"match_threshold": fitted.to_dict()}) == fitted
    with pytest.raises(RetrievalError, match="between 0 and 1"):
        calibrate(scores, labels, 1.0, "clusters")
    few = score_queries(vectors[:12], labels[:12])
    with pytest.raises(RetrievalError, match="at least 20"):
        calibrate(few, labels[:12], 0.8, "clusters")


def test_the_threshold_applies_only_to_scores_re_ranked_as_it_was_fitted() -> None:
    card = {"match_threshold": {"similarity": 0.5, "target": 0.9, "precision": 0.9, "coverage": 0.3,
                                "held_out_precision": 0.88, "queries": 100, "images": "x", "rerank": "none"}}  # fmt: skip
    assert match_similarity(card, "none") == 0.5
    assert match_similarity(card, "qe:n=1,shortlist=100") is None
    assert match_similarity(card, "qe:n=1,shortlist=100", override=0.7) == 0.7
    assert match_similarity({}, "none") is None


def test_search_marks_each_hit_by_the_threshold(tmp_path: Path) -> None:
    index, vectors = build(tmp_path / "index")
    plain = search_vectors(index, vectors[:1], [Query(5)])[0]
    between = (plain[1].score + plain[2].score) / 2
    marked = search_vectors(index, vectors[:2], [Query(5, threshold=between), Query(5)])
    assert [hit.match for hit in marked[0]] == [True, True, False, False, False]
    assert {hit.match for hit in marked[0]} == {True, False}
    assert {hit.match for hit in marked[1]} == {None}


@pytest.fixture(scope="module")
def calibrated(demo_run: RunDir, icons_root: Path, tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    """A copy of the demo run, calibrated on test classes it did not train on, at a target its hits reach."""
    root = tmp_path_factory.mktemp("calibrated") / "run"
    shutil.copytree(demo_run.root, root)
    held_out = copy_classes(icons_root, root.parent / "held-out", 12, split="test")
    assert main(["evaluate", str(root), str(held_out), "--calibrate", "--target-precision", "0.3"]) == 0
    return RunDir(root)


def test_calibrating_lists_the_training_images_once(demo_run: RunDir, icons_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--calibrate's check that the images are held out and the note on images trained on each listed the training
    folder: one count serves both."""
    import retrieval.evaluation

    root = tmp_path / "run"
    shutil.copytree(demo_run.root, root)
    trained_on = Path(read_json(RunDir(root).model_card)["trained_on"])
    listed: list[Path] = []
    load = retrieval.evaluation.load_collection
    monkeypatch.setattr(retrieval.evaluation, "load_collection", lambda source, *args, **kwargs: listed.append(Path(source)) or load(source, *args, **kwargs))
    held_out = copy_classes(icons_root, tmp_path / "held-out", 12, split="test")
    assert main(["evaluate", str(root), str(held_out), "--calibrate", "--target-precision", "0.3"]) == 0
    assert listed.count(trained_on) == 1


def test_evaluate_calibrate_stores_the_threshold_in_the_model_card(calibrated: RunDir, icons_root: Path) -> None:
    fitted = card_threshold(read_json(calibrated.model_card))  # the card's checksum still holds
    assert fitted is not None and fitted.target == 0.3 and fitted.images == "held-out" and fitted.rerank == "none"
    assert 0 < fitted.coverage <= 1 and fitted.precision >= 0.3
    metrics = json.loads(calibrated.metrics.read_text())
    assert metrics["match threshold"] == fitted.similarity and metrics["match precision"] == fitted.precision
    other = load_collection(calibrated.root / "demo-test.csv").source
    assert main(["evaluate", str(calibrated.root), str(other)]) == 0  # a second set: the stored threshold measured
    second = json.loads(calibrated.metrics.read_text())
    assert second["match threshold"] == fitted.similarity and second["match fitted on"] == "held-out"
    assert 0 <= second["match coverage"] <= 1


def test_search_prints_whether_each_hit_is_a_match(calibrated: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    fitted = card_threshold(read_json(calibrated.model_card))
    query = str(next(iter(load_collection(calibrated.root / "demo-test.csv").items)).path)
    capsys.readouterr()
    assert main(["search", str(calibrated.root), query, "--json", "-k", "5"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["threshold"] == fitted.similarity
    assert [hit["match"] for hit in found["hits"]] == [hit["score"] >= fitted.similarity for hit in found["hits"]]
    assert main(["search", str(calibrated.root), query, "--threshold", "1.0", "-k", "3"]) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if not line.startswith("# ")]  # the query's own item noted, too
    assert f"# {NO_MATCH}: the best hit is below 1.0000" in printed and rows[1].endswith("\tno")


def test_careless_thresholds_are_one_line_each(
    calibrated: RunDir, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    query = str(next(iter(load_collection(calibrated.root / "demo-test.csv").items)).path)
    train = read_json(calibrated.model_card)["trained_on"]  # the demo's run directory, where the copy came from
    cases = {
        ("search", str(calibrated.root), query, "--threshold", "2"): "--threshold 2.0: give a cosine similarity",
        ("evaluate", str(calibrated.root), train, "--calibrate"): f"--calibrate: {train} is what {calibrated.root} trained on,",
        ("evaluate", str(calibrated.root), train, "--calibrate", "--target-precision", "1.5"): "between 0 and 1",
        ("evaluate", str(tmp_path / "nowhere"), train, "--calibrate"): "no such run directory",
        # a target without --calibrate was ignored, the evaluation run as if it had not been given
        ("evaluate", str(calibrated.root), train, "--target-precision", "0.8"): "--target-precision 0.8 sets what --calibrate fits: add --calibrate",
    }
    for arguments, words in cases.items():
        capsys.readouterr()
        assert main(list(arguments)) == 2, arguments
        error = capsys.readouterr().err.strip()
        assert words in error and "Traceback" not in error and len(error.splitlines()) == 1, error


def test_calibrate_run_is_the_command_from_python(
    calibrated: RunDir, demo_run: RunDir, icons_root: Path, tmp_path: Path
) -> None:
    """calibrate_run fits and stores what `evaluate --calibrate` does, and refuses in one line what the command
    refuses (the run's training images, a target out of range) and what only Python can give it (another run's
    evaluation, something else); run_threshold reads the stored threshold for Query."""
    root = tmp_path / "run"
    shutil.copytree(calibrated.root, root)
    run, embedder = RunDir(root), OnnxEmbedder.from_run(root)
    held_out = copy_classes(icons_root, tmp_path / "held-out", 12, split="test")
    evaluation = evaluate_collection(embedder, held_out, progress=False)
    fitted = calibrate_run(str(root), evaluation, 0.3)
    assert fitted == card_threshold(read_json(run.model_card)) and fitted.images == str(held_out)
    assert fitted == calibrate(evaluation.scores, evaluation.labels, 0.3, str(held_out))
    assert run_threshold(root) == fitted.similarity and run_threshold(root, parse_rerank("qe")) is None
    assert run_threshold(tmp_path / "uncalibrated") is None
    train = read_json(run.model_card)["trained_on"]
    trained = evaluate_collection(embedder, train, progress=False)
    other = tmp_path / "other"
    shutil.copytree(demo_run.root, other)
    write_json(other / "model.json", {**read_json(other / "model.json"), "sha256": "0" * 64}, sealed=True)
    cases = [  # another run: its card names another model
        (run, trained, 0.3, f"calibrate_run: {train} is what {root} trained on,"),
        (run, evaluation, 1.5, "target 1.5: give a precision between 0 and 1"),
        (run, evaluation, "0.9", "target '0.9': give a precision between 0 and 1"),
        (other, evaluation, 0.3, f"not by a model of {other}; evaluate with OnnxEmbedder.from_run("),
        (run, evaluation.metrics, 0.3, "evaluation: dict given; give what evaluate_collection"),
    ]
    for target_run, given, target, words in cases:
        with pytest.raises(RetrievalError, match=re.escape(words)):
            calibrate_run(target_run, given, target)
    assert run_threshold(root) == fitted.similarity  # nothing refused was stored


@pytest.fixture(scope="module")
def served(calibrated: RunDir) -> Iterator[tuple[SearchService, str]]:
    service = SearchService(calibrated, threshold=0.99)
    port = free_port()
    server = launch(service, port=port, block=False)
    try:
        yield service, f"http://127.0.0.1:{port}"
    finally:
        server.close()
        service.close()


def test_the_api_and_the_app_mark_matches(served: tuple[SearchService, str]) -> None:
    service, url = served
    item_id, item = next(iter(service.items.items()))
    body = httpx.post(f"{url}/api/v1/search", params={"k": 3}, content=item.path.read_bytes()).json()
    assert [hit["match"] for hit in body["hits"]] == [hit["score"] >= 0.99 for hit in body["hits"]]
    assert httpx.get(f"{url}/api/v1/stats").json()["match_threshold"] == 0.99
    neighbours = httpx.get(f"{url}/api/v1/items/{item_id}/neighbours", params={"k": 3}).json()["hits"]
    assert {hit["match"] for hit in neighbours} <= {True, False} and len(neighbours) == 3
    result = service.search(item.path, k=3)
    assert result.summary.startswith(f"**{NO_MATCH}**") == (not result.hits[0].match)
    tiles, _, data, _ = Handlers(service).search(str(item.path), 3, None, None, False)  # what gradio_client gets
    assert [tile["match"] for tile in data] == [hit["score"] >= 0.99 for hit in body["hits"]]
    assert [caption.endswith(" · match") for _, caption in tiles] == [tile["match"] for tile in data]
    fitted = card_threshold(read_json(service.run.model_card))
    plain = SearchService(service.run)
    try:
        assert plain.query().threshold == fitted.similarity  # without --threshold: the card's
    finally:
        plain.close()
