"""torchtitan 0.3 (Python config registry) integration of fsdp_qcomm.

Launch: ``torchrun ... -m torchtitan.train --module fsdp_qcomm.titan03 --config <recipe>
[--qcomm.preset sdp4bit] [--qcomm.<field> value] [--<section>.<key> value]``.

* ``config_registry`` -- the recipe functions (debug GPT, GPT-3 125M..13B, one per scheme);
* ``trainer`` -- :class:`QCommTrainer`: torchtitan's ``Trainer`` with a ``qcomm`` config
  section, the hooks installed on every model part, their state in checkpoints, a ``diloco``
  section (``--diloco.enable``: DiLoCo across the ``dp_replicate`` replica groups), and CPU
  support where there is no accelerator;
* ``metrics`` -- the metrics processor that logs the ``qcomm/*`` figures;
* ``models`` -- the GPT model specs; ``attention`` -- the CPU attention;
* ``python -m fsdp_qcomm.titan03.main`` -- the CPU debug job (4 processes).

The version-free pieces live in ``fsdp_qcomm.titan_common``; the torchtitan 0.2.2 (TOML)
adapter is ``fsdp_qcomm.titan``. Importing this package checks that torchtitan 0.3.x is
installed and names the adapter to use otherwise.
"""

from fsdp_qcomm.titan_common.version import require_torchtitan

require_torchtitan(__name__)
