"""benchmarks/gpu_targets.py: the targets' PASS / FAIL / unrun over a GPU
run's archives, on records written here (no GPU)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from benchmarks import gpu_targets


def _point(method, n, config, pass_, ms, of_mm, causal=False):
    return {"stage": "bench", "method": method, "n": n, "config": config, "causal": causal,
            "pass": pass_, "status": "ok", "ms": ms, "tflops": 1.0, "of_mm": of_mm}  # fmt: skip


def _stage(root: Path, name: str, files: dict[str, list[dict]], pack: bool) -> None:
    d = root / "work" / name
    d.mkdir(parents=True)
    for fname, recs in files.items():
        (d / fname).write_text("".join(json.dumps(r) + "\n" for r in recs))
    if pack:  # as gpu_check.sh leaves it
        with tarfile.open(root / "run" / f"c2-01-{name}.tar.gz", "w:gz") as tar:
            tar.add(d, arcname=name)
    else:
        (root / "run" / name).mkdir()
        for f in d.iterdir():
            (root / "run" / name / f.name).write_bytes(f.read_bytes())


def test_targets_pass_fail_and_unrun(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    head = {"kind": "run", "device_name": "NVIDIA H100 80GB HBM3 (cc 9.0, 79 GiB)", "argv": []}
    views = [head, {"stage": "bench", "what": "matmul rate", "flop_rate": 8e14},
             _point("default", 131072, "16x128", "fwd", 10.0, 0.72),
             _point("default", 1048576, "16x128", "fwd", 80.0, 0.71, causal=True),
             _point("default", 131072, "12x64", "fwd", 5.0, 0.50),
             _point("default", 32768, "16x128", "fwd", 3.0, 0.46)]  # fmt: skip
    _stage(tmp_path, "views", {"views.jsonl": views}, pack=True)
    torch_only = [head, _point("torch", 131072, "16x128", "fwd", 18.0, 0.40)]
    _stage(tmp_path, "torch", {"views.jsonl": torch_only}, pack=False)
    prev_head = dict(head, argv=["bench.py", "views", "--tag", "prev"], commit="c4a8cfc (exported)")
    prev = [head, _point("prev", 131072, "16x128", "fwd", 36.0, 0.2),
            _point("prev", 1048576, "16x128", "fwd", 300.0, 0.2, causal=True)]  # fmt: skip
    _stage(tmp_path, "prev", {"views.jsonl": prev, "prev.jsonl": [prev_head]}, pack=True)
    base = [head, _point("gather", 131072, "16x128", "fwd", 20.0, 0.3),
            _point("flex", 131072, "16x128", "fwd", 16.0, 0.3)]  # fmt: skip
    _stage(tmp_path, "baselines", {"views.jsonl": base}, pack=True)
    ring = [{"stage": "time", "shape": "1x131072x16x16x128", "pass": p, "method": m,
             "backend": "fa4", "median_s": s}
            for p, m, s in (("fwd", "ring_dense", 1.02), ("fwd", "direct", 1.0),
                            ("fwdbwd", "ring_dense", 3.3), ("fwdbwd", "direct", 3.0))]  # fmt: skip
    unrun = "dilated ring blocks, dense route / our kernels (decides auto; not a target): unrun"
    assert unrun in gpu_targets.report([tmp_path / "run"])  # (no records yet)
    where = {"config": "16x128", "n": 131072, "p": 8}
    ring += [{"stage": "dilated_check", "causal": c, "status": "ok", **where} for c in (1, 0)]
    ring += [
        {
            "stage": "dilated",
            "method": m,
            "pass": p,
            "causal": c,
            "ratio": x,
            "backend": "fa4" if m == "dense" else "kernel",
            **where,
        }
        for m in ("dense", "kernel")
        for p, c, x in (("fwd", 1, 0.8), ("fwd", 0, 0.6), ("fwdbwd", 1, 1.2), ("fwdbwd", 0, 0.9))
    ]
    _stage(tmp_path, "ringdense", {"ring_dense_rank0.jsonl": ring}, pack=True)
    lines = gpu_targets.report([tmp_path / "run"])
    text = "\n".join(lines)
    assert "measured on: NVIDIA H100 80GB HBM3" in lines[0]
    assert "- PASS: forward 16x128 from n=131072 >= 70% of the matmul rate: least 71%" in text
    assert "- FAIL: forward 12x64 from n=131072 >= 55% of the matmul rate: least 50%" in text
    assert "- unrun: forward+backward 16x128 from n=131072 >= 60%" in text
    assert "- PASS: forward 16x128 n=32768 >= 45%" in text
    assert (
        "- FAIL: torch only (no flash-attn-4): forward 16x128 from n=131072 >= 45%: least 40%"
        in text
    )
    # 36 / 10 = 3.6x and 300 / 80 = 3.75x: the least is 3.60x
    assert "- PASS: >= 3.5x the default of c4a8cfc at 16x128 from n=131072: least 3.60x" in text
    # one point has baselines (best: flex, 1.6x), three have none: not a pass
    assert "- FAIL: >= 1.5x the best of" in text and "least 1.60x (flex" in text
    assert "3 points without any baseline (unrun)" in text
    assert "- FAIL: dense causal ring of 1 within 5%" in text and "worst 1.100x" in text
    assert "- unrun: 2M tokens" in text
    assert ("dilated ring blocks, dense route / our kernels (decides auto; not a target): "
            "forward 0.60-0.80x; forward+backward 0.90-1.20x (2 points: 16x128, causal and not, "
            "n=131072 over p=8, backend fa4)") in lines  # fmt: skip
    assert lines[-1] == "targets: 3 PASS, 4 FAIL, 3 unrun"
    assert gpu_targets.share_target("16x128", 1048576, "fwdbwd") == 0.60
    assert gpu_targets.share_target("12x64", 32768, "fwd") is None
