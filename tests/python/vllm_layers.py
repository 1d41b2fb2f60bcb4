"""Held against vLLM's own layers: the layout refit's vLLM recipe gives a
model (refit-plan --layout-out, from its manifest and Hugging Face config)
equals what vLLM allocates and loads at every TP rank.

How: vLLM builds a layer for TP rank r of N in one process when its
parallel-state queries answer r and N (they are patched in the modules that
call them: linear, vocab_parallel_embedding, parameter); no process group is
made. Per rank it builds the layers of one decoder layer (QKVParallelLinear,
RowParallelLinear for o_proj and down_proj, MergedColumnParallelLinear,
RMSNorm) and the VocabParallelEmbedding, with int32 parameters. Then:

  - shapes: every receiver buffer refit gives rank r has the name and the
    byte size (at the manifest's BF16) of a parameter vLLM allocated at rank
    r, and every such parameter of every layer has a buffer;
  - contents: each Hugging Face tensor of layer 0 and the embedding is
    tagged, element i holding i + 1, loaded by vLLM's own weight_loader into
    a zeroed parameter, and compared element by element with the same zeroed
    parameter filled through refit's segments for that tensor.

    vllm_layers.py CONFIG.json LAYOUT.json TP [CONFIG.json LAYOUT.json TP ...]
    vllm_layers.py --refuses CONFIG.json TP     (vLLM's own refusal)

Prints one line per rank; exits non-zero at the first difference.
"""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")

import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from contextlib import ExitStack  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402
import vllm.model_executor.layers.linear as linear  # noqa: E402
import vllm.model_executor.layers.vocab_parallel_embedding as vocab  # noqa: E402
import vllm.model_executor.parameter as parameter  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402

BF16_BYTES = 2


def as_rank(rank, tp):
    """vLLM's TP-rank queries answer `rank` of `tp` inside the context."""
    stack = ExitStack()
    for module in (linear, vocab, parameter):
        stack.enter_context(mock.patch.object(module, "get_tensor_model_parallel_rank", return_value=rank))
        stack.enter_context(mock.patch.object(module, "get_tensor_model_parallel_world_size", return_value=tp))
    return stack


def build_layers(config, rank, tp):
    """vLLM's layers of one decoder layer and the embedding at TP rank `rank`,
    keyed by the parameter name vLLM gives them in layer 0."""
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd, inter = config["head_dim"], config["intermediate_size"]
    bias = config["model_type"] == "qwen2"
    dt = torch.int32
    with as_rank(rank, tp):
        qkv = linear.QKVParallelLinear(hidden, hd, heads, kv, bias=bias, params_dtype=dt)
        o = linear.RowParallelLinear(heads * hd, hidden, bias=False, params_dtype=dt)
        gate_up = linear.MergedColumnParallelLinear(hidden, [inter, inter], bias=False, params_dtype=dt)
        down = linear.RowParallelLinear(inter, hidden, bias=False, params_dtype=dt)
        embed = vocab.VocabParallelEmbedding(config["vocab_size"], hidden, params_dtype=dt)
    norm = RMSNorm(hidden)
    p = "model.layers.0."
    layers = {p + "self_attn.qkv_proj": qkv, p + "self_attn.o_proj": o, p + "mlp.gate_up_proj": gate_up,
              p + "mlp.down_proj": down, p + "input_layernorm": norm, p + "post_attention_layernorm": norm,
              "model.embed_tokens": embed, "model.norm": norm}
    if not config["tie_word_embeddings"]:
        layers["lm_head"] = embed  # ParallelLMHead lays out as VocabParallelEmbedding
    return layers


def vllm_shapes(config, layers):
    """Every parameter vLLM allocates at this rank: name -> shape, over all layers."""
    shapes = {}
    for prefix, layer in layers.items():
        for pname, param in layer.named_parameters():
            name = f"{prefix}.{pname}"
            if name.startswith("model.layers.0."):
                for i in range(config["num_hidden_layers"]):
                    shapes[name.replace("model.layers.0.", f"model.layers.{i}.", 1)] = tuple(param.shape)
            else:
                shapes[name] = tuple(param.shape)
    return shapes


# Layer 0's Hugging Face tensors and how vLLM loads each: (tensor, vLLM
# layer, parameter, shard id for weight_loader).
def loads(config):
    p = "model.layers.0."
    out = [(p + "self_attn.q_proj.weight", p + "self_attn.qkv_proj", "weight", "q"),
           (p + "self_attn.k_proj.weight", p + "self_attn.qkv_proj", "weight", "k"),
           (p + "self_attn.v_proj.weight", p + "self_attn.qkv_proj", "weight", "v"),
           (p + "self_attn.o_proj.weight", p + "self_attn.o_proj", "weight", None),
           (p + "mlp.gate_proj.weight", p + "mlp.gate_up_proj", "weight", 0),
           (p + "mlp.up_proj.weight", p + "mlp.gate_up_proj", "weight", 1),
           (p + "mlp.down_proj.weight", p + "mlp.down_proj", "weight", None),
           ("model.embed_tokens.weight", "model.embed_tokens", "weight", None)]
    if config["model_type"] == "qwen2":
        out += [(p + f"self_attn.{x}_proj.bias", p + "self_attn.qkv_proj", "bias", x) for x in "qkv"]
    return out


