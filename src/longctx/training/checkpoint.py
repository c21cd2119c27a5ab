"""Training checkpoints: written atomically, read with ``torch.load(weights_only=True)``.

A checkpoint is one file holding plain data only (tensors, numbers, strings, lists, dicts):

    {"format": "longctx-checkpoint", "version": 2, "checksums": {...}, "step": int, "model": state_dict,
     "optimizer": state_dict, "rng": {...}, "model_config": dict, "train_config": dict, "extra": dict}

Saving writes a temporary file next to the target, flushes it to disk and renames it over the target
with `os.replace` (atomic on POSIX): a crash mid-save leaves the previous checkpoint intact, never a torn
one (a crash can leave a ``*.tmp`` file beside it, which `remove_partial_files` deletes). ``checksums`` holds a
CRC-32 of every tensor's bytes (by its path in the payload, e.g. ``model/layers.0.mlp.fc1.weight``) and one of
everything else; loading recomputes them, so bytes flipped on disk are an error naming the tensor instead of
weights that load and train to NaN. Loading refuses, with a `CheckpointError` that says why and what to do, a
file that is missing, truncated or corrupt, not a longctx checkpoint, of another format version, or written
for another model configuration. `save_training_state` refuses to write a model or optimizer state that holds
NaN or infinity.

`save_training_state` and `load_training_state` are what the trainer calls: the model, the optimizer, the RNG
states and the step in one file, and on loading a check that the checkpoint was written for the same model.

Under a DeviceMesh (data or context parallelism) the trainer writes sharded checkpoints instead
(`save_sharded_state`, `torch.distributed.checkpoint`): a folder ``<save>/checkpoint/`` holding one complete
checkpoint ``step-00000012/`` (every rank's shards, DCP's ``.metadata``, and ``longctx.pt``: the step, the RNG
states, both configurations and the other data, with its checksums, and a CRC-32 of every shard file). Every rank
writes into ``step-N.tmp/``; once all have finished, the first rank writes ``longctx.pt``, renames the folder to
``step-N`` (atomic) and only then deletes the previous one, so a crash at any point leaves the previous complete
checkpoint. `load_sharded_state`
reads the newest complete one on any number of ranks (DCP reshards), a single process included, after the first
rank has checked every shard file against its CRC-32 (a flipped or truncated shard is an error on every rank that
names the file, not weights that load and train to NaN).
"""

from __future__ import annotations

import os
import random
import tempfile
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "save_training_state",
    "load_training_state",
    "capture_rng",
    "restore_rng",
    "config_diff",
    "checksums",
    "non_finite_tensors",
    "remove_partial_files",
    "save_sharded_state",
    "load_sharded_state",
    "latest_sharded",
    "remove_partial_dirs",
    "read_sharded_meta",
]

FORMAT = "longctx-checkpoint"
VERSION = 2

# Model fields that say how the model is computed, not what it is: a resumed run may change them.
HOW_FIELDS = ("attention_backend", "recompute_granularity", "recompute_method", "recompute_num_layers")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, corrupt, foreign, or mismatched)."""


def capture_rng() -> dict[str, Any]:
    """The RNG states that training consumes (dropout): torch CPU, every CUDA device, Python's random."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": _to_lists(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set the RNG states that `capture_rng` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(_to_tuples(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_lists(x: Any) -> Any:
    return [_to_lists(i) for i in x] if isinstance(x, tuple) else x


def _to_tuples(x: Any) -> Any:
    return tuple(_to_tuples(i) for i in x) if isinstance(x, list) else x


