"""`retrieval export`: the run's encoder to ONNX, checked against PyTorch."""

from __future__ import annotations

from typing import Annotated

import typer

from retrieval.commands.output import RunArg, console
from retrieval.errors import RetrievalError, one_of
from retrieval.extras import require
from retrieval.runs import RunDir, shell_path

FP16_HELP = "Export in float16 for GPUs (float32 inputs and outputs, normalisations kept in float32)."
WHITEN_HELP = (
    "PCA-whitening fitted on the run's training images and exported in the graph: a covariance shrinkage "
    "in [0, 1] (0: full whitening), or none. Default: the recipe's (docs/recipe.md)."
)
WHITEN_DIM_HELP = "Keep only this many whitened dimensions (the strongest); default: all."
INT8_HELP = (
    "Also write RUN/model.int8.onnx, statically quantised for CPUs and calibrated on the run's training images; "
    "refused (nothing written) if held-out recall@1 drops by more than 0.01 or top-10 overlap is under 0.9."
)
CALIBRATION_HELP = "How --int8 sets activation ranges: minmax, entropy or percentile."


def export(
    run: RunArg,
    fp16: Annotated[bool, typer.Option("--fp16", help=FP16_HELP)] = False,
    whiten: Annotated[str | None, typer.Option(help=WHITEN_HELP, show_default=False)] = None,
    whiten_dim: Annotated[int | None, typer.Option(help=WHITEN_DIM_HELP, show_default=False)] = None,
    int8: Annotated[bool, typer.Option("--int8", help=INT8_HELP)] = False,
    calibration: Annotated[str, typer.Option(help=CALIBRATION_HELP)] = "minmax",
) -> None:
    """Export the run's encoder to RUN/model.onnx and RUN/model.json, checked against PyTorch."""
    RunDir(run).require_checkpoint()  # said before torch is loaded (seconds)
    require("torch", "train")
    from training.exporting import DEFAULT_WHITENING
    from training.exporting import export as run_export
    from training.quantise import DEFAULT_METHOD, METHODS

    if calibration not in METHODS:  # said before the float export (seconds), not after it
        raise RetrievalError(f"--calibration {calibration!r}: {one_of(calibration, METHODS)}")
    if fp16 and int8:  # said before the float export replaces model.onnx, not after it
        raise RetrievalError(
            "--fp16 and --int8: give one; RUN/model.onnx is float16 for GPUs, or float32 with an int8 copy for CPUs"
        )
    if calibration != DEFAULT_METHOD and not int8:
        raise RetrievalError(f"--calibration {calibration} sets how --int8 quantises: add --int8")

    shrinkage = DEFAULT_WHITENING if whiten is None else _shrinkage(whiten)
    parity = run_export(RunDir(run), float16=fp16, whiten=shrinkage, whiten_dim=whiten_dim)
    whitened = "" if shrinkage is None else f", whitened (shrinkage {shrinkage:g})"
    console.print(f"wrote {RunDir(run).model} ({parity.precision}{whitened}; vs PyTorch: {parity.describe()})")
    if int8:
        from training.quantise import export_int8

        report = export_int8(RunDir(run), calibration)
        console.print(f"wrote {RunDir(run).int8_model} (int8, {calibration} calibration; {report.describe()})")
    _stale_index_note(RunDir(run))


def _stale_index_note(run: RunDir) -> None:
    """Says when the run's index holds the vectors of a model exported before: search refuses it until it is rebuilt
    (a fingerprint check), so the user hears it here, where it happened, not at the next search."""
    from index.backends import built_with

    try:
        built = built_with(run.index)
    except RetrievalError:  # a damaged index says so itself where it is opened
        return
    if built and built not in run.fingerprints().values():
        console.print(
            f"note: {run.index} holds the vectors of the model exported before; rebuild it for this one: "
            f"`retrieval index {shell_path(run.root)} IMAGES --rebuild`"
        )


def _shrinkage(text: str) -> float | None:
    """--whiten none -> None; --whiten 0.2 -> 0.2; anything else is refused with what it takes."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise RetrievalError(f"--whiten takes a shrinkage in [0, 1] or none, got {text!r}") from None
