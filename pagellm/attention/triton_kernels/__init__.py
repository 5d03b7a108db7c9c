"""Triton kernels for paged attention: the cache write, decode (split-K) and varlen prefill.

Imported only by ``pagellm.attention.triton_paged``, and only once Triton is known to import.
Under ``TRITON_INTERPRET=1`` (set before this package is imported) they run on CPU tensors.
"""
