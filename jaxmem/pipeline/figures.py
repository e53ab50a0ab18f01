"""Per-stage memory of a pipeline, from the stages' own compiled programs.

A pipeline stage is not one program: between its passes the driver holds the residuals of the micro-batches
in flight. So a stage's device figure is built from XLA's memory analysis of each of its programs, compiled
for the target (deviceless):

    layer phase  = state + gradient accumulator + params cast for the gradient
                   + in_flight x residuals of one micro-batch
                   + the larger of (forward temporaries + its input and output activations,
                                    backward temporaries + its cotangents)
    update phase = the update program's own total (state + gradients + temporaries)
    stage peak   = the larger of the two

in_flight comes from the schedule (1F1B: pp - s on stage s; GPipe: every micro-batch).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import time

import jax
import jax.numpy as jnp

from jaxmem.runtime import memory_kinds_shim
from jaxmem.runtime.compiled_memory import captured_stderr, memory_warnings, read_fields

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class StageFigures:
    stage: int
    layers: int
    in_flight: int
    state: int  # device bytes of the stage's train state
    grads: int  # the fp32 gradient accumulator
    params_for_grad: int  # the params cast to the gradient dtype (0 when they already are)
    residuals: int  # device bytes one micro-batch's forward leaves for its backward
    residuals_host: int  # the same, offloaded to pinned host memory
    forward_peak: int  # temporaries + input and output activations of one forward
    backward_peak: int  # temporaries + cotangents of one backward
    update_total: int  # the update program's device total
    state_host: int  # host bytes of the state (optimizer offload)
    update_host: int  # the update program's host total
    compile_seconds: float
    warnings: tuple[str, ...] = ()

    @property
    def layer_phase(self) -> int:
        return (self.state + self.grads + self.params_for_grad + self.in_flight * self.residuals
                + max(self.forward_peak, self.backward_peak))

    @property
    def device_total(self) -> int:
        return max(self.layer_phase, self.update_total)

    @property
    def host_total(self) -> int:
        return max(self.update_host, self.state_host) + self.in_flight * self.residuals_host

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(layer_phase=self.layer_phase, device_total=self.device_total, host_total=self.host_total,
                   warnings=list(self.warnings))
        return out


def _with_sharding(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


@dataclasses.dataclass(frozen=True)
class _Compiled:
    fields: dict
    warnings: tuple
    out_info: object
    output_shardings: object


# One compile per program and device set in a process: the balancer's candidate splits share stages (the
# same layers at the same position), and the plan of the chosen split compiles them once more.
_compiled: dict[tuple, _Compiled] = {}


def _compile(lowered, devices) -> _Compiled:
    """The figures of `lowered` compiled for `devices`, compiled once per process (same text, same devices:
    the same executable). The devices themselves are the key, not their ids: two deviceless topologies
    (8 x h100-80g and 2 x 8 x h100-80g) number their devices alike, and the cached output shardings name the devices
    of the topology that compiled them."""
    key = (hashlib.sha256(lowered.as_text().encode()).hexdigest(), tuple(devices))
    if key not in _compiled:
        with captured_stderr() as lines:
            exe = lowered.compile()
        _compiled[key] = _Compiled(read_fields(exe), tuple(memory_warnings(lines)), exe.out_info,
                                   exe.output_shardings)
    return _compiled[key]


def compile_stage(stage, in_flight: int) -> StageFigures:
    """Compiles the stage's forward, backward and update for its mesh's devices and reads their figures."""
    prog = stage.prog
    start = time.perf_counter()
    state = prog.abstract_state
    devices = list(stage.mesh.devices.flat)
    p_grad = _with_sharding(stage.abstract_params_for_grad(), prog.state_shardings["params"])
    grads = _with_sharding(jax.eval_shape(stage._zero_grads), stage.grad_shardings)
    x, extras = stage.abstract_input(), stage.abstract_extras()
    with stage.prog.lowering():
        fwd = _compile(stage.forward.lower(p_grad, x, extras), devices)
        out_avals = fwd.out_info
        res_avals = _with_sharding(out_avals[1], fwd.output_shardings[1])
        ct = stage.abstract_cotangent(out_avals[0], fwd.output_shardings[0])
        bwd = _compile(stage.backward.lower(p_grad, res_avals, ct, grads), devices)
        norm = jax.ShapeDtypeStruct((), jnp.float32)
        upd = _compile(stage.update.lower(state, grads, norm), devices)
    f, b, u = fwd.fields, bwd.fields, upd.fields
    warnings = tuple(dict.fromkeys(fwd.warnings + bwd.warnings + upd.warnings))
    activation = 0 if stage.last else _shard_bytes([ct])
    received = 0 if stage.first else _shard_bytes([x])
    grad_bytes = _shard_bytes(grads)
    cast = prog.precision.param != prog.precision.grad_reduce
    return StageFigures(
        stage=stage.index, layers=stage.n_layers, in_flight=in_flight,
        state=_state_on_device(prog), grads=grad_bytes, params_for_grad=_shard_bytes(p_grad) if cast else 0,
        residuals=f["output"] - activation, residuals_host=f["host_output"],
        forward_peak=f["temp"] + received + activation,
        backward_peak=b["temp"] + activation + received,
        update_total=u["argument"] + u["output"] - u["alias"] + u["temp"],
        state_host=u["host_argument"],
        update_host=u["host_argument"] + u["host_output"] - u["host_alias"] + u["host_temp"],
        compile_seconds=round(time.perf_counter() - start, 2), warnings=warnings)


def _state_on_device(prog) -> int:
    """Device bytes of the train state between passes (offloaded entries live in pinned host memory)."""
    leaves = jax.tree.leaves(prog.abstract_state)
    return _shard_bytes([a for a, s in zip(leaves, jax.tree.leaves(prog.state_shardings))
                         if not memory_kinds_shim.is_host(s)])


def _shard_bytes(tree) -> int:
    """Bytes per device of abstract arrays with shardings (the largest shard)."""
    total = 0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(a.shape) if a.shape else ()
        total += math.prod(shape) * jnp.dtype(a.dtype).itemsize
    return total


def stage_figures(pipe) -> list[StageFigures]:
    return [compile_stage(stage, pipe.schedule.in_flight[stage.index]) for stage in pipe.stages]
