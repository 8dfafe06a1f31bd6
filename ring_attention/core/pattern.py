"""The attention pattern (docs/design.md §1): one frozen, hashable value, checked once at the top
and passed down unchanged (it keys the caches, the ring handshake serialises it;
``csrc/pattern.h`` is the same definition in C++)."""

import operator
import zlib
from collections.abc import Sequence
from dataclasses import InitVar, dataclass, field, replace
from typing import Any, Literal

import torch

__all__ = [
    "DENSE",
    "HEAD_OFFSETS",
    "Pattern",
    "as_flag",
    "check_documents_tensor",
    "head_group_bounds",
    "head_offset",
]

#: How head ``h`` picks its offset in a branch with dilation ``r``:
#: ``"modulo"``: ``h mod r`` (LongNet's per-head offsets, the default);
#: ``"grouped"``: ``h // ceil(heads / r)``, contiguous groups of heads share an
#: offset (torchscale's LongNet implementation).
HEAD_OFFSETS: tuple[str, ...] = ("modulo", "grouped")

HeadOffsets = Literal["modulo", "grouped"]

INT64_MAX = 2**63 - 1  # the operators' integers are int64


def head_offset(h: int, r: int, heads: int, head_offsets: str = "modulo") -> int:
    """The offset of query head ``h`` (of ``heads``) in a branch of dilation ``r``: ``h mod r``,
    or ``h // ceil(heads / r)`` for ``"grouped"``."""
    if head_offsets == "grouped":
        return h // -(-heads // r)
    return h % r


def head_group_bounds(heads: int, n_branches: int) -> list[tuple[int, int]]:
    """``[begin, end)`` of the ``n_branches`` contiguous head groups of ``head_groups=True`` (the
    first groups take the extra heads)."""
    base, extra = divmod(heads, n_branches)
    return [
        (i * base + min(i, extra), (i + 1) * base + min(i + 1, extra)) for i in range(n_branches)
    ]


def as_flag(value: Any, name: str) -> bool:
    """``value`` as a ``bool``: only ``bool`` (and NumPy's ``bool_``), else ``ValueError`` naming
    the argument (``"no"`` is truthy)."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    raise ValueError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")


def _as_index(value: Any, name: str) -> int:
    """A Python int from a Python/NumPy integer or a 0-d integer tensor."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.is_floating_point() or value.is_complex():
            raise ValueError(
                f"{name} must be an integer, got a tensor of shape {tuple(value.shape)}"
            )
        if value.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer, got a bool tensor")
        return int(value.item())
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    try:
        return operator.index(value)
    except TypeError:  # e.g. a NumPy array of several values
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _as_ints(values: Any, name: str) -> tuple[int, ...]:
    """A tuple of ints from one integer or a sequence / 1-D tensor of integers."""
    if getattr(values, "ndim", None) == 1:  # a 1-D tensor or NumPy array
        return tuple(_as_index(v, f"{name}[{i}]") for i, v in enumerate(values))
    if isinstance(values, torch.Tensor) or hasattr(values, "__index__"):
        return (_as_index(values, name),)
    if isinstance(values, (str, bytes)):
        raise ValueError(f"{name} must be a sequence of integers, got {values!r}")
    try:
        items = list(values)
    except TypeError:
        raise ValueError(
            f"{name} must be an integer or a sequence of integers, got {values!r}"
        ) from None
    return tuple(_as_index(v, f"{name}[{i}]") for i, v in enumerate(items))


