"""The analytic bill and the train program agree on every resolved decision, for every config in configs/.

The bill reads a `Layout`; the program is built from one. These tests hold the bill's layout against what
the built program really does: the kernels its traced step runs (named scopes), its state's partition specs
and per-device bytes, the remat policy jax applies, and which state entries sit in host memory.
"""
import math
import re
import typing
from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax._src import ad_checkpoint  # the checkpoint_name primitive, to ask the policy about each name

from jaxmem import kernels
from jaxmem.runtime import memory_kinds_shim
from jaxmem.core import remat
from jaxmem.runtime.aot import resolve_topology
from jaxmem.config import KernelConfig
from jaxmem.loader import load_config
from tiny_config import shipped_config
from jaxmem.core.layout import spec_leaves
from jaxmem.config.names import ALL_NAMES, CheckpointName as CN
from jaxmem.plan.bill import compute_bill
from jaxmem.core.precision import Precision
from jaxmem.registry import build_program

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if "sweeps" not in p.parts)


@pytest.fixture(scope="module", params=CONFIGS, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def program_and_bill(request):
    cfg = shipped_config(request.param)
    if cfg.target.name:
        pytest.importorskip("jax_cuda12_plugin")
    topo = resolve_topology(cfg)
    if cfg.parallel.pp > 1:  # a pipeline: its last stage's program (LM head and loss) and that stage's bill
        from jaxmem.pipeline import partition
        from jaxmem.registry import build_pipeline

        counts = partition.layer_counts(cfg) or partition.even_counts(cfg.model.n_layers, cfg.parallel.pp)
        stage = build_pipeline(cfg, list(topo.devices()), counts=counts).stages[-1]
        bill = compute_bill(stage.prog.cfg, topo.n_devices // cfg.parallel.pp, gpu=bool(topo.name),
                            layout=stage.prog.layout)
        trace = lambda: jax.make_jaxpr(stage._forward)(  # noqa: E731
            stage.abstract_params_for_grad(), stage.abstract_input(), stage.abstract_extras())
        return stage.prog, bill, trace
    prog = build_program(cfg, devices=list(topo.devices()))
    trace = lambda: jax.make_jaxpr(prog.step_fn())(prog.abstract_state, prog.abstract_batch())  # noqa: E731
    return prog, compute_bill(cfg, topo.n_devices, gpu=bool(topo.name)), trace


def _dispatch_scopes() -> set[str]:
    """Every "<op>_<implementation>" scope jaxmem.kernels can put on a call (KernelConfig's choices)."""
    hints = typing.get_type_hints(KernelConfig)
    return {f"{op}_{impl}" for op in ("attention", "loss", "norm", "grouped_matmul")
            for impl in typing.get_args(hints[op]) if impl != "auto"}


def _kernel_scopes(jaxpr, out=None) -> set[str]:
    """The kernels' dispatch scopes ("loss_chunked", ...) anywhere in a traced program's name stacks, also inside
    autodiff's wrappers ("transpose(jvp(loss_chunked))") and sub-jaxprs (a Pallas kernel's own names, such as
    grouped_matmul_fwd, are not dispatch scopes)."""
    out = set() if out is None else out
    scopes = _dispatch_scopes()
    for eqn in jaxpr.eqns:
        out.update(set(re.findall(r"\b([a-z]+(?:_[a-z]+)+)\b", str(eqn.source_info.name_stack))) & scopes)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _kernel_scopes(sub, out)
    return out


@pytest.mark.slow
def test_kernels_the_step_runs_are_the_bill_kernels(program_and_bill):
    prog, bill, trace = program_and_bill
    assert bill.layout.kernels == prog.layout.kernels
    traced = trace()
    ran = _kernel_scopes(traced.jaxpr)
    moe = prog.cfg.model.n_experts > 0  # a dense model has no grouped matmul to run
    assert ran == {f"{op}_{impl}" for op, impl in bill.layout.kernels.items() if moe or op != "grouped_matmul"}, ran


def _per_device_bytes(tree, dtype=None, host=None) -> int:
    """Bytes of `tree`'s arrays on one device; quantized moments count their uint8 codes and fp32 scales."""
    total = 0
    for x in jax.tree.leaves(tree):
        quantized_codes = x.dtype == jnp.uint8 and x.ndim  # (a QTensor's codes; its scales are floats)
        if not x.ndim or not (jnp.issubdtype(x.dtype, jnp.floating) or quantized_codes):
            continue  # counters are bookkeeping (the bill's `inputs`)
        if host is not None and memory_kinds_shim.is_host(x.sharding) != host:
            continue
        total += math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(dtype or x.dtype).itemsize
    return total


def test_state_specs_and_bytes_match(program_and_bill):
    prog, bill, _ = program_and_bill
    lay, state = bill.layout, prog.abstract_state
    spec = lambda tree: [x.sharding.spec for x in jax.tree.leaves(tree)]  # noqa: E731
    assert spec(state["params"]) == spec_leaves(lay.param_specs)
    assert spec_leaves(prog.grad_specs) == spec_leaves(lay.grad_specs)
    if "master" in state:
        assert spec(state["master"]) == spec_leaves(lay.opt_specs)
    prec = Precision.from_config(prog.cfg.precision)
    layers = sum(math.prod(x.shape) for x in jax.tree.leaves(lay.model_abstract_params["layers"]))
    assert lay.layer_param_elems * prog.cfg.model.n_layers == layers  # the presets' count is the model's
    device, host = bill.device, bill.host
    base = jax.tree.leaves(state.get("base", {}))  # LoRA's frozen base in its stored form (int8 / uint8 too)
    assert device["base"] == sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in base)
    assert device["params"] == _per_device_bytes(state["params"], host=False)
    assert host["params"] == _per_device_bytes(state["params"], host=True)
    opt_bytes = _per_device_bytes(state["opt"]) + _per_device_bytes(state.get("master", {}))
    on_host = "opt" in lay.host_state
    assert device["opt_m"] + device["opt_v"] + device["master"] == (0 if on_host else opt_bytes)
    assert host["opt_m"] + host["opt_v"] + host["master"] == (opt_bytes if on_host else 0)
    def shard_elems(params, specs):
        return [math.prod(NamedSharding(prog.mesh, s).shard_shape(x.shape))
                for x, s in zip(jax.tree.leaves(params), spec_leaves(specs), strict=True)]

    itemsize = np.dtype(prec.grad_reduce).itemsize
    if prog.cfg.optimizer.update_in_backward:  # one layer's gradient and the largest of the others at a time
        rest = {k: v for k, v in state["params"].items() if k != "layers"}
        rest_specs = {k: v for k, v in prog.grad_specs.items() if k != "layers"}
        layer = sum(shard_elems(state["params"]["layers"], prog.grad_specs["layers"])) // prog.cfg.model.n_layers
        assert device["grads"] == (layer + max(shard_elems(rest, rest_specs))) * itemsize
    elif {"opt", "params"} <= set(lay.host_state):
        # weights on the host: the layer gradients are host buffers in the compiled step whatever runs the update
        # (llama3-8b 1 x 4090 recipe, update streamed; qwen2.5-7b 1 x H100, update on the host: `jaxmem explain
        # --dump-dir`); the others stay on the device for a streamed update and are not billed there when the
        # host runs the update (tests/integration/test_plan_params_host.py)
        rest = {k: v for k, v in state["params"].items() if k != "layers"}
        rest_specs = {k: v for k, v in prog.grad_specs.items() if k != "layers"}
        host_update = prog.cfg.offload.optimizer_update == "host"
        assert device["grads"] == (0 if host_update else sum(shard_elems(rest, rest_specs)) * itemsize)
    else:  # the default step: projections at their exact dtype, the embedding as its rows (test_lean_update.py)
        from jaxmem.core import embed_grad
        from jaxmem.core.grad_dtype import planned_dtype

        paths = [str(getattr(p[-1], "key", p[-1])) for p, _ in jax.tree_util.tree_flatten_with_path(state["params"])[0]]
        sizes = [n * np.dtype(planned_dtype(name, prog.cfg, prec, sp=lay.mesh_sizes["sp"])).itemsize
                 for name, n in zip(paths, shard_elems(state["params"], prog.grad_specs), strict=True)]
        if embed_grad.applies(prog.cfg, lay, prec):
            tokens, d = embed_grad.tokens_per_step(prog.cfg, lay), prog.cfg.model.d_model  # sums + rows' grads
            sizes[paths.index("embed")] = tokens * d * 4 + tokens // lay.data_ways * d * np.dtype(prec.compute).itemsize
        assert device["grads"] == sum(sizes)