def tags(shape):
    """A tensor whose element i (row-major) holds i + 1."""
    n = 1
    for d in shape:
        n *= d
    return torch.arange(1, n + 1, dtype=torch.int32).view(*shape)


def fill_from_segments(out, buffer, tensor, source):
    """Writes the boxes of `tensor` that refit's `buffer` holds into `out`."""
    flat = out.view(-1)
    for s in buffer["segments"]:
        if s["tensor"] != tensor:
            continue
        box = tuple(slice(a, a + n) for a, n in zip(s["start"], s["size"]))
        flat.as_strided(s["size"], s["strides"], s["offset"]).copy_(source[box])


def main(config_path, layout_path, tp):
    config = json.load(open(config_path))
    layout = json.load(open(layout_path))
    shapes_of = {t["name"]: t["shape"] for t in layout["tensors"]}
    buffers = [b for b in layout["buffers"] if b["side"] == "receiver"]
    tagged = {}  # tensor -> its tags, made once for all ranks
    with set_current_vllm_config(VllmConfig()):
        for rank in range(tp):
            layers = build_layers(config, rank, tp)
            theirs = vllm_shapes(config, layers)
            ours = {b["name"]: b for b in buffers if b["rank"] == rank}
            if ours.keys() != theirs.keys():
                raise SystemExit(f"rank {rank}: refit's buffers and vLLM's parameters differ: only refit "
                                 f"{sorted(ours.keys() - theirs.keys())}, only vLLM "
                                 f"{sorted(theirs.keys() - ours.keys())}")
            for name, shape in theirs.items():
                want = BF16_BYTES
                for d in shape:
                    want *= d
                if ours[name]["bytes"] != want:
                    raise SystemExit(f"rank {rank}: \"{name}\": refit's buffer has {ours[name]['bytes']} bytes, "
                                     f"vLLM's parameter {list(shape)} has {want}")
            checked = 0
            for tensor, prefix, pname, shard in loads(config):
                param = getattr(layers[prefix], pname)
                if tensor not in tagged:
                    tagged[tensor] = tags(shapes_of[tensor])
                source = tagged[tensor]
                with torch.no_grad():
                    param.data.zero_()
                    loader = param.weight_loader
                    loader(param, source) if shard is None else loader(param, source, shard)
                expected = torch.zeros_like(param.data)
                fill_from_segments(expected, ours[f"{prefix}.{pname}"], tensor, source)
                if not torch.equal(param.data, expected):
                    diff = (param.data != expected).nonzero()
                    first = tuple(diff[0].tolist())
                    raise SystemExit(f"rank {rank}: \"{tensor}\" in \"{prefix}.{pname}\" {list(param.shape)}: "
                                     f"{len(diff)} elements differ; first at {first}: vLLM holds source element "
                                     f"{int(param.data[first]) - 1}, refit "
                                     f"{int(expected[first]) - 1} (-1: nothing)")
                checked += param.numel()
            print(f"rank {rank}/{tp}: {len(theirs)} parameters of equal size; "
                  f"{len(loads(config))} tensors loaded by vLLM equal refit's segments "
                  f"({checked} elements compared)", flush=True)


def vllm_refuses(config_path, tp):
    """Says whether vLLM's QKVParallelLinear refuses this model at `tp` (its message)."""
    config = json.load(open(config_path))
    with set_current_vllm_config(VllmConfig()), as_rank(0, tp):
        try:
            linear.QKVParallelLinear(config["hidden_size"], config["head_dim"], config["num_attention_heads"],
                                     config["num_key_value_heads"], params_dtype=torch.int32)
        except (AssertionError, ValueError) as e:
            print(f"{config_path} tp {tp}: vLLM refuses: {type(e).__name__}: {e}", flush=True)
            return
    raise SystemExit(f"{config_path} tp {tp}: vLLM builds QKVParallelLinear")


if __name__ == "__main__":
    # Jobs: CONFIG LAYOUT TP (compare), or --refuses CONFIG TP; one vLLM import for all.
    a = sys.argv[1:]
    while a:
        if a[0] == "--refuses":
            vllm_refuses(a[1], int(a[2]))
        else:
            print(f"{a[0]} tp {a[2]}:", flush=True)
            main(a[0], a[1], int(a[2]))
        a = a[3:]
