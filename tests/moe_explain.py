"""tiny-moe explained deviceless for 8 x h100-80g (`jaxmem explain`), once per test run through `built_once`:
test_moe_plan_compiled reads its buffers, test_expert_parallel the expert-parallel step's optimized HLO from the
same compile's dumps (a deviceless executable cannot be kept in the persistent cache, so it is shared here)."""
import json
from pathlib import Path

from jaxmem.cli.explain import main

OVERRIDES = ["target.name=h100-80g", "target.gpus_per_host=8", "remat.preset=full", "precision.param_dtype=bfloat16",
             "precision.compute_dtype=bfloat16", "precision.master_weights=true"]
EP8 = ["parallel.ep=8", "parallel.fsdp=1", "model.moe_capacity_factor=1.25"]  # the default kernel: blocked


def explained(built_once, name: str, extra: list[str]) -> tuple[dict, Path]:
    """(explain's JSON, the folder of XLA's dumps) of configs/tiny-moe.yaml with OVERRIDES and `extra`."""
    def build(directory):
        args = ["configs/tiny-moe.yaml", *OVERRIDES, *extra, "--top", "40", "--json", str(directory / "top.json"),
                "--dump-dir", str(directory / "dump")]
        assert main(args) == 0

    directory = built_once(name, build)
    return json.loads((directory / "top.json").read_text()), directory / "dump"
