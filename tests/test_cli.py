"""The command line: --help everywhere, the stages on a user's folder, and every bad input of the foundation."""

from __future__ import annotations

import json
import os
import re
import tokenize
from pathlib import Path

import pytest
from PIL import Image

from retrieval.commands import main
from retrieval.errors import RetrievalError
from retrieval.runs import RunDir
from tests.conftest import write_bad_files

COMMANDS = ["train", "export", "index", "search", "evaluate", "serve", "demo"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, "--help"]) == 0
    assert "Usage" in capsys.readouterr().out


def test_the_help_names_only_the_arguments_its_command_takes() -> None:
    """evaluate's --benchmark said "Read DATA as ...", where evaluate's images are IMAGES (train's help, shared): a
    placeholder in a command's help is one of its own arguments (or RUN where it takes --run)."""
    import typer.main

    from retrieval.commands import app

    placeholders = {"DATA", "IMAGES", "IMAGE", "RUN", "INDEX_DIR", "OTHER"}
    for name, command in typer.main.get_command(app).commands.items():
        own = {param.name.upper() for param in command.params if param.param_type_name == "argument"}
        own |= {"RUN"} if any("--run" in param.opts for param in command.params) else set()
        own |= {"OTHER"} if any("--against" in param.opts for param in command.params) else set()
        for text in [command.help, *(getattr(param, "help", None) for param in command.params)]:
            said = re.sub(r"`[^`]*`", "", text or "")  # a command quoted whole is another's
            assert not (set(re.findall(r"\b[A-Z_]{3,}\b", said)) & placeholders) - own, (name, said)


def test_top_level_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(command in out for command in COMMANDS)


def test_train_help_names_every_kind_of_data_it_reads(capsys: pytest.CaptureFixture[str]) -> None:
    """`retrieval train --help` named a labeled folder and a CSV only, where train reads a .txt list and unlabeled images too."""
    assert main(["train", "--help"]) == 0
    help_text = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "a .txt list of paths" in help_text and "train without labels" in help_text, help_text


def test_help_as_a_word_shows_the_help_asked_for(capsys: pytest.CaptureFixture[str]) -> None:
    """`retrieval help` and `retrieval help search` said "No such command 'help'"."""
    assert main(["help"]) == 0
    out = capsys.readouterr().out
    assert "Usage: retrieval [OPTIONS] COMMAND" in out and all(command in out for command in COMMANDS)
    assert main(["help", "search"]) == 0
    assert "Usage: retrieval search [OPTIONS]" in capsys.readouterr().out
    assert main(["help", "serach"]) == 2
    assert "No such command 'serach'. Did you mean 'search'?" in capsys.readouterr().err


def test_counts_are_worded_in_the_singular_for_one_and_never_as_s_in_brackets() -> None:
    """Messages said "1 epoch(s) trained", "311 suspected wrong label(s)", "3 labeled class(es)": counted words them as a
    reader would."""
    from retrieval.wording import counted

    assert [counted(n, "image") for n in (0, 1, 2, 12_345)] == ["0 images", "1 image", "2 images", "12,345 images"]
    assert (counted(1, "batch", "batches"), counted(3, "batch", "batches")) == ("1 batch", "3 batches")
    sources = Path(__file__).resolve().parents[1]
    bracketed = []
    for folder in ("app", "index", "retrieval", "training"):
        for path in (sources / folder).rglob("*.py"):
            with path.open("rb") as source:
                strings = [token.string for token in tokenize.tokenize(source.readline) if token.type == tokenize.STRING]
            bracketed += [f"{path.name}: {text}" for text in strings if re.search(r"[a-z]\((?:s|es|ies)\)", text) and not text.startswith('"""')]
    assert bracketed == []


