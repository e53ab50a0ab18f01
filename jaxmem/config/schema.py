"""The run configuration's schema: typed, frozen dataclasses, ConfigError, YAML reading and dotted
`key=value` overrides.

It imports no other jaxmem module, so every module that owns a vocabulary (model presets, remat, kernels,
targets, offload) imports its types from here, and `jaxmem.config.validate` and `jaxmem.config` (the loader users
call) sit above them: imports go one way.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal

import yaml


class ConfigError(ValueError):
    """A bad config value; the message is one line and names the key."""


class NotYetSupported(ConfigError, NotImplementedError):
    """A lever that is not implemented yet (one line, naming the key)."""


Dtype = Literal["float32", "bfloat16", "float16"]


def _f(default: Any, help: str, *, factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field with its one-line description (`metadata["help"]`): the single source of the config
    reference (`jaxmem config`, docs/config.md; see `field_docs`)."""
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


# ---------------------------------------------------------------- open choices
# A key whose allowed values a higher floor owns (precision.moment_dtype: the optimizer state kinds,
# jaxmem.optim.states) is declared here with `_choice`; the owner registers each value, its description and
# its config rule when it is imported (`register_choice`). Building a config checks the value against them,
# the key's help lists them, and jaxmem.config.validate runs the value's rule. Key -> {value: (description,
# rule)}.
_CHOICES: dict[str, dict[str, tuple[str, Callable[[Any], None] | None]]] = {}


def _choice(default: str, help: str, key: str, owner: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, "choices": key, "owner": owner})


def register_choice(key: str, value: str, description: str, rule: Callable[[Any], None] | None = None) -> None:
    _CHOICES.setdefault(key, {})[value] = (description, rule)


def registered_choices(key: str, owner: str = "its owner") -> dict[str, str]:
    """value -> description of an open key; a one-line error where the module that owns them is not imported."""
    if key not in _CHOICES:
        raise ConfigError(f"{key}: its values are registered by {owner}, which is not imported")
    return {value: description for value, (description, _) in _CHOICES[key].items()}


def check_choice(key: str, value: str, owner: str = "its owner") -> Callable[[Any], None] | None:
    """The rule of an open key's value (None: no rule); a one-line ConfigError naming the allowed values."""
    if value not in registered_choices(key, owner):
        raise ConfigError(f"{key}: {value!r} is not allowed; use one of {', '.join(_CHOICES[key])}")
    return _CHOICES[key][value][1]


_FROM_PRESET = "; from model.preset unless set"
_FILL = ("; -1: fill the remaining devices (at most one axis; on a CPU host where no device count is set, "
         "`jaxmem train` and `bench` make as many devices as the other axes take, so -1 is 1)")
