"""Attention sinks (gpt-oss): one learned logit per query head joins each row's softmax and attends to no
value. The reference against transformers' formulation, the Pallas kernel (interpret mode) against the
reference with the sinks' gradient, sharded and sequence-parallel runs against one device, and the dispatch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from jaxmem.config import KernelConfig
from jaxmem.kernels import select_attention
from jaxmem.kernels.attention.config import AttentionBlocks
from jaxmem.kernels.attention.cudnn import cudnn_attention
from jaxmem.kernels.attention.pallas import flash_attention
from jaxmem.kernels.attention.reference import attention_reference
from kernel_checks import TOLERANCES, assert_close, attention_inputs

SMALL = AttentionBlocks(block_q=16, block_k=16)
B, T, N, K, H = 2, 40, 4, 2, 16  # T = 40: the kernel pads to 48, so padded rows are exercised
SINKS = {"large": (5.0, -1.0, 0.5, 2.5), "negative": (-30.0,) * N}


def _inputs(b=B, t=T, n=N, kv=K, h=H, dtype=jnp.float32, segments=False, seed=0):
    return attention_inputs(b, t, n, kv, h, dtype, segments, seed)


def _keep(b, t, causal=True, window=None, seg=None):
    """[B, T, S] booleans: which keys each query sees."""
    pos = jnp.arange(t)
    keep = jnp.ones((t, t), bool)
    if causal:
        keep = pos[:, None] >= pos[None, :]
    if window is not None:
        keep = keep & (pos[:, None] - pos[None, :] < window)
    keep = jnp.broadcast_to(keep, (b, t, t))
    if seg is not None:
        keep = keep & (seg[:, :, None] == seg[:, None, :])
    return keep


def _transformers_attention(q, k, v, sinks, keep):
    """transformers' gpt-oss eager_attention_forward in jnp: kv heads repeated to the q heads, an additive
    mask, a sink column concatenated to the scores, softmax, the sink column dropped. sinks None: no column."""
    n, h = q.shape[2], q.shape[3]
    query = q.transpose(0, 2, 1, 3)  # [B, N, T, H]
    key, value = (jnp.repeat(x.transpose(0, 2, 1, 3), n // k.shape[2], axis=1) for x in (k, v))
    weights = query @ key.swapaxes(2, 3) * h**-0.5
    weights = weights + jnp.where(keep, 0.0, jnp.finfo(jnp.float32).min)[:, None]
    if sinks is not None:
        column = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, n, 1, 1), weights.shape[:3] + (1,))
        weights = jnp.concatenate([weights, column], axis=-1)
    weights = weights - jnp.max(weights, axis=-1, keepdims=True)
    probs = jax.nn.softmax(weights, axis=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return (probs @ value).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("case", ["causal", "window", "segments", "bidirectional"])
def test_reference_matches_transformers(case):
    """Values and gradients (q, k, v and the sinks) of attention_reference(..., sinks=) against transformers'
    formulation, GQA with group 2."""
    q, k, v, ct, seg = _inputs(segments=case == "segments")
    causal, window = case != "bidirectional", 8 if case == "window" else None
    sinks = jnp.array(SINKS["large"])
    keep = _keep(B, T, causal, window, seg)
    ours = lambda q, k, v, s: attention_reference(q, k, v, causal=causal, window=window, segment_ids_bt=seg,
                                                  sinks=s)
    theirs = lambda q, k, v, s: _transformers_attention(q, k, v, s, keep)
    out, grads = jax.value_and_grad(lambda *a: jnp.sum(ours(*a) * ct), (0, 1, 2, 3))(q, k, v, sinks)
    ref, ref_grads = jax.value_and_grad(lambda *a: jnp.sum(theirs(*a) * ct), (0, 1, 2, 3))(q, k, v, sinks)
    assert_close(ours(q, k, v, sinks), theirs(q, k, v, sinks), 2e-5, "output")
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        assert_close(g, r, 2e-5, name)
    assert float(jnp.min(jnp.abs(grads[3]))) > 0  # every head's sink gets a gradient


def test_reference_without_sinks_is_unchanged():
    q, k, v, _, seg = _inputs(segments=True)
    plain = attention_reference(q, k, v, segment_ids_bt=seg)
    assert np.array_equal(attention_reference(q, k, v, segment_ids_bt=seg, sinks=None), plain)
    assert_close(plain, _transformers_attention(q, k, v, None, _keep(B, T, seg=seg)), 2e-5, "no sinks")
    # a sink far below every score takes no probability: the output without sinks
    assert_close(attention_reference(q, k, v, segment_ids_bt=seg, sinks=jnp.full((N,), -1e4)), plain, 2e-5,
                 "negligible sinks")


def test_reference_fully_masked_rows_attend_to_the_sink():
    """A row that sees no key (window 0 masks everything) puts all its probability on the sink: output 0,
    gradients finite."""
    q, k, v, ct, _ = _inputs()
    sinks = jnp.array(SINKS["large"])
    f = lambda q, k, v, s: jnp.sum(attention_reference(q, k, v, window=0, sinks=s) * ct)
    out = attention_reference(q, k, v, window=0, sinks=sinks)
    assert np.all(np.asarray(out) == 0.0)
    grads = jax.grad(f, (0, 1, 2, 3))(q, k, v, sinks)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


@pytest.mark.parametrize("dtype, sinks, window, segments", [
    (jnp.float32, "large", None, False),
    (jnp.float32, "negative", 8, False),
    (jnp.bfloat16, "large", 8, True),
    (jnp.bfloat16, "negative", None, True),
])
def test_pallas_matches_reference(dtype, sinks, window, segments):
    """Forward and VJP (q, k, v, sinks) of the interpreted kernel against the fp32 reference; the sinks in the
    inputs' dtype, their gradient coming back in it."""
    q, k, v, ct, seg = _inputs(dtype=dtype, segments=segments)
    s = jnp.array(SINKS[sinks], dtype)

    def fwd_bwd(attend, q, k, v, s):
        out, vjp = jax.vjp(attend, q, k, v, s)
        return out, vjp(ct.astype(out.dtype))

    kernel = lambda q, k, v, s: flash_attention(q, k, v, seg, blocks=SMALL, window=window, interpret=True, sinks=s)
    ref = lambda q, k, v, s: attention_reference(q, k, v, segment_ids_bt=seg, window=window, sinks=s)
    out, grads = jax.jit(lambda *a: fwd_bwd(kernel, *a))(q, k, v, s)
    f32 = lambda x: x.astype(jnp.float32)
    ref_out, ref_grads = fwd_bwd(ref, f32(q), f32(k), f32(v), f32(s))
    rtol, gtol = TOLERANCES[dtype]
    assert out.dtype == dtype
    assert_close(out, ref_out, rtol * 5, "output")
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        assert g.dtype == dtype, name
        assert_close(g, r, gtol, name)


