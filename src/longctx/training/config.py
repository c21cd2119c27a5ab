"""The settings of `longctx train`: `TrainConfig`, read from flags and YAML, validated once.

Settings come from, in increasing priority: the defaults of `TrainConfig`, the ``--preset`` model shape, the
YAML file (``--config``, read with ``yaml.safe_load``), and flags given on the command line. Names follow
Megatron-LM (flags ``--train-iters``, ``--micro-batch-size``, ``--recompute-granularity`` ...; YAML keys with
underscores); NeMo's spellings are accepted too (``activations_checkpoint_granularity``,
``activations_checkpoint_method``, ``activations_checkpoint_num_layers``, ``max_steps``,
``gradient_clip_val`` ...), and so is NeMo's nesting (``model:``, ``trainer:``, ``optim:`` sections). An
unknown key is an error that names it and suggests the closest known one.

Every value is checked against its field's type with one rule for YAML and flags (`coerce`): an error names the
key, where it came from, the value, its type and the type expected. Numbers in scientific notation (``3e-4``,
which YAML 1.1 reads as a string, or ``1e3`` steps) are accepted; a quoted number in YAML (``"5"``) is not.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from longctx.models.gpt import PRESETS, GPTConfig
from longctx.training.data import RecallTask, parse_separator
from longctx.units import to_count

__all__ = [
    "TrainConfig",
    "parse_config",
    "load_yaml",
    "build_parser",
    "coerce",
    "ALIASES",
    "CP_METHODS",
    "CP_LAYOUTS",
    "ON_NONFINITE",
]

CP_METHODS = ("auto", "ring", "allgather", "ulysses", "ulysses_ring", "p2p")
CP_LAYOUTS = ("zigzag", "contiguous")
ON_NONFINITE = ("stop", "skip")
DP_SHARD = ("fsdp2", "replicate")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def default_lr(hidden_size: int) -> float:
    """The peak learning rate a run gets unless it sets one, by the model's width: 3e-3 for the small demo models
    (hidden 512 or less), and the rates published for models of that width (GPT-3's 6e-4 for 768, 3e-4 for 1024
    to 3072 as GPT-3 350M and Llama 3; 1.5e-4 from 4096, between GPT-3 6.7B's 1.2e-4 and Llama 3 8B's 3e-4, which
    used million-token batches). A wide model at the small models' rate diverges within its warmup."""
    if hidden_size <= 512:
        return 3e-3
    if hidden_size < 1024:
        return 6e-4
    if hidden_size < 4096:
        return 3e-4
    return 1.5e-4


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs.

    The model is the ``preset`` shape with the GPTConfig fields in ``model`` overriding it (Megatron names;
    entries that are None keep the preset's value). Validation happens on construction: a bad setting raises
    ValueError or TypeError naming it, before any model is built.
    """

    # model
    preset: str = "demo"
    model: dict[str, Any] = field(default_factory=dict)  # GPTConfig overrides (Megatron names)
    # data
    data: str | None = None  # a text file for byte-level LM; None = the embedded recall task
    # the bytes that end a document in --data (backslash escapes: "\\n\\n", "\\x00"); None: one sequence per row
    doc_separator: str | None = None
    num_pairs: int = RecallTask.num_pairs  # the task's own defaults, stated once in longctx.training.data
    num_queries: int = RecallTask.num_queries
    num_keys: int = RecallTask.num_keys
    num_values: int = RecallTask.num_values
    # optimisation
    train_iters: int = 1500
    micro_batch_size: int | None = None  # None: 32 for the demo models, 1 for the others (`default_lr`'s widths)
    lr: float | None = None  # None: by the model's width (`default_lr`)
    min_lr: float | None = None  # None: lr / 10
    lr_warmup_iters: int = 50
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 1.0  # 0 disables clipping
    on_nonfinite: str = "stop"  # a non-finite loss or gradient: "stop" the run, or "skip" the step
    # evaluation, logging, checkpoints
    eval_interval: int = 250  # 0 evaluates only after the last step
    eval_iters: int = 8  # 0 disables evaluation
    log_interval: int = 50
    save: str | None = "runs/recall"  # None (or "none") writes no checkpoint and no metrics
    save_interval: int = 500  # 0 saves only at the end (and on an interrupt)
    resume: str | None = None  # "auto" = <save>/checkpoint.pt, or a path
    overwrite: bool = False  # start afresh in a --save folder that holds another run's files
    halt_after: int | None = None  # stop (saving a checkpoint) after this many steps, as an interruption would
    seed: int = 1234
    # data x context parallelism on a DeviceMesh (run under torchrun with data_parallel * context_parallel
    # processes; see longctx.distributed.mesh)
    data_parallel: int = 1
    context_parallel: int = 1
    cp_method: str = "auto"  # auto: `TrainConfig.context_parallel_method`
    cp_layout: str = "zigzag"
    cp_ulysses_size: int | None = None  # ulysses_ring: ranks per all-to-all group
    # the parameters under data parallelism: "fsdp2" shards them over the data-parallel ranks (gathered layer by
    # layer), "replicate" keeps them whole on every rank and all-reduces the gradients after the backward
    dp_shard: str = "fsdp2"
    device: str = "auto"  # auto: cuda if available
    bf16: bool | None = None  # autocast to bfloat16; default: on CUDA only
    compile_ahead: bool = True  # compile the attention kernels before the first step (longctx.warmup)
    quiet: bool = False
    # GPU memory for a training step ("40GiB"): the recompute / chunking / offloading settings come from
    # longctx.plan for this budget instead of the model settings
    memory_budget: str | None = None
    # parameters, gradients and AdamW states in pinned host memory (FSDP2's CPU offload, sharded over every rank;
    # the optimizer steps on the CPU; longctx.distributed.offload): a model larger than the GPU, such as llama-8b.
    # With memory_budget the plan turns it on where nothing fits otherwise.
    offload_params: bool = False
    # with offload_params: how many units (the output layer, the embedding, the first layers: the order the forward
    # gathers them) keep their states on the GPU; None: the plan of memory_budget chooses, 0 without one
    offload_resident_units: int | None = None
    # host memory the plan of memory_budget may use ("400GiB"); None: what this machine has available
    host_memory_budget: str | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "model":
                object.__setattr__(self, f.name, coerce(f.name, str(f.type), getattr(self, f.name)))
        if isinstance(self.save, str) and self.save.lower() == "none":
            object.__setattr__(self, "save", None)
        if self.memory_budget is not None:
            from longctx.units import parse_bytes

            parse_bytes(self.memory_budget, "memory_budget")  # a clear error now, not after the model is built
        if self.host_memory_budget is not None:
            from longctx.units import parse_bytes

            if self.memory_budget is None:
                raise ValueError(
                    f"host_memory_budget ({self.host_memory_budget}) bounds the plan of memory_budget, which is not "
                    "set: pass --memory-budget (GPU memory) too, or drop --host-memory-budget"
                )
            parse_bytes(self.host_memory_budget, "host_memory_budget")
        if not isinstance(self.model, dict):
            raise TypeError(f"model must be a dict of GPTConfig fields, got {type(self.model).__name__}")
        unknown = [k for k in self.model if k not in MODEL_FIELDS]
        if unknown:
            raise _unknown_key_error(unknown, "model")
        object.__setattr__(self, "model", {k: coerce(k, _MODEL_TYPES[k], v) for k, v in self.model.items()})
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; expected one of {sorted(PRESETS)}")
        for name, (low, strict) in _LOWER_BOUNDS.items():
            value = getattr(self, name)
            if value is not None and (value <= low if strict else value < low):
                raise ValueError(
                    f"{name} must be {'>' if strict else '>='} {low}, got {value}{_RANGE_HINTS.get(name, '')}"
                )
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.doc_separator is not None:
            if self.data is None:
                raise ValueError(
                    f"doc_separator {self.doc_separator!r} splits the text of --data into documents, but no --data "
                    "file was given; pass --data FILE, or drop --doc-separator for the recall task"
                )
            parse_separator(self.doc_separator)  # an empty separator or a bad escape: ValueError naming it
        _choice("cp_method", self.cp_method, CP_METHODS)
        _choice("cp_layout", self.cp_layout, CP_LAYOUTS)
        if self.cp_method == "p2p" and self.doc_separator is None:
            raise ValueError(
                "cp_method 'p2p' moves the K/V chunks of packed documents that other ranks' queries see; it needs "
                "--doc-separator (documents in --data); use ring, allgather, ulysses or ulysses_ring otherwise"
            )
        if (self.cp_method == "ulysses_ring") != (self.cp_ulysses_size is not None):
            raise ValueError(
                f"cp_ulysses_size ({self.cp_ulysses_size!r}) goes with cp_method 'ulysses_ring' (got "
                f"{self.cp_method!r}): pass both --cp-method ulysses_ring and --cp-ulysses-size U, or neither"
            )
        if self.cp_ulysses_size is not None and (
            self.context_parallel % self.cp_ulysses_size or self.cp_ulysses_size >= self.context_parallel
        ):
            raise ValueError(
                f"cp_ulysses_size ({self.cp_ulysses_size}) must divide context_parallel ({self.context_parallel}) "
                "and be smaller than it (all-to-all inside groups of that many ranks, a ring across the groups)"
            )
        _choice("on_nonfinite", self.on_nonfinite, ON_NONFINITE)
        _choice("dp_shard", self.dp_shard, DP_SHARD)
        if self.dp_shard == "replicate" and self.offload_params:
            raise ValueError(
                "dp_shard 'replicate' keeps whole parameters on every GPU, offload_params shards them into host "
                "memory: drop one of --dp-shard replicate and --offload-params"
            )
        if self.offload_resident_units is not None:
            if self.offload_resident_units < 0:
                raise ValueError(f"offload_resident_units must be >= 0, got {self.offload_resident_units}")
            if not self.offload_params:
                raise ValueError(
                    f"offload_resident_units={self.offload_resident_units} keeps units of offloaded states on the "
                    "GPU: pass --offload-params too"
                )
        if not _DEVICE.fullmatch(self.device):
            hint = " (use 'cuda' for an NVIDIA GPU)" if self.device.lower() in ("gpu", "nvidia", "cuda:") else ""
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}{hint}")
        if self.resume is not None and self.overwrite:
            raise ValueError(
                "resume and overwrite exclude each other: --resume continues the run in --save, "
                "--overwrite starts a new one there; pass one of them"
            )
        # the model settings, validated by GPTConfig (its ValueError names the field); the rates by its width
        width = self.model_config().hidden_size
        if self.micro_batch_size is None:  # the recall demo's 32 short sequences; one long sequence for the rest
            object.__setattr__(self, "micro_batch_size", 32 if width <= 512 else 1)
        if self.lr is None:
            object.__setattr__(self, "lr", default_lr(width))
        if self.min_lr is None:
            object.__setattr__(self, "min_lr", min(self.lr / 10, default_lr(width) / 10))
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must be <= lr ({self.lr}): the schedule decays from lr to min_lr")

    def context_parallel_method(self) -> str:
        """The context-parallel method the run uses: ``cp_method``, or for "auto" the fastest measured on its data:
        over packed documents (``doc_separator``) "ulysses" where the model's heads split over the context-parallel
        ranks, else "p2p" (docs/context-parallel.md); one dense sequence, "ring"."""
        if self.cp_method != "auto":
            return self.cp_method
        if self.doc_separator is None:
            return "ring"
        from longctx.distributed.ulysses import splits_heads

        mcfg = self.model_config()
        return "ulysses" if splits_heads(mcfg.num_attention_heads, mcfg.kv_heads, self.context_parallel) else "p2p"

    def model_config(self, vocab_size: int | None = None) -> GPTConfig:
        """The GPTConfig of this run: the preset, the ``model`` overrides, then ``vocab_size`` if given.

        Args:
            vocab_size: the data's vocabulary (256 for byte-level text); None keeps the configured one.

        Raises:
            ValueError: a model setting GPTConfig rejects.
        """
        overrides = {k: v for k, v in self.model.items() if v is not None}
        if vocab_size is not None:
            overrides["vocab_size"] = vocab_size
        return GPTConfig.preset(self.preset, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """The training settings (without the model overrides) as plain data, as checkpoints store them."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "model"}


# (bound, strict): strict means value > bound, else value >= bound
_LOWER_BOUNDS: dict[str, tuple[float, bool]] = {
    "train_iters": (1, False),
    "micro_batch_size": (1, False),
    "data_parallel": (1, False),
    "context_parallel": (1, False),
    "log_interval": (1, False),
    "halt_after": (1, False),
    "cp_ulysses_size": (2, False),
    "num_pairs": (1, False),
    "num_queries": (1, False),
    "num_keys": (1, False),
    "num_values": (1, False),
    "lr_warmup_iters": (0, False),
    "eval_iters": (0, False),
    "eval_interval": (0, False),
    "save_interval": (0, False),
    "seed": (0, False),
    "lr": (0.0, True),
    "min_lr": (0.0, False),
    "weight_decay": (0.0, False),
    "clip_grad": (0.0, False),
}
_RANGE_HINTS = {
    "train_iters": " (the number of optimiser steps)",
    "micro_batch_size": " (sequences per step)",
    "clip_grad": " (0 disables clipping)",
    "eval_iters": " (0 disables evaluation)",
    "save_interval": " (0 saves only at the end)",
}


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


# -- one type rule for YAML, flags and Python ---------------------------------------------------------------

_SCIENTIFIC = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _kind(annotation: str) -> str:
    for kind in ("bool", "int", "float", "str"):
        if kind in annotation:
            return kind
    return "any"


def coerce(name: str, annotation: str, value: Any, source: str = "python") -> Any:
    """``value`` of the setting ``name`` converted to its type (``annotation``, e.g. ``"int | None"``).

    Args:
        name: the setting (Megatron name), as the error message names it.
        annotation: the field's type as a string (``str(dataclasses.Field.type)``).
        value: what was given.
        source: ``"flag"`` (a string from the command line, parsed), ``"yaml"`` or ``"python"`` (typed values;
            a string is accepted for a number only in scientific notation, which YAML 1.1 leaves a string).

    Raises:
        TypeError: the value's type does not fit (the message names the key, the value, its type, the type
            expected, where it came from and the fix).
        ValueError: a non-finite number.
    """
    optional = "None" in annotation
    kind = _kind(annotation)
    if value is None and optional:
        return None
    if isinstance(value, str) and optional and source == "flag" and value.lower() in ("none", "null"):
        return None
    out: Any = _MISSING
    if kind == "bool":
        if isinstance(value, bool):
            out = value
        elif isinstance(value, str) and source == "flag" and value.lower() in _TRUE + _FALSE:
            out = value.lower() in _TRUE
    elif kind == "int":
        out = _as_int(value, source)
    elif kind == "float":
        out = _as_float(value, source)
    elif kind == "str":
        if isinstance(value, str):
            out = value
    else:
        out = value
    if out is _MISSING:
        raise TypeError(_type_message(name, annotation, kind, value, source))
    if isinstance(out, float) and not math.isfinite(out):
        raise ValueError(f"{_where(name, source)} must be a finite number, got {value!r}")
    return out


_MISSING = object()


def _as_int(value: Any, source: str) -> Any:
    # a count as every command reads one (`longctx.units.to_count`: 1e3 steps, 1.0e+3 from YAML); text in a YAML file
    # only in scientific notation, which YAML 1.1 leaves a string
    if isinstance(value, str) and not (source == "flag" or _SCIENTIFIC.fullmatch(value.strip())):
        return _MISSING
    n = to_count(value)
    return _MISSING if n is None else n


def _as_float(value: Any, source: str) -> Any:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and (source == "flag" or _SCIENTIFIC.fullmatch(value.strip())):
        try:
            return float(value)
        except ValueError:
            return _MISSING
    return _MISSING


def _where(name: str, source: str) -> str:
    if source == "flag":
        return f"--{name.replace('_', '-')}"
    return name


_EXPECTED = {
    "bool": "a bool (true or false)",
    "int": "an int (e.g. 100 or 1e3)",
    "float": "a float (e.g. 0.001 or 1e-3)",
    "str": "a str",
}


def _parses(text: str, kind: str) -> bool:
    """Whether ``text`` without its quotes is a valid ``kind`` ("int" or "float")."""
    if kind == "int":
        return to_count(text) is not None
    try:
        float(text)
    except ValueError:
        return False
    return True


def _type_message(name: str, annotation: str, kind: str, value: Any, source: str) -> str:
    expected = _EXPECTED.get(kind, annotation) + (" or none" if "None" in annotation else "")
    text = f"{_where(name, source)} must be {expected}, got {value!r} ({type(value).__name__})"
    if source == "yaml" and isinstance(value, str) and kind == "bool":
        text += f"; write {name}: true or {name}: false, without quotes"
    elif source == "yaml" and isinstance(value, str) and kind in ("int", "float") and _parses(value, kind):
        text += f"; write it without quotes in the YAML file ({name}: {value.strip()})"
    elif kind == "int" and isinstance(value, float):
        text += f"; {name} counts whole items"
    elif source == "flag" and kind == "bool":
        text += "; pass true/false, yes/no, on/off or 1/0"
    return text


# -- names: Megatron (ours), NeMo and a few common spellings -----------------------------------------------

ALIASES: dict[str, str] = {
    "activations_checkpoint_granularity": "recompute_granularity",
    "activations_checkpoint_method": "recompute_method",
    "activations_checkpoint_num_layers": "recompute_num_layers",
    "encoder_seq_length": "seq_length",
    "max_steps": "train_iters",
    "steps": "train_iters",
    "batch_size": "micro_batch_size",
    "warmup_steps": "lr_warmup_iters",
    "gradient_clip_val": "clip_grad",
    "val_check_interval": "eval_interval",
    "limit_val_batches": "eval_iters",
    "tie_word_embeddings": "share_embeddings_and_output_weights",
    "num_kv_heads": "num_query_groups",
    "checkpoint_dir": "save",
    "enable_cpu_offload": "offload_params",  # torchtitan's name for FSDP2's CPU offload of parameters and states
}
MODEL_FIELDS = tuple(f.name for f in fields(GPTConfig))
TRAIN_FIELDS = tuple(f.name for f in fields(TrainConfig) if f.name != "model")
ALL_KEYS = set(TRAIN_FIELDS) | set(MODEL_FIELDS)
_MODEL_TYPES = {f.name: str(f.type) for f in fields(GPTConfig)}
_TRAIN_TYPES = {f.name: str(f.type) for f in fields(TrainConfig) if f.name != "model"}
_NEMO_SECTIONS = ("model", "trainer", "optim", "exp_manager")


def _canonical(key: str) -> str:
    key = key.replace("-", "_")
    return ALIASES.get(key, key)


def _unknown_key_error(unknown: list[str], where: str) -> ValueError:
    hints = []
    for k in unknown:
        close = difflib.get_close_matches(k, sorted(ALL_KEYS | set(ALIASES)), n=1)
        hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ValueError(
        f"unknown configuration key(s) in {where}: {', '.join(hints)}. Known keys: the Megatron names of "
        f"GPTConfig ({', '.join(MODEL_FIELDS)}), the training keys ({', '.join(TRAIN_FIELDS)}) and the NeMo "
        f"spellings {sorted(ALIASES)}"
    )


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML file of settings into a flat mapping of canonical (Megatron) names, each value type-checked.

    Args:
        path: a YAML file holding a flat mapping, or NeMo's nesting (``model:``, ``trainer:``, ``optim:``,
            ``exp_manager:`` sections), which is flattened.

    Returns:
        ``{canonical name: value}``; NeMo and other spellings in `ALIASES` are renamed; numbers in scientific
        notation are numbers.

    Raises:
        ValueError: the file cannot be read, is not YAML, is not a mapping, or holds unknown keys (named,
            with the closest known key).
        TypeError: a value of the wrong type (the message names the file, the key, the value and its type).
    """
    import yaml

    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"cannot read config file {str(path)!r}: {e}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {e}") from e
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of settings, got {type(raw).__name__}")
    flat: dict[str, Any] = {}
    for key, val in raw.items():
        if key in _NEMO_SECTIONS and isinstance(val, dict):
            flat.update(val)
        else:
            flat[key] = val
    out: dict[str, Any] = {}
    unknown = []
    for key, val in flat.items():
        name = _canonical(str(key))
        if name not in ALL_KEYS:
            unknown.append(str(key))
        out[name] = val
    if unknown:
        raise _unknown_key_error(unknown, repr(str(path)))
    for name, val in out.items():
        try:
            out[name] = coerce(name, _TRAIN_TYPES.get(name) or _MODEL_TYPES[name], val, "yaml")
        except (TypeError, ValueError) as e:
            raise type(e)(f"config file {str(path)!r}: {e}") from None
    return out


# -- flags -------------------------------------------------------------------------------------------------

_DEFAULTS = {f.name: f.default for f in fields(TrainConfig) if f.name != "model"}

_TRAIN_HELP: dict[str, str] = {
    "num_pairs": "recall task: key-value pairs per sequence",
    "num_queries": "recall task: pairs queried at the end of each sequence",
    "num_keys": "recall task: size of the key vocabulary",
    "num_values": "recall task: size of the value vocabulary (chance accuracy is 1/num_values)",
    "train_iters": "optimiser steps of the whole run (alias --steps)",
    "micro_batch_size": "sequences per step and data-parallel rank (alias --batch-size)",
    "lr": "peak learning rate, after warmup (scientific notation accepted: 3e-3)",
    "min_lr": "learning rate at the end of the cosine decay",
    "lr_warmup_iters": "steps of linear warmup",
    "weight_decay": "AdamW weight decay (matrices only)",
    "adam_beta1": "AdamW beta1",
    "adam_beta2": "AdamW beta2",
    "clip_grad": "gradient-norm clipping; 0 disables it",
    "on_nonfinite": "a non-finite loss or gradient: stop the run (naming the step) or skip the step",
    "eval_interval": "steps between evaluations; 0 evaluates after the last step only",
    "eval_iters": "held-out batches per evaluation; 0 disables evaluation",
    "log_interval": "steps between progress lines when stdout is not a terminal",
    "save": "run folder: checkpoint.pt, metrics.jsonl and loss.png; 'none' writes nothing",
    "save_interval": "steps between checkpoints; 0 saves at the end only (an interrupt always saves)",
    "resume": "continue the run in --save (or from the checkpoint PATH)",
    "overwrite": "start a new run in a --save folder that holds another run's checkpoint, deleting its files",
    "halt_after": "stop after this many steps with a checkpoint, as an interruption would",
    "seed": "seed of the initial weights, the data and dropout",
    "data_parallel": "ranks reading different sequences, parameters sharded over them by FSDP2 (torchrun: "
    "data_parallel * context_parallel processes)",
    "context_parallel": "ranks sharing each sequence (torchrun: data_parallel * context_parallel processes)",
    "cp_method": "context-parallel method: " + ", ".join(CP_METHODS) + " (auto: ulysses over packed documents where "
    "the heads split over the ranks, else p2p; ring for one dense sequence)",
    "cp_layout": "context-parallel sequence layout: " + " or ".join(CP_LAYOUTS),
    "cp_ulysses_size": "ulysses_ring: ranks per all-to-all group (a ring across the groups)",
    "dp_shard": "the parameters under data parallelism: fsdp2 (sharded over the data-parallel ranks, gathered layer "
    "by layer) or replicate (whole on every GPU, 16 bytes a parameter, the gradients all-reduced after the backward)",
    "device": "auto (cuda if available), cpu, cuda or cuda:N",
    "bf16": "bf16 autocast",
    "compile_ahead": "on a GPU, compile the attention and position-wise kernels the run calls before the first "
    "step, concurrently (longctx.warmup; without context parallelism)",
    "data": "text file for byte-level language modelling instead of the recall task",
    "doc_separator": "bytes that end a document in --data (escapes: '\\n\\n', '\\x00'): rows become packed "
    "documents, attention and RoPE positions restart at each, no label crosses one",
    "quiet": "print nothing but errors",
    "memory_budget": "GPU memory for a step, e.g. 40GiB: longctx plan chooses the recompute / offloading settings",
    "offload_params": "parameters, gradients and AdamW states in host memory (FSDP2 CPU offload; the optimizer "
    "steps on the CPU): a model larger than the GPU",
    "offload_resident_units": "with --offload-params, how many units keep their states on the GPU (the output layer, "
    "the embedding, then the first layers): no copies, no host optimizer step for them",
    "host_memory_budget": "host memory the plan of --memory-budget may use, e.g. 400GiB",
}


_MODEL_HELP: dict[str, str] = {
    "vocab_size": "vocabulary size (byte-level text sets 256)",
    "seq_length": "tokens per training sequence",
    "num_layers": "transformer layers",
    "hidden_size": "model width",
    "num_attention_heads": "query heads",
    "num_query_groups": "key/value heads: none = multi-head, 1 = multi-query, a divisor of the heads = GQA",
    "ffn_hidden_size": "SwiGLU inner size; none: 8/3 of hidden_size, rounded up to a multiple of 64",
    "kv_channels": "head dim; none: hidden_size / num_attention_heads",
    "attention_dropout": "dropout on the attention probabilities (not under context parallelism)",
    "hidden_dropout": "dropout on the embeddings and the residual branches",
    "attention_backend": "auto or a backend name (longctx info lists them)",
    "recompute_granularity": "activation recomputation: none, full or selective",
    "recompute_method": "full recomputation: uniform or block",
    "recompute_num_layers": "full recomputation: layers per group (uniform) or recomputed layers (block)",
    "sequence_chunk_size": "tokens per chunk of the norm/MLP part of a layer in training; none runs it whole",
    "cpu_offloading": "keep the inputs of fully recomputed layers in host memory",
    "cpu_offloading_num_layers": "offload the first N layers; none: every layer",
    "cpu_offloading_activations": "offload activations (must stay true)",
    "recompute_skip_core_attention": "full recomputation keeps attention outputs and skips attention in the replay",
    "share_embeddings_and_output_weights": "tie the input embedding and the output projection",
    "rotary_base": "RoPE base",
    "layernorm_epsilon": "RMSNorm epsilon",
    "init_method_std": "standard deviation of the initial weights",
    "add_bias_linear": "biases in the linear layers",
}


# defaults that depend on the run, in words
_DEFAULT_TEXT = {
    "bf16": "on CUDA only",
    "micro_batch_size": "32 for the demo models (hidden 512 or less), else 1",
    "lr": "by the model's width: 3e-3 up to hidden 512 (the demo models), 6e-4 below 1024, 3e-4 below 4096, 1.5e-4 "
    "from 4096",
    "min_lr": "lr / 10",
    "offload_resident_units": "what --memory-budget's plan fits, else 0",
    "host_memory_budget": "what this machine has available",
}


def _default_text(name: str) -> str:
    if name in _DEFAULT_TEXT:
        return _DEFAULT_TEXT[name]
    if name == "resume":
        return "off; without PATH: <save>/checkpoint.pt"
    value = _DEFAULTS[name]
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _raw(s: str) -> str:
    return s  # converted by coerce(), which names the flag in its errors


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``longctx train``: one flag per setting, every default None (= not given).

    Values stay strings here; `parse_config` converts them with `coerce`, the rule YAML values follow too.
    """
    p = argparse.ArgumentParser(
        prog="longctx train",
        description="Train a GPT on the embedded long-context recall task (default) or a text file (--data).",
        epilog=(
            "The run folder (--save) holds checkpoint.pt, metrics.jsonl (one JSON object per step: step, loss, "
            "lr, and eval_loss with recall_accuracy or bits_per_byte on evaluation steps) and loss.png. A new "
            "run refuses a folder that holds another run's checkpoint: continue it with --resume or replace it "
            "with --overwrite. Ctrl-C (SIGINT) or SIGTERM ends the current step, writes a checkpoint and exits "
            "with 130 or 143."
        ),
    )
    p.add_argument("--config", help="YAML file of settings (Megatron or NeMo names); flags override it")
    p.add_argument("--preset", choices=sorted(PRESETS), help="model shape (default: demo)")
    p.add_argument("--data", type=_raw, help=f"{_TRAIN_HELP['data']} (default: none, the recall task)")
    demo = PRESETS["demo"]
    g = p.add_argument_group("model (GPTConfig fields, Megatron names; defaults: the preset's, shown for demo)")
    defaults = {f.name: f.default for f in fields(GPTConfig)}
    for name in MODEL_FIELDS:
        value = demo.get(name, defaults[name])
        shown = "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        g.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=_raw,
            default=None,
            metavar=_kind(_MODEL_TYPES[name]).upper(),
            help=f"{_MODEL_HELP.get(name, 'GPTConfig.' + name)} (default: {shown})",
        )
    t = p.add_argument_group("training")
    for name in TRAIN_FIELDS:
        if name in ("preset", "data", "resume", "overwrite", "quiet"):
            continue
        t.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=_raw,
            default=None,
            metavar=_kind(_TRAIN_TYPES[name]).upper(),
            help=f"{_TRAIN_HELP[name]} (default: {_default_text(name)})",
        )
    t.add_argument("--steps", dest="train_iters", type=_raw, default=None, help="alias of --train-iters")
    t.add_argument("--batch-size", dest="micro_batch_size", type=_raw, default=None, help="alias of --micro-batch-size")
    t.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        metavar="PATH",
        help=f"{_TRAIN_HELP['resume']} (default: {_default_text('resume')})",
    )
    t.add_argument("--overwrite", action="store_true", default=None, help=f"{_TRAIN_HELP['overwrite']} (default: off)")
    t.add_argument("--quiet", action="store_true", default=None, help=f"{_TRAIN_HELP['quiet']} (default: off)")
    return p


def parse_config(argv: list[str] | None) -> TrainConfig:
    """The `TrainConfig` of a ``longctx train`` command line: defaults < preset < YAML < flags.

    Args:
        argv: the arguments after ``train`` (None: ``sys.argv[1:]``).

    Raises:
        ValueError: unknown YAML keys, or a setting `TrainConfig` or GPTConfig rejects (named).
        TypeError: a YAML value or a flag of the wrong type (named, with where it came from).
    """
    args = build_parser().parse_args(argv)
    settings: dict[str, Any] = {}
    if args.config:
        settings.update(load_yaml(args.config))
    for key, val in vars(args).items():
        if key in ("config", "preset") or val is None:
            continue
        types = _TRAIN_TYPES if key in _TRAIN_TYPES else _MODEL_TYPES
        settings[key] = coerce(key, types[key], val, "flag") if isinstance(val, str) else val
    if args.preset is not None:
        settings["preset"] = args.preset
    train_kw = {k: v for k, v in settings.items() if k in TRAIN_FIELDS}
    model_kw = {k: v for k, v in settings.items() if k in MODEL_FIELDS}
    return TrainConfig(**train_kw, model=model_kw)
