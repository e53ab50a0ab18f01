"""Orbax checkpoints of a run (train state + JSON metadata) and params-only `init_from` loading.

Only finalized steps count: orbax writes each step into a temporary directory and
renames it when complete, so `latest_step()` never names a half-written checkpoint.
Restores go onto the *current* program's shardings, so a run may resume on a
different mesh or parallel layout than the one that saved it. Every saved array's digest goes into the meta
(jaxmem.io.checksum) and is checked after each restore: a damaged step is a CorruptCheckpoint naming the step
and the array, and `restore_intact` can fall back to the newest intact step (checkpoint.on_corrupt=previous).
"""
from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import sys
from pathlib import Path

import jax
import orbax.checkpoint as ocp

from jaxmem.config.schema import Config, ConfigError, config_hash
from jaxmem.core import host_init
from jaxmem.optim.hyper import schedule_steps
from jaxmem.optim.kind import state_kind
from jaxmem.core.plugins import FROZEN
from jaxmem.core import checksum
from jaxmem.io import hf
from jaxmem.io.model_match import check_hf_config, check_model_json, is_hf_dir
from jaxmem.runtime.oom_text import is_oom
from jaxmem.core.precision import all_finite
from jaxmem.core.step_state import leaf_name

_META = "meta"
DIGESTS = "digests"  # meta key: leaf name -> "dtype:hex" digest of every saved array (jaxmem.io.checksum)

# Keys that may change between a save and a resume without changing the math of a
# step (mesh, bookkeeping, how the global batch is split); the rest enters the hash.
_RUN_LOCAL = ("out_dir", "parallel", "distributed", "checkpoint", "target")
_TRAIN_LOCAL = ("progress", "tensorboard", "log_every", "micro_batch", "grad_accum", "global_batch",
                "memory_profile_at")
RUN_META_KEYS = ("step", "data_position", "batch_rows")  # what `jaxmem train` reads back to resume