def test_pallas_rejects_sinks_of_the_wrong_shape():
    q, k, v, _, _ = _inputs()
    with pytest.raises(ValueError, match=r"sinks shape \(2,\) must be \(4,\)"):
        flash_attention(q, k, v, interpret=True, sinks=jnp.zeros((2,)))


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def _value_and_grads(attend, q, k, v, s, ct):
    """attention and the gradients of <attention, ct> w.r.t. q and the sinks, jitted."""
    loss = lambda q, s: jnp.sum(attend(q, k, v, s) * ct)
    return jax.jit(lambda q, s: (attend(q, k, v, s), jax.grad(loss, (0, 1))(q, s)))(q, s)


def test_sharded_pallas_matches_one_device():
    """Batch over fsdp, heads over tp (8 q heads and 4 kv heads: 2 and 1 per device); the sinks split with
    the q heads and their gradient summed over the batch shards."""
    q, k, v, ct, seg = _inputs(n=8, kv=4, segments=True, seed=1)
    s = jnp.linspace(-3.0, 5.0, 8)
    one = lambda q, k, v, s: flash_attention(q, k, v, seg, blocks=SMALL, interpret=True, sinks=s)
    mesh = _mesh((2, 4), ("fsdp", "tp"))
    sharded = lambda q, k, v, s: flash_attention(q, k, v, seg, blocks=SMALL, interpret=True, sinks=s, mesh=mesh)
    out, (dq, ds) = _value_and_grads(sharded, q, k, v, s, ct)
    ref, (ref_dq, ref_ds) = _value_and_grads(one, q, k, v, s, ct)
    assert_close(out, ref, 1e-6, "output")
    assert_close(dq, ref_dq, 1e-6, "dq")
    assert_close(ds, ref_ds, 1e-6, "dsinks")


