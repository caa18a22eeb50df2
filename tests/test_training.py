"""The trainer's parts: backbones, stems, augmentation, schedule, memory queue, options, and a run with the non-default options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from retrieval.commands import main
from retrieval.errors import RetrievalError
from retrieval.runs import RunDir, read_json
from training.config import TrainConfig
from training.memory import MemoryQueue
from training.model import BACKBONES, PROJECTION_DIM, Encoder
from training.loop import train, warmup_cosine


@pytest.mark.parametrize("backbone", [*BACKBONES, "timm:resnet10t"])
def test_every_backbone_gives_unit_embeddings_and_projections(backbone: str) -> None:
    model = Encoder(backbone, embedding_dim=48, image_size=32).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        embeddings, projections = model(images), model.project(images)
    assert embeddings.shape == (2, 48) and projections.shape == (2, PROJECTION_DIM)
    assert torch.allclose(embeddings.norm(dim=1), torch.ones(2), atol=1e-5)


def test_backbone_mistakes_are_explained() -> None:
    with pytest.raises(RetrievalError, match="unknown backbone 'resnet9'"):
        Encoder("resnet9")
    with pytest.raises(RetrievalError, match="unknown backbone 'resnet9'"):  # with the options: before the images are checked
        TrainConfig(data="photos", backbone="resnet9")
    with pytest.raises(RetrievalError, match="timm has no model 'no_such_net'"):
        Encoder("timm:no_such_net")
    with pytest.raises(RetrievalError, match="multiple of 16"):
        Encoder("vit_b_16", image_size=40)
    with pytest.raises(RetrievalError, match="224-pixel images"):
        Encoder("vit_b_16", pretrained=True, image_size=64)  # refused before any download


def test_the_small_stem_keeps_four_times_the_feature_map_and_is_explained_where_it_cannot_apply() -> None:
    model = Encoder("resnet18", image_size=64, stem="small").eval()
    conv = model.backbone.conv1
    assert (conv.kernel_size, conv.stride) == ((3, 3), (1, 1))
    trunk = torch.nn.Sequential(*list(model.backbone.children())[:-2])  # up to layer4, before pooling
    assert trunk(torch.randn(1, 3, 64, 64)).shape[-2:] == (4, 4)
    assert Encoder("resnet18", image_size=64).backbone.conv1.stride == (2, 2)
    with pytest.raises(RetrievalError, match="for the resnet backbones"):
        Encoder("mobilenet_v3_small", stem="small")
    with pytest.raises(RetrievalError, match="cannot start from pretrained weights"):
        Encoder("resnet18", pretrained=True, stem="small")  # refused before any download


def test_every_augmentation_step_makes_the_declared_tensor() -> None:
    from PIL import Image

    from retrieval.preprocess import Preprocessing
    from training.augment import AUGMENTATIONS, make_augmentation

    image = Image.new("RGB", (50, 70), (200, 40, 40))
    preprocessing = Preprocessing(32)
    every = ",".join(step for step in AUGMENTATIONS if step != "strongcrop")  # one crop at a time
    for step in (*AUGMENTATIONS, "none", every):
        view = make_augmentation(step, preprocessing)(image)
        assert view.dtype == torch.float32 and view.shape == (3, 32, 32), step
    plain = make_augmentation("none", preprocessing)(image)
    assert torch.equal(plain, torch.from_numpy(preprocessing([image])[0]))  # no step: the evaluation transform
    with pytest.raises(RetrievalError, match="unknown step 'flip'"):
        TrainConfig(data=".", augment="crop,flip")
    with pytest.raises(RetrievalError, match="names a step twice"):
        TrainConfig(data=".", augment="crop,crop")
    with pytest.raises(RetrievalError, match="take crop or strongcrop, not both"):
        TrainConfig(data=".", ssl_augment="crop,strongcrop")
    with pytest.raises(RetrievalError, match="--stem must be one of"):
        TrainConfig(data=".", stem="tiny")
    assert TrainConfig(data=".").augment == "crop,color"


def test_warmup_then_cosine_to_zero() -> None:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule = warmup_cosine(optimizer, total_steps=100, warmup=0.1)
    rates = []
    for _ in range(100):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)  # linear over 10 steps
    assert rates[10] == pytest.approx(1.0) and rates[55] == pytest.approx(0.5, abs=0.01)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:])) and rates[-1] < 1e-3


def test_memory_queue_is_first_in_first_out_and_follows_the_encoder() -> None:
    model = Encoder("resnet18", image_size=32)
    queue = MemoryQueue(model, size=5, momentum=0.9)
    assert len(queue.contents()[0]) == 0
    queue.push(torch.full((3, PROJECTION_DIM), 1.0), torch.tensor([1, 2, 3]))
    queue.push(torch.full((4, PROJECTION_DIM), 2.0), torch.tensor([4, 5, 6, 7]))
    keys, labels = queue.contents()
    assert sorted(labels.tolist()) == [3, 4, 5, 6, 7] and keys.shape == (5, PROJECTION_DIM)  # 1 and 2 were the oldest
    query = next(model.parameters())
    before = next(queue.encoder.parameters()).clone()
    with torch.no_grad():
        query.add_(1.0)
    queue.follow(model)
    assert torch.allclose(next(queue.encoder.parameters()), 0.9 * before + 0.1 * query)
    assert not any(p.requires_grad for p in queue.encoder.parameters())


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"loss": "npair", "queue_size": 64}, "works with the supcon and infonce losses"),
        ({"precision": "fp8"}, "--precision must be one of"),
        ({"optimizer": "lamb"}, "--optimizer must be one of"),
        ({"warmup": 1.5}, "--warmup is a fraction"),
        ({"momentum": 1.0}, "--momentum must be in"),
        ({"learning_rate": -1.0}, "--learning-rate must be positive, got -1.0"),
        ({"learning_rate": 0.0}, "--learning-rate must be positive, got 0.0"),
        ({"temperature": float("inf")}, "--temperature must be a finite number, got inf"),  # trained at a constant loss
        ({"learning_rate": float("nan")}, "--learning-rate must be a finite number, got nan"),
        ({"ssl_temperature": float("inf")}, "--ssl-temperature must be a finite number, got inf"),
        ({"weight_decay": -1.0}, "--weight-decay must not be negative, got -1.0"),
        ({"workers": -1}, "--workers must not be negative, got -1"),
        ({"seed": -1}, "--seed must not be negative, got -1"),
        ({"patience": -1}, "--patience must not be negative, got -1"),
        ({"patience": 3}, "--patience 3 stops when the held-out classes' MAP@R stops improving: give --val-classes too"),  # was ignored
        ({"proximal": -0.5}, "--proximal must not be negative, got -0.5"),
        ({"val_classes": 1.5}, r"--val-classes is a fraction of the classes in \[0, 1\), got 1.5"),
        ({"image_size": 100000}, "--image-size must be from 32 to 1024 pixels"),
        ({"loss": "arcface"}, "--loss: unknown loss 'arcface'; choose one of hard, hcl, infonce, instdisc, moco, npair, simclr, supcon$"),
        ({"ssl_loss": "foo"}, "--ssl-loss: unknown loss 'foo'; choose one of hard, hcl, instdisc, joint, moco, simclr$"),
    ],
)
def test_bad_training_options_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(RetrievalError, match=message):
        TrainConfig(data="d", **changes)


def test_sgd_clipping_bf16_queue_and_tensorboard(small_folder: Path, tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    options = ["--epochs", "2", "--batch-size", "8", "--image-size", "32", "--optimizer", "sgd", "--learning-rate", "0.05"]
    options += ["--clip-grad", "1.0", "--precision", "bf16", "--queue-size", "32", "--warmup", "0.2", "--tensorboard", "--loss", "infonce"]
    options += ["--stem", "small", "--augment", "crop,hue,grayscale,invert,blur,affine,erase"]
    assert main(["train", str(small_folder), "--run", str(run.root), *options]) == 0
    config = json.loads(run.config.read_text())
    assert (config["optimizer"], config["precision"], config["queue_size"], config["clip_grad"]) == ("sgd", "bf16", 32, 1.0)
    assert (config["stem"], config["augment"]) == ("small", "crop,hue,grayscale,invert,blur,affine,erase")
    assert main(["export", str(run.root)]) == 0  # the small stem is rebuilt from config.json and exported
    log = [json.loads(line) for line in run.train_log.read_text().splitlines()]
    assert len(log) == 2 and all(entry["images_per_second"] > 0 and entry["loss"] == entry["loss"] for entry in log)
    assert list((run.root / "tensorboard").glob("events.out.tfevents.*"))


def test_validation_logs_the_embedding_diagnostics(icons_root: Path, tmp_path: Path) -> None:
    from tests.conftest import copy_classes

    data = copy_classes(icons_root, tmp_path / "data", 6)
    run = RunDir(tmp_path / "run")
    assert main(["train", str(data), "--run", str(run.root), "--epochs", "1", "--batch-size", "8", "--image-size", "32", "--val-classes", "0.34"]) == 0
    entry = json.loads(run.train_log.read_text().splitlines()[0])
    assert {"val_recall@1", "val_map@r", "val_alignment", "val_uniformity", "val_tolerance"} <= entry.keys()
    assert -1 <= entry["val_tolerance"] <= 1 and entry["val_uniformity"] <= 0


def test_trainer_state_from_another_process_count_or_damaged_is_refused(small_folder: Path, tmp_path: Path) -> None:
    from training.distributed import Ranks
    from training.checkpoints import TrainerState
    from training.loop import make_optimizer

    run = RunDir(tmp_path / "run")
    assert main(["train", str(small_folder), "--run", str(run.root), "--epochs", "1", "--batch-size", "8", "--image-size", "32"]) == 0
    config = TrainConfig.from_dict(read_json(run.config))
    model = Encoder(config.backbone, image_size=config.image_size)
    optimizer = make_optimizer(config, model)
    schedule = warmup_cosine(optimizer, 10, 0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with pytest.raises(RetrievalError, match="saved by 1 training processes; resume it with as many, not 2"):
        TrainerState(run.trainer_state, model, optimizer, schedule, scaler, None, Ranks(0, 2, 0)).load()
    assert TrainerState(run.trainer_state, model, optimizer, schedule, scaler, None, Ranks()).load().epoch == 1
    run.trainer_state.write_bytes(run.trainer_state.read_bytes()[:5000])
    with pytest.raises(RetrievalError, match=r"trainer\.safetensors: .*damaged"):
        TrainerState(run.trainer_state, model, optimizer, schedule, scaler, None, Ranks()).load()


def test_compiled_and_fp16_training_write_plain_checkpoints(small_folder: Path, tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    """fp16's first steps, which its loss scaler skips, also printed PyTorch's warning that the schedule stepped first."""
    from training.checkpoints import load_encoder

    for name, flags in (("compiled", ["--compile"]), ("fp16", ["--precision", "fp16"])):
        run = RunDir(tmp_path / name)
        assert main(["train", str(small_folder), "--run", str(run.root), "--epochs", "1", "--batch-size", "8", "--image-size", "32", *flags]) == 0
        model, _ = load_encoder(run)  # no torch.compile prefix in the weights' names
        assert torch.isfinite(model(torch.randn(2, 3, 32, 32))).all()
    assert not [warning for warning in recwarn if "lr_scheduler.step()" in str(warning.message)]


def test_pretrained_weights_offline_fail_with_a_clear_message(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import urllib.error

    import timm.models._builder
    import torchvision.models._api

    def offline(*args: object, **kwargs: object) -> None:
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # no cached weights
    monkeypatch.setattr(torchvision.models._api, "load_state_dict_from_url", offline)
    with pytest.raises(RetrievalError, match="cannot load pretrained weights for resnet18 .*check the network or train without --pretrained"):
        Encoder("resnet18", pretrained=True)
    monkeypatch.setattr(timm.models._builder, "load_pretrained", offline)
    with pytest.raises(RetrievalError, match="cannot build timm model 'resnet10t'.*check the network"):
        Encoder("timm:resnet10t", pretrained=True)


def test_a_large_jpeg_is_decoded_for_training_at_the_reduced_scale_its_crops_still_fill(tmp_path: Path) -> None:
    """Training decoded every photo at full size each epoch: 12-megapixel JPEGs trained at 10 images/s on 2 cores
    (60 at the reduced scale). Both sides stay at least DECODED_SIDES input sizes; other formats are whole."""
    from PIL import Image

    from retrieval.data import Item
    from retrieval.preprocess import Preprocessing
    from training.images import DECODED_SIDES, AugmentedImages, decoded

    picture = Image.radial_gradient("L").convert("RGB").resize((2048, 1536))
    picture.save(tmp_path / "photo.jpg", quality=90)
    picture.save(tmp_path / "photo.png")
    preprocessing = Preprocessing(image_size=64)
    photo = decoded(Item(tmp_path / "photo.jpg", "a"), preprocessing)
    assert photo.size == (512, 384) and min(photo.size) >= DECODED_SIDES * 64  # 1/4: at 1/8 a side would be 192
    assert decoded(Item(tmp_path / "photo.png", "a"), preprocessing).size == (2048, 1536)
    views = AugmentedImages([Item(tmp_path / "photo.jpg", "a")], ["a"], preprocessing, "crop")
    assert tuple(views[0][0].shape) == (3, 64, 64)


def test_the_check_before_training_decodes_as_training_does_and_still_skips_a_truncated_jpeg(tmp_path: Path) -> None:
    """The check decoded every photo at full size once more before the first epoch (60 photos: 2.9 s, now 0.6 s)."""
    from PIL import Image

    from retrieval.data import Item
    from training.inputs import readable_items

    Image.radial_gradient("L").convert("RGB").resize((2048, 1536)).save(tmp_path / "whole.jpg", quality=90)
    data = (tmp_path / "whole.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 2])
    items = [Item(tmp_path / "whole.jpg", "a"), Item(tmp_path / "cut.jpg", "a")]
    good, skipped, _ = readable_items(items, progress=False, min_size=256)
    assert good == items[:1] and [entry.path for entry in skipped] == [tmp_path / "cut.jpg"]
    assert "truncated" in skipped[0].reason


def test_a_second_trainer_of_a_run_that_is_training_is_one_line(small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A --resume (or a second `make demo`) while the run trained went on beside it: every epoch logged twice."""
    from training.loop import training_lock

    run = RunDir(tmp_path / "run")
    argv = ["train", str(small_folder), "--run", str(run.root), "--epochs", "1", "--batch-size", "8", "--image-size", "32"]
    with training_lock(run):  # another process's, as flock sees it: a lock of another open file
        assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"error: {run.root}: another process is training this run; wait for it to end, or stop it (Ctrl+C there) "
        f"and continue with `retrieval train --run {run.root} --resume`\n"
    )
    assert not run.root.exists()  # refused before anything was written
    assert main(argv) == 0 and len(run.train_log.read_text().splitlines()) == 1


