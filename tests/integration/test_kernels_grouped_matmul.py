"""Grouped matmul (the MoE experts): the blocked XLA implementation and the Pallas kernel (interpret mode on
CPU) against jax.lax.ragged_dot and a per-group numpy loop, forward and VJP, fp32 and bf16, over odd shapes;
the tiny MoE trains to the same losses with each implementation; both compile for an H100 far below
ragged_dot's dense lowering; bad settings are one-line errors."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.config import ConfigError, KernelConfig

from jaxmem.loader import load_config
from jaxmem.registry import build_program
from jaxmem.kernels import resolve, select_grouped_matmul
from jaxmem.kernels.grouped_matmul import blocked, pallas
from jaxmem.kernels.grouped_matmul.config import GroupedMatmulBlocks
from jaxmem.kernels.grouped_matmul.layout import padded_blocks
from jaxmem.kernels.grouped_matmul.reference import grouped_matmul_loop, grouped_matmul_reference
from kernel_checks import TOLERANCES, assert_close

# (rows, D, F, group sizes, block rows, blocks per chunk): odd widths, empty groups (first, middle, last), one
# group holding every row, rows after the last group (sum < rows), a group of many blocks, chunks by shape
CASES = [
    (37, 9, 11, [5, 0, 20, 3, 9], 8, 3),
    (37, 9, 11, [0, 37, 0], 8, 2),
    (50, 5, 7, [10, 0, 30, 0], 16, 1),
    (300, 16, 24, [0, 0, 0, 300, 0], 64, 3),
    (200, 33, 17, [41, 0, 1, 77, 2, 0, 64], 16, 0),
    (129, 8, 8, [1] * 6 + [123], 128, 0),
]


def _implementation(impl: str, blocks: GroupedMatmulBlocks):
    if impl == "blocked":
        return functools.partial(blocked.grouped_matmul, blocks=blocks)
    # Triton tiles: at least 16 rows; small column tiles so that odd widths take several masked steps
    blocks = GroupedMatmulBlocks(block_rows=max(16, blocks.block_rows), pallas_block_k=16, pallas_block_n=16)
    return functools.partial(pallas.grouped_matmul, blocks=blocks, interpret=True)


def _inputs(rows, d, f, sizes, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(k[0], (rows, d), jnp.float32).astype(dtype)
    rhs = jax.random.normal(k[1], (len(sizes), d, f), jnp.float32).astype(dtype)
    dy = jax.random.normal(k[2], (rows, f), jnp.float32).astype(dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), dy


def _vjp(fn, lhs, rhs, sizes, dy):
    out, pullback = jax.vjp(lambda x, w: fn(x, w, sizes), lhs, rhs)
    return (out, *pullback(dy))


@pytest.mark.parametrize("impl", ["blocked", "pallas"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}g{len(c[3])}b{c[4]}" for c in CASES])
def test_matches_ragged_dot_forward_and_vjp(case, dtype, impl):
    rows, d, f, sizes, block, chunk = case
    lhs, rhs, group_sizes, dy = _inputs(rows, d, f, sizes, dtype)
    fn = _implementation(impl, GroupedMatmulBlocks(block_rows=block, chunk_blocks=chunk))
    got = jax.jit(lambda *a: _vjp(fn, *a))(lhs, rhs, group_sizes, dy)
    f32 = [jnp.asarray(a, jnp.float32) for a in (lhs, rhs, dy)]  # the fp32 spec of the same (rounded) inputs
    want = _vjp(grouped_matmul_reference, f32[0], f32[1], group_sizes, f32[2])
    forward_tol, grad_tol = (1e-5, 1e-5) if dtype == jnp.float32 else TOLERANCES[dtype]
    assert [a.dtype for a in got] == [jnp.dtype(dtype)] * 3
    for name, a, b, tol in zip(("out", "d_lhs", "d_rhs"), got, want, (forward_tol, grad_tol, grad_tol)):
        assert_close(a, b, tol, f"{name} {jnp.dtype(dtype).name}")
    np.testing.assert_allclose(np.asarray(want[0]), grouped_matmul_loop(*f32[:2], sizes), rtol=1e-5, atol=1e-4)
    assert not np.any(np.asarray(got[0], np.float32)[sum(sizes):])  # rows after the groups are zero
    empty = [g for g, n in enumerate(sizes) if n == 0]
    assert not np.any(np.asarray(got[2], np.float32)[empty])  # an empty group gets no weight gradient


@pytest.mark.parametrize("impl", ["blocked", "pallas"])
def test_preferred_element_type_and_rows_after_the_used_blocks(impl):
    lhs, rhs, sizes, _ = _inputs(40, 6, 5, [3, 4, 5, 6], jnp.bfloat16)
    fn = _implementation(impl, GroupedMatmulBlocks(block_rows=4, chunk_blocks=1))
    out = fn(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32
    want = grouped_matmul_reference(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    assert_close(out, want, 1e-5, "fp32 out of bf16 inputs")  # both accumulate in fp32 from the same inputs
    assert not np.any(np.asarray(out)[18:])
    # 40 rows in 4 groups of blocks of 4 may need 10 + 3 blocks; 3 + 4 + 5 + 6 rows need 1 + 1 + 2 + 2 = 6
    assert padded_blocks(40, 4, 4) == 13


def test_pallas_takes_an_fp32_output_gradient_of_bf16_inputs_and_builds_for_sm_90():
    """A LoRA adapter's grouped matmul outputs fp32 (preferred_element_type) from bf16 inputs, so its backward
    pairs an fp32 gradient with bf16 rows and weights: Triton's dot takes one element type (this failed to
    build for an H100 before the kernel cast its tiles; interpret mode had not minded)."""
    lhs, rhs, sizes, dy = _inputs(40, 6, 5, [3, 4, 5, 6], jnp.bfloat16)
    dy = dy.astype(jnp.float32)
    fn = _implementation("pallas", GroupedMatmulBlocks(block_rows=16))
    f32 = functools.partial(fn, preferred_element_type=jnp.float32)
    got = _vjp(f32, lhs, rhs, sizes, dy)
    want = _vjp(functools.partial(grouped_matmul_reference, preferred_element_type=jnp.float32), lhs, rhs, sizes, dy)
    assert [a.dtype for a in got] == [jnp.float32, jnp.bfloat16, jnp.bfloat16]
    for name, a, b in zip(("out", "d_lhs", "d_rhs"), got, want):
        assert_close(a, b, TOLERANCES[jnp.bfloat16][1], name)
    pytest.importorskip("jax_cuda12_plugin")
    from jaxmem.runtime.aot import compile_abstract, target_devices

    device = jax.sharding.SingleDeviceSharding(target_devices("h100-80g", 1)[0])
    compiled = compile_abstract(
        lambda x, w, n, g: _vjp(functools.partial(pallas.grouped_matmul, preferred_element_type=jnp.float32),
                                x, w, n, g),
        *(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device) for a in (lhs, rhs, sizes, dy)))
    text = compiled.as_text()
    assert all(name in text for name in ("grouped_matmul_fwd", "grouped_matmul_bwd_lhs", "grouped_matmul_bwd_rhs"))


def test_pallas_reads_an_fp32_output_gradient_of_bf16_inputs_in_bf16():
    """The Pallas backward rounds an fp32 output gradient (a LoRA adapter's fp32 output of bf16 inputs) to bf16
    before gathering it to padded rows, halving what was the largest buffer at QLoRA Qwen3-30B-A3B widths: the
    gradients equal those of the bf16-rounded output gradient, bit for bit (not those of the fp32 one)."""
    lhs, rhs, sizes, dy = _inputs(40, 6, 5, [3, 4, 5, 6], jnp.bfloat16)
    dy32 = dy.astype(jnp.float32) * (1 + 1e-3 * jax.random.normal(jax.random.key(7), dy.shape))
    assert not np.array_equal(np.asarray(dy32), np.asarray(dy32.astype(jnp.bfloat16), np.float32))
    fn = functools.partial(_implementation("pallas", GroupedMatmulBlocks(block_rows=16)),
                           preferred_element_type=jnp.float32)
    got = _vjp(fn, lhs, rhs, sizes, dy32)
    rounded = _vjp(fn, lhs, rhs, sizes, dy32.astype(jnp.bfloat16).astype(jnp.float32))
    for a, b in zip(got[1:], rounded[1:]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("target,dtype", [("rtx4090-24g", jnp.bfloat16), ("a100-80g", jnp.float32)])
def test_pallas_tiles_fit_the_shared_memory_of_the_gpu_it_builds_for(target, dtype):
    """At Qwen3-30B-A3B widths the configured tiles asked 128 KiB of an RTX 4090's 99 in bf16 and more than
    any GPU has in fp32; the kernel now halves them for the GPU it is compiled for (and keeps them for bf16 on
    an H100, the configuration measured on GPU)."""
    pytest.importorskip("jax_cuda12_plugin")
    from jaxmem.runtime.aot import compile_abstract, lowering_target, target_devices

    device = target_devices(target, 1)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(shape, t, sharding=sharding)
            for shape, t in (((2048, 2048), dtype), ((16, 2048, 768), dtype), ((16,), jnp.int32))]
    compiled = compile_abstract(lambda x, w, n: _vjp(pallas.grouped_matmul, x, w, n, x[:, :768]), *args)
    assert "grouped_matmul_bwd_rhs" in compiled.as_text()
    blocks = GroupedMatmulBlocks()
    dw_tiles = lambda a, b: blocks.block_rows * (a + b)  # noqa: E731
    fitted = {"rtx4090-24g": (64, 32, 3), "a100-80g": (128, 64, 3)}[target]  # 99 KiB on sm_89, 163 on sm_80
    with lowering_target(device):
        assert pallas._fit(128, 128, dw_tiles, 2, blocks) == fitted  # bf16 dw tiles
    with lowering_target(target_devices("h100-80g", 1)[0]):
        assert pallas._fit(128, 128, dw_tiles, 2, blocks) == (128, 128, 3)  # as measured on an H200


def test_padded_blocks_bound_every_split():
    """ceil(M / b) + G - 1 blocks suffice for every split of M rows into G groups (and no more than M)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows, groups, block = int(rng.integers(1, 200)), int(rng.integers(1, 12)), int(rng.integers(1, 40))
        cuts = np.sort(rng.integers(0, rows + 1, groups - 1))
        sizes = np.diff(np.concatenate([[0], cuts, [rows]]))
        assert np.sum(-(-sizes // block)) <= padded_blocks(rows, groups, block), (rows, groups, block, sizes)


def test_dispatch_picks_pallas_on_one_gpu_blocked_elsewhere_and_ragged_dot_on_request():
    # one GPU: the Pallas kernel (as lean, 1.9x the step's speed on an H200); several devices: blocked, which
    # GSPMD splits (it runs a Pallas call whole on every device); CPU: blocked (Pallas would interpret)
    assert [resolve(KernelConfig(), platform, n)["grouped_matmul"] for platform, n in
            (("gpu", 1), ("gpu", 2), ("gpu", 8), ("cpu", 1), ("cpu", 8))] == ["pallas"] + ["blocked"] * 4
    assert resolve(KernelConfig(grouped_matmul="blocked"), "gpu", 1)["grouped_matmul"] == "blocked"
    lhs, rhs, sizes, _ = _inputs(20, 4, 3, [7, 0, 13], jnp.float32)
    for impl in ("blocked", "ragged_dot", "pallas"):
        fn = select_grouped_matmul(KernelConfig(grouped_matmul=impl, grouped_matmul_block_rows=16), "cpu")
        jaxpr = jax.make_jaxpr(lambda x, w: fn(x, w, sizes))(lhs, rhs).jaxpr
        assert {f"grouped_matmul_{impl}"} == {str(e.source_info.name_stack) for e in jaxpr.eqns}
        assert ("ragged_dot" in str(jaxpr)) == (impl == "ragged_dot")
        assert_close(fn(lhs, rhs, sizes), grouped_matmul_reference(lhs, rhs, sizes), 1e-5, impl)


@pytest.mark.parametrize("override,key", [
    ("kernels.grouped_matmul=dense", "kernels.grouped_matmul"),
    ("kernels.grouped_matmul_block_rows=100", "kernels.grouped_matmul_block_rows"),
    ("kernels.grouped_matmul_block_rows=0", "kernels.grouped_matmul_block_rows"),
])
def test_bad_grouped_matmul_settings_are_one_line_errors(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_config("configs/tiny.yaml", [override])
    assert "\n" not in str(e.value)


def _train_losses(impl, steps=3):
    cfg = load_config("configs/tiny.yaml", [
        "train.seq_len=32", "train.micro_batch=8", "optimizer.warmup_steps=0", "model.n_experts=8",
        "model.experts_per_token=2", "model.router_z_loss_coef=0.001", "parallel.fsdp=1",
        f"kernels.grouped_matmul={impl}", "kernels.grouped_matmul_block_rows=16"])
    prog = build_program(cfg, devices=jax.devices()[:1])
    state, step = prog.init_state(), prog.jit_step()
    toks = np.random.default_rng(0).integers(0, 256, size=(8, cfg.train.seq_len + 1)).astype(np.int32)
    out = []
    for _ in range(steps):
        state, m = step(state, prog.shard_batch(toks.reshape(prog.batch_shape)))
        out.append([float(m[k]) for k in ("loss", "moe_aux_loss", "moe_z_loss", "grad_norm")])
    return np.array(out)


@pytest.fixture(scope="module")
def ragged_dot_losses():
    return _train_losses("ragged_dot")


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["pallas"])
def test_tiny_moe_trains_the_same_as_with_ragged_dot(impl, ragged_dot_losses):
    """Three train steps through the Pallas kernel (interpret mode) give ragged_dot's metrics. The blocked
    kernel is what every CPU train program takes (auto): test_moe_lora.py's
    test_expert_adapter_gradients_equal_the_merged_reference holds its loss, router losses and gradients to
    the plain model's through ragged_dot, and test_matches_ragged_dot_forward_and_vjp its forward and VJP."""
    assert ragged_dot_losses[-1, 0] < ragged_dot_losses[0, 0] - 0.2, ragged_dot_losses  # the loss falls
    # 3 steps' metrics through two implementations summing in another order: jax 0.10.2 agrees to 1e-5, jax
    # 0.12.0.1 to 2.1e-5 (the last step's fourth metric, blocked)
    np.testing.assert_allclose(_train_losses(impl), ragged_dot_losses, rtol=5e-5)


def _compile_fwd_bwd_for_h100(fn, rows, d, f, groups):
    """XLA's memory analysis of a deviceless sm_90 compile of out + both gradients in bf16."""
    from jaxmem.runtime.aot import compile_abstract, target_devices

    sharding = jax.sharding.SingleDeviceSharding(target_devices("h100-80g", 1)[0])
    args = (jax.ShapeDtypeStruct((rows, d), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((groups, d, f), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((groups,), jnp.int32, sharding=sharding))

    def fwd_bwd(x, w, sizes):
        out, pullback = jax.vjp(lambda x, w: fn(x, w, sizes), x, w)
        return pullback(out)

    return compile_abstract(fwd_bwd, *args).memory_analysis()


@pytest.mark.slow
def test_blocked_and_pallas_compile_for_h100_far_below_ragged_dots_dense_lowering():
    """XLA:GPU lowers ragged_dot with a masked [M, G x D] lhs; blocked keeps O(padded rows) + one weight chunk
    (+ its fp32 d_rhs accumulator), the Pallas kernel O(padded rows) (and it builds for sm_90)."""
    rows, d, f, groups = 8192, 512, 256, 64
    ragged = _compile_fwd_bwd_for_h100(grouped_matmul_reference, rows, d, f, groups).temp_size_in_bytes
    assert ragged >= rows * groups * d * 2  # the dense bf16 lhs is there
    padded_rows = padded_blocks(rows, groups, 128) * 128 + 16 * 128  # + at most one chunk of rounding
    for impl, extra in (("blocked", groups * d * f * 4 + 16 * d * f * 4), ("pallas", 0)):
        fn = blocked.grouped_matmul if impl == "blocked" else pallas.grouped_matmul
        temp = _compile_fwd_bwd_for_h100(fn, rows, d, f, groups).temp_size_in_bytes
        assert temp < 0.2 * ragged, (impl, temp, ragged)
        assert temp < 3 * padded_rows * (d + f) * 2 + extra, (impl, temp)


@pytest.mark.slow
def test_bench_script_labels_every_figure():
    """scripts/bench_grouped_matmul.py's cases at a small shape: each figure says how it was obtained."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "bench_grouped_matmul.py"
    spec = importlib.util.spec_from_file_location("bench_grouped_matmul", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shape = (2048, 128, 64, 16)
    kernel = {impl: bench.deviceless_case(impl, shape) for impl in bench.IMPLS}
    timed = bench.gpu_case("blocked", shape, "float32")
    text = bench._markdown({"shape": list(shape), "kernel": list(kernel.values()), "cpu": [timed]})
    assert text.count("compiled deviceless (h100-80g, jax") == 3 and "| blocked | 2048, 128, 64, 16 |" in text
    assert timed["how"].startswith("measured on CPU") and timed["fwd_bwd_ms"] > 0
    assert kernel["blocked"]["fwd_bwd_temp_gib"] < 0.2 * kernel["ragged_dot"]["fwd_bwd_temp_gib"]
    assert kernel["pallas"]["fwd_bwd_temp_gib"] < 0.2 * kernel["ragged_dot"]["fwd_bwd_temp_gib"]
