"""The default AdamW step (gradients at their exact dtype, the exact global-norm clip first, then the state
updated in place one layer at a time) against an independent reference: fp32 gradients of the params cast
to fp32, summed over micro-batches, then optax's clip_by_global_norm + AdamW over the whole model at once
(the step as it was before the lean update). Each of 3 steps, from the same state: same loss, master and
moments, on 1 device and fsdp=8, with and without micro-batch accumulation, optimizer state on the host."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxmem.core import embed_grad, grad_dtype
from jaxmem.loader import load_config
from jaxmem.core.program import loss_sum_fn, split_batch
from jaxmem.registry import build_program

TINY = "configs/tiny.yaml"
# clip_norm 0.5 is below the tiny model's gradient norms (~1.4): every step is clipped
BASE = ["optimizer.warmup_steps=0", "optimizer.lr=1e-2", "optimizer.clip_norm=0.5", "remat.preset=full",
        "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16", "precision.master_weights=true",
        "train.seq_len=32"]
# fsdp8: a vocabulary of 4096 (ids stay below 256) so that the embedding's rows are smaller than its shard
LAYOUTS = {"one_device": ["parallel.fsdp=1", "train.micro_batch=4"],
           "fsdp8": ["parallel.fsdp=8", "train.micro_batch=1", "train.seq_len=16", "model.vocab_size=4096"]}
ACCUM = {"accum1": [], "accum2": ["train.grad_accum=2"]}
HOST = {"host_update_device": ["offload.optimizer=host", "offload.optimizer_update=device"],
        "host_update_host": ["offload.optimizer=host", "offload.optimizer_update=host"]}


def _devices(layout):
    return jax.devices()[:1] if layout == "one_device" else jax.devices()


def _batches(prog, n=3):
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, size=prog.batch_shape).astype(np.int32) for _ in range(n)]


def _run(overrides, devices):
    """The program, its batches and the train state before and after each of 3 steps (host copies), with the
    losses; the last state stays live (its memory kinds are checked)."""
    prog = build_program(load_config(TINY, BASE + overrides), devices=devices)
    state, step = prog.init_state(), prog.jit_step()
    states, losses, batches = [jax.device_get(state)], [], _batches(prog)
    for tokens in batches:
        state, metrics = step(state, prog.shard_batch(tokens))
        states.append(jax.device_get(state))
        losses.append(float(metrics["loss"]))
    return prog, batches, states, losses, state


def _adam_fields(opt_state):
    """(mu, nu, count) of the layer-wise state as whole-model trees (the layers' counts are all the same)."""
    rest, layers = (_adam(opt_state[k])[0] for k in ("rest", "layers"))
    assert np.all(np.asarray(layers.count) == np.asarray(rest.count))
    return dict(rest.mu, layers=layers.mu), dict(rest.nu, layers=layers.nu), rest.count


def _adam(state):
    return [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)]


def _reference_step(prog):
    """One step of the plain whole-model update, written here from optax: the loss differentiated with
    respect to the params cast to fp32 (every gradient fp32), summed over micro-batches in fp32, then
    optax.chain(clip_by_global_norm, AdamW) over the whole model at once. Returns
    fn(master, mu, nu, count, tokens) -> (new master, new mu, new nu, loss)."""
    loss = loss_sum_fn(prog)
    opt = optax.chain(optax.clip_by_global_norm(prog.cfg.optimizer.clip_norm), prog.optimizer)

    def with_state(fresh, mu, nu, count):
        def put(s):
            if isinstance(s, optax.ScaleByAdamState):
                return s._replace(mu=mu, nu=nu, count=count)
            return s._replace(count=count) if isinstance(s, optax.ScaleByScheduleState) else s
        kinds = (optax.ScaleByAdamState, optax.ScaleByScheduleState)
        return jax.tree.map(put, fresh, is_leaf=lambda x: isinstance(x, kinds))

    @jax.jit
    def step(master, mu, nu, count, tokens):
        inputs, labels, _, _ = split_batch({"tokens": tokens})
        n_valid = jnp.float32(labels.size)
        params32 = jax.tree.map(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32), master)

        def micro(carry, batch):
            g, l = jax.grad(lambda p: (lambda s: (s / n_valid, s))(loss(p, *batch)[0]), has_aux=True)(params32)
            return (jax.tree.map(jnp.add, carry[0], g), carry[1] + l), None

        zeros = (jax.tree.map(jnp.zeros_like, params32), jnp.float32(0.0))
        (grads, total), _ = jax.lax.scan(micro, zeros, (inputs, labels))
        updates, new = opt.update(grads, with_state(opt.init(master), mu, nu, count), master)
        (adam,) = _adam(new)
        return optax.apply_updates(master, updates), adam.mu, adam.nu, total / n_valid

    return step


