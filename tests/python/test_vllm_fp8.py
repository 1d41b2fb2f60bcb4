"""A BF16 FSDP2 trainer refreshing vLLM's own model class served in block
FP8 (quantization_config {"quant_method": "fp8", "weight_block_size":
[128, 128]}) through refit's vLLM engine, on the CPU, every process real:
trainer ranks (gloo, fully_shard on a mesh of 2), vLLM workers at tp 2 and
refit-coordinator. refit quantizes on the way (docs/conversion.md): three
versions land in vLLM's float8_e4m3fn weights and float32 weight_scale_inv
bit for bit as vLLM's load_weights puts the trainer's state dict quantized
by the torch reference; a version one trainer rank never published is
refused and leaves every parameter at the old one. A model whose shards cut
the 128x128 blocks, with a scale parameter missing, or in blocks other
than 128x128, is refused naming the parameter, with nothing registered. vllm_fp8_receiver.py says what each
vLLM worker does, and why this vLLM needs a stand-in for its FP8 kernel.
The same for vLLM's Qwen3-MoE in block FP8, whose FusedMoE experts
(w13_weight, w2_weight and their weight_scale_inv) land from moe_trainer.py's
F32 experts. The engine's own checks, on a module tree shaped like vLLM's:
the trainer weights an FP8 parameter fuses (a linear layer's, FusedMoE's)
and their scale shapes; UE8M0 scales, experts whose blocks vLLM refined and
a weight the trainer lacks refused naming the parameter.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("vllm")

from hf_models import manifest  # noqa: E402
from processes import explain, free_port, start, wait_all  # noqa: E402

VERSIONS = 3
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def qwen2_fp8_config(head_dim: int, heads: int) -> dict:
    # 2 KV heads of head_dim over tp 2: k and v rows per worker are head_dim,
    # a whole number of 128-row blocks with head_dim 128, half a block with 64.
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 512,
            "intermediate_size": 1024, "num_attention_heads": heads, "num_key_value_heads": 2,
            "head_dim": head_dim, "num_hidden_layers": 2, "vocab_size": 1000, "tie_word_embeddings": False,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
            "torch_dtype": "bfloat16", "quantization_config": FP8}


# Qwen3-MoE in block FP8: the attention projections and every expert in
# F8_E4M3, the routers left in BF16 (modules_to_not_convert), as
# DeepSeek-V3's FP8 checkpoint keeps its gates. At tp 2 each worker holds 128
# rows of each expert's gate and up projections and 128 columns of its down
# projection: whole 128x128 blocks, so vLLM does not refine them.
QWEN3_MOE_FP8 = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 256,
                 "intermediate_size": 512, "moe_intermediate_size": 256, "num_experts": 4,
                 "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "num_hidden_layers": 2,
                 "vocab_size": 1000, "tie_word_embeddings": False, "max_position_embeddings": 128,
                 "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "bfloat16",
                 "quantization_config": {**FP8, "modules_to_not_convert": [f"model.layers.{i}.mlp.gate"
                                                                           for i in range(2)]}}


def write_files(tmp_path, coordinator, config):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    (tmp_path / "coordinator.json").write_text(json.dumps(coordinator.config()))


def refreshed_logs(coordinator, tmp_path, config, trainer, before_port=(), last=()):
    """Two trainer ranks (`trainer` RANK 2 *before_port PORT DIR VERSIONS 2
    *last) and two vLLM workers at tp 2 taking VERSIONS versions and
    refusing the partial one after them; the workers' logs, each checked
    for both."""
    write_files(tmp_path, coordinator, config)
    train_port, serve_port = free_port(), free_port()
    procs = [start(tmp_path, f"trainer{r}", trainer, r, 2, *before_port, train_port, tmp_path, VERSIONS, 2, *last)
             for r in range(2)]
    procs += [start(tmp_path, f"receiver{r}", "vllm_fp8_receiver.py", r, serve_port, tmp_path, VERSIONS, 2,
                    "refresh")
              for r in range(2)]
    logs, failed = wait_all(tmp_path, procs)
    assert not failed, explain(logs, failed)
    out = [logs[f"receiver{r}"] for r in range(2)]
    for log in out:
        assert f"version {VERSIONS} bit-exact" in log, log[-4000:]
        assert f"every parameter still at version {VERSIONS}" in log, log[-4000:]
    return out


def test_bf16_fsdp2_trainer_refreshes_vllm_block_fp8_bit_exact(coordinator, tmp_path):
    # fsdp_trainer.py RANK WORLD TP PORT DIR VERSIONS RECEIVERS DTYPE
    for log in refreshed_logs(coordinator, tmp_path, qwen2_fp8_config(128, 4), "fsdp_trainer.py", before_port=(1,),
                              last=("bfloat16",)):
        assert "parameters (torch.bfloat16, torch.float32, torch.float8_e4m3fn)" in log


def test_f32_moe_trainer_refreshes_vllm_fused_fp8_experts_bit_exact(coordinator, tmp_path):
    """moe_trainer.py (F32, the experts split over two ranks) into vLLM's
    FusedMoE in block FP8 at tp 2: w13_weight, w2_weight and their
    weight_scale_inv as vLLM's load_weights puts the reference's FP8
    checkpoint, three versions."""
    for log in refreshed_logs(coordinator, tmp_path, QWEN3_MOE_FP8, "moe_trainer.py"):
        assert "'model.layers.0.mlp.experts.routed_experts.w13_weight_scale_inv': [4, 2, 2]" in log, log[-4000:]
        assert "'model.layers.0.mlp.gate.weight': [4, 256]" in log, log[-4000:]


def refused_logs(coordinator, tmp_path, config, mode):
    """The logs of two vLLM workers at tp 2 running vllm_fp8_receiver.py's
    `mode` against the manifest of `config`, no trainer."""
    write_files(tmp_path, coordinator, config)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest(config)))
    port = free_port()
    procs = [start(tmp_path, f"receiver{r}", "vllm_fp8_receiver.py", r, port, tmp_path, 0, 2, mode)
             for r in range(2)]
    logs, failed = wait_all(tmp_path, procs, timeout=600)
    assert not failed, explain(logs, failed)
    return [logs[f"receiver{r}"] for r in range(2)]


def test_fp8_model_refused_naming_the_parameter(coordinator, tmp_path):
    for log in refused_logs(coordinator, tmp_path, qwen2_fp8_config(64, 8), "refused"):
        assert ('without a scale: refused: InvalidArgumentError: refit: REFIT_INVALID_ARGUMENT: vLLM parameter '
                '"model.layers.0.self_attn.qkv_proj.weight" (F8_E4M3) has no '
                '"model.layers.0.self_attn.qkv_proj.weight_scale_inv" beside it') in log, log[-4000:]
        assert ('in 64x64 blocks: refused: UnsupportedError: refit: REFIT_UNSUPPORTED: vLLM parameter '
                '"model.layers.0.self_attn.qkv_proj.weight" (F8_E4M3) is quantized in blocks of [64, 64]') in log, \
            log[-4000:]
        # vLLM allows a fused parameter whose parts cut its blocks; refit does not.
        assert ('as vLLM built it: refused: InvalidArgumentError: refit_receiver_create: REFIT_INVALID_ARGUMENT: '
                'config: "recipe": vllm: tensor "model.layers.0.self_attn.k_proj.weight": its shard rows [0, 64) at '
                '256 of buffer "model.layers.0.self_attn.qkv_proj.weight" cut its 128x128 FP8 scale blocks') in log, \
            log[-4000:]
        assert ("no receiver left: refit: REFIT_INVALID_ARGUMENT: refit: init_transfer_engine has not been called"
                in log), log[-4000:]


def test_fp8_experts_whose_blocks_vllm_refines_are_refused_naming_them(coordinator, tmp_path):
    """Experts of width 128 at tp 2: each worker holds 64 rows of a 128-row
    block, and vLLM refines the experts' scale blocks to fit them."""
    config = {**QWEN3_MOE_FP8, "moe_intermediate_size": 128}
    for log in refused_logs(coordinator, tmp_path, config, "refused-as-built"):
        assert ('refused: UnsupportedError: refit: REFIT_UNSUPPORTED: vLLM parameter '
                '"model.layers.0.mlp.experts.routed_experts.w13_weight" (F8_E4M3): vLLM scales this worker\'s '
                'experts in blocks of [64, 64] (the 128x128 blocks divided by (2, 2))') in log, log[-4000:]


