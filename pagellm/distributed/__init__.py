"""Tensor parallelism's plumbing: how a model splits across ranks, and the collectives between them."""