@pytest.mark.parametrize("flushed", ["at exit", "by the command"])
def test_output_whose_reader_stopped_ends_quietly_not_with_pythons_broken_pipe_message(flushed: str) -> None:
    """`retrieval audit ... --json | head` printed "Exception ignored in: <_io.TextIOWrapper name='<stdout>'> ...
    BrokenPipeError" (status 120) when head had gone before the last of the output was flushed at exit, and a write
    that met the closed pipe outside click said "error: Broken pipe; check the path and its permissions" (status 2).
    Both now end with status 1 and nothing on stderr, as click ends the writes it meets the closed pipe in."""
    import subprocess
    import sys

    read, write = os.pipe()
    driver = (
        "import os, sys\n"
        "import retrieval.commands as commands\n"
        "def command(**_):\n"
        "    sys.stdout.write('{\"hits\": []}' * 10)  # buffered: not written yet\n"
        "    sys.stderr.write('written\\n'); sys.stderr.flush()\n"
        "    os.read(0, 3)  # until the reader has stopped\n"
        f"    {'sys.stdout.flush()' if flushed == 'by the command' else 'pass'}\n"
        "    return 0\n"
        "commands.app = command\n"
        "sys.exit(commands.main([]))\n"
    )
    buffered = {name: value for name, value in os.environ.items() if name != "PYTHONUNBUFFERED"}
    process = subprocess.Popen([sys.executable, "-c", driver], stdin=subprocess.PIPE, stdout=write, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1], env=buffered)
    os.close(write)
    assert process.stderr.readline() == "written\n"
    os.close(read)  # the reader stops
    err = process.communicate("go\n", timeout=120)[1]
    assert (process.returncode, err) == (1, "")


def test_a_command_ends_without_the_interpreters_last_collection() -> None:
    """The objects still alive at exit are frozen, so that the last collection does not walk them (0.1-2 s of a
    command's end with PyTorch and Gradio loaded, bench/exit.py): after the exit handlers registered once the command
    runs (they run first), and registered once however often main runs."""
    import subprocess
    import sys

    driver = (
        "import atexit, gc\n"
        "freeze = gc.freeze\n"
        "def counted():\n"
        "    print('frozen'); freeze()\n"
        "gc.freeze = counted\n"
        "atexit.register(lambda: print('at exit:', gc.get_freeze_count() > 0))  # registered first: runs last\n"
        "from retrieval.commands import main\n"
        "main(['--version']); main(['--version'])\n"
        "atexit.register(lambda: print('a handler registered since'))\n"
    )
    done = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=120, check=True)
    lines = [line for line in done.stdout.splitlines() if not line.startswith("retrieval ")]
    assert lines == ["a handler registered since", "frozen", "at exit: True"], done.stdout + done.stderr


