"""torchtitan (0.2.2, TOML configs) integration of fsdp_qcomm.

* ``fsdp_qcomm.titan.register`` -- ``[experimental] custom_import``: CPU/gloo support, offline
  datasets, and the ``gpt_qcomm`` train spec whose parallelize step installs the hooks.
* ``fsdp_qcomm.titan.config`` -- ``[job] custom_config_module``: the ``[qcomm]`` section.
* ``fsdp_qcomm.titan.data`` -- offline corpus and BPE tokenizer (cached, no downloads).
* ``fsdp_qcomm.titan.recipes`` -- generates the TOML recipes under ``recipes/``.
* ``python -m fsdp_qcomm.titan.main`` -- the CPU debug job (4 processes).

Nothing here is imported by ``import fsdp_qcomm``; torchtitan is only needed for this
subpackage.
"""
