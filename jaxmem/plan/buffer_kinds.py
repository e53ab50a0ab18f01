"""What a buffer of the compiled train step is (param, grad, optimizer, activation, logits, temp), from the
phase of the step that wrote it and its shape relative to the train state, with the lever that shrinks it."""
from __future__ import annotations

import dataclasses
import re

import jaxmem.kernels
import jaxmem.kernels.cross_entropy
import jaxmem.model.layers
import jaxmem.model.rope
import jaxmem.optim
from jaxmem import registry
from jaxmem.config.schema import Config, ConfigError
from jaxmem.core.offload import StateHomes
from jaxmem.config.names import ALL_NAMES
from jaxmem.plan import advice, hlo_dump
from jaxmem.plan.attribution import (PLUMBING, defining, in_files, in_loss_scope, is_ours, is_scores, model_frame,
                                     module_path, rel_path, shape_name, tagged_op, vocab_dims)
from jaxmem.plan.categories import EXPLAIN_CATEGORIES, SUGGESTIONS
from jaxmem.core.step_state import GRADS_SCOPE, UPDATE_SCOPE
from jaxmem.model import abstract_model
from jaxmem.core.remat import group_size

# The categories and what each holds: jaxmem.plan.categories (shared with the bill).
CATEGORIES = EXPLAIN_CATEGORIES
# Where per-layer values are computed (the scan call in transformer.py only owns the stacking).
_LAYER_CODE = tuple(module_path(m) for m in (jaxmem.model.layers, jaxmem.model.rope, jaxmem.kernels))
_OPTIM_CODE = (module_path(jaxmem.optim),)  # the optimizer update
_LOSS_CODE = (module_path(jaxmem.kernels.cross_entropy),)


# ------------------------------------------------------------------ what a buffer is
# A peak buffer is classified from what it is, not from the nearest model source line:
#   * an argument of the step (an ENTRY parameter): its train-state path (state['params'] -> param;
#     state['opt'], state['master'] -> optimizer; the batch -> temp);
#   * else the phase of the op that wrote it, from the jax name stack in its op_name: the step's named
#     scopes "optimizer_update/" (the update) and "grads/" (loss and gradients), and inside the latter
#     "transpose(" (the backward pass) or "jvp(" (the forward pass). A loop's buffer takes the loop's phase
#     (a value only passed through a loop, where it was made); an op without a name stack takes the phase
#     of the ops that read it;
#   * and its shape against the train state: weight-shaped (a parameter's shape, one layer's, the stacked
#     [L, ...] or remat-grouped [L/k, k, ...] one, or a shard of it, up to a relayout) or token-shaped (a
#     seq_len or micro_batch x seq_len dim).
# Then: anything the update writes -> optimizer (its temporaries); an all-gathered weight, or one only moved,
# cast, sliced or relaid out from state['params'] (dataflow) -> param; weight-shaped from the backward pass,
# a reduce-scatter or the micro-batch accumulation -> grad; [tokens, vocab] -> logits; a per-layer value a
# scan keeps ([L, ...] residuals, token-shaped) -> activation (with its checkpoint name); other
# weight-shaped values -> param; the rest -> temp. The evidence used is in each buffer's "why".

_STATE_CATEGORY = (("state['params']", "param"), ("state['base']", "param"), ("state['opt']", "optimizer"), ("state['master']", "optimizer"))


