"""`auto` dtypes (pipeline/precision.py): bf16 on CUDA, and on a CPU with bf16 matrix units for the
stages measured faster there (build, train); evaluation stays fp32 on every CPU."""

from __future__ import annotations

import pytest
import torch

from pipeline.cache_build.config import WorkerConfig
from pipeline.precision import CPU_BF16_ENV, auto_bf16, native_bf16_matmul


def test_auto_is_bf16_where_the_cpu_multiplies_bf16_and_the_stage_gains(monkeypatch):
    assert auto_bf16("cuda", stage="eval") and auto_bf16("cuda", stage="train")
    monkeypatch.setenv(CPU_BF16_ENV, "1")  # as on an AMX / AVX512-BF16 CPU
    assert auto_bf16("cpu", stage="build") and auto_bf16("cpu", stage="train")
    assert not auto_bf16("cpu", stage="eval")  # the exact lossless check stays the default
    assert WorkerConfig().device_and_dtype() == ("cpu", torch.bfloat16)
    assert WorkerConfig(target_dtype="float32").device_and_dtype() == ("cpu", torch.float32)
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    assert not auto_bf16("cpu", stage="build") and WorkerConfig().device_and_dtype() == ("cpu", torch.float32)
    monkeypatch.delenv(CPU_BF16_ENV)
    assert auto_bf16("cpu", stage="train") == native_bf16_matmul()
    monkeypatch.setenv(CPU_BF16_ENV, "yes")
    with pytest.raises(ValueError, match=f"^{CPU_BF16_ENV}=yes: expected 0, 1 or unset"):
        auto_bf16("cpu", stage="train")