_POW2 = " (a power of two >= 16)"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    preset: str = _f("tiny", "model shape preset (`jaxmem list presets`), or custom to give every shape key; "
                             "it fills each model.* key the config does not set")
    vocab_size: int = _f(0, "vocabulary size in tokens" + _FROM_PRESET)
    d_model: int = _f(0, "hidden width of the residual stream" + _FROM_PRESET)
    n_layers: int = _f(0, "number of decoder layers" + _FROM_PRESET)
    n_heads: int = _f(0, "number of attention (query) heads" + _FROM_PRESET)
    n_kv_heads: int = _f(0, "number of key/value heads (grouped-query attention; must divide n_heads)"
                         + _FROM_PRESET)
    head_dim: int = _f(0, "width of one attention head" + _FROM_PRESET)
    d_ff: int = _f(0, "hidden width of the gated (SwiGLU) MLP" + _FROM_PRESET)
    rope_theta: float = _f(10000.0, "RoPE base frequency (theta)" + _FROM_PRESET)
    rope_scaling: dict | None = _f(None, "RoPE frequency scaling of the global layers: Llama-3 style, a "
                                         "mapping of factor, low_freq_factor, high_freq_factor, "
                                         "original_max_position_embeddings; or {rope_type: linear, factor: f} "
                                         "(positions divided by f, Gemma 3); or {rope_type: yarn, factor, "
                                         "original_max_position_embeddings, beta_fast, beta_slow, truncate} "
                                         "(gpt-oss); null: plain theta" + _FROM_PRESET)
    norm_eps: float = _f(1e-5, "RMSNorm epsilon" + _FROM_PRESET)
    qkv_bias: bool = _f(False, "biases on the query/key/value projections (Qwen2)" + _FROM_PRESET)
    attn_out_bias: bool = _f(False, "a bias on the attention output projection (gpt-oss)" + _FROM_PRESET)
    attention_sinks: bool = _f(False, "a learned logit per query head joins every attention softmax as one more "
                                      "column that weighs no value (gpt-oss)" + _FROM_PRESET)
    qk_norm: bool = _f(False, "RMSNorm over head_dim on each query and key head, before RoPE (Qwen3, Gemma 3)"
                       + _FROM_PRESET)
    post_norms: bool = _f(False, "RMSNorm on the attention and MLP outputs before each residual add, four norms "
                                 "per layer (Gemma 3)" + _FROM_PRESET)
    activation: Literal["silu", "gelu_tanh", "swiglu_clamped"] = _f(
        "silu", "gated MLP activation, one of silu (SwiGLU), gelu_tanh (GeGLU, Gemma) or swiglu_clamped (gpt-oss: "
                "(clip(up, -7, 7) + 1) * g * sigmoid(1.702 g) with g = min(gate, 7))" + _FROM_PRESET)
    embed_scale: bool = _f(False, "multiply the token embeddings by sqrt(d_model) (Gemma)" + _FROM_PRESET)
    query_pre_attn_scalar: float = _f(0.0, "attention scores are scaled by query_pre_attn_scalar ** -0.5; "
                                           "0: head_dim ** -0.5" + _FROM_PRESET)
    sliding_window: int = _f(0, "local attention layers see the last sliding_window keys (their own included); "
                                "0: every layer attends to the whole causal prefix" + _FROM_PRESET)
    global_every: int = _f(0, "with sliding_window: every global_every-th layer (the 6th, 12th, ... for 6) "
                              "attends globally, the others locally; 0: every layer is local" + _FROM_PRESET)
    rope_local_theta: float = _f(0.0, "RoPE base of the local (sliding-window) layers, unscaled; 0: the global layers' "
                                 "frequencies (rope_theta with rope_scaling)"
                                 + _FROM_PRESET)
    tie_embeddings: bool = _f(False, "the LM head reuses the input embedding matrix" + _FROM_PRESET)
    n_experts: int = _f(0, "mixture of experts: routed experts per layer (Qwen3-MoE, Mixtral); 0: a dense MLP"
                        + _FROM_PRESET)
    experts_per_token: int = _f(0, "mixture of experts: experts each token is routed to (top-k); needs "
                                   "n_experts" + _FROM_PRESET)
    expert_d_ff: int = _f(0, "mixture of experts: hidden width of each expert's gated MLP; 0: d_ff"
                          + _FROM_PRESET)
    router_norm_topk: bool = _f(True, "mixture of experts: renormalize the top-k routing probabilities to sum to "
                                      "1 (Mixtral always; Qwen3-MoE norm_topk_prob)" + _FROM_PRESET)
    moe_biases: bool = _f(False, "mixture of experts: biases on the router and on each expert's gate, up and down "
                                 "projections (gpt-oss)" + _FROM_PRESET)
    router_aux_loss_coef: float = _f(0.001, "mixture of experts: weight of the load-balancing loss (Switch / "
                                            "Mixtral style) added to the training loss")
    router_z_loss_coef: float = _f(0.0, "mixture of experts: weight of the router z-loss (mean squared "
                                        "logsumexp of the router logits) added to the training loss")
    moe_capacity_factor: float = _f(0.0, "mixture of experts with parallel.ep > 1: 0 is dropless (each device's "
                                         "all-to-all buffers hold the worst case, ep x its own top-k rows); c > 0 "
                                         "caps what a device sends each ep peer at c x its top-k rows / ep and "
                                         "drops the overflow (the moe_dropped metric says how much)")
    max_seq_len: int = _f(8192, "longest sequence the model takes, in tokens (train.seq_len must not exceed it)"
                          + _FROM_PRESET)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    dp: int = _f(1, "data-parallel mesh axis: batch split, weights replicated" + _FILL)
    fsdp: int = _f(-1, "FSDP mesh axis: batch split, state sharded per zero_stage" + _FILL)
    tp: int = _f(1, "tensor-parallel mesh axis: heads, MLP and vocab split (with rules fsdp_tp or dp)" + _FILL)
    sp: int = _f(1, "sequence-parallel mesh axis (Ulysses): every activation split along the sequence, "
                    "attention split along the heads (an all-to-all each way); weights sharded over it like "
                    "fsdp with rules fsdp" + _FILL)
    ep: int = _f(1, "expert-parallel mesh axis for a mixture of experts: the experts split over it (model.n_experts "
                    "/ ep per device), the tokens traded with all-to-alls; outside the experts it splits the "
                    "batch like fsdp (gradients summed, state sharded over it)")
    rules: Literal["fsdp", "fsdp_tp", "dp"] = _f(
        "fsdp", "sharding rules, one of fsdp (every weight sharded over fsdp), fsdp_tp (Megatron-style tp "
                "inside, fsdp across), dp (weights replicated; tp still applies)")
    zero_stage: Literal[1, 2, 3] = _f(3, "ZeRO stage over the fsdp axis, one of 1 (shard the optimizer state), "
                                         "2 (also the gradients), 3 (also the parameters)")
    pp: int = _f(1, "pipeline-parallel stages: the decoder layers split into pp consecutive stages, each a program "
                    "of its own on devices/pp devices (dp x fsdp x ep x sp x tp inside each stage); the micro-batches "
                    "are train.grad_accum's")
    pp_schedule: Literal["gpipe", "1f1b"] = _f(
        "1f1b", "pipeline schedule, one of gpipe (every forward, then every backward: each stage holds all "
                "micro-batches' activations) or 1f1b (stage s holds at most pp - s micro-batches)")
    pp_layers: str = _f("even", "decoder layers per stage: even, auto (the counts that minimize the largest "
                                "stage's compiled peak), or one count per stage, comma-separated (a YAML list "
                                "works too), e.g. 19,21,21,19")


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    enabled: bool = _f(False, "dynamic loss scaling, for precision.compute_dtype=float16 only; steps whose "
                              "gradients overflow are skipped")
    init_scale: float = _f(2.0**15, "loss scale at the first step")
    growth_interval: int = _f(2000, "grow the scale after this many consecutive steps without overflow")
    growth_factor: float = _f(2.0, "factor the scale grows by after growth_interval good steps")
    backoff_factor: float = _f(0.5, "factor the scale shrinks by on a step that overflows")
    min_scale: float = _f(1.0, "the scale never backs off below this")


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    param_dtype: Dtype = _f("float32", "dtype the parameters are stored in, one of float32, bfloat16, float16")
    compute_dtype: Dtype = _f("float32", "dtype of the matmuls and activations, one of float32, bfloat16, "
                                         "float16")
    master_weights: bool = _f(False, "the optimizer holds an fp32 master copy of the parameters (only when "
                                     "param_dtype is not float32)")
    grad_reduce_dtype: Dtype = _f("float32", "dtype the gradients are reduced across devices and held in until "
                                             "the update, one of float32, bfloat16, float16")
    moment_dtype: str = _choice(
        "float32", "how AdamW keeps its moments m and v (the quantized kinds are lossy: docs/optimizers.md)",
        "precision.moment_dtype", "jaxmem.optim.states")
    moment_block: int = _f(0, "values per quantization block along a tensor's last dim for quantized moments "
                              "(precision.moment_dtype); 0: the kind's default")
    stochastic_rounding: bool | None = _f(
        None, "round each update into bf16 params stochastically (unbiased: updates below half a bf16 step still "
              "move the weights on average), seeded per step from train.seed; only for param_dtype=bfloat16 "
              "without master_weights; null: on exactly there")
    loss_scale: LossScaleConfig = _f(LossScaleConfig(), "fp16 dynamic loss scaling")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: Literal["adamw", "adafactor"] = _f(
        "adamw", "the optimizer, one of adamw (AdamW; its moments' storage: precision.moment_dtype), adafactor "
                 "(optax.adafactor: factored second moment, no first moment, lr and weight_decay as AdamW's; "
                 "b1, b2 and eps unused)")
    lr: float = _f(3e-4, "peak AdamW learning rate, reached at the end of the warmup; >= 0")
    warmup_steps: int = _f(10, "steps of linear warmup from 0 to lr; >= 0")
    decay_steps: int = _f(0, "length of the warmup + cosine decay schedule in steps, >= 0; 0: train.steps "
                             "(a resume keeps the length saved in the checkpoint)")
    min_lr_ratio: float = _f(0.1, "learning rate at the end of the cosine decay, as a fraction of lr, in "
                                  "[0, 1]")
    b1: float = _f(0.9, "AdamW beta1 (decay of the first moment), in [0, 1)")
    b2: float = _f(0.95, "AdamW beta2 (decay of the second moment), in [0, 1)")
    eps: float = _f(1e-8, "AdamW epsilon (added to the denominator), > 0")
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay (norms and biases are not decayed), >= 0")
    clip_norm: float = _f(1.0, "clip the gradients to this global L2 norm; <= 0: no clipping")
    update_in_backward: bool = _f(
        False, "run each decoder layer's AdamW update inside the backward pass, right after its gradient, so "
               "the whole-model gradient never exists; clips by the previous step's global norm; needs "
               "remat.preset=full (or offload_layer_inputs: the layer inputs in pinned host memory) at layer "
               "granularity, one micro-batch per step, params on the device and no fp16 loss scaling; with offload.optimizer=host needs offload.optimizer_update=device (each "
               "layer's state is streamed from pinned host memory to the device and back)")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = _f(100, "optimizer steps of the run (a resumed run continues up to this step)")
    micro_batch: int = _f(1, "sequences per micro-batch per data-parallel way (dp x fsdp)")
    seq_len: int = _f(128, "tokens per training sequence (at most model.max_seq_len)")
    global_batch: int = _f(0, "sequences per optimizer step; 0: micro_batch x data ways x grad_accum")
    grad_accum: int = _f(0, "micro-batches accumulated per optimizer step; 0: derived from global_batch, or 1")
    log_every: int = _f(10, "write a metrics record every this many steps (and at the first and last step)")
    seed: int = _f(0, "random seed of the parameter init and of which samples the data source draws, in "
                      "[0, 2**63)")
    progress: bool = _f(True, "show a progress bar when stdout is a terminal; false (or not a terminal): print "
                              "one plain log line per metrics record")
    tensorboard: bool = _f(False, "also write TensorBoard events to out_dir/tensorboard (needs tensorboardX)")
    wandb: str = _f("", "also log to this Weights & Biases project (needs wandb; WANDB_MODE=offline keeps it "
                        "local); empty: off")
    objective: Literal["sft", "dpo", "ipo", "orpo", "simpo", "grpo"] = _f(
        "sft", "what the step minimizes, one of sft (next-token cross-entropy), dpo, ipo, orpo, simpo (preference "
               "pairs: data.format=preference, settings in the preference section), grpo (group relative policy "
               "optimization on prompts: settings in the rl section)")
    memory_profile_at: int = _f(0, "after this step, save a device memory profile (pprof) to "
                                   "out_dir/memory_profile_step<N>.prof; 0: off")


