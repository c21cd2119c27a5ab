"""Training data without a download: the embedded multi-query associative recall task, or bytes of a text file.

Multi-query associative recall (MQAR; Arora et al., "Zoology", 2023), spread over a long sequence:

    position:  0 ........................................................ S-2q      S
    tokens:    n . n k3 v3 n n . k1 v1 n n n . n k2 v2 n . n n k7 v7 n ... | k2 v2 k7 v7 k1 v1 ...
               `-------- key-value pairs scattered among noise tokens --------'  `--- queries ---'

Each sequence draws its own key -> value map, so nothing can be memorised: the value after a query key
is predictable only by finding that key far back in the context and copying the token after it (an
induction head). Loss and accuracy count only the answers (the value after each query key). Chance
accuracy is 1 / num_values.

Every batch is a pure function of (seed, split, step): training is reproducible, resuming needs no data
state, and the held-out split ("eval") uses a disjoint stream of generator seeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Batch", "RecallTask", "ByteText"]

_SPLIT_SALT = {"train": 0x5EED_0001, "eval": 0x5EED_0002}


@dataclass
class Batch:
    """inputs (B, S) int64; labels (B, S) int64 (inputs shifted by one); loss_mask (B, S) bool."""

    inputs: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor | None

    def to(self, device: torch.device | str) -> Batch:
        """The same batch on ``device``."""
        m = None if self.loss_mask is None else self.loss_mask.to(device, non_blocking=True)
        return Batch(self.inputs.to(device, non_blocking=True), self.labels.to(device, non_blocking=True), m)


def _generator(seed: int, split: str, step: int) -> torch.Generator:
    if split not in _SPLIT_SALT:
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + _SPLIT_SALT[split]) * 1_000_033 + step)
    return g


@dataclass(frozen=True)
class RecallTask:
    """Multi-query associative recall over sequences of ``seq_length`` tokens.

    Vocabulary: [0, num_keys) keys, then ``num_values`` values, then noise tokens up to ``vocab_size``.

    Args:
        seq_length: tokens per sequence (model input length).
        vocab_size: must hold keys + values + at least one noise token.
        num_pairs: key-value pairs stored per sequence (distinct keys).
        num_queries: how many of them are queried at the end (<= num_pairs).
        num_keys, num_values: sizes of the key and value vocabularies.
    """

    seq_length: int = 128
    vocab_size: int = 32
    num_pairs: int = 4
    num_queries: int = 4
    num_keys: int = 8
    num_values: int = 8

    def __post_init__(self) -> None:
        if self.num_keys + self.num_values >= self.vocab_size:
            raise ValueError(
                f"RecallTask needs vocab_size > num_keys + num_values (room for noise tokens), got "
                f"vocab_size={self.vocab_size}, num_keys={self.num_keys}, num_values={self.num_values}"
            )
        if not 1 <= self.num_queries <= self.num_pairs <= self.num_keys:
            raise ValueError(
                f"RecallTask needs 1 <= num_queries <= num_pairs <= num_keys, got num_queries={self.num_queries}, "
                f"num_pairs={self.num_pairs}, num_keys={self.num_keys}"
            )
        slots = (self.seq_length + 1 - 2 * self.num_queries) // 2
        if slots < self.num_pairs:
            raise ValueError(
                f"seq_length={self.seq_length} is too short for {self.num_pairs} pairs and {self.num_queries} "
                f"queries; need at least {2 * (self.num_pairs + self.num_queries)} tokens"
            )

    @property
    def chance_accuracy(self) -> float:
        """Accuracy of guessing a value uniformly: 1 / num_values."""
        return 1.0 / self.num_values

    def batch(self, batch_size: int, step: int, seed: int, split: str = "train") -> Batch:
        """The batch of ``step``: a pure function of (seed, split, step).

        Args:
            batch_size: sequences B.
            step: training step (or eval batch index).
            seed: the run's seed.
            split: "train" or "eval" (disjoint generator streams).

        Returns:
            A `Batch` of (B, seq_length) tensors; ``loss_mask`` marks the query keys, whose labels are the answers.

        Raises:
            ValueError: an unknown split.
        """
        g = _generator(seed, split, step)
        B, S, n, nq = batch_size, self.seq_length, self.num_pairs, self.num_queries
        K, V = self.num_keys, self.num_values
        total = S + 1
        ctx = total - 2 * nq  # context tokens before the queries
        noise_lo = K + V
        seq = torch.randint(noise_lo, self.vocab_size, (B, total), generator=g)
        keys = torch.rand(B, K, generator=g).argsort(dim=1)[:, :n]  # (B, n) distinct keys
        values = torch.randint(K, K + V, (B, n), generator=g)  # (B, n)
        slots = torch.rand(B, ctx // 2, generator=g).argsort(dim=1)[:, :n]  # (B, n) distinct pair slots
        pos = 2 * slots
        seq.scatter_(1, pos, keys)
        seq.scatter_(1, pos + 1, values)
        order = torch.rand(B, n, generator=g).argsort(dim=1)[:, :nq]  # which pairs are queried, in what order
        qpos = ctx + 2 * torch.arange(nq)
        seq[:, qpos] = keys.gather(1, order)
        seq[:, qpos + 1] = values.gather(1, order)
        inputs, labels = seq[:, :S], seq[:, 1:]
        loss_mask = torch.zeros(B, S, dtype=torch.bool)
        loss_mask[:, qpos] = True  # the input is a query key, the label its value
        return Batch(inputs.contiguous(), labels.contiguous(), loss_mask)


class ByteText:
    """Byte-level language modelling on a text file: vocabulary 256, random windows; the last 10% is held out.

    Args:
        path: any file (read as bytes).
        seq_length: tokens per window.
    """

    vocab_size = 256

    def __init__(self, path: str | Path, seq_length: int) -> None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--data {str(path)!r} is not a readable file")
        data = torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8).to(torch.int64)
        n_eval = max(len(data) // 10, seq_length + 1)
        if len(data) - n_eval < seq_length + 1:
            raise ValueError(
                f"--data {str(path)!r} has {len(data)} bytes; with seq_length={seq_length} it needs at least "
                f"{2 * (seq_length + 1) + seq_length} bytes (a training part and a 10% held-out part)"
            )
        self.seq_length = seq_length
        self.train_data = data[: len(data) - n_eval]
        self.eval_data = data[len(data) - n_eval :]

    def batch(self, batch_size: int, step: int, seed: int, split: str = "train") -> Batch:
        """``batch_size`` random windows of the train (or held-out) bytes, a pure function of (seed, split, step).

        Returns:
            A `Batch` of (B, seq_length) tensors, ``loss_mask`` None (every byte counts).

        Raises:
            ValueError: an unknown split.
        """
        g = _generator(seed, split, step)
        data = self.train_data if split == "train" else self.eval_data
        S = self.seq_length
        starts = torch.randint(0, len(data) - S, (batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(S + 1)  # (B, S + 1)
        seq = data[idx]
        return Batch(seq[:, :S].contiguous(), seq[:, 1:].contiguous(), None)
