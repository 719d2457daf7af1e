"""torchtitan 0.2.2 (TOML job files) integration of fsdp_qcomm.

* ``fsdp_qcomm.titan.register`` -- ``[experimental] custom_import``: CPU/gloo support, offline
  datasets, and the ``gpt_qcomm`` train spec whose parallelize step installs the hooks.
* ``fsdp_qcomm.titan.config`` -- ``[job] custom_config_module``: the ``[qcomm]`` section.
* ``fsdp_qcomm.titan.recipes`` -- generates the TOML recipes under ``recipes/``.
* ``python -m fsdp_qcomm.titan.main`` -- the CPU debug job (4 processes).

The pieces that do not depend on the torchtitan version (the section, figures, checkpoint
entry, data, CPU support) live in ``fsdp_qcomm.titan_common``; the torchtitan 0.3 adapter is
``fsdp_qcomm.titan03``. Importing this package checks that torchtitan 0.2.x is installed and
names the adapter to use otherwise. Nothing here is imported by ``import fsdp_qcomm``.
"""

from fsdp_qcomm.titan_common.version import require_torchtitan

require_torchtitan(__name__)