def _leaves(x: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) of a nested payload in a fixed order: dict keys sorted, lists in order."""
    if isinstance(x, dict):
        for k in sorted(x, key=str):
            yield from _leaves(x[k], f"{path}/{k}" if path else str(k))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{path}/{i}")
    else:
        yield path, x


def _tensor_crc(t: torch.Tensor) -> int:
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)  # any dtype, as raw bytes
    return zlib.crc32(memoryview(data.numpy())) if data.numel() else 0


def checksums(payload: dict[str, Any]) -> dict[str, int]:
    """CRC-32 of every tensor of ``payload`` (keyed by its path) and, under ``""``, of all other values."""
    out: dict[str, int] = {}
    rest = []
    for path, leaf in _leaves(payload):
        if isinstance(leaf, torch.Tensor):
            out[path] = _tensor_crc(leaf)
        else:
            rest.append(f"{path}={leaf!r}")
    out[""] = zlib.crc32("\n".join(rest).encode())
    return out


def non_finite_tensors(payload: dict[str, Any]) -> list[str]:
    """Paths of the floating-point tensors of ``payload`` that hold NaN or infinity."""
    return [
        path
        for path, leaf in _leaves(payload)
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and not bool(torch.isfinite(leaf).all())
    ]


def remove_partial_files(path: str | Path) -> list[Path]:
    """Delete the temporary files an interrupted `save_checkpoint` of ``path`` left beside it; returns them."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    stale = sorted(path.parent.glob(path.name + ".*.tmp"))
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def save_checkpoint(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (plus the format header and its checksums) to ``path`` atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "version": VERSION, "checksums": checksums(payload), **payload}
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: readers see the old file or the new one, never a partial one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # the rename itself reaches the disk
    return path


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the rename is still atomic
    finally:
        os.close(fd)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint` (``weights_only=True``: no code is executed)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {str(path)!r}; train without --resume first, or pass the right path")
    try:
        data = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # zip/pickle errors of truncated or foreign files
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt or not a longctx checkpoint ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); it was left untouched - restore a good copy or "
            "start a new run in another --save directory"
        ) from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{str(path)!r} is not a longctx checkpoint (no {FORMAT!r} header)")
    if data.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has format version {data.get('version')!r}; this longctx reads version {VERSION}"
        )
    missing = [k for k in ("checksums", "step", "model", "optimizer", "rng", "model_config") if k not in data]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} is incomplete: missing {missing}")
    _verify(path, data)
    return data


def _verify(path: Path, data: dict[str, Any]) -> None:
    saved = data["checksums"]
    payload = {k: v for k, v in data.items() if k not in ("format", "version", "checksums")}
    now = checksums(payload)
    bad = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if bad:
        what = ", ".join(repr(k) if k else "its non-tensor data" for k in bad[:5])
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupt: the checksum of {what}{more} does not match the one written "
            "with it (bytes changed on disk or in transfer); it was left untouched - restore a good copy or "
            "start a new run in another --save directory"
        )


def config_diff(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences ``field: saved -> current`` between two config dicts."""
    keys = sorted(set(saved) | set(current))
    return [
        f"{k}: {saved.get(k, '<absent>')!r} -> {current.get(k, '<absent>')!r}"
        for k in keys
        if saved.get(k) != current.get(k)
    ]


def save_training_state(
    path: str | Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_config: dict[str, Any],
    train_config: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Checkpoint a training run after ``step`` steps: weights, optimizer state, RNG states and both configs.

    Args:
        path: the checkpoint file, written atomically (`save_checkpoint`).
        step: steps done; a resumed run starts at this step.
        model, optimizer: their ``state_dict`` is saved.
        model_config, train_config: plain dicts (``GPTConfig.to_dict()``, ``TrainConfig.to_dict()``).
        extra: anything else worth keeping (the last evaluation).

    Raises:
        CheckpointError: the model or optimizer state holds NaN or infinity (nothing is written).
    """
    payload = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": capture_rng(),
        "model_config": model_config,
        "train_config": train_config,
        "extra": extra or {},
    }
    bad = non_finite_tensors({"model": payload["model"], "optimizer": payload["optimizer"]})
    if bad:
        raise CheckpointError(
            f"refusing to write checkpoint {str(path)!r} at step {step}: NaN or infinity in "
            f"{', '.join(bad[:5])}{f' and {len(bad) - 5} more' if len(bad) > 5 else ''}; the previous checkpoint "
            "is kept"
        )
    return save_checkpoint(path, payload)


def load_training_state(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_config: dict[str, Any]
) -> int:
    """Restore a run saved by `save_training_state` into ``model`` and ``optimizer``; returns the step to start at.

    The RNG states are restored too, so the run continues to the same losses as an uninterrupted one.

    Args:
        path: the checkpoint file.
        model, optimizer: built as for a fresh run; their state is replaced.
        model_config: the current ``GPTConfig.to_dict()``; it must match the saved one except for `HOW_FIELDS`.

    Raises:
        CheckpointError: the file is missing, corrupt or foreign, was written for another model configuration
            (the differing fields are named), or its state does not fit ``model``/``optimizer``.
    """
    state = load_checkpoint(path)
    saved = {k: v for k, v in state["model_config"].items() if k not in HOW_FIELDS}
    diff = config_diff(saved, {k: v for k, v in model_config.items() if k not in HOW_FIELDS})
    if diff:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was written for another model configuration ({'; '.join(diff)}); "
            "pass the same model settings, or start a new run in another --save directory"
        )
    try:
        if any(hasattr(p, "device_mesh") for p in model.parameters()):  # sharded: FSDP2, offloaded states
            _load_full_into_shards(model, optimizer, state["model"], state["optimizer"])
        else:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError, IndexError) as e:
        raise CheckpointError(f"checkpoint {str(path)!r} does not fit this model: {e}") from e
    restore_rng(state["rng"])
    return int(state["step"])


def _load_full_into_shards(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict[str, Any], optim_sd: dict[str, Any]
) -> None:
    """A single process's whole state (``model.state_dict()``, ``optimizer.state_dict()``) into a model whose
    parameters are DTensor shards (FSDP2, its states in host memory or not), on every rank: each takes its shard.
    The optimizer's states are keyed by position in its parameter groups, which the same model and
    ``build_optimizer`` give in the same order; the shapes are checked against the parameters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    saved_groups = optim_sd["param_groups"]
    if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise ValueError(
            f"the optimizer's parameter groups hold {[len(g['params']) for g in optimizer.param_groups]} "
            f"parameters, the checkpoint's {[len(g['params']) for g in saved_groups]}"
        )
    index = [i for g in saved_groups for i in g["params"]]
    fqn = dict(zip(index, order, strict=True))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    state = {}
    for i, st in optim_sd["state"].items():
        name = fqn[i]
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and tuple(v.shape) != shapes[name]:
                raise ValueError(f"the optimizer state {k!r} of {name} is {tuple(v.shape)}, the parameter "
                                 f"{shapes[name]}")  # fmt: skip
        state[name] = st
    groups = [{**g, "params": [fqn[i] for i in g["params"]]} for g in saved_groups]
    optim_full = {"state": state, "param_groups": groups}
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_full,
                   options=StateDictOptions(full_state_dict=True))  # fmt: skip


# -- sharded checkpoints (torch.distributed.checkpoint) -----------------------------------------------------

SHARDED_META = "longctx.pt"


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _barrier() -> None:
    dist = _dist()
    if dist is not None and dist.get_world_size() > 1:
        dist.barrier()


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank (every rank gets the same answer)."""
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def shard_file_crcs(folder: Path) -> dict[str, int]:
    """CRC-32 of every file of a sharded checkpoint folder but ``longctx.pt`` (which carries its own checksums)."""
    return {p.name: _file_crc(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != SHARDED_META}


def _bad_shard_files(folder: Path, expected: dict[str, int]) -> list[str]:
    """The files of ``folder`` that are missing or whose CRC-32 differs from ``expected``."""
    bad = []
    for name, crc in expected.items():
        path = folder / name
        if not path.is_file():
            bad.append(f"{name} (missing)")
        elif _file_crc(path) != crc:
            bad.append(f"{name} (checksum mismatch)")
    return bad


def _local_tensors(state: Any) -> Any:
    """The state with every DTensor replaced by this rank's shard (for finiteness checks)."""
    if isinstance(state, dict):
        return {k: _local_tensors(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_local_tensors(v) for v in state]
    return state.to_local() if hasattr(state, "to_local") else state


def remove_partial_dirs(directory: str | Path) -> list[Path]:
    """Delete the ``step-N.tmp`` folders of sharded saves that did not complete; returns them."""
    import shutil

    directory = Path(directory)
    if not directory.is_dir():
        return []
    stale = sorted(p for p in directory.glob("step-*.tmp") if p.is_dir())
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def latest_sharded(path: str | Path) -> Path | None:
    """The newest complete sharded checkpoint at ``path``: the folder itself if it is one, else its newest
    ``step-N`` folder (``.tmp`` folders are incomplete and ignored); None if there is none."""
    path = Path(path)
    if (path / ".metadata").is_file() and (path / SHARDED_META).is_file():
        return path
    if not path.is_dir():
        return None
    done = [
        p for p in path.glob("step-*")
        if p.is_dir() and not p.name.endswith(".tmp") and (p / ".metadata").is_file() and (p / SHARDED_META).is_file()
    ]  # fmt: skip
    return max(done, key=lambda p: p.name) if done else None


def read_sharded_meta(path: str | Path) -> dict[str, Any]:
    """The ``longctx.pt`` of the newest complete sharded checkpoint at ``path`` (step, configs, extra), verified.

    Raises:
        CheckpointError: no complete sharded checkpoint at ``path``, or a corrupt or foreign ``longctx.pt``.
    """
    found = latest_sharded(path)
    if found is None:
        raise CheckpointError(
            f"no complete sharded checkpoint at {str(path)!r} (a folder holding step-N/ folders, or one of them); "
            "train without --resume first, or pass the right path"
        )
    meta_path = found / SHARDED_META
    try:
        data = torch.load(meta_path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{str(meta_path)!r} is corrupt ({type(e).__name__}); restore a good copy") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise CheckpointError(f"{str(meta_path)!r} is not a longctx checkpoint of format version {VERSION}")
    _verify(meta_path, data)
    data["path"] = str(found)
    return data


def save_sharded_state(
    directory: str | Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_config: dict[str, Any],
    train_config: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Checkpoint a (sharded) training run after ``step`` steps with `torch.distributed.checkpoint`; every rank
    calls it. Returns the complete ``<directory>/step-N`` folder.

    The shards go to ``step-N.tmp/``; the first rank then writes ``longctx.pt`` (step, RNG states, both configs,
    ``extra``, checksums), renames the folder to ``step-N`` and deletes the older ones, so the previous checkpoint
    stays whole until the new one is complete.

    Raises:
        CheckpointError: on every rank, when any rank's shard of the model or optimizer state holds NaN or
            infinity (nothing is written).
    """
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    directory = Path(directory)
    dist = _dist()
    first = dist is None or dist.get_rank() == 0
    model_sd, optim_sd = get_state_dict(model, optimizer)
    bad = non_finite_tensors({"model": _local_tensors(model_sd), "optimizer": _local_tensors(optim_sd)})
    if _any_rank(bool(bad)):
        where = ", ".join(bad[:5]) if bad else "another rank's shard"
        raise CheckpointError(
            f"refusing to write checkpoint {str(directory)!r} at step {step}: NaN or infinity in {where}; the "
            "previous checkpoint is kept"
        )
    final = directory / f"step-{step:08d}"
    tmp = directory / f"step-{step:08d}.tmp"
    if first:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    with warnings.catch_warnings():  # one process writing every shard: what is meant without a process group
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp))
    _barrier()  # every rank's shards are on disk
    if first:
        meta = {
            "step": step,
            "rng": capture_rng(),
            "model_config": model_config,
            "train_config": train_config,
            "extra": extra or {},
            "shard_files": shard_file_crcs(tmp),
        }
        save_checkpoint(tmp / SHARDED_META, meta)
        if final.exists():  # the same step saved again: put the old copy aside until the new one is in place
            aside = directory / f"step-{step:08d}.old.tmp"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
        os.replace(tmp, final)  # atomic: the folder is complete or absent under this name
        _fsync_dir(directory)
        for old in directory.glob("step-*"):
            if old != final and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_sharded_state(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_config: dict[str, Any]
) -> int:
    """Restore a run saved by `save_sharded_state` into ``model`` and ``optimizer`` on any number of ranks
    (plain or FSDP2 model, a single process included); returns the step to start at.

    Args:
        path: a folder of ``step-N`` checkpoints (the newest complete one is read) or one of them.
        model, optimizer: built (and sharded) as for a fresh run; their state is replaced.
        model_config: the current ``GPTConfig.to_dict()``; it must match the saved one except for `HOW_FIELDS`.

    Raises:
        CheckpointError: no complete checkpoint, a corrupt ``longctx.pt``, a shard file missing or failing its
            CRC-32 (named), another model configuration (the differing fields are named), or shards that do not
            fit ``model``/``optimizer``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta = read_sharded_meta(path)
    saved = {k: v for k, v in meta["model_config"].items() if k not in HOW_FIELDS}
    diff = config_diff(saved, {k: v for k, v in model_config.items() if k not in HOW_FIELDS})
    if diff:
        raise CheckpointError(
            f"checkpoint {meta['path']!r} was written for another model configuration ({'; '.join(diff)}); "
            "pass the same model settings, or start a new run in another --save directory"
        )
    dist = _dist()
    bad = []
    if dist is None or dist.get_rank() == 0:  # one rank reads the files: the others would read the same bytes
        bad = _bad_shard_files(Path(meta["path"]), meta.get("shard_files", {}))
    if _any_rank(bool(bad)):
        where = ", ".join(bad[:5]) if bad else "files the first rank checked"
        raise CheckpointError(
            f"checkpoint {meta['path']!r} is damaged: {where}; restore a good copy of the folder, or start a new "
            "run in another --save directory"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    try:
        with warnings.catch_warnings():  # a single process reads the shards of every rank: what is meant here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=meta["path"])
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    except Exception as e:
        raise CheckpointError(f"checkpoint {meta['path']!r} does not fit this model: {str(e)[:500]}") from e
    restore_rng(meta["rng"])
    return int(meta["step"])
