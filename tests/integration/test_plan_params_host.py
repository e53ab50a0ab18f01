"""The bill with the weights on the host and the AdamW update on the host (offload.params=host,
offload.optimizer=host): the decoder layers' gradients are host buffers, as the compiled step has them."""
from jaxmem.loader import load_config
from jaxmem.plan import resolve_topology
from jaxmem.plan.bill import compute_bill
from jaxmem.plan.compiled import compile_for_plan

# Qwen2.5-7B widths, 2 layers, a 16K vocabulary: small enough to compile deviceless for an H100 in a test
BASE = ["model.preset=qwen2.5-7b", "model.n_layers=2", "model.vocab_size=16384", "parallel.fsdp=1",
        "precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16", "precision.master_weights=true",
        "train.seq_len=2048", "train.micro_batch=1", "remat.preset=full", "target.name=h100-80g",
        "target.gpus_per_host=1", "offload.optimizer=host", "offload.params=host"]
D, F, V, H, N, K = 3584, 18944, 16384, 128, 28, 4
LAYER = 2 * D + 3 * D * F + 2 * D * N * H + 2 * D * K * H + (N + 2 * K) * H  # norms, MLP, q/o, k/v, biases


def test_layer_gradients_are_host_buffers():
    bill = compute_bill(load_config(None, BASE), 1)
    assert bill.device["grads"] == 0 and bill.absent_in_loss == 0
    assert bill.device["temporaries"] == LAYER * 2  # one layer's gradient, in the weights' bf16
    assert bill.device["params"] == (2 * V * D + D) * 2  # embedding, LM head, final norm
    # the update on the host holds the fp32 gradients, new m and v and new params there
    assert bill.host["temporaries"] == (2 * LAYER + 2 * V * D + D) * (4 + 4 + 4 + 2)


def test_bill_within_ten_percent_of_the_compile():
    # the bill and the step's compiled figures as `plan` pairs them; only the step is compiled (the init program
    # `plan` compiles beside it, host_init's with the weights on the host, is test_host_init's to check)
    cfg = load_config(None, BASE)
    topo = resolve_topology(cfg)
    bill = compute_bill(cfg, topo.n_devices, gpu=True, device_memory=topo.gpu.hbm_bytes)
    compiled = compile_for_plan(cfg, topo, init=False)[1]
    assert compiled.label == "compiled for 1 x h100-80g (deviceless)"
    analytic, device = bill.device_total, compiled.device_total
    assert abs(analytic / device - 1) <= 0.10, (analytic / 2**20, device / 2**20)  # was 4.9x before
    assert abs(bill.host_total / compiled.host_total - 1) <= 0.10
