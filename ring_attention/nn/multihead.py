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
input projections (both ``multihead_call.py``) -> one attention path ->
output projection (``multihead_paths.py``), laid out as
``nn.MultiheadAttention`` lays out its output for the same call. The
constructor's own options (pattern, ``compute_dtype``) are
``multihead_options.py``'s. This file owns the class: its constructor,
properties, copying and scripting, and the choice between
``nn.MultiheadAttention.forward`` and its own path. The paths (both exact):

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
  ``log(multiplicity)`` bias (``ring_attention.core.multiplicity``).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..core.pattern import as_flag
from .multihead_call import checked_call
from .multihead_checks import MultiheadAttentionError
from .multihead_options import check_options
from .multihead_paths import dense_path, kernel_attention, outputs

__all__ = ["MultiheadAttentionError", "MultiheadDilatedAttention"]


def _keep_forward(module: nn.Module, args: tuple) -> None:
    """A no-op forward pre-hook. ``nn.TransformerEncoderLayer`` in inference
    skips its fused kernel (which reads the projection weights and computes
    *dense* attention in their dtype, bypassing ``self_attn.forward``) when a
    submodule has hooks. A module with a pattern, a ``group`` or a
    ``compute_dtype`` registers this hook so that its own ``forward`` is always
    the one that runs; a plain module does not, and the layer keeps PyTorch's
    fused path."""
    return None


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
        window: ``(left, right)``, a sliding window on the pattern (on dense
            attention without one): query ``t`` reaches key ``u`` only if
            ``t - left <= u <= t + right`` (``-1``: unbounded; ``None``: none).

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
        window: tuple[int, int] | None = None,
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
        self.pattern = check_options(
            num_heads, segment_lengths, dilation_rates, head_groups, head_offsets,
            group is not None or ulysses_group is not None or mesh is not None,
            add_bias_kv, add_zero_attn, compute_dtype, window,
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
        call = checked_call(
            self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
        )
        if call.kernels:
            out, weights = kernel_attention(self, call, cu_seqlens), None
        else:
            out, weights = dense_path(self, call, need_weights, cu_seqlens)
        return outputs(self, out, weights, call, average_attn_weights)
