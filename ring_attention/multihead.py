"""``MultiheadDilatedAttention``: a drop-in replacement for
``torch.nn.MultiheadAttention`` with exact dilated attention (docs/design.md
§1) and sequence sharding.

``forward`` reads: checks (through the ring's handshake when sharded) ->
input projections -> one attention path -> output projection. The paths (all
exact):

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
from collections.abc import Sequence
from dataclasses import replace
from typing import ClassVar, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.init import constant_, xavier_normal_, xavier_uniform_
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from ._comm import world_info
from .dense import dense_attention
from .dtypes import select_dtype
from .functional import attend
from .handshake import reject
from .pattern import Pattern
from .ring import ring_attention

__all__ = ["MultiheadDilatedAttention"]

#: A pattern whose one segment is longer than any sequence: dense attention.
_DENSE = Pattern((2**62,), (1,))


def _block_mha_fastpath(module: nn.Module, args: tuple) -> None:
    """A no-op forward pre-hook. ``nn.TransformerEncoderLayer`` skips its fused
    inference kernel (which reads the projection weights and computes *dense*
    attention itself, bypassing ``self_attn.forward``) when its submodules have
    hooks; a dilated or sharded ``MultiheadDilatedAttention`` registers this
    hook so that its ``forward`` is always the one that runs."""
    return None


_CAUSAL_HINT_ERROR = (
    "Need attn_mask if specifying the is_causal hint. You may use the Transformer module "
    "method `generate_square_subsequent_mask` to create this mask."
)


def _check_mask_dtype(mask: torch.Tensor | None, name: str) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name} must be a bool or floating tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not torch.is_floating_point(mask):
        raise ValueError(f"{name} must have dtype torch.bool or a floating dtype, got {mask.dtype}")


class _Call(NamedTuple):
    """One checked ``forward`` call, inputs as ``(batch, seq, features)``."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_padding_mask: torch.Tensor | None
    attn_mask: torch.Tensor | None
    batched: bool
    causal: bool
    kernels: bool  # the C++ operators apply (else: the dense path)


