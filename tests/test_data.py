"""Collections (folder and CSV), the embedded dataset's split, safe decoding and preprocessing."""

from __future__ import annotations

import csv
import hashlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import retrieval.data as data
from retrieval.data import Item, decode_image, load_collection, load_image
from retrieval.errors import ImageError, RetrievalError
from retrieval.preprocess import Preprocessing, resize_and_crop
from tests.conftest import write_bad_files


def test_folder_labels_come_from_the_first_folder_level(tmp_path: Path) -> None:
    for label, name in [("cat", "a.png"), ("cat", "sub/b.png"), ("dog", "c.jpg")]:
        path = tmp_path / label / name
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(path)
    (tmp_path / "dog" / "readme.txt").write_text("not an image")
    (tmp_path / ".hidden").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / ".hidden" / "x.png")
    collection = load_collection(tmp_path)
    assert [(item.path.name, item.label) for item in collection.items] == [("a.png", "cat"), ("b.png", "cat"), ("c.jpg", "dog")]
    assert [s.path.name for s in collection.skipped] == ["readme.txt"]


def test_a_run_kept_among_the_images_is_not_read_as_a_class(tmp_path: Path) -> None:
    """`retrieval train photos --run photos/run` a second time trained on 'run', a class of the first run's loss
    plot ("trained on 9 images of 3 classes"); an index of photos/ would have held the run's plots."""
    for label in ("cat", "dog"):
        (tmp_path / label).mkdir()
        Image.new("RGB", (8, 8)).save(tmp_path / label / "a.png")
    for run, marker in [("run", "train_log.jsonl"), ("exported/deep", "model.json"), ("saved", "checkpoints/last.safetensors")]:
        (tmp_path / run / marker).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / run / marker).write_text("{}")
        Image.new("RGB", (8, 8)).save(tmp_path / run / "train_loss.png")
    (tmp_path / "exported" / "deep" / "model.onnx").write_bytes(b"")
    collection = load_collection(tmp_path)
    assert sorted(collection.class_counts()) == ["cat", "dog"]
    skipped = {s.path: s.reason for s in collection.skipped}
    assert sorted(skipped) == [tmp_path / "exported" / "deep", tmp_path / "run", tmp_path / "saved"]
    assert all("a run directory" in reason for reason in skipped.values())
    with pytest.raises(RetrievalError, match="a run directory, not a collection of images"):
        load_collection(tmp_path / "run")


def test_an_index_kept_among_the_images_is_not_read(tmp_path: Path) -> None:
    """`retrieval index RUN photos --index photos/idx` listed the index's own four files as skipped on every run."""
    (tmp_path / "cat").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "cat" / "a.png")
    (tmp_path / "idx").mkdir()
    for name in ("manifest.json", "items.sqlite", "vectors.faiss", "skipped.json"):
        (tmp_path / "idx" / name).write_text("{}")
    collection = load_collection(tmp_path)
    assert [item.path.name for item in collection.items] == ["a.png"]
    assert [(s.path, s.reason) for s in collection.skipped] == [(tmp_path / "idx", "an index (`retrieval index ... --index` put it here): not read")]


def test_paths_written_on_windows_are_read_or_named(tmp_path: Path) -> None:
    """A CSV made on Windows (photos\\cat\\a.png) skipped every row as "not found"; a drive's path said only that."""
    (tmp_path / "photos" / "cat").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "photos" / "cat" / "a.png")
    (tmp_path / "list.csv").write_text("path,label\nphotos\\cat\\a.png,cat\nC:\\Users\\me\\b.png,cat\n")
    (tmp_path / "list.txt").write_text("photos\\cat\\a.png\nD:/pictures/b.png\n")
    for name in ("list.csv", "list.txt"):
        collection = load_collection(tmp_path / name)
        assert [item.path for item in collection.items] == [(tmp_path / "photos" / "cat" / "a.png").resolve()]
        assert [s.reason.split(": ", 1)[1] for s in collection.skipped] == ["a Windows path; list the images by paths on this machine (relative to the list)"]


