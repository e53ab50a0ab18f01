"""A compile that fails inside XLA (or a library it lowers to: cuDNN, Triton) as one line: the target, XLA's own
first line, the lever most likely responsible and `--no-compile`, instead of a page of traceback.

`plan` (jaxmem.plan.compiled) and `explain`'s dump compile (jaxmem.plan.explain) both go through here."""
from __future__ import annotations

import contextlib
import re

import jax

from jaxmem.config.schema import Config, ConfigError
from jaxmem.runtime.oom_text import is_oom


class CompileFailed(ConfigError):
    """The train step of a valid config did not compile for the target; the message is one line."""


def _attention(cfg: Config, kernels: dict) -> str:
    return (f"kernels.attention (here {kernels.get('attention', cfg.kernels.attention)}, "
            f"model.head_dim={cfg.model.head_dim})")


def _pallas_kernels(cfg: Config, kernels: dict) -> str:
    chosen = [f"kernels.{op}={impl}" for op, impl in sorted(kernels.items()) if impl == "pallas"]
    return " or ".join(chosen) if chosen else _attention(cfg, kernels)


def _offload(cfg: Config, kernels: dict) -> str:
    return f"offload.* (params={cfg.offload.params}, optimizer={cfg.offload.optimizer})"


# (a pattern in XLA's message, the lever it points at: a function of the config and the program's kernels)
_CLUES = ((re.compile(r"cudnn|cuDNN|head dim", re.I), _attention),
          (re.compile(r"triton|pallas|mosaic|shared memory", re.I), _pallas_kernels),
          (re.compile(r"memory space|pinned_host|S\(5\)|host offload", re.I), _offload))


def likely_lever(cfg: Config, kernels: dict, message: str) -> str:
    """The config key most likely behind a failed compile, from XLA's message (attention by default: the
    kernel whose shapes vary most with the model)."""
    return next((lever(cfg, kernels) for pattern, lever in _CLUES if pattern.search(message)),
                _attention(cfg, kernels))


def first_line(message: str, width: int = 300) -> str:
    """XLA's message cut to its first non-empty line (an HLO dump follows it), at most `width` characters."""
    line = next((s.strip() for s in str(message).splitlines() if s.strip()), "no message")
    return line if len(line) <= width else line[: width - 3] + "..."


def compile_failed(cfg: Config, label: str, kernels: dict, message: str) -> CompileFailed:
    """`label`: the target, as "1 x h100-80g (deviceless)"."""
    hint = (" (a deviceless cuDNN compile needs the cuDNN library: pip install 'jaxmem[aot-cudnn]')"
            if "cudnn not found" in message.lower() or "cudnn is not detected" in message.lower() else "")
    return CompileFailed(f"the train step did not compile for {label}: {first_line(message)}{hint}; the lever "
                         f"most likely responsible: {likely_lever(cfg, kernels, message)}; change it, or run "
                         "with --no-compile for the analytic bill")


@contextlib.contextmanager
def one_line(cfg: Config, label: str, kernels: dict):
    """Turns an XLA compile or lowering failure inside the block into a CompileFailed line (an out-of-memory
    error passes through: the caller explains those)."""
    try:
        yield
    except (jax.errors.JaxRuntimeError, NotImplementedError, RuntimeError) as e:
        if is_oom(e) or (type(e) is RuntimeError and "cudnn" not in str(e).lower()):
            raise  # an out-of-memory error is explained by the caller; another RuntimeError is no XLA refusal
        raise compile_failed(cfg, label, kernels, str(e)) from None