# data.kind values that read records (chat or prompt/completion documents), not a token stream
RECORD_KINDS = ("jsonl", "parquet", "hf")
# The role names chat templates render (Llama 3's ipython for tool results, OpenAI's developer); data.roles maps
# a dataset's own names (human, gpt, ...) onto them.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer", "ipython")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    kind: Literal["synthetic", "text", "bin", "jsonl", "parquet", "hf"] = _f(
        "synthetic", "token source, one of synthetic (a built-in learnable Markov chain), text (a text file, "
                     "tokenized), bin (a flat file of token ids), jsonl, parquet (records: a file, or a directory "
                     "of such files), hf (a directory written by datasets' save_to_disk); records are read "
                     "locally, never downloaded")
    path: str = _f("", "input file or directory, required for every kind but synthetic")
    bin_dtype: Literal["uint16", "uint32"] = _f("uint16", "integer type of the token ids in a kind=bin file, "
                                                          "one of uint16, uint32")
    tokenizer: str = _f("", "tokenizer.json (needs the tokenizers package); its directory's tokenizer_config.json "
                            "gives the chat template and the bos / eos tokens; required for record kinds; "
                            "empty with kind=text: one token per byte")
    format: Literal["text", "prompt_completion", "messages", "preference"] = _f(
        "text", "what a record holds, one of text (one document), prompt_completion (a prompt and its completion), "
                "messages (a chat: role / content turns, rendered with the chat template), preference (a prompt "
                "with a chosen and a rejected completion: strings, or message lists rendered with the chat "
                "template; one sequence per row, the pair's two on adjacent rows; with packing greedy or first_fit, "
                "whole pairs per row, a sequence a segment)")
    text_field: str = _f("text", "record field holding the document for format=text")
    prompt_field: str = _f("prompt", "record field holding the prompt for format=prompt_completion")
    completion_field: str = _f("completion", "record field holding the completion for format=prompt_completion")
    messages_field: str = _f("messages", "record field holding the turns for format=messages")
    chat_template: str = _f("", "a Jinja chat template file used instead of tokenizer_config.json's "
                                "chat_template")
    roles: dict | None = _f(None, "format=messages: the records' role names mapped to the template's (system, "
                                  "user, assistant, tool, developer, ipython), e.g. {human: user, gpt: assistant}; "
                                  "a role neither standard nor mapped is refused, naming the record")
    train_on: Literal["assistant", "all"] = _f(
        "assistant", "which tokens the loss trains on, one of assistant (every assistant turn with its end-of-turn "
                     "token; for prompt_completion the completion), all (every token of the document)")
    packing: Literal["none", "greedy", "first_fit"] = _f(
        "greedy", "how documents fill rows of train.seq_len tokens, one of none (one document per row, padded), "
                  "greedy (in order, a new row when the next does not fit), first_fit (longest first, each "
                  "into the first row with room); attention never crosses documents and positions restart")
    overlong: Literal["split", "drop"] = _f(
        "split", "a document longer than a row, in every packing mode, one of split (cut into row-sized pieces), "
                 "drop (left out and counted in the log)")
    cache_dir: str = _f("", "where tokenized and packed records are cached, keyed by a hash of the files and "
                            "settings; empty: ~/.cache/jaxmem/data")
    workers: int = _f(0, "processes that tokenize records; 0: one per CPU core, at most 8")
    max_prompt_len: int = _f(0, "format=preference: the prompt's token budget (a longer prompt's pair is "
                                "skipped and counted); 0: half of train.seq_len. Completions are cut from the "
                                "end to fit the row")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = _f(0, "LoRA rank: adapters on the targeted projections are trained, the base is frozen (no "
                      "gradients, no optimizer state); 0: full fine-tune")
    alpha: float = _f(16.0, "LoRA alpha: the adapters' product is scaled by alpha / rank (alpha / sqrt(rank) with "
                            "rslora)")
    rslora: bool = _f(False, "rank-stabilized LoRA: scale by alpha / sqrt(rank)")
    dropout: float = _f(0.0, "dropout on the adapters' input in training (PEFT's lora_dropout), in [0, 1): the "
                             "adapter path becomes scale * (dropout(x) A) B beside the base's x W; 0: no mask is "
                             "drawn")
    targets: str = _f("all-linear", "projections that get adapters, by Hugging Face name, comma-separated (a YAML "
                                     "list works too): q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                                     "down_proj; or all-linear. In a mixture of experts gate_proj, up_proj, "
                                     "down_proj (Mixtral: also w1, w3, w2) adapt every expert, one A, B pair per "
                                     "expert as PEFT stores them; the router is never adapted")
    base_dtype: Literal["bfloat16", "int8", "nf4"] = _f(
        "bfloat16", "how every frozen linear of the base (adapted or not) is stored, one of bfloat16, int8 (per "
                    "output channel absmax), nf4 (NormalFloat-4, blocks of 64 with fp32 scales: QLoRA); a "
                    "mixture's experts too (its small router stays at the parameter dtype)")
    double_quant: bool = _f(False, "with base_dtype=nf4, quantize the block scales too (int8 in blocks of 256)")
    quantize_embeddings: bool = _f(
        False, "store the frozen embedding table and LM head as base_dtype too (int8 or nf4, per vocab row): the "
               "embedding dequantizes the rows it gathers, the chunked loss a vocab chunk at a time; needs "
               "kernels.loss=chunked on one device")


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    beta: float = _f(0.1, "dpo / ipo / simpo: the reward scale (IPO's tau); orpo: unused (see orpo_lambda)")
    label_smoothing: float = _f(0.0, "dpo: the probability that a pair's labels are flipped (conservative DPO), "
                                     "in [0, 0.5)")
    simpo_gamma: float = _f(0.5, "simpo: the target reward margin gamma (TRL's simpo_gamma): the loss is "
                                 "-log sigmoid(beta x (chosen - rejected) - gamma)")
    length_normalize: bool = _f(True, "simpo: rewards from the mean log-prob per completion token (false: "
                                      "the sum)")
    orpo_lambda: float = _f(0.1, "orpo: the weight of the odds-ratio term beside the chosen completion's NLL")
    reference: Literal["auto", "base", "precompute", "model"] = _f(
        "auto", "where dpo / ipo take the reference policy's log-probs, one of auto (base with LoRA, precompute "
                "otherwise), base (the frozen LoRA base, adapters off: no extra weights), precompute (one pass "
                "with the initial weights before training, stored in the run folder), model (a frozen bf16 copy "
                "sharded like the params); orpo and simpo take none")
    reference_dtype: Literal["bfloat16", "int8", "nf4"] = _f(
        "bfloat16", "reference=model: how the frozen copy stores each layer's linear weights, one of bfloat16, "
                    "int8 (per channel) or nf4 (QLoRA's blocks of 64), dequantized a layer at a time in the "
                    "reference forward; norms, embedding and LM head stay bfloat16")
    reference_memory: Literal["device", "host"] = _f(
        "device", "reference=model: where the frozen copy's layers live, device or host (pinned host memory, "
                  "brought to the device a layer at a time, as offload.params=host does)")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    path: str = _f("", "held-out records of the same data.kind and data.format; empty: no evaluation")
    every: int = _f(0, "evaluate every this many steps and at the end; 0: only at the end")
    batches: int = _f(8, "global batches (train.micro_batch x data ways rows each) per evaluation")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = _f(0, "save every this many steps; 0: only at the end (and by every_minutes)")
    every_minutes: float = _f(30.0, "also save when this many minutes have passed since the last save (bounds "
                                    "the work a crash loses; multi-process runs check it at log steps); 0: off. "
                                    "SIGTERM / Ctrl-C and the final step always save")
    keep: int = _f(3, "number of most recent checkpoints kept in out_dir/checkpoints")
    async_save: bool = _f(True, "write checkpoints in the background while training goes on")
    enabled: bool = _f(True, "save to and resume from out_dir/checkpoints; false: neither")
    on_corrupt: Literal["stop", "previous"] = _f(
        "stop", "what a resume does when the latest checkpoint is damaged (a file missing or cut short, or an "
                "array that does not match the checksum saved with it), one of stop (a one-line error naming the "
                "step and the array), previous (set the damaged step aside as <step>.damaged and resume from the "
                "newest intact one, saying which)")
    init_from: str = _f("", "weights to start from: a Hugging Face directory (config.json + *.safetensors) or "
                            "a `jaxmem import-hf` output; the folder gives the model (leave the model section out; "
                            "model.* keys that are set must agree with it); a LoRA run reads and quantizes its "
                            "base a layer at a time; a checkpoint in out_dir to resume from wins")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator: str = _f("", "HOST:PORT of process 0 for a multi-process run; empty: one process, or SLURM "
                              "when auto is true")
    num_processes: int = _f(0, "number of processes (required with coordinator)")
    process_id: int = _f(-1, "this process's id in [0, num_processes) (required with coordinator)")
    auto: bool = _f(True, "join the process group from the SLURM variables when no coordinator is given")


