"""`--dtype fit` (the default): float32 where it fits the memory, bfloat16 where it does not."""

from __future__ import annotations

from models.loading import fit_dtype


def test_dtype_fit_chooses_float32_only_when_it_fits():
    assert fit_dtype(3_600_000, 24 * 2 ** 30)[0] == "float32"  # the bundled model
    dtype, reason = fit_dtype(3_750_000_000, 24 * 2 ** 30)  # a 3B VLM on this 24 GB machine: 15 GB in float32
    assert dtype == "bfloat16" and "15.0 GB in float32" in reason
    assert fit_dtype(8_300_000_000, 141 * 10 ** 9)[0] == "float32"  # a 7B VLM on a 141 GB GPU
