"""The analytic per-device memory bill: model states, saved activations by checkpoint name, working set,
logits, temporaries and host-resident bytes, computed from the config alone (no compile)."""
from __future__ import annotations

import dataclasses
import math
import types

import jax
import numpy as np
from flax import nnx

from jaxmem import remat, sharding
from jaxmem.config import Config
from jaxmem.model import abstract_model
from jaxmem.model.names import CheckpointName as CN
from jaxmem.precision import Precision

# Device-bill categories in display order; `host` holds the host-resident counterparts.
CATEGORIES = ("params", "grads", "master", "opt_m", "opt_v", "inputs", "activations", "working_set", "logits",
              "temporaries")
HOST_CATEGORIES = ("params", "master", "opt_m", "opt_v", "activations", "temporaries")

_BTD = (CN.LAYER_INPUT, CN.ATTN_NORM, CN.ATTN_OUT, CN.MLP_NORM, CN.MLP_OUT)
_BTF = (CN.MLP_GATE, CN.MLP_UP, CN.MLP_ACT)
_DOT_NAMES = (CN.QUERY_PROJ, CN.KEY_PROJ, CN.VALUE_PROJ, CN.ATTN_CONTEXT, CN.ATTN_OUT, CN.MLP_GATE, CN.MLP_UP,
              CN.MLP_OUT)
# Per score element XLA keeps live while differentiating plain attention: fp32 scores, their fp32 gradient,
# the compute-dtype probs and the boolean mask (read off `jaxmem explain` of deviceless H100 compiles).
_SCORE_WORKING_COPIES_F32 = 2
_MASK_BYTES = 1
# Per score element saved for the backward when plain attention is not rematerialized: the fp32 scores,
# the fp32 softmax output and the compute-dtype probs fed to the second matmul. Fitted to deviceless
# H100 compiles of configs/ladder/{1-fp32,2-bf16}.yaml (Llama-3-8B, seq 4096, no remat): 11.2 and 9.5
# bytes per element measured from the compiled totals, 12 and 10 here.
_SAVED_SCORE_BYTES_F32 = 8


@dataclasses.dataclass
class Bill:
    """Per-device bytes; every figure is an estimate (analytic)."""

    device: dict[str, int]
    host: dict[str, int]
    activations_by_name: dict[str, int]  # saved on device, all layers
    offloaded_by_name: dict[str, int]  # saved on host, all layers
    mesh: dict[str, int]
    notes: list[str]

    @property
    def device_total(self) -> int:
        """The estimated peak: the loss phase (logits, LM head) and one layer's backward (working set,
        gathered layer weights and gradients = temporaries) are never live together; the larger counts."""
        d = self.device
        phases = ("working_set", "logits", "temporaries")
        layer_phase = d["working_set"] + d["temporaries"]
        return sum(v for k, v in d.items() if k not in phases) + max(layer_phase, d["logits"])

    @property
    def host_total(self) -> int:
        """Host state plus the larger of the offloaded activations and the host optimizer update's buffers:
        the activations are dead before the update runs, so XLA reuses their host space."""
        h = self.host
        return sum(v for k, v in h.items() if k not in ("activations", "temporaries")) + max(h["activations"],
                                                                                          h["temporaries"])

    def to_json(self) -> dict:
        return {**{k: int(v) for k, v in self.device.items()}, "device_total": int(self.device_total),
                "host": {k: int(v) for k, v in self.host.items()}, "host_total": int(self.host_total),
                "activations_by_name": dict(self.activations_by_name),
                "offloaded_by_name": dict(self.offloaded_by_name), "notes": list(self.notes),
                "label": "estimated (analytic)"}


def _itemsize(dtype) -> int:
    return np.dtype(dtype).itemsize


def _fake_mesh(sizes: dict[str, int]):
    # logical_to_spec only reads mesh.shape, so planning needs no devices
    return types.SimpleNamespace(shape=dict(sizes))


def _shard_elems(shape, spec, sizes) -> int:
    div = 1
    for axes in spec:
        for a in (axes if isinstance(axes, tuple) else (axes,)):
            if a is not None:
                div *= sizes[str(a)]
    return math.prod(shape) // div