@dataclasses.dataclass
class StateShapes:
    """The shapes a weight-shaped buffer can have (size-1 dims dropped) -> the parameter, and the token dims."""

    exact: dict[tuple[int, ...], list[str]]
    relaid: dict[tuple[int, ...], list[str]]  # by sorted dims: XLA may transpose a weight (layout assignment)
    tokens: set[int]
    homes: StateHomes  # where the state lives (the layout's resolution of offload.*)

    def weight(self, shape) -> str | None:
        """The parameter(s) this shape can belong to, e.g. "layers.w_gate|w_up"; None if not weight-shaped."""
        s = tuple(d for d in shape if d != 1)
        if len(s) < 2:  # vectors are too ambiguous to call weights
            return None
        names = list(dict.fromkeys(self.exact.get(s) or self.relaid.get(tuple(sorted(s))) or ()))
        if not names:
            return None
        return "|".join([names[0]] + [n.removeprefix("layers.") if names[0].startswith("layers.") else n
                                      for n in names[1:]])

    def token_shaped(self, shape) -> bool:
        return any(d in self.tokens for d in shape)


def _state_path(op_name: str) -> str:
    """"state['opt']['layers'][0].mu['w_up']" -> "layers.w_up" (the parameter a state leaf belongs to)."""
    keys = re.findall(r"\['([^']+)'\]", op_name)[1:]
    keys = [k for k in keys if k not in ("rest",)]
    return ("layers." if "layers" in keys[:-1] else "") + keys[-1] if keys else op_name


# What an optimizer-state leaf holds, by the field names on its path (optax's states, jaxmem.optim.codes.QTensor).
_MOMENTS = {".mu": "m", ".nu": "v", ".v_row": "v row factors", ".v_col": "v column factors", ".v": "v"}


def state_leaf_words(cfg: Config, path: str) -> str:
    """"m codes (int8) of layers.w_up" for the train-state path of an optimizer-state argument
    (state['opt']['layers'][0].mu['w_up'].codes), "fp32 master of embed" for a master weight."""
    param = _state_path(path)
    if path.startswith("state['master']"):
        return f"fp32 master of {param}"
    moment = next((word for field, word in _MOMENTS.items() if re.search(re.escape(field) + r"(\[|\.|$)", path)),
                  "state")
    if path.endswith(".codes"):
        return f"{moment} codes ({cfg.precision.moment_dtype}) of {param}"
    if path.endswith(".scales"):
        return f"{moment} block scales (fp32) of {param}"
    return f"{moment} of {param}"


