"""The four benchmark loaders on tiny fabricated copies of their archives' layouts, and `--benchmark` end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy.io import savemat

from retrieval.benchmarks import load_benchmark
from retrieval.commands import main
from retrieval.errors import RetrievalError
from retrieval.runs import RunDir


def image(path: Path, shade: int) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (24, 24), (shade * 37 % 256, shade * 91 % 256, 120)).save(path)
    return path.name


def fabricate_cub(root: Path, classes: int = 4, per_class: int = 3) -> Path:
    """CUB_200_2011/: images.txt, image_class_labels.txt, classes.txt, images/<NNN.Name>/<file>.jpg."""
    root = root / "CUB_200_2011"
    names, images, labels = [], [], []
    for class_id in range(1, classes + 1):
        folder = f"{class_id:03d}.Bird_{class_id}"
        names.append(f"{class_id} {folder}")
        for n in range(per_class):
            image_id = len(images) + 1
            image(root / "images" / folder / f"Bird_{class_id}_{n}.jpg", image_id)
            images.append(f"{image_id} {folder}/Bird_{class_id}_{n}.jpg")
            labels.append(f"{image_id} {class_id}")
    for name, lines in (("classes.txt", names), ("images.txt", images), ("image_class_labels.txt", labels)):
        (root / name).write_text("\n".join(lines) + "\n")
    return root.parent


def fabricate_cars(root: Path, classes: int = 4, per_class: int = 3) -> Path:
    """cars_annos.mat (annotations: relative_im_path, bbox, class, test; class_names) and car_ims/."""
    root.mkdir(parents=True)
    records = []
    for class_id in range(1, classes + 1):
        for n in range(per_class):
            number = len(records) + 1
            image(root / "car_ims" / f"{number:06d}.jpg", number)
            records.append((f"car_ims/{number:06d}.jpg", 0, 0, 20, 20, class_id, n % 2))
    fields = [("relative_im_path", "O"), ("bbox_x1", "O"), ("bbox_y1", "O"), ("bbox_x2", "O"), ("bbox_y2", "O"), ("class", "O"), ("test", "O")]
    annotations = np.array(records, dtype=fields).reshape(1, -1)
    names = np.array([f"Maker Model {year}" for year in range(2000, 2000 + classes)], dtype=object).reshape(1, -1)
    savemat(str(root / "cars_annos.mat"), {"annotations": annotations, "class_names": names})
    return root


def fabricate_sop(root: Path) -> Path:
    """Stanford_Online_Products/: Ebay_train.txt, Ebay_test.txt (image_id class_id super_class_id path) and images."""
    root = root / "Stanford_Online_Products"
    for name, classes in (("Ebay_train.txt", (1, 2)), ("Ebay_test.txt", (3, 4, 5))):
        lines = ["image_id class_id super_class_id path"]
        for class_id in classes:
            for n in range(2):
                path = f"bicycle_final/{class_id}{n}_0.JPG"
                image(root / path, class_id * 2 + n)
                lines.append(f"{len(lines)} {class_id} 1 {path}")
        (root / name).write_text("\n".join(lines) + "\n")
    return root


def fabricate_inshop(root: Path) -> Path:
    """img/<GENDER>/<category>/id_*/<file>.jpg and Eval/list_eval_partition.txt (count, header, rows)."""
    rows = []
    for item, statuses in (("id_00000001", ("train", "train")), ("id_00000002", ("train", "train")), ("id_00000003", ("query", "gallery")), ("id_00000004", ("query", "gallery", "gallery"))):
        for n, status in enumerate(statuses):
            name = f"img/WOMEN/Dresses/{item}/0{n}_1_front.jpg"
            image(root / name, len(rows))
            rows.append(f"{name}    {item}    {status}")
    (root / "Eval").mkdir(parents=True)
    (root / "Eval" / "list_eval_partition.txt").write_text(f"{len(rows)}\nimage_name item_id evaluation_status\n" + "\n".join(rows) + "\n")
    return root


def labels(collection) -> list[str]:  # type: ignore[no-untyped-def]
    return sorted({item.label for item in collection.items})


def test_cub_first_half_of_the_classes_trains(tmp_path: Path) -> None:
    benchmark = load_benchmark("cub", fabricate_cub(tmp_path))  # the folder the archive was extracted into
    assert labels(benchmark.train) == ["001.Bird_1", "002.Bird_2"] and labels(benchmark.test) == ["003.Bird_3", "004.Bird_4"]
    assert len(benchmark.train.items) == len(benchmark.test.items) == 6
    assert all(item.path.is_file() for item in benchmark.train.items)


def test_cars_first_half_of_the_classes_trains_whatever_the_test_flag(tmp_path: Path) -> None:
    benchmark = load_benchmark("cars196", fabricate_cars(tmp_path / "cars"))
    assert labels(benchmark.train) == ["Maker Model 2000", "Maker Model 2001"]
    assert labels(benchmark.test) == ["Maker Model 2002", "Maker Model 2003"]
    assert len(benchmark.train.items) == len(benchmark.test.items) == 6


def test_sop_uses_its_official_files(tmp_path: Path) -> None:
    benchmark = load_benchmark("sop", fabricate_sop(tmp_path))
    assert labels(benchmark.train) == ["1", "2"] and labels(benchmark.test) == ["3", "4", "5"]


def test_inshop_query_and_gallery(tmp_path: Path) -> None:
    benchmark = load_benchmark("inshop", fabricate_inshop(tmp_path))
    assert benchmark.test is None and benchmark.query is not None and benchmark.gallery is not None
    assert labels(benchmark.train) == ["id_00000001", "id_00000002"]
    assert len(benchmark.query.items) == 2 and len(benchmark.gallery.items) == 3


def test_missing_images_are_skipped_and_reported(tmp_path: Path) -> None:
    root = fabricate_cub(tmp_path)
    missing = root / "CUB_200_2011" / "images" / "001.Bird_1" / "Bird_1_0.jpg"
    missing.unlink()
    benchmark = load_benchmark("cub", root)
    assert len(benchmark.train.items) == 5
    assert [(entry.path, entry.reason) for entry in benchmark.train.skipped] == [(missing, "listed in images.txt but not found")]


@pytest.mark.parametrize(
    ("name", "make", "damage", "message"),
    [
        ("cub", fabricate_cub, lambda root: (root / "CUB_200_2011" / "classes.txt").unlink(), "classes.txt: not found; .* should be the extracted CUB_200_2011 folder"),
        ("cub", fabricate_cub, lambda root: (root / "CUB_200_2011" / "images.txt").write_text("1\n"), "images.txt, line 1: expected 2 fields"),
        ("cars196", lambda root: fabricate_cars(root / "cars"), lambda root: (root / "cars" / "cars_annos.mat").write_bytes(b"not a mat"), "cars_annos.mat: not a readable cars_annos.mat"),
        ("sop", fabricate_sop, lambda root: (root / "Stanford_Online_Products" / "Ebay_test.txt").unlink(), "Ebay_test.txt: not found"),
        ("inshop", fabricate_inshop, lambda root: (root / "Eval" / "list_eval_partition.txt").write_text("1\nheader\nimg/a.jpg id_1 validation\n"), "evaluation_status 'validation'"),
        ("inshop", fabricate_inshop, lambda root: shutil.rmtree(root / "img"), "none of the images listed"),
    ],
)
def test_broken_layouts_are_explained(tmp_path: Path, name: str, make, damage, message: str) -> None:  # type: ignore[no-untyped-def]
    make(tmp_path)
    damage(tmp_path)
    target = tmp_path / "cars" if name == "cars196" else tmp_path
    with pytest.raises(RetrievalError, match=message):
        load_benchmark(name, target)


def test_unknown_benchmark_and_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(RetrievalError, match="choose one of cub, cars196, sop, inshop"):
        load_benchmark("mnist", tmp_path)
    with pytest.raises(RetrievalError, match="no such folder"):
        load_benchmark("cub", tmp_path / "nowhere")


@pytest.mark.parametrize("name", ["cub", "inshop"])
def test_train_and_evaluate_with_benchmark(demo_run: RunDir, tmp_path: Path, name: str) -> None:
    root = fabricate_cub(tmp_path / "data") if name == "cub" else fabricate_inshop(tmp_path / "data")
    run = RunDir(tmp_path / "run")
    assert main(["train", str(root), "--benchmark", name, "--run", str(run.root), "--epochs", "1", "--batch-size", "4", "--images-per-class", "2", "--image-size", "32"]) == 0
    config = json.loads(run.config.read_text())
    assert config["benchmark"] == name
    scored = tmp_path / "scored"
    shutil.copytree(demo_run.root, scored)
    assert main(["evaluate", str(scored), str(root), "--benchmark", name, "-k", "1,2"]) == 0
    metrics = json.loads((scored / "metrics.json").read_text())
    assert metrics["benchmark"] == name
    assert metrics["protocol"] == ("leave-one-out" if name == "cub" else "query-gallery")
    assert metrics["num_queries"] == (6 if name == "cub" else 2)
