"""Orbax checkpoints of a run (train state + JSON metadata) and params-only `init_from` loading.

Only finalized steps count: orbax writes each step into a temporary directory and
renames it when complete, so `latest_step()` never names a half-written checkpoint.
Restores go onto the *current* program's shardings, so a run may resume on a
different mesh or parallel layout than the one that saved it.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxmem.config import Config, ConfigError, config_hash

_STATE, _META = "state", "meta"

# Keys that may change between a save and a resume without changing the math of a
# step (mesh, bookkeeping, how the global batch is split); the rest enters the hash.
_RUN_LOCAL = ("out_dir", "parallel", "distributed", "checkpoint", "target")
_TRAIN_LOCAL = ("progress", "tensorboard", "log_every", "micro_batch", "grad_accum", "global_batch")

# ModelConfig fields that must agree between an init_from checkpoint and the run.
_MODEL_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
               "qkv_bias", "tie_embeddings", "rope_theta", "rope_scaling", "norm_eps")


def math_hash(cfg: Config) -> str:
    """Hash of the settings that determine the losses (mesh and bookkeeping left out).

    train.steps enters only through the LR schedule's decay length, so extending a run
    whose optimizer.decay_steps is fixed keeps the hash.
    """
    defaults = Config()
    blank = {k: getattr(defaults, k) for k in _RUN_LOCAL}
    train = dataclasses.replace(cfg.train, steps=0, **{k: getattr(defaults.train, k) for k in _TRAIN_LOCAL})
    optimizer = dataclasses.replace(cfg.optimizer, decay_steps=cfg.optimizer.decay_steps or cfg.train.steps)
    return config_hash(dataclasses.replace(cfg, train=train, optimizer=optimizer, **blank))


def run_meta(cfg: Config, step: int, data_position: int, batch_rows: int) -> dict:
    """The JSON item saved beside the state: where the data and the RNG stand."""
    return {"step": int(step), "data_position": int(data_position), "batch_rows": int(batch_rows),
            "seed": cfg.train.seed, "data_kind": cfg.data.kind, "config_hash": math_hash(cfg)}


class Checkpoints:
    """Saves and restores a run's train state under `<out_dir>/checkpoints/`."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=(_STATE, _META))

    @classmethod
    def for_run(cls, cfg: Config) -> "Checkpoints":
        return cls(Path(cfg.out_dir) / "checkpoints", keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)

    def latest_step(self) -> int | None:
        """Latest finalized step (incomplete, temporary ones are ignored)."""
        self._manager.reload()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Starts a save; with async saving, returns once the arrays are copied off the devices.

        The copy is taken before returning, so the state may be donated to the next step
        right away.
        """
        self._manager.save(step, args=ocp.args.Composite(
            **{_STATE: ocp.args.StandardSave(state), _META: ocp.args.JsonSave(meta)}), force=True)

    def restore(self, abstract_state: dict, step: int | None = None) -> tuple[dict, dict]:
        """(state, meta) of `step` (default: the latest), laid out as `abstract_state`'s shardings."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no finalized checkpoint under {self.directory}")
        out = self._manager.restore(step, args=ocp.args.Composite(
            **{_STATE: ocp.args.StandardRestore(abstract_state), _META: ocp.args.JsonRestore()}))
        return out[_STATE], out[_META]

    def wait(self) -> None:
        """Blocks until every started save is finalized."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


# ---------------------------------------------------------------- init_from


def check_model_json(path: str | Path, cfg: Config) -> None:
    """Raises a one-line ConfigError if `<path>/model.json` describes another model."""
    model_json = Path(path) / "model.json"
    if not model_json.is_file():
        raise ConfigError(f"checkpoint.init_from: {model_json} not found (expected a `jaxmem import-hf` output dir)")
    saved = json.loads(model_json.read_text())
    mine = dataclasses.asdict(cfg.model)
    for key in _MODEL_KEYS:
        if key in saved and saved[key] != mine[key]:
            raise ConfigError(f"checkpoint.init_from: {path} holds a model with {key}={saved[key]!r} but the run "
                              f"has model.{key}={mine[key]!r}; make the model config match")


def restore_params(path: str | Path, abstract_params: dict) -> dict:
    """Params-only checkpoint `<path>/params` restored onto `abstract_params`' shapes, dtypes, shardings."""
    params_dir = Path(path).absolute() / "params"
    if not params_dir.is_dir():
        raise ConfigError(f"checkpoint.init_from: {params_dir} not found (expected a `jaxmem import-hf` output dir)")
    with ocp.StandardCheckpointer() as ckptr:
        try:
            return ckptr.restore(params_dir, abstract_params)
        except (ValueError, KeyError) as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"checkpoint.init_from: {params_dir} does not match the model's params ({first})") from None


def init_from(prog, path: str | Path) -> dict:
    """A fresh train state (step 0, new optimizer state) whose params come from `path`.

    With master weights on, the master copy is the fp32 cast of the loaded params.
    """
    check_model_json(path, prog.cfg)
    params = restore_params(path, prog.abstract_state["params"])
    assemble = jax.jit(prog.state_from_params, out_shardings=prog.state_shardings, donate_argnums=(0,))
    return assemble(params)
