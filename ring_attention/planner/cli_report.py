"""The capacity planner's report as text, from a :class:`~.capacity.Setup` and an
:class:`~.capacity.Evaluation` or :class:`~.modes.ModeEvaluation`."""

import argparse
from typing import Any

from ..core.links import LINKS
from ..core.pairs import pattern_flops
from .memory import acc_bytes
from .model import activation_bytes_per_token
from .presets import PATTERNS


def fmt_bytes(x: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.2f} {unit}"
    return f"{x:.0f} B"


def fmt_time(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def fmt_tokens(n: int) -> str:
    if n < 10**6:
        return f"{n:,}"
    e = len(str(n)) - 1
    return f"{n:,} ({n / 10**e:.2f}e{e})"


def header(s: Any, args: argparse.Namespace) -> list[str]:
    """The setup, as the report's first lines."""
    pat = (f"segments {list(s.segments)} dilations {list(s.dilations)}" if s.segments
           else f"{s.pattern}: {PATTERNS[s.pattern][0]}")  # fmt: skip
    docs = f"documents of {s.document_length:,} tokens" if s.document_length else ""
    offsets = f"{s.head_offsets} head offsets" if s.head_offsets != "modulo" else ""
    groups = "head groups" if s.head_groups else ""
    flags = ", ".join(filter(None, ("causal" if s.causal else "non-causal", groups, offsets, docs)))
    given = args.link_gbps or args.link_latency_us is not None or args.message_us is not None
    mem_note = "per GPU" if s.device == "cuda" else "per process (host memory / processes)"
    return [
        "ring_attention capacity planner",
        f"  ranks        {s.ranks} x {s.device}, {fmt_bytes(s.memory)} {mem_note}; usable "
        f"{fmt_bytes(s.usable)} (reserve {fmt_bytes(s.reserve)})",
        f"  attention    {s.heads} heads (K/V {s.kv_heads}), head_dim {s.head_dim}, {s.dtype}, "
        f"batch {s.batch}, {s.layout} layout, {flags}",
        f"  pattern      {pat}",
        f"  link         {s.link.gbps:g} Gbit/s each way, {s.link.latency_us:g} us per transfer, "
        f"{s.link.message_us:g} us per further message of a batch "
        f"({'given' if given else LINKS[s.device][1]})",
    ]


def layer_details(ev: Any) -> list[str]:
    """One attention layer, training: work, rates, the worst rank's memory
    items, time, the far group's schedules, bytes per link."""
    s, tr, times = ev.setup, ev.traffic, ev.times
    pairs_max = int(tr.total_pairs.max())
    flops = [
        pattern_flops(pairs_max, s.head_dim, s.batch, backward=b) / 1e12 for b in (False, True)
    ]
    j = ev.worst(lambda j: ev.memories[j].training_peak)
    m = ev.memories[j]
    grouped = f"; RING_ATTENTION_BACKWARD_HEADS={ev.group_heads}" if ev.group_heads else ""
    lines = [
        f"  pattern      segments {list(ev.pattern.segment_lengths)} dilations "
        f"{list(ev.pattern.dilation_rates)}",
        f"  per rank     {fmt_tokens(int(tr.local_len.max()))} tokens (longest shard)",
        f"  work         {pairs_max:.4g} reached pairs per batch row on the busiest rank "
        f"({int(tr.total_pairs.sum()):.4g} in all): {flops[0]:.4g} TFLOP forward, "
        f"{flops[1]:.4g} TFLOP fwd+bwd",
        f"  kernel rate  {ev.rates.source}",
        f"  peak memory  {fmt_bytes(m.training_peak)} on rank {j}, training (forward + backward)"
        f"{grouped}:",
    ]
    items = {**m.inputs, **(m.backward if m.backward_peak >= m.forward_peak else m.forward)}
    lines += [f"      {name:<28} {fmt_bytes(v):>12}" for name, v in items.items() if v]
    bufs = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in m.buffers["backward"].items() if v)
    lines += [f"      (transport buffers: {bufs})"] if bufs else []
    t_rank = ev.worst(lambda k: times[k].forward_backward)
    f_rank = ev.worst(lambda k: times[k].forward)
    t, tf = times[t_rank], times[f_rank]
    lines += [
        f"  time/layer   forward {fmt_time(tf.forward)} (compute {fmt_time(tf.compute_forward)},"
        f" exposed communication {fmt_time(tf.exposed_forward)}; rank {f_rank})",
        f"               forward+backward {fmt_time(t.forward_backward)} (compute "
        f"{fmt_time(t.compute_forward_backward)}, exposed communication "
        f"{fmt_time(t.exposed_forward_backward)}; rank {t_rank})",
    ]
    lines += _far_lines(ev)
    row, acc = 2 * s.batch * s.head_dim, acc_bytes(s.itemsize)
    sent, recv = tr.rows_sent, tr.rows_received
    fb_sent = int((2 * row * s.itemsize * sent + row * acc * recv).max())
    fb_recv = int((2 * row * s.itemsize * recv + row * acc * sent).max())
    big = int(max(tr.send_rows.max(), tr.recv_rows.max())) * row * s.itemsize
    lines.append(
        f"  bytes/link   sent per rank per layer: forward "
        f"{fmt_bytes(int(sent.max()) * row * s.itemsize)}, forward+backward "
        f"{fmt_bytes(fb_sent)} (received: {fmt_bytes(int(recv.max()) * row * s.itemsize)}, "
        f"{fmt_bytes(fb_recv)}); largest transfer {fmt_bytes(big)}; "
        f"{int(tr.active.sum(1).max())} of {s.ranks - 1} ring steps carry data (rows: {tr.source})"
    )
    return lines