# The engine's checks of a model's FP8 parameters, on a module tree shaped
# like vLLM's (names, dtypes, weight_block_size, packed_modules_mapping).

def fp8_model(scale_dtype="float32", experts=None):
    """experts: None; "as built" (FusedMoE in whole 128x128 blocks); or
    the factor by which vLLM's Fp8MoEMethod refined the experts' blocks
    (its weight_scale_refine) for a shard that cuts them."""
    import torch

    def linear(rows, cols):
        m = torch.nn.Module()
        m.weight = torch.nn.Parameter(torch.zeros(rows, cols, dtype=torch.float8_e4m3fn), requires_grad=False)
        scales = torch.zeros(-(-rows // 128), -(-cols // 128), dtype=getattr(torch, scale_dtype))
        m.weight_scale_inv = torch.nn.Parameter(scales, requires_grad=False)
        m.weight_block_size = [128, 128]
        return m

    root = torch.nn.Module()
    root.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    layer = torch.nn.Module()
    layer.self_attn = torch.nn.Module()
    layer.self_attn.qkv_proj = linear(512, 1000)
    layer.mlp = torch.nn.Module()
    layer.mlp.down_proj = linear(1000, 256)
    if experts:
        # FusedMoE of 2 experts of width 256 over hidden 1000, whole.
        moe = torch.nn.Module()
        for name, shape, scales in (("w13_weight", (2, 512, 1000), (2, 4, 8)), ("w2_weight", (2, 1000, 256), (2, 8, 2))):
            setattr(moe, name, torch.nn.Parameter(torch.zeros(shape, dtype=torch.float8_e4m3fn), requires_grad=False))
            setattr(moe, name + "_scale_inv", torch.nn.Parameter(torch.zeros(scales), requires_grad=False))
        moe.weight_block_size = [128, 128]
        moe.global_num_experts = 2
        refined = experts != "as built"
        moe.quant_method = type("Fp8MoEMethod", (), {"weight_scale_refine": experts if refined else None,
                                                     "moe_block_shape": [64, 128] if refined else [128, 128]})()
        layer.mlp.experts = moe
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([layer])
    return root


def fp8_manifest(**left_out):
    p = "model.layers.0."
    m = {p + "self_attn.q_proj.weight": [256, 1000], p + "self_attn.k_proj.weight": [128, 1000],
         p + "self_attn.v_proj.weight": [128, 1000], p + "mlp.down_proj.weight": [1000, 256],
         p + "input_layernorm.weight": [1000]}
    return {n: {"dtype": "BF16", "shape": s} for n, s in m.items() if n not in left_out.values()}


def test_fp8_parameters_give_the_trainer_weights_their_scales():
    from refit._vllm_engine import _fp8_weights, _with_scales
    model = fp8_model()
    fp8 = _fp8_weights(model, list(model.named_parameters()))
    p = "model.layers.0."
    assert fp8 == {p + "self_attn.qkv_proj.weight": [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                                      p + "self_attn.v_proj.weight"],
                   p + "mlp.down_proj.weight": [p + "mlp.down_proj.weight"]}
    out = _with_scales(fp8_manifest(), fp8)
    added = {n: v for n, v in out.items() if n not in fp8_manifest()}
    # 1000 columns: 7 full blocks and a partial one.
    assert added == {p + "self_attn.q_proj.weight_scale_inv": {"dtype": "F32", "shape": [2, 8]},
                     p + "self_attn.k_proj.weight_scale_inv": {"dtype": "F32", "shape": [1, 8]},
                     p + "self_attn.v_proj.weight_scale_inv": {"dtype": "F32", "shape": [1, 8]},
                     p + "mlp.down_proj.weight_scale_inv": {"dtype": "F32", "shape": [8, 2]}}


def test_fused_fp8_experts_give_every_experts_weights_their_scales():
    from refit._vllm_engine import _fp8_weights, _with_scales
    model = fp8_model(experts="as built")
    fp8 = _fp8_weights(model, list(model.named_parameters()))
    p = "model.layers.0.mlp.experts."
    assert fp8[p + "w13_weight"] == [p + "0.gate_proj.weight", p + "0.up_proj.weight", p + "1.gate_proj.weight",
                                     p + "1.up_proj.weight"]
    assert fp8[p + "w2_weight"] == [p + "0.down_proj.weight", p + "1.down_proj.weight"]
    manifest = fp8_manifest()
    for e in range(2):
        manifest.update({f"{p}{e}.gate_proj.weight": {"dtype": "BF16", "shape": [256, 1000]},
                         f"{p}{e}.up_proj.weight": {"dtype": "BF16", "shape": [256, 1000]},
                         f"{p}{e}.down_proj.weight": {"dtype": "BF16", "shape": [1000, 256]}})
    out = _with_scales(manifest, fp8)
    for e in range(2):
        assert out[f"{p}{e}.gate_proj.weight_scale_inv"] == {"dtype": "F32", "shape": [2, 8]}
        assert out[f"{p}{e}.up_proj.weight_scale_inv"] == {"dtype": "F32", "shape": [2, 8]}
        assert out[f"{p}{e}.down_proj.weight_scale_inv"] == {"dtype": "F32", "shape": [8, 2]}


@pytest.mark.parametrize("case", ["ue8m0", "experts", "manifest"])
def test_fp8_parameters_refused_naming_them(case):
    import refit
    from refit._vllm_engine import _fp8_weights, _with_scales
    model = fp8_model(scale_dtype="float8_e8m0fnu" if case == "ue8m0" else "float32", experts=(2, 1) if case == "experts" else None)
    left_out = {"k": "model.layers.0.self_attn.k_proj.weight"} if case == "manifest" else {}
    with pytest.raises(refit.Error) as e:
        _with_scales(fp8_manifest(**left_out), _fp8_weights(model, list(model.named_parameters())))
    want = {"ue8m0": (refit.UnsupportedError, 'vLLM parameter "model.layers.0.self_attn.qkv_proj.weight" (F8_E4M3): '
                      'its scales "model.layers.0.self_attn.qkv_proj.weight_scale_inv" are torch.float8_e8m0fnu'),
            "experts": (refit.UnsupportedError, 'vLLM parameter "model.layers.0.mlp.experts.w13_weight" (F8_E4M3): '
                        "vLLM scales this worker's experts in blocks of [64, 128] (the 128x128 blocks divided by (2, 1))"),
            "manifest": (refit.InvalidArgumentError, 'vLLM parameter "model.layers.0.self_attn.qkv_proj.weight" '
                         '(F8_E4M3) holds "model.layers.0.self_attn.k_proj.weight", which the trainer\'s manifest '
                         'does not have')}[case]
    assert isinstance(e.value, want[0]) and want[1] in e.value.message, e.value