def _reason(e: BaseException) -> str:
    """One line on why orbax failed: its innermost cause, without tensorstore's JSON spec."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = str(e).strip().splitlines()
    text = (lines[0] if lines else type(e).__name__).split(" [tensorstore_spec")[0]
    text = re.sub(r' in OCDBT database at local file "[^"]*"', "", text)  # the step directory, named already
    text = re.sub(r'Failed writing: "[^"]*": ', "", text)  # a temporary file of the step directory
    return text if len(text) <= 300 else text[:297] + "..."


def _shapes(tree) -> dict[str, tuple]:
    """'opt.layers.0.mu.wq' -> shape for every leaf of a state, abstract state or orbax tree metadata."""
    return {leaf_name(path): tuple(getattr(leaf, "shape", ()))
            for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _saved_shapes(item_dir: Path) -> dict[str, tuple]:
    """Leaf shapes of the orbax item at `item_dir`, from its metadata files only (no array is read)."""
    tree = ocp.StandardCheckpointHandler().metadata(item_dir)  # raises on a missing or unreadable _METADATA
    if tree is None:
        raise FileNotFoundError(f"no tree metadata in {item_dir}")
    return _shapes(tree)


def _without_digests(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k != DIGESTS}


class CorruptCheckpoint(ConfigError):
    """A step directory whose files are missing, cut short or changed since the save (one line naming it)."""

    def __init__(self, message: str, step: int, reason: str):
        super().__init__(message)
        self.step, self.reason = step, reason


class WholeStateItem:
    """One program's train state as orbax's standard item "state" (jaxmem.core.plugins.StateItem)."""

    name = "state"

    def save_args(self, state: dict):
        return ocp.args.StandardSave(state)

    def restore_args(self, abstract_state: dict):
        return ocp.args.StandardRestore(abstract_state)

    def saved_shapes(self, item_dir: Path) -> dict[str, tuple]:
        return _saved_shapes(item_dir)

    def state_of(self, restored: dict) -> dict:
        return restored

    def parts(self, state: dict) -> list:
        return [state]


WHOLE_STATE = WholeStateItem()


def _mismatch(saved: dict[str, tuple], wanted: dict[str, tuple]) -> str | None:
    """What differs between a saved tree and the one a restore needs; None if they fit (dtypes may differ)."""
    for key, shape in sorted(wanted.items(), key=lambda kv: not kv[0].startswith("params.")):  # params first
        if key not in saved:
            return f"it has no {key}"
        if saved[key] != shape:
            return f"{key} has shape {list(saved[key])}, this run's has {list(shape)}"
    extra = sorted(set(saved) - set(wanted))
    return f"it has {extra[0]}, which this run's state lacks" if extra else None


def math_hash(cfg: Config) -> str:
    """Hash of the settings that determine the losses (mesh and bookkeeping left out).

    train.steps enters only through the LR schedule's decay length, so extending a run
    whose optimizer.decay_steps is fixed keeps the hash (`jaxmem train` fixes it on resume
    to the decay length saved in the checkpoint's meta).
    """
    defaults = Config()
    blank = {k: getattr(defaults, k) for k in _RUN_LOCAL}
    train = dataclasses.replace(cfg.train, steps=0, **{k: getattr(defaults.train, k) for k in _TRAIN_LOCAL})
    optimizer = dataclasses.replace(cfg.optimizer, decay_steps=cfg.optimizer.decay_steps or cfg.train.steps)
    return config_hash(dataclasses.replace(cfg, train=train, optimizer=optimizer, **blank))


def run_meta(cfg: Config, step: int, data_position: int, batch_rows: int) -> dict:
    """The JSON item saved beside the state: where the data and the RNG stand, and the LR schedule.

    `decay_steps` and `warmup_steps` are the schedule as resolved (optimizer.decay_steps=0
    means train.steps), so a resume that raises train.steps can keep it.
    """
    warmup, decay = schedule_steps(cfg)
    meta = {"step": int(step), "data_position": int(data_position), "batch_rows": int(batch_rows),
            "seed": cfg.train.seed, "data_kind": cfg.data.kind, "config_hash": math_hash(cfg),
            "decay_steps": int(decay), "warmup_steps": int(warmup), OPTIMIZER_STATE: state_kind_id(cfg)}
    return meta


def _quiet_failed_saves(record: logging.LogRecord) -> bool:
    """Drops orbax's own error logs (with their tracebacks) while a run's checkpoints are open: a save that
    failed is named in one line by `Checkpoints.failure` / SaveFailed, and the run stops there."""
    return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


def _closed_loop_error(exc_type, exc, tb) -> bool:
    """tensorstore's callbacks into an event loop orbax already closed after a failed write (reported through
    sys.unraisablehook from its own threads): noise once the failure is named."""
    if not (exc_type is RuntimeError and str(exc) == "Event loop is closed"):
        return False
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "asyncio" in tb.tb_frame.f_code.co_filename


class _QuietOrbax:
    """Keeps orbax's tracebacks of a failed save or restore off stderr: its error logs while checkpoints are open
    (counted: one `Checkpoints` may live inside another's life), and from the first `Checkpoints` on, the
    closed-loop reports its tensorstore callbacks may still make after the restore or save that failed."""

    depth = 0
    saved_hook = None

    @classmethod
    def enter(cls) -> None:
        if cls.depth == 0:
            logging.getLogger("absl").addFilter(_quiet_failed_saves)
        if sys.unraisablehook != _QuietOrbax.hook:
            cls.saved_hook = sys.unraisablehook
            sys.unraisablehook = _QuietOrbax.hook
        cls.depth += 1

    @classmethod
    def leave(cls) -> None:
        cls.depth = max(cls.depth - 1, 0)
        if cls.depth == 0:
            logging.getLogger("absl").removeFilter(_quiet_failed_saves)

    @staticmethod
    def hook(unraisable) -> None:
        if not _closed_loop_error(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback):
            (_QuietOrbax.saved_hook or sys.__unraisablehook__)(unraisable)


class SaveFailed(RuntimeError):
    """A checkpoint could not be written; the message is one line: what failed, the last good step, the free
    space. orbax may still hold threads waiting on the failed save (its barriers time out after minutes): a
    command line that reports it exits without waiting for them (`jaxmem.train.signals.exit_now`)."""


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _free_bytes(directory: Path) -> int:
    """Free bytes on the filesystem that holds (or will hold) `directory`."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def _written_bytes(state: dict) -> int:
    """Bytes of `state` this process writes into a checkpoint, uncompressed (an upper bound of the files)."""
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(state) if isinstance(leaf, jax.Array)
               for shard in leaf.addressable_shards if shard.replica_id == 0)