def test_host_placement_is_the_layout_host_state(program_and_bill):
    prog, bill, _ = program_and_bill
    for key, tree in prog.state_shardings.items():
        hosted = {memory_kinds_shim.is_host(s) for s in jax.tree.leaves(tree if key != "params" else tree["layers"])}
        arrays = [a for a in jax.tree.leaves(prog.abstract_state[key]) if a.ndim]
        if key in bill.layout.host_state and arrays:
            assert hosted == {True} or (key == "opt" and True in hosted), key  # scalar counters stay
        else:
            assert True not in hosted, key


def test_remat_saves_are_what_the_jax_policy_keeps(program_and_bill):
    prog, bill, _ = program_and_bill
    cfg = prog.cfg.remat
    policy = remat.policy(cfg)
    if policy is None:
        assert set(bill.layout.saved.values()) == {"device"}
        return
    aval = jax.core.ShapedArray((2, 2), np.float32)
    base_saves = remat.PRESETS[cfg.preset].get("base") is not None
    for name in ALL_NAMES:
        if name in (CN.LAYER_INPUT.value, CN.MLP_OUT.value):
            continue  # the layer input is the checkpoint's own residual; the layer output is never read back
        decision = policy(ad_checkpoint.name_p, aval, name=name)
        kind = type(decision).__name__  # True/False, or jax's Saveable / Offloadable / Recompute markers
        kept = "host" if kind == "Offloadable" else "device" if decision is True or kind == "SaveableType" \
            else "remat"
        if base_saves and kept == "remat":
            continue  # a base policy (dots) may still keep it through the matmul that produced it
        assert bill.layout.saved[name] == kept, (name, decision)


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_auto_is_decided_in_one_place(platform):
    """The drift this layout fixed: the bill once counted `auto` as the Pallas loss on GPUs."""
    chosen = kernels.resolve(KernelConfig(), platform, 8)
    gpu_attention = "cudnn" if kernels.cudnn_present() else "pallas"
    assert chosen == {"attention": gpu_attention if platform == "gpu" else "xla", "loss": "chunked", "norm": "xla",
                      "grouped_matmul": "blocked"}
    half = ["precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16"]  # what cuDNN takes
    cfg = load_config(None, ["model.preset=tiny", "parallel.fsdp=8", *half])
    assert compute_bill(cfg, 8, gpu=platform == "gpu").layout.kernels == chosen
    one = load_config(None, ["model.preset=tiny", *half])  # a one-device program: the Pallas grouped matmul on a GPU
    assert compute_bill(one, 1, gpu=platform == "gpu").layout.kernels == dict(
        chosen, grouped_matmul="pallas" if platform == "gpu" else "blocked")