def test_csv_paths_are_relative_to_the_csv(tmp_path: Path) -> None:
    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "imgs" / "one.png")
    listing = tmp_path / "list.csv"
    with listing.open("w", newline="") as handle:
        csv.writer(handle).writerows([["path", "label"], ["imgs/one.png", "printer, laser \"A\""], ["imgs/missing.png", "x"]])
    collection = load_collection(listing)
    assert [(item.path, item.label) for item in collection.items] == [((tmp_path / "imgs" / "one.png").resolve(), 'printer, laser "A"')]
    assert "not found" in collection.skipped[0].reason


def test_an_image_listed_twice_is_kept_once_and_a_second_label_is_named(tmp_path: Path) -> None:
    """A second row with another label was reported as 'listed in the CSV more than once', the conflict unsaid."""
    Image.new("RGB", (8, 8)).save(tmp_path / "one.png")
    listing = tmp_path / "list.csv"
    listing.write_text("path,label\none.png,cat\none.png,cat\none.png,dog\n")
    collection = load_collection(listing)
    assert [item.label for item in collection.items] == ["cat"]
    assert [entry.reason for entry in collection.skipped] == [
        "listed in the CSV more than once (the first row is used)",
        "listed in the CSV again with the label 'dog'; the first row's 'cat' is used",
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("file,class\na.png,x\n", r"no column path \(its header: file,class\); the header must name path,label"),
        ("a.png,x\n", r"its first line is a row \(a.png\), not a header; add the line path,label above it"),
        ("path,class\na.png,x\n", r"no column label beside path \(its other columns: class\); name the labels' column"),
        ("", r"it is empty; its first line must be the header path,label"),
        ("path,label\n", r"lists no images \(no row below its header\)"),
    ],
    ids=["other-names", "no-header", "labels-named-otherwise", "empty", "header-only"],
)
def test_csv_without_the_columns_is_refused_saying_what_its_header_lacks(tmp_path: Path, text: str, message: str) -> None:
    """A header naming the labels otherwise (path,class) loaded every image unlabeled, without a word."""
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    listing = tmp_path / "list.csv"
    listing.write_text(text)
    with pytest.raises(RetrievalError, match=f"list.csv: {message}"):
        load_collection(listing)


@pytest.mark.parametrize(
    "header", ["path,label", "Path,Label", "path, label", " PATH ;  label", "path\tlabel", "path,label,split"]
)
def test_a_spreadsheets_header_and_separator_are_read(tmp_path: Path, header: str) -> None:
    """A header with a space after its comma ("path, label") loaded every image unlabeled, and one with capitals or a
    semicolon (a spreadsheet's CSV where the comma is the decimal mark) was refused: "missing column path"."""
    Image.new("RGB", (8, 8)).save(tmp_path / "one.png")
    separator = ";" if ";" in header else "\t" if "\t" in header else ","
    listing = tmp_path / ("list.tsv" if separator == "\t" else "list.csv")  # a .tsv was refused: "expected ... a .csv file"
    listing.write_text(f"{header}\n" + separator.join(["one.png", " cup", "train"][: header.count(separator) + 1]) + "\n")
    assert [(item.path.name, item.label) for item in load_collection(listing).items] == [("one.png", "cup")]


