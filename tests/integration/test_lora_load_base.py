"""A LoRA base streamed from a Hugging Face directory (jaxmem.lora.load_base): bit-identical to the base built
the old way (whole params, then quantized on the device) for every base dtype, read and quantized a layer
at a time on the host, trains and resumes from it; the numpy quantizers match quant.py's bit for bit."""
import dataclasses
import json
import tracemalloc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxmem.config import ConfigError

from jaxmem.loader import load_config
from jaxmem.io.hf import load_hf, save_hf
from jaxmem.io.hf_safetensors import CheckpointReader
from jaxmem.core import quant
from jaxmem.lora import quant_host
from jaxmem.lora.frozen import make_base
from jaxmem.lora.load_base import stream_base
from jaxmem.model import init_model
from jaxmem.registry import build_program

BASE = ["train.seq_len=32", "optimizer.warmup_steps=0", "optimizer.lr=1e-2", "lora.rank=4", "lora.alpha=8"]


def _hf_dir(tmp_path, cfg, dtype="bfloat16", max_shard_bytes=200_000):
    """A Hugging Face checkpoint of a random model of cfg.model, in several safetensors shards."""
    save_hf(init_model(cfg.model, seed=7), tmp_path, dtype=dtype, max_shard_bytes=max_shard_bytes)
    return tmp_path


def _cfg(*overrides):
    return load_config("configs/tiny.yaml", BASE + list(overrides))


@pytest.mark.parametrize("shape", [(40, 7), (64, 4, 16), (600 * 64 + 5,)])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_host_quantizers_match_quant_py_bit_for_bit(shape, dtype):
    rng = np.random.RandomState(0)
    ramp = np.linspace(0.1, 3.0, int(np.prod(shape)), dtype=np.float32).reshape(shape)
    w = (rng.standard_normal(shape).astype(np.float32) * np.float32(0.05) * ramp).astype(dtype)
    w.reshape(-1)[:64] = 0  # an all-zero block
    stacked = jnp.asarray(np.stack([w, -w]))  # the device quantizers see [L, ...], the host one layer
    for double_quant in (False, True):
        device = jax.jit(quant.quantize_nf4, static_argnums=(1, 2, 3))(stacked, 64, double_quant, 1)
        host = quant_host.quantize_nf4(w, 64, double_quant)
        assert set(device) == set(host)
        for k in host:
            assert host[k].dtype == device[k].dtype, k
            np.testing.assert_array_equal(host[k], np.asarray(device[k])[0])
    device = jax.jit(quant.quantize_int8, static_argnums=1)(stacked, (1,))
    host = quant_host.quantize_int8(w, (0,))
    for k in host:
        assert host[k].dtype == device[k].dtype
        np.testing.assert_array_equal(host[k], np.asarray(device[k])[0])


@pytest.mark.slow
@pytest.mark.parametrize("base_dtype,double_quant,param_dtype,file_dtype,fsdp,extra", [
    ("bfloat16", False, "float32", "bfloat16", 8, []), ("int8", False, "float32", "bfloat16", 8, []),
    ("nf4", False, "bfloat16", "float32", 8, []), ("nf4", True, "float32", "bfloat16", 8, []),
    ("int8", False, "float32", "bfloat16", 1, ["lora.quantize_embeddings=true", "kernels.loss=chunked"])])
def test_streamed_base_equals_the_base_built_from_whole_params(tmp_path, base_dtype, double_quant, param_dtype,
                                                               file_dtype, fsdp, extra):
    cfg = _cfg(f"lora.base_dtype={base_dtype}", f"lora.double_quant={str(double_quant).lower()}",
               f"precision.param_dtype={param_dtype}", "lora.targets=q_proj,o_proj,gate_proj,down_proj",
               f"parallel.fsdp={fsdp}", f"train.micro_batch={16 // fsdp}", *extra)
    hf = _hf_dir(tmp_path, cfg, file_dtype)
    prog = build_program(cfg, devices=jax.devices()[:fsdp])
    streamed = stream_base(prog, hf)
    # the old way: the whole model loaded, then stored by frozen.make_base on the device
    params = jax.device_get(nnx.to_pure_dict(nnx.split(load_hf(hf, dtype=param_dtype))[1]))
    want = jax.jit(lambda p: make_base(prog.layout.part("lora"), cfg, p, prog.precision.param),
                   out_shardings=prog.state_shardings["base"])(params)
    if base_dtype == "nf4":  # the same base streamed from a `jaxmem import-hf` output (orbax) of that directory
        from jaxmem.cli.import_hf import main as import_hf

        import_hf([str(hf), str(tmp_path / "imported"), f"--dtype={param_dtype}"])
        imported = stream_base(prog, tmp_path / "imported")
    for base in (streamed, imported) if base_dtype == "nf4" else (streamed,):
        assert jax.tree.structure(base) == jax.tree.structure(want)
        for got, ref, sharding in zip(jax.tree.leaves(base), jax.tree.leaves(want),
                                      jax.tree.leaves(prog.state_shardings["base"])):
            assert got.dtype == ref.dtype and got.sharding == sharding
            np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


