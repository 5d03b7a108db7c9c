"""Shared test set-up: shared helpers importable from any test directory."""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import atexit
import shutil
import tempfile

import pytest

# Packed weights go to a folder of the run's own, not the user's cache, and every load after the
# first of a model replays them: the suite runs its models from mapped panels too.
if "PAGELLM_PACKED_WEIGHT_CACHE" not in os.environ:
    os.environ["PAGELLM_PACKED_WEIGHT_CACHE"] = tempfile.mkdtemp(prefix="pagellm-packed-")
    atexit.register(shutil.rmtree, os.environ["PAGELLM_PACKED_WEIGHT_CACHE"], True)


@pytest.fixture
def no_amx():
    """Linear layers off AMX tiles for the test (a no-op on CPUs without them). With tiles, a
    product of 64 rows or more on GGUF blocks computes in bfloat16 and a narrower one in int8, so
    outputs depend on how requests were batched or cached; tests of exactly equal outputs across
    batching pin the row-invariant int8 kernel."""
    from pagellm.kernels import ops

    was_on = ops.available() and ops.set_amx(False)
    yield
    if was_on:
        ops.set_amx(True)