@pytest.mark.parametrize("name", ["list.csv", "list.txt"])
def test_a_list_saved_by_a_spreadsheet_is_read_and_one_in_another_encoding_is_one_line(tmp_path: Path, name: str) -> None:
    """Excel's "CSV UTF-8" starts with a byte-order mark (the header read as "\\ufeffpath": "missing column path");
    a CSV saved as Latin-1 was a UnicodeDecodeError traceback."""
    Image.new("RGB", (8, 8)).save(tmp_path / "caf\u00e9.png")
    listing = tmp_path / name
    rows = ["path,label", "caf\u00e9.png,cup"] if name.endswith(".csv") else ["caf\u00e9.png"]
    listing.write_bytes("\r\n".join(rows).encode("utf-8-sig"))
    assert [item.path.name for item in load_collection(listing).items] == ["caf\u00e9.png"]
    listing.write_bytes("\r\n".join(rows).encode("latin-1"))
    with pytest.raises(RetrievalError, match=rf"{name}: not UTF-8 text \(byte 0xe9 at offset \d+\); save it as a UTF-8"):
        load_collection(listing)


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_missing_or_empty_source_names_it(tmp_path: Path, make: str) -> None:
    source = tmp_path / "nothing"
    if make == "empty":
        source.mkdir()
    with pytest.raises(RetrievalError, match=str(source)):
        load_collection(source)


def test_embedded_dataset_has_class_disjoint_splits(icons_root: Path) -> None:
    train, test = load_collection(icons_root / "train"), load_collection(icons_root / "test")
    assert (len(train.items), len(train.class_counts())) == (1004, 117)
    assert (len(test.items), len(test.class_counts())) == (494, 59)
    assert not set(train.class_counts()) & set(test.class_counts())
    assert min(test.class_counts().values()) >= 3
    assert not train.skipped and not test.skipped
    assert load_image(train.items[0].path).size == (64, 64)


def test_bad_files_raise_image_errors(tmp_path: Path) -> None:
    for kind, path in write_bad_files(tmp_path).items():
        with pytest.raises(ImageError, match=path.name):
            load_image(path)
    with pytest.raises(ImageError, match="cannot be read"):
        load_image(tmp_path / "absent.png")


def test_decompression_bombs_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.png"
    Image.new("L", (300, 200)).save(path)
    monkeypatch.setattr(data, "MAX_PIXELS", 50_000)
    with pytest.raises(ImageError, match="300x200 pixels is over the limit"):
        load_image(path)


def test_images_pillow_warns_of_are_refused_with_their_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between Pillow's warning (MAX_IMAGE_PIXELS) and its error (twice that), the message names the size; above
    the error, Pillow's limit."""
    path = tmp_path / "big.png"
    Image.new("L", (300, 200)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 40_000)
    monkeypatch.setattr(data, "MAX_PIXELS", 50_000)
    with pytest.raises(ImageError, match="300x200 pixels is over the limit of 50,000"):
        load_image(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 20_000)
    with pytest.raises(ImageError, match="over 40,000 pixels \\(a decompression bomb guard\\); downscale it"):
        load_image(path)


@pytest.mark.parametrize(
    "image",
    [
        Image.new("RGBA", (4, 4), (0, 0, 0, 0)),
        Image.new("LA", (4, 4), (0, 0)),
        Image.new("1", (4, 4), 1),
        Image.new("CMYK", (4, 4), (0, 0, 0, 0)),
        Image.new("I;16", (4, 4), 65535),
        Image.new("F", (4, 4), 1.0),
    ],
    ids=lambda image: image.mode,
)
def test_every_mode_becomes_white_rgb(tmp_path: Path, image: Image.Image) -> None:
    path = tmp_path / "image.tiff"
    image.save(path)
    decoded = load_image(path)
    assert decoded.mode == "RGB"
    assert np.asarray(decoded).min() == 255  # transparent and full-scale pixels become white


def test_palette_transparency_is_composited_over_white() -> None:
    image = Image.new("P", (4, 4), 0)
    image.putpalette([0, 0, 0] * 256)
    image.info["transparency"] = 0
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG", transparency=0)
    assert np.asarray(decode_image(buffer.getvalue())).min() == 255


