"""The layers models share (vLLM's ``model_executor/layers``): linear layers and their
quantization methods, the vocabulary embedding, norms, activations, rotary embeddings, the
attention layer and the mixture-of-experts layer. Model files in pagellm.models compose them."""
