"""Sequential Temperature Scaling of a drafter's confidence prediction (docs/dspark.md, "Calibration").

A confidence head predicts c_k, the chance slot k is accepted given the slots before it were, so the
chance a round accepts at least k + 1 drafts is the survival prod_{i <= k} c_i. The DSpark paper
(section 3.2.1), TensorRT-LLM (`dspark_sts.py`, `apply_sts`) and SGLang (`dspark_sts_fit.py`, the
confidence head's `sts_temperatures`) calibrate that survival with one temperature per slot on the
confidence logit, c_k = sigmoid(logit_k / T_k), fitted left to right: T_k is the grid value whose
survival has the least expected calibration error (ECE) against the observed prefix acceptance,
the temperatures of slots 0..k-1 held at their fitted values. Temperature scaling keeps the order
of the predictions; only their magnitudes move. The grid (41 values, log-spaced 0.1..10) and the
ECE (15 equal-width bins, bins weighted by their counts) are SGLang's; ties go to the temperature
closest to 1. The file a fit writes (`calibration_file`) is TensorRT-LLM's format (`sts_temperatures`,
with SGLang's `temperatures` beside it), read by `confidence_sts_path` there and
`--speculative-dspark-confidence-sts-path` in SGLang.

Pure tensor functions: the walk that produces (logits, prefix acceptance) pairs from a cache's
evaluation split is pipeline/train/eval_split.py's `calibrate_split`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

CALIBRATION_FILE = "sts_calibration.json"  # beside config.json in an export
NUM_BINS = 15
EPS_PROB = 1e-8


def default_grid() -> Tensor:
    """SGLang's temperature grid: 41 values log-spaced from 0.1 to 10 (1 among them)."""
    return torch.logspace(math.log10(0.1), math.log10(10.0), steps=41, dtype=torch.float64)


def expected_calibration_error(probs: Tensor, targets: Tensor, *, num_bins: int = NUM_BINS) -> float:
    """Equal-width binned ECE, sum_b (n_b / N) |mean prediction_b - mean target_b|, of probs [N] against
    0/1 targets [N]; nan without samples."""
    probs = probs.reshape(-1).double().clamp(EPS_PROB, 1.0 - EPS_PROB)
    targets = targets.reshape(-1).double()
    if probs.numel() == 0:
        return float("nan")
    bins = (probs * num_bins).long().clamp_(0, num_bins - 1)
    predicted = torch.zeros(num_bins, dtype=torch.float64).scatter_add_(0, bins, probs)
    observed = torch.zeros(num_bins, dtype=torch.float64).scatter_add_(0, bins, targets)
    return float(((predicted - observed).abs()).sum() / probs.numel())


def survival(logits: Tensor, temperatures: list[float] | None = None) -> Tensor:
    """prod_{i <= k} sigmoid(logit_i / T_i) [N, D] of confidence logits [N, D] (T = 1 without temperatures)."""
    logits = logits.double()
    if temperatures is not None:
        logits = logits / torch.tensor(temperatures, dtype=torch.float64)
    return torch.sigmoid(logits).cumprod(dim=1)


def fit_sts(logits: Tensor, prefix_accepted: Tensor, *, grid: Tensor | None = None, num_bins: int = NUM_BINS) -> dict:
    """Per-slot temperatures [D] fitted left to right on logits [N, D] (the head's, uncalibrated) and
    prefix_accepted [N, D] (1 where the round accepted slots 0..k), with the survival's ECE per slot
    before (T = 1) and after."""
    logits, prefix_accepted = logits.double(), prefix_accepted.double()
    if logits.ndim != 2 or logits.shape != prefix_accepted.shape or logits.shape[0] == 0:
        raise ValueError(f"fit_sts needs logits and prefix_accepted of one [N >= 1, D] shape, got {tuple(logits.shape)} and "
                         f"{tuple(prefix_accepted.shape)}")  # fmt: skip
    grid = default_grid() if grid is None else grid.double()
    order = sorted(range(len(grid)), key=lambda i: abs(math.log(float(grid[i]))))  # ties go to the T nearest 1
    before = survival(logits)
    fitted = torch.ones(logits.shape[0], dtype=torch.float64)
    temperatures, ece_before, ece_after = [], [], []
    for k in range(logits.shape[1]):
        target = prefix_accepted[:, k]
        ece_before.append(expected_calibration_error(before[:, k], target, num_bins=num_bins))
        candidates = [(expected_calibration_error(fitted * torch.sigmoid(logits[:, k] / grid[i]), target, num_bins=num_bins), i)
                      for i in order]  # fmt: skip
        best_ece, best = min(candidates, key=lambda c: c[0])  # min keeps the first of equals: the T nearest 1
        temperatures.append(float(grid[best]))
        ece_after.append(best_ece)
        fitted = fitted * torch.sigmoid(logits[:, k] / grid[best])
    return {"temperatures": temperatures, "ece_before": ece_before, "ece_after": ece_after}


def calibration_file(calibration: dict) -> dict:
    """The calibration file's payload: TensorRT-LLM's `DSparkStsCalibration.to_json` keys (SGLang's
    `DSparkStsCalibration` reads `temperatures` and ignores the rest)."""
    return {
        "sts_temperatures": list(calibration["temperatures"]),
        "temperatures": list(calibration["temperatures"]),
        "ece_before": list(calibration["ece_before"]),
        "ece_after": list(calibration["ece_after"]),
        "dataset": calibration["dataset"],
        "num_samples": int(calibration["num_samples"]),
    }
