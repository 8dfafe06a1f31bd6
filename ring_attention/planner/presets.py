"""Named patterns and model shapes for the planner's command line."""

from dataclasses import dataclass

from ..core.checks import check_int
from ..core.geometry import MAX_SEQ_LEN
from ..core.pattern import as_flag


def longnet_pattern(seq_len: int, base: int = 2048, factor: int = 4) -> tuple[list[int], list[int]]:
    """LongNet grown to ``seq_len``: segments ``base * factor**i`` and
    ``seq_len``, dilation ``segment // base``."""
    seq_len = check_int(seq_len, "seq_len", 0, MAX_SEQ_LEN)
    base = check_int(base, "base", 1, MAX_SEQ_LEN)
    factor = check_int(factor, "factor", 2, MAX_SEQ_LEN)
    segs = []
    w = base
    while w < seq_len:
        segs.append(w)
        w *= factor
    segs.append(max(seq_len, 1))
    return segs, [max(1, s // base) for s in segs]


#: name -> (description, function of the sequence length giving (segments, dilations)).
PATTERNS = {
    "longnet": ("LongNet grown to n: segments 2048*4^i below n and n, dilations segment/2048",
                longnet_pattern),
    "longnet-paper": ("segments [2048, 4096, 8192, 16384, 32768], dilations [1, 2, 4, 6, 12]",
                      lambda n: ([2048, 4096, 8192, 16384, 32768], [1, 2, 4, 6, 12])),
    "dense": ("one segment of n, dilation 1 (dense attention)", lambda n: ([max(n, 1)], [1])),
}  # fmt: skip


@dataclass(frozen=True)
class ModelShape:
    """A decoder/encoder stack: ``layers`` blocks of attention and MLP."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # MLP width
    gated: bool = False  # gated MLP (SwiGLU: three matrices) instead of two
    vocab: int = 0  # input embedding and an untied output head

    def __post_init__(self) -> None:
        as_flag(self.gated, "gated")

    def layer_params(self) -> int:
        """Parameters of one block (weights and norms, no biases)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = (3 if self.gated else 2) * self.hidden * self.ffn
        return attn + mlp + 2 * self.hidden

    def params(self) -> int:
        """All parameters: blocks, final norm, embedding and output head."""
        return self.layers * self.layer_params() + self.hidden + 2 * self.vocab * self.hidden


#: Public shapes (layer counts, widths, heads, MLP and vocabulary sizes).
MODELS = {
    "24x2048": ModelShape(24, 2048, 16, 16, 128, 8192, False, 50304),
    "llama2-7b": ModelShape(32, 4096, 32, 32, 128, 11008, True, 32000),
    "llama3-8b": ModelShape(32, 4096, 32, 8, 128, 14336, True, 128256),
}