def test_preprocessing_matches_torchvision(icons_root: Path) -> None:
    from torchvision import transforms

    preprocessing = Preprocessing(image_size=48)
    reference = transforms.Compose(
        [transforms.Resize(48), transforms.CenterCrop(48), transforms.ToTensor(), transforms.Normalize(preprocessing.mean, preprocessing.std)]
    )
    images = [load_image(path) for path in sorted((icons_root / "test").rglob("*.png"))[:4]]
    images += [images[0].resize((90, 61)), images[1].resize((33, 70))]
    ours = preprocessing(images)
    theirs = np.stack([reference(image).numpy() for image in images])
    assert ours.shape == (6, 3, 48, 48) and ours.dtype == np.float32
    assert np.abs(ours - theirs).max() <= 1e-5


def test_resize_and_crop_keeps_the_centre() -> None:
    image = Image.new("RGB", (100, 50), (255, 0, 0))
    image.paste((0, 0, 255), (0, 0, 25, 50))  # a blue band on the left, cropped away
    out = resize_and_crop(image, 20)
    assert out.size == (20, 20)
    assert np.asarray(out)[:, :, 2].max() < 50


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    image = Image.new("RGB", (40, 20), (255, 0, 0))
    exif = image.getexif()
    exif[0x0112] = 6  # stored landscape, shown rotated 90 degrees: portrait
    path = tmp_path / "rotated.jpg"
    image.save(path, exif=exif.tobytes())
    assert load_image(path).size == (20, 40)


def test_normalising_pixels_gives_the_values_of_the_float_formula() -> None:
    """The in-place, channels-first-as-bytes normalisation is bit for bit the plain formula (and so the torch one)."""
    preprocessing = Preprocessing()
    pixels = np.random.default_rng(0).integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)
    plain = (pixels.astype(np.float32) / 255.0 - np.asarray(preprocessing.mean, np.float32)) / np.asarray(preprocessing.std, np.float32)
    ours = preprocessing.normalise_pixels(pixels)
    assert ours.flags["C_CONTIGUOUS"] and ours.dtype == np.float32
    np.testing.assert_array_equal(ours, plain.transpose(0, 3, 1, 2))


def test_a_large_jpeg_is_decoded_at_a_reduced_scale_that_covers_the_input(tmp_path: Path) -> None:
    """min_size: libjpeg's DCT scaling down to the smallest scale with both sides >= min_size, EXIF orientation
    applied after it; a PNG (no DCT) and min_size 0 decode at full size."""
    picture = Image.radial_gradient("L").convert("RGB").resize((520, 300))
    exif = picture.getexif()
    exif[0x0112] = 6  # shown rotated: portrait
    picture.save(tmp_path / "photo.jpg", quality=90, exif=exif.tobytes())
    picture.save(tmp_path / "photo.png")
    jpeg = (tmp_path / "photo.jpg").read_bytes()
    assert data.decode_image(jpeg, "photo.jpg", 64).size == (75, 130)  # 1/4: 130 x 75 before the rotation
    assert data.decode_image(jpeg, "photo.jpg", 100).size == (150, 260)  # 1/2 (1/4 would leave 75 < 100)
    assert data.decode_image(jpeg, "photo.jpg").size == (300, 520)
    assert data.decode_image((tmp_path / "photo.png").read_bytes(), "photo.png", 64).size == (520, 300)
    full = Preprocessing(image_size=64)([data.decode_image(jpeg)])
    drafted = Preprocessing(image_size=64)([data.decode_image(jpeg, "photo.jpg", 64)])
    assert np.abs(full - drafted).mean() < 0.05  # the same picture the encoder sees, within a few grey levels


