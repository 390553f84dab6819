"""Run the Triton kernels in Triton's CPU interpreter when there is no GPU.

NOTE: Triton binds a kernel to the interpreter when ``triton.jit`` decorates it, i.e. when
``engine.kernels`` is first imported, so the variable is set here, at conftest import,
before any test module of this folder imports the kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
