"""What an engine will run, decided once before anything loads: the resolved configuration
(resolved_config.py), the KV cache's blocks (kv_cache_plan.py) and the memory plan (memory_plan.py)."""
