"""pretrain.py's configuration: one typed dataclass, Megatron-LM flag names, YAML files.

Precedence: dataclass defaults < the model preset (model shape fields) < --config FILE.yaml <
flags given on the command line. The kernels' switches (--kernel-backend, --kernel-ws,
--kernel-ws-split, --kernel-ws-large, --debug-nonfinite, --debug-nonfinite-dir) default to
None, "not set": their FORGE_* environment variable decides then (forge_engine/kernels/
options.py), so for them flag > --config > environment > the kernels' default, and
apply_kernel_switches hands the set ones to the kernels before any work. Every field's `help`
is its documentation and its --help text. Unknown YAML keys, wrong types, bad values (the
environment's FORGE_* variables included) and impossible combinations are rejected with one
line (a ConfigError) before any work starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field

OPTIMIZERS = ("adamw", "nadam", "radam", "lion", "rmsprop", "adagrad", "sgd")
# the fields that set a kernel switch -> the switch (a field of kernels.options.Options)
KERNEL_SWITCHES = {"kernel_backend": "backend", "kernel_ws": "ws", "kernel_ws_split": "ws_split",
                   "kernel_ws_large": "ws_large", "debug_nonfinite": "debug_nonfinite",
                   "debug_nonfinite_dir": "debug_dir"}


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line for the user."""


def _f(default, help, flag=None, aliases=(), choices=None, model=False):
    return field(default=default, metadata=dict(help=help, flag=flag, aliases=tuple(aliases),
                                                choices=choices, model=model))