def test_a_lock_file_that_cannot_be_made_is_one_line_naming_it(tmp_path: Path) -> None:
    from retrieval.runs import folder_lock

    (tmp_path / "a-file").write_text("")
    with pytest.raises(RetrievalError, match=r"--run .*/a-file/run: its lock file .*/a-file/\.run\.lock cannot be made \(.*\); give a folder inside one you can write in"):
        with folder_lock(tmp_path / "a-file" / "run", "--run", "busy"):
            pass


def test_the_lock_of_a_folder_given_as_dot_lies_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`retrieval train --run .` (in the run's folder) ended in pathlib's "PosixPath('.') has an empty name"."""
    from retrieval.runs import folder_lock

    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    with folder_lock(Path("."), "--run", "busy"):
        assert (tmp_path / ".run.lock").is_file()
    with pytest.raises(RetrievalError, match="--run /: the file system's root; give a folder inside it"):
        with folder_lock(Path("/"), "--run", "busy"):
            pass


@pytest.mark.parametrize(
    ("batch_size", "images_per_class", "message"),
    [(1, 4, "--batch-size 1: give at least 8, two classes of --images-per-class 4"), (8, 1, "--images-per-class 1: give at least 2")],
)
def test_batches_too_small_for_two_classes_name_the_option(batch_size: int, images_per_class: int, message: str) -> None:
    """They said "batch size 1 must hold at least two classes of 4 images", without the option to change."""
    from training.samplers import ClassBalancedBatchSampler

    with pytest.raises(RetrievalError, match=message):
        ClassBalancedBatchSampler(["a"] * 4 + ["b"] * 4, batch_size, images_per_class)


def test_labels_that_differ_only_in_case_are_named_before_training(small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Cat and cat in a CSV trained as two classes without a word."""
    from training.distributed import Ranks
    from training.inputs import prepare_data

    first = sorted(small_folder.iterdir())[0].name
    rows = ["path,label"]
    for image in sorted(small_folder.glob("*/*")):
        upper = image.parent.name == first and len(rows) < 3  # the first two images of the first class
        rows.append(f"{image},{first.upper() if upper else image.parent.name}")
    (tmp_path / "labels.csv").write_text("\n".join(rows) + "\n")
    config = TrainConfig(data=str(tmp_path / "labels.csv"), val_classes=0)
    data = prepare_data(config, progress=False, ranks=Ranks())
    assert {first, first.upper()} <= set(data.classes)
    out = " ".join(capsys.readouterr().out.split())
    count = len(list((small_folder / first).iterdir())) - 2
    assert f"note: labels written alike but for case, spaces, - or _ are different classes: '{first}' ({count} images) and '{first.upper()}' (2)" in out
    prepare_data(TrainConfig(data=str(small_folder), val_classes=0), progress=False, ranks=Ranks())
    assert "note:" not in capsys.readouterr().out


def test_out_of_memory_while_training_is_one_line_naming_the_options_that_shrink_it(small_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`train --embedding-dim 100000` ended in torch's 'DefaultCPUAllocator: can't allocate memory' traceback."""
    import training.loop

    def fails(*_: object) -> None:  # where the training starts: the demo, analyze and --folds train through it too
        raise RuntimeError(f"[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate {40 * 2**30} bytes. Error code 12")

    monkeypatch.setattr(training.loop, "prepare_data", fails)
    assert main(["train", str(small_folder), "--run", str(tmp_path / "run"), "--embedding-dim", "100000"]) == 2
    err = capsys.readouterr().err
    assert err == "error: out of memory while training (it asked for 40.0 GiB); lower --batch-size (128), --image-size (64) or --embedding-dim (100000); what the run saved before is kept\n"

    def other(*_: object) -> None:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(training.loop, "prepare_data", other)
    with pytest.raises(RuntimeError, match="a bug of ours"):  # anything else is not dressed up as memory
        main(["train", str(small_folder), "--run", str(tmp_path / "run2")])


def test_a_config_refuses_values_of_the_wrong_type_and_takes_paths(small_folder: Path) -> None:
    """TrainConfig(data=Path(...)) failed in writing config.json (a Path is not JSON); epochs="5" (a script's argv)
    failed deep in training with "'<' not supported between instances of 'str' and 'int'"."""
    config = TrainConfig(data=small_folder, adapt=small_folder, epochs=1)
    assert config.data == config.adapt == str(small_folder)
    json.dumps(config.to_dict())
    for field, value, wanted in [("epochs", "5", "a whole number"), ("epochs", 1.5, "a whole number"), ("epochs", True, "a whole number"), ("temperature", "0.1", "a number"), ("pretrained", 1, "True or False"), ("backbone", 18, "text")]:
        with pytest.raises(RetrievalError, match=f"TrainConfig {field}: give {wanted}, got {value!r}"):
            TrainConfig(data=str(small_folder), **{field: value})
    assert TrainConfig(data=str(small_folder), temperature=1, ema=0).temperature == 1  # a whole number is a number
    named = TrainConfig(data=str(small_folder), loss="SupCon", ssl_loss="SimCLR")  # as the papers write them
    assert (named.loss, named.ssl_loss) == ("supcon", "simclr")
    with pytest.raises(RetrievalError, match=r"^config: a TrainConfig, not a dict; write TrainConfig\(data=\.\.\., "):
        train({"data": str(small_folder)}, RunDir(small_folder.parent / "dict-run"))  # type: ignore[arg-type]
