"""Which ranks attend together: the ring and the Ulysses groups of a call
(docs/design.md §2), from ``group``/``ulysses_group`` or a ``DeviceMesh``.

The ranks of a ring x Ulysses hybrid form a grid of ``R`` rows (one Ulysses
group of ``U`` ranks each) and ``U`` columns (one ring of ``R`` ranks each):
the rank with ring index ``i`` and Ulysses index ``j`` holds shard
``i * U + j`` of the sequence. A 1-D mesh is a ring (``U = 1``); a 2-D mesh
names its dimensions ``("ring", "ulysses")``.

:func:`check_grid` makes sure, once per configuration, that every rank of
the grid passed groups that form the same grid, through the default
process group's key-value store rather than a collective: a collective on
groups that differ between ranks (a mesh not the same on every rank) would
wait forever, while every rank can read what its peers wrote to the store.
"""

from __future__ import annotations

import datetime
import json
import threading
import weakref
import zlib
from dataclasses import dataclass

import torch.distributed as dist

from .comm import world_info

__all__ = ["Topology", "check_grid", "resolve_topology"]

_DIM_NAMES = ("ring", "ulysses")


@dataclass(frozen=True, eq=False)
class Topology:
    """The grid of one call, seen from this rank.

    Attributes:
        ring_group: the ring (ranks with this rank's Ulysses index), or
            ``None`` for a ring of one.
        ulysses_group: the Ulysses group (ranks with this rank's ring index),
            or ``None`` for ``U = 1``.
        ring_size, ulysses_size: ``R`` and ``U``.
        ring_index, ulysses_index: ``i`` and ``j``.
        ring_ranks, ulysses_ranks: the global ranks of the two groups, by
            their index in the group.
        mesh: ``(mesh ranks, dimension names)`` when given as a mesh.
    """

    ring_group: dist.ProcessGroup | None
    ulysses_group: dist.ProcessGroup | None
    ring_size: int
    ulysses_size: int
    ring_index: int
    ulysses_index: int
    ring_ranks: tuple[int, ...]
    ulysses_ranks: tuple[int, ...]
    mesh: tuple | None = None

    @property
    def world_size(self) -> int:
        """``R * U``: the number of shards."""
        return self.ring_size * self.ulysses_size

    @property
    def shard_index(self) -> int:
        """``i * U + j``: the shard this rank holds."""
        return self.ring_index * self.ulysses_size + self.ulysses_index

    def view(self) -> dict:
        """What this rank believes (compared between ranks by :func:`check_grid`)."""
        return {
            "ring": [_group_name(self.ring_group), list(self.ring_ranks)],
            "ulysses": [_group_name(self.ulysses_group), list(self.ulysses_ranks)],
            "i": self.ring_index,
            "j": self.ulysses_index,
            "mesh": None if self.mesh is None else [self.mesh[0], list(self.mesh[1])],
        }

    def digest(self, along: str) -> int:
        """A 62-bit digest of the group ``along`` (``"ring"`` or ``"ulysses"``)
        and the mesh: equal on every rank of that group in a consistent grid."""
        v = self.view()
        text = json.dumps([v[along], v["mesh"]]).encode()
        return (zlib.crc32(text) << 30) ^ zlib.adler32(text)


def _group_name(group: dist.ProcessGroup | None) -> str | None:
    return None if group is None else str(getattr(group, "group_name", ""))


def _group_ranks(group: dist.ProcessGroup, size: int) -> tuple[int, ...]:
    return tuple(dist.get_global_rank(group, r) for r in range(size))


def _check_group(group, name: str) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"{name} must be a torch.distributed ProcessGroup or None, got {type(group).__name__}"
        )


