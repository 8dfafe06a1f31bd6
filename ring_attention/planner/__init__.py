"""Capacity planner for ring dilated attention (``python -m ring_attention.planner``):
the longest sequence per rank, time per layer and bytes per link (docs/planner.md)."""

from ..core.pairs import pattern_flops, reached_pairs
from .capacity import Evaluation, Setup, evaluate, fewest_ranks, largest_length
from .memory import LayerMemory, layer_memories, layer_memory, transport_buffers
from .presets import MODELS, PATTERNS, ModelShape, longnet_pattern
from .throughput import Rates, assumed_rates, load_records, rates_from_records
from .timing import Link, RankTime, layer_times
from .traffic import Traffic, predict_traffic

__all__ = ["MODELS", "PATTERNS", "Evaluation", "LayerMemory", "Link", "ModelShape", "RankTime",
           "Rates", "Setup", "Traffic", "assumed_rates", "evaluate", "fewest_ranks",
           "largest_length", "layer_memories", "layer_memory", "layer_times", "load_records",
           "longnet_pattern", "pattern_flops", "predict_traffic", "rates_from_records",
           "reached_pairs", "transport_buffers"]  # fmt: skip