OPTIMIZER_STATE = "optimizer_state"  # meta key: how the optimizer state is stored (state_kind_id)


def state_kind_id(cfg: Config) -> str:
    """'adamw/int8/2048', 'adamw/float32', 'adafactor/float32': the optimizer state's form in a checkpoint."""
    return state_kind(cfg).checkpoint_id


def check_state_kind(cfg: Config, meta: dict | None, where) -> None:
    """A checkpoint whose optimizer state another form saved (another optimizer, quantized moments or another
    block) is refused in one line; float32 and bfloat16 moments convert on restore, as any dtype does."""
    saved = (meta or {}).get(OPTIMIZER_STATE)
    kind = state_kind(cfg)
    if saved is None or kind.restores(saved):
        return
    mine = kind.checkpoint_id
    raise ConfigError(f"{where}: its optimizer state is {saved}, this run's {mine} (optimizer.name, "
                      "precision.moment_dtype, precision.moment_block); resume with the settings that saved it, or "
                      "use a new out_dir")


class Checkpoints:
    """Saves and restores a run's train state under `<out_dir>/checkpoints/`."""

    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():  # else the first save fails, after training
            raise ConfigError(f"{self.directory}: is a file, not a checkpoint directory; move it or use a new out_dir")
        # create=False: the directory appears with the first save, so a run that fails on bad input leaves none.
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=False)
        # no item names: each save and restore names its items (a program's state item, the meta), and orbax
        # finds their handlers from the args' types
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._failed: str | None = None  # why a started save failed (see `failure`)
        self._open = True
        _QuietOrbax.enter()

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

    def room_for(self, state: dict, step: int) -> None:
        """SaveFailed, before anything is written, when the checkpoint folder's disk cannot hold one more
        checkpoint of `state` (counted uncompressed); the older checkpoints are left as they are."""
        need, free = _written_bytes({k: v for k, v in state.items() if k != FROZEN}), _free_bytes(self.directory)
        if need > free:
            self._settle()
            raise SaveFailed(f"not enough disk for the checkpoint of step {step} in {self.directory}: it needs up to "
                             f"{_size(need)}, {_size(free)} is free; {self._last_good()}")

    def failure(self) -> str | None:
        """Why a save started earlier failed (an I/O error, a full disk), in one line; None while none did."""
        if self._failed is not None:
            return self._failed
        try:
            self._manager.check_for_errors()
        except Exception as e:  # orbax re-raises what its writer thread hit
            return self._failure_line(e)
        return None

    def _failure_line(self, e: BaseException) -> str:
        """The one line on a failed save (kept: every later question gets the same answer)."""
        if self._failed is None:  # orbax's threads of the failed save are not waited for: see SaveFailed
            self._failed = (f"writing a checkpoint in {self.directory} failed ({_reason(e)}); {self._last_good()}; "
                            f"{_size(_free_bytes(self.directory))} free")
        return self._failed

    def _settle(self) -> None:
        """Waits for the saves in flight (a failure is kept for `failure`), so the steps on disk are final."""
        if self._failed is not None:
            return
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # a failed save: `failure` names it
            self._failure_line(e)

    def _last_good(self) -> str:
        steps = self.all_steps()
        return f"the last good checkpoint is step {steps[-1]}" if steps else "no checkpoint was completed"

    def save(self, step: int, state: dict, meta: dict, item=WHOLE_STATE) -> None:
        """Starts a save of `state` as `item` (the program's state_item); with async saving, returns once the
        arrays are copied off the devices.

        The copy is taken before returning, so the state may be donated to the next step
        right away.
        """
        state = {k: v for k, v in state.items() if k != FROZEN}  # a frozen part is rebuilt, never saved
        meta = dict(meta, **{DIGESTS: checksum.digests(state)})  # process 0 writes the meta: its parts' digests
        args = {item.name: item.save_args(state), _META: ocp.args.JsonSave(meta)}
        if self._failed is not None:
            raise SaveFailed(self._failed)
        try:  # orbax first waits for the previous save, and re-raises what its writer hit
            self._manager.save(step, args=ocp.args.Composite(**args), force=True)
        except Exception as e:
            if is_oom(e):
                raise
            raise SaveFailed(self._failure_line(e)) from None

    def restore(self, abstract_state: dict, step: int | None = None,
                required_meta: tuple[str, ...] = (), item=WHOLE_STATE) -> tuple[dict, dict]:
        """(state, meta) of `step` (default: the latest), read from `item` (the program's state_item) and laid
        out as `abstract_state`'s shardings; a state comes back without its frozen part, a LoRA base
        (`restore_run` rebuilds it).

        `required_meta` names integer fields the meta item must hold (a resume needs RUN_META_KEYS).
        A step directory that is damaged, or holds another model's state, is a one-line ConfigError
        that says what to do; shapes are compared before any array is read.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no finalized checkpoint under {self.directory}")
        meta = self._restore_meta(step, required_meta)
        saved_digests = meta.pop(DIGESTS, None)  # the caller's meta is the one it saved
        abstract_state = {k: v for k, v in abstract_state.items() if k != FROZEN}
        try:
            saved = item.saved_shapes(self.directory / str(step) / item.name)
        except Exception as e:  # orbax raises whatever its reader hit: FileNotFoundError, JSONDecodeError, ...
            raise self._damaged(step, f"{item.name} metadata: {_reason(e)}") from None
        problem = _mismatch(saved, _shapes(abstract_state))
        if problem:
            raise ConfigError(f"{self.directory / str(step)}: holds a train state that does not fit this run "
                              f"({problem}); resume with the config that saved it, or use a new out_dir")
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(
                **{item.name: item.restore_args(abstract_state)}))[item.name]
            state = item.state_of(restored)
        except Exception as e:  # tensorstore raises bare Exception / ValueError for missing or cut-short files
            if is_oom(e):
                raise
            raise self._damaged(step, _reason(e)) from None
        changed = checksum.first_mismatch(saved_digests, state)
        if changed:
            raise self._damaged(step, f"array {changed} of step {step} does not match the checksum saved with it")
        # We never save non-finite weights (a checkpoint saved without digests is checked for those only).
        if not all(bool(jax.jit(all_finite)(p)) for p in item.parts(state)):
            raise self._damaged(step, "it holds inf/NaN values")
        return state, meta

    def meta(self, step: int | None = None) -> dict | None:
        """The meta item of `step` (default: the latest), without the state; None if no step is saved.

        A damaged meta item is the same one-line ConfigError `restore` raises.
        """
        step = self.latest_step() if step is None else step
        return None if step is None else _without_digests(self._restore_meta(step, ()))

    def newest_meta(self, on_corrupt: str = "stop") -> dict | None:
        """The latest step's meta; with on_corrupt="previous", that of the newest step whose meta reads."""
        for step in reversed(self.all_steps()):
            try:
                return _without_digests(self._restore_meta(step, ()))
            except CorruptCheckpoint:
                if on_corrupt != "previous":
                    raise
        return None

    def _restore_meta(self, step: int, required: tuple[str, ...]) -> dict:
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
        except Exception as e:  # missing item, garbage or cut-short JSON
            raise self._damaged(step, f"{_META}: {_reason(e)}") from None
        if not isinstance(meta, dict) or not all(isinstance(meta.get(k), int) for k in required):
            raise self._damaged(step, f"{_META} lacks {', '.join(required)}")
        return meta

    def _damaged(self, step: int, reason: str) -> CorruptCheckpoint:
        earlier = [s for s in self.all_steps() if s < step]
        then = (f"resume from step {earlier[-1]} (or set checkpoint.on_corrupt=previous)" if earlier
                else "start from scratch")
        return CorruptCheckpoint(f"{self.directory / str(step)}: checkpoint is incomplete or damaged ({reason}); "
                                 f"delete this directory to {then}", step, reason)

    def set_aside(self, step: int) -> Path:
        """Renames a damaged step's directory to `<step>.damaged` (kept for a look, never read again: orbax
        takes only numeric names for steps), so a new save of that step can be written. Process 0 renames."""
        source = self.directory / str(step)
        target = self.directory / f"{step}.damaged"
        n = 1
        while target.exists():
            n += 1
            target = self.directory / f"{step}.damaged.{n}"
        if jax.process_index() == 0:
            source.rename(target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"jaxmem set aside step {step}")
        self._manager.reload()
        return target

    def wait(self) -> None:
        """Blocks until every started save is finalized; SaveFailed (one line) if one failed."""
        if self._failed is not None:
            raise SaveFailed(self._failed)
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise SaveFailed(self._failure_line(e)) from None

    def close(self) -> None:
        """Finishes the saves already started; after a failed one (reported by `failure`) it leaves orbax's
        threads be (they may wait minutes on the failed save's barriers) and closes nothing more."""
        if not self._open:
            return
        self._open = False
        try:
            if self._failed is None:
                try:
                    self._manager.wait_until_finished()
                except Exception as e:
                    self._failure_line(e)
            if self._failed is None:
                self._manager.close()
        finally:
            _QuietOrbax.leave()