def _state_bytes(leaves_specs, sizes, dtype_of) -> int:
    return sum(_shard_elems(x.shape, s, sizes) * _itemsize(dtype_of(x)) for x, s in leaves_specs)


def state_leaves(cfg: Config, sizes: dict[str, int]):
    """(abstract param leaves, sharded specs, replicated specs) for the mesh sizes."""
    prec = Precision.from_config(cfg.precision)
    state = nnx.split(abstract_model(cfg.model, param_dtype=prec.param))[1]
    rules = sharding.RULE_TABLES[cfg.parallel.rules]
    mesh = _fake_mesh(sizes)
    leaves = jax.tree.leaves(nnx.to_pure_dict(state))
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    sharded = jax.tree.leaves(sharding.param_specs(state, rules, mesh), is_leaf=is_spec)
    replicated = jax.tree.leaves(sharding.param_specs(state, sharding.without_data_axes(rules), mesh),
                                 is_leaf=is_spec)
    return leaves, sharded, replicated


def name_shapes(cfg: Config, sizes: dict[str, int]) -> dict[str, int]:
    """Elements per device of each checkpointed tensor, for one layer."""
    m, t = cfg.model, cfg.train
    tp = sizes["tp"]
    bt = t.micro_batch * t.seq_len
    heads = m.n_heads // tp if m.n_heads % tp == 0 else m.n_heads
    kv = m.n_kv_heads // tp if m.n_kv_heads % tp == 0 else m.n_kv_heads
    ff = m.d_ff // tp if m.d_ff % tp == 0 else m.d_ff
    out = {n.value: bt * m.d_model for n in _BTD}
    out.update({n.value: bt * ff for n in _BTF})
    out.update({CN.QUERY_PROJ.value: bt * heads * m.head_dim, CN.ATTN_CONTEXT.value: bt * heads * m.head_dim,
                CN.KEY_PROJ.value: bt * kv * m.head_dim, CN.VALUE_PROJ.value: bt * kv * m.head_dim})
    return out


def score_elems(cfg: Config, sizes: dict[str, int]) -> int:
    """Elements per device of one layer's attention score matrix [B, N, T, S] (plain XLA attention)."""
    m, t = cfg.model, cfg.train
    heads = m.n_heads // sizes["tp"] if m.n_heads % sizes["tp"] == 0 else m.n_heads
    return t.micro_batch * heads * t.seq_len * t.seq_len


def resolved_kernels(cfg: Config, gpu: bool) -> dict[str, str]:
    """The attention and loss implementations `auto` picks on this platform (as jaxmem.kernels does)."""
    attention, loss = cfg.kernels.attention, cfg.kernels.loss
    if attention == "auto":
        attention = "pallas" if gpu else "xla"
    if loss == "auto":
        loss = "pallas" if gpu else "chunked"
    return {"attention": attention, "loss": loss}


def attention_materializes_scores(cfg: Config, gpu: bool = True) -> bool:
    return resolved_kernels(cfg, gpu)["attention"] == "xla"


def saved_choices(cfg: Config, gpu: bool = True) -> dict[str, str]:
    """Per checkpoint name: where its per-layer value lives across the backward (device/host/remat)."""
    choices = remat.name_choices(cfg.remat)
    if not remat.uses_checkpoint(cfg.remat):
        return {n: "device" for n in choices}
    out = {n: {"device": "device", "offload": "host"}.get(c, "remat") for n, c in choices.items()}
    if out[CN.LAYER_INPUT.value] == "remat":
        out[CN.LAYER_INPUT.value] = "device"  # the checkpointed layer's input is always a residual
    base = remat.PRESETS[cfg.remat.preset].get("base")
    if base == "dots_saveable":
        for n in _DOT_NAMES:
            if n == CN.ATTN_CONTEXT and not attention_materializes_scores(cfg, gpu):
                continue  # a fused attention kernel's output is no dot
            out[n.value] = "device" if out[n.value] == "remat" else out[n.value]
    elif base == "dots_with_no_batch_dims_saveable":
        for n in _DOT_NAMES:
            if n != CN.ATTN_CONTEXT:
                out[n.value] = "device" if out[n.value] == "remat" else out[n.value]
    # The layer's output is never read by its own backward (the next layer keeps its input): whatever the
    # policy says (device or offload), autodiff drops it (deviceless compiles agree).
    out[CN.MLP_OUT.value] = "remat"
    return out