@dataclass
class TrainConfig:
    # ---- model (None: take the preset's value)
    model: str = _f("tiny", "model preset: tiny, qwen3-0.6b/1.7b/4b/8b/14b/32b, llama3.1-8b")
    hf_checkpoint: str | None = _f(None, "Hugging Face model directory (config.json + "
                                         "safetensors): model shape and initial weights from "
                                         "it instead of --model; shape flags must agree")
    num_layers: int | None = _f(None, "transformer layers (default: the preset's)", model=True)
    hidden_size: int | None = _f(None, "hidden size (default: the preset's)", model=True)
    ffn_hidden_size: int | None = _f(None, "SwiGLU inner size (default: the preset's)",
                                     model=True)
    num_attention_heads: int | None = _f(None, "attention heads (default: the preset's)",
                                         model=True)
    num_query_groups: int | None = _f(None, "KV heads for GQA (default: the preset's)",
                                      model=True)
    seq_length: int | None = _f(None, "tokens per sample (default: the preset's)", model=True)
    untie_embeddings_and_output_weights: bool = _f(
        False, "separate LM-head and embedding weights (presets that untie them set this)")
    recompute_activations: bool = _f(False, "recompute each transformer layer in backward")
    bf16: bool = _f(False, "bf16 weights (FORGE: stochastic rounding; states bf16 by default)")
    fp16: bool = _f(False, "Megatron's loss-scaled fp16: refused, use --bf16 (see the message)")
    use_cpu_initialization: bool = _f(False, "draw the initial weights on the CPU (identical "
                                             "on any machine; slow for 8B+) instead of the GPU")
    vocab_size: int | None = _f(None, "vocabulary of --mock-data (default: the preset's)")
    # ---- parallelism
    tensor_model_parallel_size: int = _f(1, "tensor-parallel size (divides heads, KV heads, "
                                            "FFN, vocab)", aliases=("--tensor-parallel",))
    sequence_parallel: bool = _f(False, "shard activations between TP layers along the sequence")
    # ---- optimization
    optimizer: str = _f("adamw", "element-wise optimizer", choices=OPTIMIZERS)
    state_dtype: str | None = _f(None, "optimizer-state format: fp32 / bf16 / int8 (default: "
                                       "fp32 for fp32 weights, bf16 for bf16)",
                                 choices=("fp32", "bf16", "int8"))
    no_forge: bool = _f(False, "baseline: torch.optim on materialized gradients")
    main_params_dtype: str | None = _f(
        None, "--no-forge --bf16 only: fp32 keeps fp32 master copies of the bf16 weights and "
              "fp32 optimizer states (Megatron's mixed precision: each update is applied to "
              "the copy, which is rounded to nearest into the weight); default: torch.optim "
              "steps the bf16 weights themselves", choices=("fp32",))
    micro_batch_size: int = _f(1, "samples per micro-batch")
    global_batch_size: int | None = _f(None, "samples per step (default: micro batch size)")
    train_iters: int = _f(100, "training iterations")
    lr: float = _f(3e-4, "peak learning rate")
    min_lr: float = _f(0.0, "learning rate at the end of decay")
    lr_warmup_iters: int = _f(0, "linear warmup iterations")
    lr_decay_iters: int | None = _f(None, "decay iterations (default: --train-iters)")
    lr_decay_style: str = _f("cosine", "decay after warmup",
                             choices=("constant", "linear", "cosine"))
    weight_decay: float = _f(0.01, "decoupled weight decay (AdamW, Lion) or L2 (others)")
    adam_beta1: float = _f(0.9, "beta1 (Adam family, Lion)")
    adam_beta2: float = _f(0.999, "beta2 (Adam family, Lion)")
    adam_eps: float = _f(1e-8, "epsilon (Adam family, RMSprop, Adagrad)")
    sgd_momentum: float = _f(0.9, "momentum of SGD and RMSprop")
    clip_grad: float = _f(
        0.0, "global gradient-norm clipping; default 0 = off, unlike Megatron's 1.0: with "
             "FORGE it is exact but not free: every update waits for the end of backward, "
             "keeping each layer's token segments (its input and output gradient, "
             "activation-sized) alive until then, plus one norm-only kernel pass per weight")
    seed: int = _f(1234, "seed of initialization, data order and rounding")
    enable_cuda_graph: bool = _f(
        False, "capture the whole training step (forward, backward with the fused updates, "
               "optimizer step) as one CUDA graph and replay it: the step no longer waits for "
               "Python's launches. One GPU, one micro-batch per step")
    cuda_graph_warmup_steps: int = _f(3, "eager steps before the step is captured "
                                         "(--enable-cuda-graph)")
    # ---- kernels (None: the FORGE_* variable decides, then the kernels' default)
    kernel_backend: str | None = _f(
        None, "the fused update's backend: triton (the Triton kernel; without CUDA it needs "
              "TRITON_INTERPRET=1) or torch (the tiled torch implementation); default: "
              "FORGE_BACKEND, else Triton on CUDA and torch on CPU",
        choices=("triton", "torch"))
    kernel_ws: str | None = _f(
        None, "which updates take the warp-specialized Gluon kernel (Hopper; bf16 weights): "
              "auto (its split design above 1024 tokens), 1 (every update it can take), 0 "
              "(none); default: FORGE_WS, else auto", choices=("auto", "0", "1"))
    kernel_ws_split: str | None = _f(
        None, "under --kernel-ws auto, which updates of at most 1024 tokens take the split "
              "design: auto and 1 (all, eager and graphed), 0 (none: the Triton kernel); default: "
              "FORGE_WS_SPLIT, else auto", choices=("auto", "0", "1"))
    kernel_ws_large: str | None = _f(
        None, "for experiments: a JSON object of the split design's config above 1024 tokens "
              "under --kernel-ws auto ('{}': its default config); default: FORGE_WS_LARGE")
    debug_nonfinite: bool | None = _f(
        None, "examine a step whose gradient norm is not finite weight by weight (were the "
              "inputs finite, what the kernel gives run again); keeps each update's inputs "
              "until the step ends; default: FORGE_DEBUG_NONFINITE=1, else off")
    debug_nonfinite_dir: str | None = _f(
        None, "with --debug-nonfinite: save the examined updates' inputs in this directory; "
              "default: FORGE_DEBUG_DIR")
    # ---- data
    data_path: str | None = _f(None, "prefix of a Megatron indexed dataset (PREFIX.bin/.idx)")
    mock_data: bool = _f(False, "deterministic synthetic tokens from --seed (no files)")
    split: str = _f("969,30,1", "train,valid,test weights of the documents")
    sft: bool = _f(False, "supervised fine-tuning: --data-path PREFIX is what "
                          "tools/preprocess_data.py --sft wrote (tokens and loss mask); samples "
                          "are packed into rows, the loss is the mean over the counted tokens")
    sft_overlong: str | None = _f(None, "--sft: samples longer than --seq-length + 1 tokens are "
                                        "cut to it (truncate) or left out (drop); no default: "
                                        "such a sample without it is an error",
                                  choices=("truncate", "drop"))
    tokenizer_type: str | None = _f(None, "SentencePieceTokenizer (with --tokenizer-model) or "
                                          "NullTokenizer (default with --hf-checkpoint: "
                                          "HuggingFaceTokenizer of its directory)")
    tokenizer_model: str | None = _f(None, "sentencepiece .model file, or a Hugging Face "
                                           "directory (HuggingFaceTokenizer: tokenizer.json)")
    # ---- checkpoints, evaluation, logging
    save: str | None = _f(None, "directory to save checkpoints to")
    load: str | None = _f(None, "directory to resume from (its latest checkpoint); the same "
                                "directory as --save starts from scratch while it holds none")
    ckpt_step: int | None = _f(None, "--load this iteration, not the one the tracker names")
    finetune: bool = _f(False, "--load the model weights only: iteration 0, a fresh optimizer, "
                               "the data from its start, the RNG not restored")
    no_load_optim: bool = _f(False, "--load without the optimizer state (a fresh optimizer)")
    no_load_rng: bool = _f(False, "--load without the RNG states")
    save_interval: int | None = _f(None, "save every N iterations (and at the end); 0: only at "
                                         "the end")
    eval_interval: int = _f(1000, "validate every N iterations; 0: never")
    eval_iters: int = _f(10, "validation micro-batches per evaluation")
    tensorboard_dir: str | None = _f(None, "write TensorBoard events here (rank 0)")
    log_interval: int = _f(10, "print a log line every N iterations")
    exit_interval: int | None = _f(None, "stop after the iteration that is a multiple of N; "
                                         "0: never")
    config: str | None = _f(None, "YAML file of these fields (flags override it)")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            choices = f.metadata.get("choices")
            if choices and v is not None and v not in choices:
                raise ConfigError(f"--{flag_name(f)} must be one of {', '.join(choices)}; got "
                                  f"{v!r}")
        positive = ("micro_batch_size", "train_iters", "tensor_model_parallel_size",
                    "log_interval")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got "
                                  f"{getattr(self, name)}")
        for name in ("global_batch_size", "lr_decay_iters",
                     "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "seq_length", "vocab_size"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive, got {v}")
        for name in ("eval_iters", "lr_warmup_iters", "eval_interval", "save_interval",
                     "exit_interval", "ckpt_step"):  # 0 of an interval: never (Megatron's)
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {v}")
        if self.fp16:
            raise ConfigError(
                "--fp16 is not supported: its loss scale must skip a step that overflows as a "
                "whole, and FORGE has applied each weight's update inside backward by then; use "
                "--bf16 (the same range as fp32, no loss scale needed)")
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.lr})")
        if self.clip_grad < 0:
            raise ConfigError(f"--clip-grad must be >= 0, got {self.clip_grad}")
        if self.cuda_graph_warmup_steps < 1:
            raise ConfigError(f"--cuda-graph-warmup-steps must be >= 1 (the eager steps compile "
                              f"the kernels and create the optimizer state), got "
                              f"{self.cuda_graph_warmup_steps}")
        if self.no_forge and self.state_dtype not in (None, "fp32"):
            raise ConfigError(f"--state-dtype {self.state_dtype} is a FORGE option; --no-forge "
                              f"keeps torch.optim's own states")
        if self.main_params_dtype is not None:
            if not self.no_forge:
                raise ConfigError("--main-params-dtype fp32 is the --no-forge baseline's master "
                                  "copy; FORGE keeps none (bf16 weights with stochastic "
                                  "rounding)")
            if not self.bf16:
                raise ConfigError("--main-params-dtype fp32 keeps fp32 copies of bf16 weights; "
                                  "add --bf16 (without it the weights are fp32 already)")
            if self.optimizer == "lion":
                raise ConfigError("--main-params-dtype fp32 wraps torch.optim, which has no "
                                  "Lion")
            if self.enable_cuda_graph:
                raise ConfigError("--main-params-dtype fp32 is not captured by "
                                  "--enable-cuda-graph; leave one of them out")
        if self.sft and self.mock_data:
            raise ConfigError("--sft trains on --data-path PREFIX (written by "
                              "tools/preprocess_data.py --sft), not on --mock-data")
        if self.sft_overlong is not None and not self.sft:
            raise ConfigError("--sft-overlong applies to --sft data")
        if self.sft and self.enable_cuda_graph:
            raise ConfigError("--enable-cuda-graph captures the pretraining loss; --sft's "
                              "packed rows and masked loss are not captured: leave one out")
        if self.data_path is not None and self.tokenizer_type is None and \
                self.hf_checkpoint is not None and \
                os.path.isfile(os.path.join(self.hf_checkpoint, "tokenizer.json")):
            self.tokenizer_type = "HuggingFaceTokenizer"  # the checkpoint's own tokenizer
            self.tokenizer_model = self.tokenizer_model or self.hf_checkpoint
        if self.mock_data == (self.data_path is not None):
            raise ConfigError("give exactly one of --data-path PREFIX and --mock-data")
        if self.data_path is not None and self.tokenizer_type is None:
            raise ConfigError("--data-path needs --tokenizer-type (and --tokenizer-model for "
                              "SentencePieceTokenizer) to know the vocabulary")
        if self.lr_warmup_iters > (self.lr_decay_iters or self.train_iters):
            raise ConfigError("--lr-warmup-iters is longer than the decay (--lr-decay-iters or "
                              "--train-iters)")
        if self.save_interval is not None and self.save is None:
            raise ConfigError("--save-interval needs --save DIR")
        for name in ("ckpt_step", "finetune", "no_load_optim", "no_load_rng"):
            if getattr(self, name) not in (None, False) and not self.load:
                raise ConfigError(f"--{name.replace('_', '-')} needs --load DIR")
        if self.load is not None and not os.path.isdir(self.load):
            if os.path.exists(self.load):
                raise ConfigError(f"--load {self.load}: not a directory")
            if not self.load_is_save():  # a typo must not start a run from scratch
                raise ConfigError(f"--load {self.load}: no such directory (a first launch that "
                                  f"resumes later passes the same directory as --save)")
        if self.hf_checkpoint is not None and not os.path.isdir(self.hf_checkpoint):
            raise ConfigError(f"--hf-checkpoint {self.hf_checkpoint}: no such directory")
        if self.config is not None and not os.path.isfile(self.config):
            raise ConfigError(f"--config {self.config}: no such file")
        self._check_kernel_ws_large()

    def _check_kernel_ws_large(self):
        if self.kernel_ws_large is None:
            return
        try:
            ws_large = json.loads(self.kernel_ws_large)
        except ValueError as e:
            raise ConfigError(f"--kernel-ws-large must be a JSON object, got "
                              f"{self.kernel_ws_large!r} ({e})") from None
        if not isinstance(ws_large, dict):
            raise ConfigError(f"--kernel-ws-large must be a JSON object, got "
                              f"{self.kernel_ws_large!r}")

    def load_is_save(self) -> bool:
        """--load names the --save directory: Megatron's `--save ck --load ck`, which starts
        from scratch while nothing is saved there and resumes once something is."""
        return bool(self.load and self.save) and \
            os.path.realpath(self.load) == os.path.realpath(self.save)

    def model_overrides(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.metadata.get("model") and getattr(self, f.name) is not None}
        if self.untie_embeddings_and_output_weights:
            out["untie_embeddings_and_output_weights"] = True
        if self.recompute_activations:
            out["recompute_activations"] = True
        return out


    def kernel_switches(self) -> dict:
        """The kernel switches this configuration sets, as kernels.options.Options fields and
        values; the ones it leaves unset are not named (their environment variable decides)."""
        out = {}
        for name, switch in KERNEL_SWITCHES.items():
            v = getattr(self, name)
            if v is not None:
                out[switch] = json.loads(v) if switch == "ws_large" else v
        return out


