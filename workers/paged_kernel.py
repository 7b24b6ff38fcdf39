"""The C decode-attention kernel (``paged_attention.c``): built on first use, loaded with ctypes.

The reference engine's decode attention on CPU is bound by memory traffic: the torch path
gathers every decode sequence's KV blocks into a padded copy per layer (``index_select``)
and SDPA reads that copy again. The kernel reads each block where it lies, once, up to the
sequence's own length (docs/performance.md, "Decode attention in a C kernel").

It is compiled with the host's C compiler (``$CC``, else ``cc``) for the host's own CPU
(``-march=native``) into the directory it is given (the engine area's ``kernel_dir``,
``CONVEYOR_KERNEL_DIR``), under a name that hashes the source, the flags, the compiler and
the CPU, so a changed source or another machine sharing the directory builds its own copy.
A build takes about a second; concurrent builds (several workers starting at once) each
write a private
temporary file and rename it into place. ``-ffast-math`` is used at compile time only, so
the vectorised ``expf`` and reassociated sums are allowed; the library is linked without
it, so loading it does not switch the process to flush-to-zero (GCC before 13 links
``crtfastmath.o`` into shared objects built with it).

ctypes releases the GIL for the call, as a torch op does. No compiler, or a failed build:
:func:`load` raises :class:`KernelUnavailable` with the reason, and the engine falls back
to the torch path (``decode_attention="auto"``) or refuses to start (``"kernel"``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("paged_attention.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c11")
SYMBOL = "conveyor_paged_decode_attention"


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded on this host (the message says why)."""


def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the CPU model and its feature flags."""
    keep = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    keep.append(line.strip())
                if len(keep) >= 2:
                    break
    except OSError:
        pass
    return "\n".join([platform.machine(), platform.processor(), *keep])


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise KernelUnavailable(f"no C compiler: {cc!r} is not on PATH (set CC)")
    return path


def library_path(cc: str, directory: Path) -> Path:
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        raise KernelUnavailable(f"{cc} --version failed: {e}") from e
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(COMPILE_FLAGS).encode(), version.encode(),
                 _cpu_identity().encode()):  # fmt: skip
        h.update(part)
        h.update(b"\0")
    return directory / f"paged_attention-{h.hexdigest()[:16]}.so"


def _build(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".build-") as tmp:
        obj, lib = Path(tmp) / "k.o", Path(tmp) / "k.so"
        steps = (
            [cc, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
            [cc, "-shared", str(obj), "-o", str(lib), "-lm"],  # no -ffast-math: see above
        )
        for cmd in steps:
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.SubprocessError) as e:
                raise KernelUnavailable(f"{' '.join(cmd)}: {e}") from e
            if r.returncode != 0:
                raise KernelUnavailable(f"{' '.join(cmd)} failed:\n{r.stderr.strip()}")
        os.replace(lib, out)


@functools.cache
def load(directory: Path) -> PagedDecodeKernel:
    """The kernel in ``directory``, built there if it has no copy for this host yet (once
    per process and directory)."""
    cc = _compiler()
    path = library_path(cc, directory)
    if not path.exists():
        _build(cc, path)
    try:
        return PagedDecodeKernel(ctypes.CDLL(str(path)))
    except (OSError, AttributeError) as e:
        raise KernelUnavailable(f"loading {path}: {e}") from e


class PagedDecodeKernel:
    """``__call__`` runs one layer's decode attention for a batch of sequences, on the
    calling thread. One thread is the right number here: decode attention is bound by
    memory bandwidth, and splitting the sequences over two threads made a call slower
    (docs/performance.md, "Decode kernel on one thread")."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = getattr(lib, SYMBOL)
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, i64, i64, i64, i64, i64,
                       ptr, ptr, i64, ptr, i64, ctypes.c_float, ptr, ptr]  # fmt: skip
        fn.restype = None
        self._fn = fn

    def __call__(
        self,
        cache: torch.Tensor,  # [blocks, layers, 2, block_size, kv_heads, dim] float32
        layer: int,
        q: torch.Tensor,  # [D, heads, dim] float32, contiguous
        tables: torch.Tensor,  # [D, nb] int64 block ids, contiguous
        ctx_lens: torch.Tensor,  # [D] int64, each >= 1 and <= nb * block_size
        max_ctx: int,  # max(ctx_lens)
        scale: float,
        out: torch.Tensor,  # [D, heads, dim] float32, contiguous
    ) -> None:
        _, layers, _, bs, nkv, hd = cache.shape
        per_kv = bs * nkv * hd
        scores = torch.empty(q.shape[1] * max_ctx, dtype=torch.float32)
        self._fn(
            cache.data_ptr(),
            layers * 2 * per_kv,
            2 * layer * per_kv,
            (2 * layer + 1) * per_kv,
            bs,
            nkv,
            q.shape[1] // nkv,
            hd,
            q.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            ctx_lens.data_ptr(),
            q.shape[0],
            scale,
            out.data_ptr(),
            scores.data_ptr(),
        )
