"""The machine a benchmark ran on, recorded in every report so that two runs can be judged comparable."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx")  # in machine_info; "amx": any amx_* flag


def machine_info() -> dict[str, Any]:
    """CPU model and flags (``CPU_FLAGS``), cores, library versions: enough to tell whether two runs are comparable."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                flags = [f for f in CPU_FLAGS if f in present or any(p.startswith(f"{f}_") for p in present)]
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_flags": flags,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