def _from_mesh(mesh) -> tuple:
    """``(ring group, ulysses group, mesh key)`` of a 1-D or 2-D mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise ValueError(
            f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}"
        )
    if mesh.get_coordinate() is None:
        raise ValueError("mesh: this process is not a member of the mesh")
    names = tuple(mesh.mesh_dim_names or ())
    key = (mesh.mesh.tolist(), names)
    if mesh.ndim == 1:
        return mesh.get_group(), None, key
    if mesh.ndim == 2 and sorted(names) == sorted(_DIM_NAMES):
        return mesh.get_group("ring"), mesh.get_group("ulysses"), key
    if mesh.ndim == 2:
        raise ValueError(
            f"a 2-D mesh needs mesh_dim_names=('ring', 'ulysses') (the ring between the ranks "
            f"that hold the same heads, the Ulysses groups along the other dimension), got "
            f"{names or None}"
        )
    raise ValueError(
        f"mesh must be 1-D (a ring) or 2-D with mesh_dim_names=('ring', 'ulysses'), got "
        f"{mesh.ndim} dimensions {names or ''}; slice it, e.g. mesh['ring', 'ulysses']"
    )


def resolve_topology(
    group: dist.ProcessGroup | None = None,
    ulysses_group: dist.ProcessGroup | None = None,
    mesh=None,
) -> Topology:
    """The grid of a call with ``ulysses_group`` or ``mesh`` (docs/design.md §2).

    ``group`` is then the ring between the ranks holding the same heads;
    ``None`` means no ring (pure Ulysses). Checks only this rank's
    arguments; :func:`check_grid` compares them between ranks.

    Raises:
        ValueError: ``mesh`` together with ``group``/``ulysses_group``, a mesh
            that is not 1-D or 2-D ``("ring", "ulysses")``, an argument that
            is not a group or mesh, or a group this process is not in.
    """
    if mesh is not None:
        if group is not None or ulysses_group is not None:
            raise ValueError(
                "mesh replaces group and ulysses_group: pass either mesh= or the groups, not both"
            )
        group, ulysses_group, key = _from_mesh(mesh)
    else:
        key = None
        _check_group(group, "group")
        _check_group(ulysses_group, "ulysses_group")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "ulysses_group and mesh need torch.distributed: call "
            "torch.distributed.init_process_group first"
        )
    R, i = world_info(group) if group is not None else (1, 0)
    U, j = world_info(ulysses_group) if ulysses_group is not None else (1, 0)
    me = dist.get_rank()
    return Topology(
        ring_group=group if R > 1 else None,
        ulysses_group=ulysses_group if U > 1 else None,
        ring_size=R,
        ulysses_size=U,
        ring_index=i,
        ulysses_index=j,
        ring_ranks=_group_ranks(group, R) if group is not None else (me,),
        ulysses_ranks=_group_ranks(ulysses_group, U) if ulysses_group is not None else (me,),
        mesh=key,
    )


# ---------------------------------------------------------------------------
# The one-time agreement check (through the store).

_lock = threading.Lock()
_checked: dict[tuple, Exception | None] = {}


def _ref(group: dist.ProcessGroup | None) -> weakref.ref | None:
    return None if group is None else weakref.ref(group)


def _problems(topo: Topology, me: int, views: dict[int, dict]) -> list[str]:
    mine = topo.view()
    out = []
    for rank, v in views.items():
        if v["mesh"] != mine["mesh"]:
            out.append(f"rank {rank} passed mesh {v['mesh']}, rank {me} {mine['mesh']}")
        if rank in topo.ulysses_ranks:
            if v["ulysses"] != mine["ulysses"] or v["i"] != topo.ring_index:
                out.append(
                    f"rank {rank} is in the Ulysses group {mine['ulysses'][1]} of rank {me} "
                    f"(ring index {topo.ring_index}) but passed Ulysses group {v['ulysses'][1]} "
                    f"and has ring index {v['i']}"
                )
            if len(v["ring"][1]) != topo.ring_size:
                out.append(
                    f"rank {rank} passed a ring of {len(v['ring'][1])} ranks, rank {me} one "
                    f"of {topo.ring_size}"
                )
        if rank in topo.ring_ranks:
            if v["ring"] != mine["ring"] or v["j"] != topo.ulysses_index:
                out.append(
                    f"rank {rank} is in the ring {mine['ring'][1]} of rank {me} (Ulysses "
                    f"index {topo.ulysses_index}) but passed ring {v['ring'][1]} and has Ulysses "
                    f"index {v['j']}"
                )
            if len(v["ulysses"][1]) != topo.ulysses_size:
                out.append(
                    f"rank {rank} passed a Ulysses group of {len(v['ulysses'][1])} ranks, "
                    f"rank {me} one of {topo.ulysses_size}"
                )
    return out


def _read(store, keys: list[str], timeout: datetime.timedelta, ranks: list[int]) -> list[str]:
    try:
        store.wait(keys, timeout)
    except Exception as exc:  # a peer never came: name it
        raise RuntimeError(
            f"ring_attention: ranks {ranks} did not reach the same ring_attention call within "
            f"{timeout} (their group, ulysses_group or mesh differs, or they are elsewhere): "
            f"{exc}"
        ) from None
    if hasattr(store, "multi_get"):
        return [b.decode() for b in store.multi_get(keys)]
    return [store.get(k).decode() for k in keys]


def check_grid(topo: Topology) -> None:
    """Check, once per configuration of groups, that every rank of this
    rank's row and column passed groups (or a mesh) forming the same grid.

    Two rounds through the default store: each rank writes its view and
    reads its peers', then writes what it found and reads theirs, so that a
    mismatch seen anywhere in a row or a column of the grid reaches every rank
    of it. Raises ``ValueError`` on every rank of a grid whose ranks
    disagree, ``RuntimeError`` when a peer never writes (within the store's
    timeout). Every rank must make its calls in the same order.

    The check runs once per configuration and process: a rank that passes a
    configuration it has used before while its peers pass one they have not
    is not caught here (the calls' own rounds then meet different groups).
    """
    # Weak references: the cache must not keep a group alive after
    # destroy_process_group (a live gloo group can abort the process at exit).
    key = (_ref(topo.ring_group), _ref(topo.ulysses_group), repr(topo.mesh))
    with _lock:
        if key in _checked:
            err = _checked[key]
            if err is not None:
                raise err
            return
        serial = len(_checked)
        _checked[key] = None
    me = dist.get_rank()
    peers = sorted((set(topo.ring_ranks) | set(topo.ulysses_ranks)) - {me})
    if not peers:
        return
    store = dist.distributed_c10d._get_default_store()
    timeout = getattr(store, "timeout", datetime.timedelta(seconds=300))
    prefix = f"ring_attention/grid/{serial}"
    err: Exception | None = None
    try:
        store.set(f"{prefix}/view/{me}", json.dumps(topo.view()))
        texts = _read(store, [f"{prefix}/view/{r}" for r in peers], timeout, peers)
        found = _problems(topo, me, {r: json.loads(t) for r, t in zip(peers, texts, strict=True)})
        store.set(f"{prefix}/found/{me}", "; ".join(found))
        flags = _read(store, [f"{prefix}/found/{r}" for r in peers], timeout, peers)
        if found or any(flags):
            seen = found or [f for f in flags if f]
            where = [r for r, f in zip(peers, flags, strict=True) if f] + ([me] if found else [])
            err = ValueError(
                "ring_attention: the ranks' groups do not form one ring x Ulysses grid "
                "(group, ulysses_group or mesh must describe the same grid on every rank; "
                f"found by rank(s) {sorted(where)}): {seen[0]}"
            )
    except Exception as exc:
        err = exc
    if err is not None:
        with _lock:
            _checked[key] = err
        raise err
