"""Multi-LoRA serving: PEFT adapters in a fixed pool of slots, applied per segment of the flat batch (docs/lora.md)."""
