"""The modules: DilatedAttention, RingDilatedAttention, MultiheadDilatedAttention."""
