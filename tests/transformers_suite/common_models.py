"""Llama, Mistral, Qwen2, gpt-oss, Gemma 3 and 4, Llama 4, Cohere 2 and OLMo 3 under
transformers' common model tests.

scripts/transformers_tests.py (``--sdist``) places this file in the tests/
tree of the installed release's sdist, as ``tests/ring_dilated/test_common_models.py``,
and runs it with and without ``"ring_dilated"`` as the default attention. The
tests are the release's ``ModelTesterMixin`` (tests/test_modeling_common.py
of the sdist); the model testers below are the project's: a tiny config of
each model and its inputs (ragged padding, GQA). Nothing of transformers is
copied here. Not collected by the project's own suite (no ``test_`` prefix
here, and its imports need the sdist's tree).

Llama runs with every model class (the base model, causal LM and the three
task heads); Mistral and Qwen2, whose attention differs from Llama's
(sliding windows, projection biases) and whose task heads do not, with the
base model and the causal LM only: the task heads thrice took 40 % of the
run and reached no attention path that Llama's do not. The families with
sinks, sliding and chunked layers run with the causal LM only (it runs its
base model's attention; the base models made 23 % of the attention calls),
each with the layer kinds of its own: gpt-oss (sinks, sliding and full
layers alternating), Gemma 3's text model (sliding and global layers,
``query_pre_attn_scalar``), Gemma 4's (global layers with their own head
size, keys as values, layers sharing earlier layers' keys), Llama 4's text
model (chunked and full layers, ``attention_chunk_size``), Cohere 2 and
OLMo 3 (sliding and full layers), windows and chunks shorter than the
sequence. gpt-oss has no ``"sdpa"`` (its sinks): the model's own attention
there is ``"eager"``, which its tester asks for by name, and
``"ring_dilated"`` where the plugin is on (``ring_dilated_default.attention``).
"""

from __future__ import annotations

import unittest
from typing import ClassVar

from ring_dilated_default import attention
from transformers import (
    Cohere2Config,
    Cohere2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
    MistralModel,
    Olmo3Config,
    Olmo3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2Model,
)

from ..generation.test_utils import GenerationTesterMixin
from ..test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask


class TinyCausalLMTester:
    """A tiny config of ``config_class`` and a padded batch for it: the
    attributes ``ModelTesterMixin`` reads of its ``model_tester``."""

    batch_size = 13
    seq_length = 7
    is_training = True
    vocab_size = 99
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    intermediate_size = 37
    num_labels = 3

    def __init__(self, parent: unittest.TestCase, config_class: type, extra: dict) -> None:
        self.parent = parent
        self.config_class = config_class
        self.extra = extra

    def get_config(self):
        extra = dict(self.extra)
        reference = extra.pop("attn_reference", None)
        config = self.config_class(
            **{
                "vocab_size": self.vocab_size,
                "hidden_size": self.hidden_size,
                "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads,
                "intermediate_size": self.intermediate_size,
                "hidden_act": "gelu",
                "max_position_embeddings": 512,
                "initializer_range": 0.02,
                "num_labels": self.num_labels,
                "pad_token_id": 0,
                "bos_token_id": 1,
                "eos_token_id": 2,
                **extra,
            }
        )
        if reference is not None:  # a model without "sdpa": its own attention, by name
            config._attn_implementation = attention(reference)
        return config

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), {"input_ids": input_ids, "attention_mask": mask}


class _CommonTests(ModelTesterMixin, GenerationTesterMixin):
    config_class: type = LlamaConfig
    #: the family's own config arguments (``attn_reference``: the attention
    #: the model is judged against where it has no ``"sdpa"``)
    config_extra: ClassVar[dict] = {}

    def setUp(self) -> None:
        self.model_tester = TinyCausalLMTester(self, self.config_class, self.config_extra)


class LlamaCommonTest(_CommonTests, unittest.TestCase):
    config_class = LlamaConfig
    all_model_classes = (
        LlamaModel,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
        LlamaForQuestionAnswering,
        LlamaForTokenClassification,
    )


class MistralCommonTest(_CommonTests, unittest.TestCase):
    config_class = MistralConfig
    all_model_classes = (MistralModel, MistralForCausalLM)  # the task heads: Llama's


class Qwen2CommonTest(_CommonTests, unittest.TestCase):
    config_class = Qwen2Config
    all_model_classes = (Qwen2Model, Qwen2ForCausalLM)  # the task heads: Llama's


#: sliding / chunked layers first, windows shorter than the sequence (7)
ALTERNATING = ["sliding_attention", "full_attention"]


class GptOssCommonTest(_CommonTests, unittest.TestCase):
    config_class = GptOssConfig
    # the experts' grouped matmul takes strides of 16 bytes: 32 wide
    config_extra: ClassVar[dict] = dict(head_dim=8, sliding_window=3, layer_types=ALTERNATING,
                        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                        attn_reference="eager")  # fmt: skip
    all_model_classes = (GptOssForCausalLM,)


class Gemma3CommonTest(_CommonTests, unittest.TestCase):
    config_class = Gemma3TextConfig
    config_extra: ClassVar[dict] = dict(head_dim=8, sliding_window=3, layer_types=ALTERNATING,
                        query_pre_attn_scalar=12)  # fmt: skip
    all_model_classes = (Gemma3ForCausalLM,)


class Llama4CommonTest(_CommonTests, unittest.TestCase):
    config_class = Llama4TextConfig
    config_extra: ClassVar[dict] = dict(head_dim=8, attention_chunk_size=3, no_rope_layers=[1, 0],
                        layer_types=["chunked_attention", "full_attention"],
                        intermediate_size_mlp=37, num_local_experts=2,
                        moe_layers=[1])  # fmt: skip
    all_model_classes = (Llama4ForCausalLM,)


class Cohere2CommonTest(_CommonTests, unittest.TestCase):
    config_class = Cohere2Config
    config_extra: ClassVar[dict] = dict(sliding_window=3, layer_types=ALTERNATING)
    all_model_classes = (Cohere2ForCausalLM,)


class Olmo3CommonTest(_CommonTests, unittest.TestCase):
    config_class = Olmo3Config
    config_extra: ClassVar[dict] = dict(sliding_window=3, layer_types=ALTERNATING)
    all_model_classes = (Olmo3ForCausalLM,)


class Gemma4CommonTest(_CommonTests, unittest.TestCase):
    config_class = Gemma4TextConfig
    # global layers of their own head size with keys as values; the last two
    # layers reuse the first two's keys (a prefill computes their last queries only)
    config_extra: ClassVar[dict] = dict(head_dim=8, sliding_window=3, num_hidden_layers=4,
                        layer_types=ALTERNATING * 2, global_head_dim=16,
                        num_global_key_value_heads=1, attention_k_eq_v=True, num_kv_shared_layers=2,
                        hidden_size_per_layer_input=4, vocab_size_per_layer_input=99)  # fmt: skip
    all_model_classes = (Gemma4ForCausalLM,)