@pytest.mark.slow
def test_the_base_is_read_and_quantized_one_layer_at_a_time(tmp_path, monkeypatch):
    """Every read is one layer's tensor at most, layers come in order, each tensor is read once, nothing builds
    the whole model, and the host's peak allocation (tracemalloc) stays near one layer, far below the model."""
    import jaxmem.lora.frozen as frozen

    cfg = _cfg("lora.base_dtype=nf4", "lora.double_quant=true", "model.d_model=256", "model.d_ff=1024",
               "model.n_layers=8", "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=64",
               "parallel.fsdp=1", "train.micro_batch=2")
    hf = _hf_dir(tmp_path, cfg, "float32", max_shard_bytes=4_000_000)
    prog = build_program(cfg, devices=jax.devices()[:1])
    reads = []
    real_read = CheckpointReader.read

    def read(self, name, index):
        block = real_read(self, name, index)
        reads.append((name, block.nbytes))
        return block

    def refuse(*args, **kwargs):
        raise AssertionError("the whole model was built")

    monkeypatch.setattr(CheckpointReader, "read", read)
    monkeypatch.setattr(frozen, "store", refuse)
    monkeypatch.setattr(frozen, "make_base", refuse)
    stream_base(prog, hf)  # compiles the writers; the measured call below reuses them
    reads.clear()
    tracemalloc.start()
    base = stream_base(prog, hf)
    jax.block_until_ready(base)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    m = cfg.model
    layer_fp32 = 4 * (m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.head_dim + m.n_heads * m.head_dim * m.d_model
                      + 3 * m.d_model * m.d_ff)
    largest_tensor = 4 * max(m.d_model * m.d_ff, m.vocab_size * m.d_model)
    model_fp32 = m.n_layers * layer_fp32 + 4 * 2 * m.vocab_size * m.d_model
    names = [n for n, _ in reads]
    assert len(names) == len(set(names)) == len(CheckpointReader(hf)._file_of)  # every tensor once
    assert max(nbytes for _, nbytes in reads) <= largest_tensor
    layers = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layers == sorted(layers)  # layer by layer
    assert peak < 1.5 * layer_fp32 < model_fp32 / 5, (peak, layer_fp32, model_fp32)


def _run_cfg(tmp_path, hf, *extra):
    return _cfg("train.steps=6", "train.log_every=1", "checkpoint.every=3", f"out_dir={tmp_path}",
                "train.progress=false", "lora.base_dtype=nf4", "parallel.fsdp=-1", f"checkpoint.init_from={hf}",
                *extra)


@pytest.mark.slow
def test_a_lora_run_trains_from_a_hugging_face_directory_and_resumes_exactly(tmp_path):
    import shutil

    from jaxmem.core.checkpoint import Checkpoints
    from jaxmem.train import run

    hf = _hf_dir(tmp_path / "hf", _cfg())
    cfg = _run_cfg(tmp_path / "run", hf)
    # streamed a layer at a time, no one program builds this state for a plan to compile (the seed's does)
    assert build_program(cfg).lower_init() is None and build_program(_cfg()).lower_init() is not None
    straight = run(cfg)
    losses = [r["loss"] for r in straight["records"]]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    ckpts = Checkpoints.for_run(cfg)
    assert str(hf.absolute()) in ckpts.meta()["lora_base"]  # resume checks the base came from this directory
    ckpts.close()
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
    resumed = run(cfg)  # the base streamed again from the directory
    assert resumed["start_step"] == 3
    assert [r["loss"] for r in resumed["records"]] == losses[3:]
    other = _hf_dir(tmp_path / "hf2", _cfg())
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
    with pytest.raises(ConfigError, match="these adapters belong to the base"):
        run(_run_cfg(tmp_path / "run", other))


def test_a_hugging_face_directory_of_another_model_is_refused_by_file(tmp_path):
    hf = _hf_dir(tmp_path, _cfg())
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(dict(config, intermediate_size=config["intermediate_size"] * 2)))
    with pytest.raises(ConfigError) as e:  # at load: the config's preset names another model than the folder
        _cfg(f"checkpoint.init_from={hf}")
    assert f"{hf / 'config.json'}" in str(e.value) and "d_ff=352" in str(e.value) and "\n" not in str(e.value)
    cfg = _cfg()  # a Config built in code skips the loader: the stream checks the folder again
    prog = build_program(dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, init_from=str(hf))))
    with pytest.raises(ConfigError) as e:
        prog.frozen_base()
    assert f"{hf / 'config.json'}" in str(e.value) and "d_ff" in str(e.value) and "\n" not in str(e.value)
