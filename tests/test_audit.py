"""`retrieval audit`: suspected wrong labels (small classes too), copies and leaks, outliers, --folds checks, the
command's tables, --json and --csv, its one-line refusals, and the labels CSV the app's decisions go to."""

from __future__ import annotations

import csv
import io
import json
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image, ImageDraw

import retrieval.duplicates as copy_check
from app.service import SearchService
from retrieval.audit import AuditedCollection, agreement, audit, check_folds, describe_agreement, duplicates, label_scores, leaks, outliers, suspects
from retrieval.commands import main
from retrieval.data import Item, Skipped, load_collection, write_collection_csv
from retrieval.decisions import Decision, LabelDecision, decide, decided_labels, read_decisions
from retrieval.duplicates import THUMBNAIL, CopyKind, difference, find_copies
from retrieval.embedders import l2_normalise
from retrieval.errors import RetrievalError
from retrieval.knn import Neighbours, nearest_neighbours
from retrieval.runs import RunDir
from tests.conftest import copy_classes


def clusters(sizes: list[int], dim: int = 16, spread: float = 0.15, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """Unit vectors in one tight cluster per class (class c has sizes[c] of them), and their labels."""
    rng = np.random.default_rng(seed)
    centres = l2_normalise(rng.normal(size=(len(sizes), dim)))
    vectors = np.concatenate(
        [centres[c] + spread * rng.normal(size=(n, dim)) / np.sqrt(dim) for c, n in enumerate(sizes)]
    )
    return l2_normalise(vectors).astype(np.float32), [f"class-{c}" for c, n in enumerate(sizes) for _ in range(n)]


def test_a_moved_label_is_the_top_suspect_with_its_own_class_suggested() -> None:
    vectors, labels = clusters([6, 6, 6, 6])
    labels[3] = "class-2"  # an image of class-0 labeled class-2
    scores = label_scores(vectors, labels)
    assert int(np.nanargmax(scores.score)) == 3
    assert scores.classes[scores.suggested[3]] == "class-0"
    assert (np.nan_to_num(scores.score, nan=-1) > 0).sum() == 1  # the others' closest images agree with them


def test_classes_of_two_images_are_audited_and_a_lone_image_is_not_scored() -> None:
    vectors, labels = clusters([2, 2, 2, 2, 2, 1])
    labels[0] = "class-1"  # one of class-0's two images labeled class-1: class-0 is left with one
    scores = label_scores(vectors, labels)
    assert int(np.nanargmax(scores.score)) == 0 and scores.classes[scores.suggested[0]] == "class-0"
    assert np.isnan(scores.score[1]) and np.isnan(scores.score[-1])  # alone in their label: nothing to compare with
    items = [Item(Path(f"/images/{row}.png"), label) for row, label in enumerate(labels)]
    found = suspects(items, vectors)
    assert [(s.path.name, s.label, s.suggested) for s in found] == [("0.png", "class-1", "class-0")]
    assert [path.name for path in found[0].neighbours] == ["1.png"]  # the suggested label's closest image


def test_the_search_limit_never_flatters_a_label_with_one_image_nearby() -> None:
    """Other labels' closest images come from a k-NN search; where fewer than CLOSEST of a label are found, the rest
    count at the search's last similarity, not left out: searched deep enough, the scores are the exhaustive ones,
    and a shallow search loses no suspect."""
    vectors, labels = clusters([12, 12, 12, 12, 12], spread=0.9, seed=3)
    rng = np.random.default_rng(1)
    labels = [labels[i] if rng.random() > 0.1 else f"class-{rng.integers(5)}" for i in range(len(labels))]
    shallow, deep = label_scores(vectors, labels, depth=8), label_scores(vectors, labels, depth=len(labels) - 1)
    exact = exhaustive(vectors, labels)
    assert np.allclose(deep.score, exact, equal_nan=True, atol=1e-5)
    flagged = set(np.flatnonzero(np.nan_to_num(exact) > 0))
    assert flagged and flagged <= set(np.flatnonzero(np.nan_to_num(shallow.score) > 0))  # no suspect lost to the limit
    assert np.isfinite(shallow.score[~np.isnan(exact)]).all()


def exhaustive(vectors: np.ndarray, labels: list[str], closest: int = 3) -> np.ndarray:
    """The suspicion of each image by brute force: per label, the mean similarity of its closest images."""
    similar = vectors @ vectors.T
    np.fill_diagonal(similar, -np.inf)
    names = np.array(labels)
    score = np.full(len(labels), np.nan)
    for row in range(len(labels)):
        means = {name: np.sort(similar[row, names == name])[::-1][:closest] for name in set(labels)}
        means = {
            name: values[np.isfinite(values)].mean() for name, values in means.items() if np.isfinite(values).any()
        }
        if names[row] in means:
            score[row] = max(value for name, value in means.items() if name != names[row]) - means[names[row]]
    return score


def test_fold_counts_the_labels_do_not_allow_are_one_line() -> None:
    check_folds(["a", "a", "a", "b", "b", "b"], 3)
    with pytest.raises(RetrievalError, match="between 2 and 3"):
        check_folds(["a", "a", "a", "b", "b", "b"], 4)
    with pytest.raises(RetrievalError, match="single image"):
        check_folds(["a", "a", "b"], 2)


def test_neighbours_searched_once_to_depth_are_each_shallower_search_and_the_audit_is_that_of_its_parts() -> None:
    """The audit searches the collection's neighbours once for the labels, copies and outliers (three searches
    before): each part gets what its own search gave, ties included, so the findings are the same."""
    vectors, labels = clusters([15, 15, 15, 14], seed=3)
    vectors[[5, 20, 40]] = vectors[4]  # tied neighbours across classes: ties go to the lower id at every depth
    vectors = np.concatenate([vectors, -vectors[:1]])  # one image far from every other
    labels.append("class-1")
    labels[2] = "class-3"
    shared = Neighbours.of(vectors, 50)
    for k in (3, 10, 50):
        ids, similarities = nearest_neighbours(vectors, vectors, k, exclude_self=True)
        assert np.array_equal(shared.first(k)[0], ids) and np.array_equal(shared.first(k)[1], similarities)
    pictures = shapes(len(vectors))
    pictures[9] = changed(pictures[30], "jpeg")
    for unlabeled in (False, True):  # an unlabeled image: the labels are scored on the labeled ones' own search
        items = [Item(Path(f"/images/{row}.png"), "" if unlabeled and row == 7 else label) for row, label in enumerate(labels)]
        collection = AuditedCollection(items, vectors, [f"d{row}" for row in range(len(items))], np.stack(pictures))
        found = audit(collection)
        assert found.labels == suspects(items, vectors) and found.labels[0].path.name == "2.png"
        assert found.duplicates == duplicates(collection) and len(found.duplicates) == 1
        assert found.outliers == outliers(items, vectors) and found.outliers[0].path.name == f"{len(vectors) - 1}.png"


def shapes(count: int, seed: int = 0) -> list[np.ndarray]:
    """Distinct pictures (coloured shapes at seeded places), 64 px."""
    rng = np.random.default_rng(seed)
    pictures = []
    for _ in range(count):
        image = Image.new("RGB", (64, 64), tuple(int(v) for v in rng.integers(180, 256, 3)))
        draw = ImageDraw.Draw(image)
        for _ in range(3):
            x, y = rng.integers(0, 44, 2)
            draw.rectangle(
                [int(x), int(y), int(x) + 20, int(y) + 14], fill=tuple(int(v) for v in rng.integers(0, 160, 3))
            )
        pictures.append(np.asarray(image))
    return pictures


def changed(picture: np.ndarray, kind: str) -> np.ndarray:
    """A copy of a picture re-encoded, resized, cropped 10 % or grey, as a thumbnail again."""
    image = Image.fromarray(picture)
    if kind == "jpeg":
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=60)
        image = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
    elif kind == "resize":
        image = image.resize((37, 37), Image.BICUBIC)
    elif kind == "crop":
        image = image.crop((3, 2, 61, 60))
    else:
        image = image.convert("L").convert("RGB")
    return np.asarray(image.resize((THUMBNAIL, THUMBNAIL), Image.BILINEAR))


