"""(Streaming) DiLoCo across replica groups, with 2-8-bit outer all-reduces (``docs/diloco.md``).

``DiLoCo(model, DiLoCoConfig(...), replicas=mesh)`` and one ``diloco.step()`` after every inner
optimizer step. Modules: ``config`` (``DiLoCoConfig``), ``schedule`` (which fragment syncs when;
the overlap thread), ``outer`` (one fragment's outer state and step), ``replicas`` (the replica
group a sync runs over), ``engine`` (``DiLoCo``), ``isolation`` (``isolate_replicas``: an HSDP
model whose replica groups train by themselves), ``ft`` (torchft, imported on use).
"""

from .config import DiLoCoConfig
from .engine import DiLoCo
from .isolation import ReplicaIsolation, isolate_replicas
from .replicas import ReplicaGroup, StaticReplicas, replica_group_of

__all__ = ["DiLoCo", "DiLoCoConfig", "ReplicaGroup", "ReplicaIsolation", "StaticReplicas",
           "isolate_replicas", "replica_group_of"]
