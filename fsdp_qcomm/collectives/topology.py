"""Which ranks of a process group share a node, and the subgroups a two-level collective uses.

A node is a block of ``ranks_per_node`` consecutive global ranks (what torchrun and SLURM block
placement give): global rank ``g`` lives on node ``g // ranks_per_node``. ``ranks_per_node``
comes from ``QCommConfig.ranks_per_node`` when set, else from ``LOCAL_WORLD_SIZE`` (set by
torchrun), else from the ranks' host names. ``resolve_placement`` (called once by ``enable``)
checks the choice against the host names: ranks treated as one node must share a host, and
nodes that share a host (one machine pretending to be several nodes, as the tests and the
emulated cluster do) are accepted only when ``ranks_per_node`` was set explicitly.

The members of a process group are arranged as a grid ``nodes x local``: nodes in order of node
id, and inside a node the members in order of global rank. ``grid[q][p]`` is the group rank of
the ``p``-th member on the ``q``-th node. The intra-node subgroup of a rank holds row ``q`` of
the grid, its inter-node subgroup column ``p``; ``torch.distributed.new_group`` orders members by
global rank, which is exactly the grid order, so subgroup rank ``p`` (intra) and ``q`` (inter)
index the grid directly.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Optional, Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup

_ENV = "LOCAL_WORLD_SIZE"


def known_ranks_per_node(ranks_per_node: Optional[int]) -> Optional[int]:
    """``ranks_per_node`` if given, else ``LOCAL_WORLD_SIZE``, else None (placement unknown)."""
    if ranks_per_node is None and _ENV not in os.environ:
        return None
    return resolve_ranks_per_node(ranks_per_node)


def resolve_ranks_per_node(ranks_per_node: Optional[int]) -> int:
    """``ranks_per_node`` if given, else ``LOCAL_WORLD_SIZE``; a clear error when neither is set."""
    if ranks_per_node is not None:
        bad = isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
        if bad or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
        return ranks_per_node
    raw = os.environ.get(_ENV)
    if raw is None:
        raise ValueError(
            f"cannot tell which ranks share a node: {_ENV} is not set (torchrun sets it); "
            "set QCommConfig.ranks_per_node to the number of ranks on each node"
        )
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            f"{_ENV}={raw!r} is not a positive integer; fix it or set QCommConfig.ranks_per_node"
        )
    return value


@dataclass(frozen=True)
class NodePlacement:
    """Where the ranks run: ``ranks_per_node`` and where it came from (``source``), the host
    of every global rank, and whether several nodes share a host (``emulated``)."""

    ranks_per_node: int
    source: str
    hosts: tuple[str, ...]
    emulated: bool

    @property
    def num_nodes(self) -> int:
        return len(self.hosts) // self.ranks_per_node

    def describe(self) -> str:
        how = "emulated on shared hosts" if self.emulated else "one host each"
        return (f"{self.num_nodes} node(s) of {self.ranks_per_node} rank(s) ({self.source}; "
                f"{how})")


def check_placement(
    ranks_per_node: Optional[int], source: str, hosts: Sequence[str]
) -> NodePlacement:
    """Check a node size against the host of every global rank (pure; ``hosts[g]`` is global
    rank ``g``'s host name). ``ranks_per_node`` None derives it from the hosts.

    Ranks the package treats as one node must share a host (else the "intra-node" hop would
    cross the network). Nodes sharing a host are an emulation: accepted only when ``source`` is
    the explicit ``QCommConfig.ranks_per_node``, since a ``LOCAL_WORLD_SIZE`` smaller than a
    host's ranks usually means several launchers per machine by mistake.
    """
    hosts = tuple(hosts)
    world = len(hosts)
    if ranks_per_node is None:
        ranks_per_node, source = _node_size_from_hosts(hosts), "host names"
    if world % ranks_per_node:
        raise ValueError(
            f"ranks_per_node={ranks_per_node} does not divide the world size {world} (from "
            f"{source}); every node must run the same number of ranks. Set "
            "QCommConfig.ranks_per_node (or LOCAL_WORLD_SIZE) to a divisor of the world size"
        )
    blocks = [hosts[a:a + ranks_per_node] for a in range(0, world, ranks_per_node)]
    for q, block in enumerate(blocks):
        if len(set(block)) > 1:
            first = q * ranks_per_node
            raise ValueError(
                f"ranks {first}..{first + ranks_per_node - 1} are treated as one node "
                f"(ranks_per_node={ranks_per_node} from {source}) but run on hosts "
                f"{sorted(set(block))}; traffic between them would cross the network as "
                "'intra-node'. Set QCommConfig.ranks_per_node to the number of ranks on each "
                "host (ranks of one host must be consecutive)"
            )
    owners = [b[0] for b in blocks]
    emulated = len(set(owners)) < len(owners)
    if emulated and source != _EXPLICIT:
        shared = sorted({h for h in owners if owners.count(h) > 1})
        raise ValueError(
            f"{source} says nodes of {ranks_per_node} rank(s), but several of those nodes run on "
            f"the same host ({', '.join(shared)}), for example two torchrun launchers on one "
            "machine. To emulate several nodes on one host on purpose, set "
            f"QCommConfig.ranks_per_node={ranks_per_node} explicitly"
        )
    return NodePlacement(ranks_per_node, source, hosts, emulated)


_EXPLICIT = "QCommConfig.ranks_per_node"


def _node_size_from_hosts(hosts: tuple[str, ...]) -> int:
    """The node size when every host runs one block of consecutive ranks of the same size."""
    runs: list[list] = []
    for h in hosts:
        if runs and runs[-1][0] == h:
            runs[-1][1] += 1
        else:
            runs.append([h, 1])
    sizes = {n for _, n in runs}
    if len(sizes) == 1 and len({h for h, _ in runs}) == len(runs):
        return sizes.pop()
    layout = ", ".join(f"{h} x{n}" for h, n in runs)
    raise ValueError(
        f"cannot tell the node size from the host names (runs of consecutive ranks: {layout}); "
        "fsdp_qcomm needs every host to run one block of consecutive ranks of the same size. "
        "Set QCommConfig.ranks_per_node (or LOCAL_WORLD_SIZE) to the ranks per node"
    )


_HOSTS: dict[tuple, tuple[str, ...]] = {}


def host_names() -> tuple[str, ...]:
    """The host name of every global rank (``socket.gethostname``), gathered once per process
    group world and cached. Collective on first use: every rank must call it."""
    world = dist.group.WORLD
    key = (id(world), dist.get_world_size())
    hit = _HOSTS.get(key)
    if hit is None:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, socket.gethostname())
        hit = _HOSTS[key] = tuple(str(h) for h in every)
    return hit


def resolve_placement(ranks_per_node: Optional[int]) -> NodePlacement:
    """The node placement ``enable`` uses: ``ranks_per_node`` if given (explicit), else
    ``LOCAL_WORLD_SIZE``, else the host names, checked by ``check_placement``. Collective on
    first use (``host_names``)."""
    if ranks_per_node is not None:
        rpn, source = resolve_ranks_per_node(ranks_per_node), _EXPLICIT
    elif _ENV in os.environ:
        rpn, source = resolve_ranks_per_node(None), _ENV
    else:
        rpn, source = None, "host names"
    return check_placement(rpn, source, host_names())


@dataclass(frozen=True)
class NodeLayout:
    """The members of one process group laid out by node (see the module docstring).

    ``nodes[q]`` lists the group ranks on the ``q``-th node, in global-rank order. The layout is
    ``regular`` when every node holds the same number of members; only then does ``grid``-based
    two-level routing apply.
    """

    global_ranks: tuple[int, ...]
    ranks_per_node: int
    nodes: tuple[tuple[int, ...], ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.global_ranks)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def regular(self) -> bool:
        return len({len(n) for n in self.nodes}) == 1

    @property
    def remote_peers(self) -> int:
        """Members of the group on other nodes than the caller."""
        q, _ = self.position(self.rank)
        return self.size - len(self.nodes[q])

    @property
    def local_size(self) -> int:
        if not self.regular:
            raise ValueError(self._irregular_message())
        return len(self.nodes[0])

    def position(self, group_rank: int) -> tuple[int, int]:
        """(node index q, local index p) of a group rank."""
        for q, members in enumerate(self.nodes):
            if group_rank in members:
                return q, members.index(group_rank)
        raise ValueError(f"group rank {group_rank} is not in this layout of {self.size} ranks")

    def hop1_order(self) -> list[int]:
        """Group ranks in the order of the intra-node send buffer: for local peer ``p`` (outer),
        the rows of every rank with local index ``p``, by node (inner)."""
        L = self.local_size
        return [self.nodes[q][p] for p in range(L) for q in range(self.num_nodes)]

    def _irregular_message(self) -> str:
        counts = {self.global_ranks[m[0]] // self.ranks_per_node: len(m) for m in self.nodes}
        return (
            f"the process group's {self.size} ranks are spread unevenly over nodes "
            f"(members per node id: {counts}, ranks_per_node={self.ranks_per_node}); two-level "
            "reduction needs the same number on every node. Use grad_scheme='one_level' for this "
            "group or fix QCommConfig.ranks_per_node"
        )


def plan_layout(
    global_ranks: list[int] | tuple[int, ...], rank: int, ranks_per_node: int
) -> NodeLayout:
    """The layout of a group whose group rank ``i`` is global rank ``global_ranks[i]``.

    Pure function (no communication); ``rank`` is the caller's group rank.
    """
    ranks = tuple(int(g) for g in global_ranks)
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"global ranks must be distinct, got {list(ranks)}")
    if not 0 <= rank < len(ranks):
        raise ValueError(f"group rank {rank} is outside a group of {len(ranks)}")
    by_node: dict[int, list[int]] = {}
    for i in sorted(range(len(ranks)), key=lambda i: ranks[i]):
        by_node.setdefault(ranks[i] // ranks_per_node, []).append(i)
    nodes = tuple(tuple(by_node[k]) for k in sorted(by_node))
    return NodeLayout(ranks, ranks_per_node, nodes, rank)


def group_layout(group: Optional[ProcessGroup], ranks_per_node: Optional[int]) -> NodeLayout:
    """The layout of ``group`` (None: the default group); ``ranks_per_node`` None reads
    ``LOCAL_WORLD_SIZE``. Checks it against the world size. No communication."""
    rpn = resolve_ranks_per_node(ranks_per_node)
    world = dist.get_world_size()
    if world % rpn:
        raise ValueError(
            f"ranks_per_node={rpn} does not divide the world size {world}; every node must run "
            "the same number of ranks. Set QCommConfig.ranks_per_node (or LOCAL_WORLD_SIZE) to a "
            "divisor of the world size"
        )
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return plan_layout(ranks, dist.get_rank(group), rpn)


@dataclass(frozen=True)
class Topology:
    """A group's layout plus the caller's two subgroups.

    ``intra``: the members on the caller's node; ``inter``: the members sharing the caller's
    local index. Both are None when the layout needs a single hop (one node, or one member per
    node), which runs over the group itself.
    """

    layout: NodeLayout
    intra: Optional[ProcessGroup]
    inter: Optional[ProcessGroup]


_CACHE: dict[tuple, Topology] = {}


def is_alive(pg: Optional[ProcessGroup]) -> bool:
    if pg is None:
        return True
    try:
        dist.get_process_group_ranks(pg)
        return True
    except (ValueError, KeyError, RuntimeError):
        return False


def node_topology(group: Optional[ProcessGroup], ranks_per_node: Optional[int]) -> Topology:
    """The layout and subgroups of ``group``, created on first use and cached per
    (group, ranks_per_node).

    Collective on first use: every member of ``group`` must call it, in the same order relative
    to other collectives on ``group``. When ``group`` is the whole world, every rank creates all
    subgroups with ``new_group`` in one fixed order (intra groups by node, then inter groups by
    local index). For a smaller group the non-members cannot be made to join, so each member
    creates only its own two subgroups with ``use_local_synchronization=True``, which names the
    group by its ranks; the members must then have created the same number of process groups
    before (true for SPMD programs).
    """
    layout = group_layout(group, ranks_per_node)
    pg = group if group is not None else dist.group.WORLD
    cache_key = (pg.group_name, layout.global_ranks, layout.ranks_per_node)
    hit = _CACHE.get(cache_key)
    if hit is not None and is_alive(hit.intra) and is_alive(hit.inter):
        return hit
    if not layout.regular:
        raise ValueError(layout._irregular_message())
    L, N = layout.local_size, layout.num_nodes
    q_me, p_me = layout.position(layout.rank)
    if L == 1 or N == 1:  # one hop over the group itself: no subgroups to create
        topo = Topology(layout, None, None)
        _CACHE[cache_key] = topo
        return topo
    g = layout.global_ranks
    intra_sets = [[g[r] for r in layout.nodes[q]] for q in range(N)]
    inter_sets = [[g[layout.nodes[q][p]] for q in range(N)] for p in range(L)]
    whole_world = len(g) == dist.get_world_size()
    intra = inter = None
    for kind, sets, mine in (("intra", intra_sets, q_me), ("inter", inter_sets, p_me)):
        for i, ranks in enumerate(sets):
            if not whole_world and i != mine:
                continue
            sub = dist.new_group(
                ranks, use_local_synchronization=not whole_world, group_desc=f"qcomm_grad_{kind}"
            )
            if i == mine:
                if kind == "intra":
                    intra = sub
                else:
                    inter = sub
    topo = Topology(layout, intra, inter)
    _check_subgroup_order(topo, q_me, p_me)
    _CACHE[cache_key] = topo
    return topo


def layout_topology(group: Optional[ProcessGroup], ranks_per_node: Optional[int]) -> Topology:
    """The layout of ``group`` without subgroups (what a single-hop collective needs)."""
    return Topology(group_layout(group, ranks_per_node), None, None)


_CLONES: dict[tuple, ProcessGroup] = {}


def private_group(group: Optional[ProcessGroup]) -> ProcessGroup:
    """A second process group over ``group``'s ranks (same rank order), created on first use
    and cached.

    Collectives of one process group must be issued in the same order on every rank; a thread
    that runs collectives while the main thread runs others (``fsdp.grad_overlap``) therefore
    needs groups of its own. Collective on first use, with the same rules as ``node_topology``.
    """
    pg = group if group is not None else dist.group.WORLD
    ranks = tuple(dist.get_process_group_ranks(pg))
    key = (pg.group_name, ranks)
    hit = _CLONES.get(key)
    if hit is not None and is_alive(hit):
        return hit
    whole_world = len(ranks) == dist.get_world_size()
    clone = dist.new_group(list(ranks), use_local_synchronization=not whole_world,
                           group_desc="qcomm_grad_overlap")
    if tuple(dist.get_process_group_ranks(clone)) != ranks:
        raise RuntimeError(f"private group ranks {dist.get_process_group_ranks(clone)} do not "
                           f"follow {list(ranks)}")
    _CLONES[key] = clone
    return clone


def _check_subgroup_order(topo: Topology, q: int, p: int) -> None:
    """The routing relies on subgroup ranks following the grid; fail loudly if they do not."""
    lay = topo.layout
    if topo.intra is not None:
        want = [lay.global_ranks[r] for r in lay.nodes[q]]
        got = dist.get_process_group_ranks(topo.intra)
        if got != want:
            raise RuntimeError(f"intra-node subgroup ranks {got} do not follow the layout {want}")
    if topo.inter is not None:
        want = [lay.global_ranks[lay.nodes[k][p]] for k in range(lay.num_nodes)]
        got = dist.get_process_group_ranks(topo.inter)
        if got != want:
            raise RuntimeError(f"inter-node subgroup ranks {got} do not follow the layout {want}")


__all__ = [
    "NodeLayout",
    "NodePlacement",
    "check_placement",
    "host_names",
    "is_alive",
    "layout_topology",
    "resolve_placement",
    "Topology",
    "group_layout",
    "known_ranks_per_node",
    "node_topology",
    "plan_layout",
    "private_group",
    "resolve_ranks_per_node",
]