@dataclasses.dataclass(frozen=True)
class RematConfig:
    preset: str = _f("none", "activation checkpointing preset (`jaxmem list remat` says what each keeps), one "
                             "of none, full, selective, dots, dots_no_batch, save_qkv_proj, save_attn_out, "
                             "offload_layer_inputs, offload_selective, alternate_matmuls")
    granularity: Literal["layer", "segments", "every_k", "nested"] = _f(
        "layer", "what one checkpoint wraps, one of layer (each decoder layer), segments (the attention and "
                 "MLP parts of each layer), every_k (groups of every_k layers), nested (groups of the largest "
                 "divisor of n_layers up to sqrt(n_layers) layers: a group keeps only its input, each layer "
                 "inside is checkpointed with the preset)")
    every_k: int = _f(1, "layers per checkpointed group with granularity=every_k (must divide model.n_layers)")
    seq_tile: int = _f(0, "sequence tiling: the per-token parts of each layer (norms, q/k/v projections and "
                          "RoPE, the output projection, the MLP; a mixture of experts' router and experts, each "
                          "tile routing its own tokens) and the final norm run over tiles of this many tokens per "
                          "device, each tile recomputed in the backward, so no [seq, d_ff] (or routed-rows) "
                          "intermediate exists at once; must divide seq_len / sp; 0: off")
    names: dict = _f(None, "per checkpoint name (`jaxmem list remat`), one of remat (recompute), device (keep), "
                           "offload (keep on the host); each entry overrides the preset for that name and the "
                           "other names keep the preset's choice (with preset none, any entry turns "
                           "checkpointing on and the unlisted names are recomputed)", factory=dict)


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    optimizer: Literal["device", "host"] = _f("device", "where the optimizer state (AdamW moments, master "
                                                        "weights) lives between steps, one of device, host "
                                                        "(pinned host memory)")
    optimizer_update: Literal["host", "device"] = _f(
        "host", "with optimizer=host, where the AdamW update runs, one of host (XLA host compute: the "
                "leanest on the GPU, but slow: about 5.4 s per billion trained params per step on one H200 "
                "machine's host, 13.17 s against 1.21 s streamed for a 2.35B-param step, measured; the plan's "
                "cost model prices it), device (the state is streamed in and out over the host link, a layer at "
                "a time, the embedding and LM head whole)")
    params: Literal["device", "host"] = _f(
        "device", "where the parameters live, one of device, host (each layer's weights are fetched inside "
                  "the layer scan; needs a remat preset other than none, remat.granularity=layer and "
                  "grad_accum 1)")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    loss: Literal["auto", "naive", "chunked", "pallas"] = _f(
        "auto", "LM head + cross-entropy implementation, one of auto (chunked), naive (full logits), chunked, "
                "pallas (Pallas logsumexp forward, chunked backward)")
    attention: Literal["auto", "xla", "pallas", "cudnn"] = _f(
        "auto", "attention implementation, one of auto (cudnn on NVIDIA GPUs where the cuDNN library loads, "
                "else pallas; xla on CPU), xla (plain, keeps the "
                "S x S scores), pallas (flash attention), cudnn (GPU only)")
    norm: Literal["auto", "xla", "pallas"] = _f("auto", "RMSNorm implementation, one of auto (xla), xla, pallas")
    grouped_matmul: Literal["auto", "ragged_dot", "blocked", "pallas"] = _f(
        "auto", "MoE expert matmul implementation, one of auto (pallas in a one-GPU program, else blocked), "
                "ragged_dot (jax.lax.ragged_dot: XLA:GPU densifies it, G x the FLOPs and a [rows, G x D] lhs), "
                "blocked (groups padded to whole blocks, a loop over chunks of blocks; no dense lhs), pallas "
                "(Triton grouped GEMM over the same blocks)")
    host_update: Literal["auto", "xla", "fused"] = _f(
        "auto", "the AdamW update on the host (offload.optimizer_update=host), one of auto (fused in a one-device "
                "CPU program where the kernel builds and covers the state, else xla), xla (XLA:CPU code under "
                "host compute: a loop per output), fused (one pass per tensor in C++ through XLA's FFI, built "
                "with the machine's C++ compiler on first use; CPU or GPU programs, over several devices on each "
                "device's shard (on a GPU it runs in the step's host computation, registered with the CUDA "
                "plugin; compiled for GPUs, not yet measured on one); fp32, int8 or int4 moments, fp32 master, "
                "bf16 params)")
    grouped_matmul_block_rows: int = _f(128, "blocked and pallas grouped matmul: rows per block (each expert's "
                                             "rows are padded to a multiple)" + _POW2)
    loss_block_t: int = _f(0, "chunked loss: tokens per tile; 0: by shape (all local tokens, up to "
                              "8192 x 2048 / loss_block_v)")
    loss_block_v: int = _f(0, "chunked loss: vocab columns per tile; 0: by shape (2048)")
    fused_loss_block_t: int = _f(256, "pallas loss: tokens per tile" + _POW2)
    fused_loss_block_v: int = _f(128, "pallas loss: vocab columns per tile" + _POW2)
    fused_loss_block_d: int = _f(64, "pallas loss: hidden columns per inner matmul step" + _POW2)
    attn_block_q: int = _f(64, "pallas flash attention: query rows per block" + _POW2)
    attn_block_k: int = _f(64, "pallas flash attention: key rows per block" + _POW2)
    z_loss: float = _f(0.0, "z-loss coefficient: adds z_loss x logsumexp^2 per token to the loss; 0: off")


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    name: str = _f("", "GPU that plan, explain and sweep compile for deviceless (`jaxmem list targets`); "
                       "empty: the attached devices")
    gpus_per_host: int = _f(0, "GPUs per host; 0: the mesh size / hosts")
    hosts: int = _f(1, "number of hosts (nodes)")
    headroom: float = _f(0.10, "fraction of device memory held back: a plan fits under capacity x "
                               "(1 - headroom), in [0, 1)")
    host_ram_gb: float = _f(0.0, "host RAM per node in GiB, for the host-offload fit; 0: the target's "
                                 "default")


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    batch: int = _f(0, "prompts generated at once, for `jaxmem plan` of generation (the KV cache and the decode "
                       "program's peak); 0: not planned")
    prompt_len: int = _f(512, "the longest prompt's tokens (rounded up to a power-of-two bucket, at least 16)")
    max_new_tokens: int = _f(512, "new tokens per prompt at most (rounded up to a bucket like prompt_len)")
    cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "int8"] = _f(
        "auto", "the KV cache's dtype, one of auto (precision.compute_dtype), float32, bfloat16, float16, int8 "
                "(per token and head scales)")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    prompts: str = _f("", "train.objective=grpo: a jsonl file of prompts, each record a prompt (text) or messages (a "
                          "chat, through data.tokenizer's chat template); its other fields go to the rewards")
    rewards: str = _f("", "comma-separated reward functions, each module:function or path.py:function called as "
                          "f(prompts, completions, **fields) -> one float per completion (TRL's convention)")
    reward_weights: str = _f("", "comma-separated weights, one per reward function; empty: all 1")
    group_size: int = _f(4, "completions generated per prompt (a group); advantages are normalized within it")
    prompts_per_step: int = _f(2, "prompts per rollout; the rollout generates prompts_per_step x group_size "
                                  "completions")
    generation_batch: int = _f(0, "completions decoded at once in a rollout (the KV cache's rows; the rollout runs "
                                  "the decode loop on its completions in chunks of this many); 0: all at once. "
                                  "The cache's dtype is generate.cache_dtype")
    max_prompt_len: int = _f(64, "a prompt's token budget (a longer prompt is refused in one line)")
    max_completion_len: int = _f(32, "new tokens per completion at most")
    temperature: float = _f(1.0, "sampling temperature of the rollout (> 0)")
    top_p: float = _f(1.0, "nucleus sampling of the rollout; 1.0: off")
    top_k: int = _f(0, "top-k sampling of the rollout; 0: off")
    beta: float = _f(0.0, "weight of the KL to the reference (the base with adapters off for LoRA, a frozen bf16 "
                          "copy of the initial weights for a full fine-tune); 0: no reference is computed or "
                          "allocated")
    epsilon_low: float = _f(0.2, "the importance ratio's lower clip: 1 - epsilon_low")
    epsilon_high: float = _f(0.2, "the importance ratio's upper clip: 1 + epsilon_high (DAPO: 0.28); with "
                                  "loss_type cispo, the ratio's cap itself")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"] = _f(
        "dapo", "the loss, as TRL's GRPOTrainer names it: grpo (clipped ratio; per sequence mean, then the mean), "
                "dr_grpo (sum over completions x max_completion_len), dapo (per token over the rollout), bnpo (per "
                "token over each micro-batch, then the mean), cispo (the capped ratio, without gradient, times the "
                "advantage and the log-prob; per token over the rollout), sapo (a sigmoid gate of the ratio "
                "instead of the clip, rl.sapo_temperature_*; per sequence mean, then the mean), luspo (the "
                "clipped ratio; each sequence's sum, then the mean; its paper pairs it with "
                "rl.importance_sampling_level=sequence), vespo (a gamma weight of the sequence's ratio, "
                "rl.vespo_*, times the advantage and the log-prob; per token over the rollout)")
    importance_sampling_level: Literal["token", "sequence"] = _f(
        "token", "token: the importance ratio per token (TRL's default); sequence: one per completion, exp of the "
                 "mean log-ratio over its tokens (GSPO)")
    vespo_k_pos: float = _f(2.0, "loss_type vespo: the gamma weight's k where the advantage is >= 0")
    vespo_lambda_pos: float = _f(3.0, "loss_type vespo: the gamma weight's lambda where the advantage is >= 0")
    vespo_k_neg: float = _f(3.0, "loss_type vespo: the gamma weight's k where the advantage is < 0")
    vespo_lambda_neg: float = _f(2.0, "loss_type vespo: the gamma weight's lambda where the advantage is < 0")
    sapo_temperature_pos: float = _f(1.0, "loss_type sapo: the gate's temperature where the advantage is > 0")
    sapo_temperature_neg: float = _f(1.05, "loss_type sapo: the gate's temperature where the advantage is <= 0")
    updates_per_rollout: int = _f(1, "optimizer steps on each rollout (TRL's num_iterations), with the importance "
                                     "ratio to the rollout's log-probs")
    samples_every: int = _f(0, "write a few prompts with their completions and rewards to out_dir/samples.jsonl "
                               "every this many rollouts; 0: never")

    @property
    def completions(self) -> int:
        """Completions a rollout generates and trains on: prompts_per_step x group_size."""
        return self.prompts_per_step * self.group_size

    @property
    def rollout_rows(self) -> int:
        """Completions decoded at once: generation_batch, or all of them."""
        return self.generation_batch or self.completions


