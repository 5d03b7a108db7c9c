"""pagellm: LLM inference and serving with a paged KV cache and continuous batching."""
import os

# Before torch loads its OpenMP runtime: idle OpenMP workers sleep instead of spinning. With
# spinning workers, a parallel op took 8-15 ms instead of 10-100 us whenever another thread
# (the HTTP server, the engine loop, another process) wanted the core, and decode steps were
# 1.4-1.8x slower on this 2-core machine (`pagellm bench profile`, both policies back to back).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
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
