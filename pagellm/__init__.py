"""pagellm: LLM inference and serving with a paged KV cache and continuous batching."""
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