def test_copies_re_encoded_resized_cropped_and_grey_are_found_and_other_pictures_are_not() -> None:
    pictures = shapes(12)
    kinds = ["jpeg", "resize", "crop", "grey"]
    thumbnails = np.stack(pictures + [changed(pictures[i], kind) for i, kind in enumerate(kinds)])
    for i, kind in enumerate(kinds):
        assert difference(pictures[i], thumbnails[12 + i]) <= 0.02, kind
    assert difference(pictures[0], pictures[1]) > 0.1
    vectors = l2_normalise(np.random.default_rng(0).normal(size=(len(thumbnails), 8))).astype(np.float32)
    digests = [f"d{row}" for row in range(len(thumbnails))]
    digests[5] = digests[4]  # identical bytes, whatever the pictures
    pairs = find_copies(vectors, digests, thumbnails)
    found = {(pair.a, pair.b): pair.kind for pair in pairs}
    assert found[(4, 5)] is CopyKind.IDENTICAL
    assert {(i, 12 + i) for i in range(4)} <= set(found)  # by hash: the vectors here are random
    assert set(found) - {(4, 5)} == {(i, 12 + i) for i in range(4)}


def test_a_grey_picture_is_a_copy_of_its_colour_original_only_where_the_luma_matches_closely() -> None:
    """Greying keeps the luma exactly: a grey copy matches its original, while the grey picture of another one whose
    drawn shapes are 7 % lighter (within the colour comparison's tolerance) is not a copy of it."""
    original = shapes(1)[0]
    grey = np.asarray(Image.fromarray(original).convert("L").convert("RGB"))
    drawn = np.abs(original.astype(int) - original[0, 0].astype(int)).max(axis=-1, keepdims=True) > 30
    lighter = np.clip(original.astype(int) + 18 * drawn, 0, 255).astype(np.uint8)
    assert difference(original, grey) <= copy_check.COPY_DIFFERENCE
    assert difference(original, np.asarray(Image.fromarray(lighter).convert("L").convert("RGB"))) > 0.05