@dataclasses.dataclass(frozen=True)
class Config:
    out_dir: str = _f("runs/default", "run folder: config.yaml, metrics.jsonl, checkpoints/ (a run there resumes)")
    model: ModelConfig = _f(ModelConfig(), "model shape")
    parallel: ParallelConfig = _f(ParallelConfig(), "device mesh and sharding")
    precision: PrecisionConfig = _f(PrecisionConfig(), "dtypes and fp16 loss scaling")
    optimizer: OptimizerConfig = _f(OptimizerConfig(), "the optimizer (AdamW or Adafactor) with warmup and cosine "
                                                       "decay")
    train: TrainConfig = _f(TrainConfig(), "steps, batch and logging")
    data: DataConfig = _f(DataConfig(), "token source")
    eval: EvalConfig = _f(EvalConfig(), "held-out loss and perplexity during training")
    lora: LoraConfig = _f(LoraConfig(), "LoRA / QLoRA adapters on a frozen (optionally quantized) base")
    preference: PreferenceConfig = _f(PreferenceConfig(), "preference tuning (train.objective dpo, ipo, orpo, "
                                                          "simpo): the loss's settings and the reference")
    checkpoint: CheckpointConfig = _f(CheckpointConfig(), "run checkpoints (save, resume, init_from)")
    distributed: DistributedConfig = _f(DistributedConfig(), "multi-process (multi-host) runs")
    remat: RematConfig = _f(RematConfig(), "activation checkpointing (rematerialization)")
    offload: OffloadConfig = _f(OffloadConfig(), "host memory for optimizer state and parameters; a fresh state's "
                                  "host parts are built a layer at a time (jaxmem.core.host_init), so init "
                                  "holds one layer's worth on the device")
    kernels: KernelConfig = _f(KernelConfig(), "fused kernel choices and tile sizes")
    target: TargetConfig = _f(TargetConfig(), "the GPU target a plan compiles for and its fit rule")
    generate: GenerateConfig = _f(GenerateConfig(), "generation with the run's model, as `jaxmem plan` sizes it")
    rl: RLConfig = _f(RLConfig(), "reinforcement learning from rewards (train.objective=grpo)")


