"""refit's CPU conversion kernels against PyTorch on the CPU, bit for bit.

The reference for FP8 block quantization is vLLM's per_block_cast_to_fp8
(vllm/utils/deep_gemm.py, taken from DeepGEMM), written here with torch's
float8_e4m3fn: scale = amax.clamp(1e-4) / 448 in F32, values =
(x * (1.0 / scale)).to(float8_e4m3fn), edge blocks padded with zeros.
refit's kernel runs through refit_convert_tool (built by meson under
tests/transport/convert/); REFIT_CONVERT_TOOL names it, else it is looked
for in build/. Run by scripts/convert-torch-check; docs/conversion.md says
what each convention is.
"""

import os
import pathlib
import subprocess

import numpy as np
import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[3]
TOOL = pathlib.Path(os.environ.get("REFIT_CONVERT_TOOL",
                                   REPO / "build/tests/transport/convert/refit_convert_tool"))

TORCH_DTYPE = {"BF16": torch.bfloat16, "F32": torch.float32}


def setup_module():
    if not TOOL.exists():
        pytest.fail(f"{TOOL} not found: build it (ninja -C build) or set REFIT_CONVERT_TOOL")


def reference_quantize(x, block):
    """vLLM's per_block_cast_to_fp8 with block = (block rows, block cols)."""
    m, n = x.shape
    bm, bn = block
    padded = torch.zeros((-(-m // bm) * bm, -(-n // bn) * bn), dtype=x.dtype)
    padded[:m, :n] = x
    view = padded.view(-1, bm, padded.size(1) // bn, bn)
    amax = view.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    scale = amax / 448.0
    values = (view * (1.0 / scale)).to(torch.float8_e4m3fn)
    return values.view_as(padded)[:m, :n].contiguous(), scale.view(view.size(0), view.size(2))


def random_blocks(rng, brows, bm, bcols, bn, dtype):
    """brows x bcols blocks of bm x bn, each of one kind: all zero (with -0),
    normal values at a random magnitude (far past E4M3's range, or deep in
    the subnormals of E4M3 after scaling), subnormals of the source type,
    one outlier over tiny values, exact round-to-nearest-even ties (a
    power-of-two scale), or normal values with -0 sprinkled in."""
    shape = (brows, bm, bcols, bn)
    per_block = (brows, 1, bcols, 1)
    kind = rng.integers(0, 6, size=per_block)
    lowest = -133 if dtype == "BF16" else -149
    exp = rng.integers(lowest + 8, 124, size=per_block)
    base = np.clip(rng.standard_normal(shape), -3.9, 3.9)
    x = np.ldexp(base, exp)
    # 0: all zero, signs random.
    zeros = np.where(rng.random(shape) < 0.5, -0.0, 0.0)
    x = np.where(kind == 0, zeros, x)
    # 2: subnormals of the source type.
    x = np.where(kind == 2, np.ldexp(base, lowest + 4), x)
    # 3: one outlier 2^20 times the rest.
    outlier = np.zeros(shape, dtype=bool)
    outlier[:, 0, :, 0] = True
    x = np.where((kind == 3) & outlier, np.ldexp(base, np.minimum(exp + 20, 124)), x)
    # 4: amax 448 * 2^j, so the scale is 2^j and x / scale is exact:
    # half-integers in [-448, 448], many of them ties on E4M3's grid.
    j = rng.integers(-100, 100, size=per_block)
    halves = rng.integers(-896, 897, size=shape) / 2.0
    halves[:, 0, :, 0] = np.where(rng.random((brows, bcols)) < 0.5, -448.0, 448.0)
    x = np.where(kind == 4, np.ldexp(halves, j), x)
    # 5: normal values, a third of them -0.
    x = np.where((kind == 5) & (rng.random(shape) < 0.33), -0.0, x)
    t = torch.from_numpy(x.reshape(brows * bm, bcols * bn).astype(np.float32))
    return t.to(TORCH_DTYPE[dtype])


def run_tool(tmp_path, x, dtype, block):
    rows, cols = x.shape
    src = tmp_path / "src.bin"
    vals = tmp_path / "values.bin"
    scales = tmp_path / "scales.bin"
    raw = x.contiguous().view(torch.int16 if dtype == "BF16" else torch.int32).numpy()
    raw.tofile(src)
    proc = subprocess.run([str(TOOL), "quantize", dtype, str(rows), str(cols), str(block[0]), str(block[1]),
                           str(src), str(vals), str(scales)], capture_output=True, text=True, timeout=600)
    return proc, vals, scales


# (dtype, tensor rows, tensor cols, block rows, block cols): 1,049,952 blocks.
CASES = [
    ("BF16", 2048, 2048, 4, 4),        # 262,144 blocks
    ("BF16", 2048, 1024, 1, 8),        # 262,144
    ("BF16", 512, 512, 1, 1),          # 262,144: every element its own block
    ("F32", 2048, 2048, 2, 8),         # 262,144
    ("BF16", 4096, 4096, 128, 128),    # 1,024: DeepSeek-V3 / Kimi-K2 blocks
    ("BF16", 576, 7168, 128, 128),     # 280: partial last block row (kv_a_proj_with_mqa)
    ("F32", 1000, 1100, 128, 128),     # 72: partial in both dimensions
]

totals = {"blocks": 0, "bytes": 0, "differing": 0}


@pytest.mark.parametrize("dtype,rows,cols,bm,bn", CASES)
def test_quantize_matches_torch(tmp_path, dtype, rows, cols, bm, bn):
    rng = np.random.default_rng(rows * 7919 + cols * 31 + bm * 7 + bn)
    brows, bcols = -(-rows // bm), -(-cols // bn)
    x = random_blocks(rng, brows, bm, bcols, bn, dtype)[:rows, :cols].contiguous()
    ref_values, ref_scales = reference_quantize(x, (bm, bn))
    proc, vals, scales = run_tool(tmp_path, x, dtype, (bm, bn))
    assert proc.returncode == 0, proc.stderr
    got_values = np.fromfile(vals, dtype=np.uint8)
    got_scales = np.fromfile(scales, dtype=np.uint8)
    want_values = ref_values.view(torch.uint8).numpy().reshape(-1)
    want_scales = ref_scales.contiguous().float().numpy().view(np.uint8).reshape(-1)
    assert got_values.size == want_values.size and got_scales.size == want_scales.size
    differing = int(np.count_nonzero(got_values != want_values)) + int(np.count_nonzero(got_scales != want_scales))
    totals["blocks"] += brows * bcols
    totals["bytes"] += want_values.size + want_scales.size
    totals["differing"] += differing
    print(f"\n{dtype} {rows}x{cols} in {bm}x{bn} blocks: {brows * bcols} blocks, "
          f"{want_values.size + want_scales.size} bytes, {differing} differ "
          f"(running total: {totals['blocks']} blocks, {totals['differing']} bytes differ)")
    if differing:
        bad = np.flatnonzero(got_values != want_values)[:5]
        flat = x.reshape(-1).float()
        detail = [(int(i), float(flat[i]), int(got_values[i]), int(want_values[i])) for i in bad]
        pytest.fail(f"{differing} bytes differ; first (index, source, refit, torch): {detail}")


def test_at_least_a_million_blocks_compared():
    # Runs after the cases above (pytest keeps file order).
    assert totals["blocks"] >= 1_000_000, totals
    assert totals["differing"] == 0, totals
    print(f"\ntotal: {totals['blocks']} blocks, {totals['bytes']} bytes compared, {totals['differing']} differ")


def vllm_quantizer():
    """vLLM's own per_block_cast_to_fp8 (vllm/utils/deep_gemm.py), run
    eagerly: vLLM wraps it in torch.compile, whose original Python body is
    the function itself. None when vLLM is not installed."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        from vllm.utils import deep_gemm
    except ImportError:
        return None
    f = deep_gemm.per_block_cast_to_fp8
    return getattr(f, "_torchdynamo_orig_callable", f)


# (dtype, tensor rows, tensor cols, block rows, block cols): 263,576 blocks.
VLLM_CASES = [
    ("BF16", 2048, 2048, 4, 4),        # 262,144 blocks
    ("BF16", 4096, 4096, 128, 128),    # 1,024
    ("BF16", 576, 7168, 128, 128),     # 280: partial last block row
    ("F32", 1000, 1100, 128, 128),     # 72: partial in both dimensions
]


@pytest.mark.parametrize("dtype,rows,cols,bm,bn", VLLM_CASES)
def test_quantize_matches_vllms_own_function(tmp_path, dtype, rows, cols, bm, bn):
    """Bit for bit against vLLM's quantizer itself, not only against the
    reference written after it above."""
    quantize = vllm_quantizer()
    if quantize is None:
        pytest.skip("vLLM is not installed in this Python (scripts/python-env installs it)")
    rng = np.random.default_rng(rows * 104729 + cols + bm)
    brows, bcols = -(-rows // bm), -(-cols // bn)
    x = random_blocks(rng, brows, bm, bcols, bn, dtype)[:rows, :cols].contiguous()
    want_values, want_scales = quantize(x, [bm, bn])
    proc, vals, scales = run_tool(tmp_path, x, dtype, (bm, bn))
    assert proc.returncode == 0, proc.stderr
    got_values = np.fromfile(vals, dtype=np.uint8)
    got_scales = np.fromfile(scales, dtype=np.uint8)
    want_v = want_values.view(torch.uint8).numpy().reshape(-1)
    want_s = want_scales.contiguous().float().numpy().view(np.uint8).reshape(-1)
    assert got_values.size == want_v.size and got_scales.size == want_s.size
    differing = int(np.count_nonzero(got_values != want_v)) + int(np.count_nonzero(got_scales != want_s))
    print(f"\nvLLM's per_block_cast_to_fp8, {dtype} {rows}x{cols} in {bm}x{bn} blocks: {brows * bcols} blocks, "
          f"{want_v.size + want_s.size} bytes, {differing} differ")
    assert differing == 0


def test_nan_and_inf_are_refused_naming_the_block(tmp_path):
    x = torch.ones((256, 384), dtype=torch.bfloat16)
    x[130, 260] = float("nan")  # block (1, 2)
    proc, vals, _ = run_tool(tmp_path, x, "BF16", (128, 128))
    assert proc.returncode == 2
    assert "block (1, 2)" in proc.stderr and "NaN" in proc.stderr, proc.stderr
    assert not vals.exists()
    x[130, 260] = float("-inf")
    proc, _, _ = run_tool(tmp_path, x, "BF16", (128, 128))
    assert proc.returncode == 2 and "infinity" in proc.stderr, proc.stderr


def run_cast(tmp_path, src_np, frm, to):
    src = tmp_path / "cast_src.bin"
    out = tmp_path / "cast_out.bin"
    src_np.tofile(src)
    proc = subprocess.run([str(TOOL), "cast", frm, to, str(src_np.size), str(src), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return np.fromfile(out, dtype=np.uint16)


def test_bf16_to_f16_every_value(tmp_path):
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    bits = bits[(bits & 0x7FFF) <= 0x7F80]  # every BF16 but the NaNs (docs/conversion.md)
    want = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(torch.float16).view(torch.int16).numpy()
    got = run_cast(tmp_path, bits, "BF16", "F16")
    assert np.count_nonzero(got != want.view(np.uint16)) == 0
    print(f"\nBF16 -> F16: {bits.size} values, 0 differ")


@pytest.mark.parametrize("to", ["BF16", "F16"])
def test_f32_casts(tmp_path, to):
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 2**32, size=4_000_000, dtype=np.uint64).astype(np.uint32)
    # Half of them near F16's range, where its rounding and subnormals are.
    near = (rng.integers(0x33000000, 0x47800000, size=bits.size // 2, dtype=np.uint64).astype(np.uint32)
            | (rng.integers(0, 2, size=bits.size // 2, dtype=np.uint64).astype(np.uint32) << 31))
    bits[: near.size] = near
    bits = bits[(bits & 0x7FFFFFFF) <= 0x7F800000]  # no NaN
    t = torch.from_numpy(bits.view(np.int32)).view(torch.float32)
    want = t.to(torch.bfloat16 if to == "BF16" else torch.float16).view(torch.int16).numpy().view(np.uint16)
    got = run_cast(tmp_path, bits, "F32", to)
    assert np.count_nonzero(got != want) == 0
    print(f"\nF32 -> {to}: {bits.size} values, 0 differ")


def test_f32_to_e4m3_elements(tmp_path):
    """The element conversion alone: rounding, subnormals, saturation past
    448 (infinity included), against torch's .to(float8_e4m3fn)."""
    rng = np.random.default_rng(13)
    bits = rng.integers(0, 2**32, size=2_000_000, dtype=np.uint64).astype(np.uint32)
    # Most of them in and around E4M3's range: 2^-12 to 2^10.
    near = rng.integers(0x39800000, 0x44800000, size=bits.size * 3 // 4, dtype=np.uint64).astype(np.uint32)
    bits[: near.size] = near | (rng.integers(0, 2, size=near.size, dtype=np.uint64).astype(np.uint32) << 31)
    bits = np.concatenate([bits, np.array([0x7F800000, 0xFF800000, 0x43E80000, 0x43E80001], dtype=np.uint32)])
    bits = bits[(bits & 0x7FFFFFFF) <= 0x7F800000]  # no NaN
    src = tmp_path / "e4m3_src.bin"
    out = tmp_path / "e4m3_out.bin"
    bits.tofile(src)
    proc = subprocess.run([str(TOOL), "e4m3", str(bits.size), str(src), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = np.fromfile(out, dtype=np.uint8)
    want = torch.from_numpy(bits.view(np.int32)).view(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.count_nonzero(got != want) == 0
    print(f"\nF32 -> F8_E4M3 elements: {bits.size} values, 0 differ")