def _far_lines(ev: Any) -> list[str]:
    """The ring alone and the far group side by side, and which is cheaper."""
    far = ev.setup.far_bytes or ev.setup.link.far_bytes
    out = []
    for name, far_bytes in (("ring alone", 0), (f"far group (transfers <= {fmt_bytes(far)})", far)):
        times = ev.times_with(far_bytes)
        f = max(times, key=lambda t: t.forward)
        fb = max(times, key=lambda t: t.forward_backward)
        msgs = max(t.far_messages for t in times)
        out.append(
            (name, fb.forward_backward, f"{name}: forward {fmt_time(f.forward)} (exposed "
             f"{fmt_time(f.exposed_forward)}, {f.exposed_forward / f.compute_forward:.0%} of "
             f"compute), forward+backward {fmt_time(fb.forward_backward)} (exposed "
             f"{fmt_time(fb.exposed_forward_backward)}, "
             f"{fb.exposed_forward_backward / fb.compute_forward_backward:.0%}); "
             f"{max(t.steps for t in times)} ring steps"
             + (f", {msgs} messages in the group" if msgs else ""))
        )  # fmt: skip
    best = min(out, key=lambda o: o[1])[0]
    return [
        f"  far steps    {out[0][2]}",
        f"               {out[1][2]}",
        f"               cheaper: {best} (RING_ATTENTION_FAR_BYTES: the ring's choice)",
    ]


def model_lines(ev: Any) -> list[str]:
    """The whole model (a model must be set): its shape, the worst rank's
    memory items, the step time and the activations per token."""
    s, m = ev.setup, ev.setup.model
    j = ev.worst(lambda k: sum(ev.model_items(k).values()))
    items, secs = ev.model_items(j), ev.model_seconds()
    act = activation_bytes_per_token(m, s.itemsize)
    return [
        f"Whole model: {m.layers} blocks, hidden {m.hidden}, MLP {m.ffn} "
        f"({'gated' if m.gated else 'GELU'}), vocab {m.vocab or 'none'}, "
        f"{m.params() / 1e9:.3g} B parameters; training, activation checkpointing "
        f"{'on' if s.checkpointing else 'off'}, parameters "
        f"{'sharded over the ranks (FSDP/ZeRO-3)' if s.shard_params else 'replicated'}, "
        f"at n = {fmt_tokens(ev.seq_len)}:",
        f"  peak memory  {fmt_bytes(sum(items.values()))} on rank {j}:",
        *(f"      {k:<42} {fmt_bytes(v):>12}" for k, v in items.items() if v),
        f"  step time    {fmt_time(sum(secs.values()))} per training step of one sequence: "
        + "; ".join(f"{k} {fmt_time(v)}" for k, v in secs.items())
        + f" (matmul rate {s.matmul_rate(ev.rates)[1]})",
        f"  activations  {fmt_bytes(act)} per token and block without checkpointing",
    ]


