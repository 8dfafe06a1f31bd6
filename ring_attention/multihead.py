"""``MultiheadDilatedAttention``: ``torch.nn.MultiheadAttention`` with exact
dilated attention (docs/design.md §1) and sequence sharding.

The class derives from ``nn.MultiheadAttention``. With no pattern, no
``group`` and no ``compute_dtype`` its ``forward`` *is*
``nn.MultiheadAttention.forward`` (the only change: the ``AssertionError`` it
raises for a bad argument becomes :class:`MultiheadAttentionError`, which is
also a ``ValueError``), so outputs, weights, gradients, dropout, output
strides, the fused inference path, nested tensors, warnings and errors are
PyTorch's own.

Otherwise ``forward`` reads: checks in ``nn.MultiheadAttention``'s order and
words (``multihead_checks.py``; through the ring's handshake when sharded) ->
input projections -> one attention path -> output projection, laid out as
``nn.MultiheadAttention`` lays out its output for the same call. The paths
(both exact):

- **kernels**: the C++ operators, O(n) memory for a dilated pattern —
  ``ring_attention.attend`` on one process, ``ring_attention.ring_attention``
  when ``group`` is set. Used whenever they apply: query and key of the same
  length, no ``attn_mask`` (an ``is_causal`` hint counts as none), no
  ``add_bias_kv``/``add_zero_attn``, a boolean (or no) ``key_padding_mask``,
  ``need_weights=False`` and no dropout in training.
- **dense**: everything else (attention weights, float or boolean
  ``attn_mask``, float ``key_padding_mask``, ``add_bias_kv``,
  ``add_zero_attn``, cross-attention of different lengths, dropout in
  training). It materialises the ``(batch, heads, L, S)`` scores like
  ``nn.MultiheadAttention``, the pattern entering as an additive
  ``log(multiplicity)`` bias (``ring_attention.multiplicity``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .dense import dense_attention
from .dtypes import select_dtype, supported_dtypes
from .functional import attend
from .multihead_checks import (
    MultiheadAttentionError,
    canonical_mask,
    check_attn_mask_shape,
    check_dims,
    check_key_padding_mask_shape,
    check_key_value,
    check_mask_dtype,
    check_separate_weights,
    fast_path_reason,
    nested_error,
)
from .pattern import Pattern, as_flag
from .ring import ring_attention
from .ulysses import reject_sharded

__all__ = ["MultiheadAttentionError", "MultiheadDilatedAttention"]

#: A pattern whose one segment is longer than any sequence: dense attention.
_DENSE = Pattern((2**62,), (1,))

_CAUSAL_HINT_ERROR = (
    "Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
    "method `generate_square_subsequent_mask` to create this mask."
)


def _keep_forward(module: nn.Module, args: tuple) -> None:
    """A no-op forward pre-hook. ``nn.TransformerEncoderLayer`` in inference
    skips its fused kernel (which reads the projection weights and computes
    *dense* attention in their dtype, bypassing ``self_attn.forward``) when a
    submodule has hooks. A module with a pattern, a ``group`` or a
    ``compute_dtype`` registers this hook so that its own ``forward`` is always
    the one that runs; a plain module does not, and the layer keeps PyTorch's
    fused path."""
    return None


def _views(
    fn: Callable[[torch.Tensor], torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fn`` applied to ``q``, ``k``, ``v``, keeping which of them are the
    same tensor (the projections, as PyTorch's, depend on it)."""
    q2 = fn(q)
    k2 = q2 if k is q else fn(k)
    v2 = k2 if v is k else (q2 if v is q else fn(v))
    return q2, k2, v2


class _Call(NamedTuple):
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


