"""Sequence parallelism (`parallel.sp`) and sequence tiles (`remat.seq_tile`) as a feature: the rules on the
sequence's split once the mesh and the attention kernel are known. The mechanism is the kernels' (Ulysses
attention: jaxmem.kernels.attention.sequence_parallel) and the model's (jaxmem.model.seq_tiling)."""
from __future__ import annotations

from jaxmem.config.schema import Config, ConfigError
from jaxmem.core.plugins import Feature
from jaxmem.kernels.attention.sequence_parallel import heads_divide


def check_layout(cfg: Config, sizes: dict[str, int], attention: str) -> None:
    """Sequence parallelism and tiling against the mesh sizes and the attention kernel `auto` resolved to."""
    sp, seq, m = sizes.get("sp", 1), cfg.train.seq_len, cfg.model
    if seq % sp:
        raise ConfigError(f"parallel.sp: {sp} does not divide train.seq_len={seq}")
    if sp > 1 and attention != "xla" and not heads_divide(m.n_heads, sizes):
        raise ConfigError(f"parallel.sp: model.n_heads={m.n_heads} does not split over tp x sp = "
                          f"{sizes.get('tp', 1) * sp}; kernels.attention={attention} needs whole heads per "
                          "device (use kernels.attention=xla, which gathers k and v, or an sp that divides them)")
    tile = cfg.remat.seq_tile
    if tile and (seq // sp) % tile:
        raise ConfigError(f"remat.seq_tile: {tile} does not divide the per-device sequence train.seq_len / "
                          f"parallel.sp = {seq // sp}")


class SequenceParallel(Feature):
    name = "sequence_parallel"

    def applies(self, cfg: Config) -> bool:
        return cfg.parallel.sp != 1 or cfg.remat.seq_tile > 0

    def check_layout(self, cfg: Config, sizes: dict[str, int], kernels: dict[str, str]) -> None:
        check_layout(cfg, sizes, kernels["attention"])


SEQUENCE_PARALLEL = SequenceParallel()
