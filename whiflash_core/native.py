"""Our C kernels (whiflash_core/kernels/*.c): built on the machine that runs them, loaded with ctypes.

Each file is small plain C (no PyTorch headers), so it builds in about a second at first use with
the system C compiler, for this CPU (-march=native) or, when PyTorch is forced to its AVX2 kernels
(ATEN_CPU_CAPABILITY=avx2), for the AVX2 class (-march=haswell), and is cached beside the format
timings (~/.cache/whiflash/kernels, or $WHIFLASH_CACHE_DIR/kernels), keyed by its source, the
flags, the compiler and the CPU. No C compiler, no x86-64 with AVX2 or a failed build: `build`
returns None and the caller keeps PyTorch's ops.

A call releases the GIL (ctypes does) and runs on the OpenMP pool PyTorch loaded (same libgomp).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from .cache import cache_root
from .machine import cpu_flags


def isa() -> str | None:
    """Which instruction set the kernels are built for here: "avx2" (forced by ATEN_CPU_CAPABILITY,
    or what the CPU has), "native" (-march=native: VNNI where the CPU has it), or None (no AVX2)."""
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma", "f16c"} <= cpu_flags():
        return None
    forced = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if forced == "default":
        return None
    return "avx2" if forced == "avx2" else "native"


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")


def _flags(kind: str) -> list[str]:
    arch = ["-march=haswell"] if kind == "avx2" else ["-march=native"]
    return ["-O3", *arch, "-fopenmp", "-shared", "-fPIC", "-std=c11"]


def build(source: Path) -> ctypes.CDLL | None:
    """`source` built for this machine (or the cached build), loaded; None where it cannot be."""
    kind, cc = isa(), compiler()
    if kind is None or cc is None:
        return None
    flags = _flags(kind)
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        text = source.read_bytes()
    except (OSError, subprocess.SubprocessError):
        return None
    # -march=native means this CPU: its flags are part of the key, with the source and compiler
    key = hashlib.sha256(b"\0".join([text, " ".join(flags).encode(), version.encode(),
                                     " ".join(sorted(cpu_flags())).encode()])).hexdigest()[:16]
    name = source.stem
    path = cache_root() / "kernels" / f"{name}-{kind}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True,
                                  timeout=120)
            if done.returncode != 0:
                return None
            os.replace(tmp, path)  # atomic: processes building at once each install a whole file
            for old in path.parent.glob(f"{name}-{kind}-*.so"):  # builds of an older source or compiler
                if old != path:
                    old.unlink(missing_ok=True)
        except (OSError, subprocess.SubprocessError):
            return None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(path))  # torch is imported, so its libgomp is the one this links to
    except OSError:
        return None
