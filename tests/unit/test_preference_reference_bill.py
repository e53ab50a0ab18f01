"""The analytic bill of preference.reference=model (no compile): the frozen copy's bytes in its stored form
(bf16, int8 per channel, nf4 in blocks of 64: jaxmem.core.quant's sizes), and with reference_memory=host its
linear weights counted on the host instead of the device."""
import math

import pytest

from jaxmem.core.quant import quantized_bytes
from jaxmem.loader import load_config
from jaxmem.plan.bill import compute_bill

MODEL = ["model.vocab_size=256", "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.head_dim=16", "model.d_ff=128"]


def _bill(*extra):
    overrides = ["train.objective=dpo", "data.format=preference", "data.kind=jsonl", "data.path=pairs.jsonl",
                 "data.tokenizer=tokenizer.json", "lora.rank=0", "train.micro_batch=2", "parallel.fsdp=1",
                 "preference.reference=model"]
    cfg = load_config("configs/tiny.yaml", MODEL + overrides + list(extra))
    return compute_bill(cfg, 1), cfg


def test_reference_copy_bytes_follow_its_dtype_and_home():
    bf16, cfg = _bill()
    layers = cfg.model.n_layers
    linears = {"wq": (64, 4, 16), "wk": (64, 2, 16), "wv": (64, 2, 16), "wo": (4, 16, 64), "w_gate": (64, 128),
               "w_up": (64, 128), "w_down": (128, 64)}
    linear_elems = sum(layers * math.prod(s) for s in linears.values())
    rest = bf16.device["base"] - 2 * linear_elems  # norms, embedding and LM head in bf16
    assert rest > 0
    for dtype in ("int8", "nf4"):
        bill, _ = _bill(f"preference.reference_dtype={dtype}")
        stored = sum(quantized_bytes((layers, *s), dtype, block=64, batch_dims=1, in_axes=(1,))
                     for s in linears.values())
        assert bill.device["base"] == rest + stored
        host, _ = _bill(f"preference.reference_dtype={dtype}", "preference.reference_memory=host")
        assert host.device["base"] == rest and host.host["base"] == stored
    assert _bill("preference.reference_memory=host")[0].host["base"] == 2 * linear_elems


@pytest.mark.parametrize("extra", [["preference.reference=precompute", "preference.reference_dtype=int8"],
                                   ["preference.reference=precompute", "preference.reference_memory=host"]])
def test_copy_settings_without_a_copy_are_refused(extra):
    from jaxmem.config import ConfigError

    with pytest.raises(ConfigError, match="preference.reference_dtype / reference_memory"):
        _bill(*extra)


def test_held_out_pairs_with_precomputed_reference_are_refused():
    from jaxmem.config import ConfigError

    with pytest.raises(ConfigError, match="eval.path: held-out pairs need the reference's log-probs"):
        _bill("preference.reference=precompute", "eval.path=held_out.jsonl")
