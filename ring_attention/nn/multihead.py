"""``MultiheadDilatedAttention``: ``torch.nn.MultiheadAttention`` with exact
dilated attention and sequence sharding (docs/modules.md)."""

import copy
from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..core.checks import supported_dtypes
from ..core.dtypes import select_dtype
from ..core.pattern import DENSE, Pattern, as_flag
from ..local.functional import attend
from ..parallel.ring import sharded_ring
from ..parallel.ulysses import reject_sharded, sharded_attention
from .dense import dense_attention
from .multihead_checks import (
    MultiheadAttentionError,
    canonical_mask,
    check_attn_mask_shape,
    check_dims,
    check_key_padding_mask_shape,
    check_key_value,
    check_mask_dtype,
    fast_path_reason,
)


def _keep_forward(module: nn.Module, args: tuple) -> None:
    """A no-op hook: ``nn.TransformerEncoderLayer`` then skips its fused kernel."""


class MultiheadDilatedAttention(nn.MultiheadAttention):
    """Drop-in ``torch.nn.MultiheadAttention`` with optional exact dilated
    attention, sequence sharding (``group``, ``ulysses_group``, ``mesh``) and
    ``compute_dtype`` (docs/modules.md); ``need_weights=False`` runs the kernels."""

    def __init__(
        self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
        add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: int | None = None,
        vdim: int | None = None, batch_first: bool = False, device=None, dtype=None, *,
        segment_lengths: Sequence[int] | None = None,
        dilation_rates: Sequence[int] | None = None, head_groups: bool = False,
        head_offsets: str = "modulo", group: dist.ProcessGroup | None = None,
        ulysses_group: dist.ProcessGroup | None = None, mesh=None,
        compute_dtype: torch.dtype | str | None = None, window: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        for name in ("bias", "add_bias_kv", "add_zero_attn", "batch_first", "head_groups"):
            as_flag(locals()[name], name)
        try:
            super().__init__(
                embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim,
                batch_first, device, dtype)  # fmt: skip
        except AssertionError as e:
            raise MultiheadAttentionError(*e.args).with_traceback(e.__traceback__) from None
        self.group, self.ulysses_group, self.mesh = group, ulysses_group, mesh
        self.pattern = _check_options(
            num_heads, segment_lengths, dilation_rates, head_groups, head_offsets, self._sharded,
            add_bias_kv, add_zero_attn, compute_dtype, window)  # fmt: skip
        self.compute_dtype = compute_dtype
        if not self._is_plain():
            self.register_forward_pre_hook(_keep_forward)

    def __deepcopy__(self, memo):
        # Process groups are shared, not copied (nn.TransformerEncoder clones layers).
        shared = (self.group, self.ulysses_group, self.mesh)
        memo.update({id(g): g for g in shared if g is not None})
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            object.__setattr__(new, name, copy.deepcopy(value, memo))
        return new

    def __prepare_scriptable__(self) -> nn.Module:
        """``torch.jit.script``: a plain module scripts as the
        ``nn.MultiheadAttention`` it is; any other raises ``RuntimeError``."""
        if not self._is_plain():
            raise RuntimeError(
                "torch.jit.script: a MultiheadDilatedAttention with a pattern, group= or "
                "compute_dtype cannot be scripted (its attention calls the C++ operators from "
                "Python); use torch.compile or torch.export, or script one without them"
            )
        plain = nn.MultiheadAttention.__new__(nn.MultiheadAttention)
        plain.__dict__.update(self.__dict__)  # the same parameter, buffer, module dicts
        return plain

    def _is_plain(self) -> bool:
        """No pattern, group or compute_dtype: ``nn.MultiheadAttention`` itself."""
        return self.pattern is None and not self._sharded and self.compute_dtype is None

    @property
    def _sharded(self) -> bool:
        """Inputs and outputs are this rank's sequence shard."""
        return self.group is not None or self.ulysses_group is not None or self.mesh is not None

    has_pattern = property(lambda s: s.pattern is not None, doc="Whether a pattern was given.")

    segment_lengths = property(lambda s: None if s.pattern is None else s.pattern.segment_lengths)
    dilation_rates = property(lambda s: None if s.pattern is None else s.pattern.dilation_rates)
    head_groups = property(lambda s: s.pattern is not None and s.pattern.head_groups)

    def extra_repr(self) -> str:
        p, cdt = self.pattern, self.compute_dtype
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"
            + (f", dropout={self.dropout}" if self.dropout else "")
            + (", batch_first=True" if self.batch_first else "")
            + ("" if p is None else ", " + p.describe().replace(" ", ", "))
            + (", group=<sharded>" if self._sharded else "")
            + ("" if cdt is None else f", compute_dtype={cdt}"))  # fmt: skip

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
        attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
        is_causal: bool = False, *, cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """``nn.MultiheadAttention.forward``: ``(attn_output, attn_weights or
        None)``; ``cu_seqlens``: document boundaries of a packed self-attention
        (with ``group=``: GLOBAL, the same on every rank)."""
        for name, flag in (("need_weights", need_weights),
                           ("average_attn_weights", average_attn_weights),
                           ("is_causal", is_causal)):  # fmt: skip
            as_flag(flag, name)
        if self._is_plain() and cu_seqlens is None:
            try:
                return super().forward(
                    query, key, value, key_padding_mask, need_weights, attn_mask,
                    average_attn_weights, is_causal)  # fmt: skip
            except AssertionError as e:
                raise MultiheadAttentionError(*e.args).with_traceback(e.__traceback__) from None
        try:  # sharded: a failure is reported through the ring's handshake, on every rank
            call = _check_call(
                self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
            )
        except Exception as exc:
            if self._sharded:
                reject_sharded(self.group, self.ulysses_group, self.mesh, exc)
            raise
        if call.kernels:
            out, weights = _kernel_attention(self, call, cu_seqlens), None
        else:
            pattern = self.pattern
            if pattern is not None or cu_seqlens is not None:
                pattern = _call_pattern(self, call, cu_seqlens)
            out, weights = dense_attention(
                call.q, call.k, call.v, num_heads=self.num_heads,
                compute_dtype=_compute_dtype(self, call.q), key_padding_mask=call.kpm,
                attn_mask=call.attn_mask, causal=call.causal,
                dropout_p=self.dropout if self.training else 0.0, need_weights=need_weights,
                bias_k=self.bias_k, bias_v=self.bias_v, add_zero_attn=self.add_zero_attn,
                pattern=pattern)  # fmt: skip
        return outputs(self, out, weights, call, average_attn_weights)


