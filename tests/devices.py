"""The device the tests put caches on (importable as `devices`): env KVC_TEST_DEVICE, "cpu" by default.

`KVC_TEST_DEVICE=cuda make test` runs the suite with every cache's device tier on the GPU (`make gpu-check`); tests
of code that exists only on a GPU skip elsewhere with `needs_cuda`'s one-line reason.
"""

from __future__ import annotations

import os

import pytest
import torch

TEST_DEVICE = os.environ.get("KVC_TEST_DEVICE", "cpu") or "cpu"
if TEST_DEVICE.startswith("cuda") and not torch.cuda.is_available():
    raise RuntimeError(f"KVC_TEST_DEVICE={TEST_DEVICE}, but torch {torch.__version__} sees no CUDA device")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (copy streams, pinned "
                                                                      "host memory seen from the device)")


def on_device(t: torch.Tensor) -> torch.Tensor:
    """`t` on the tests' device."""
    return t.to(TEST_DEVICE)
