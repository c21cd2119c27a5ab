"""The settings of `longctx train`: `TrainConfig`, read from flags and YAML, validated once.

Settings come from, in increasing priority: the defaults of `TrainConfig`, the ``--preset`` model shape, the
YAML file (``--config``, read with ``yaml.safe_load``), and flags given on the command line. Names follow
Megatron-LM (flags ``--train-iters``, ``--micro-batch-size``, ``--recompute-granularity`` ...; YAML keys with
underscores); NeMo's spellings are accepted too (``activations_checkpoint_granularity``,
``activations_checkpoint_method``, ``activations_checkpoint_num_layers``, ``max_steps``,
``gradient_clip_val`` ...), and so is NeMo's nesting (``model:``, ``trainer:``, ``optim:`` sections). An
unknown key is an error that names it and suggests the closest known one.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from longctx.models.gpt import PRESETS, GPTConfig
from longctx.training.data import RecallTask

__all__ = ["TrainConfig", "parse_config", "load_yaml", "build_parser", "ALIASES", "CP_METHODS", "CP_LAYOUTS"]

CP_METHODS = ("ring", "allgather", "ulysses")
CP_LAYOUTS = ("zigzag", "contiguous")


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
    num_pairs: int = RecallTask.num_pairs  # the task's own defaults, stated once in longctx.training.data
    num_queries: int = RecallTask.num_queries
    num_keys: int = RecallTask.num_keys
    num_values: int = RecallTask.num_values
    # optimisation
    train_iters: int = 1500
    micro_batch_size: int = 32
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_warmup_iters: int = 50
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 1.0  # 0 disables clipping
    # evaluation, logging, checkpoints
    eval_interval: int = 250  # 0 evaluates only after the last step
    eval_iters: int = 8  # 0 disables evaluation
    log_interval: int = 50
    save: str | None = "runs/recall"  # None (or "none") writes no checkpoint and no metrics
    save_interval: int = 500  # 0 saves only at the end
    resume: str | None = None  # "auto" = <save>/checkpoint.pt, or a path
    halt_after: int | None = None  # stop (saving a checkpoint) after this many steps, as an interruption would
    seed: int = 1234
    # context parallelism (run under torchrun with --nproc-per-node = context_parallel; see longctx.distributed)
    context_parallel: int = 1
    cp_method: str = "ring"
    cp_layout: str = "zigzag"
    device: str = "auto"  # auto: cuda if available
    bf16: bool | None = None  # autocast to bfloat16; default: on CUDA only
    quiet: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "model":
                object.__setattr__(self, f.name, _checked(f.name, str(f.type), getattr(self, f.name)))
        if isinstance(self.save, str) and self.save.lower() == "none":
            object.__setattr__(self, "save", None)
        if not isinstance(self.model, dict):
            raise TypeError(f"model must be a dict of GPTConfig fields, got {type(self.model).__name__}")
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; expected one of {sorted(PRESETS)}")
        at_least = {"train_iters": 1, "micro_batch_size": 1, "context_parallel": 1, "lr_warmup_iters": 0}
        at_least |= {"eval_iters": 0, "eval_interval": 0, "save_interval": 0, "halt_after": 0}
        for name, low in at_least.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        for name in ("lr", "min_lr", "weight_decay", "clip_grad"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.cp_method not in CP_METHODS:
            raise ValueError(f"cp_method must be one of {list(CP_METHODS)}, got {self.cp_method!r}")
        if self.cp_layout not in CP_LAYOUTS:
            raise ValueError(f"cp_layout must be one of {list(CP_LAYOUTS)}, got {self.cp_layout!r}")
        self.model_config()  # the model settings, validated by GPTConfig (its ValueError names the field)

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


def _checked(name: str, annotation: str, value: Any) -> Any:
    """``value`` converted to the field's type where that is lossless; TypeError naming the field otherwise."""
    optional = "None" in annotation
    if value is None and optional:
        return None
    if "bool" in annotation:
        if isinstance(value, bool):
            return value
    elif "int" in annotation:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif "float" in annotation:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif isinstance(value, str):
        return value
    expected = annotation.replace(" | None", " or None")
    raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")


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
}
MODEL_FIELDS = tuple(f.name for f in fields(GPTConfig))
TRAIN_FIELDS = tuple(f.name for f in fields(TrainConfig) if f.name != "model")
ALL_KEYS = set(TRAIN_FIELDS) | set(MODEL_FIELDS)
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
    """Read a YAML file of settings into a flat mapping of canonical (Megatron) names.

    Args:
        path: a YAML file holding a flat mapping, or NeMo's nesting (``model:``, ``trainer:``, ``optim:``,
            ``exp_manager:`` sections), which is flattened.

    Returns:
        ``{canonical name: value}``; NeMo and other spellings in `ALIASES` are renamed.

    Raises:
        ValueError: the file cannot be read, is not YAML, is not a mapping, or holds unknown keys (named,
            with the closest known key).
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
    return out


# -- flags -------------------------------------------------------------------------------------------------


def _none_or(typ: type) -> Any:
    def conv(s: str) -> Any:
        return None if s.lower() in ("none", "null") else typ(s)

    conv.__name__ = typ.__name__  # argparse names the type in its error messages
    return conv


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


_TRAIN_FLAGS: list[tuple[str, type]] = [
    ("train_iters", int),
    ("micro_batch_size", int),
    ("lr", float),
    ("min_lr", float),
    ("lr_warmup_iters", int),
    ("weight_decay", float),
    ("adam_beta1", float),
    ("adam_beta2", float),
    ("clip_grad", float),
    ("eval_interval", int),
    ("eval_iters", int),
    ("log_interval", int),
    ("save_interval", int),
    ("seed", int),
    ("num_pairs", int),
    ("num_queries", int),
    ("num_keys", int),
    ("num_values", int),
    ("halt_after", int),
    ("context_parallel", int),
]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``longctx train``: one flag per setting, every default None (= not given)."""
    p = argparse.ArgumentParser(
        prog="longctx train",
        description="Train a GPT on the embedded long-context recall task (default) or a text file (--data).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--config", help="YAML file of settings (Megatron or NeMo names)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="model shape (default: demo)")
    p.add_argument("--data", help="text file for byte-level language modelling instead of the recall task")
    g = p.add_argument_group("model (GPTConfig fields, Megatron names)")
    hints = {f.name: str(f.type) for f in fields(GPTConfig)}
    for name in MODEL_FIELDS:
        if "bool" in hints[name]:
            conv: Any = _bool
        elif "float" in hints[name]:
            conv = float
        elif "int" in hints[name]:
            conv = _none_or(int)
        else:
            conv = _none_or(str)
        g.add_argument("--" + name.replace("_", "-"), dest=name, type=conv, default=None)
    t = p.add_argument_group("training")
    for name, typ in _TRAIN_FLAGS:
        t.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None)
    t.add_argument("--steps", dest="train_iters", type=int, default=None, help="alias of --train-iters")
    t.add_argument("--batch-size", dest="micro_batch_size", type=int, default=None, help="alias of --micro-batch-size")
    t.add_argument("--save", default=None, help="checkpoint directory (default runs/recall; 'none' disables)")
    t.add_argument(
        "--resume", nargs="?", const="auto", default=None, help="resume from <save>/checkpoint.pt, or from PATH"
    )
    t.add_argument("--cp-method", default=None, help="context-parallel method: " + ", ".join(CP_METHODS))
    t.add_argument("--cp-layout", default=None, help="context-parallel sequence layout: " + " or ".join(CP_LAYOUTS))
    t.add_argument("--device", default=None, help="auto, cpu or cuda")
    t.add_argument("--bf16", type=_bool, default=None, help="bf16 autocast (default: on CUDA)")
    t.add_argument("--quiet", action="store_true", default=None)
    return p


def parse_config(argv: list[str] | None) -> TrainConfig:
    """The `TrainConfig` of a ``longctx train`` command line: defaults < preset < YAML < flags.

    Args:
        argv: the arguments after ``train`` (None: ``sys.argv[1:]``).

    Raises:
        ValueError: unknown YAML keys, or a setting `TrainConfig` or GPTConfig rejects (named).
        TypeError: a YAML value of the wrong type (named).
    """
    args = build_parser().parse_args(argv)
    settings: dict[str, Any] = {}
    if args.config:
        settings.update(load_yaml(args.config))
    for key, val in vars(args).items():
        if key != "config" and val is not None:
            settings[key] = val
    train_kw = {k: v for k, v in settings.items() if k in TRAIN_FIELDS}
    model_kw = {k: v for k, v in settings.items() if k in MODEL_FIELDS}
    return TrainConfig(**train_kw, model=model_kw)
