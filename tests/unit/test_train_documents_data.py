"""Packed documents in byte text: separators, boundaries, positions, cu_seqlens, labels that never cross a document."""

from __future__ import annotations

import pytest
import torch

from longctx.training.config import TrainConfig, parse_config
from longctx.training.data import (
    ByteText,
    document_positions,
    packed_cu_seqlens,
    parse_separator,
    separator_ends,
)


def test_parse_separator_decodes_escapes():
    assert parse_separator(r"\n\n") == b"\n\n"
    assert parse_separator(r"\x00") == b"\x00"
    assert parse_separator("<|end|>") == b"<|end|>"
    assert parse_separator("é") == "é".encode()


@pytest.mark.parametrize("text, match", [("", "is empty"), (r"\x", "invalid escape")])
def test_parse_separator_rejects(text, match):
    with pytest.raises(ValueError, match=match):
        parse_separator(text)


def test_separator_ends_are_left_to_right_without_overlap():
    raw = b"ab\n\n\ncd\n\nef"
    ends = separator_ends(raw, b"\n\n")
    assert ends.nonzero().flatten().tolist() == [3, 8]  # as bytes.split: "ab", "\ncd", "ef"
    assert not separator_ends(b"abc", b"\n\n").any()


def test_positions_and_cu_seqlens():
    starts = torch.tensor([[1, 0, 0, 1, 0], [1, 1, 0, 0, 1]], dtype=torch.bool)
    assert document_positions(starts).tolist() == [[0, 1, 2, 0, 1], [0, 0, 1, 2, 0]]
    cu = packed_cu_seqlens(starts)
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 3, 5, 6, 9, 10]
    # a row not marked at position 0 still starts a document: no document crosses rows
    starts[1, 0] = False
    assert packed_cu_seqlens(starts).tolist() == [0, 3, 5, 6, 9, 10]


def _file(tmp_path, docs: list[bytes], sep: bytes):
    path = tmp_path / "docs.txt"
    path.write_bytes(sep.join(docs))
    return path


def test_byte_text_batch_marks_boundaries_and_masks_cross_document_labels(tmp_path):
    sep = b"\n\n"
    docs = [bytes([97 + i % 26]) * n for i, n in enumerate([1, 7, 30, 2, 50, 13, 90, 4, 60, 5] * 6)]
    path = _file(tmp_path, docs, sep)
    raw = path.read_bytes()
    S = 64
    task = ByteText(path, S, doc_separator=sep)
    for split in ("train", "eval"):
        b = task.batch(8, step=3, seed=1, split=split)
        data = task.train_data if split == "train" else task.eval_data
        offset = 0 if split == "train" else len(task.train_data)
        assert b.doc_starts.shape == b.inputs.shape == b.loss_mask.shape == (8, S)
        assert b.doc_starts[:, 0].all()
        for row in range(8):
            inputs = bytes(b.inputs[row].tolist())
            # where the row came from, to check it against the file's own separators
            start = next(i for i in range(len(data) - S) if raw[offset + i : offset + i + S] == inputs)
            for i in range(S):
                g = offset + start + i
                assert bool(b.loss_mask[row, i]) == (not _ends_at(raw, sep, g)), (row, i)
                if i > 0:
                    assert bool(b.doc_starts[row, i]) == _ends_at(raw, sep, g - 1), (row, i)
            assert int(b.labels[row, -1]) == raw[offset + start + S]  # labels: inputs shifted by one


def _ends_at(raw: bytes, sep: bytes, g: int) -> bool:
    """Whether byte g ends a separator occurrence, taking occurrences left to right without overlap."""
    pos = 0
    while True:
        j = raw.find(sep, pos)
        if j < 0 or j > g:
            return False
        if j + len(sep) - 1 == g:
            return True
        pos = j + len(sep)


def test_labels_never_cross_a_document(tmp_path):
    """Every counted (input, label) pair lies inside one document: the label's document is the input's."""
    sep = b"\x00"
    docs = [bytes([65 + i % 20]) * (1 + (7 * i) % 23) for i in range(200)]
    task = ByteText(_file(tmp_path, docs, sep), 48, doc_separator=sep)
    b = task.batch(6, step=0, seed=2)
    doc_id = b.doc_starts.long().cumsum(1)  # (B, S): document of each input
    # the label of input i is input i + 1: counted pairs never have a document start at i + 1
    assert not (b.loss_mask[:, :-1] & b.doc_starts[:, 1:]).any()
    assert (doc_id[:, 1:] == doc_id[:, :-1])[b.loss_mask[:, :-1]].all()
    # the separator (a document's last byte) is the only byte not counted
    assert ((b.inputs == 0) == ~b.loss_mask).all()
    pos = document_positions(b.doc_starts)
    inside = ~b.doc_starts[:, 1:]
    assert (pos[b.doc_starts] == 0).all()
    assert (pos[:, 1:][inside] == pos[:, :-1][inside] + 1).all()


def test_without_a_separator_nothing_changes(tmp_path):
    path = _file(tmp_path, [b"x" * 300, b"y" * 300], b"\n\n")
    plain = ByteText(path, 32).batch(4, step=1, seed=0)
    assert plain.loss_mask is None and plain.doc_starts is None
    docs = ByteText(path, 32, doc_separator=b"\n\n").batch(4, step=1, seed=0)
    assert torch.equal(plain.inputs, docs.inputs) and torch.equal(plain.labels, docs.labels)


def test_config_doc_separator(tmp_path):
    assert TrainConfig().doc_separator is None  # off by default
    path = _file(tmp_path, [b"a" * 400], b"\n")
    cfg = parse_config(["--data", str(path), "--doc-separator", r"\n\n"])
    assert parse_separator(cfg.doc_separator) == b"\n\n"
    with pytest.raises(ValueError, match="no --data file was given"):
        TrainConfig(doc_separator=r"\n\n")
    with pytest.raises(ValueError, match="doc_separator '' is empty"):
        TrainConfig(data=str(path), doc_separator="")
