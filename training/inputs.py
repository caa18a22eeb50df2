"""What a run trains on: the readable images, which of them have labels, and what that makes the run learn from.

Every image is decoded once. Labeled ones (a label folder, a CSV label) feed the supervised loss;
images without a label (files at a folder's root, empty CSV labels, a CSV without a label column, a
.txt list), the images of --self-supervised, and those of the --adapt gallery feed the
self-supervised loss as its pool (each its own class). The mode follows (training.config.MODES):
supervised, self-supervised, partly labeled or adapted. Classes held out for validation
(--val-classes) are left out of both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from retrieval.benchmarks import load_training_data
from retrieval.data import (
    VARIANTS,
    Collection,
    Item,
    Skipped,
    decode_image,
    describe_variants,
    label_variants,
    load_collection,
    none_readable,
    one_level_too_high,
    read_image_bytes,
    split_by_class,
    write_skip_report,
)
from retrieval.errors import ImageError, RetrievalError
from retrieval.progress import progress as progress_bar
from retrieval.progress import say
from retrieval.runs import RunDir, write_json
from retrieval.wording import counted
from training.config import ADAPTED, PARTLY_LABELED, SELF_SUPERVISED, SUPERVISED, TrainConfig
from training.distributed import Ranks, broadcast_object
from training.images import DECODED_SIDES
from training.model import weights_cached
from training.samplers import refuse_batch_shape

PHOTO_SIDE = 256  # a collection whose images' median shorter side is this or more is taken for photos
SIZE_SAMPLE = 64  # images whose size is read for that (their headers only)


@dataclass
class TrainingData:
    """The readable items split into training and validation classes, the self-supervised pool, the files skipped,
    and the run's config resolved for the mode they make."""

    items: list[Item]  # labeled training images: the supervised loss's
    validation: list[Item]
    classes: list[str]
    skipped: list[Skipped]
    config: TrainConfig
    pool: list[Item] = field(default_factory=list)  # the self-supervised loss's images (instance = position)


def readable_items(
    items: Sequence[Item], progress: bool = True, min_size: int = 0
) -> tuple[list[Item], list[Skipped], set[str]]:
    """Splits items into those that decode (at min_size, as training decodes them) and those skipped (with the
    reason); also the sha256 of the readable."""
    good: list[Item] = []
    skipped: list[Skipped] = []
    digests: set[str] = set()
    for item in progress_bar(items, desc="checking images", unit="img", enabled=progress):
        try:
            read = read_image_bytes(item.path)
            decode_image(read.data, item.path, min_size)
        except ImageError as error:
            skipped.append(Skipped(item.path, error.reason))
            continue
        good.append(item)
        digests.add(read.sha256)
    return good, skipped, digests


def prepare_data(config: TrainConfig, progress: bool, ranks: Ranks) -> TrainingData:
    """Checks every image once, decides the mode, and splits off the validation classes; write_inputs records them
    once the trainer is built, so that a run refused before it trains leaves no files."""
    collection = load_training_data(config.data, config.benchmark)
    gallery = _gallery(config.adapt)
    listed = collection.items + [Item(item.path, "") for item in gallery.items]
    # process 0 decodes every image once; the others take its verdict rather than decoding them again
    sides = DECODED_SIDES * config.image_size
    checked = readable_items(listed, progress, sides) if ranks.is_main else None
    readable, skipped, digests = broadcast_object(checked)  # type: ignore[misc]
    skipped = collection.skipped + gallery.skipped + skipped
    if not readable:
        raise none_readable(config.data, skipped)
    seen = {item.path for item in gallery.items}
    own = [item for item in readable if item.path not in seen or item.label]
    shown = [item for item in readable if item.path in seen and not item.label]
    labeled = [item for item in own if item.label]
    mode = config.mode or decide_mode(config, labeled, own, bool(config.adapt))
    config = config.for_mode(mode)
    data = _split(config, labeled, [item for item in own if not item.label], shown, skipped)
    _refuse(config, data, len(digests))
    if ranks.is_main:
        if progress:
            _hint(config, readable)
        _say_variants(data.items + data.validation)
    return data


def write_inputs(run: RunDir, data: TrainingData) -> None:
    """Writes the run's config.json (resolved for the mode) and skipped.json."""
    run.root.mkdir(parents=True, exist_ok=True)
    write_json(run.config, data.config.to_dict(), sealed=True)
    write_skip_report(run.root / "skipped.json", data.skipped)