def apply_kernel_switches(cfg: TrainConfig):
    """Hand cfg's kernel switches to the kernels of this process, above the FORGE_*
    environment (kernels.options.apply), and check every switch before any work: a bad
    variable in the environment, or the Triton backend on a machine without CUDA and without
    its interpreter, is a ConfigError."""
    import torch

    from forge_engine.kernels import options
    try:
        now = options.apply(cfg.kernel_switches())
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if now.backend == "triton" and not torch.cuda.is_available() \
            and os.environ.get("TRITON_INTERPRET") != "1":
        where = "--kernel-backend triton" if cfg.kernel_backend else "FORGE_BACKEND=triton"
        raise ConfigError(f"{where} without CUDA needs the Triton interpreter: "
                          f"TRITON_INTERPRET=1 in the environment")


def flag_name(f) -> str:
    return f.metadata.get("flag") or f.name.replace("_", "-")


def _type_of(f):
    t = f.type if isinstance(f.type, str) else f.type.__name__
    for name, py in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if t.startswith(name):
            return py
    raise TypeError(f"unsupported field type {t}")


class _Parser(argparse.ArgumentParser):
    """argparse with a bad flag or value raised as a ConfigError, which pretrain.py reports as
    every bad input: one line on stderr, exit code 2 (--help prints the usage)."""

    def error(self, message):
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pretrain.py", description="Train a GPT with FORGE (Megatron-LM flag names).",
        argument_default=argparse.SUPPRESS, allow_abbrev=False)
    for f in dataclasses.fields(TrainConfig):
        names = ["--" + flag_name(f), *f.metadata["aliases"]]
        typ = _type_of(f)
        default = f.default
        help_ = f.metadata["help"] + (f" (default: {default})" if default not in (None, False)
                                      else "")
        if typ is bool:
            p.add_argument(*names, dest=f.name, action="store_true", help=help_)
        else:
            p.add_argument(*names, dest=f.name, type=typ, choices=f.metadata.get("choices"),
                           metavar=f.name.upper() if not f.metadata.get("choices") else None,
                           help=help_)
    return p


