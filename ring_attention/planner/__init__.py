"""Capacity planner for ring dilated attention.

Given ranks, memory, the attention shape and a pattern, predict per rank the
longest sequence that fits, the time per layer and the bytes per link, for one
attention layer and for a whole model (``python -m ring_attention.planner``):

* :mod:`.pairs`: reached (query, key) pairs in closed form (FLOPs);
* :mod:`.traffic`: rows exchanged per rank and ring step, from the ring's
  plan or in closed form (:mod:`.progressions` counts unions of dilated rows);
* :mod:`.memory`: peak memory of one layer per rank, item by item, agreeing
  with the ring's own buffer accounting;
* :mod:`.throughput` and :mod:`.timing`: kernel rates (benchmark records or
  labelled assumptions) and the ring schedule's time;
* :mod:`.model`: whole-model memory and time (stated assumptions);
* :mod:`.capacity`: a configuration at one length, and the searches;
* :mod:`.validate`: predictions against measured gloo runs on this machine.
"""

from ..core.pairs import pattern_flops, reached_pairs
from .capacity import Evaluation, Setup, evaluate, fewest_ranks, largest_length
from .memory import LayerMemory, layer_memories, layer_memory, transport_buffers
from .presets import MODELS, PATTERNS, ModelShape, longnet_pattern
from .throughput import Rates, assumed_rates, load_records, rates_from_records
from .timing import Link, RankTime, layer_times
from .traffic import Traffic, predict_traffic

__all__ = [
    "MODELS",
    "PATTERNS",
    "Evaluation",
    "LayerMemory",
    "Link",
    "ModelShape",
    "RankTime",
    "Rates",
    "Setup",
    "Traffic",
    "assumed_rates",
    "evaluate",
    "fewest_ranks",
    "largest_length",
    "layer_memories",
    "layer_memory",
    "layer_times",
    "load_records",
    "longnet_pattern",
    "pattern_flops",
    "predict_traffic",
    "rates_from_records",
    "reached_pairs",
    "transport_buffers",
]