def decide_mode(config: TrainConfig, labeled: list[Item], own: list[Item], adapting: bool) -> str:
    """What the images and the options make the run learn from."""
    if config.self_supervised or not labeled:
        return SELF_SUPERVISED
    if len(labeled) < len(own):
        return PARTLY_LABELED
    return ADAPTED if adapting else SUPERVISED


def _gallery(adapt: str | None) -> Collection:
    """The --adapt gallery's images (their labels are ignored), or nothing."""
    if adapt is None:
        return Collection(Path("."), [], [])
    try:
        return load_collection(adapt)
    except RetrievalError as error:
        raise RetrievalError(f"--adapt {error}") from None


def _split(
    config: TrainConfig, labeled: list[Item], unlabeled: list[Item], gallery: list[Item], skipped: list[Skipped]
) -> TrainingData:
    """The validation classes split off the labeled images; the rest train, supervised or (without labels) in the
    pool of the self-supervised loss."""
    items, validation = split_by_class(labeled, config.val_classes, config.seed)
    blank = [Item(item.path, "") for item in items]
    if config.mode == SELF_SUPERVISED:
        return TrainingData([], validation, [], skipped, config, blank + unlabeled + gallery)
    pool = (blank + unlabeled if config.mode == PARTLY_LABELED else []) + gallery
    classes = sorted({item.label for item in items})
    return TrainingData(items, validation, classes, skipped, config, pool)


def _refuse(config: TrainConfig, data: TrainingData, distinct: int) -> None:
    """One line for what cannot train: too few classes or images, identical images, too few held-out classes."""
    held = {item.label for item in data.validation}
    total = len(held) + len(data.classes)
    if config.mode != SELF_SUPERVISED and len(data.classes) < 2 and held:
        raise RetrievalError(
            f"--val-classes {config.val_classes} holds out {len(held)} of the {total} classes, "
            f"leaving {len(data.classes)} to train on; training needs at least two: lower it"
        )
    if config.mode != SELF_SUPERVISED:
        refuse_batch_shape(config.batch_size, config.images_per_class)
    if config.mode != SELF_SUPERVISED and len(data.classes) < 2:
        found = f"only class {data.classes[0]!r} is labeled" if data.classes else "no readable labeled image"
        remedy = (
            ": label images of a second class, or train --self-supervised" if data.pool else " (ROOT/<label>/<image>)"
        )
        remedy = one_level_too_high(config.data, set(data.classes)) or remedy
        raise RetrievalError(f"{config.data}: {found}; training needs at least two labeled classes{remedy}")
    if config.mode != SUPERVISED and len(data.pool) < 2:
        raise RetrievalError(
            f"{config.data}: {counted(len(data.pool), 'image')} for the self-supervised loss; it contrasts each image "
            "with the others, so it needs at least two (more: hundreds)"
        )
    if config.mode == SELF_SUPERVISED and distinct < 2:
        raise RetrievalError(
            f"{config.data}: every image has the same content; self-supervised training tells images apart, "
            "so it needs different ones"
        )
    if config.val_classes > 0 and len(held) < 2:
        least = math.ceil(150 / total) / 100  # split_by_class holds out round(total * f): 2 from f = 1.5 / total
        raise RetrievalError(
            f"--val-classes {config.val_classes} holds out fewer than two of the {total} classes; give at least "
            f"{least} (two classes)"
        )


def _say_variants(labeled: list[Item]) -> None:
    """One line where labels differ only in case or separators (Cat and cat): they train as different classes."""
    groups = label_variants(labeled)
    if groups:
        say(
            f"note: {VARIANTS}: {describe_variants(groups)}; write each class's label one way in DATA if they are one "
            "class"
        )


def _hint(config: TrainConfig, items: list[Item]) -> None:
    """One line when the collection looks like photos and the run starts from scratch: --pretrained would help."""
    if config.pretrained or config.stem != "imagenet" or weights_cached(config.backbone):
        return
    sides = []
    for item in items[:: max(1, len(items) // SIZE_SAMPLE)][:SIZE_SAMPLE]:
        try:
            with Image.open(item.path) as image:
                sides.append(min(image.size))
        except OSError:
            continue
    if sides and sorted(sides)[len(sides) // 2] >= PHOTO_SIDE:
        median = sorted(sides)[len(sides) // 2]
        say(
            f"these images are large (median shorter side {median} px), photos perhaps: training from scratch at "
            f"{config.image_size} px suits small images; --pretrained downloads ImageNet weights once and is "
            "usually far better for photos"
        )
