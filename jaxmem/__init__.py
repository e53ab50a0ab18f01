"""jaxmem: plan, measure, explain and reduce GPU memory for LLM training in JAX."""
import os as _os

# The aot extra installs the CUDA plugin on machines without a GPU; without this it
# tries (and noisily fails) to start CUDA on every import.
if "JAX_PLATFORMS" not in _os.environ and not _os.path.exists("/proc/driver/nvidia"):
    _os.environ["JAX_PLATFORMS"] = "cpu"
    # XLA's own INFO logs; the plugin's "Could not find cuda drivers" lines ignore it (jaxmem.runtime.cpu_host
    # starts jax with them silenced)
    _os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

from jaxmem.version import __version__  # noqa: E402,F401 (the package's version)


def _start_jax():
    from jaxmem.runtime.cpu_host import start_jax_quietly  # lazy: as jax itself

    start_jax_quietly()


def load_hf(path, dtype="float32", mesh=None, **kwargs):
    """Loads a local Hugging Face checkpoint; see jaxmem.io.hf.load_hf."""
    _start_jax()
    from jaxmem.io.hf import load_hf as _load  # lazy: `import jaxmem` stays cheap (no jax until it is used)

    return _load(path, dtype=dtype, mesh=mesh, **kwargs)


def save_hf(model, path, **kwargs):
    """Writes a model in Hugging Face format; see jaxmem.io.hf.save_hf."""
    _start_jax()
    from jaxmem.io.hf import save_hf as _save  # lazy: as load_hf

    return _save(model, path, **kwargs)


# The library surface for your own training script (docs/library.md), imported on first use so that
# `import jaxmem` stays cheap.
_API = ("Checkpoints", "TrainProgram", "batches", "build_program", "load_config", "loss_fn", "optimizer",
        "place_params", "place_tokens", "run_meta", "train_state", "train_step", "generate", "generator")


def __getattr__(name):
    if name in _API:
        _start_jax()
        from jaxmem import api  # lazy: the library surface loads jax, flax and optax on first use

        return getattr(api, name)
    raise AttributeError(f"module 'jaxmem' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_API))