class MultiheadDilatedAttention(nn.MultiheadAttention):
    """Drop-in replacement for ``torch.nn.MultiheadAttention`` with optional
    exact dilated attention and sequence sharding.

    It is an ``nn.MultiheadAttention``: same constructor, parameters,
    initialisation, state-dict keys, ``forward`` signature and return value.
    With no pattern, no ``group`` and no ``compute_dtype`` it runs
    ``nn.MultiheadAttention.forward`` itself, so nothing observable changes
    (inside ``nn.Transformer*`` too, fused inference paths and nested tensors
    included); a bad argument raises the same error with the same message, as
    :class:`MultiheadAttentionError` (an ``AssertionError`` that is also a
    ``ValueError``) where PyTorch raises ``AssertionError``. One check of its
    own: the flags (``bias``, ``add_bias_kv``, ``add_zero_attn``,
    ``batch_first``, ``head_groups``; ``need_weights``,
    ``average_attn_weights``, ``is_causal``) are ``bool`` (``ValueError``
    naming the flag), where ``nn.MultiheadAttention`` takes any truthy value.

    Args:
        embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim,
        vdim, batch_first, device, dtype: as for ``nn.MultiheadAttention``.
        segment_lengths, dilation_rates: a dilated pattern (both or neither).
            ``None``: dense attention.
        head_groups: branch ``i`` of the pattern applies only to head group
            ``i`` (docs/design.md §1).
        head_offsets: ``"modulo"`` (head ``h`` starts at ``h mod r``) or
            ``"grouped"`` (torchscale's contiguous head groups).
        group: a ``torch.distributed`` process group: ``query``/``key``/
            ``value`` and the output are then this rank's shard of the
            sequence (``torch.tensor_split`` convention, ``ra.shard_sequence``;
            sequence dimension per ``batch_first``). Projections are local;
            attention runs as ring attention over the group (with no pattern:
            dense over the global sequence). Not supported with ``group``:
            ``attn_mask`` (except as the ``is_causal`` hint, which is not
            read), ``need_weights=True``, ``key_padding_mask``, dropout in
            training, key/query of different lengths, ``add_bias_kv``,
            ``add_zero_attn``, nested tensors — each raises ``ValueError``
            naming the argument, on every rank (the checks go through the
            ring's handshake). Every rank must call ``forward`` (and the
            backward) together.
        ulysses_group, mesh: head-parallel (Ulysses) or ring x Ulysses
            sharding, as for ``ra.ring_dilated_attention`` (``group`` is then
            the ring, ``None`` = none); the same restrictions as ``group``.
        compute_dtype: dtype of the attention core: ``None`` (that of the
            projected inputs), ``"auto"`` (``ra.select_dtype(device)``:
            bfloat16 on Ampere and newer, float16 on 7.x, float32 on older
            GPUs and the CPU) or one of the kernels' dtypes (float32,
            float64, float16, bfloat16; others raise ``ValueError`` naming
            ``compute_dtype``). Projected q/k/v are cast to it and the
            attention output cast back before ``out_proj``.

    With a pattern, a ``group`` or a ``compute_dtype`` the module computes
    attention itself. Argument checks, their order, exception types and
    messages, the output's memory layout (strides), the dropout random stream
    and which nested-tensor inputs are accepted stay those of
    ``nn.MultiheadAttention`` (its checks are those of its general path: where
    it would run its fused inference kernel, which checks shapes in C++ with
    its own words, this path never does); the differences:

    - The attention of each head is the multiset softmax of docs/design.md §1:
      query ``t`` attends to key ``u`` with weight
      ``M[h, t, u] * exp(s_tu - lse_t)``, ``M`` the number of branches reaching
      ``u`` from ``t``. ``query`` and ``key`` must have the same length
      (``ValueError``).
    - ``is_causal=True`` (with an ``attn_mask``, as for
      ``nn.MultiheadAttention``) makes the pattern causal when the hint is
      used (no ``key_padding_mask``, ``need_weights=False``); otherwise the
      given ``attn_mask`` is applied on top of the pattern.
    - ``attn_mask`` (bool or float, ``(L, S)`` or ``(batch * heads, L, S)``)
      is applied on top of the pattern through the exact dense path.
    - ``need_weights=True`` returns the exact pattern weights, a dense
      ``(batch, heads, L, S)`` matrix (averaged over heads when
      ``average_attn_weights``); it is computed only when asked.
    - ``dropout > 0`` in training drops attention probabilities (after the
      softmax, before multiplying with V, as ``nn.MultiheadAttention`` does,
      with the same random stream); it uses the exact dense path (O(L*S)
      memory per head).
    - The keys added by ``add_bias_kv`` and ``add_zero_attn`` are reached by
      every query once (multiplicity 1); they use the dense path.
    - A query that reaches no key (all its keys masked) gets a zero output and
      zero weights, never NaN (``nn.MultiheadAttention`` gives NaN there).
    - Inference never takes PyTorch's fused kernels (they compute dense
      attention): ``nn.TransformerEncoderLayer`` is kept off its fused path
      by a no-op forward pre-hook. Nested-tensor inputs (as
      ``nn.TransformerEncoder`` makes them in inference with a
      ``src_key_padding_mask``) are attended as padded sequences with the
      padding masked, and returned nested.

    Performance: as for ``nn.MultiheadAttention``, ``need_weights`` defaults
    to ``True``, which materialises the dense ``(batch, heads, L, S)`` weights.
    Pass ``need_weights=False`` (``nn.Transformer*Layer`` does) to get the
    C++ op, O(L) memory for a dilated pattern.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
        *,
        segment_lengths: Sequence[int] | None = None,
        dilation_rates: Sequence[int] | None = None,
        head_groups: bool = False,
        head_offsets: str = "modulo",
        group: dist.ProcessGroup | None = None,
        ulysses_group: dist.ProcessGroup | None = None,
        mesh=None,
        compute_dtype: torch.dtype | str | None = None,
    ) -> None:
        for name, flag in (("bias", bias), ("add_bias_kv", add_bias_kv),
                           ("add_zero_attn", add_zero_attn), ("batch_first", batch_first),
                           ("head_groups", head_groups)):  # fmt: skip
            as_flag(flag, name)
        try:
            super().__init__(
                embed_dim, num_heads, dropout, bias, add_bias_kv, add_zero_attn, kdim, vdim,
                batch_first, device, dtype,
            )  # fmt: skip
        except AssertionError as e:
            raise MultiheadAttentionError(*e.args).with_traceback(e.__traceback__) from None
        self.pattern = _check_extensions(
            num_heads, segment_lengths, dilation_rates, head_groups, head_offsets,
            group is not None or ulysses_group is not None or mesh is not None,
            add_bias_kv, add_zero_attn, compute_dtype,
        )  # fmt: skip
        self.group = group
        self.ulysses_group = ulysses_group
        self.mesh = mesh
        self.compute_dtype = compute_dtype
        if not self._is_plain():
            self.register_forward_pre_hook(_keep_forward)

    def __deepcopy__(self, memo):
        # A process group is shared, not copied (it cannot be), so that e.g.
        # nn.TransformerEncoder can clone a layer holding a sharded module.
        for shared in (self.group, self.ulysses_group, self.mesh):
            if shared is not None:
                memo[id(shared)] = shared
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            object.__setattr__(new, name, copy.deepcopy(value, memo))
        return new

    def __prepare_scriptable__(self) -> nn.Module:
        """``torch.jit.script`` support. With no pattern, ``group`` or
        ``compute_dtype`` the module is ``nn.MultiheadAttention``, and scripts
        as one: ``torch.jit.script`` compiles an ``nn.MultiheadAttention``
        that shares this module's parameters, buffers and submodules (and,
        as for any ``__prepare_scriptable__``, puts it in this module's place
        inside a parent module being scripted). With them the attention runs
        the C++ operators from Python, which TorchScript cannot compile:
        ``RuntimeError`` (``torch.compile`` and ``torch.export`` work)."""
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
        """Inputs and outputs are this rank's sequence shard (``group``,
        ``ulysses_group`` or ``mesh``)."""
        return self.group is not None or self.ulysses_group is not None or self.mesh is not None

    @property
    def has_pattern(self) -> bool:
        """Whether a dilated pattern was given (``False``: dense attention)."""
        return self.pattern is not None

    @property
    def segment_lengths(self) -> tuple[int, ...] | None:
        return None if self.pattern is None else self.pattern.segment_lengths

    @property
    def dilation_rates(self) -> tuple[int, ...] | None:
        return None if self.pattern is None else self.pattern.dilation_rates

    @property
    def head_groups(self) -> bool:
        return self.pattern is not None and self.pattern.head_groups

    def extra_repr(self) -> str:
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}"
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self.batch_first:
            s += ", batch_first=True"
        if self.pattern is not None:
            s += ", " + self.pattern.describe().replace(" ", ", ")
        if self._sharded:
            s += ", group=<sharded>"
        if self.compute_dtype is not None:
            s += f", compute_dtype={self.compute_dtype}"
        return s

    # -- forward -------------------------------------------------------------
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        cu_seqlens: torch.Tensor | Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention as ``nn.MultiheadAttention.forward``.

        Args:
            query: ``(L, E)`` unbatched, ``(L, N, E)``, or ``(N, L, E)`` with
                ``batch_first``.
            key, value: ``(S, kdim/vdim)`` / ``(S, N, ·)`` / ``(N, S, ·)``.
            key_padding_mask: ``(N, S)`` (``(S,)`` unbatched), bool (``True`` =
                ignore) or float (added to the scores).
            need_weights: also return the attention weights.
            attn_mask: ``(L, S)`` or ``(N * num_heads, L, S)``, bool (``True``
                = not allowed) or float (added).
            average_attn_weights: average the returned weights over heads.
            is_causal: hint that ``attn_mask`` is the causal mask (requires
                ``attn_mask``); with no ``key_padding_mask`` and
                ``need_weights=False`` causal attention is computed and
                ``attn_mask`` is not read.
            cu_seqlens: keyword only; document boundaries of a packed
                sequence, ``[0, e_1, ..., L]`` (self-attention, query and key of
                equal length; with ``group=`` GLOBAL boundaries, the same on
                every rank): every document starts its own segments and no
                query reaches another document (docs/design.md §1).

        Returns:
            ``(attn_output, attn_weights)``; ``attn_weights`` is ``None`` when
            ``need_weights=False``, else ``(N, L, S)`` averaged or
            ``(N, num_heads, L, S)`` (no batch dimension when unbatched).

        Raises:
            MultiheadAttentionError: where ``nn.MultiheadAttention`` raises
                ``AssertionError``, with its message.
            RuntimeError: where it raises ``RuntimeError`` (``is_causal``
                without ``attn_mask``, an ``attn_mask`` of the wrong shape).
            ValueError: for what only this module checks (a flag that is not
                a ``bool``, ``group=`` restrictions, query and key of
                different lengths with a pattern).
        """
        for name, flag in (("need_weights", need_weights),
                           ("average_attn_weights", average_attn_weights),
                           ("is_causal", is_causal)):  # fmt: skip
            as_flag(flag, name)
        if self._is_plain() and cu_seqlens is None:
            try:
                return super().forward(
                    query, key, value, key_padding_mask, need_weights, attn_mask,
                    average_attn_weights, is_causal,
                )  # fmt: skip
            except AssertionError as e:
                raise MultiheadAttentionError(*e.args).with_traceback(e.__traceback__) from None
        call = self._checked_call(
            query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
        )
        if call.kernels:
            out, weights = self._kernel_attention(call, cu_seqlens), None
        else:
            out, weights = self._dense_attention(call, need_weights, cu_seqlens)
        return self._outputs(out, weights, call, average_attn_weights)

    def _call_pattern(self, call: _Call, cu_seqlens) -> Pattern:
        """The pattern of one call: the module's (dense when it has none),
        causal per the ``is_causal`` hint, with the call's documents."""
        pattern = self.pattern if self.pattern is not None else _DENSE
        if call.causal != pattern.causal:
            pattern = replace(pattern, causal=call.causal)
        if cu_seqlens is not None and call.q.shape[1] != call.k.shape[1]:
            raise ValueError(
                "cu_seqlens needs query and key of the same sequence length (self-attention), "
                f"got {call.q.shape[1]} and {call.k.shape[1]}"
            )
        return pattern.with_documents(cu_seqlens)

    # -- checks --------------------------------------------------------------
    def _checked_call(
        self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
    ) -> _Call:
        """Check and project one call; when sharded, a failure here makes
        every rank raise (it is reported through the ring's handshake)."""
        if not self._sharded:
            return self._check_call(
                query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
            )
        try:
            return self._check_call(
                query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
            )
        except Exception:
            reject_sharded(self.group, self.ulysses_group, self.mesh)
            raise

    def _check_call(
        self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
    ) -> _Call:
        """The steps of ``nn.MultiheadAttention.forward`` and
        ``F.multi_head_attention_forward`` up to the attention itself, in
        their order, then this module's own checks."""
        float_masks = (attn_mask is not None and torch.is_floating_point(attn_mask)) or (
            key_padding_mask is not None and torch.is_floating_point(key_padding_mask)
        )
        query.dim()  # read first, as PyTorch does (a non-tensor fails here, with its error)
        for name, mask in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
            if isinstance(mask, torch.Tensor) and mask.is_meta and not query.is_meta:
                raise ValueError(f"{name} must be on query's device {query.device}, got meta")
        kpm = canonical_mask(
            key_padding_mask, "key_padding_mask", attn_mask, "attn_mask", query.dtype
        )
        am = canonical_mask(attn_mask, "attn_mask", None, "", query.dtype)
        bool_kpm = None if kpm is None or key_padding_mask.is_floating_point() else key_padding_mask
        reason = fast_path_reason(self, query, key, value, kpm, am, float_masks)
        # Where nn.MultiheadAttention runs its fused kernel (or would, but for
        # make_fx tracing) its output is a contiguous (N, L, E) tensor.
        batch_major = not reason and self.in_proj_bias is not None
        lengths = None
        if query.is_nested or key.is_nested or value.is_nested:
            if not batch_major:
                raise nested_error(reason)
            if self._sharded:
                raise ValueError(
                    "nested tensors are not supported with group= (sequence-sharded "
                    "MultiheadDilatedAttention)"
                )
            # Self-attention without masks (the fused path's conditions):
            # attend the padded batch with the padding masked.
            lengths = [int(t.shape[0]) for t in query.unbind()]
            query = key = value = torch.nested.to_padded_tensor(query, 0.0)
            bool_kpm = torch.arange(query.shape[1], device=query.device) >= torch.tensor(
                lengths, device=query.device
            ).unsqueeze(1)
            kpm = canonical_mask(bool_kpm, "key_padding_mask", None, "", query.dtype)

        batched = check_dims(query, key, value, kpm, am, self.num_heads)
        if not batched:  # each on its own, as PyTorch (the projections then split three ways)
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            kpm = None if kpm is None else kpm.unsqueeze(0)
            bool_kpm = None if bool_kpm is None else bool_kpm.unsqueeze(0)
        elif self.batch_first:
            query, key, value = _views(lambda t: t.transpose(0, 1), query, key, value)
        # Now (L, N, E) as F.multi_head_attention_forward sees them.
        L, B, _ = query.shape
        S = key.shape[0]
        # F.multi_head_attention_forward canonicalises it again (and may warn again).
        kpm = canonical_mask(kpm, "key_padding_mask", am, "attn_mask", query.dtype)
        if is_causal and attn_mask is None:
            raise RuntimeError(_CAUSAL_HINT_ERROR)
        # nn.MultiheadAttention: the hint replaces attn_mask only when nothing
        # else needs the explicit mask.
        causal = bool(is_causal and kpm is None and not need_weights)
        if causal:
            am = None
        check_key_value(query, key, value, self)
        if not self._qkv_same_embed_dim:
            check_separate_weights(self, key, value)
        # Projected as PyTorch projects (the same errors), then (N, L, E) views.
        q, k, v = (t.transpose(0, 1) for t in self._project(query, key, value))
        if am is not None:
            check_attn_mask_shape(am, B, self.num_heads, L, S)
        if key.shape[1] != B:  # (PyTorch fails in a reshape here)
            raise RuntimeError(
                f"key and value must have the batch size of query ({B}), got key of shape "
                f"{tuple(key.shape)} in (seq, batch, features) order"
            )
        extra_keys = int(self.bias_k is not None) + int(self.add_zero_attn)
        if kpm is not None:
            check_key_padding_mask_shape(kpm, B, S, extra_keys)
        check_mask_dtype(kpm, am, q.dtype, need_weights)

        # This module's own checks.
        if self.has_pattern and L != S:
            raise ValueError(
                "with a dilated pattern (segment_lengths/dilation_rates), query and key must have "
                f"the same sequence length, got L={L} and S={S}"
            )
        if self._sharded:
            self._check_group_call(need_weights, am, kpm, L, S)
        kernels = self._sharded or (
            not need_weights
            and am is None
            and not extra_keys
            and L == S
            and (kpm is None or bool_kpm is not None)
            and not (self.training and self.dropout > 0)
        )
        return _Call(q, k, v, bool_kpm, kpm, am, batched, causal, kernels, batch_major, lengths)

    def _check_group_call(self, need_weights, attn_mask, key_padding_mask, L, S) -> None:
        where = "with group= (sequence-sharded MultiheadDilatedAttention)"
        if need_weights:
            raise ValueError(f"need_weights=True is not supported {where}; pass need_weights=False")
        if attn_mask is not None:
            raise ValueError(
                f"attn_mask is not supported {where} (for causal attention pass is_causal=True "
                "with any attn_mask as the hint)"
            )
        if key_padding_mask is not None:
            raise ValueError(f"key_padding_mask is not supported {where}")
        if self.training and self.dropout > 0:
            raise ValueError(
                f"dropout={self.dropout} in training is not supported {where}; "
                "use dropout=0 or eval()"
            )
        if L != S:
            raise ValueError(
                f"key must have the same local sequence length as query {where} (no "
                f"cross-attention), got {L} and {S}"
            )

    # -- attention paths -----------------------------------------------------
    def _project(self, query, key, value):
        """Input projections, split as ``F.multi_head_attention_forward``
        splits them (one, two or three matrix products)."""
        E = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        if not self._qkv_same_embed_dim:
            return (
                F.linear(query, self.q_proj_weight, bq),
                F.linear(key, self.k_proj_weight, bk),
                F.linear(value, self.v_proj_weight, bv),
            )
        w = self.in_proj_weight
        if key is value:
            if query is key:
                return F.linear(query, w, b).chunk(3, dim=-1)
            k, v = F.linear(key, w[E:], None if b is None else b[E:]).chunk(2, dim=-1)
            return F.linear(query, w[:E], bq), k, v
        wq, wk, wv = w.chunk(3)
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    def _compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        if self.compute_dtype is None:
            return x.dtype
        if self.compute_dtype == "auto":
            return select_dtype(x.device)
        return self.compute_dtype

    def _kernel_attention(self, call: _Call, cu_seqlens) -> torch.Tensor:
        """The C++ operators on the ``(batch, seq, embed)`` projections: one
        process, or the ring when sharded."""
        B, L, E = call.q.shape
        cdt = self._compute_dtype(call.q)
        # Contiguous: the projections are (L, N, E)-major views, and the
        # operators' Meta kernels (torch.compile) give their outputs the
        # inputs' strides while the CPU/CUDA kernels return contiguous ones.
        q, k, v = (
            t.reshape(B, L, self.num_heads, self.head_dim).to(cdt).contiguous()
            for t in (call.q, call.k, call.v)
        )
        if self._sharded:  # pattern errors are reported on every rank
            out = ring_attention(
                q, k, v, lambda: self._call_pattern(call, cu_seqlens), group=self.group,
                ulysses_group=self.ulysses_group, mesh=self.mesh,
            )  # fmt: skip
        else:
            out = attend(
                q, k, v, self._call_pattern(call, cu_seqlens), key_padding_mask=call.bool_kpm
            )
        return out.reshape(B, L, E)

    def _dense_attention(self, call: _Call, need_weights: bool, cu_seqlens):
        pattern = self.pattern
        if pattern is not None or cu_seqlens is not None:
            pattern = self._call_pattern(call, cu_seqlens)
        return dense_attention(
            call.q,
            call.k,
            call.v,
            num_heads=self.num_heads,
            compute_dtype=self._compute_dtype(call.q),
            key_padding_mask=call.kpm,
            attn_mask=call.attn_mask,
            causal=call.causal,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
            bias_k=self.bias_k,
            bias_v=self.bias_v,
            add_zero_attn=self.add_zero_attn,
            pattern=pattern,
        )

    def _outputs(self, out, weights, call: _Call, average_attn_weights: bool):
        """The output projection and the return values, in the memory layout
        ``nn.MultiheadAttention`` gives them: a contiguous ``(N, L, E)`` where
        it runs its fused kernel, else projected as ``(L, N, E)`` (a transposed
        view of that with ``batch_first``)."""
        B, L, E = out.shape
        out = out.to(call.q.dtype)
        if call.batch_major:
            y = self.out_proj(out)
        else:
            y = self.out_proj(out.transpose(0, 1).reshape(L * B, E)).view(L, B, E)
            if not call.batched:
                y = y.squeeze(1)
            elif self.batch_first:
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


