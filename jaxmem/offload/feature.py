"""Host offload (`offload.*`) as a feature: its rules. The mechanism, placing state in pinned host memory
and running the update there or streamed through the device, is the core's (jaxmem.core.offload)."""
from __future__ import annotations

from jaxmem.config.schema import Config, ConfigError
from jaxmem.core import remat
from jaxmem.core.plugins import Feature
from jaxmem.offload.explain import BUFFER_TERMS
from jaxmem.offload.bill import BILL_TERMS


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


# tune's escalation once recomputation is not enough: the optimizer state, then the activations, then the
# parameters in pinned host memory.
SEARCH_STAGES = (
    ("optimizer state offloaded", [[r, "offload.optimizer=host", f"offload.optimizer_update={u}"]
                                   for r in ("remat.preset=selective", "remat.preset=full")
                                   for u in ("device", "host")]),
    ("activations offloaded", [["remat.preset=offload_layer_inputs", "offload.optimizer=host",
                                f"offload.optimizer_update={u}"] for u in ("device", "host")]),
    ("parameters offloaded", [["remat.preset=offload_layer_inputs", "offload.optimizer=host",
                               "offload.optimizer_update=device", "offload.params=host"]]),
)


class HostOffload(Feature):
    name = "offload"
    search_axes = SEARCH_STAGES
    bill_terms = BILL_TERMS
    buffer_terms = BUFFER_TERMS

    def applies(self, cfg: Config) -> bool:
        """Always: where the state lives is a decision of every run (its terms follow Layout.homes, and do
        nothing where everything is on the device)."""
        return True

    def check(self, cfg: Config) -> None:
        check(cfg)

    def check_micro_batches(self, cfg: Config, grad_accum: int) -> None:
        check_micro_batches(cfg, grad_accum)


HOST_OFFLOAD = HostOffload()