def _details(ev: Any, usable: int) -> list[str]:
    worst, b, t = ev.worst, fmt_bytes, fmt_time
    m = max(ev.ranks, key=lambda r: r.training_peak)
    fits = "fits" if worst["training_peak"] <= usable else "does NOT fit"
    lines = [
        f"{ev.mode}: {ev.ring} ring(s) x {ev.ulysses} Ulysses rank(s)"
        + (f"; {ev.idle} Ulysses rank(s) hold no head" if ev.idle else ""),
        f"  bytes/rank   sent per layer: forward {b(worst['sent_forward'])}, forward+backward "
        f"{b(worst['sent_forward_backward'])} (all-to-all {b(worst['a2a_forward_backward'])}, "
        f"ring {b(worst['ring_forward_backward'])})",
        f"  peak memory  {b(worst['training_peak'])} training, {b(worst['forward_peak'])} "
        f"inference (rank {m.rank}; {fits}, {b(usable)} usable):",
    ]
    lines += [f"      {k:<28} {b(v):>12}" for k, v in m.training_items.items() if v]
    f = max(ev.ranks, key=lambda r: r.seconds[1])
    lines.append(
        f"  time/layer   forward {t(worst['forward_s'])}, forward+backward "
        f"{t(worst['forward_backward_s'])} (all-to-alls {t(f.a2a_seconds[1])} of it; rank "
        f"{f.rank}; kernel rate {ev.rate_source})"
    )
    return lines


def mode_lines(evals: list[Any], usable: int, advice: list[str]) -> list[str]:
    """The modes side by side (``--mode compare``), the advice, and each
    mode's details; one mode (``--mode ulysses|hybrid``): its details."""
    if len(evals) == 1:
        return [f"One attention layer at n = {evals[0].seq_len:,}:", *_details(evals[0], usable)]
    ev = evals[0]
    columns = (("sent fwd+bwd", 13, "sent_forward_backward"), ("a2a", 11, "a2a_forward_backward"),
               ("ring", 11, "ring_forward_backward"), ("training peak", 14, "training_peak"),
               ("fwd+bwd time", 13, "forward_backward_s"))  # fmt: skip
    lines = [
        f"Three modes at n = {ev.seq_len:,} on {len(ev.ranks)} ranks, one attention layer:",
        f"  {'mode':<8} {'R x U':>9} " + " ".join(f"{name:>{w}}" for name, w, _ in columns),
    ]
    for ev in evals:
        cells = (f"{(fmt_time if k.endswith('_s') else fmt_bytes)(ev.worst[k]):>{w}}"
                 for _, w, k in columns)  # fmt: skip
        lines.append(f"  {ev.mode:<8} {f'{ev.ring} x {ev.ulysses}':>9} " + " ".join(cells))
    lines += ["", *(("Advice: " if i == 0 else " " * 8) + a for i, a in enumerate(advice)), ""]
    for ev in evals:
        lines += _details(ev, usable)
    return lines


ASSUMPTIONS = [
    "Assumptions:",
    "  - memory per rank follows what ring_attention allocates (parallel/ring.py, "
    "parallel/exchange.py): inputs, "
    "fp32 accumulators (out, lse; dq, dk, dv), casts, transport buffers sized from the exchange "
    "rows, the backward kernel's delta, the cached plan's indices; kernel tiles not counted;",
    "  - time per layer = the ring schedule: each step's K/V transfer overlaps the previous "
    "step's compute, gradient returns overlap the next; compute = reached pairs x 4d (fwd) / "
    "10d (bwd) FLOPs at the kernel rate; transfer = latency + bytes / link; the slowest rank "
    "sets the pace; packing copies and launch overheads not modelled;",
    "  - one attention layer alone: q, k, v exist before the call (grad_out too for training); "
    "inference = forward under no_grad;",
]

MODEL_ASSUMPTIONS = [
    "  - whole model: sequence parallel, every rank holds batch x n / p tokens of every block; "
    "AdamW mixed precision at 16 B/parameter; stored activations per token and block: 4h + "
    "(2H + 2H_kv)d + 2f (3f gated) values + fp32 lse, or the block input h with checkpointing "
    "(one block recomputed at a time); the attention backward of one block and two residual "
    "gradients on top; chunked loss (no full logits); matmuls 2 FLOPs per parameter and token "
    "forward, 6 fwd+bwd, 8 with recomputation; optimizer step and data-parallel/FSDP "
    "collectives not modelled.",
]

MODE_ASSUMPTIONS = [
    "",
    "Assumptions (modes): the all-to-alls (q, k, v out; out, lse back; both reversed in "
    "the backward) are not overlapped with compute and take the link inside a node when "
    "the Ulysses group fits in one; the ring's steps overlap as in the ring report; a "
    "rank's heads are those of torch.tensor_split over U, its K/V heads only those they "
    "read; memory: the largest phase (exchange buffers, stretch tensors, the attention's "
    "own items).",
]
