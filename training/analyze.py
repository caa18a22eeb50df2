"""The temperature sweep of `retrieval analyze`: the uniformity-tolerance dilemma on the user's own data.

Wang & Liu 2021 show that a contrastive loss's temperature trades uniformity (embeddings spread
over the sphere) against tolerance (similar samples kept close): a low temperature spreads
everything apart, including classes that should stay together, and their hard contrastive loss
escapes the trade-off by contrasting only the informative negatives. The sweep trains one short run
per (loss, temperature) and measures both quantities on classes held out of training.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from retrieval.plots import plot_temperature_sweep
from retrieval.progress import progress as progress_bar
from retrieval.progress import say
from retrieval.runs import RunDir, write_json
from training.config import TrainConfig
from training.loop import train

SWEEP_TEMPERATURES = (0.05, 0.1, 0.2, 0.5, 1.0)
SWEEP_LOSSES = ("supcon", "hard")


def temperature_sweep(
    base: TrainConfig,
    out: Path,
    temperatures: Sequence[float] = SWEEP_TEMPERATURES,
    losses: Sequence[str] = SWEEP_LOSSES,
    progress: bool = True,
) -> list[dict]:
    """Trains base once per loss and temperature, writes out/temperature_sweep.{json,png}; returns the rows.

    Each row has the final epoch's validation scores on the held-out classes of base.val_classes:
    recall@1 and MAP@R of the embeddings, and uniformity, tolerance and alignment both of the
    embeddings and (loss_*) of the unit projections the loss sees, the space Wang & Liu analyse.
    The runs stay in out/runs/ for a closer look.
    """
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    runs = [(loss, t) for loss in losses for t in temperatures]
    for loss, temperature in progress_bar(runs, desc="temperature sweep", unit="run", enabled=progress):
        run = RunDir(out / "runs" / f"{loss}-t{temperature:g}")
        train(replace(base, loss=loss, temperature=temperature), run, progress=False, overwrite=True)
        last = json.loads(run.train_log.read_text(encoding="utf-8").splitlines()[-1])
        row = {"loss": loss, "temperature": temperature, "epochs": last["epoch"]}
        row.update({name.removeprefix("val_"): value for name, value in last.items() if name.startswith("val_")})
        rows.append(row)
        if progress:
            say(
                f"{loss:>7} t={temperature:<5g} loss space: uniformity {row['loss_uniformity']:.3f} "
                f"tolerance {row['loss_tolerance']:.3f}  recall@1 {row['recall@1']:.3f}"
            )
    write_json(out / "temperature_sweep.json", {"config": base.to_dict(), "rows": rows})
    plot_temperature_sweep(rows, out / "temperature_sweep.png")
    return rows