def no_checkpoint_residuals(per_name: dict[str, int], cd: int) -> dict[str, int]:
    """Per-layer bytes autodiff keeps without any checkpoint: more than the tagged names (fp32 norm inputs,
    silu internals, roped q/k), as `jaxmem explain` of llama3-8b (remat none) on 8 x h100-80g showed."""
    btd, btf = per_name[CN.LAYER_INPUT.value], per_name[CN.MLP_GATE.value]
    q, kv = per_name[CN.QUERY_PROJ.value], per_name[CN.KEY_PROJ.value]
    return {
        "mlp_gate": btf * cd, "mlp_up": btf * cd, "mlp_act": btf * cd, "mlp_silu_internals": 3 * btf * cd,
        "norm_inputs_fp32": 4 * btd * 4, "attn_norm": btd * cd, "mlp_norm": btd * cd,
        "query_proj_roped": q * cd, "attn_context": q * cd,
        "key_proj": kv * cd, "key_proj_roped": kv * cd, "value_proj": kv * cd,
    }


def scores_saved(cfg: Config, gpu: bool = True) -> bool:
    """Whether plain-XLA attention keeps each layer's scores across the backward."""
    if not attention_materializes_scores(cfg, gpu):
        return False
    if not remat.uses_checkpoint(cfg.remat):
        return True
    return remat.PRESETS[cfg.remat.preset].get("base") == "dots_saveable"


def logits_bytes(cfg: Config, sizes: dict[str, int], gpu: bool = True) -> int:
    """Live loss-side bytes per device: fp32 logits and their gradient, per kernel choice."""
    k, m = cfg.kernels, cfg.model
    loss = resolved_kernels(cfg, gpu)["loss"]
    tokens = cfg.train.micro_batch * cfg.train.seq_len
    vocab = m.vocab_size // sizes["tp"] if m.vocab_size % sizes["tp"] == 0 else m.vocab_size
    if loss == "naive":
        return 2 * tokens * vocab * 4
    if loss == "chunked":
        return 2 * min(tokens, k.loss_block_t) * vocab * 4 + tokens * 4
    # fused kernels: one [block_t, block_v] fp32 tile and its gradient, plus per-token lse
    return 2 * min(tokens, k.fused_loss_block_t) * min(vocab, k.fused_loss_block_v) * 4 + 2 * tokens * 4


