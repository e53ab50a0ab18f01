"""Shared by the Hugging Face parity tests (test_hf, test_families, test_moe): logits of a jaxmem model and of a
transformers model for the same tokens, and tiny HF checkpoints saved once per module."""
import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx


def jax_logits(model, tokens, ctx=None):
    """A jaxmem model's logits [B, T, V] for `tokens`, jitted (with a ForwardContext where given)."""
    graphdef, state = nnx.split(model)

    def run(s, t):
        merged = nnx.merge(graphdef, s)
        return merged(t) if ctx is None else merged(t, ctx)

    return np.asarray(jax.jit(run)(state, jnp.asarray(tokens)))


def hf_logits(model, tokens):
    """A transformers model's fp32 logits for `tokens`."""
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def random_tokens(vocab, batch=2, seq=20):
    """The parity tests' input ids: a fixed draw, the same for every family."""
    return np.random.RandomState(3).randint(0, vocab, (batch, seq)).astype(np.int32)


def saved_checkpoints(tmp_path_factory, names, build) -> dict:
    """{name: (directory, model)}: `build(name)`'s transformers model saved as safetensors in its own directory."""
    out = {}
    for name in names:
        directory = tmp_path_factory.mktemp(name)
        model = build(name)
        model.save_pretrained(directory, safe_serialization=True)
        out[name] = (directory, model)
    return out


def meta_param_count(config) -> int:
    """Parameters of the transformers model `config` builds, counted on the meta device (no memory)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())
