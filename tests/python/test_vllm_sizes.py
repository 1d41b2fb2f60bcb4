"""A vLLM parameter whose size is not what refit's recipe lays out for that
rank is refused when it is registered, before any transfer, naming the
parameter, its shape and both sizes; nothing of it is registered.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")

import pytest  # noqa: E402

torch = pytest.importorskip("torch")

import refit  # noqa: E402
from conftest import network  # noqa: E402
from hf_models import manifest  # noqa: E402

# A small Llama: 4 heads and 2 KV heads of 32; vocabulary 100, padded to 128.
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1, "hidden_size": 128,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
          "vocab_size": 100, "tie_word_embeddings": True}
QKV = "model.layers.0.self_attn.qkv_proj.weight"


def receiver(coordinator, tmp_path):
    (tmp_path / "m.json").write_text(json.dumps(manifest(CONFIG)))
    (tmp_path / "m.config.json").write_text(json.dumps(CONFIG))
    return refit.Receiver({"rank": 0, "coordinator": coordinator.config(), "network": network(), "mode": "staged",
                           "recipe": {"model": str(tmp_path / "m.json"), "tp": 2}})


@pytest.mark.parametrize("rows", [127, 129, 192])
def test_a_parameter_of_another_size_is_refused(coordinator, tmp_path, rows):
    # vLLM at tp 2, rank 0: qkv_proj holds 2 query heads and 1 KV head of 32.
    with receiver(coordinator, tmp_path) as rx:
        with pytest.raises(refit.InvalidArgumentError) as e:
            rx.add(QKV, torch.zeros(rows, 128, dtype=torch.bfloat16), "recipe")
        assert f"in 32768 bytes, the buffer given has {rows * 128 * 2}" in str(e.value), e.value
        assert rx.names == []
        rx.add(QKV, torch.zeros(128, 128, dtype=torch.bfloat16), "recipe")
        assert rx.names == [QKV]


def test_the_vllm_engine_names_the_parameter_and_its_shape(coordinator, tmp_path):
    pytest.importorskip("vllm")
    from refit.vllm import RefitWeightTransferEngine
    with receiver(coordinator, tmp_path) as rx:
        # The whole vocabulary unpadded (what a server at tp 1 without
        # padding would hold), where rank 0 of tp 2 holds 64 padded rows.
        param = torch.nn.Parameter(torch.zeros(100, 128, dtype=torch.bfloat16), requires_grad=False)
        with pytest.raises(refit.InvalidArgumentError) as e:
            RefitWeightTransferEngine._add(rx, "model.embed_tokens.weight", param)
        message = e.value.message
        assert message.startswith('vLLM parameter "model.embed_tokens.weight" [100, 128] torch.bfloat16: '), message
        assert "in 16384 bytes, the buffer given has 25600" in message, message
        RefitWeightTransferEngine._add(rx, "model.embed_tokens.weight", param[:64])
        assert rx.names == ["model.embed_tokens.weight"]


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.qkv.weight",  # a name the trainer does not serve
                                  "model.layers.0.mlp.experts.routed_experts.w13_weight"])  # a later vLLM's MoE name
def test_the_vllm_engine_names_a_parameter_the_recipe_lacks(coordinator, tmp_path, name):
    # The names vLLM gives its parameters drift between versions; one the
    # recipe does not lay out is refused naming it, and nothing is registered.
    pytest.importorskip("vllm")
    from refit.vllm import RefitWeightTransferEngine
    with receiver(coordinator, tmp_path) as rx:
        param = torch.nn.Parameter(torch.zeros(128, 128, dtype=torch.bfloat16), requires_grad=False)
        with pytest.raises(refit.NotFoundError) as e:
            RefitWeightTransferEngine._add(rx, name, param)
        message = e.value.message
        assert message.startswith(f'vLLM parameter "{name}" has no counterpart in refit\'s vLLM recipe'), message
        assert rx.names == []