def compute_bill(cfg: Config, n_devices: int, gpu: bool = True) -> Bill:
    """Analytic per-device bill for `cfg` sharded over `n_devices` (GPUs, or CPU devices: `auto` kernels
    resolve differently)."""
    sizes = sharding.mesh_shape(cfg.parallel, n_devices)
    prec = Precision.from_config(cfg.precision)
    m, t = cfg.model, cfg.train
    leaves, sharded, replicated = state_leaves(cfg, sizes)
    zero = cfg.parallel.zero_stage
    param_specs = sharded if zero == 3 else replicated
    grad_specs = sharded if zero >= 2 else replicated
    params = _state_bytes(zip(leaves, param_specs), sizes, lambda x: prec.param)
    grads = _state_bytes(zip(leaves, grad_specs), sizes, lambda x: prec.grad_reduce)  # cast to fp32 on use
    master = _state_bytes(zip(leaves, sharded), sizes, lambda x: np.float32) if prec.master else 0
    moment = _state_bytes(zip(leaves, sharded), sizes, lambda x: prec.moment)
    data_ways = sizes["dp"] * sizes["fsdp"]
    from jaxmem.program import batch_layout

    accum, rows = batch_layout(cfg, data_ways)
    inputs = accum * (rows // data_ways) * (t.seq_len + 1) * 4 + _counter_bytes(cfg)
    cd = _itemsize(prec.compute)

    per_name = name_shapes(cfg, sizes)
    where = saved_choices(cfg, gpu)
    if remat.uses_checkpoint(cfg.remat):
        saved_dev = {n: per_name[n] * cd * m.n_layers for n, w in where.items() if w == "device"}
    else:
        saved_dev = {k: v * m.n_layers for k, v in no_checkpoint_residuals(per_name, cd).items()}
    saved_host = {n: per_name[n] * cd * m.n_layers for n, w in where.items() if w == "host"}
    notes = []
    scores = score_elems(cfg, sizes)
    if scores_saved(cfg, gpu):
        saved_dev["attention_scores"] = scores * (_SAVED_SCORE_BYTES_F32 + cd) * m.n_layers
        notes.append("plain XLA attention keeps the S x S scores of every layer (use a flash kernel or a "
                     "policy that does not save dots)")
    activations = sum(saved_dev.values())

    # One layer's backward: its forward intermediates come back (recomputed or saved) plus their gradients.
    layer_all = sum(per_name.values()) * cd
    working = 2 * layer_all
    if attention_materializes_scores(cfg, gpu):
        working += scores * (4 * _SCORE_WORKING_COPIES_F32 + cd + _MASK_BYTES)
    logits = logits_bytes(cfg, sizes, gpu)

    # FSDP all-gathers a full layer in the compute dtype (the next one is prefetched) and its gradient
    # arrives full before the reduce-scatter; the loss phase does the same for the LM head.
    gather_ways = sizes["fsdp"] * sizes["dp"] if zero == 3 else 1
    layer_full = _layer_param_elems(cfg) // sizes["tp"]
    head_full = m.d_model * m.vocab_size // sizes["tp"]
    temporaries = 2 * layer_full * _itemsize(prec.grad_reduce) + (2 * layer_full * cd if gather_ways > 1 else 0)
    logits += head_full * 4 + (head_full * cd if gather_ways > 1 else 0)
    if accum > 1:
        temporaries += _state_bytes(zip(leaves, grad_specs), sizes, lambda x: np.float32)  # fp32 accumulator
    device = dict(params=params, grads=grads, master=master, opt_m=moment, opt_v=moment, inputs=inputs,
                  activations=activations, working_set=working, logits=logits, temporaries=temporaries)
    host = {k: 0 for k in HOST_CATEGORIES}
    if cfg.offload.optimizer == "host":
        for k in ("master", "opt_m", "opt_v"):
            host[k], device[k] = device[k], 0
        if cfg.offload.optimizer_update == "host":  # fp32 grads, new m and v, new params (compiles agree)
            fp32_grads = _state_bytes(zip(leaves, sharded), sizes, lambda x: np.float32)
            host["temporaries"] = fp32_grads + host["opt_m"] + host["opt_v"] + params
    if cfg.offload.params == "host":
        host["params"], device["params"] = device["params"], 0
    host["activations"] = sum(saved_host.values())
    return Bill(device, host, saved_dev, saved_host, sizes, notes)


def _layer_param_elems(cfg: Config) -> int:
    m = cfg.model
    d, n, k, h, f = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff
    return 2 * d + d * n * h + 2 * d * k * h + n * h * d + 3 * d * f


def _counter_bytes(cfg: Config) -> int:
    """Replicated bookkeeping in the train state (step, optimizer counters, loss scale), read off the
    program's own state layout so it follows jaxmem.program."""
    from jaxmem.optim import make_optimizer
    from jaxmem.program import assemble_state

    prec = Precision.from_config(cfg.precision)
    params = nnx.to_pure_dict(nnx.split(abstract_model(cfg.model, param_dtype=prec.param))[1])
    state = jax.eval_shape(lambda p: assemble_state(cfg, prec, make_optimizer(cfg), p), params)
    small = [x for k, x in state.items() if k not in ("params", "master", "opt")]
    small += [x for x in jax.tree.leaves(state["opt"]) if not np.issubdtype(x.dtype, np.floating)]
    return sum(math.prod(x.shape) * _itemsize(x.dtype) for x in jax.tree.leaves(small))