def test_pairs_compared_in_blocks_get_the_difference_each_pair_gets_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rough and fine checks compare blocks of pairs in one array operation: a pair's difference must not depend
    on the block it falls in, nor on the other pairs (here blocks of 3 and 2, and chroma blurred 5 planes at a time,
    across a collection and against another)."""
    pictures = shapes(6)
    thumbnails = np.stack(pictures + [changed(pictures[i], kind) for i, kind in enumerate(["jpeg", "crop", "grey"])])
    vectors = l2_normalise(np.random.default_rng(1).normal(size=(len(thumbnails), 8))).astype(np.float32)
    monkeypatch.setattr(copy_check, "PAIR_BLOCK", 3)
    monkeypatch.setattr(copy_check, "ROUGH_BLOCK", 3)
    monkeypatch.setattr(copy_check, "FINE_BLOCK", 2)
    monkeypatch.setattr(copy_check, "BLUR_PLANES", 5)
    monkeypatch.setattr(copy_check, "COARSE_BOUND", 1.0)  # every candidate pair to the rough check
    within = find_copies(vectors, [f"d{row}" for row in range(9)], thumbnails, threshold=1.0)
    assert len(within) > 3  # more than one block
    for pair in within:
        assert pair.difference == difference(thumbnails[pair.a], thumbnails[pair.b]), (pair.a, pair.b)
    other = (vectors[6:], ["x", "y", "z"], thumbnails[6:])
    across = find_copies(vectors[:6], [f"d{row}" for row in range(6)], thumbnails[:6], other, threshold=1.0)
    close = {(pair.a, pair.b) for pair in across if pair.difference <= copy_check.COPY_DIFFERENCE * 4}
    assert close >= {(0, 0), (1, 1), (2, 2)}
    for pair in across:
        assert pair.difference == difference(thumbnails[pair.a], thumbnails[6 + pair.b]), (pair.a, pair.b)


def test_the_rough_check_breaks_ties_only_where_a_pair_can_be_near_and_decides_as_with_ties_broken_everywhere() -> None:
    """The rough grid's tie-break (each crop's mean difference, under 0.001) only adds, so it is computed only for the
    pairs whose best crop can come within ROUGH_BOUND: which pairs go on to the fine search, which picture is the
    cropped one, its crop and its share are those of the tie-break added to every crop of every pair."""
    pictures = shapes(8)
    thumbnails = np.stack(pictures + [changed(pictures[i], kind) for i, kind in enumerate(["jpeg", "resize", "crop", "grey"])])
    a, b = np.triu_indices(len(thumbnails), 1)
    best, crop = copy_check._rough(thumbnails, thumbnails, a, b)
    views = copy_check._rough_views(thumbnails)
    wholes = copy_check._Wholes.of(views[:, 0].astype(np.float32) / 255, copy_check.ROUGH[0], 1.0)
    full = np.stack([copy_check._shares(views[x].astype(np.float32) / 255, wholes, y) for x, y in ((a, b), (b, a))])
    near = full.min(2).min(0) <= copy_check.ROUGH_BOUND
    assert 4 <= near.sum() < len(a) and np.array_equal(best.min(0) <= copy_check.ROUGH_BOUND, near)
    side = (full[1].min(1) < full[0].min(1)).astype(np.int64)
    assert np.array_equal((best[1] < best[0])[near], side[near].astype(bool))
    rows = np.flatnonzero(near)
    assert np.array_equal(crop[side[rows], rows], full.argmin(2)[side[rows], rows])
    assert np.array_equal(best[side[rows], rows], full.min(2)[side[rows], rows])


def test_the_rough_check_on_bytes_decides_every_pixel_as_the_float_check_does_ties_included() -> None:
    """The rough check compares its crops as bytes with bounds drawn from the whole pictures' bytes (_ByteWholes): each
    pair's share for every crop must be the float check's (_drawn_shares of the bytes / 255 on _Wholes of the whole
    views / 255) to the bit, also where a pixel lies exactly 0.1 from a background halfway between two bytes, which
    float rounding decides either way."""
    rng = np.random.default_rng(3)
    pictures = shapes(6) + [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(2)]
    for grey in (60, 130, 200):  # halves a byte apart (the median halfway), squares 25.5 bytes from it in each half
        halves = np.full((64, 64, 3), grey, np.uint8)
        halves[32:] += 1
        halves[8:16, 8:16], halves[48:56, 8:16] = grey + 26, grey - 25
        pictures.append(halves)
    views = copy_check._rough_views(np.stack(pictures))
    wholes = copy_check._Wholes.of(views[:, 0].astype(np.float32) / 255, copy_check.ROUGH[0], 1.0)
    a, b = (pair.ravel() for pair in np.meshgrid(np.arange(len(views)), np.arange(len(views))))
    twice = np.sort(views[:, 0, 0].astype(np.int16), axis=1)[:, 287:289].sum(axis=1)  # twice each whole's median
    ties = np.abs(2 * views[a, :, 0].astype(np.int16) - twice[b, None, None]) == 51
    assert ties.sum() >= 100  # pixels exactly 0.1 from the background they are compared with
    floats = copy_check._drawn_shares(views[a].astype(np.float32) / 255, wholes, b)
    on_bytes = copy_check._ByteWholes.of(views[:, 0], copy_check.ROUGH[0])
    np.testing.assert_array_equal(copy_check._byte_shares(views[a], on_bytes, b), floats)
    assert 0 < (floats <= copy_check.ROUGH_BOUND).sum() < floats.size and (floats > 0.5).any()


def test_the_rough_views_are_each_crop_resampled_on_its_own() -> None:
    """_rough_views draws the rough grid's crops of a block of pictures at once, grouped by their rows' resampling (and
    in blocks, the last one short): each must be the crop's own two products, rounded to a byte, to the bit."""
    count = copy_check.VIEW_BLOCK + 3
    pictures = np.stack(shapes(count))
    views = copy_check._rough_views(pictures)
    side, size = copy_check.ROUGH[0], pictures.shape[1]
    grey = pictures.astype(np.float32) / 255 @ copy_check.LUMA
    for number, (left, top, width) in enumerate(copy_check._boxes(copy_check.ROUGH[1])):
        rows = copy_check._weights(side, size, round(top * size, 3), round(width * size, 3))
        columns = np.ascontiguousarray(copy_check._weights(side, size, round(left * size, 3), round(width * size, 3)).T)
        expected = np.round(np.stack([rows @ plane @ columns for plane in grey]) * 255).reshape(count, -1)
        np.testing.assert_array_equal(views[:, number, 0], expected.astype(np.uint8), err_msg=f"crop {number}")


def test_a_symmetric_pictures_hash_does_not_depend_on_how_its_frequencies_are_summed() -> None:
    """A blank or symmetric picture has DCT frequencies that are exactly equal (zeros); their hash bits (above the
    median or not) were decided by the rounding errors of the einsum that summed them. Rounded to a millionth, they
    are the bits of any way of summing them."""
    pictures = [np.full((64, 64, 3), grey, np.uint8) for grey in (0, 128, 255)]
    for radius in (8, 16, 24, 30):
        for shape, fill in (("ellipse", (20, 60, 200)), ("rectangle", (200, 30, 30))):
            image = Image.new("RGB", (64, 64), (245, 245, 245))
            getattr(ImageDraw.Draw(image), shape)([32 - radius, 32 - radius, 31 + radius, 31 + radius], fill=fill)
            pictures.append(np.asarray(image))
    grey = np.stack([copy_check._grey_square(picture) for picture in pictures]).astype(np.float64)
    basis = np.cos(np.pi * (2 * np.arange(32)[None] + 1) * np.arange(8)[:, None] / 64)
    summed = [np.einsum("us,nst,vt->nuv", basis, grey, basis), np.einsum("us,nst,vt->nuv", basis, grey, basis, optimize=True), basis @ (grey @ basis.T)]
    hashes = copy_check.perceptual_hashes(np.stack(pictures))
    for low in summed:
        low = np.round(low, 6).reshape(len(grey), 64)
        np.testing.assert_array_equal(hashes, np.packbits(low > np.median(low, axis=1, keepdims=True), axis=1))
    assert len({bytes(row) for row in hashes}) >= 5


