"""Quantized collectives on process groups, usable without FSDP."""
