"""Program-level hooks (jaxmem.core.plugins.RunProgram): the checkpointer (jaxmem.core.checkpoint) and the train
loop (jaxmem.cli.train) reach a program's state layout, restore, init_from and compile only through them, so
a program defined here, unknown to jaxmem, is saved, restored, resumed and compiled its own way."""
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import SingleDeviceSharding

from jaxmem.train import loop as train
from jaxmem.config import ConfigError, to_dict
from jaxmem.loader import load_config
from jaxmem.core.checkpoint import RUN_META_KEYS, Checkpoints, WHOLE_STATE, init_from, restore_run, run_meta

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


class _Halves:
    """A state {"halves": [a, b]} stored flat as {"h0": a, "h1": b} in the standard "state" item."""

    name = WHOLE_STATE.name

    def save_args(self, state):
        return ocp.args.StandardSave({f"h{i}": h for i, h in enumerate(state["halves"])})

    def restore_args(self, abstract_state):
        return ocp.args.StandardRestore({f"h{i}": h for i, h in enumerate(abstract_state["halves"])})

    def saved_shapes(self, item_dir):
        return {"halves." + key[1:]: shape for key, shape in WHOLE_STATE.saved_shapes(item_dir).items()}

    def state_of(self, restored):
        return {"halves": [restored[f"h{i}"] for i in range(len(restored))]}

    def parts(self, state):
        return list(state["halves"])


class _FakeProgram:
    """Two halves of one weight on one device; records which hooks the loop and the checkpointer called."""

    state_item = _Halves()
    grad_accum, rows = 1, 16

    def __init__(self, cfg):
        self.cfg, self.calls = cfg, []
        where = SingleDeviceSharding(jax.devices()[0])
        half = {"params": {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32, sharding=where)}}
        self.abstract_state = {"halves": [half, half]}

    def checkpoint_meta(self):
        return {"halves": 2}

    def abstract_model_params(self):  # what the init_from line counts
        return {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32)}

    def restore_run(self, ckpts, step, required_meta=()):
        self.calls.append(("restore_run", step))
        return ckpts.restore(self.abstract_state, step, required_meta, item=self.state_item)

    def init_from(self, path):
        self.calls.append(("init_from", str(path)))
        return _state(7.0)

    def compile_step(self):
        self.calls.append(("compile_step",))
        return "compiled"


def _state(start):
    w = np.arange(start, start + 6, dtype=np.float32).reshape(2, 3)
    return {"halves": [{"params": {"w": jnp.asarray(w)}}, {"params": {"w": jnp.asarray(-w)}}]}


def test_a_program_unknown_to_jaxmem_is_saved_restored_and_resumed_through_its_hooks(tmp_path):
    cfg = load_config(TINY, [f"out_dir={tmp_path}", "train.seq_len=32", "train.micro_batch=2"])
    prog = _FakeProgram(cfg)
    state = _state(1.0)
    ckpts = Checkpoints(tmp_path / "checkpoints", async_save=False)
    ckpts.save(3, state, dict(run_meta(cfg, 3, 48, 16), **prog.checkpoint_meta()), prog.state_item)
    on_disk = WHOLE_STATE.saved_shapes(tmp_path / "checkpoints" / "3" / "state")
    assert on_disk == {"h0.params.w": (2, 3), "h1.params.w": (2, 3)}  # the program's item layout, not its tree

    restored, meta = restore_run(prog, ckpts)
    assert prog.calls == [("restore_run", 3)] and meta["halves"] == 2 and meta["step"] == 3
    np.testing.assert_array_equal(restored["halves"][0]["params"]["w"], np.arange(1.0, 7.0).reshape(2, 3))
    np.testing.assert_array_equal(restored["halves"][1]["params"]["w"], -np.arange(1.0, 7.0).reshape(2, 3))

    resumed, start, position, latest = train.initial_state(prog, ckpts)  # the train loop's resume
    assert (start, position, latest) == (3, 48, 3) and prog.calls[-1] == ("restore_run", 3)
    np.testing.assert_array_equal(resumed["halves"][1]["params"]["w"], restored["halves"][1]["params"]["w"])
    assert set(RUN_META_KEYS) <= set(meta)

    other = _FakeProgram(cfg)  # a tree the saved item does not fit: the shapes check of the item's names
    other.abstract_state = {"halves": [other.abstract_state["halves"][0]]}
    with pytest.raises(ConfigError, match=r"\(it has halves\.1\.params\.w, which this run's state lacks\)"):
        restore_run(other, ckpts)
    ckpts.close()


def test_the_train_loop_compiles_initializes_and_checks_a_program_through_its_hooks(tmp_path):
    imported = tmp_path / "imported"  # what the config names must look like a model (an import-hf output)
    (imported / "params").mkdir(parents=True)
    (imported / "model.json").write_text(json.dumps(to_dict(load_config(TINY))["model"]))
    cfg = load_config(TINY, [f"out_dir={tmp_path}", f"checkpoint.init_from={imported}"])
    prog = _FakeProgram(cfg)
    assert train.compile_train_step(prog) == "compiled"
    state, start, position, latest = train.initial_state(prog, None)
    assert (start, position, latest) == (0, None, None)
    np.testing.assert_array_equal(state["halves"][0]["params"]["w"], np.arange(7.0, 13.0).reshape(2, 3))
    assert init_from(prog, "/elsewhere")["halves"][1]["params"]["w"][0, 0] == -7.0
    assert prog.calls == [("compile_step",), ("init_from", str(imported)), ("init_from", "/elsewhere")]
    assert train._state_finite(prog, state)  # every part the item names is checked
    state["halves"][1]["params"]["w"] = state["halves"][1]["params"]["w"].at[1, 2].set(jnp.nan)
    assert not train._state_finite(prog, state)