def _close(a, b, rel):
    """Each leaf equal up to `rel` times its largest magnitude (fp32 sums taken in another order)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        assert np.max(np.abs(x - y)) <= rel * np.max(np.abs(y)), (np.max(np.abs(x - y)), np.max(np.abs(y)))


def _check(prog, batches, states, losses):
    """Each step from jaxmem's state before it: the reference step from the same state gives the same loss,
    master and moments (up to the summation order of the global norm: a few fp32 ulps; a whole-model
    comparison over 3 steps would compound them through the bf16 rounding of the params)."""
    reference = _reference_step(prog)
    for k, tokens in enumerate(batches):
        before, after = states[k], states[k + 1]
        mu, nu, count = _adam_fields(before["opt"])
        ref_master, ref_mu, ref_nu, ref_loss = reference(before["master"], mu, nu, count,
                                                         prog.shard_batch(tokens)["tokens"])
        assert losses[k] == pytest.approx(float(ref_loss), rel=1e-6)
        new_mu, new_nu, new_count = _adam_fields(after["opt"])
        assert int(new_count) == k + 1
        _close(after["master"], ref_master, 1e-6)
        _close(new_mu, ref_mu, 1e-5)
        _close(new_nu, ref_nu, 1e-5)
        rounded = jax.tree.map(lambda w: w.astype(jnp.bfloat16), after["master"])
        assert _max_diff(after["params"], rounded) == 0  # the stored weight rounded (optim._BARRIER_BEFORE_CAST)


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


# Where the embedding's gradient is kept as its rows (jaxmem.core.embed_grad.applies: fewer bytes than the table's
# gradient shard): 128 tokens per step on one device, not 256; on fsdp=8 both
ROWS = {("one_device", "accum1"): True, ("one_device", "accum2"): False, ("fsdp8", "accum1"): True,
        ("fsdp8", "accum2"): True}


@pytest.mark.slow
@pytest.mark.parametrize("accum", list(ACCUM))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_the_whole_model_update(layout, accum):
    prog, *run = _run(LAYOUTS[layout] + ACCUM[accum], _devices(layout))[:4]
    assert embed_grad.applies(prog.cfg, prog.layout, prog.precision) == ROWS[layout, accum]
    _check(prog, *run)


@pytest.mark.slow
@pytest.mark.parametrize("host", list(HOST))
def test_optimizer_state_on_host_matches(host):
    *run, state = _run(LAYOUTS["fsdp8"] + HOST[host], _devices("fsdp8"))
    _check(*run)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves((state["opt"], state["master"])) if x.ndim}
    assert kinds == {"pinned_host"}


def test_gradients_kept_at_their_exact_dtype():
    """Matmul weights and the LM head are used only through a cast to bf16: their fp32 gradient is a widened
    bf16 value, found in the jaxpr; the norm scales and the embedding table (a scatter-add in fp32) are not."""
    cfg = load_config(TINY, BASE + LAYOUTS["one_device"])
    prog = build_program(cfg, devices=_devices("one_device"))
    loss = loss_sum_fn(prog)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), prog.abstract_state["params"])
    tokens = jax.ShapeDtypeStruct((4, cfg.train.seq_len), jnp.int32)
    exact = grad_dtype.exact_dtypes(lambda p, x, y: jax.grad(lambda p: loss(p, x, y)[0])(p), params, tokens,
                                    tokens)
    layers = exact["layers"]
    for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):  # read through the layer scan
        assert layers[name] == jnp.bfloat16, name
    assert exact["lm_head"] == jnp.bfloat16
    assert layers["attn_norm"] is None and layers["mlp_norm"] is None
    assert exact["embed"] is None and exact["final_norm"] is None
    # the planner's rule (jaxmem.plan.bill reads no jaxpr) says the same for every leaf
    flat = jax.tree_util.tree_flatten_with_path(exact, is_leaf=lambda x: x is None)[0]
    for path, found in flat:
        name = str(path[-1].key)
        assert grad_dtype.planned_dtype(name, cfg, prog.precision) == (found or jnp.float32), name
    # with fp32 compute nothing is narrower than fp32
    cfg32 = load_config(TINY, BASE + LAYOUTS["one_device"] + ["precision.compute_dtype=float32"])
    loss32 = loss_sum_fn(build_program(cfg32, devices=_devices("one_device")))
    exact32 = grad_dtype.exact_dtypes(lambda p, x, y: jax.grad(lambda p: loss32(p, x, y)[0])(p), params, tokens,
                                      tokens)
    assert all(d is None for d in jax.tree.leaves(exact32, is_leaf=lambda x: x is None))