def test_heic_and_avif_photos_are_listed_and_read(tmp_path: Path) -> None:
    """A phone's HEIC photos and AVIF files were skipped as "not an image file type" (Pillow reads AVIF itself,
    HEIC with pillow-heif, a dependency)."""
    pillow_heif = pytest.importorskip("pillow_heif")
    picture = Image.radial_gradient("L").convert("RGB").resize((300, 200))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    pillow_heif.from_pillow(picture).save(tmp_path / "a" / "IMG_0001.HEIC", quality=90)
    picture.save(tmp_path / "b" / "photo.avif", quality=90)
    collection = load_collection(tmp_path)
    assert [(item.path.name, item.label) for item in collection.items] == [("IMG_0001.HEIC", "a"), ("photo.avif", "b")]
    for item in collection.items:
        image = load_image(item.path)
        assert image.size == (300, 200) and abs(int(np.asarray(image)[100, 150, 0]) - int(np.asarray(picture)[100, 150, 0])) < 16


def test_a_heic_photo_without_pillow_heif_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pillow_heif = pytest.importorskip("pillow_heif")
    pillow_heif.from_pillow(Image.new("RGB", (40, 30), (200, 30, 30))).save(tmp_path / "IMG_0002.heic")
    monkeypatch.setitem(__import__("sys").modules, "pillow_heif", None)  # as where it is not installed
    data._heif_opener.cache_clear()
    try:
        with pytest.raises(ImageError, match=r"IMG_0002.heic: a HEIC/HEIF photo: install pillow-heif to read it \(pip install pillow-heif\)"):
            load_image(tmp_path / "IMG_0002.heic")
    finally:
        data._heif_opener.cache_clear()  # registered again on the next HEIC, with the module back


@pytest.mark.parametrize("layout", ["train/cat/a.png,test/dog/b.png", "Train/a.png", "val/cat/a.png"])
def test_a_folder_of_splits_is_refused_naming_one_to_give(tmp_path: Path, layout: str) -> None:
    """The folder above train/ and test/ loaded every image labeled by its split: 2 classes, train and test."""
    for relative in layout.split(","):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(tmp_path / relative)
    first = layout.split("/")[0]
    with pytest.raises(RetrievalError, match=rf"are splits, not labels .* e\.g\. {tmp_path / first}, whose folders"):
        load_collection(tmp_path)
    assert load_collection(tmp_path / first).items


def test_a_folder_of_query_and_gallery_names_the_options_to_give(tmp_path: Path) -> None:
    for relative in ["query/cat/a.png", "gallery/cat/b.png"]:
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(tmp_path / relative)
    with pytest.raises(RetrievalError, match=rf"--query {tmp_path / 'query'} --gallery {tmp_path / 'gallery'}`\)$"):
        load_collection(tmp_path)


def test_a_class_named_like_a_split_beside_others_is_a_label(tmp_path: Path) -> None:
    for relative in ["test/a.png", "printer/b.png"]:
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8)).save(tmp_path / relative)
    assert sorted(item.label for item in load_collection(tmp_path).items) == ["printer", "test"]


def test_labels_written_alike_but_for_case_or_separators_are_grouped_and_described() -> None:
    from retrieval.data import describe_variants, label_variants

    labels = ["Cat"] * 3 + ["cat", "golden_retriever", "Golden Retriever", "golden-retriever", "dog", "", ""]
    groups = label_variants([Item(Path(f"/{number}.png"), label) for number, label in enumerate(labels)])
    assert groups == [{"Cat": 3, "cat": 1}, {"Golden Retriever": 1, "golden-retriever": 1, "golden_retriever": 1}]
    assert describe_variants(groups) == "'Cat' (3 images) and 'cat' (1); 'Golden Retriever' (1 image) and 'golden-retriever' (1) and 'golden_retriever' (1)"
    assert describe_variants(groups, shown=1).endswith("'cat' (1); and 1 more")
    assert label_variants([Item(Path("/a.png"), "cat"), Item(Path("/b.png"), "dog")]) == []


