"""The rules at load on where the train state lives (`offload.*`): lever combinations the step cannot honour.
The mechanism (pinned host memory, the update on the host or streamed through the device) is
jaxmem.core.offload's and jaxmem.optim's; the bill's terms of it are the base bill's (jaxmem.plan.bill_homes)."""
from __future__ import annotations

from jaxmem.config.schema import Config, ConfigError
from jaxmem.core import remat


def check(cfg: Config) -> None:
    """Lever combinations the step cannot honour (with the grad_accum the config gives; a derived one is
    checked by check_micro_batches)."""
    if cfg.offload.params != "host":
        return
    if not remat.uses_checkpoint(cfg.remat):
        raise ConfigError("offload.params=host: needs a remat preset other than none (layer weights are "
                          "fetched again in the backward pass instead of being kept on the device)")
    if cfg.remat.granularity != "layer":
        raise ConfigError(f"offload.params=host: needs remat.granularity=layer (got {cfg.remat.granularity!r}); "
                          "the per-layer fetch must sit inside the layer's checkpoint")
    check_micro_batches(cfg, cfg.train.grad_accum)


def check_micro_batches(cfg: Config, grad_accum: int) -> None:
    if cfg.offload.params == "host" and grad_accum > 1:
        raise ConfigError(f"offload.params=host: needs train.grad_accum=1, got {grad_accum} from train.* "
                          "(gradients land on the host, where they cannot be accumulated)")