class MultiheadDilatedAttention(nn.Module):
    """Drop-in replacement for ``torch.nn.MultiheadAttention`` with optional
    exact dilated attention and sequence sharding.

    Constructor, parameter names/shapes/initialisation, state-dict keys and the
    ``forward`` signature and return value are those of
    ``nn.MultiheadAttention``, so ``load_state_dict`` works both ways and a
    model keeps working unchanged. With no pattern the module computes dense
    attention and matches ``nn.MultiheadAttention`` numerically, masks, biases,
    ``add_zero_attn``, ``is_causal`` (a hint that needs ``attn_mask``) and
    dropout included.

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
            ``add_zero_attn`` — each raises ``ValueError`` naming the argument,
            on every rank (the checks go through the ring's handshake). Every
            rank must call ``forward`` (and the backward) together.
        compute_dtype: dtype of the attention core: ``None`` (that of the
            projected inputs), ``"auto"`` (``ra.select_dtype(device)``:
            bfloat16 on Ampere and newer, float16 on 7.x, float32 on older
            GPUs and the CPU) or a ``torch.dtype``. Projected q/k/v are cast to
            it and the attention output cast back before ``out_proj``.

    Semantics with a pattern:

    - The attention of each head is the multiset softmax of docs/design.md §1:
      query ``t`` attends to key ``u`` with weight
      ``M[h, t, u] * exp(s_tu - lse_t)``, ``M`` the number of branches reaching
      ``u`` from ``t``. ``query`` and ``key`` must have the same length.
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
      softmax, before multiplying with V, as ``nn.MultiheadAttention`` does),
      reproducibly under ``torch.manual_seed``; it uses the exact dense path
      (O(L*S) memory per head).
    - The keys added by ``add_bias_kv`` and ``add_zero_attn`` are reached by
      every query once (multiplicity 1); they use the dense path.
    - A query that reaches no key (all its keys masked) gets a zero output and
      zero weights, never NaN (``nn.MultiheadAttention`` gives NaN there).

    Performance: as for ``nn.MultiheadAttention``, ``need_weights`` defaults
    to ``True``, which materialises the dense ``(batch, heads, L, S)`` weights.
    Pass ``need_weights=False`` (``nn.Transformer*Layer`` does) to get the
    C++ op, O(L) memory for a dilated pattern.

    ``nn.TransformerEncoderLayer`` in inference mode would compute dense
    attention from this module's weights itself (its fused fast path); a
    module with a pattern or a ``group`` disables that path with a no-op
    forward pre-hook. Nested-tensor inputs are not supported: with
    ``nn.TransformerEncoder``, build it with ``enable_nested_tensor=False``.
    """

    __constants__: ClassVar[list[str]] = ["batch_first"]
    bias_k: torch.Tensor | None
    bias_v: torch.Tensor | None

    # nn.TransformerEncoderLayer's inference fast path calls self_attn.merge_masks.
    merge_masks = nn.MultiheadAttention.merge_masks

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
        compute_dtype: torch.dtype | str | None = None,
    ) -> None:
        pattern = _check_constructor(
            embed_dim, num_heads, dropout, segment_lengths, dilation_rates, head_groups,
            head_offsets, group, add_bias_kv, add_zero_attn, compute_dtype,
        )  # fmt: skip
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads

        # Same creation order as nn.MultiheadAttention, so the same seed gives
        # the same initial parameters.
        if not self._qkv_same_embed_dim:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory_kwargs))
            self.k_proj_weight = nn.Parameter(torch.empty((embed_dim, self.kdim), **factory_kwargs))
            self.v_proj_weight = nn.Parameter(torch.empty((embed_dim, self.vdim), **factory_kwargs))
            self.register_parameter("in_proj_weight", None)
        else:
            self.in_proj_weight = nn.Parameter(
                torch.empty((3 * embed_dim, embed_dim), **factory_kwargs)
            )
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory_kwargs))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(
            embed_dim, embed_dim, bias=bias, **factory_kwargs
        )
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, embed_dim), **factory_kwargs))
            self.bias_v = nn.Parameter(torch.empty((1, 1, embed_dim), **factory_kwargs))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn

        self.pattern = pattern
        self.group = group
        self.compute_dtype = compute_dtype
        self._reset_parameters()
        if pattern is not None or group is not None:
            self.register_forward_pre_hook(_block_mha_fastpath)

    def _reset_parameters(self) -> None:
        if self._qkv_same_embed_dim:
            xavier_uniform_(self.in_proj_weight)
        else:
            xavier_uniform_(self.q_proj_weight)
            xavier_uniform_(self.k_proj_weight)
            xavier_uniform_(self.v_proj_weight)

        if self.in_proj_bias is not None:
            constant_(self.in_proj_bias, 0.0)
            constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            xavier_normal_(self.bias_v)

    def __setstate__(self, state):
        if "_qkv_same_embed_dim" not in state:
            state["_qkv_same_embed_dim"] = True
        super().__setstate__(state)

    def __deepcopy__(self, memo):
        # A process group is shared, not copied (it cannot be), so that e.g.
        # nn.TransformerEncoder can clone a layer holding a sharded module.
        if self.group is not None:
            memo[id(self.group)] = self.group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            object.__setattr__(new, name, copy.deepcopy(value, memo))
        return new

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
        if self.group is not None:
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

        Returns:
            ``(attn_output, attn_weights)``; ``attn_weights`` is ``None`` when
            ``need_weights=False``, else ``(N, L, S)`` averaged or
            ``(N, num_heads, L, S)`` (no batch dimension when unbatched).
        """
        call = self._checked_call(
            query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
        )
        q, k, v = self._project(
            call.query, call.key, call.value, query is key and key is value, key is value
        )
        if call.kernels:
            out, weights = self._kernel_attention(q, k, v, call), None
        else:
            out, weights = self._dense_attention(q, k, v, call, need_weights)
            if weights is not None:
                weights = weights.to(q.dtype)
                if average_attn_weights:
                    weights = weights.mean(dim=1)
                if not call.batched:
                    weights = weights.squeeze(0)
        out = self.out_proj(out.to(q.dtype))
        if not call.batched:
            return out.squeeze(0), weights
        return (out if self.batch_first else out.transpose(0, 1)), weights

    # -- checks --------------------------------------------------------------
    def _checked_call(
        self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
    ) -> _Call:
        """Check one call; when sharded, a failure here makes every rank
        raise (it is reported through the ring's handshake)."""
        if self.group is None:
            return self._check_call(
                query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
            )
        try:
            return self._check_call(
                query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
            )
        except Exception:
            if world_info(self.group)[0] > 1:
                reject(self.group)
            raise

    def _check_call(
        self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
    ) -> _Call:
        batched = self._check_inputs(query, key, value, key_padding_mask, attn_mask)
        if is_causal and attn_mask is None:
            raise RuntimeError(_CAUSAL_HINT_ERROR)
        # nn.MultiheadAttention: the hint replaces attn_mask only when nothing
        # else needs the explicit mask.
        causal = bool(is_causal and key_padding_mask is None and not need_weights)
        if causal:
            attn_mask = None
        if self.group is not None:
            self._check_group_call(query, key, key_padding_mask, need_weights, attn_mask, batched)
        # To (batch, seq, features).
        if not batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        B, L, _ = query.shape
        S = key.shape[1]
        if key_padding_mask is not None and tuple(key_padding_mask.shape) != (B, S):
            want = (B, S) if batched else (S,)
            got = key_padding_mask.shape if batched else key_padding_mask.shape[1:]
            raise ValueError(f"key_padding_mask must have shape {want}, got {tuple(got)}")
        if attn_mask is not None:
            want = (L, S) if attn_mask.dim() == 2 else (B * self.num_heads, L, S)
            if tuple(attn_mask.shape) != want:
                raise ValueError(f"attn_mask must have shape {want}, got {tuple(attn_mask.shape)}")
        if self.has_pattern and L != S:
            raise ValueError(
                "with a dilated pattern (segment_lengths/dilation_rates), query and key must have "
                f"the same sequence length, got L={L} and S={S}"
            )
        kernels = self.group is not None or (
            not need_weights
            and attn_mask is None
            and self.bias_k is None
            and not self.add_zero_attn
            and L == S
            and (key_padding_mask is None or key_padding_mask.dtype == torch.bool)
            and not (self.training and self.dropout > 0)
        )
        return _Call(query, key, value, key_padding_mask, attn_mask, batched, causal, kernels)

    def _check_inputs(self, query, key, value, key_padding_mask, attn_mask) -> bool:
        """Shapes as ``nn.MultiheadAttention`` expects them; returns is_batched."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.is_nested:
                raise ValueError(
                    f"{name} is a nested tensor, which MultiheadDilatedAttention does not support "
                    "(with nn.TransformerEncoder, pass enable_nested_tensor=False)"
                )
        _check_mask_dtype(key_padding_mask, "key_padding_mask")
        _check_mask_dtype(attn_mask, "attn_mask")
        if query.dim() not in (2, 3):
            raise ValueError(
                "query must be 2-D (unbatched) or 3-D (batched), got a "
                f"{query.dim()}-D tensor of shape {tuple(query.shape)}"
            )
        batched = query.dim() == 3
        if key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                f"key and value must be {query.dim()}-D like query, got {key.dim()}-D and "
                f"{value.dim()}-D tensors"
            )
        for name, t, e in (
            ("query", query, self.embed_dim),
            ("key", key, self.kdim),
            ("value", value, self.vdim),
        ):
            if t.shape[-1] != e:
                raise ValueError(
                    f"{name} must have {e} features in its last dimension, "
                    f"got shape {tuple(t.shape)}"
                )
        seq_dim = 1 if (batched and self.batch_first) else 0
        batch_dim = 1 - seq_dim
        if key.shape[seq_dim] != value.shape[seq_dim] or (
            batched
            and not (query.shape[batch_dim] == key.shape[batch_dim] == value.shape[batch_dim])
        ):
            raise ValueError(
                "key and value must have the same sequence length and the batch size of "
                f"query, got query {tuple(query.shape)}, key {tuple(key.shape)}, "
                f"value {tuple(value.shape)} (batch_first={self.batch_first})"
            )
        if key_padding_mask is not None and key_padding_mask.dim() != (2 if batched else 1):
            raise ValueError(
                f"key_padding_mask must be {'2-D (batch, S)' if batched else '1-D (S,)'} "
                f"for {'batched' if batched else 'unbatched'} query, got shape "
                f"{tuple(key_padding_mask.shape)}"
            )
        if attn_mask is not None and attn_mask.dim() not in (2, 3):
            raise ValueError(
                f"attn_mask must be 2-D (L, S) or 3-D (batch * num_heads, L, S), got shape "
                f"{tuple(attn_mask.shape)}"
            )
        return batched

    def _check_group_call(self, query, key, key_padding_mask, need_weights, attn_mask, batched):
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
        seq_dim = 1 if (batched and self.batch_first) else 0
        if query.shape[seq_dim] != key.shape[seq_dim]:
            raise ValueError(
                f"key must have the same local sequence length as query {where} (no "
                f"cross-attention), got {query.shape[seq_dim]} and {key.shape[seq_dim]}"
            )

    # -- attention paths -----------------------------------------------------
    def _project(self, query, key, value, self_attn: bool, kv_same: bool):
        E = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            if self_attn:
                return F.linear(query, w, b).chunk(3, dim=-1)
            wq, wk, wv = w.chunk(3)
            if kv_same:
                kv = F.linear(key, w[E:], None if b is None else b[E:])
                k, v = kv.chunk(2, dim=-1)
                return F.linear(query, wq, bq), k, v
            return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)
        return (
            F.linear(query, self.q_proj_weight, bq),
            F.linear(key, self.k_proj_weight, bk),
            F.linear(value, self.v_proj_weight, bv),
        )

    def _compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        if self.compute_dtype is None:
            return x.dtype
        if self.compute_dtype == "auto":
            return select_dtype(x.device)
        return self.compute_dtype

    def _kernel_attention(self, q, k, v, call: _Call) -> torch.Tensor:
        """The C++ operators on ``(batch, seq, embed)`` projections: one
        process, or the ring when sharded."""
        B, L, E = q.shape
        pattern = self.pattern if self.pattern is not None else _DENSE
        if call.causal != pattern.causal:
            pattern = replace(pattern, causal=call.causal)
        cdt = self._compute_dtype(q)
        q, k, v = (t.reshape(B, L, self.num_heads, self.head_dim).to(cdt) for t in (q, k, v))
        if self.group is not None:
            out = ring_attention(q, k, v, pattern, group=self.group)
        else:
            out = attend(q, k, v, pattern, key_padding_mask=call.key_padding_mask)
        return out.reshape(B, L, E)

    def _dense_attention(self, q, k, v, call: _Call, need_weights: bool):
        pattern = self.pattern
        if pattern is not None and call.causal != pattern.causal:
            pattern = replace(pattern, causal=call.causal)
        return dense_attention(
            q,
            k,
            v,
            num_heads=self.num_heads,
            compute_dtype=self._compute_dtype(q),
            key_padding_mask=call.key_padding_mask,
            attn_mask=call.attn_mask,
            causal=call.causal,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
            bias_k=self.bias_k,
            bias_v=self.bias_v,
            add_zero_attn=self.add_zero_attn,
            pattern=pattern,
        )


def _check_constructor(
    embed_dim, num_heads, dropout, segment_lengths, dilation_rates, head_groups, head_offsets,
    group, add_bias_kv, add_zero_attn, compute_dtype,
) -> Pattern | None:  # fmt: skip
    """The constructor's checks; the pattern (``None``: dense)."""
    if embed_dim <= 0 or num_heads <= 0:
        raise ValueError(
            f"embed_dim and num_heads must be greater than 0,"
            f" got embed_dim={embed_dim} and num_heads={num_heads} instead"
        )
    if embed_dim % num_heads != 0:
        raise ValueError(
            f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim} "
            f"and num_heads={num_heads}"
        )
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout <= 1:
        raise ValueError(f"dropout must be a probability in [0, 1], got {dropout!r}")
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
    if not (
        compute_dtype is None
        or compute_dtype == "auto"
        or (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point)
    ):
        raise ValueError(
            f'compute_dtype must be None, "auto" or a floating torch.dtype, got {compute_dtype!r}'
        )
    if group is not None and (add_bias_kv or add_zero_attn):
        which = "add_bias_kv" if add_bias_kv else "add_zero_attn"
        raise ValueError(f"{which}=True is not supported with group= (sequence sharding)")
    return pattern
