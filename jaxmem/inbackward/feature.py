"""The update in the backward (`optimizer.update_in_backward`) as a feature: its rules and its train step
(jaxmem.inbackward.step)."""
from __future__ import annotations

from jaxmem.config.schema import Config, ConfigError
from jaxmem.core.plugins import Feature
from jaxmem.inbackward.bill import BILL_TERMS
from jaxmem.inbackward.step import UpdateInBackward


def check(cfg: Config) -> None:
    """optimizer.update_in_backward rebuilds each layer from its input inside the backward and updates it at
    once: the levers that would change either part are refused here, by name."""
    if not cfg.optimizer.update_in_backward:
        return
    key = "optimizer.update_in_backward"
    if cfg.remat.preset not in ("full", "offload_layer_inputs") or cfg.remat.granularity != "layer" \
            or cfg.remat.names:
        raise ConfigError(f"{key}: needs remat.preset=full or offload_layer_inputs with remat.granularity=layer "
                          "and no remat.names (the backward rebuilds each layer from its input)")
    if cfg.offload.params != "device":
        raise ConfigError(f"{key}: needs offload.params=device (the backward updates device-resident layers)")
    if cfg.offload.optimizer == "host" and cfg.offload.optimizer_update != "device":
        raise ConfigError(f"{key}: with offload.optimizer=host needs offload.optimizer_update=device (each "
                          "layer's state is streamed to the device and back; no host-compute variant)")
    if cfg.precision.loss_scale.enabled:
        raise ConfigError(f"{key}: cannot skip a step after layers were already updated; turn off "
                          "precision.loss_scale (fp16), or use bf16")


def check_micro_batches(cfg: Config, grad_accum: int) -> None:
    if cfg.optimizer.update_in_backward and grad_accum > 1:
        raise ConfigError(f"optimizer.update_in_backward: needs train.grad_accum=1, got {grad_accum} from "
                          "train.* (each layer is updated as soon as its gradient exists)")


class UpdateInBackwardFeature(Feature):
    name = "update_in_backward"
    bill_terms = BILL_TERMS

    def applies(self, cfg: Config) -> bool:
        return cfg.optimizer.update_in_backward

    def check(self, cfg: Config) -> None:
        check(cfg)

    def check_micro_batches(self, cfg: Config, grad_accum: int) -> None:
        check_micro_batches(cfg, grad_accum)

    def program_plugin(self, cfg: Config):
        return UpdateInBackward.from_config(cfg)


UPDATE_IN_BACKWARD = UpdateInBackwardFeature()