def field_docs(cls: type = None, prefix: str = ""):
    """(dotted key, dataclasses.Field, description) for every config key, in declaration order; a section
    (a nested dataclass such as `precision.loss_scale`) comes before its keys."""
    cls = Config if cls is None else cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        text = f.metadata.get("help", "")
        if "choices" in f.metadata:
            values = registered_choices(f.metadata["choices"], f.metadata["owner"]).values()
            text += ", one of " + ", ".join(values)
        yield key, f, text
        if dataclasses.is_dataclass(hints[f.name]):
            yield from field_docs(hints[f.name], key + ".")



# ---------------------------------------------------------------- building


def _allowed(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _number(value: Any, tp: type, key: str):
    """An int (whole floats and digit strings accepted) or a float (ints and numeric strings accepted)."""
    what = "an int" if tp is int else "a number"
    if isinstance(value, bool):
        raise ConfigError(f"{key}: {value!r} is not {what}")
    if isinstance(value, int) or (isinstance(value, float) and (tp is float or value.is_integer())):
        return tp(value)
    if isinstance(value, str):
        try:
            return tp(value)
        except ValueError:
            pass
    raise ConfigError(f"{key}: {value!r} is not {what}")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        for c in choices:
            if value == c and type(value) is type(c):
                return c
            if isinstance(c, int) and isinstance(value, str) and value.lstrip("-").isdigit() and int(value) == c:
                return c
        raise ConfigError(f"{key}: {value!r} is not allowed; use {_allowed(tp)}")
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or value == "null":
            return None
        return _coerce(value, args[0], key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}: {value!r} is not a bool; use true or false")
    if tp in (int, float):
        return _number(value, tp, key)
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, list) and all(isinstance(v, str) for v in value):  # a YAML list of names
            return ",".join(value)
        raise ConfigError(f"{key}: {value!r} is not a string")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"{key}: {value!r} is not a mapping")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {', '.join(f.name for f in dataclasses.fields(tp))}")
        return _build(tp, value, key + ".")
    raise ConfigError(f"{key}: unsupported type {tp}")


