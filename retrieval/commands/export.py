"""`retrieval export`: the run's encoder to ONNX, checked against PyTorch."""

from __future__ import annotations

from typing import Annotated

import typer

from retrieval.commands.output import RunArg, console
from retrieval.extras import require
from retrieval.runs import RunDir

FP16_HELP = "Export in float16 for GPUs (float32 inputs and outputs, normalisations kept in float32)."


def export(run: RunArg, fp16: Annotated[bool, typer.Option("--fp16", help=FP16_HELP)] = False) -> None:
    """Export the run's encoder to RUN/model.onnx and RUN/model.json, checked against PyTorch."""
    require("torch", "train")
    from training.exporting import export as run_export

    parity = run_export(RunDir(run), float16=fp16)
    console.print(f"wrote {RunDir(run).model} ({parity.precision}; vs PyTorch: {parity.describe()})")
