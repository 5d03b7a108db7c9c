"""pagellm: LLM inference and serving with a paged KV cache and continuous batching."""
import os

# Before torch loads its OpenMP runtime (libgomp): a worker spins for a while (~100,000 pause
# loops, a few ms) after each parallel region before it sleeps. A decode step is ~300 short
# regions; waking a sleeping worker on this 2-core VM costs ~0.1 ms each (the idle virtual CPU
# has to be woken), so sleeping at once (OMP_WAIT_POLICY=PASSIVE) made decode steps 92-109 ms
# against 73-82 ms spinning (`pagellm bench profile`, alternating), and served 184-218 against
# 222-248 output tok/s on the R, P and V workloads. libgomp itself cuts spinning short whenever it
# manages more workers than there are cores, so every engine builds and steps on one thread
# (`pagellm.engine.llm`, `pagellm.engine.async_llm`). A user's own setting of either wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it lazily so `import pagellm` stays cheap.
    if name == "LLM":
        from pagellm.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