def test_sequence_parallel_pallas_with_sinks():
    """select_attention over fsdp=2, sp=2, tp=2: the sinks go in as a keyword array, the heads split over
    tp x sp after the all-to-all (2 kv heads repeated to 4) and the sinks follow them."""
    q, k, v, ct, _ = _inputs(n=8, kv=2, seed=2)
    s = jnp.linspace(-2.0, 4.0, 8)
    mesh = _mesh((2, 2, 2), ("fsdp", "sp", "tp"))
    fn = select_attention(KernelConfig(attention="pallas", attn_block_q=16, attn_block_k=16), "cpu", mesh)
    out, (dq, ds) = _value_and_grads(lambda q, k, v, s: fn(q, k, v, None, sinks=s), q, k, v, s, ct)
    ref, (ref_dq, ref_ds) = _value_and_grads(lambda q, k, v, s: attention_reference(q, k, v, sinks=s), q, k, v, s,
                                             ct)
    assert_close(out, ref, 1e-5, "output")
    assert_close(dq, ref_dq, 2e-5, "dq")
    assert_close(ds, ref_ds, 2e-5, "dsinks")


def test_xla_dispatch_passes_sinks_through():
    q, k, v, _, seg = _inputs(segments=True)
    s = jnp.array(SINKS["large"])
    fn = select_attention(KernelConfig(attention="xla"), "cpu")
    assert np.array_equal(fn(q, k, v, seg, sinks=s), attention_reference(q, k, v, segment_ids_bt=seg, sinks=s))


def test_explicit_cudnn_refuses_sinks_before_any_work(monkeypatch):
    """kernels.attention='cudnn' has no sinks: the call raises ValueError before jax's cuDNN attention is
    reached (it is replaced by a recorder here; this machine has no GPU)."""
    calls = []
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, **kw: calls.append(1))
    q, k, v, _, _ = _inputs()
    fn = select_attention(KernelConfig(attention="cudnn"), "gpu")
    with pytest.raises(ValueError, match="cudnn_attention has no attention sinks"):
        fn(q, k, v, None, sinks=jnp.zeros((N,)))
    with pytest.raises(ValueError, match="no attention sinks"):
        cudnn_attention(q, k, v, sinks=jnp.zeros((N,)))
    assert calls == []
    cudnn_attention(q, k, v, sinks=None)  # None is no sinks: on to cuDNN
    assert calls == [1]


def test_auto_on_gpu_sends_sinks_to_pallas(monkeypatch):
    """auto picks cuDNN on a GPU with the cuDNN library; a call with sinks goes to the Pallas kernel (traced
    here, not run)."""
    from jaxmem import kernels

    calls = []
    monkeypatch.setattr(kernels, "cudnn_attention", lambda q, k, v, seg, **kw: calls.append(kw) or q)
    monkeypatch.setattr(kernels, "cudnn_present", lambda: True)
    fn = select_attention(KernelConfig(), "gpu")
    q, kv = jnp.zeros((1, 32, 2, 16), jnp.bfloat16), jnp.zeros((1, 32, 1, 16), jnp.bfloat16)  # what cuDNN takes
    assert fn(q, kv, kv, None) is q and calls == [{}]
    assert fn(q, kv, kv, None, sinks=None) is q and calls == [{}, {"sinks": None}]
    jaxpr = str(jax.make_jaxpr(lambda q, k, v, s: fn(q, k, v, None, sinks=s))(q, kv, kv, jnp.zeros((2,))))
    assert "flash_attention_fwd" in jaxpr and len(calls) == 2