# ---------------------------------------------------------------- init_from


def restore_params(path: str | Path, abstract_params: dict) -> dict:
    """Params-only checkpoint `<path>/params` restored onto `abstract_params`' shapes, dtypes, shardings."""
    params_dir = Path(path).absolute() / "params"
    if not params_dir.is_dir():
        raise ConfigError(f"checkpoint.init_from: {params_dir} not found (expected a `jaxmem import-hf` output dir)")
    with ocp.StandardCheckpointer() as ckptr:
        try:
            saved = _saved_shapes(params_dir)
        except Exception as e:  # orbax raises whatever its reader hit: FileNotFoundError, JSONDecodeError, ...
            raise _damaged_params(params_dir, _reason(e)) from None
        problem = _mismatch(saved, _shapes(abstract_params))
        if problem:
            raise ConfigError(f"checkpoint.init_from: {params_dir} does not match the model's params ({problem})")
        try:
            params = ckptr.restore(params_dir, abstract_params)
        except Exception as e:  # tensorstore raises bare Exception / ValueError for missing or cut-short files
            if is_oom(e):
                raise
            raise _damaged_params(params_dir, _reason(e)) from None
    if not bool(jax.jit(all_finite)(params)):
        raise _damaged_params(params_dir, "it holds inf/NaN values")
    return params