def _from_yaml(path: str) -> dict:
    import yaml
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of field: value")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    out = {}
    for key, val in data.items():
        name = str(key).replace("-", "_")
        if name not in fields or name == "config":
            raise ConfigError(f"--config {path}: unknown key {key!r}")
        typ = _type_of(fields[name])
        if val is not None and not (isinstance(val, typ) and not (typ is int and
                                                                   isinstance(val, bool))):
            choices = fields[name].metadata.get("choices") or ()
            if typ is float and isinstance(val, int) and not isinstance(val, bool):
                val = float(val)
            elif typ is str and not isinstance(val, bool) and str(val) in choices:
                val = str(val)  # kernel_ws: 0, as YAML reads an unquoted 0
            elif name == "kernel_ws_large" and isinstance(val, dict):
                val = json.dumps(val)  # the JSON object written as a YAML mapping
            else:
                raise ConfigError(f"--config {path}: {key} must be {typ.__name__}, got "
                                  f"{type(val).__name__} {val!r}")
        out[name] = val
    return out


def parse_config(argv=None) -> TrainConfig:
    """Flags (and --config FILE) -> validated TrainConfig. Raises ConfigError."""
    ns = vars(build_parser().parse_args(argv))
    values = {}
    if "config" in ns:
        if not os.path.isfile(ns["config"]):
            raise ConfigError(f"--config {ns['config']}: no such file")
        values.update(_from_yaml(ns["config"]))
    values.update(ns)
    if values.get("hf_checkpoint") is not None and "model" in values:
        # the directory's config.json is the shape: a preset beside it is a typo or a mix-up
        raise ConfigError(f"--model {values['model']} and --hf-checkpoint "
                          f"{values['hf_checkpoint']} both name the model; pass one")
    return TrainConfig(**values)
