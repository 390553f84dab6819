"""The machine a benchmark ran on, recorded in every report so that two runs can be judged comparable."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx")  # in machine_info; "amx": any amx_* flag


def machine_info() -> dict[str, Any]:
    """CPU model, family and flags (``CPU_FLAGS``), cores, library versions: enough to tell whether two runs are
    comparable. A VM's model name is often only the vendor's line ("AMD EPYC"); family and model tell its cores
    apart."""
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    family, model, flags = None, None, []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name":
                cpu = value
            elif key == "cpu family" and value.isdigit():
                family = int(value)
            elif key == "model" and value.isdigit():
                model = int(value)
            elif key == "flags":
                present = set(value.split())
                flags = [f for f in CPU_FLAGS if f in present or any(p.startswith(f"{f}_") for p in present)]
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_family": family,
        "cpu_model": model,
        "cpu_flags": flags,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