@dataclass(frozen=True)
class Pattern:
    """A dilated-attention pattern (docs/design.md §1), validated at construction (``ValueError``
    naming the argument). ``segment_lengths``/``dilation_rates`` may be integers, 0-d integer
    tensors or one integer; ``documents`` is ``cu_seqlens`` (:meth:`with_documents`) or ``None``;
    ``window=None`` is ``(-1, -1)``."""

    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    causal: bool = False
    head_groups: bool = False
    head_offsets: HeadOffsets = "modulo"
    documents: tuple[int, ...] | None = None
    window: tuple[int, int] | None = None
    # documents on a device, built once; _checked: the values are a checked pattern's
    _tensors: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _checked: InitVar[bool] = False

    def __post_init__(self, _checked: bool) -> None:
        if _checked:
            return
        segs = _as_ints(self.segment_lengths, "segment_lengths")
        dils = _as_ints(self.dilation_rates, "dilation_rates")
        if not segs:
            raise ValueError(
                "segment_lengths must not be empty: a pattern needs at least one branch"
            )
        if len(segs) != len(dils):
            raise ValueError(
                f"segment_lengths and dilation_rates must have the same length, got "
                f"{len(segs)} segment_lengths and {len(dils)} dilation_rates"
            )
        for i, (w, r) in enumerate(zip(segs, dils, strict=True)):
            if w < 1:
                raise ValueError(f"segment_lengths[{i}] must be >= 1, got {w}")
            if w > INT64_MAX:  # the operators take int64
                raise ValueError(
                    f"segment_lengths[{i}] must be at most 2**63 - 1 (a segment longer than "
                    f"any sequence behaves as one of that length), got {w}"
                )
            if r < 1:
                raise ValueError(f"dilation_rates[{i}] must be >= 1, got {r}")
            if r > w:
                raise ValueError(
                    f"dilation_rates[{i}] must be <= segment_lengths[{i}] = {w}, got {r}"
                )
        if self.head_offsets not in HEAD_OFFSETS:
            raise ValueError(
                f"head_offsets must be one of {list(HEAD_OFFSETS)}, got {self.head_offsets!r}"
            )
        set_ = object.__setattr__
        set_(self, "segment_lengths", segs)
        set_(self, "dilation_rates", dils)
        set_(self, "causal", as_flag(self.causal, "causal"))
        set_(self, "head_groups", as_flag(self.head_groups, "head_groups"))
        if self.documents is not None:
            set_(self, "documents", _check_documents(self.documents))
        set_(self, "window", _check_window(self.window))

    @property
    def n_branches(self) -> int:
        """Number of branches."""
        return len(self.segment_lengths)

    @property
    def windowed(self) -> bool:
        """Whether a sliding window restricts the pattern."""
        return self.window != (-1, -1)

    @property
    def branches(self) -> tuple[tuple[int, int], ...]:
        """``((w_0, r_0), (w_1, r_1), ...)``."""
        return tuple(zip(self.segment_lengths, self.dilation_rates, strict=True))

    def with_documents(self, cu_seqlens: Any) -> "Pattern":
        """This pattern on a packed sequence with boundaries ``cu_seqlens`` (``None``: one
        document)."""
        if cu_seqlens is None:
            return self if self.documents is None else self._replace(documents=None)
        return self._replace(documents=_check_documents(cu_seqlens))

    def _replace(self, **changes: Any) -> "Pattern":
        """A copy with checked ``changes``; the other values are not checked again."""
        return replace(self, **changes, _checked=True)

    def check_heads(self, heads: int) -> None:
        """``head_groups=True`` needs at least one head per branch."""
        if self.head_groups and heads < self.n_branches:
            raise ValueError(
                f"head_groups=True needs at least as many heads as branches: "
                f"got {heads} heads and {self.n_branches} branches"
            )

    def check_length(self, seq_len: int) -> None:
        """The documents must end where the sequence does."""
        if self.documents is not None and self.documents[-1] != seq_len:
            raise ValueError(
                f"cu_seqlens must end at the sequence length {seq_len}, got "
                f"cu_seqlens[-1] = {self.documents[-1]}"
            )

    def applies(self, branch: int, heads: int) -> list[int]:
        """The heads branch ``branch`` applies to."""
        if not self.head_groups:
            return list(range(heads))
        return list(range(*head_group_bounds(heads, self.n_branches)[branch]))

    def offset(self, h: int, branch: int, heads: int) -> int:
        """The dilation offset of head ``h`` in branch ``branch``."""
        return head_offset(h, self.dilation_rates[branch], heads, self.head_offsets)

    def offset_classes(self, heads: int) -> list[dict[int, list[int]]]:
        """Per branch, ``{offset: query heads}`` over the heads the branch applies to."""
        self.check_heads(heads)
        classes = []
        for i in range(self.n_branches):
            by_offset: dict[int, list[int]] = {}
            for h in self.applies(i, heads):
                by_offset.setdefault(self.offset(h, i, heads), []).append(h)
            classes.append(by_offset)
        return classes

    def branch_offsets(self, heads: int) -> list[dict[int, int]]:
        """Per branch, ``{offset: number of query heads with that offset}``."""
        return [{o: len(hs) for o, hs in c.items()} for c in self.offset_classes(heads)]

    def documents_tensor(self, device: torch.device | str) -> torch.Tensor | None:
        """``documents`` as an int64 tensor on ``device`` (built once per device)."""
        if self.documents is None:
            return None
        if torch.compiler.is_compiling():  # a constant of the graph, not a cached tensor
            return torch.tensor(self.documents, dtype=torch.int64, device=device)
        key = str(device)
        if key not in self._tensors:
            self._tensors[key] = torch.tensor(self.documents, dtype=torch.int64, device=device)
        return self._tensors[key]

    def digest(self) -> int:
        """A stable 63-bit digest of the value (the same in every process)."""
        text = repr((self.segment_lengths, self.dilation_rates, self.causal, self.head_groups,
                     self.head_offsets, self.documents,
                     *(() if self.window == (-1, -1) else (self.window,)))).encode()  # fmt: skip
        return (zlib.crc32(text) << 31) ^ zlib.adler32(text)

    def describe(self) -> str:
        """A short human-readable description (error messages)."""
        s = f"segment_lengths={list(self.segment_lengths)} "
        s += f"dilation_rates={list(self.dilation_rates)}"
        s += " causal" * self.causal + " head_groups" * self.head_groups
        if self.head_offsets != "modulo":
            s += f" head_offsets={self.head_offsets}"
        if self.documents is not None:
            s += f" documents={len(self.documents) - 1}"
        if self.windowed:
            s += f" window=({self.window[0]},{self.window[1]})"
        return s


