"""The metric set on 100,000 x 128-d clustered embeddings: ours against pytorch-metric-learning's AccuracyCalculator.

Both score the same embeddings leave-one-out, each in a fresh process (time of the call, and peak
resident memory above what the process held before it):

- PML: AccuracyCalculator with precision_at_1, r_precision, mean_average_precision_at_r, NMI and AMI
  (k = max_bin_count, so R-precision and MAP@R are exact), its FaissKNN and its FaissKMeans given our
  k-means settings and seed (so that NMI and AMI can be identical);
- ours, the same metrics: retrieval_metrics without mAP over the full ranking (it also gives recall@k,
  precision@k and the CMC curve, from the same neighbours) and clustering_metrics;
- ours, the full set: the above plus mAP over the full ranking where it is on by default (galleries
  up to 10,000) and alignment, uniformity and tolerance (embedding_diagnostics).

Each case runs --repeats times, the cases interleaved, and the table keeps the fastest run of each
(a shared 2-core machine varies by 20-40% from run to run).

    python bench/metrics.py [--size 100000] [--classes 1000] [--dim 128] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np
from rich.console import Console
from rich.table import Table

SHARED = {"precision@1": "precision_at_1", "r_precision": "r_precision", "map@r": "mean_average_precision_at_r", "nmi": "NMI", "ami": "AMI"}
CASES = {"pml": "PML AccuracyCalculator", "ours": "ours, the same metrics", "ours-full": "ours, the full set"}


def clustered(size: int, classes: int, dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Unit embeddings scattered around one random centre per class (about as separable as a trained model's)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, size)
    centres = rng.standard_normal((classes, dim)).astype(np.float32)
    vectors = centres[labels] + 1.5 * rng.standard_normal((size, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True), labels


def resident_kib(key: str) -> int:
    return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1])


def run_case(case: str, size: int, classes: int, dim: int) -> dict:
    """Scores the embeddings one way in this process; returns seconds, peak MiB and the shared values."""
    vectors, labels = clustered(size, classes, dim)
    if case == "pml":
        import torch
        from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
        from pytorch_metric_learning.utils.inference import FaissKMeans

        from retrieval.metrics import KMEANS_SETTINGS

        calculator = AccuracyCalculator(include=tuple(SHARED.values()), k="max_bin_count", device=torch.device("cpu"), kmeans_func=FaissKMeans(**KMEANS_SETTINGS, seed=0))
        embeddings, targets = torch.from_numpy(vectors), torch.from_numpy(labels)

        def score() -> dict:
            found = calculator.get_accuracy(embeddings, targets)
            return {ours: float(found[theirs]) for ours, theirs in SHARED.items()}

    else:
        import sklearn.metrics  # noqa: F401  imported before the clock starts, as PML's module does

        from retrieval.metrics import clustering_metrics, embedding_diagnostics, retrieval_metrics

        names = [str(label) for label in labels]
        full = case == "ours-full"

        def score() -> dict:
            found = {**retrieval_metrics(vectors, names, full_ranking=None if full else False), **clustering_metrics(vectors, names)}
            if full:
                found.update(embedding_diagnostics(vectors, names))
            return found

    before = resident_kib("VmRSS:")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM to the current resident size
    started = time.perf_counter()
    values = score()
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "peak_mib": (resident_kib("VmHWM:") - before) / 1024, "values": {name: values[name] for name in SHARED}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--classes", type=int, default=1_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)  # one case, in the child process
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.size, args.classes, args.dim)))
        return
    results: dict[str, dict] = {}
    for _ in range(args.repeats):
        for case in CASES:
            command = [sys.executable, __file__, "--case", case, "--size", str(args.size), "--classes", str(args.classes), "--dim", str(args.dim)]
            found = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
            if case not in results or found["seconds"] < results[case]["seconds"]:
                results[case] = found
    import faiss

    reference = results["pml"]
    table = Table(title=f"metrics on {args.size:,} x {args.dim}-d embeddings, {args.classes:,} classes, leave-one-out, {faiss.omp_get_max_threads()} threads, best of {args.repeats}")
    for column in ("", "seconds", "time vs PML", "peak MiB", "memory vs PML", "max |value - PML value|"):
        table.add_column(column, justify="right")
    for case, title in CASES.items():
        found = results[case]
        difference = max(abs(found["values"][name] - reference["values"][name]) for name in SHARED)
        table.add_row(
            title,
            f"{found['seconds']:.1f}",
            f"{found['seconds'] / reference['seconds']:.2f}x",
            f"{found['peak_mib']:.0f}",
            f"{found['peak_mib'] / reference['peak_mib']:.2f}x",
            f"{difference:.1e}",
        )
    Console().print(table)
    values = Table(title="the shared values")
    for column in ("metric", *CASES):
        values.add_column(column, justify="right")
    for name in SHARED:
        values.add_row(name, *(f"{results[case]['values'][name]:.6f}" for case in CASES))
    Console().print(values)


if __name__ == "__main__":
    main()