def test_stages_on_a_users_folder_with_bad_files(small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = write_bad_files(small_folder / sorted(p.name for p in small_folder.iterdir())[0])
    run = RunDir(tmp_path / "run")
    assert main(["train", str(small_folder), "--run", str(run.root), "--epochs", "1", "--batch-size", "8", "--image-size", "32"]) == 0
    report = {Path(entry["path"]).name: entry["reason"] for entry in json.loads((run.root / "skipped.json").read_text())}
    assert set(report) == {path.name for path in bad.values()}
    assert "skipped 3 files" in capsys.readouterr().err

    assert main(["export", str(run.root)]) == 0
    assert main(["index", str(run.root), str(small_folder)]) == 0
    index_report = json.loads((run.index / "skipped.json").read_text())
    assert {Path(entry["path"]).name for entry in index_report} == {path.name for path in bad.values()}
    manifest = json.loads((run.index / "manifest.json").read_text())
    good = [p for p in small_folder.rglob("*.png") if p.name not in {path.name for path in bad.values()}]
    assert manifest["count"] == len(good)

    capsys.readouterr()
    assert main(["search", str(run.root), str(good[0]), "-k", "3"]) == 0
    out = capsys.readouterr().out
    assert "similarity" in out and good[0].parent.name in out

    assert main(["evaluate", str(run.root), str(small_folder), "-k", "1,2"]) == 0
    metrics = json.loads(run.metrics.read_text())
    for key in ("recall@1", "recall@2", "map@r", "r_precision", "num_queries", "protocol", "alignment", "uniformity", "tolerance"):
        assert key in metrics
    assert metrics["protocol"] == "leave-one-out" and metrics["num_queries"] == len(good)


def expect_error(argv: list[str], capsys: pytest.CaptureFixture[str], *fragments: str) -> None:
    assert main(argv) == 2
    err = re.split(r"[\r\n]+", capsys.readouterr().err.strip())[-1]  # the last line, after any progress bar
    assert err.startswith("error: ") and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err.replace("\n", "")


def test_train_on_missing_empty_and_one_class_folders(tmp_path: Path, small_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(["train", str(tmp_path / "nope"), "--run", str(tmp_path / "r")], capsys, "nope", "no such file or folder")
    (tmp_path / "empty").mkdir()
    expect_error(["train", str(tmp_path / "empty"), "--run", str(tmp_path / "r")], capsys, "empty", "no images found")
    # what to give names the .txt list too, as every other refusal of a collection does (it named a folder and a CSV)
    expect_error(["train", str(tmp_path / "empty"), "--run", str(tmp_path / "r")], capsys, "; give an image folder ROOT/<label>/<image>, a CSV with columns path,label or a .txt list of paths")
    expect_error(["train", "--run", str(tmp_path / "r")], capsys, "give DATA: an image folder ROOT/<label>/<image>, a CSV with columns path,label or a .txt list of paths (or --resume a run)")
    (tmp_path / "stale.csv").write_text("path,label\ngone.png,a\ngone.png,b\n")  # every row names a missing file
    expect_error(["train", str(tmp_path / "stale.csv"), "--run", str(tmp_path / "r")], capsys, "no usable images (2 skipped", "gone.png: listed in the CSV but not found")
    one = tmp_path / "one"
    one.mkdir()
    sorted(small_folder.iterdir())[0].rename(one / "only")
    expect_error(["train", str(one), "--run", str(tmp_path / "r")], capsys, "only class 'only' is labeled; training needs at least two labeled classes (ROOT/<label>/<image>)")
    expect_error(["evaluate", str(tmp_path / "r"), str(one)], capsys, "no such run directory")  # failed trainings leave no run behind
    deep = tmp_path / "deep" / "animals"  # one folder too high: ROOT/<group>/<label>/<image>
    deep.mkdir(parents=True)
    for folder in sorted(small_folder.iterdir())[:2]:
        folder.rename(deep / folder.name)
    said = f"only class 'animals' is labeled; training needs at least two labeled classes; its images are in folders under {deep}: if those are the classes, give {deep}"
    expect_error(["train", str(tmp_path / "deep"), "--run", str(tmp_path / "r")], capsys, said)
    from retrieval.embedders import PixelEmbedder
    from retrieval.evaluation import evaluate_collection

    with pytest.raises(RetrievalError, match=f"evaluation needs at least two labeled classes .*; its images are in folders under {deep}: if those are the classes, give {deep}$"):
        evaluate_collection(PixelEmbedder(8), tmp_path / "deep", progress=False)


@pytest.mark.parametrize("command", ["export", "index", "search", "evaluate", "serve"])
def test_a_run_without_a_model_names_what_to_do(command: str, tmp_path: Path, small_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run folder that is not there is one to train, named so by every command (export spoke of a checkpoint in
    it); an empty one is to be trained first (the others said to export it, and export then said to train); a
    trained one, to be exported."""
    run = tmp_path / "run"
    extra = {"index": [str(small_folder)], "search": [str(next(small_folder.rglob("*.png")))], "evaluate": [str(small_folder)]}.get(command, [])
    expect_error([command, str(run), *extra], capsys, f"{run}: no such run directory; train one with `retrieval train DATA --run {run}`")
    run.mkdir()
    expect_error([command, str(run), *extra], capsys, str(run), f"retrieval train DATA --run {run}")
    if command != "export":
        (run / "checkpoints").mkdir()
        (run / "checkpoints" / "last.safetensors").write_bytes(b"")  # trained: only the exported model is missing
        expect_error([command, str(run), *extra], capsys, str(run), f"run `retrieval export {run}` first")


def test_bad_k_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(["evaluate", str(tmp_path), str(tmp_path), "-k", "1,five"], capsys, "1,five")


@pytest.mark.parametrize("loss", ["infonce", "npair", "hcl", "hard"])
def test_every_loss_trains(loss: str, small_folder: Path, tmp_path: Path) -> None:
    run = RunDir(tmp_path / loss)
    assert main(["train", str(small_folder), "--run", str(run.root), "--loss", loss, "--epochs", "1", "--batch-size", "8", "--image-size", "32"]) == 0
    entry = json.loads(run.train_log.read_text().splitlines()[-1])
    assert entry["loss"] == entry["loss"] and json.loads(run.config.read_text())["loss"] == loss  # a number, not NaN


def test_validation_on_held_out_classes_picks_the_best_epoch(icons_root: Path, tmp_path: Path) -> None:
    from tests.conftest import copy_classes

    data = copy_classes(icons_root, tmp_path / "data", 10)
    run = RunDir(tmp_path / "run")
    argv = ["train", str(data), "--run", str(run.root), "--epochs", "4", "--batch-size", "16", "--image-size", "32", "--val-classes", "0.3", "--patience", "1"]
    assert main(argv) == 0
    log = [json.loads(line) for line in run.train_log.read_text().splitlines()]
    assert all("val_recall@1" in entry and "val_map@r" in entry for entry in log)
    scores = [entry["val_map@r"] for entry in log]
    assert len(log) == 4 or (len(log) >= 2 and scores[-1] <= max(scores[:-1]))  # stopped only after an epoch without improvement
    assert run.best_checkpoint.is_file() and run.require_checkpoint() == run.best_checkpoint
    from safetensors import safe_open

    with safe_open(str(run.best_checkpoint), "pt") as checkpoint:
        assert int(checkpoint.metadata()["epoch"]) == 1 + scores.index(max(scores))


def test_too_few_validation_classes_is_an_error(small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(["train", str(small_folder), "--run", str(tmp_path / "r"), "--val-classes", "0.1"], capsys, "--val-classes 0.1", "fewer than two of the 4 classes; give at least 0.38 (two classes)")
    too_many = ["train", str(small_folder), "--run", str(tmp_path / "r"), "--val-classes", "0.8"]
    expect_error(too_many, capsys, "--val-classes 0.8 holds out 3 of the 4 classes, leaving 1 to train on", "lower it")


def test_batches_too_small_for_two_classes_are_refused_before_the_run_is_written(small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "r"
    expect_error(["train", str(small_folder), "--run", str(run), "--batch-size", "1"], capsys, "--batch-size 1: give at least 8, two classes of --images-per-class 4")
    expect_error(["train", str(small_folder), "--run", str(run), "--images-per-class", "1"], capsys, "--images-per-class 1: give at least 2")
    assert not run.exists()  # no config.json or skipped.json of a run that never trained
    # refused where the model or the loss is built, after the images are read: nothing is written either
    expect_error(["train", str(small_folder), "--run", str(run), "--backbone", "vit_b_16", "--stem", "small"], capsys, "--stem small is for the resnet backbones")
    expect_error(["train", str(small_folder), "--run", str(run), "--self-supervised", "--ssl-loss", "instdisc", "--nce-negatives", "100000"], capsys, "--nce-negatives 100000: the collection has")
    assert not run.exists()


def test_a_refused_overwrite_keeps_the_run_it_would_have_replaced(small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`train --run R --overwrite` with options the model refuses wrote its config.json over R's, and R's checkpoints
    no longer matched it: the run could not be exported."""
    run = RunDir(tmp_path / "r")
    assert main(["train", str(small_folder), "--run", str(run.root), "--epochs", "1", "--batch-size", "8", "--image-size", "32"]) == 0
    before = run.config.read_bytes()
    expect_error(["train", str(small_folder), "--run", str(run.root), "--overwrite", "--backbone", "vit_b_16", "--stem", "small"], capsys, "--stem small is for the resnet backbones")
    assert run.config.read_bytes() == before
    assert main(["export", str(run.root)]) == 0


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["index", "runs/x", ""], "IMAGES"),  # "$GALLERY" unset: it indexed the folder the user stood in
        (["train", "", "--run", "r"], "DATA"),  # it trained on the current folder
        (["evaluate", "", "photos"], "RUN"),
        (["search", "runs/x", "--json", ""], "IMAGES"),  # after a flag, still an argument
        (["audit", "runs/x", "photos", "--csv", ""], "--csv"),  # it wrote the four tables into the current folder
        (["audit", "runs/x", "photos", "--csv="], "--csv"),
        (["search", "runs/x", "q.png", "-k", " "], "-k"),
        (["index", "runs/x", "photos", "--memory", ""], "--memory"),  # the default was used without a word
    ],
)
def test_an_empty_argument_is_refused_naming_it(argv: list[str], named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    expect_error(argv, capsys, f"{named} is empty (a shell variable unset?)")
    assert not list(tmp_path.iterdir())  # refused before anything was read or written


def test_a_run_in_an_index_folder_is_refused(small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`retrieval demo --run runs/demo/index` (and train) replaced the index's skip report and wrote checkpoints
    among its files."""
    index = tmp_path / "run" / "index"
    index.mkdir(parents=True)
    for name, text in (("manifest.json", "{}"), ("items.sqlite", ""), ("skipped.json", "[1]")):
        (index / name).write_text(text)
    said = f"--run {index}: an index's folder (manifest.json, items.sqlite), and training would write among its files"
    expect_error(["train", str(small_folder), "--run", str(index)], capsys, said)
    expect_error(["demo", "--run", str(index), "--no-serve"], capsys, said)
    assert sorted(path.name for path in index.iterdir()) == ["items.sqlite", "manifest.json", "skipped.json"]
    assert (index / "skipped.json").read_text() == "[1]"


def test_a_run_in_another_runs_checkpoints_or_plots_folder_is_refused(small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`retrieval demo --run runs/demo/checkpoints` trained a second run among the first one's checkpoints."""
    run = RunDir(tmp_path / "run")
    run.checkpoints.mkdir(parents=True)
    run.last_checkpoint.write_bytes(b"weights")
    for folder in (run.checkpoints, run.plots):
        said = f"--run {folder}: the {folder.name} folder of the run {run.root}, and training would write among its files"
        expect_error(["train", str(small_folder), "--run", str(folder)], capsys, said)
        expect_error(["demo", "--run", str(folder), "--no-serve"], capsys, said)
    assert [path.name for path in run.checkpoints.iterdir()] == ["last.safetensors"] and not run.plots.exists()


def test_resuming_a_run_that_is_not_there_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A mistyped --run with --resume read "runs/nope/config.json: missing", as if the run were there."""
    expect_error(["train", "--run", str(tmp_path / "nope"), "--resume"], capsys, f"--run {tmp_path / 'nope'}: no such run directory; nothing to resume")
    (tmp_path / "empty").mkdir()
    expect_error(["train", "--run", str(tmp_path / "empty"), "--resume"], capsys, f"{tmp_path / 'empty' / 'config.json'}: missing; nothing to resume")


def test_every_training_option_is_a_config_field_stated_once() -> None:
    """`retrieval train` states each option once (commands.train.OPTIONS), for every TrainConfig field but data and
    mode (resolved from the data):
    a new field needs an option, and nothing else becomes a config key."""
    import typing
    from dataclasses import fields

    from retrieval.commands.train import OPTIONS, train
    from training.config import TrainConfig

    names = [option.name for option in OPTIONS]
    assert len(names) == len(set(names)) and set(names) == {field.name for field in fields(TrainConfig)} - {"data", "mode"}
    hints = typing.get_type_hints(TrainConfig)
    for option in OPTIONS:
        assert option.type in (hints[option.name], *typing.get_args(hints[option.name])), option.name
    import inspect

    parameters = inspect.signature(train).parameters
    assert list(parameters)[:4] == ["data", "run", "resume", "overwrite"] and set(names) <= set(parameters)


@pytest.mark.parametrize("given", [None, "1"])
def test_the_command_line_keeps_numpy_in_small_pages_unless_told(monkeypatch: pytest.MonkeyPatch, given: str | None) -> None:
    """First touches of huge pages cost these VMs 10x those of small ones (docs/benchmarks.md); a value set is kept."""
    from retrieval.commands import main

    if given is None:
        monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    else:
        monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", given)
    assert main(["--version"]) == 0
    assert os.environ["NUMPY_MADVISE_HUGEPAGE"] == (given or "0")


@pytest.mark.parametrize("command", [["serve"], ["export"], ["evaluate", "IMAGES"], ["search", "IMAGE"], ["index", "IMAGES"]])
def test_a_file_given_as_the_run_is_one_line_saying_so(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    """A labels CSV given as RUN said "no such run directory; train one with `retrieval train DATA --run labels.csv`"."""
    labels = tmp_path / "labels.csv"
    labels.write_text("path,label\n")
    (tmp_path / "images" / "cat").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "cat" / "a.png")
    given = {"IMAGE": tmp_path / "images" / "cat" / "a.png", "IMAGES": tmp_path / "images"}
    rest = [str(given.get(word, word)) for word in command[1:]]
    expect_error([command[0], str(labels), *rest], capsys, f"{labels}: a file, not a run directory; give the folder")


def test_a_file_given_as_the_run_to_train_from_python_is_one_line(small_folder: Path, tmp_path: Path) -> None:
    """train(config, "notes.txt") failed in "FileExistsError: [Errno 17] File exists" (the command line said it)."""
    from training import TrainConfig, train

    notes = tmp_path / "mine" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("mine")
    with pytest.raises(RetrievalError, match=f"^--run {re.escape(str(notes))}: a file is there, not a folder; give a folder"):
        train(TrainConfig(data=str(small_folder), epochs=1), notes)
    assert notes.read_text() == "mine" and sorted(path.name for path in notes.parent.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["index-stats", "RUN", "--sample", "0"], "Invalid value for '--sample': Input should be greater than or equal to 1"),
        (["evaluate", "RUN", "IMAGES", "--split-classes", "0.5", "--seed", "-1"], "Invalid value for '--seed': Input should be greater than or equal to 0"),
        (["evaluate", "RUN", "IMAGES", "--split-classes", "1.5"], "--split-classes 1.5: give a fraction of the classes from 0"),
        (["evaluate", "RUN", "IMAGES", "--split-classes", "-0.2"], "--split-classes -0.2: give a fraction of the classes from 0"),
    ],
)
def test_option_values_out_of_range_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    """index-stats --sample 0 ended in ZeroDivisionError, evaluate --seed -1 in numpy's 'expected non-negative integer';
    --split-classes 1.5 did not name the option."""
    from retrieval.commands import main

    assert main([str(tmp_path) if word in ("RUN", "IMAGES") else word for word in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_lr_is_the_learning_rate(small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--lr, as in most training scripts, said "No such option: --lr (Possible options: --layers, --loss, --run)"."""
    from retrieval.commands import main

    assert main(["train", str(small_folder), "--run", str(tmp_path / "run"), "--lr", "-1"]) == 2
    assert capsys.readouterr().err.strip() == "error: --learning-rate must be positive, got -1.0"
    assert not (tmp_path / "run").exists()


def test_a_run_in_the_image_folder_itself_is_refused(small_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`train photos --run photos` wrote checkpoints and plots among the images, and the folder was then read as a run,
    not a collection ("a run directory, not a collection of images")."""
    assert main(["train", str(small_folder), "--run", str(small_folder), "--epochs", "1"]) == 2
    assert capsys.readouterr().err == f"error: --run {small_folder}: the image folder itself ({small_folder}); give the run a folder of its own, e.g. runs/images\n"
    assert not (small_folder / "config.json").exists()


def test_a_config_json_that_is_not_a_runs_is_never_replaced(small_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`retrieval train photos --run .` in a project replaced the project's own config.json."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.json").write_text('{"mine": 1}')
    for extra in ([], ["--overwrite"]):
        assert main(["train", str(small_folder), "--run", str(project), "--epochs", "1", *extra]) == 2
        assert capsys.readouterr().err == f"error: --run {project}: its config.json is not a run's, and training would replace it; give the run a folder of its own, e.g. runs/photos\n"
    assert main(["demo", "--no-serve", "--run", str(project), "--classes", "2", "--epochs", "1"]) == 2  # the demo too
    assert capsys.readouterr().err.startswith(f"error: --run {project}: its config.json is not a run's")
    from training import TrainConfig, train

    with pytest.raises(RetrievalError, match="its config.json is not a run's"):  # and from Python
        train(TrainConfig(data=str(small_folder), epochs=1), project)
    assert (project / "config.json").read_text() == '{"mine": 1}' and sorted(path.name for path in project.iterdir()) == ["config.json"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "DATA", "--run", "RUN", "--loss", "supcom"], "--loss: unknown loss 'supcom'; did you mean 'supcon'? choose one of hard,"),
        (["train", "DATA", "--run", "RUN", "--backbone", "resnet-18"], "unknown backbone 'resnet-18'; did you mean 'resnet18'? choose one of"),
        (["search", "RUN", "IMAGE", "--rerank", "k-reciprocal"], "unknown re-ranker 'k-reciprocal'; did you mean 'kreciprocal'? choose one of none,"),
        (["train", "DATA", "--run", "RUN", "--augment", "crop,colour"], "--augment: unknown step 'colour'; did you mean 'color'? choose one of crop,"),
        (["train", "DATA", "--run", "RUN", "--ssl-augment", "strongcrop,jiter"], "--ssl-augment: unknown step 'jiter'; did you mean 'jitter'?"),  # was --augment
        (["train", "DATA", "--run", "RUN", "--loss", "arcface"], "--loss: unknown loss 'arcface'; choose one of hard,"),  # nothing like it: no guess
    ],
)
def test_a_misspelt_name_gets_the_one_it_looks_like(small_folder: Path, tmp_path: Path, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    """--loss supcom listed the eight losses and left the user to spot the one meant."""
    from retrieval.commands import main

    run = request.getfixturevalue("demo_run").root if argv[0] == "search" else tmp_path / "run"  # search reads it first
    capsys.readouterr()  # what making the demo run printed
    given = {"RUN": str(run), "DATA": str(small_folder), "IMAGE": str(next(small_folder.rglob("*.png")))}
    assert main([given.get(word, word) for word in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
