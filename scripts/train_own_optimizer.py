"""Your own optimizer (optax.adamw) and your own batches (a numpy token array) around jaxmem's model,
shardings and loss: place_params + loss_fn + jax.value_and_grad + jax.jit.

    python scripts/train_own_optimizer.py configs/tiny.yaml train.steps=30
"""
import functools
import sys

import jax
import numpy as np
import optax

import jaxmem
from jaxmem.model import init_model
from jaxmem.cli.train import parse_args


def main(argv: list[str]) -> list[float]:
    path, overrides = parse_args(argv)
    cfg = jaxmem.load_config(path or "configs/tiny.yaml", overrides)
    prog = jaxmem.build_program(cfg)  # mesh, param shardings, kernels; nothing allocated yet
    vocab, seq, rows = cfg.model.vocab_size, cfg.train.seq_len, prog.rows  # rows: a multiple of data ways

    # Any nnx model of the config's architecture (or jaxmem.load_hf(path, mesh=prog.mesh)), its nnx.State,
    # or a dict of arrays: placed as a dict of global arrays on the program's shardings.
    params = jaxmem.place_params(prog, init_model(cfg.model, seed=cfg.train.seed))

    # Your own data: here 4096 sequences that count upwards from a random token, [N, seq_len + 1].
    rng = np.random.default_rng(cfg.train.seed)
    corpus = (rng.integers(0, vocab, (4096, 1)) + np.arange(seq + 1)) % vocab

    loss_fn = jaxmem.loss_fn(prog)  # (params, tokens [B, T+1]) -> (mean loss, n_valid)
    lr = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=5, decay_steps=cfg.train.steps)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.01))
    opt_state = jax.jit(opt.init)(params)  # moments follow the params' shardings
    param_shardings = prog.state_shardings["params"]

    @functools.partial(jax.jit, in_shardings=(param_shardings, None, None),
                       out_shardings=(param_shardings, None, None), donate_argnums=(0, 1))
    def step(params, opt_state, tokens):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i in range(1, cfg.train.steps + 1):
        tokens = jaxmem.place_tokens(prog, corpus[rng.integers(0, len(corpus), rows)])  # rows over data axes
        params, opt_state, loss = step(params, opt_state, tokens)
        losses.append(float(loss))
        print(f"step {i}  loss {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main(sys.argv[1:])