def restore_run(prog, ckpts: "Checkpoints", step: int | None = None, required_meta: tuple[str, ...] = ()):
    """(state, meta) of a run's checkpoint; a frozen part (a LoRA base) is rebuilt from where the config says
    (checkpoint.init_from, or the seed) after the plug-in checked the meta (the base the adapters were trained on).
    The program restores onto its own layout (jaxmem.core.plugins.RunProgram.restore_run), re-cutting a
    checkpoint another layout saved."""
    step = ckpts.latest_step() if step is None else step
    return prog.restore_run(ckpts, step, required_meta)


def restore_intact(prog, ckpts: "Checkpoints", on_corrupt: str, note, required_meta: tuple[str, ...] = ()):
    """(state, meta, step) of the latest checkpoint. With on_corrupt="previous" a damaged step gives way to the
    next older one; once an intact step restores, the damaged ones are set aside (`Checkpoints.set_aside`)
    and `note` says which step the run resumes from. With "stop", or when no step is intact (then nothing is
    moved), the latest step's CorruptCheckpoint is raised."""
    damaged: list[CorruptCheckpoint] = []
    for step in reversed(ckpts.all_steps()):
        try:
            state, meta = restore_run(prog, ckpts, step, required_meta)
        except CorruptCheckpoint as e:
            if on_corrupt != "previous":
                raise
            damaged.append(e)
            continue
        for e in damaged:
            note(f"checkpoint step {e.step} is damaged ({e.reason}); set aside as {ckpts.set_aside(e.step)}")
        if damaged:
            note(f"resuming from step {step}, the newest intact checkpoint (checkpoint.on_corrupt=previous)")
        return state, meta, step
    if len(damaged) > 1:  # every step tried: the advice to set on_corrupt=previous or resume earlier is spent
        newest = damaged[0]
        raise CorruptCheckpoint(f"{ckpts.directory}: no checkpoint is intact (checkpoint.on_corrupt=previous tried "
                                f"steps {', '.join(str(e.step) for e in damaged)}; step {newest.step}: {newest.reason}"
                                "); delete the step directories to start from scratch, or use a new out_dir",
                                newest.step, newest.reason)
    if damaged:
        raise damaged[0]
    raise FileNotFoundError(f"no finalized checkpoint under {ckpts.directory}")


