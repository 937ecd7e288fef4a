"""The FSDP backend's dtypes: ``auto`` resolves to fp32 master weights, bf16 compute and fp32
gradient reduction on CUDA (resolved for a CUDA rank's spec without a GPU: nothing is built) and
to the weights' dtype on CPU; low-precision master weights warn; bad names fail by field."""

from __future__ import annotations

import logging

import pytest
import torch

from trellis.interfaces.backend import BackendSpec, DistInfo
from trellis_fsdp.backend import FSDPBackend, FSDPOptions


def precision(device: str, trainable: bool = True, **opts):
    spec = BackendSpec("actor", "unused", FSDPOptions(**opts), trainable, dist=DistInfo(device=device))
    return FSDPBackend(spec)._precision()


def test_auto_is_fp32_weights_bf16_compute_fp32_reduction_on_cuda():
    assert precision("cuda") == (torch.float32, torch.bfloat16, torch.float32)
    assert precision("cpu") == (torch.float32, None, None)
    # explicit choices are kept; None is FSDP2's default (reduction in the compute dtype)
    assert precision("cuda", param_dtype=None, reduce_dtype=None) == (torch.float32, None, None)
    assert precision("cpu", param_dtype="bfloat16", reduce_dtype="float32") == (torch.float32, torch.bfloat16, torch.float32)


def test_bf16_master_weights_warn_for_a_trained_role_only(caplog):
    with caplog.at_level(logging.WARNING, logger="trellis"):
        precision("cuda", trainable=False, dtype="bfloat16")
        assert not caplog.records
        precision("cuda", dtype="bfloat16")
    assert "backend.dtype=bfloat16" in caplog.text and "keep dtype=float32 and set param_dtype=bfloat16" in caplog.text


@pytest.mark.parametrize("field, value", [("dtype", "auto"), ("param_dtype", "fp16"), ("reduce_dtype", "double")])
def test_unknown_dtype_names_the_field_and_the_valid_values(field, value):
    with pytest.raises(ValueError, match=rf"backend.{field}={value!r} is not a dtype; valid: float32, bfloat16, float16"):
        precision("cpu", **{field: value})