def test_the_neighbourhood_blur_and_spread_are_those_of_a_padded_picture_pixel_by_pixel() -> None:
    """_blur and _spread work on flat views of a padded buffer (one contiguous loop per operation): their values,
    edges and corners included, must be those of the 3 x 3 neighbourhood of the edge-padded planes, in the same
    order of operations, to the bit."""
    planes = np.random.default_rng(0).random((7, 6, 6), dtype=np.float32)
    padded = np.pad(planes, ((0, 0), (1, 1), (1, 1)), mode="edge")
    shifted = [padded[:, i : i + 6, j : j + 6] for i in range(3) for j in range(3)]
    total = shifted[0].copy()
    for plane in shifted[1:]:
        total += plane
    moved = [planes + 0.5 * (plane - planes) for plane in shifted]
    low, high = copy_check._spread(planes.reshape(7, 36), 6, 0.5)
    np.testing.assert_array_equal(copy_check._blur(planes), total / 9)
    np.testing.assert_array_equal(low.reshape(7, 6, 6), np.minimum.reduce([planes, *moved]))
    np.testing.assert_array_equal(high.reshape(7, 6, 6), np.maximum.reduce([planes, *moved]))


def test_pairs_shared_out_over_worker_processes_get_the_differences_of_one_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many candidate pairs are checked on every core: this process and a worker process per other core each take
    every n-th pair; the differences must be those of one process, within a collection and against another, and a
    worker that fails loses nothing (its share is checked in this process)."""
    pictures = shapes(6)
    thumbnails = np.stack(pictures + [changed(pictures[i], kind) for i, kind in enumerate(["jpeg", "crop", "grey"])])
    vectors = l2_normalise(np.random.default_rng(1).normal(size=(len(thumbnails), 8))).astype(np.float32)
    monkeypatch.setattr(copy_check, "COARSE_BOUND", 1.0)
    digests = [f"d{row}" for row in range(9)]
    other = (vectors[6:], ["x", "y", "z"], thumbnails[6:])
    alone = [find_copies(vectors, digests, thumbnails, threshold=1.0)]
    alone.append(find_copies(vectors[:6], digests[:6], thumbnails[:6], other, threshold=1.0))
    monkeypatch.setattr(copy_check, "SHARED_PAIRS", 1)
    monkeypatch.setattr(copy_check.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    here = []  # the shares checked in this process
    check = copy_check._differences
    monkeypatch.setattr(copy_check, "_differences", lambda *given: here.append(len(given[2])) or check(*given))
    shared = [find_copies(vectors, digests, thumbnails, threshold=1.0)]
    shared.append(find_copies(vectors[:6], digests[:6], thumbnails[:6], other, threshold=1.0))
    assert len(alone[0]) > 3 and len(alone[1]) > 3
    assert shared == alone
    assert len(here) == 2  # one share each time: the workers checked the others
    monkeypatch.setattr(copy_check.sys, "executable", "/bin/false")  # workers that fail: their shares checked here
    assert find_copies(vectors, digests, thumbnails, threshold=1.0) == alone[0]
    assert len(here) == 5
    monkeypatch.setattr(copy_check.tempfile, "tempdir", "/nonexistent/folder")  # no temporary folder: all here
    assert find_copies(vectors, digests, thumbnails, threshold=1.0) == alone[0]
    assert len(here) == 6


def embedded(thumbnails: np.ndarray, name: str, labels: list[str] | None = None) -> AuditedCollection:
    vectors = l2_normalise(np.random.default_rng(len(name)).normal(size=(len(thumbnails), 8))).astype(np.float32)
    items = [
        Item(Path(f"/{name}/{row}.png"), (labels or [""] * len(thumbnails))[row]) for row in range(len(thumbnails))
    ]
    return AuditedCollection(items, vectors, [f"{name}{row}" for row in range(len(thumbnails))], thumbnails)


def test_duplicates_are_grouped_and_leaks_name_the_other_collections_copy() -> None:
    pictures = shapes(8)
    one = embedded(np.stack(pictures[:5] + [changed(pictures[0], "jpeg"), changed(pictures[0], "grey")]), "train")
    groups = duplicates(one)
    assert [sorted(path.name for path in group.paths) for group in groups] == [["0.png", "5.png", "6.png"]]
    assert groups[0].kind is CopyKind.NEAR and 0.9 < groups[0].score <= 1.0
    other = embedded(np.stack([changed(pictures[2], "crop"), pictures[6], pictures[7]]), "test")
    found = leaks(other, one)
    assert [(leak.path.name, leak.other.name) for leak in found] == [("0.png", "2.png")]


def test_an_image_far_from_every_other_and_an_unreadable_file_are_outliers() -> None:
    vectors, labels = clusters([10, 10, 10], spread=0.2)
    stranger = l2_normalise(np.random.default_rng(9).normal(size=(1, vectors.shape[1]))).astype(np.float32)
    everything = np.concatenate([vectors, stranger])
    items = [Item(Path(f"/images/{row}.png"), "") for row in range(len(everything))]
    found = outliers(items, everything, [Skipped(Path("/images/broken.png"), "cannot be decoded")])
    assert [o.path.name for o in found] == ["30.png", "broken.png"]
    assert found[1].reason == "cannot be decoded"


def test_decisions_go_to_a_labels_csv_that_train_reads_and_none_is_lost(tmp_path: Path) -> None:
    items = [Item(tmp_path / f"{row}.png", "cat" if row < 3 else "dog") for row in range(6)]
    target = tmp_path / "run" / "labels.csv"
    decide(target, items, LabelDecision(items[2].path, "dog", "cat", Decision.ACCEPTED))
    threads = [
        threading.Thread(target=decide, args=(target, items, LabelDecision(items[row].path, items[row].label, items[row].label, Decision.KEPT)))
        for row in (0, 4, 5)
    ]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    decisions = read_decisions(target)
    assert {path.name: d.decision for path, d in decisions.items()} == {
        "2.png": Decision.ACCEPTED, "0.png": Decision.KEPT, "4.png": Decision.KEPT, "5.png": Decision.KEPT
    }  # fmt: skip
    rows = list(csv.DictReader(target.read_text().splitlines()))
    assert [(Path(r["path"]).name, r["label"]) for r in rows][:3] == [
        ("0.png", "cat"),
        ("1.png", "cat"),
        ("2.png", "dog"),
    ]
    assert [item.label for item in decided_labels(items, decisions)] == ["cat", "cat", "dog", "dog", "dog", "dog"]
    assert not list(target.parent.glob(".labels.csv.*"))  # written atomically: no temporary left
    with pytest.raises(RetrievalError, match="not among the audited images"):
        decide(target, items, LabelDecision(tmp_path / "other.png", "dog", "cat", Decision.ACCEPTED))
    target.write_bytes(target.read_text().encode("utf-8-sig"))  # opened and saved again in Excel: a byte-order mark
    assert read_decisions(target) == decisions


@pytest.fixture(scope="module")
def audited_folder(icons_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four classes of the icons' test split, one image's label moved, one copied grey, one broken file."""
    root = copy_classes(icons_root, tmp_path_factory.mktemp("audit") / "images", 4, "test")
    classes = sorted(path for path in root.iterdir())
    moved = sorted(classes[0].iterdir())[0]
    shutil.move(moved, classes[1] / f"moved-{moved.name}")
    original = sorted(classes[2].iterdir())[0]
    Image.open(original).convert("L").save(classes[2] / f"grey-{original.stem}.png")
    (classes[3] / "broken.png").write_bytes(b"not an image")
    return root


