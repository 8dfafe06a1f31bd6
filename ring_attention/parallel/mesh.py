"""Which ranks attend together (docs/design.md §2, §6): :func:`world_info`,
:class:`Topology` and :func:`check_grid`, once per configuration."""

import dataclasses
import datetime
import json
import os
import threading
import weakref
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch.distributed as dist

from .comm import global_ranks

_DIM_NAMES = ("ring", "ulysses")


def world_info(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(world_size, rank)`` of ``group``; ``(1, 0)`` without a process group
    (``RuntimeError`` where ``WORLD_SIZE`` > 1)."""
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("group was given but torch.distributed is not initialised; call "
                             "torch.distributed.init_process_group first (or pass "
                             "group=None)")  # fmt: skip
        try:
            launched = int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            launched = 1
        if launched > 1:
            raise RuntimeError(f"WORLD_SIZE={launched} is set (a launcher such as torchrun started "
                               f"{launched} processes) but torch.distributed is not initialised, "
                               "so each process would compute the whole sequence alone: call "
                               "torch.distributed.init_process_group first (or unset WORLD_SIZE "
                               "to run one process)")  # fmt: skip
        return 1, 0
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    return world, rank


@dataclass(frozen=True, eq=False)
class Topology:
    """The grid of one call, seen from this rank: the ring and the Ulysses
    group, their sizes, this rank's indices, ranks, orders and ``mode``."""

    ring_group: dist.ProcessGroup | None
    ulysses_group: dist.ProcessGroup | None
    ring_size: int
    ulysses_size: int
    ring_index: int
    ulysses_index: int
    ring_ranks: tuple[int, ...]
    ulysses_ranks: tuple[int, ...]
    mesh: tuple | None = None
    ring_order: tuple[int, ...] | None = None
    ulysses_order: tuple[int, ...] | None = None
    mode: str = "grid"

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
        mesh = None if self.mesh is None else [self.mesh[0], list(self.mesh[1])]
        return {"mode": self.mode, "ring": [_group_name(self.ring_group), list(self.ring_ranks)],
                "ulysses": [_group_name(self.ulysses_group), list(self.ulysses_ranks)],
                "i": self.ring_index, "j": self.ulysses_index, "mesh": mesh}  # fmt: skip

    def digest(self, along: str) -> int:
        """A 62-bit digest of the group ``along`` (``"ring"`` or ``"ulysses"``)
        and the mesh: equal on every rank of that group in a consistent grid."""
        v = self.view()
        return digest_of(json.dumps([v[along], v["mesh"]]))


def digest_of(text: str) -> int:
    """A 62-bit digest of ``text`` (equal texts, equal digests on every rank)."""
    return (zlib.crc32(text.encode()) << 30) ^ zlib.adler32(text.encode())


def _group_name(group: dist.ProcessGroup | None) -> str | None:
    return None if group is None else str(getattr(group, "group_name", ""))


def group_order(group: dist.ProcessGroup | None, ranks: tuple[int, ...]) -> tuple[int, ...] | None:
    """The group rank of each of ``ranks``, ``None`` where it is the index."""
    if group is None or len(ranks) < 2:
        return None
    order = tuple(dist.get_group_rank(group, r) for r in ranks)
    return None if order == tuple(range(len(ranks))) else order


def check_group(group, name: str) -> None:
    """``ValueError`` unless ``group`` is a ``ProcessGroup`` or ``None``."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"{name} must be a torch.distributed ProcessGroup or None, got "
                         f"{type(group).__name__}")  # fmt: skip


def _from_mesh(mesh) -> tuple:
    """``(ring group, ulysses group, i, j, ring ranks, ulysses ranks, key)``."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got "
                         f"{type(mesh).__name__}")  # fmt: skip
    coord = mesh.get_coordinate()
    if coord is None:
        raise ValueError("mesh: this process is not a member of the mesh")
    names = tuple(mesh.mesh_dim_names or ())
    ranks = mesh.mesh
    key = (ranks.tolist(), names)
    if mesh.ndim == 1:
        return mesh.get_group(), None, coord[0], 0, tuple(ranks.tolist()), None, key
    if mesh.ndim == 2 and sorted(names) == sorted(_DIM_NAMES):
        r, u = names.index("ring"), names.index("ulysses")
        i, j = coord[r], coord[u]
        return (mesh.get_group("ring"), mesh.get_group("ulysses"), i, j,
                tuple(ranks.select(u, j).tolist()), tuple(ranks.select(r, i).tolist()),
                key)  # fmt: skip
    if mesh.ndim == 2:
        raise ValueError(f"a 2-D mesh needs mesh_dim_names=('ring', 'ulysses') (the ring between "
                         "the ranks that hold the same heads, the Ulysses groups along the other "
                         f"dimension), got {names or None}")  # fmt: skip
    raise ValueError(f"mesh must be 1-D (a ring) or 2-D with mesh_dim_names=('ring', 'ulysses'), "
                     f"got {mesh.ndim} dimensions {names or ''}; slice it, e.g. "
                     "mesh['ring', 'ulysses']")  # fmt: skip