def _check_options(
    num_heads, segment_lengths, dilation_rates, head_groups, head_offsets, sharded, add_bias_kv,
    add_zero_attn, compute_dtype, window,
) -> Pattern | None:  # fmt: skip
    """The checks of the constructor's own arguments; the pattern (``None``: dense)."""
    if (segment_lengths is None) != (dilation_rates is None):
        raise ValueError(
            "segment_lengths and dilation_rates must be given together (or both None for "
            f"dense attention), got segment_lengths={segment_lengths!r} and "
            f"dilation_rates={dilation_rates!r}")  # fmt: skip
    pattern = None
    if segment_lengths is not None:
        pattern = Pattern(segment_lengths, dilation_rates, head_groups=head_groups,
                          head_offsets=head_offsets, window=window)  # fmt: skip
        pattern.check_heads(num_heads)
    elif window is not None:  # a sliding window on dense attention
        pattern = replace(DENSE, window=window)
        if not pattern.windowed:
            pattern = None
    kernels = supported_dtypes(torch.device("cpu"))  # the same on every device
    ok = compute_dtype is None or (isinstance(compute_dtype, str) and compute_dtype == "auto")
    if not (ok or (isinstance(compute_dtype, torch.dtype) and compute_dtype in kernels)):
        allowed = ", ".join(str(d) for d in kernels)
        raise ValueError(
            f'compute_dtype must be None, "auto" or one of {allowed}, got {compute_dtype!r}'
        )
    if sharded and (add_bias_kv or add_zero_attn):
        which = "add_bias_kv" if add_bias_kv else "add_zero_attn"
        raise ValueError(f"{which}=True is not supported with group= (sequence sharding)")
    return pattern


def _module_pattern(m: MultiheadDilatedAttention, causal: bool) -> Pattern:
    """The module's pattern (dense without one), causal per the call's hint."""
    pattern = m.pattern if m.pattern is not None else DENSE
    return pattern if causal == pattern.causal else replace(pattern, causal=causal)


def _call_pattern(m: MultiheadDilatedAttention, call: "Call", cu_seqlens) -> Pattern:
    """The pattern of one call: the module's, with the call's documents."""
    pattern = _module_pattern(m, call.causal)
    if cu_seqlens is not None and call.q.shape[1] != call.k.shape[1]:
        raise ValueError(
            "cu_seqlens needs query and key of the same sequence length (self-attention), "
            f"got {call.q.shape[1]} and {call.k.shape[1]}")  # fmt: skip
    return pattern.with_documents(cu_seqlens)


def _compute_dtype(m: MultiheadDilatedAttention, x: torch.Tensor) -> torch.dtype:
    """The attention core's dtype for projections ``x``."""
    cdt = m.compute_dtype
    return x.dtype if cdt is None else (select_dtype(x.device) if cdt == "auto" else cdt)


