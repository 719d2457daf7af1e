"""FSDP2 integration: custom AllGather / ReduceScatter classes and ``enable``."""
