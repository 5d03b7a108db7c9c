"""pagellm's compiled CPU kernels (paged attention, fused layer ops) and their build cache."""
