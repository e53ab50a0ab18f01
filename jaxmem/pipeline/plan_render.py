"""The pipeline section of `jaxmem plan`'s report: one row per stage, from the plan dict's "pipeline" entry
(jaxmem.pipeline.plan writes it; jaxmem.plan.report prints it through the feature's render_plan hook)."""
from __future__ import annotations

from jaxmem.pipeline.figures import GIB

STAGE_COLUMNS = ("stage", "layers", "micro-batches in flight", "state", "grads (fp32 accumulator, cast params)",
                 "residuals x in flight (device)", "largest pass", "update", "device total", "host")


def stage_row(b: dict) -> list[str]:
    """One stage's bill (StageFigures.to_json) as the cells of STAGE_COLUMNS, GiB per device."""
    g = lambda x: f"{x / GIB:.2f}"  # noqa: E731
    return [str(b["stage"]), str(b["layers"]), str(b["in_flight"]), g(b["state"]), g(b["grads"] + b["params_for_grad"]),
            g(b["in_flight"] * b["residuals"]), g(max(b["forward_peak"], b["backward_peak"])), g(b["update_total"]),
            g(b["device_total"]), g(b["host_total"])]


def render_pipeline(plan: dict, console) -> None:
    info = plan.get("pipeline")
    if not info:
        return
    from rich.table import Table

    def table(title, bills):
        t = Table(title=title, caption="GiB per device, compiled for the target per stage program")
        for col in STAGE_COLUMNS:
            t.add_column(col, justify="right")
        for b in bills:
            t.add_row(*stage_row(b))
        console.print(t)

    console.print(f"pipeline: {info['stages']} stages, {info['schedule']}, {info['micro_batches']} micro-batches, "
                  f"layers {info['layers']} (pp_layers={info['layers_setting']}); bubble {info['bubble']:.1%} "
                  "(schedule simulation, backward = 2 forwards)", highlight=False)
    if info["stage_bills"]:
        table(f"pipeline stages, layers {info['layers']}", info["stage_bills"])
    if info["even_stage_bills"] and info["even_layers"] != info["layers"]:
        table(f"even split for comparison, layers {info['even_layers']}", info["even_stage_bills"])