class Call(NamedTuple):
    """One checked call of the module's own path."""

    q: torch.Tensor  # projections, (batch, seq, embed)
    k: torch.Tensor
    v: torch.Tensor
    bool_kpm: torch.Tensor | None  # the key_padding_mask when bool (the kernels take it)
    kpm: torch.Tensor | None  # additive key_padding_mask (the dense path)
    attn_mask: torch.Tensor | None  # additive; None when the is_causal hint replaces it
    batched: bool
    causal: bool
    kernels: bool  # the C++ operators apply (else: the dense path)
    batch_major: bool  # nn.MultiheadAttention would return a contiguous (N, L, E) output
    lengths: list[int] | None  # the sequence lengths of a nested-tensor input


def _check_call(
    m: MultiheadDilatedAttention, query, key, value, key_padding_mask, need_weights, attn_mask,
    is_causal,
) -> Call:  # fmt: skip
    """PyTorch's checks up to the attention, in its order, then this module's
    own checks and the choice of path."""
    masks = (attn_mask, key_padding_mask)
    float_masks = any(t is not None and torch.is_floating_point(t) for t in masks)
    query.dim()  # read first, as PyTorch does (a non-tensor fails here, with its error)
    for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        if isinstance(mask, torch.Tensor) and mask.is_meta and not query.is_meta:
            raise ValueError(f"{name} must be on query's device {query.device}, got meta")
    kpm = canonical_mask(key_padding_mask, "key_padding_mask", attn_mask, "attn_mask", query.dtype)
    am = canonical_mask(attn_mask, "attn_mask", None, "", query.dtype)
    bool_kpm = None if kpm is None or key_padding_mask.is_floating_point() else key_padding_mask
    reason = fast_path_reason(m, query, key, value, kpm, am, float_masks)
    # Where nn.MultiheadAttention runs its fused kernel its output is a contiguous (N, L, E).
    batch_major = not reason and m.in_proj_bias is not None
    lengths = None
    if query.is_nested or key.is_nested or value.is_nested:
        if not batch_major:
            raise MultiheadAttentionError(
                "MultiheadAttention does not support NestedTensor outside of its fast path. "
                f"The fast path was not hit because {reason}")  # fmt: skip
        if m._sharded:
            raise ValueError(
                "nested tensors are not supported with group= (sequence-sharded "
                "MultiheadDilatedAttention)")  # fmt: skip
        # Self-attention without masks: the padded batch with the padding masked.
        lengths = [int(t.shape[0]) for t in query.unbind()]
        query = key = value = torch.nested.to_padded_tensor(query, 0.0)
        ends = torch.tensor(lengths, device=query.device).unsqueeze(1)
        bool_kpm = torch.arange(query.shape[1], device=query.device) >= ends
        kpm = canonical_mask(bool_kpm, "key_padding_mask", None, "", query.dtype)

    batched = check_dims(query, key, value, kpm, am, m.num_heads)
    if not batched:  # each on its own, as PyTorch (the projections then split three ways)
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        kpm = None if kpm is None else kpm.unsqueeze(0)
        bool_kpm = None if bool_kpm is None else bool_kpm.unsqueeze(0)
    elif m.batch_first:  # keeping which are the same tensor (the projections depend on it)
        q2 = query.transpose(0, 1)
        k2 = q2 if key is query else key.transpose(0, 1)
        value = k2 if value is key else (q2 if value is query else value.transpose(0, 1))
        query, key = q2, k2
    L, B, _ = query.shape  # now (L, N, E) as F.multi_head_attention_forward sees them
    S = key.shape[0]
    # F.multi_head_attention_forward canonicalises it again (and may warn again).
    kpm = canonical_mask(kpm, "key_padding_mask", am, "attn_mask", query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError(
            "Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
            "method `generate_square_subsequent_mask` to create this mask.")  # fmt: skip
    # The hint replaces attn_mask only when nothing else needs the explicit mask.
    causal = bool(is_causal and kpm is None and not need_weights)
    if causal:
        am = None
    check_key_value(query, key, value, m)
    # Projected as PyTorch projects (the same errors), then (N, L, E) views.
    q, k, v = (t.transpose(0, 1) for t in _project(m, query, key, value))
    if am is not None:
        check_attn_mask_shape(am, B, m.num_heads, L, S)
    if key.shape[1] != B:  # (PyTorch fails in a reshape here)
        raise RuntimeError(
            f"key and value must have the batch size of query ({B}), got key of shape "
            f"{tuple(key.shape)} in (seq, batch, features) order")  # fmt: skip
    extra_keys = int(m.bias_k is not None) + int(m.add_zero_attn)
    if kpm is not None:
        check_key_padding_mask_shape(kpm, B, S, extra_keys)
    check_mask_dtype(kpm, am, q.dtype, need_weights)
    # this module's own checks
    if m.has_pattern and L != S:
        raise ValueError(
            "with a dilated pattern (segment_lengths/dilation_rates), query and key must have "
            f"the same sequence length, got L={L} and S={S}")  # fmt: skip
    if m._sharded:
        _check_group_call(m, need_weights, am, kpm, L, S)
    kernels = m._sharded or (
        not need_weights
        and am is None
        and not extra_keys
        and L == S
        and (kpm is None or bool_kpm is not None)
        and not (m.training and m.dropout > 0)
    )
    return Call(q, k, v, bool_kpm, kpm, am, batched, causal, kernels, batch_major, lengths)


def _check_group_call(m, need_weights, attn_mask, key_padding_mask, L, S) -> None:
    where = "with group= (sequence-sharded MultiheadDilatedAttention)"
    for bad, message in (
        (need_weights, f"need_weights=True is not supported {where}; pass need_weights=False"),
        (attn_mask is not None, f"attn_mask is not supported {where} (for causal attention pass "
                                "is_causal=True with any attn_mask as the hint)"),
        (key_padding_mask is not None, f"key_padding_mask is not supported {where}"),
        (m.training and m.dropout > 0, f"dropout={m.dropout} in training is not supported "
                                       f"{where}; use dropout=0 or eval()"),
        (L != S, f"key must have the same local sequence length as query {where} (no "
                 f"cross-attention), got {L} and {S}"),
    ):  # fmt: skip
        if bad:
            raise ValueError(message)


def _project(m: MultiheadDilatedAttention, query, key, value):
    """Input projections, split as ``F.multi_head_attention_forward`` splits
    them (one, two or three matrix products)."""
    E, b, w = m.embed_dim, m.in_proj_bias, m.in_proj_weight
    bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
    if m._qkv_same_embed_dim and key is value:
        if query is key:
            return F.linear(query, w, b).chunk(3, dim=-1)
        k, v = F.linear(key, w[E:], None if b is None else b[E:]).chunk(2, dim=-1)
        return F.linear(query, w[:E], bq), k, v
    ws = w.chunk(3) if w is not None else (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)
    return tuple(map(F.linear, (query, key, value), ws, (bq, bk, bv)))


def _kernel_attention(m: MultiheadDilatedAttention, call: Call, cu_seqlens) -> torch.Tensor:
    """The C++ operators on the ``(batch, seq, embed)`` projections: one
    process, or the ring when sharded."""
    B, L, E = call.q.shape
    cdt = _compute_dtype(m, call.q)
    # Contiguous: the Meta kernels (torch.compile) keep the inputs' strides.
    q, k, v = (
        t.reshape(B, L, m.num_heads, m.head_dim).to(cdt).contiguous()
        for t in (call.q, call.k, call.v)
    )
    if m._sharded:  # pattern errors are reported on every rank
        out = sharded_attention(
            q, k, v, _module_pattern, (m, call.causal), cu_seqlens=cu_seqlens, scale=None,
            group=m.group, ulysses_group=m.ulysses_group, mesh=m.mesh, layout="contiguous",
            return_lse=False, ring=sharded_ring)  # fmt: skip
    else:
        out = attend(q, k, v, _call_pattern(m, call, cu_seqlens), key_padding_mask=call.bool_kpm)
    return out.reshape(B, L, E)


def outputs(m: MultiheadDilatedAttention, out, weights, call: Call, average_attn_weights: bool):
    """The output projection and the return values, in the memory layout
    ``nn.MultiheadAttention`` gives them."""
    B, L, E = out.shape
    out = out.to(call.q.dtype)
    if call.batch_major:
        y = m.out_proj(out)
    else:
        y = m.out_proj(out.transpose(0, 1).reshape(L * B, E)).view(L, B, E)
        if not call.batched:
            y = y.squeeze(1)
        elif m.batch_first:
            y = y.transpose(0, 1)
    if call.lengths is not None:
        y = torch.nested.as_nested_tensor(
            [y[i, :n] for i, n in enumerate(call.lengths)], layout=torch.strided
        )
    if weights is not None:
        weights = weights.to(call.q.dtype)
        if call.lengths is not None:  # padding queries: no weights, as the fused path
            weights = weights.masked_fill(call.bool_kpm[:, None, :, None], 0.0)
        if average_attn_weights:
            weights = weights.mean(dim=1)
        if not call.batched:
            weights = weights.squeeze(0)
    return y, weights
