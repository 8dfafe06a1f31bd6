"""pytest plugin: transformers' own model tests with ``"ring_dilated"`` as the
default attention.

transformers picks ``"sdpa"`` for a model that supports it unless told
otherwise; this plugin registers ring_attention's attention and mask
functions under that name through transformers' public ``AttentionInterface``
and ``AttentionMaskInterface`` (nothing of transformers is edited or
patched), so every model the tests build with the default implementation
attends with ``"ring_dilated"`` (no pattern: dense, to be equal to sdpa).
Where the kernels cannot express an input, the backend itself calls
transformers' ``sdpa_attention_forward`` (the function, not the registry
entry), as it does for any user. A model without ``"sdpa"`` (gpt-oss: its sinks)
defaults to its own ``"eager"``, which is no registry entry: its tester names
its attention with ``attention("eager")``, ``"ring_dilated"`` while the
plugin is on.

Use: ``python -m pytest -p ring_dilated_default ...`` with this folder on
``PYTHONPATH`` (scripts/transformers_tests.py does this). With
``RING_DILATED_CALLS`` naming a file, each pytest process appends to it the
number of attention calls the backend served, so the harness can tell that
the tests ran through it.
"""

from __future__ import annotations

import os
from typing import Any

_saved: dict[str, Any] = {}
_calls = [0]


def _counted(*args: Any, **kwargs: Any) -> Any:
    from ring_attention import hf

    _calls[0] += 1
    return hf.dilated_attention_forward(*args, **kwargs)


def install() -> None:
    """Route transformers' ``"sdpa"`` entries to ``"ring_dilated"``'s."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    import ring_attention as ra
    from ring_attention import hf

    ra.register_transformers()
    _saved.setdefault("attention", ALL_ATTENTION_FUNCTIONS["sdpa"])
    _saved.setdefault("mask", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    counted = bool(os.environ.get("RING_DILATED_CALLS"))
    forward = _counted if counted else hf.dilated_attention_forward
    AttentionInterface.register("sdpa", forward)
    AttentionInterface.register("ring_dilated", forward)
    AttentionMaskInterface.register("sdpa", hf.dilated_attention_mask)


def attention(reference: str) -> str:
    """The attention a tester names for a model whose own is ``reference``
    (not ``"sdpa"``): ``"ring_dilated"`` while the plugin is on."""
    return "ring_dilated" if _saved else reference


def uninstall() -> None:
    """Give transformers' ``"sdpa"`` entries back."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from ring_attention import hf

    if _saved:
        AttentionInterface.register("sdpa", _saved.pop("attention"))
        AttentionMaskInterface.register("sdpa", _saved.pop("mask"))
        AttentionInterface.register("ring_dilated", hf.dilated_attention_forward)


def pytest_configure(config: Any) -> None:
    install()


def pytest_unconfigure(config: Any) -> None:
    out = os.environ.get("RING_DILATED_CALLS")
    if out:
        with open(out, "a") as f:
            f.write(f"{_calls[0]}\n")