def _check_window(window: Any) -> tuple[int, int]:
    """``window`` as ``(left, right)``, each an integer ``>= -1``; only a tuple or list (a set's
    order is not the sides')."""
    if window is None:
        return (-1, -1)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(
            "window must be (left, right), a tuple or list of two integers >= -1 (-1: "
            f"unbounded), got {window!r} ({type(window).__name__})"
        )
    sides = []
    for i, x in enumerate(window):
        x = _as_index(x, f"window[{i}]")
        if x < -1:
            raise ValueError(f"window[{i}] must be >= -1 (-1: unbounded), got {x}")
        if x > INT64_MAX:
            raise ValueError(f"window[{i}] must be at most 2**63 - 1, got {x}")
        sides.append(x)
    return (sides[0], sides[1])


def check_documents_tensor(cu_seqlens: torch.Tensor) -> None:
    """A ``cu_seqlens`` tensor is 1-D and integer (what a traced call can check)."""
    if cu_seqlens.dim() != 1:
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor, got shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must have an integer dtype, got {cu_seqlens.dtype}")


def _check_documents(cu_seqlens: Any) -> tuple[int, ...]:
    """``cu_seqlens`` as a tuple of ints: 1-D integer, starting at 0, non-decreasing (tensors
    checked vectorised, sequences in Python so they trace)."""
    if not isinstance(cu_seqlens, torch.Tensor) and type(cu_seqlens).__module__ == "numpy":
        cu_seqlens = torch.as_tensor(cu_seqlens)
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.device.type == "meta":
            raise ValueError("cu_seqlens must hold values: got a tensor on the meta device")
        check_documents_tensor(cu_seqlens)
        cu = cu_seqlens.detach().to("cpu", torch.int64)
        if cu.numel() == 0 or int(cu[0]) != 0:
            _bad_documents(cu[:1].tolist())
        drops = torch.nonzero(cu[1:] < cu[:-1])
        if drops.numel():
            i = int(drops[0])
            _bad_documents(cu[i : i + 2].tolist(), i)
        return tuple(cu.tolist())
    if not isinstance(cu_seqlens, Sequence) or isinstance(cu_seqlens, (str, bytes)):
        raise ValueError(
            f"cu_seqlens must be a 1-D integer tensor, got {type(cu_seqlens).__name__}"
        )
    if not all(type(x) is int for x in cu_seqlens):
        cu_seqlens = [_as_index(v, f"cu_seqlens[{i}]") for i, v in enumerate(cu_seqlens)]
    for i, x in enumerate(cu_seqlens):
        if not -INT64_MAX - 1 <= x <= INT64_MAX:
            raise ValueError(f"cu_seqlens[{i}] must fit in int64, got {x}")
    if not cu_seqlens or cu_seqlens[0] != 0:
        _bad_documents(list(cu_seqlens[:1]))
    for i in range(1, len(cu_seqlens)):
        if cu_seqlens[i] < cu_seqlens[i - 1]:
            _bad_documents(list(cu_seqlens[i - 1 : i + 1]), i - 1)
    return tuple(cu_seqlens)


def _bad_documents(values: list[int], at: int = 0) -> None:
    """Raise for boundaries ``values`` (from ``cu_seqlens[at]`` on)."""
    if not values:
        raise ValueError("cu_seqlens must not be empty: it starts with 0 and ends at seq")
    if at == 0 and values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {values[0]}")
    raise ValueError(
        f"cu_seqlens must be non-decreasing, got cu_seqlens[{at}] = {values[0]} > "
        f"cu_seqlens[{at + 1}] = {values[1]}"
    )


#: One segment longer than any sequence, every row active: dense attention.
DENSE = Pattern((2**62,), (1,))
