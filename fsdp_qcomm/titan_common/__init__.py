"""What both torchtitan integrations share; nothing here depends on the torchtitan version.

* ``section`` -- the ``qcomm`` config section, generated from ``QCommConfig``;
* ``install`` -- :func:`install_qcomm`, the hooks on torchtitan's model parts;
* ``comm_stats`` -- the ``qcomm/*`` figures, the console line, the summary file;
* ``metrics`` -- the mixin that adds them to either torchtitan's metrics processor;
* ``checkpoint`` -- the handles' state as one checkpoint entry;
* ``data`` -- the offline corpus, BPE tokenizer and dataset entries;
* ``cpu`` -- running torchtitan on hosts without an accelerator (gloo);
* ``shapes`` -- the GPT model shapes and the recipes' hyper-parameters;
* ``launch`` -- the CPU debug jobs' torchrun command and summary printout;
* ``version`` -- which adapter fits the installed torchtitan.

The adapters are ``fsdp_qcomm.titan`` (torchtitan 0.2.2, TOML job files) and
``fsdp_qcomm.titan03`` (torchtitan 0.3, Python config registry). Importing this package imports
no torchtitan module; the few functions that touch torchtitan (``cpu``, ``data``) import it when
called, and use only what both versions have.
"""