def resolve_topology(group: dist.ProcessGroup | None = None,
                     ulysses_group: dist.ProcessGroup | None = None,
                     mesh=None) -> Topology:  # fmt: skip
    """The grid of a call with ``ulysses_group`` or ``mesh``, from this rank's
    arguments only; ``ValueError`` for a bad mesh or group."""
    if mesh is not None:
        if group is not None or ulysses_group is not None:
            raise ValueError("mesh replaces group and ulysses_group: pass either mesh= or the "
                             "groups, not both")  # fmt: skip
        group, ulysses_group, i, j, ring_ranks, ulysses_ranks, key = _from_mesh(mesh)
        R, U = len(ring_ranks), len(ulysses_ranks or (0,))
    else:
        key = None
        check_group(group, "group")
        check_group(ulysses_group, "ulysses_group")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("ulysses_group and mesh need torch.distributed: call "
                         "torch.distributed.init_process_group first")  # fmt: skip
    me = dist.get_rank()
    if mesh is None:
        R, i = world_info(group) if group is not None else (1, 0)
        U, j = world_info(ulysses_group) if ulysses_group is not None else (1, 0)
        ring_ranks = global_ranks(group, R) if group is not None else (me,)
        ulysses_ranks = global_ranks(ulysses_group, U) if ulysses_group is not None else None
    ulysses_ranks = ulysses_ranks or (me,)
    ring = group if R > 1 else None
    uly = ulysses_group if U > 1 else None
    return Topology(ring_group=ring, ulysses_group=uly, ring_size=R, ulysses_size=U, ring_index=i,
                    ulysses_index=j, ring_ranks=ring_ranks, ulysses_ranks=ulysses_ranks, mesh=key,
                    ring_order=group_order(ring, ring_ranks), mode="grid" if U > 1 else "ring",
                    ulysses_order=group_order(uly, ulysses_ranks))  # fmt: skip


# The one-time agreement check through the store (docs/design.md §6): per rank
# and round a view, what it found and the outcome, under ``ring_attention/grid``.

_PREFIX = "ring_attention/grid"
_lock = threading.Lock()


@dataclass
class _State:
    """The check's state in this process, for one default process group."""

    rounds: int = 0  # rounds this process has run
    calls: int = 0  # calls with peers this process has made (checked before or not)
    next_round: dict[int, int] = field(default_factory=dict)  # peer -> its next unread round
    # _key -> the other fields of a topology that passed, last used last (its groups are
    # the key's weak references: a live gloo group can abort the process at exit)
    checked: OrderedDict = field(default_factory=OrderedDict)
    rings: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)


_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _state() -> _State:
    pg = dist.distributed_c10d._get_default_group()
    with _lock:
        return _states.setdefault(pg, _State())


def _key(topo: Topology) -> tuple:
    refs = (None if g is None else weakref.ref(g) for g in (topo.ring_group, topo.ulysses_group))
    return (*refs, repr(topo.mesh), topo.ring_ranks, topo.ulysses_ranks, topo.mode)


_MODES = {"ring": "a ring call (group= only, or a 1-D mesh)",
          "grid": "a call with ulysses_group= or a 2-D mesh"}  # fmt: skip


def _problem(topo: Topology, me: int, views: dict[int, dict]) -> str:
    """The first disagreement of the peers' ``views`` with this rank's ("": none)."""
    mine = topo.view()
    for rank, v in views.items():
        if v["mode"] != mine["mode"]:
            return (f"rank {rank} is in {_MODES[v['mode']]}, rank {me} in {_MODES[mine['mode']]} "
                    "(a rank in another call: every rank must make the same call)")  # fmt: skip
        if v["mesh"] != mine["mesh"]:
            return f"rank {rank} passed mesh {v['mesh']}, rank {me} {mine['mesh']}"
        for group, index, other, name, at, of in (
                ("ulysses", "i", "ring", "Ulysses group", "ring index", "a ring"),
                ("ring", "j", "ulysses", "ring", "Ulysses index", "a Ulysses group")):  # fmt: skip
            if rank not in (topo.ulysses_ranks if group == "ulysses" else topo.ring_ranks):
                continue
            if v[group] != mine[group] or v[index] != mine[index]:
                return (f"rank {rank} is in the {name} {mine[group][1]} of rank {me} ({at} "
                        f"{mine[index]}) but passed {name} {v[group][1]} and has {at} "
                        f"{v[index]}")  # fmt: skip
            if len(v[other][1]) != len(mine[other][1]):
                return (f"rank {rank} passed {of} of {len(v[other][1])} ranks, rank {me} one "
                        f"of {len(mine[other][1])}")  # fmt: skip
    return ""


def _read(store, keys: list[str], ranks: list[int]) -> list[str]:
    timeout = getattr(store, "timeout", datetime.timedelta(seconds=300))
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


