"""parallel.pp_layers=auto: the layer counts per stage that minimize the largest stage's compiled peak.

Each stage position (first, middle, last) is compiled at one and at two layer groups; every figure of a
stage (state, gradients, residuals, temporaries) is affine in its layer count, so these two compiles give
each stage's peak for any count and its schedule's in-flight micro-batches. Layers are then handed out one
group at a time to the stage whose peak grows the least (for increasing affine peaks this minimizes the
largest). The chosen split and the even split are both compiled; the lower of the two is kept, so `auto`
never does worse than `even`.
"""
from __future__ import annotations

import dataclasses

from jaxmem.pipeline import partition
from jaxmem.pipeline.figures import StageFigures, stage_figures
from jaxmem.config.schema import Config
from jaxmem.pipeline.runtime import build_pipeline
from jaxmem.config.schema import ConfigError

_LINEAR = ("state", "grads", "params_for_grad", "residuals", "residuals_host", "forward_peak", "backward_peak",
           "update_total", "state_host", "update_host")


@dataclasses.dataclass
class Balance:
    counts: tuple[int, ...]
    figures: list[StageFigures]  # compiled, of `counts`
    even_counts: tuple[int, ...]
    even_figures: list[StageFigures]
    predicted: list[int]  # the fit's device peak per stage for the balanced counts

    @property
    def worst(self) -> int:
        return max(f.device_total for f in self.figures)

    @property
    def even_worst(self) -> int:
        return max(f.device_total for f in self.even_figures)


def _group(cfg: Config) -> int:
    return cfg.remat.every_k if cfg.remat.granularity == "every_k" else 1


def _fit(one: StageFigures, two: StageFigures):
    """fig(n layers), affine through two compiles of the stage at different layer counts."""
    def at(n: int, in_flight: int) -> StageFigures:
        steps = (n - one.layers) / (two.layers - one.layers)
        values = {k: int(round(getattr(one, k) + steps * (getattr(two, k) - getattr(one, k)))) for k in _LINEAR}
        return dataclasses.replace(one, layers=n, in_flight=in_flight, **values)
    return at


def split(peaks, pp: int, n_layers: int, g: int) -> tuple[int, ...]:
    """Counts (multiples of g, at least g each, summing to n_layers) that minimize max_s peaks[s](count)."""
    counts = [g] * pp
    for _ in range((n_layers - g * pp) // g):
        s = min(range(pp), key=lambda i: (peaks[i](counts[i] + g), i))
        counts[s] += g
    return tuple(counts)


def balance(cfg: Config, devices=None, *, features) -> Balance:
    pp, n_layers, g = cfg.parallel.pp, cfg.model.n_layers, _group(cfg)
    if n_layers % g or n_layers < g * pp:
        raise ConfigError(f"parallel.pp_layers: auto needs model.n_layers={n_layers} to be a multiple of the "
                          f"remat group {g} with at least one group per stage")
    # Probe pipelines: every stage at g layers, then at 2g (their sums need not be n_layers).
    probes = [stage_figures(build_pipeline(cfg, devices, counts=(k,) * pp, check=False, features=features)) for k in (g, 2 * g)]
    in_flight = [f.in_flight for f in probes[0]]

    def choose(fits):
        peaks = [lambda n, s=s: fits[s](n, in_flight[s]).device_total for s in range(pp)]
        counts = split(peaks, pp, n_layers, g)
        return counts, [peaks[s](counts[s]) for s in range(pp)]

    # The fit through the probes, then once more through the larger probe and the first choice's compile
    # (closer to the counts that matter); every candidate is compiled and the lowest worst stage kept.
    counts, predicted = choose([_fit(a, b) for a, b in zip(*probes)])
    compiled = {counts: stage_figures(build_pipeline(cfg, devices, counts=counts, features=features))}
    refit = [_fit(b, c) if c.layers != b.layers else _fit(a, b) for a, b, c in zip(*probes, compiled[counts])]
    second, second_predicted = choose(refit)
    if second not in compiled:
        compiled[second] = stage_figures(build_pipeline(cfg, devices, counts=second, features=features))
    even = tuple(c * g for c in partition.even_counts(n_layers // g, pp))
    if even not in compiled:
        compiled[even] = stage_figures(build_pipeline(cfg, devices, counts=even, features=features))
    best = min(compiled, key=lambda c: (max(f.device_total for f in compiled[c]), c != even))
    return Balance(best, compiled[best], even, compiled[even], second_predicted if best == second else predicted)


def stage_counts(cfg: Config, devices=None, *, features) -> tuple[int, ...]:
    """Layers per stage for build_pipeline: parallel.pp_layers as written, or with `auto` the balancer's
    choice (compiles every stage: see balance)."""
    counts = partition.layer_counts(cfg)
    return tuple(counts) if counts is not None else balance(cfg, devices, features=features).counts