def _build(cls, raw: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in raw:
        if k not in names:
            raise ConfigError(f"{prefix}{k}: unknown key; allowed keys are {', '.join(sorted(names))}")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in raw.items()}
    for f in dataclasses.fields(cls):
        if "choices" in f.metadata and f.name in kwargs:
            check_choice(f.metadata["choices"], kwargs[f.name], f.metadata["owner"])
    return cls(**kwargs)


def _to_raw(obj) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_raw(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: _to_raw(v) for k, v in obj.items()}
    return obj


def to_dict(cfg: Config) -> dict:
    return _to_raw(cfg)


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_ConfigLoader)
    except yaml.YAMLError:
        return text


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {p} is not a section")
        node = child
    node[parts[-1]] = value


def _plain_copy(value: Any, key: str = "") -> Any:
    """A deep copy of YAML data made of mappings, lists, strings, numbers, bools and nulls (aliases written
    out); any other value (!!binary bytes, a !!set) is a one-line ConfigError naming its key."""
    if isinstance(value, dict):
        return {(k if isinstance(k, str) else json.dumps(k)): _plain_copy(v, f"{key}.{k}" if key else str(k))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_copy(v, key) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise ConfigError(f"{key or 'config'}: {value!r} is not a string, number, bool, list or mapping; quote it")


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    raw = _plain_copy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. train.steps=10")
        key, text = item.split("=", 1)
        if not text.strip():
            raise ConfigError(f"{key.strip()}: empty value in the override {item!r}; give a value "
                              f"({key.strip()}=VALUE), or an empty string quoted for YAML and the shell "
                              f"({key.strip()}='\"\"')")
        _set_dotted(raw, key.strip(), _parse_scalar(text))
    return raw


# A config's content once its aliases are expanded (nodes plus scalar characters): far above any real config,
# far below what a "billion laughs" file of nested aliases expands to when the overrides copy the mapping.
EXPANDED_LIMIT = 1_000_000


class _Unbounded(yaml.YAMLError):
    """A document whose aliases expand beyond EXPANDED_LIMIT, or refer to themselves."""


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """Nodes plus scalar characters of `node` with every alias written out (an aliased node counts each time)."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        raise _Unbounded("an alias refers to a node that contains it")
    if isinstance(node, yaml.ScalarNode):
        size = 1 + len(node.value)
    else:
        open_nodes.add(id(node))
        children = node.value if isinstance(node, yaml.SequenceNode) else [n for pair in node.value for n in pair]
        size = 1 + sum(_expanded_size(child, sizes, open_nodes) for child in children)
        open_nodes.discard(id(node))
    if size > EXPANDED_LIMIT:
        raise _Unbounded(f"its aliases (*name) expand to more than {EXPANDED_LIMIT:,} nodes and characters")
    sizes[id(node)] = size
    return size


class _ConfigLoader(yaml.SafeLoader):
    """SafeLoader that refuses a repeated key (YAML keeps the last one, silently dropping a whole section) and a
    document whose aliases expand beyond EXPANDED_LIMIT (checked on the composed nodes, before any copy)."""

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            _expanded_size(node, {}, set())
        return node

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key_node.value!r} appears twice",
                                                        key_node.start_mark)
            seen.add(key_node.value)
        return super().construct_mapping(node, deep)

    def construct_timestamp_text(self, node):
        """A date or time (`out_dir: 2026-11-29`) stays the text written: no config key holds a timestamp, and a
        date object is neither a string nor JSON."""
        return self.construct_scalar(node)


_ConfigLoader.add_constructor("tag:yaml.org,2002:timestamp", _ConfigLoader.construct_timestamp_text)


def parse_yaml_file(path: Path) -> Any:
    """A YAML file's content; bad bytes or syntax are a one-line ConfigError naming the file."""
    try:
        return yaml.load(path.read_bytes(), Loader=_ConfigLoader)  # bytes: YAML detects UTF-8/UTF-16 itself
    except _Unbounded as e:
        raise ConfigError(f"{path}: refused, {e}; write the values out") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to read; a config is a few levels of sections") from None
    except yaml.reader.ReaderError as e:
        raise ConfigError(f"{path}: binary content ({e.reason} at byte {e.position}); "
                          "a config is a UTF-8 YAML file") from None
    except yaml.MarkedYAMLError as e:
        where = f"line {e.problem_mark.line + 1}: " if e.problem_mark else ""
        raise ConfigError(f"{path}: not valid YAML ({where}{e.problem or e.context})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None


def read_yaml(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    raw = parse_yaml_file(path)
    if raw is None:  # an empty file (or only comments) is more likely a mistake than a wish for the defaults
        raise ConfigError(f"{path}: empty config; expected a mapping of sections such as model: and train:")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    base = raw.pop("base", None)
    if base is not None:  # a config may extend another one, relative to itself
        raw = _merge(_read_base(path, base, _chain), raw)
    return raw


def _read_base(path: Path, base: Any, chain: tuple[Path, ...]) -> dict:
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base must be the path of another config file, got {base!r}")
    parent = path.parent / base
    if not parent.is_file():
        raise ConfigError(f"{path}: base {base} not found (looked for {parent})")
    chain = (*chain, path.resolve())
    if parent.resolve() in chain:
        raise ConfigError(f"{path}: base {base} leads back to {parent} (a cycle of base: files)")
    return read_yaml(parent, chain)


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_raw(raw: dict) -> Config:
    """The typed Config of a raw mapping: unknown keys and wrong types are refused here; `model.*` is not yet
    filled from its preset and no cross-key rule has run (jaxmem.config.validate.from_dict does both)."""
    return _build(Config, raw)


def config_hash(cfg: Config, extra: str = "") -> str:
    text = json.dumps(to_dict(cfg), sort_keys=True) + extra
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def dump_yaml(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