def restore_whole(prog, ckpts: "Checkpoints", step: int | None, required_meta: tuple[str, ...] = ()):
    """TrainProgram.restore_run: (state, meta) of one program; a checkpoint of another layout (one of the
    program's `foreign_layouts`, which its features bring: a pipeline's) is read on the host and placed on the
    program's shardings."""
    meta = ckpts.meta(step) if step is not None else None
    check_state_kind(prog.cfg, meta, ckpts.directory / str(step))
    other = next((layout for layout in prog.foreign_layouts if meta and layout.saved(meta)), None)
    if other is not None:
        return jax.device_put(other.read_whole(prog.cfg, ckpts, step, meta, required_meta),
                              prog.state_shardings), meta
    state, meta = ckpts.restore(prog.abstract_state, step, required_meta)
    prog.plugin.check_meta(prog.cfg, meta, ckpts.directory)
    frozen = prog.plugin.frozen_part(prog, model_params_from)
    return (state if frozen is None else dict(state, **{FROZEN: frozen})), meta


def _damaged_params(params_dir: Path, reason: str) -> ConfigError:
    return ConfigError(f"checkpoint.init_from: {params_dir} is incomplete or damaged ({reason}); "
                       "run `jaxmem import-hf` again")


def model_params_from(prog, path: str | Path) -> dict:
    """The model's params from a Hugging Face directory or a params-only checkpoint (`jaxmem import-hf`),
    checked against the config's model and laid out with the program's shardings."""
    return read_model_params(prog.cfg, path, prog.abstract_model_params())


def init_from(prog, path: str | Path) -> dict:
    """A fresh train state (step 0, new optimizer state) whose params come from `path`, on the program's
    layout (jaxmem.core.plugins.RunProgram.init_from).

    With master weights on, the master copy is the fp32 cast of the loaded params.
    """
    return prog.init_from(path)


def init_whole(prog, path: str | Path) -> dict:
    """TrainProgram.init_from: the loaded params on one program's shardings (or a plug-in's own loading)."""
    streamed = prog.plugin.streamed_state(prog, path)  # LoRA: an HF directory or import-hf output
    if streamed is not None:
        return streamed
    if host_init.applies(prog):
        return host_init.fresh_state(prog, read_model_params(prog.cfg, path, host_init.loading_targets(prog)))
    # a full fine-tune's state reuses the loaded params' buffers; LoRA's stored base cannot
    return prog.assembled_state_fn()(model_params_from(prog, path))


def read_model_params(cfg: Config, path: str | Path, targets: dict) -> dict:
    """The model's params from `path` onto `targets`: a Hugging Face directory is read slice by slice from its
    safetensors (each device reads its own), a `jaxmem import-hf` output restored by orbax."""
    if is_hf_dir(path):
        check_hf_config(path, cfg)
        params = hf.read_params(path, targets)
        if not bool(jax.jit(all_finite)(params)):
            raise ConfigError(f"checkpoint.init_from: {path} holds inf/NaN values")
        return params
    check_model_json(path, cfg)
    return restore_params(path, targets)