def _check_extensions(
    num_heads, segment_lengths, dilation_rates, head_groups, head_offsets, sharded, add_bias_kv,
    add_zero_attn, compute_dtype,
) -> Pattern | None:  # fmt: skip
    """The checks of the constructor's own arguments; the pattern (``None``:
    dense)."""
    if (segment_lengths is None) != (dilation_rates is None):
        raise ValueError(
            "segment_lengths and dilation_rates must be given together (or both None for "
            f"dense attention), got segment_lengths={segment_lengths!r} and "
            f"dilation_rates={dilation_rates!r}"
        )
    pattern = None
    if segment_lengths is not None:
        pattern = Pattern(
            segment_lengths, dilation_rates, head_groups=head_groups, head_offsets=head_offsets
        )
        pattern.check_heads(num_heads)
    kernels = supported_dtypes(torch.device("cpu"))  # the same on every device
    if not (
        compute_dtype is None
        or (isinstance(compute_dtype, str) and compute_dtype == "auto")
        or (isinstance(compute_dtype, torch.dtype) and compute_dtype in kernels)
    ):
        allowed = ", ".join(str(d) for d in kernels)
        raise ValueError(
            f'compute_dtype must be None, "auto" or one of {allowed}, got {compute_dtype!r}'
        )
    if sharded and (add_bias_kv or add_zero_attn):
        which = "add_bias_kv" if add_bias_kv else "add_zero_attn"
        raise ValueError(f"{which}=True is not supported with group= (sequence sharding)")
    return pattern
