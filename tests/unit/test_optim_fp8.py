"""fp8 moments (precision.moment_dtype=float8): m and v stored as float8_e4m3fn values with an fp32 scale per
block of 256 (jaxmem.optim.codes' e4m3 codes, jaxmem.optim.states' float8 kind). The codes against a float64
reference cast (ml_dtypes), the kind as the rest of jaxmem sees it. Its steps against fp32 Adam, its trajectory,
bytes and orbax round trip: tests/unit/test_optim_adamw_lowbit.py; its fsdp=8 step and exact resume:
tests/integration/test_optimizer_states.py."""
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxmem.config.schema import ConfigError
from jaxmem.loader import load_config
from jaxmem.optim import codes, fused_host, states
from jaxmem.optim.kind import state_kind

E4M3 = ml_dtypes.float8_e4m3fn
TOP = float(ml_dtypes.finfo(E4M3).max)
TINY = float(ml_dtypes.finfo(E4M3).smallest_subnormal)


def _reference_codes(x64: np.ndarray, block: int, signed: bool) -> np.ndarray:
    """x / its block's scale (the signed extreme; the max for v) times 448, cast to e4m3 in float64."""
    blocks = x64.reshape(x64.shape[:-1] + (-1, block))
    hi, lo = blocks.max(-1, keepdims=True), blocks.min(-1, keepdims=True)
    scale = np.where(hi >= -lo, hi, lo) if signed else hi
    z = blocks / np.where(scale == 0, 1.0, scale) * TOP
    if not signed:
        z = np.where(z > 0, np.maximum(z, TINY), z)
    return z.astype(E4M3).reshape(x64.shape)


@pytest.mark.parametrize("name", ["e4m3_signed", "e4m3_unsigned"])
def test_codes_are_the_float64_cast(name):
    """Every stored value is the float64 reference's e4m3 value, but where fp32's x / scale sits a rounding
    away from a midpoint of two e4m3 values (then the neighbour: one step of the bits)."""
    signed = codes.CODES[name].signed
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 4096)) * np.exp(rng.uniform(-12, 0, (16, 4096)))
    x = x if signed else np.square(x)
    x32 = x.astype(np.float32)
    q = codes.quantize(jnp.asarray(x32), name, 256)
    assert q.codes.dtype == E4M3 and q.codes.shape == x.shape and q.scales.shape == (16, 16)
    got = np.asarray(q.codes).view(np.uint8).astype(int)
    want = _reference_codes(x32.astype(np.float64), 256, signed).view(np.uint8).astype(int)
    assert np.mean(got != want) < 1e-4 and np.max(np.abs(got - want)) <= 1


def test_v_keeps_no_zero_and_zeros_stay_zero():
    """A positive second moment never comes back 0 (m / sqrt(v) would become m / eps), however small in its
    block; an all-zero block is zeros, and a fresh state dequantizes to zeros."""
    v = np.full((2, 512), 1e-20, np.float32)
    v[0, 0] = 1.0  # the first block's scale: 1e-20 of it is far below e4m3's smallest subnormal
    v[1] = 0.0
    back = np.asarray(codes.dequantize(codes.quantize(jnp.asarray(v), "e4m3_unsigned", 256)))
    assert np.all(back[0] > 0) and back[0, 0] == 1.0 and np.all(back[1] == 0)
    m = codes.quantize(jnp.asarray(v), "e4m3_signed", 256)
    assert np.asarray(codes.dequantize(m))[0, 1] == 0  # m may round to 0: Adam's update is then 0 too
    for name in ("e4m3_signed", "e4m3_unsigned"):
        assert np.all(np.asarray(codes.dequantize(codes.zeros((3, 700), name, 256))) == 0)


def test_the_kind_as_jaxmem_sees_it():
    cfg = load_config("configs/tiny.yaml", ["precision.moment_dtype=float8"])
    kind = state_kind(cfg)
    assert (kind.block, kind.bits, kind.checkpoint_id) == (256, 8, "adamw/float8/256")
    assert kind.moment_bytes_per_value() == (1 + 4 / 256, 1 + 4 / 256) and kind.quantized
    assert not kind.restores("adamw/int8/256") and not kind.restores("adamw/float32")
    assert state_kind(load_config("configs/tiny.yaml", ["precision.moment_dtype=float8",
                                                        "precision.moment_block=64"])).block == 64
    reason = fused_host.not_covered(cfg, jnp.bfloat16)
    assert reason.startswith("it keeps AdamW's moments in one of float32, int8, int4") and "float8" in reason
    assert not states.moment_kind("float8").tune_may_pick
    with pytest.raises(ConfigError, match="float8 is for AdamW's moments"):
        load_config("configs/tiny.yaml", ["precision.moment_dtype=float8", "optimizer.name=adafactor"])
