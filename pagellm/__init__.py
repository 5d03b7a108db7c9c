"""pagellm: LLM inference and serving with a paged KV cache and continuous batching."""
# Before torch loads libgomp: its workers should spin between a step's short regions (docs/benchmarks.md).
from pagellm import envs

envs.set_openmp_defaults()
from pagellm.lora.request import LoRARequest  # noqa: E402
from pagellm.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput  # noqa: E402
from pagellm.pooling_params import PoolingParams  # noqa: E402
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "LoRARequest",
    "SamplingParams",
    "PoolingParams",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EmbeddingOutput",
    "Logprob",
    "__version__",
]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it lazily so `import pagellm` stays cheap.
    if name == "LLM":
        from pagellm.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
