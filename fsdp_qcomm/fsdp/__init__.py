"""FSDP2 hooks: custom all-gather / reduce-scatter classes and enable()."""