def test_one_image_given_as_a_collection_names_its_folder(tmp_path: Path) -> None:
    """`retrieval index RUN photo.jpg` said 'expected an image folder, a .csv file ...', as for any other file."""
    (tmp_path / "cats").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "cats" / "a.JPG")
    with pytest.raises(RetrievalError) as refused:
        load_collection(tmp_path / "cats" / "a.JPG")
    assert str(refused.value) == f"{tmp_path / 'cats' / 'a.JPG'}: one image, not a collection; give the folder it is in ({tmp_path / 'cats'}), or a CSV or .txt list of images"


def test_a_files_bytes_are_read_with_their_sha256(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    Image.new("RGB", (8, 8)).save(path)
    read = data.read_image_bytes(path)
    assert read == data.FileBytes(path.read_bytes(), hashlib.sha256(path.read_bytes()).hexdigest())


def test_an_archive_given_as_a_collection_is_refused_with_how_to_unpack_it(tmp_path: Path) -> None:
    """A downloaded dataset given before it was unpacked read 'expected an image folder, a .csv file ...'."""
    for name, advice in [
        ("photos.zip", f"unpack it (`unzip {tmp_path / 'photos.zip'}`)"),
        ("Photos.TAR.GZ", f"unpack it (`tar xzf {tmp_path / 'Photos.TAR.GZ'}`)"),
        ("my photos.7z", "unpack it and give"),
    ]:
        (tmp_path / name).write_bytes(b"PK")
        with pytest.raises(RetrievalError) as refused:
            load_collection(tmp_path / name)
        assert str(refused.value).startswith(f"{tmp_path / name}: an archive (.") and advice in str(refused.value)
    (tmp_path / "notes.pdf").write_bytes(b"%PDF")
    with pytest.raises(RetrievalError, match="notes.pdf: expected an image folder"):
        load_collection(tmp_path / "notes.pdf")


def test_a_quote_left_open_in_a_csv_is_refused_naming_its_line(tmp_path: Path) -> None:
    """A label written "cat took every row after it into one label: 30 of 34 images were lost without a word."""
    for name in ("a", "b", "c", "d"):
        Image.new("RGB", (8, 8)).save(tmp_path / f"{name}.png")
    (tmp_path / "labels.csv").write_text('path,label\na.png,cat\nb.png,"cat\nc.png,dog\nd.png,dog\n')
    with pytest.raises(RetrievalError) as refused:
        load_collection(tmp_path / "labels.csv")
    assert str(refused.value) == f"{tmp_path / 'labels.csv'}, line 3: its label runs over 3 lines ('cat' ...), a quote (\") left open; close it or remove it"
    (tmp_path / "labels.csv").write_text('path,label\na.png,cat\n\n\nb.png,"cat\nc.png,dog\nd.png,dog\n')
    with pytest.raises(RetrievalError, match=", line 5: its label runs over 3 lines"):  # after blank lines: its own
        load_collection(tmp_path / "labels.csv")
    (tmp_path / "labels.csv").write_text('path,label\na.png,cat\n"b.png",cat\nc.png,"d,og"\n')  # quotes closed: read
    assert [item.label for item in load_collection(tmp_path / "labels.csv").items] == ["cat", "cat", "d,og"]


def test_a_csv_path_written_from_the_current_folder_is_named_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """data/labels.csv listing data/images/cat/1.png (from the folder the command ran in) said only "listed in the CSV
    but not found" for /…/data/data/images/cat/1.png."""
    (tmp_path / "data" / "images").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "data" / "images" / "1.png")
    (tmp_path / "data" / "labels.csv").write_text("path,label\ndata/images/1.png,cat\nimages/1.png,cat\n")
    monkeypatch.chdir(tmp_path)
    collection = load_collection(Path("data/labels.csv"))
    assert [item.path for item in collection.items] == [tmp_path / "data" / "images" / "1.png"]
    assert [entry.reason for entry in collection.skipped] == [
        f"listed in the CSV but not found: paths are read relative to the list's folder ({tmp_path / 'data'}), and "
        "data/images/1.png is relative to the current folder; write them relative to the list's folder, or in full"
    ]
