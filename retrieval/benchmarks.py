"""The standard metric-learning benchmarks, read from their extracted original archives.

Nothing is downloaded: point the command at the folder an archive was extracted to. Splits are the
ones papers report (Musgrave et al. 2020; Oh Song et al. 2016):

- CUB-200-2011 (CUB_200_2011.tgz): classes 1-100 train, 101-200 test, leave-one-out on test.
- Cars196 (car_ims.tgz + cars_annos.mat): classes 1-98 train, 99-196 test, leave-one-out on test.
- Stanford Online Products (Stanford_Online_Products.zip): Ebay_train.txt and Ebay_test.txt.
- In-Shop Clothes (DeepFashion In-shop: img/ + Eval/list_eval_partition.txt): train, and the query
  set against the gallery set.

Images listed in the annotation files but missing on disk are skipped and reported, like any other
unreadable file; a missing or malformed annotation file is an error that names what was expected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from retrieval.data import Collection, Item, Skipped, load_collection
from retrieval.errors import RetrievalError, one_of


@dataclass
class Benchmark:
    """A benchmark's training collection and its test protocol (leave-one-out on test, or query/gallery)."""

    name: str
    train: Collection
    test: Collection | None = None  # leave-one-out
    query: Collection | None = None  # with gallery: the In-Shop protocol
    gallery: Collection | None = None


def _collection(source: Path, rows: list[tuple[Path, str]], listed_in: str) -> Collection:
    """Items of the rows whose file exists; the others are skipped with the file that listed them."""
    items = [Item(path, label) for path, label in rows if path.is_file()]
    skipped = [Skipped(path, f"listed in {listed_in} but not found") for path, label in rows if not path.is_file()]
    return Collection(source, items, skipped)


def _table(path: Path, columns: int, expected: str, skip: int = 0) -> list[list[str]]:
    """The whitespace-separated rows of an annotation file, each with at least `columns` fields."""
    if not path.is_file():
        raise RetrievalError(f"{path}: not found; {expected}")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines()[skip:], start=skip + 1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) < columns:
            raise RetrievalError(
                f"{path}, line {number}: expected {columns} fields, found "
                f"{len(fields)} ({line.strip()[:80]!r}); {expected}"
            )
        rows.append(fields)
    return rows


def _number(text: str, path: Path) -> int:
    try:
        return int(text)
    except ValueError:
        raise RetrievalError(f"{path}: {text!r} is not a number where a class or image id belongs") from None


def _root(root: Path, marker: str, folder: str) -> Path:
    """The archive folder: root itself, or root/folder when root is the folder it was extracted into."""
    if not (root / marker).exists() and (root / folder / marker).exists():
        return root / folder
    return root