def state_shapes(cfg: Config, module: hlo_dump.HloModuleText | None = None) -> StateShapes:
    """From the model config (global shapes) and the step's arguments in `module` (this device's shards)."""
    import jax
    from flax import nnx

    groups = _groups(cfg)
    params = nnx.to_pure_dict(nnx.split(abstract_model(cfg.model))[1])
    full = {".".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    by_name = {name: {shape} for name, shape in full.items()}
    factors = set()  # how many ways the state's dims are sharded
    for ins in (module.instrs.values() if module else ()):
        if ins.opcode == "parameter" and ins.computation == module.entry and ins.op_name.startswith("state["):
            shape = hlo_dump.parse_array_type(ins.type)[1]
            name = _state_path(ins.op_name)
            if name in full and len(shape) == len(full[name]):
                by_name[name].add(shape)  # this device's shard
                factors |= {g // d for g, d in zip(full[name], shape) if d and g % d == 0 and g > d}
    known: dict[tuple[int, ...], list[str]] = {}  # global and this device's shapes, per layer, grouped
    sharded: dict[tuple[int, ...], list[str]] = {}  # the same with one more dim sharded as the state is
    for name, shapes in sorted(by_name.items()):
        cands = set(shapes)
        if name.startswith("layers."):
            for s in shapes:
                cands |= {s[1:]} | {(s[0] // k, k) + s[1:] for k in groups if s[0] % k == 0}
        for s in cands:
            known.setdefault(tuple(d for d in s if d != 1), []).append(name)
            for i, d in enumerate(s):
                for n in factors:
                    if d % n == 0 and d > n:
                        sharded.setdefault(tuple(x for x in s[:i] + (d // n,) + s[i + 1:] if x != 1), []).append(name)
    exact = dict(known)
    for s, names in sharded.items():
        exact.setdefault(s, sorted(set(names)))
    relaid: dict[tuple[int, ...], list[str]] = {}
    for s, names in exact.items():
        relaid.setdefault(tuple(sorted(s)), []).extend(names)
    t = cfg.train.seq_len
    return StateShapes(exact, relaid, {t, t * cfg.train.micro_batch}, StateHomes.from_config(cfg))


def _groups(cfg: Config) -> set[int]:
    """Layers per remat group (every_k / nested); the scan then stacks [L/k, k, ...]."""
    try:
        k = group_size(cfg.remat, cfg.model.n_layers)
    except ConfigError:
        return set()
    return {k} if k > 1 else set()


def _phase(op_name: str) -> str | None:
    if f"{UPDATE_SCOPE}/" in op_name or op_name.endswith(UPDATE_SCOPE):
        return "update"
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    if f"/{GRADS_SCOPE}/" in op_name:
        return "grads"  # in the gradient computation, outside jax.grad: the micro-batch accumulation
    return None


_PHASE_WORDS = {"update": "the optimizer update", "backward": "the backward pass", "forward": "the forward pass",
                "grads": "the gradient accumulation"}


def _own_phase(module, ins) -> str | None:
    """The phase named in this op's own metadata: its name stack, else an optimizer source frame."""
    p = _phase(ins.op_name)
    if p is None and ins.frame is not None:
        frame, _ = model_frame(module, ins)
        if frame is not None and in_files(frame.file, _OPTIM_CODE):
            p = "update"
    return p


def _op_phase(module, ins, idx=()) -> tuple[str | None, str]:
    """(phase, how it was found when not from the op's own metadata) of the op that wrote `ins` (its output
    idx[0] when it has several)."""
    p = _own_phase(module, ins)
    if p:
        return p, ""
    if ins.opcode in ("fusion", "async-start", "async-done", "all-gather-start", "all-gather-done"):
        for comp in ins.calls:
            for n in reversed(module.computations.get(comp, [])):
                p = _phase(module.instrs[n].op_name)
                if p:
                    return p, "its fused ops' op_name"
    frontier = _outputs(module, ins, idx)
    seen = {ins.name, *frontier}
    for _ in range(4):  # an op without a name stack (e.g. zeros XLA hoisted out of a loop): its readers' phase
        nxt = []
        for n in frontier:
            for u in module.users.get(n, []):
                if u in seen:
                    continue
                seen.add(u)
                p = _own_phase(module, module.instrs[u])
                if p:
                    return p, f"read by {u}"
                nxt.append(u)
        frontier = nxt
    return None, "no name stack"


def _loop_value(module, loop, i: int, depth: int = 8):
    """(owner, inner value) of element i of a while loop: the loop, and what its body writes there, or, for
    an element the body only passes through, the same for the loop's input."""
    for _ in range(depth):
        root = module.instrs.get(module.roots.get(loop.body or "", ""))
        if root is None or root.opcode != "tuple" or i >= len(root.operands):
            return loop, None
        inner = module.instrs.get(root.operands[i])
        passthrough = (inner is not None and inner.opcode == "get-tuple-element" and inner.tuple_index == i
                       and module.instrs.get(inner.operands[0], inner).opcode == "parameter")
        if not passthrough:
            return loop, inner
        init = module.instrs.get(loop.operands[0]) if loop.operands else None
        if init is None or init.opcode != "tuple" or i >= len(init.operands):
            return loop, inner
        src = module.instrs.get(init.operands[i])
        if src is None:
            return loop, inner
        if src.opcode == "get-tuple-element" and module.instrs.get(src.operands[0]) is not None \
                and module.instrs[src.operands[0]].opcode == "while":
            loop, i = module.instrs[src.operands[0]], src.tuple_index
            continue
        return src, src
    return loop, None


def _owner(module, ins, index: str):
    """(instruction owning the buffer, tuple index, value written into it): a loop's body parameter and
    get-tuple-element resolve to the loop element they are."""
    idx = [int(x) for x in index.strip("{}").split(",") if x]
    for _ in range(8):
        if ins.opcode == "parameter" and ins.computation != module.entry and idx:
            loops = [module.instrs[c] for c in module.callers.get(ins.computation, [])
                     if module.instrs[c].opcode == "while"]
            if not loops:
                break
            ins = loops[0]
            continue
        if ins.opcode == "get-tuple-element" and ins.operands and ins.operands[0] in module.instrs:
            ins, idx = module.instrs[ins.operands[0]], [ins.tuple_index] + idx
            continue
        break
    entry_arg = ins.opcode == "parameter" and ins.computation == module.entry
    fed = None
    if ins.opcode != "while" and not entry_arg and _own_phase(module, ins) is None:
        fed = _fed_loop(module, ins, idx)
        if fed is not None:
            ins, idx = fed[0], [fed[1]]
    if ins.opcode == "while" and idx:
        owner, value = _loop_value(module, ins, idx[0])
        return owner, idx, value, (f"as the initial buffer of {fed[0].name}" if fed else "")
    return ins, idx, None, ""


def _outputs(module, ins, idx) -> list[str]:
    """The instructions carrying output idx[0] of a multi-output op (its get-tuple-elements), else the op."""
    if not (ins.type.startswith("(") and idx):
        return [ins.name]
    return [u for u in module.users.get(ins.name, [])
            if module.instrs[u].opcode == "get-tuple-element" and module.instrs[u].tuple_index == idx[0]]


def _fed_loop(module, ins, idx):
    """(loop, element) when this value is made only to be a loop's initial element (zeros or an allocated
    buffer that the loop fills in): it is that loop's buffer."""
    for n in _outputs(module, ins, idx):
        for _ in range(4):
            users = module.users.get(n, [])
            if len(users) != 1:
                break
            user = module.instrs[users[0]]
            if user.opcode in ("bitcast", "copy"):
                n = user.name
                continue
            if user.opcode == "tuple":
                loops = [w for w in module.users.get(user.name, []) if module.instrs[w].opcode == "while"]
                if loops:
                    return module.instrs[loops[0]], user.operands.index(n)
            break
    return None


def _weight_copy(module, ins, depth: int = 6) -> str | None:
    """The train-state weight (op_name of the step's argument) that `ins` only moves, casts, slices, relays
    out or gathers (a chain of ops with one array operand), through loop elements; else None."""
    for _ in range(depth):
        if ins.opcode == "parameter":
            if ins.computation == module.entry:
                return ins.op_name if ins.op_name.startswith(("state['params']", "state['master']",
                                                              "state['opt']")) else None
            return None
        if ins.opcode == "get-tuple-element" and ins.operands and ins.operands[0] in module.instrs:
            src = module.instrs[ins.operands[0]]
            if src.opcode == "parameter" and src.computation != module.entry:  # a loop element: its input
                loops = [module.instrs[c] for c in module.callers.get(src.computation, [])
                         if module.instrs[c].opcode == "while"]
                init = module.instrs.get(loops[0].operands[0]) if loops and loops[0].operands else None
                if init is None or init.opcode != "tuple" or ins.tuple_index >= len(init.operands):
                    return None
                ins = module.instrs.get(init.operands[ins.tuple_index])
            elif src.opcode == "tuple" and ins.tuple_index < len(src.operands):
                ins = module.instrs.get(src.operands[ins.tuple_index])
            else:
                return None
            if ins is None:
                return None
            continue
        arrays = [module.instrs[o] for o in ins.operands if o in module.instrs
                  and hlo_dump.parse_array_type(module.instrs[o].type)[1] != ()
                  and module.instrs[o].opcode != "constant"]
        if len(arrays) != 1 or ins.opcode in ("while", "call", "conditional", "custom-call", "tuple"):
            return None
        ins = arrays[0]
    return None


def _collective(module, ins) -> str | None:
    called = ins.calls if ins.opcode not in ("while", "conditional", "call") else ()
    ops = {ins.opcode} | {module.instrs[n].opcode for c in called for n in module.computations.get(c, [])}
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        if any(o.startswith(kind) for o in ops):
            return kind
    return None


@dataclasses.dataclass
class BufferFacts:
    """What the rules read about one buffer of the compiled step: its shape against the train state, the
    phase of the step that wrote it, the collective that made it, the weight it copies, and its source frame."""

    cfg: Config
    state: StateShapes
    shape: tuple
    op_name: str
    weight: str | None  # the parameter(s) it is shaped like
    tokens: bool  # a token dim (seq_len or micro_batch x seq_len)
    vocab: bool  # a vocab-sized last dim
    residual: bool  # a value a scan keeps (its carry or stacked outputs)
    stacked: bool  # a [layers, ...] (or remat-grouped) leading dim
    phase: str | None
    where: str  # the phase in words
    like: str  # "shaped like <weight>" or ""
    collective: str | None
    copy_of: str | None  # the train-state weight it only moves, casts, slices or gathers
    frame: object | None  # the jaxmem source frame it is attributed to
    module: object = None
    made: object = None  # the instruction that wrote the value

    def in_code(self, *modules) -> bool:
        """Whether its source frame is in one of these jaxmem modules (or packages)."""
        return self.frame is not None and in_files(self.frame.file, tuple(module_path(m) for m in modules))


def _facts(cfg: Config, module, ins, owned: tuple, state: StateShapes, shape) -> BufferFacts:
    owner, idx, value, via = owned
    op_name = owner.op_name or ins.op_name
    weight = state.weight(shape)
    loop = owner.opcode == "while"
    phase, how = _op_phase(module, owner, idx)
    if phase is None and value is not None:
        phase, how = _op_phase(module, value)
    how = via or how
    made = value if loop and value is not None else owner
    return BufferFacts(
        cfg=cfg, state=state, shape=shape, op_name=op_name, weight=weight, tokens=state.token_shaped(shape),
        vocab=bool(shape) and shape[-1] in vocab_dims(cfg), residual=loop or _is_residual_write(owner),
        stacked=bool(shape) and shape[0] in {cfg.model.n_layers} | {cfg.model.n_layers // k for k in _groups(cfg)},
        phase=phase, where=_PHASE_WORDS.get(phase, "no named phase") + (f" ({how})" if how else ""),
        like=f"shaped like {weight}" if weight else "", collective=_collective(module, owner),
        copy_of=_weight_copy(module, made) if weight and phase != "update" else None,
        frame=_frame(module, made, owner, phase, loop), module=module, made=made)


def _frame(module, made, owner, phase: str | None, loop: bool):
    """The source line: in optim.py for the update; the per-layer computation for a loop's values."""
    if phase == "update":
        return defining(module, made.name, depth=6, prefer=_OPTIM_CODE)[1]
    if phase == "grads" and (made.frame or owner.frame) is not None:  # the accumulation itself (step code)
        return next((f for f in module.stack(made.frame or owner.frame) if is_ours(f.file)), None)
    if loop or _is_residual_write(owner):
        frame = defining(module, made.name, depth=6, prefer=_LAYER_CODE)[1]
        if loop and (frame is None or not in_files(frame.file, _LAYER_CODE)):
            frame = defining(module, made.name)[1]
        return frame
    return defining(module, made.name)[1]


# ------------------------------------------------------------------ the rules, in order: the first that names
# the buffer wins. Each returns (category, key, why) or None.


def _op_names(b: BufferFacts) -> tuple[str, ...]:
    """The name stacks of the ops that wrote the buffer (the owner's and the value written into it)."""
    return (b.op_name, b.made.op_name if b.made is not None else "")


def _gathered(b: BufferFacts):
    if b.collective == "all-gather" and b.weight:
        return "param", "gathered", f"all-gather of {b.weight}"


def _optimizer_copy(b: BufferFacts):
    if b.copy_of and b.copy_of.startswith(("state['master']", "state['opt']")):  # optimizer state, not weights
        if b.state.homes.optimizer_on_host:  # the state in pinned host memory brought to the device for the update
            return "optimizer", "optimizer_fetch", f"{b.copy_of} brought from pinned host memory in {b.where}"
        return "optimizer", "optimizer_temp", f"a copy of {b.copy_of} in {b.where}"


def _param_copy(b: BufferFacts):
    if b.copy_of:
        return "param", "param_copy", f"a copy of {b.copy_of} (cast, slice or relayout) in {b.where}"


def _reduce_scattered(b: BufferFacts):
    if b.collective == "reduce-scatter" and b.weight:
        return "grad", "grad", f"reduce-scatter, {b.like}"


def _update(b: BufferFacts):
    if b.phase == "update":
        return "optimizer", "optimizer_temp", f"written in {b.where}" + (f", {b.like}" if b.like else "")


def _gradient(b: BufferFacts):
    if b.phase in ("backward", "grads") and b.weight and not (b.tokens and _logits_not_grad(b.cfg, b.op_name,
                                                                                             b.vocab)):
        return "grad", "grad", f"{b.like}, written in {b.where}"


def _logits(b: BufferFacts):
    """[tokens, vocab]: vocab-wide and written by the loss (its scope or its code), not only shaped so."""
    made_by_loss = in_loss_scope(_op_names(b)) or (b.frame is not None and in_files(b.frame.file, _LOSS_CODE))
    if b.vocab and made_by_loss and (b.tokens or not b.weight):
        return "logits", "logits", ("d(logits) " if b.phase == "backward" else "") + \
            f"[tokens, vocab] written in {b.where}"


def _activation(b: BufferFacts):
    forward = b.phase in ("forward", None) and (b.tokens or not b.weight)
    if b.residual and (forward or b.phase == "backward" and b.tokens and b.stacked):
        return "activation", "activation", f"{'stacked scan residual' if b.stacked else 'scan value'} written in " \
            f"{b.where}" + (", token dims" if b.tokens else "")


def _weight_shaped(b: BufferFacts):
    if b.weight and not (b.tokens and b.phase == "forward"):
        return "param", "param_copy", f"{b.like}, written in {b.where}: a copy of the weights"


def _scores(b: BufferFacts):
    if is_scores(b.cfg, b.shape, _op_names(b)):
        return "temp", "scores", f"S x S attention scores written in {b.where}"


def _temp(b: BufferFacts):
    return "temp", "temp", ("token dims, " if b.tokens else "") + f"written in {b.where}"


RULES = (("gathered", _gathered), ("optimizer_copy", _optimizer_copy), ("param_copy", _param_copy),
         ("reduce_scattered", _reduce_scattered), ("update", _update), ("gradient", _gradient),
         ("logits", _logits), ("activation", _activation), ("weight_shaped", _weight_shaped), ("scores", _scores),
         ("temp", _temp))


def rules_for(cfg: Config) -> tuple[list, list]:
    """(the rules in order, each active feature's named before the base rule it precedes; the features'
    refiners, run on the match) for `cfg` (jaxmem.core.plugins.Feature.buffer_terms: ("before", name, rule)
    or ("refine", fn))."""
    terms = registry.for_config(cfg).terms("buffer_terms")
    rules = []
    for name, rule in RULES:
        rules += [t[2] for t in terms if t[0] == "before" and t[1] == name] + [rule]
    return rules, [t[1] for t in terms if t[0] == "refine"]


def classify(cfg: Config, module, name: str, index: str, size: int, state: StateShapes | None = None) -> dict:
    """What the buffer `name{index}` of `size` bytes in the compiled step is: its explain category, why, its
    checkpoint name and source line (an entry of `jaxmem explain`'s table)."""
    state = state or state_shapes(cfg, module)
    ins = module.instrs.get(name)
    type_ = hlo_dump.element_type(ins.type, index) if ins else "?"
    dtype, shape = hlo_dump.parse_array_type(type_)
    if ins is None:
        return _entry(cfg, name + index, size, shape, dtype, "temp", "temp", None, name, "", "not in the HLO text")
    if type_.startswith("("):  # the tuple itself: a small table of its elements' addresses
        return _entry(cfg, name + index, size, (), "tuple", "temp", "temp", None, name, ins.op_name,
                      "tuple of buffer addresses (a loop's state or a multi-output op)")
    host = " (host memory)" if ":S(5)" in type_ else ""
    owned = _owner(module, ins, index)
    owner = owned[0]
    if owner.opcode == "parameter" and owner.computation == module.entry:  # the step's arguments
        path = owner.op_name
        cat = next((c for prefix, c in _STATE_CATEGORY if path.startswith(prefix)), "temp")
        what = "input" if not path.startswith("state[") else "train state" + (
            f": {state_leaf_words(cfg, path)}" if cat == "optimizer" else "")
        return _entry(cfg, name + index, size, shape, dtype, cat, cat, None, path or owner.name, path,
                      f"argument of the step ({what}){host}")
    b = _facts(cfg, module, ins, owned, state, shape)
    rules, refiners = rules_for(cfg)
    cat, key, why = next(found for found in (rule(b) for rule in rules) if found)
    ckpt = _checkpoint_name(b) if key == "activation" else None
    if ckpt == "attention_scores":
        key = "scores"
    found = (cat, key, why, ckpt)
    for refine in refiners:
        found = refine(b, found)
    cat, key, why, ckpt = found
    source = f"{rel_path(b.frame.file)}:{b.frame.line} {b.frame.function}" if b.frame else (b.op_name or name)
    return _entry(cfg, name + index, size, shape, dtype, cat, key, ckpt, source, b.op_name, why + host)


def _checkpoint_name(b: BufferFacts) -> str | None:
    """The checkpoint name of an activation: the name scope of the op that made it (tagged_op), which then
    gives its source line too (the op's own frame: a LoRA or kernel call inside the named scope, not the norm
    whose output fed it); by shape only where no op carries one."""
    tagged = tagged_op(b.module, b.made)
    if tagged is not None:
        frame = model_frame(b.module, tagged[1])[0]
        if frame is not None and not in_files(frame.file, PLUMBING):
            b.frame = frame
    ckpt = tagged[0] if tagged else shape_name(b.cfg, b.shape, _op_names(b))
    if ckpt and ckpt not in ALL_NAMES and ckpt != "attention_scores" and "|" not in ckpt:
        ckpt = shape_name(b.cfg, b.shape, _op_names(b))
    return ckpt


def _logits_not_grad(cfg: Config, op_name: str, vocab: bool) -> bool:
    """For a backward-pass [X, vocab] buffer that is both weight- and token-shaped (tokens == d_model): only
    the naive loss materializes d(logits), and a weight gradient comes out of a dot."""
    return vocab and cfg.kernels.loss == "naive" and not op_name.endswith("dot_general")


def _entry(cfg, buffer, size, shape, dtype, category, key, ckpt, source, op_name, why) -> dict:
    """A row of explain's table; its suggestion names only levers the config does not use and accepts."""
    suggestion = advice.advisor_for(cfg).suggestion("activation_unnamed" if key == "activation" and not ckpt
                                                    else key, (ckpt or "").split("|")[0])
    return {"buffer": buffer, "bytes": size, "shape": list(shape), "dtype": dtype, "category": category,
            "checkpoint_name": ckpt, "source": source, "op": op_name, "why": why, "suggestion": suggestion}


def _is_residual_write(ins) -> bool:
    """A per-layer value written into its stacked [layers, ...] scan residual inside the loop body."""
    return "while/body" in ins.op_name and "dynamic_update_slice" in ins.op_name
