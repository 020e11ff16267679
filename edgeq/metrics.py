"""How far a quantized model's outputs are from the reference's: agreement, MAE, MSE, SQNR, cosine.

numpy only: ``evaluate`` (host), ``convert``'s verification and ``profile --compare``
(device side) all measure with these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class OutputComparison:
    samples: int
    agreement: float  # top-1 agreement
    mae: float
    mse: float
    max_abs_error: float
    sqnr_db: float  # 10 log10(sum ref^2 / sum (ref - q)^2); inf when identical
    cosine: float  # mean cosine similarity per sample


def compare_outputs(reference: np.ndarray, quantized: np.ndarray) -> OutputComparison:
    ref = np.asarray(reference, dtype=np.float64).reshape(len(reference), -1)
    q = np.asarray(quantized, dtype=np.float64).reshape(len(quantized), -1)
    if ref.shape != q.shape:
        raise ValueError(f"output shapes differ: {ref.shape} vs {q.shape}")
    if len(ref) == 0:
        raise ValueError("no samples to compare")
    err = ref - q
    noise = float(np.sum(err**2))
    signal = float(np.sum(ref**2))
    sqnr = math.inf if noise == 0 else (10.0 * math.log10(signal / noise) if signal > 0 else -math.inf)
    norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(q, axis=1)
    cos = np.where(norms > 0, np.sum(ref * q, axis=1) / np.where(norms > 0, norms, 1), 1.0)
    return OutputComparison(
        samples=len(ref),
        agreement=float(np.mean(ref.argmax(1) == q.argmax(1))),
        mae=float(np.mean(np.abs(err))),
        mse=float(np.mean(err**2)),
        max_abs_error=float(np.max(np.abs(err))),
        sqnr_db=float(sqnr),
        cosine=float(np.mean(cos)),
    )
