"""What the kernels' callers read at call time, as one explicit object per model load.

A :class:`KernelContext` is made before a model is loaded and handed to what needs it: the model's
``load_weights`` passes it to every layer it processes (the linear methods and the embedding pack
through it, and a form whose kernel choice was measured keeps it), and the loader hands the same
object to the attention backend. It holds:

* ``pack_session``: during a load that keeps its packed weights (:mod:`pagellm.kernels.pack_cache`),
  that load's :class:`~pagellm.kernels.pack_cache.PackSession`; every pack goes through
  :meth:`KernelContext.pack`, which replays or records it there (None: the pack just runs);
* ``tuning``: this machine's start-up measurements (:class:`~pagellm.kernels.tuning.CpuTuning`),
  untuned until the loader measures them on the loaded model's own packed weights and sets them
  here, once; every holder reads the new values from its next call on.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Optional

import torch

from pagellm.kernels.tuning import CpuTuning, TuningKey

if TYPE_CHECKING:
    from pagellm.kernels.pack_cache import PackSession


class KernelContext:
    """One model load's pack session and this machine's tuning (module docstring)."""

    def __init__(self, tuning: Optional[CpuTuning] = None) -> None:
        self.pack_session: Optional[PackSession] = None
        self._row_limits: dict[TuningKey, int] = {}
        self.tuning = tuning or CpuTuning.untuned()

    @property
    def tuning(self) -> CpuTuning:
        return self._tuning

    @tuning.setter
    def tuning(self, tuning: CpuTuning) -> None:
        self._tuning = tuning
        # Read at every small product: looked up once here, not in CpuTuning.limits_for per call.
        self._row_limits = {TuningKey(*key): limits.packed_max_rows for key, limits in tuning.row_limits}

    def packed_max_rows(self, key: TuningKey, default: int) -> int:
        """Up to how many rows the packed kernel for ``key`` (e.g. ``tuning.F32_PANELS``) is used,
        BLAS beyond: as measured on this machine, else the caller's ``default``."""
        return self._row_limits.get(key, default)

    def pack(self, op: str, signature: list[Any], pack: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``pack()``, or during a load with a :attr:`pack_session` the panels an earlier load of the
        same key recorded for this call; ``signature`` (JSON data) names the call's arguments."""
        session = self.pack_session
        return pack() if session is None else session.pack(op, signature, pack)

    @contextlib.contextmanager
    def packing(self, session: Optional[PackSession]) -> Iterator[None]:
        """Packs inside go through ``session`` (None: they just run); none after."""
        self.pack_session = session
        try:
            yield
        finally:
            self.pack_session = None