def test_audit_prints_tables_and_json_and_writes_csvs(
    demo_run: RunDir, audited_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", str(demo_run.root), str(audited_folder), "--csv", str(tmp_path / "found")]) == 0
    printed = capsys.readouterr()
    for title in ("suspected wrong labels", "copies", "outliers", "audited"):
        assert title in printed.out
    assert "leaks (" not in printed.out  # nothing was given --against: no table of it
    assert "copies, rough check: " in printed.err  # the audit's long part shows its progress (one line in a log)
    assert main(["audit", str(demo_run.root), str(audited_folder), "--json"]) == 0
    printed = capsys.readouterr()
    found = json.loads(printed.out)
    assert "copies, rough check" not in printed.err  # a script's --json is left quiet
    assert set(found) >= {"labels", "duplicates", "leaks", "outliers"} and 0 <= found["agreement"] <= 1
    assert all(
        Path(row["path"]).is_absolute() and set(row) >= {"path", "label", "suggested", "score"}
        for row in found["labels"]
    )
    scores = [row["score"] for row in found["labels"]]
    assert scores == sorted(scores, reverse=True)
    grey = [group for group in found["duplicates"] if any(Path(p).name.startswith("grey-") for p in group["paths"])]
    assert grey and len(grey[0]["paths"]) >= 2
    assert any(Path(row["path"]).name == "broken.png" and row["kind"] == "unreadable" for row in found["outliers"])
    written = {path.name: list(csv.DictReader(path.open())) for path in (tmp_path / "found").glob("*.csv")}
    assert set(written) == {"labels.csv", "duplicates.csv", "leaks.csv", "outliers.csv"}
    assert len(written["labels.csv"]) == len(found["labels"])


def test_a_folder_given_relative_with_a_file_of_another_type_prints_its_tables_with_absolute_paths(
    demo_run: RunDir, icons_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`audit RUN pics` with pics/movie.mp4 ended in commonpath's "Can't mix absolute and relative paths": the files
    a folder's walk skipped kept the relative path given."""
    root = copy_classes(icons_root, tmp_path / "pics", 2, "test")
    (root / "movie.mp4").write_bytes(b"not a picture")
    monkeypatch.chdir(tmp_path)
    assert main(["audit", str(demo_run.root), "pics"]) == 0
    printed = capsys.readouterr().out
    images = sum(1 for path in root.rglob("*.png"))
    assert "movie.mp4" in printed  # counted apart: "audited N images" counted the file that is not one among them
    assert f"audited {images} images (1 more file could not be read: the outliers above)" in printed
    assert main(["audit", str(demo_run.root), "pics", "--json"]) == 0
    unreadable = [row for row in json.loads(capsys.readouterr().out)["outliers"] if row["kind"] == "unreadable"]
    assert [row["path"] for row in unreadable] == [str(root.resolve() / "movie.mp4")]
    inside = sorted(path for path in root.iterdir() if path.is_dir())[0]  # --against a part of DATA: leaks of themselves
    assert main(["audit", str(demo_run.root), "pics", "--against", str(inside.relative_to(tmp_path))]) == 0
    count = len(list(inside.iterdir()))
    assert f"note: {count} files are in DATA and in --against alike (e.g. {inside.resolve()}/" in capsys.readouterr().err


def test_an_audit_of_the_images_the_run_trained_on_points_to_folds(demo_run: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    """On its own training images a model has learnt the wrong labels too: the audit said nothing of it."""
    trained_on = json.loads(demo_run.model_card.read_text())["trained_on"]
    assert main(["audit", str(demo_run.root), trained_on]) == 0
    err = " ".join(capsys.readouterr().err.split())
    total = len(load_collection(trained_on).items)
    assert f"note: all {total:,} images are images {demo_run.root} trained on ({trained_on}): its model has learnt their labels" in err
    assert "give --folds K" in err
    assert main(["audit", str(demo_run.root), trained_on, "--json"]) == 0
    assert "note:" not in capsys.readouterr().err  # a script's --json is left quiet


def test_audit_against_another_split_lists_its_copies(
    demo_run: RunDir, audited_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "train" / "x"
    other.mkdir(parents=True)
    leaked = sorted(sorted(audited_folder.iterdir())[1].glob("*.png"))[1]
    shutil.copy(leaked, other / "same.png")
    Image.new("RGB", (64, 64), (10, 200, 10)).save(other / "green.png")
    assert main(["audit", str(demo_run.root), str(audited_folder), "--against", str(tmp_path / "train"), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert [(Path(leak["path"]).name, Path(leak["other"]).name, leak["kind"]) for leak in found["leaks"]] == [
        (leaked.name, "same.png", "identical bytes")
    ]
    assert main(["audit", str(demo_run.root), str(audited_folder), "--against", str(tmp_path / "train")]) == 0
    printed = capsys.readouterr().out
    assert "leaks (copies in --against): 1\n" in printed
    # the copy's path is written relative to the folder the copies share, as the audited paths are to theirs
    assert "│ same.png " in printed and f"copiesunder{other}" in "".join(printed.split())  # the caption may wrap
    (other / "same.png").unlink()
    assert main(["audit", str(demo_run.root), str(audited_folder), "--against", str(tmp_path / "train")]) == 0
    assert "leaks (copies in --against): none\n" in capsys.readouterr().out  # one line, not an empty table


def test_careless_audits_are_one_line_each(
    demo_run: RunDir, audited_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "no-model").mkdir()
    present = sorted(audited_folder.rglob("*.png"))[0]
    listed = write_collection_csv(tmp_path / "listed.csv", [Item(present, "a"), Item(tmp_path / "gone.png", "a")])
    labels = write_collection_csv(tmp_path / "labels.csv", [Item(path, path.parent.name) for path in sorted(audited_folder.rglob("*.png"))])
    written = labels.read_bytes()
    cases = {
        "no model": ([str(tmp_path / "no-model"), str(audited_folder)], "model.onnx"),
        "empty folder": ([str(demo_run.root), str(tmp_path / "empty")], "no image"),
        "the same folder": (
            [str(demo_run.root), str(audited_folder), "--against", str(audited_folder)],
            f"the same images as DATA ({audited_folder}); give another collection, e.g. the training images",
        ),
        "too many folds": ([str(demo_run.root), str(audited_folder), "--folds", "50"], "--folds 50"),
        "--fold-epochs alone": (  # it was ignored
            [str(demo_run.root), str(audited_folder), "--fold-epochs", "3"],
            "--fold-epochs 3 sets the length of each --folds run: add --folds K",
        ),
        "missing files": ([str(demo_run.root), str(listed)], "not there"),
        "--against an empty folder": (  # OTHER's errors began with its path alone, as DATA's do
            [str(demo_run.root), str(audited_folder), "--against", str(tmp_path / "empty")],
            f"error: --against {tmp_path / 'empty'}: no images found",
        ),
        "--against a CSV of files not there": (
            [str(demo_run.root), str(audited_folder), "--against", str(write_collection_csv(tmp_path / "gone.csv", [Item(tmp_path / "gone.png", "a")]))],
            f"error: --against {tmp_path / 'gone.csv'}: no usable images",
        ),
        "wrong path": ([str(demo_run.root), str(tmp_path / "nowhere")], "no such file or folder"),
        "--csv on a file": ([str(demo_run.root), str(audited_folder), "--csv", str(listed)], "a file is there"),
        "--csv nowhere": ([str(demo_run.root), str(audited_folder), "--csv", f"{listed}/found"], "cannot be made"),
        "--csv named as a file": (  # it made a folder audit.csv holding the four CSVs
            [str(demo_run.root), str(audited_folder), "--csv", str(tmp_path / "audit.csv")],
            f"--csv {tmp_path / 'audit.csv'}: a file's name (.csv), but --csv is the folder the files are written into; give a folder, e.g. {tmp_path / 'audit'}",
        ),
        "--csv inside DATA": (  # the next audit of DATA read the CSVs as files that are not images
            [str(demo_run.root), str(audited_folder), "--csv", str(audited_folder / "audit")],
            f"--csv {audited_folder / 'audit'}: inside the images audited (DATA {audited_folder}), where its CSVs would be read",
        ),
        "--csv inside --against": (
            [str(demo_run.root), str(write_collection_csv(tmp_path / "part.csv", [Item(present, "a")])), "--against", str(audited_folder), "--csv", str(audited_folder)],
            f"--csv {audited_folder}: inside the images audited (--against {audited_folder})",
        ),
        "--csv where DATA's labels.csv is": (  # it was replaced by the table of suspects
            [str(demo_run.root), str(labels), "--csv", str(tmp_path)],
            f"--csv {tmp_path}: labels.csv there is not an audit's, and writing would replace it; give another folder",
        ),
    }
    for name, (arguments, said) in cases.items():
        assert main(["audit", *arguments]) == 2, name
        captured = capsys.readouterr()
        assert said in captured.err and len(captured.err.strip().splitlines()) == 1, (name, captured.err)
        assert "Traceback" not in captured.err
    assert labels.read_bytes() == written and not (tmp_path / "audit.csv").exists()
    (tmp_path / "broken" / "a").mkdir(parents=True)
    (tmp_path / "broken" / "a" / "1.png").write_text("not a picture")
    assert main(["audit", str(demo_run.root), str(audited_folder), "--against", str(tmp_path / "broken")]) == 2
    said = f"error: --against {tmp_path / 'broken'}: its one image could not be read ({tmp_path / 'broken' / 'a' / '1.png'}: "
    assert capsys.readouterr().err.splitlines()[-1].startswith(said)  # after DATA's embedding line
    assert main(["audit", str(demo_run.root), str(labels), "--csv", str(tmp_path / "found")]) == 0
    assert main(["audit", str(demo_run.root), str(labels), "--csv", str(tmp_path / "found")]) == 0  # its own: replaced


@pytest.fixture(scope="module")
def audit_run(demo_run: RunDir, tmp_path_factory: pytest.TempPathFactory) -> tuple[RunDir, Item]:
    """A copy of the demo run whose gallery has one image's label moved to another label; and that image, as it was."""
    from index.build import build_index
    from retrieval.data import Collection
    from retrieval.embedders import OnnxEmbedder

    root = tmp_path_factory.mktemp("audit-app") / "run"
    shutil.copytree(demo_run.root, root)
    run = RunDir(root)
    embedder = OnnxEmbedder.from_run(run)
    items = sorted(SearchService(run).items.values(), key=lambda item: str(item.path))
    labels = sorted({item.label for item in items})
    moved = items[0]
    other = next(label for label in labels if label != moved.label)
    shifted = [Item(item.path, other) if item.path == moved.path else item for item in items]
    build_index(embedder, Collection(root / "gallery.csv", shifted, []), run.index, rebuild=True, progress=False)
    return run, moved


def test_images_without_labels_are_said_not_judged_not_found_right(demo_run: RunDir, icons_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder of images without subfolders (no labels) read "suspected wrong labels (of 6 images): none", and the
    Audit tab of such a gallery "every image's closest images agree with its label"."""
    import app.audit as audit_tab

    flat = tmp_path / "flat"
    flat.mkdir()
    for image in copy_classes(icons_root, tmp_path / "pics", 2, "test").rglob("*.png"):
        image.rename(flat / f"{image.parent.name}-{image.name}")
    assert main(["audit", str(demo_run.root), str(flat)]) == 0
    said = "suspected wrong labels: not judged, no image has a label (labels come from an image folder ROOT/<label>/<image> or a CSV with columns path,label)"
    assert capsys.readouterr().out.startswith(said)
    assert main(["audit", str(demo_run.root), str(flat), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["labeled"] == 0 and found["labels"] == [] and found["images"] == len(list(flat.iterdir()))
    unlabeled = SimpleNamespace(items={1: Item(flat / "a.png", ""), 2: Item(flat / "b.png", "")})
    line = audit_tab.AuditHandlers(unlabeled).audit()[2]  # type: ignore[arg-type]
    assert line.startswith("No label is judged: no image of the gallery has a label")
    assert "ROOT/&lt;label&gt;/&lt;image&gt;" in line  # Markdown showed "ROOT//": <label> and <image> read as HTML tags


def test_the_audit_tab_counts_every_suspect_beyond_those_it_shows(audit_run: tuple[RunDir, Item], monkeypatch: pytest.MonkeyPatch) -> None:
    """With more suspects than the table shows, the line gave the table's length as the count (200 where 306 were found)."""
    import app.audit as audit_tab

    service = SearchService(audit_run[0])
    try:
        _, every, _ = audit_tab.AuditHandlers(service).audit()
        monkeypatch.setattr(audit_tab, "SUSPECTS_SHOWN", 1)
        rows, _, said = audit_tab.AuditHandlers(service).audit()
    finally:
        service.close()
    assert len(every) > 1 and len(rows) == 1
    labeled = sum(bool(item.label) for item in service.items.values())
    assert said.startswith(f"**{len(every)}** suspected wrong {'label' if len(every) == 1 else 'labels'} of {labeled} labeled images (the first 1 shown): click one to see it. The closest image has the same label for ")
    assert "(leave-one-out recall@1)" in said


def test_the_audit_endpoint_answers_gradio_client(audit_run: tuple[RunDir, Item]) -> None:
    """client.predict(api_name="/audit") failed in "403 Forbidden" for a gallery image: the rows' data beside the table
    (left out of the API) had a "path" key, which gradio_client fetches as a file before it drops that output."""
    from gradio_client import Client

    from app.audit import AuditHandlers
    from app.server import launch
    from tests.test_app import free_port

    run, moved = audit_run
    service = SearchService(run)
    port = free_port()
    demo = launch(service, port=port, block=False)
    try:
        table, said = Client(f"http://127.0.0.1:{port}/", verbose=False).predict(api_name="/audit")
        rows = AuditHandlers(service).audit()[0]
    finally:
        demo.close()
        service.close()
    assert table["headers"] == ["image", "label", "suggested", "score"] and table["data"] == rows
    assert moved.path.name in [row[0] for row in rows] and "suspected wrong label" in said


def test_the_audit_tab_lists_suspects_and_keeps_decisions_in_a_labels_csv(audit_run: tuple[RunDir, Item]) -> None:
    from app.audit import AuditHandlers, labels_csv
    from retrieval.data import load_collection

    run, moved = audit_run
    service = SearchService(run, allow_write=True)
    try:
        on = AuditHandlers(service)
        rows, data, said = on.audit()
        assert rows and "suspected wrong label" in said
        paths = [row["file"] for row in data]
        assert str(moved.path) in paths  # the moved image is among the suspects
        first, second = data[0], data[1] if len(data) > 1 else None
        message, rows_after, data_after, _, view, proposed, opened, *buttons = on.accept(first)
        assert "1 decision in" in message and labels_csv(service).is_file()
        # the decided suspect closed, the buttons disabled: a second click wrote it again or turned it over unseen
        assert (view, proposed, opened) == ([], "", None) and [button["interactive"] for button in buttons] == [False, False]
        assert first["file"] not in [row["file"] for row in data_after]  # decided: off the list
        if second is not None:
            on.keep(second)
        trained_on = {item.path: item.label for item in load_collection(labels_csv(service)).items}
        assert len(trained_on) == len(service.items)  # every gallery image, as `retrieval train` reads it
        assert trained_on[Path(first["file"])] == first["suggested"]
        if second is not None:
            assert trained_on[Path(second["file"])] == second["label"]
    finally:
        service.close()
    read_only = SearchService(run)
    try:
        with pytest.raises(Exception, match="read-only"):
            AuditHandlers(read_only).keep(data[0])
    finally:
        read_only.close()


def test_audit_with_folds_trains_a_short_run_per_fold_and_scores_each_image_out_of_fold(
    demo_run: RunDir, audited_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    arguments = ["audit", str(demo_run.root), str(audited_folder), "--folds", "2", "--fold-epochs", "1", "--json"]
    assert main(arguments) == 0
    found = json.loads(capsys.readouterr().out)
    assert all(set(row) >= {"path", "label", "suggested", "score"} for row in found["labels"])
    assert {Path(row["path"]).parent for row in found["labels"]} <= set(audited_folder.iterdir())
    assert not list(Path(demo_run.root).glob("fold-*"))  # the fold runs lived in a temporary folder


def test_labels_written_alike_but_for_case_are_named_before_the_audit(demo_run: RunDir, icons_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Cat and cat in a CSV were audited as two classes without a word; --json stays quiet."""
    root = copy_classes(icons_root, tmp_path / "pics", 2, "test")
    first, second = sorted(path for path in root.iterdir())
    rows = [f"{path},{first.name.upper() if number == 0 else first.name}" for number, path in enumerate(sorted(first.iterdir()))]
    rows += [f"{path},{second.name}" for path in sorted(second.iterdir())]
    (tmp_path / "labels.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    assert main(["audit", str(demo_run.root), str(tmp_path / "labels.csv")]) == 0
    err = " ".join(capsys.readouterr().err.split())
    count = len(rows) - len(list(second.iterdir())) - 1
    assert f"note: labels written alike but for case, spaces, - or _ are different classes: '{first.name}' ({count} images) and '{first.name.upper()}' (1)" in err
    assert main(["audit", str(demo_run.root), str(tmp_path / "labels.csv"), "--json"]) == 0
    assert "note:" not in capsys.readouterr().err


def test_agreement_is_leave_one_out_recall_at_1_of_the_labeled_images_and_cautions_when_weak() -> None:
    """An audit of 299 suspects among 484 images gave no hint that the model, not the labels, was mostly wrong."""
    angles = np.array([0.0, 0.1, 1.0, 1.05, 1.12, 2.0, 2.04, 3.0])  # a a | b b b(x) | c c? | d
    vectors = np.stack([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
    labels = ["a", "a", "b", "b", "c", "c", "", "d"]  # the 5th is labeled c among b's; the 7th has no label
    items = [Item(Path(f"/{number}.png"), label) for number, label in enumerate(labels)]
    # scored: the a's, b's and c's (d is alone); the c among the b's finds a b first: 5 of 6 right (the c at 2.0 passes
    # over the unlabeled image beside it to the c at 1.12)
    ids, _ = nearest_neighbours(vectors, vectors, 7, exclude_self=True)
    share = agreement(items, vectors)
    expected = []
    for row, label in enumerate(labels):
        if label in ("a", "b", "c"):
            first = next(i for i in ids[row] if labels[i])
            expected.append(labels[first] == label)
    assert share == pytest.approx(np.mean(expected)) and share == pytest.approx(5 / 6)
    assert agreement([Item(Path("/x.png"), "a"), Item(Path("/y.png"), "b")], vectors[:2]) is None  # no label twice
    assert describe_agreement(0.9) == "the closest image has the same label for 90% of the labeled images (leave-one-out recall@1)"
    assert describe_agreement(0.4).endswith("at this level many suspects are the model's mistakes rather than the labels' (docs/trust.md)")
    assert describe_agreement(None) == ""


def test_write_csvs_itself_never_replaces_a_labels_csv_an_audit_did_not_write(tmp_path: Path) -> None:
    """The check lives where the files are written, so a Python caller of write_csvs is held to it too."""
    from retrieval.audit import Audit, write_csvs

    (tmp_path / "labels.csv").write_text("path,label,was,decision\na.png,cat,,\n")  # the Audit tab's decisions
    with pytest.raises(RetrievalError, match=r"labels.csv there is not an audit's, and writing would replace it"):
        write_csvs(Audit(), tmp_path)
    assert (tmp_path / "labels.csv").read_text() == "path,label,was,decision\na.png,cat,,\n"
    assert [path.name for path in write_csvs(Audit(), tmp_path / "found")] == ["labels.csv", "duplicates.csv", "leaks.csv", "outliers.csv"]
    write_csvs(Audit(), tmp_path / "found")  # an audit's own files: replaced


def test_an_audit_from_python_is_the_commands(demo_run: RunDir, icons_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """audit() took only what the command line built in a helper of its own; embed_items's result failed with
    "'Embedded' object has no attribute 'digests'"."""
    from retrieval.audit import embed_collection
    from retrieval.embedders import OnnxEmbedder, embed_items

    folder = copy_classes(icons_root, tmp_path / "photos", 3, split="test")
    embedder = OnnxEmbedder.from_run(demo_run)
    found = audit(embed_collection(embedder, folder, progress=False))
    assert main(["audit", str(demo_run.root), str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(found.to_dict()))
    with pytest.raises(RetrievalError, match=r"\(vectors, digests and thumbnails\), not retrieval.embedders.Embedded$"):
        audit(embed_items(embedder, folder, progress=False))
    collection = embed_collection(embedder, folder, progress=False)
    with pytest.raises(RetrievalError, match="^other: the same images as the collection audited, each of which would be listed as a leak"):
        audit(collection, embed_collection(embedder, folder, progress=False))  # every image was a leak of itself
    with pytest.raises(RetrievalError, match=r"\(vectors, digests and thumbnails\), not builtins.NoneType$"):
        audit(None)  # type: ignore[arg-type]  # an AttributeError: 'NoneType' object has no attribute 'vectors'
    for folds in (2, "2", [collection.vectors]):  # 2: "'int' object is not iterable"
        with pytest.raises(RetrievalError) as refused:
            audit(collection, folds=folds)  # type: ignore[arg-type]
        assert str(refused.value).endswith(
            ": give (vectors of every image by one fold's model, the rows it did not train on) for each fold; "
            "`retrieval audit --folds K` trains the K models (training.folds.fold_models)"
        ) and str(refused.value).startswith("folds=")
    some = copy_classes(icons_root, tmp_path / "some", 1, split="test")  # copies of the first class's files
    leaked = audit(collection, embed_collection(embedder, some, progress=False)).leaks  # other files: audited
    assert len(leaked) == len(list(some.glob("*/*"))) and {leak.kind for leak in leaked} == {CopyKind.IDENTICAL}