def _next_view(store, st: _State, peer: int, me: int, call: int) -> tuple[int, dict]:
    """The peer's round this rank meets in its ``call``-th call, and its view."""
    j = st.next_round.get(peer, 0)
    while True:
        (text,) = _read(store, [f"{_PREFIX}/{peer}/{j}/view"], [peer])
        view = json.loads(text)
        if view.get("error") is not None:
            if view["call"] == call:
                break
        elif me in view["peers"]:
            break
        elif view["call"] == call:  # held with others in this call: did it fail?
            (done,) = _read(store, [f"{_PREFIX}/{peer}/{j}/done"], [peer])
            if done:  # then it is the mismatch this rank meets
                break
        j += 1
    st.next_round[peer] = j + 1
    return j, view


def _open_round(st: _State, me: int, view: dict) -> tuple:
    """A new round of this rank: its view written; the store and the round's key."""
    store = dist.distributed_c10d._get_default_store()
    with _lock:
        mine = f"{_PREFIX}/{me}/{st.rounds}"
        st.rounds += 1
    store.set(f"{mine}/view", json.dumps(view))
    return store, mine


def _round(st: _State, topo: Topology, me: int, peers: list[int], call: int) -> str:
    """One check; the error every rank raises ("" when the grid agrees)."""
    store, mine = _open_round(st, me, {**topo.view(), "peers": peers, "call": call})
    views, at, text = {}, {}, ""
    for p in peers:
        at[p], views[p] = _next_view(store, st, p, me, call)
        if views[p].get("error") is not None and not text:
            text = f"ring_attention: rank {p} failed: {views[p]['error']}"
    found = "" if text else _problem(topo, me, views)
    if found:
        text = ("ring_attention: the ranks' groups do not form one ring x Ulysses grid "
                "(group, ulysses_group or mesh must describe the same grid on every rank; "
                f"found by rank {me}): {found}")  # fmt: skip
    store.set(f"{mine}/found", text)
    if not text:
        flags = _read(store, [f"{_PREFIX}/{p}/{at[p]}/found" for p in peers], peers)
        text = next((f for f in flags if f), "")
    store.set(f"{mine}/done", text)
    return text


def check_grid(topo: Topology) -> None:
    """Check, once per configuration, that this rank's row and column form
    the same grid: ``ValueError`` on every rank, ``RuntimeError`` for a silent peer."""
    me = dist.get_rank()
    peers = sorted((set(topo.ring_ranks) | set(topo.ulysses_ranks)) - {me})
    if not peers:
        return
    st = _state()
    key = _key(topo)
    with _lock:
        st.calls += 1
        call = st.calls
        if key in st.checked:
            st.checked.move_to_end(key)
            return
    text = _round(st, topo, me, peers, call)
    if text:
        raise ValueError(text)
    with _lock:
        st.checked[key] = {f.name: getattr(topo, f.name) for f in dataclasses.fields(topo)
                           if f.name not in ("ring_group", "ulysses_group")}  # fmt: skip


def check_ring(group: dist.ProcessGroup | None) -> None:
    """:func:`check_grid` of a plain ring call over ``group``, without building its
    topology once the group has passed."""
    g = group if group is not None else dist.distributed_c10d._get_default_group()
    st = _state()
    with _lock:
        key = st.rings.get(g)
        if key is not None and key in st.checked:
            st.calls += 1
            st.checked.move_to_end(key)
            return
    R, _ = world_info(group)
    ranks, me = global_ranks(g, R), dist.get_rank()
    topo = Topology(ring_group=g, ulysses_group=None, ring_size=R, ulysses_size=1,
                    ring_index=ranks.index(me), ulysses_index=0, ring_ranks=ranks,
                    ulysses_ranks=(me,), ring_order=group_order(g, ranks), mode="ring")  # fmt: skip
    check_grid(topo)
    with _lock:
        st.rings[g] = _key(topo)


def report_grid_error(group, ulysses_group, mesh, error: BaseException,
                      mode: str | None = None) -> Topology | None:  # fmt: skip
    """Tell the peers of a rank whose grid arguments failed (``error``): the
    last checked configuration that fits, else ``None`` after a failure record."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    want = None
    if mesh is not None:
        try:
            want = _key(resolve_topology(None, None, mesh))
        except ValueError:
            pass
    st = _state()
    with _lock:
        st.calls += 1
        entries = list(reversed(st.checked.items()))
    for key, fields in entries:
        refs = key[:2]  # (_key: the groups' weak references first)
        groups = [None if r is None else r() for r in refs]
        if any(r is not None and g is None for r, g in zip(refs, groups, strict=True)):
            continue  # a group no longer exists
        t = Topology(ring_group=groups[0], ulysses_group=groups[1], **fields)
        if mode is not None and want is None and t.mode != mode:
            continue
        if mesh is not None:
            fits = want is None or _key(t) == want
        else:
            fits = all(
                have is given if isinstance(given, dist.ProcessGroup) else
                not (given is None and have is not None)
                for given, have in ((group, t.ring_group), (ulysses_group, t.ulysses_group))
            )  # fmt: skip
        if fits:
            return t
    # a round of a rank that cannot know its peers: a failure record
    why = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
    me = dist.get_rank()
    store, mine = _open_round(st, me, {"error": why, "peers": None, "call": st.calls})
    text = f"ring_attention: rank {me} failed: {why}"
    store.set(f"{mine}/found", text)
    store.set(f"{mine}/done", text)
    return None
