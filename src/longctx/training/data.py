r"""Training data without a download: the embedded multi-query associative recall task, or bytes of a text file.

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

Packed documents in byte text (``ByteText(..., doc_separator=b"\n\n")``): a separator ends a document (it is
its last bytes, as an end-of-document token would be), so a window of the file holds several documents:

    inputs      a b c \n \n d e f \n \n g h          separator "\n\n"
    doc_starts  1 0 0 0  0  1 0 0 0  0  1 0
    positions   0 1 2 3  4  0 1 2 3  4  0 1          RoPE restarts in every document
    loss_mask   1 1 1 1  0  1 1 1 1  0  1 1          the separator's last byte does not predict the next document

`Batch.doc_starts` is the single record of the boundaries; `document_positions` and `packed_cu_seqlens` derive the
positions and flash-attn's cu_seqlens from it (row boundaries are document boundaries too, so the rows packed
end to end are one packed sequence).
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from longctx.masks.packing import document_positions, packed_cu_seqlens

__all__ = [
    "Batch",
    "RecallTask",
    "ByteText",
    "parse_separator",
    "separator_ends",
    "document_positions",
    "packed_cu_seqlens",
]

_SPLIT_SALT = {"train": 0x5EED_0001, "eval": 0x5EED_0002}


@dataclass
class Batch:
    """inputs (B, S) int64; labels (B, S) int64 (inputs shifted by one); loss_mask (B, S) bool; doc_starts
    (B, S) bool, True where a document starts (position 0 of every row included), or None (one sequence per row)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor | None
    doc_starts: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> Batch:
        """The same batch on ``device``."""
        m, d = (None if t is None else t.to(device, non_blocking=True) for t in (self.loss_mask, self.doc_starts))
        return Batch(self.inputs.to(device, non_blocking=True), self.labels.to(device, non_blocking=True), m, d)


def parse_separator(text: str) -> bytes:
    """The bytes of a ``--doc-separator`` value: backslash escapes decoded (``\\n``, ``\\t``, ``\\x00``,
    ``\\\\``), every other character as UTF-8.

    Raises:
        ValueError: an empty separator or an invalid escape, naming the value.
    """
    try:
        sep = codecs.escape_decode(text.encode("utf-8"))[0]
    except ValueError as e:
        raise ValueError(
            f"doc_separator {text!r} has an invalid escape ({e}); write bytes as \\n, \\t or \\xHH"
        ) from None
    if not sep:
        raise ValueError(
            f"doc_separator {text!r} is empty; pass the bytes that end a document (e.g. '\\n\\n' or '\\x00'), "
            "or leave it unset to train on one sequence per row"
        )
    return sep


def separator_ends(raw: bytes, separator: bytes) -> torch.Tensor:
    """(len(raw),) bool: True at the last byte of every occurrence of ``separator`` in ``raw``, occurrences taken
    left to right without overlap (as ``bytes.split``)."""
    ends = torch.zeros(len(raw), dtype=torch.bool)
    last = [m.end() - 1 for m in re.finditer(re.escape(separator), raw)]
    ends[torch.tensor(last, dtype=torch.int64)] = True
    return ends


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
        doc_separator: the bytes that end a document (e.g. ``b"\\n\\n"``); given, every window carries its
            document boundaries (`Batch.doc_starts`) and its loss mask never predicts across one. None: one
            sequence per window, every byte counted.
    """

    vocab_size = 256

    def __init__(self, path: str | Path, seq_length: int, doc_separator: bytes | None = None) -> None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--data {str(path)!r} is not a readable file")
        raw = p.read_bytes()
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
        n_eval = max(len(data) // 10, seq_length + 1)
        if len(data) - n_eval < seq_length + 1:
            raise ValueError(
                f"--data {str(path)!r} has {len(data)} bytes; with seq_length={seq_length} it needs at least "
                f"{2 * (seq_length + 1) + seq_length} bytes (a training part and a 10% held-out part)"
            )
        if doc_separator is not None and (not isinstance(doc_separator, bytes) or not doc_separator):
            raise ValueError(f"doc_separator must be non-empty bytes or None, got {doc_separator!r}")
        self.seq_length = seq_length
        self.doc_separator = doc_separator
        self.train_data = data[: len(data) - n_eval]
        self.eval_data = data[len(data) - n_eval :]
        self.train_ends = self.eval_ends = None
        if doc_separator is not None:
            ends = separator_ends(raw, doc_separator)  # over the whole file: a separator may straddle the split
            self.train_ends, self.eval_ends = ends[: len(self.train_data)], ends[len(self.train_data) :]

    def batch(self, batch_size: int, step: int, seed: int, split: str = "train") -> Batch:
        """``batch_size`` random windows of the train (or held-out) bytes, a pure function of (seed, split, step).

        Returns:
            A `Batch` of (B, seq_length) tensors. Without documents ``loss_mask`` is None (every byte counts);
            with them ``doc_starts`` marks the first byte of every document (and position 0 of each row) and
            ``loss_mask`` drops the last byte of each separator (its label starts the next document).

        Raises:
            ValueError: an unknown split.
        """
        g = _generator(seed, split, step)
        data = self.train_data if split == "train" else self.eval_data
        S = self.seq_length
        starts = torch.randint(0, len(data) - S, (batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(S + 1)  # (B, S + 1)
        seq = data[idx]
        inputs, labels = seq[:, :S].contiguous(), seq[:, 1:].contiguous()
        if self.doc_separator is None:
            return Batch(inputs, labels, None)
        ends = (self.train_ends if split == "train" else self.eval_ends)[idx[:, :S]]  # (B, S): input ends a document
        doc_starts = torch.ones_like(ends)
        doc_starts[:, 1:] = ends[:, :-1]  # (B, S): the byte after a separator starts a document
        return Batch(inputs, labels, ~ends, doc_starts)