def test_a_one_gpu_mixture_of_experts_step_runs_the_pallas_grouped_matmul_its_bill_counts():
    pytest.importorskip("jax_cuda12_plugin")
    cfg = load_config("configs/tiny-moe.yaml", ["target.name=h100-80g", "target.gpus_per_host=1",
                                                "parallel.fsdp=1"])
    topo = resolve_topology(cfg)
    prog = build_program(cfg, devices=list(topo.devices()))
    bill = compute_bill(cfg, 1, gpu=True)
    assert prog.layout.kernels["grouped_matmul"] == bill.layout.kernels["grouped_matmul"] == "pallas"
    ran = _kernel_scopes(jax.make_jaxpr(prog.step_fn())(prog.abstract_state, prog.abstract_batch()).jaxpr)
    assert "grouped_matmul_pallas" in ran and "grouped_matmul_blocked" not in ran, ran


PACKED = ["data.kind=jsonl", "data.path=x.jsonl", "data.tokenizer=gpt2"]  # records, packed by default


@pytest.mark.parametrize("override,fits", [([], True), (["precision.compute_dtype=float32"], False), (PACKED, False),
                                           (["model.attention_sinks=true"], False)],
                         ids=["bf16", "fp32", "packed", "sinks"])
def test_auto_attention_is_cudnn_only_where_the_programs_calls_fit_it(monkeypatch, override, fits):
    """With cuDNN present (every CUDA jax install) `auto` plans cuDNN only for fp16 / bf16 compute without
    packed documents or sinks; a call that does not fit (fp32 q, segment ids, sinks) runs the Pallas kernel
    whatever was chosen (cuDNN refuses fp32: "Q must be fp16/bf16/fp8", seen on jax 0.12 with the cuDNN
    wheel installed)."""
    monkeypatch.setattr(kernels, "cudnn_present", lambda: True)
    cfg = load_config(None, ["model.preset=tiny", "precision.param_dtype=bfloat16",
                             "precision.compute_dtype=bfloat16", *override])
    assert compute_bill(cfg, 1, gpu=True).layout.kernels["attention"] == ("cudnn" if fits else "pallas")
    attend = kernels.select_attention(KernelConfig(), "gpu")
    q = jnp.zeros((1, 64, 4, 32), jnp.float32)
    scopes = _kernel_scopes(jax.make_jaxpr(lambda q: attend(q, q, q, None))(q).jaxpr)
    assert scopes == {"attention_pallas"}
