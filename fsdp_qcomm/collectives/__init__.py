"""Process-group level quantized collectives (no FSDP dependency)."""