def load_cub(root: Path) -> Benchmark:
    """CUB-200-2011: images.txt, image_class_labels.txt, classes.txt and images/; classes 1-100 train, 101-200 test."""
    root = _root(root, "images.txt", "CUB_200_2011")
    expected = (
        f"{root} should be the extracted CUB_200_2011 folder, with "
        "images.txt, image_class_labels.txt, classes.txt and images/"
    )
    paths = {_number(image, root / "images.txt"): name for image, name in _table(root / "images.txt", 2, expected)}
    names = {_number(number, root / "classes.txt"): name for number, name in _table(root / "classes.txt", 2, expected)}
    rows: dict[bool, list[tuple[Path, str]]] = {True: [], False: []}
    for image, number in _table(root / "image_class_labels.txt", 2, expected):
        image_id, class_id = (
            _number(image, root / "image_class_labels.txt"),
            _number(number, root / "image_class_labels.txt"),
        )
        if image_id not in paths or class_id not in names:
            raise RetrievalError(
                f"{root / 'image_class_labels.txt'}: image {image_id} or class "
                f"{class_id} is not in images.txt / classes.txt; {expected}"
            )
        rows[class_id <= len(names) // 2].append((root / "images" / paths[image_id], names[class_id]))
    return Benchmark(
        "cub", _collection(root, rows[True], "images.txt"), test=_collection(root, rows[False], "images.txt")
    )


def load_cars196(root: Path) -> Benchmark:
    """Cars196: cars_annos.mat and car_ims/; classes 1-98 train, 99-196 test."""
    from scipy.io import loadmat  # scipy comes with scikit-learn; MATLAB files hold no pickles
    from scipy.io.matlab import MatReadError

    annotations = root / "cars_annos.mat"
    expected = (
        f"{root} should hold cars_annos.mat and the extracted "
        "car_ims/ folder (car_ims.tgz) of the Stanford Cars dataset"
    )
    if not annotations.is_file():
        raise RetrievalError(f"{annotations}: not found; {expected}")
    try:
        mat = loadmat(str(annotations), squeeze_me=True)
        entries = [(str(entry["relative_im_path"]), int(entry["class"])) for entry in mat["annotations"]]
        names = [str(name) for name in mat["class_names"]]
    except (MatReadError, ValueError, KeyError, TypeError, IndexError, OSError) as error:
        raise RetrievalError(f"{annotations}: not a readable cars_annos.mat ({error}); {expected}") from None
    rows: dict[bool, list[tuple[Path, str]]] = {True: [], False: []}
    for path, class_id in entries:
        if not 1 <= class_id <= len(names):
            raise RetrievalError(
                f"{annotations}: class {class_id} of {path} is not among the {len(names)} class_names; {expected}"
            )
        rows[class_id <= len(names) // 2].append((root / path, names[class_id - 1]))
    return Benchmark(
        "cars196",
        _collection(root, rows[True], annotations.name),
        test=_collection(root, rows[False], annotations.name),
    )


def load_sop(root: Path) -> Benchmark:
    """Stanford Online Products: Ebay_train.txt and Ebay_test.txt (image_id class_id super_class_id path)."""
    root = _root(root, "Ebay_train.txt", "Stanford_Online_Products")
    expected = (
        f"{root} should be the extracted Stanford_Online_Products folder, "
        "with Ebay_train.txt, Ebay_test.txt and the image folders"
    )

    def split(name: str) -> Collection:
        rows = [(root / fields[3], fields[1]) for fields in _table(root / name, 4, expected, skip=1)]
        return _collection(root, rows, name)

    return Benchmark("sop", split("Ebay_train.txt"), test=split("Ebay_test.txt"))


def load_inshop(root: Path) -> Benchmark:
    """In-Shop Clothes: Eval/list_eval_partition.txt (image_name item_id evaluation_status) and img/."""
    listing = next(
        (
            path
            for path in (root / "Eval" / "list_eval_partition.txt", root / "list_eval_partition.txt")
            if path.is_file()
        ),
        root / "Eval" / "list_eval_partition.txt",
    )
    expected = (
        f"{root} should hold Eval/list_eval_partition.txt and the "
        "extracted img/ folder (img.zip) of DeepFashion In-shop"
    )
    rows: dict[str, list[tuple[Path, str]]] = {"train": [], "query": [], "gallery": []}
    for name, item, status in (fields[:3] for fields in _table(listing, 3, expected, skip=2)):
        if status not in rows:
            raise RetrievalError(
                f"{listing}: evaluation_status {status!r} of {name} is not train, query or gallery; {expected}"
            )
        rows[status].append((root / name, item))
    train, query, gallery = (_collection(root, rows[status], listing.name) for status in ("train", "query", "gallery"))
    return Benchmark("inshop", train, query=query, gallery=gallery)


BENCHMARKS: dict[str, Callable[[Path], Benchmark]] = {
    "cub": load_cub,
    "cars196": load_cars196,
    "sop": load_sop,
    "inshop": load_inshop,
}


def load_benchmark(name: str, root: str | Path) -> Benchmark:
    """Reads the named benchmark (cub, cars196, sop, inshop) from the folder its archive was extracted to."""
    if name not in BENCHMARKS:
        raise RetrievalError(f"--benchmark {name!r}: {one_of(name, BENCHMARKS)}")
    root = Path(root).expanduser()
    if not root.is_dir():
        raise RetrievalError(f"{root}: no such folder; give the folder the {name} archive was extracted to")
    benchmark = BENCHMARKS[name](root.resolve())
    for part in (benchmark.train, benchmark.test, benchmark.query, benchmark.gallery):
        if part is not None and not part.items:
            raise RetrievalError(
                f"{root}: none of the images listed for the {name} benchmark were found "
                f"({len(part.skipped)} listed); was the image archive extracted here?"
            )
    return benchmark


def load_training_data(data: str | Path, benchmark: str | None = None) -> Collection:
    """The collection to train on: a folder or CSV, or the training split of a benchmark archive."""
    return load_benchmark(benchmark, data).train if benchmark else load_collection(data)
