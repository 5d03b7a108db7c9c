"""Build and load pagellm's C++ CPU kernels, caching the result per source, flags and CPU.

One library holds them all: paged attention (op namespace ``pagellm_attn``), the fused layer ops
(``pagellm_ops``), the packed small-batch matmul (``pagellm_gemm``), its int8 dot-product
form for GGUF block weights (``pagellm_gemm_int8``), sampling from logits
(``pagellm_sample``), batched multi-LoRA's shrink and expand (``pagellm_lora``) and the hybrid models'
recurrent layers (``pagellm_recurrent``, ``pagellm_mamba``), called only
through :mod:`pagellm.kernels.ops`. It is compiled once with
``-O3 -march=native -fopenmp`` (``$PAGELLM_CPU_ARCH`` replaces ``native``) into the
``extensions`` folder of ``$PAGELLM_CACHE_DIR`` (see :mod:`pagellm.envs`), in a folder named by a
hash of everything that shapes the binary, so a later start just loads the ``.so``.
``python -m pagellm.kernels.build`` compiles it ahead of time; ``--clean`` also deletes builds
of older source versions. ``python -m pagellm.attention.selfcheck`` builds it and checks the
attention kernel against the reference (what the setup script runs).
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import platform
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

from pagellm import envs

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = tuple(
    CSRC / name
    for name in (
        "paged_attention.cpp", "layer_ops.cpp", "gemm.cpp", "gemm_bf16.cpp", "gemm_int8.cpp", "sampling.cpp", "lora_shrink_expand.cpp",
        "recurrent.cpp", "mamba.cpp",
    )
)
HEADERS = tuple(CSRC / name for name in (
    "amx.h", "bf16_tiles.h", "vec.h", "quant_blocks.h", "kv_types.h", "weight_layout.h", "parallel_panels.h", "seq_meta.h",
))
LIB_NAME = "pagellm_cpu_kernels"

_loaded: bool | None = None  # None: not tried yet; True/False: loaded / failed in this process
_load_error: str | None = None
_loaded_dir: Path | None = None


def flag_sets() -> tuple[tuple[str, ...], ...]:
    """Compiler flags, tried in order: the first is the fast one (for ``envs.cpu_arch()``, this CPU
    by default); the second survives compilers without that ``-march``."""
    return (
        ("-O3", f"-march={envs.cpu_arch()}", "-fopenmp"),
        ("-O3", "-fopenmp"),
    )


def cache_dir() -> Path:
    """Where compiled kernels live."""
    return envs.cache_dir() / "extensions"


def _cpu_identity() -> str:
    # -march=native bakes the CPU's instruction set into the binary: a cache shared between
    # machines must not hand one CPU's build to another.
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.strip()
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _build_tag(flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for part in (*(path.read_bytes() for path in SOURCES + HEADERS), " ".join(flags).encode(), torch.__version__.encode(),
                 sys.version.encode(), _cpu_identity().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _library_path(build_dir: Path) -> Path:
    return build_dir / f"{LIB_NAME}.so"


def _compile(flags: tuple[str, ...], build_dir: Path, verbose: bool) -> Path:
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=LIB_NAME,
        sources=[str(path) for path in SOURCES],
        extra_cflags=list(flags),
        extra_ldflags=["-fopenmp"],
        build_directory=str(build_dir),
        is_python_module=False,
        is_standalone=False,
        verbose=verbose,
    )
    return _library_path(build_dir)


def load_kernels(verbose: bool = False) -> bool:
    """Loads (building first if needed) the kernel library; False, after one warning, if it cannot be built."""
    global _loaded, _loaded_dir, _load_error
    if _loaded is not None:
        return _loaded
    errors = []
    for flags in flag_sets():
        build_dir = cache_dir() / f"{LIB_NAME}_{_build_tag(flags)}"
        library = _library_path(build_dir)
        try:
            if library.exists():
                try:
                    torch.ops.load_library(str(library))
                    _loaded, _loaded_dir = True, build_dir
                    return True
                except OSError:
                    pass  # e.g. still being linked by a concurrent build; the locked build below waits for it
            start = time.perf_counter()
            _compile(flags, build_dir, verbose)  # cpp_extension loads the library it built
            logger.info("built %s in %.1fs", library, time.perf_counter() - start)
            _loaded, _loaded_dir = True, build_dir
            return True
        except Exception as exc:  # noqa: BLE001 - a compiler or loader failure of any kind means: fall back
            lines = str(exc).strip().splitlines() or [""]
            errors.append(f"[{' '.join(flags)}] {type(exc).__name__}: {lines[-1]}")
    _load_error = "; ".join(errors)
    warnings.warn(f"pagellm: C++ kernels unavailable, using the torch fallback ({_load_error})", stacklevel=2)
    _loaded = False
    return False


def loaded_build_dir() -> Path | None:
    """The folder of the kernel library this process loaded (one per source, flags, torch and CPU),
    where what is measured about this machine's kernels can be kept; None before a load or after a failed one."""
    return _loaded_dir


def load_error() -> str | None:
    """Why the last load failed, if it did."""
    return _load_error


def remove_stale_builds() -> list[Path]:
    """Delete cached builds of other source versions, flags or CPUs; returns what was removed.

    Not done automatically: checkouts of different versions may share one cache.
    """
    keep = {f"{LIB_NAME}_{_build_tag(flags)}" for flags in flag_sets()}
    removed = []
    root = cache_dir()
    if root.is_dir():
        for entry in root.glob(f"{LIB_NAME}_*"):
            if entry.is_dir() and entry.name not in keep:
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Pre-build pagellm's C++ CPU kernels.")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    parser.add_argument("--clean", action="store_true", help="first delete cached builds of other versions")
    args = parser.parse_args(argv)
    if args.clean:
        for path in remove_stale_builds():
            print(f"removed {path}")
    start = time.perf_counter()
    if not load_kernels(verbose=args.verbose):
        print(f"build failed: {_load_error}", file=sys.stderr)
        return 1
    print(f"CPU kernels ready under {cache_dir()} ({time.perf_counter() - start:.1f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
