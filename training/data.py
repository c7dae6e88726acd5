"""Corpus and task for the shipped pair: CPython's stdlib source + arithmetic as Python.

Two sources, both available on every machine with Python and nothing downloaded:

* **Code**: the ``*.py`` files of the standard library this interpreter runs
  on (``sysconfig.get_paths()["stdlib"]``), without ``site-packages`` /
  ``dist-packages`` and without test directories. Files are split into train
  and held-out by a hash of their relative path (deterministic, independent of
  file order), so held-out code prompts come from files never trained on.
* **Task**: ``assert A + B == C`` with ``0 <= A, B <= MAX_OPERAND`` (one- and
  two-digit operands), one statement a line. The held-out set is drawn with
  its own seed from all pairs and the training sampler draws only from the
  complement, so no held-out pair is ever trained on. Scoring is exact match
  of the greedy continuation of ``assert A + B ==`` up to the newline.

Batches are a pure function of ``(seed, step)``: resuming at step ``s`` needs
no data-loader state beyond the seed, and replays exactly the batches an
uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sysconfig
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from training import tokenizer as tokenizer_lib

MAX_OPERAND = 99
HELDOUT_SEED = 20241
HELDOUT_SIZE = 500
HELDOUT_CODE_PERCENT = 5  # % of stdlib files held out (by path hash)
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


# ----------------------------------------------------------------------------- code


def stdlib_root() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: os.PathLike | None = None) -> list[str]:
    """Relative paths of the stdlib ``*.py`` files used as corpus, sorted."""
    root = pathlib.Path(root) if root is not None else stdlib_root()
    out = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root)
        if any(part in _EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        out.append(rel.as_posix())
    return sorted(out)


def is_heldout_file(rel_path: str) -> bool:
    h = int(hashlib.sha256(rel_path.encode()).hexdigest()[:8], 16)
    return h % 100 < HELDOUT_CODE_PERCENT


def split_files(files: Sequence[str]) -> tuple[list[str], list[str]]:
    train = [f for f in files if not is_heldout_file(f)]
    held = [f for f in files if is_heldout_file(f)]
    return train, held


def read_code(root: pathlib.Path, rel_paths: Sequence[str]) -> list[str]:
    texts = []
    for rel in rel_paths:
        try:
            texts.append((root / rel).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


# ----------------------------------------------------------------------------- task


def task_line(a: int, b: int) -> str:
    return f"assert {a} + {b} == {a + b}\n"


def task_prompt(a: int, b: int) -> str:
    """What the model is given; the answer is the greedy continuation to ``\\n``."""
    return f"assert {a} + {b} =="


def task_answer(a: int, b: int) -> str:
    return str(a + b)


def all_pairs(max_operand: int = MAX_OPERAND) -> np.ndarray:
    """``[N, 2]`` every ``(a, b)``, in a fixed order."""
    r = np.arange(max_operand + 1)
    a, b = np.meshgrid(r, r, indexing="ij")
    return np.stack([a.ravel(), b.ravel()], axis=1)


def heldout_pairs(
    n: int = HELDOUT_SIZE, seed: int = HELDOUT_SEED, max_operand: int = MAX_OPERAND
) -> np.ndarray:
    """``[n, 2]`` distinct held-out pairs, drawn with their own seed."""
    pairs = all_pairs(max_operand)
    idx = np.random.default_rng(seed).choice(len(pairs), size=n, replace=False)
    return pairs[np.sort(idx)]


def train_pairs(
    heldout: np.ndarray | None = None, max_operand: int = MAX_OPERAND
) -> np.ndarray:
    """Every pair not in the held-out set (dedupe by construction)."""
    heldout = heldout_pairs(max_operand=max_operand) if heldout is None else heldout
    pairs = all_pairs(max_operand)
    held = {(int(a), int(b)) for a, b in heldout}
    keep = np.array([(int(a), int(b)) not in held for a, b in pairs])
    return pairs[keep]


def sample_task_pairs(rng: np.random.Generator, pool: np.ndarray, n: int) -> np.ndarray:
    return pool[rng.integers(0, len(pool), size=n)]


def score_answer(generated: str, expected: str) -> bool:
    """Exact match: the text up to the first newline, stripped, equals ``expected``."""
    line = generated.split("\n", 1)[0]
    return line.strip() == expected.strip()


# ----------------------------------------------------------------------------- corpus


@dataclass
class Corpus:
    """Tokenized corpus: the tokenizer and flat token streams."""

    tokenizer: object
    code_train: np.ndarray  # int32 stream, files separated by <eos>
    code_heldout: np.ndarray
    heldout_files: list[str]
    task_pool: np.ndarray  # [N, 2] train pairs
    task_heldout: np.ndarray  # [n, 2]
    task_tokens: list[np.ndarray]  # bare ids of task_line for every pair in all_pairs order
    task_prompt_lens: np.ndarray  # tokens of task_prompt for every pair (a prefix of the line)
    max_operand: int = MAX_OPERAND

    def line_tokens(self, a: int, b: int) -> np.ndarray:
        return self.task_tokens[int(a) * (self.max_operand + 1) + int(b)]

    def prompt_len(self, a: int, b: int) -> int:
        return int(self.task_prompt_lens[int(a) * (self.max_operand + 1) + int(b)])


def _flatten(docs: list[list[int]]) -> np.ndarray:
    parts = []
    for ids in docs:
        parts.append(np.asarray(ids, np.int32))
        parts.append(np.asarray([tokenizer_lib.EOS_ID], np.int32))
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def build_corpus(
    cache_dir: os.PathLike,
    *,
    vocab_size: int = tokenizer_lib.DEFAULT_VOCAB_SIZE,
    root: os.PathLike | None = None,
    max_files: int | None = None,
    tokenizer_path: os.PathLike | None = None,
) -> Corpus:
    """Trains (or loads) the tokenizer and tokenizes the corpus, cached in ``cache_dir``.

    Args:
      cache_dir: where ``tokenizer.json`` and the token streams are kept.
      vocab_size: BPE vocabulary size, special tokens included.
      root: stdlib directory (default: this interpreter's).
      max_files: use only the first N files of each split (tests).
      tokenizer_path: use this tokenizer instead of training one.
    """
    cache = pathlib.Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    root = pathlib.Path(root) if root is not None else stdlib_root()
    files = stdlib_files(root)
    train_files, held_files = split_files(files)
    if max_files is not None:
        train_files, held_files = train_files[:max_files], held_files[: max(1, max_files // 10)]
    held = heldout_pairs()
    pool = train_pairs(held)
    pairs = all_pairs()

    tok_file = cache / "tokenizer.json"
    meta_file = cache / "corpus.json"
    meta = {
        "vocab_size": vocab_size,
        "root": str(root),
        "train_files": len(train_files),
        "heldout_files": len(held_files),
        "tokenizer_path": str(tokenizer_path) if tokenizer_path else None,
    }
    cached = (
        meta_file.exists()
        and json.loads(meta_file.read_text()) == meta
        and (cache / "code_train.npy").exists()
    )
    if cached:
        tok = tokenizer_lib.load_tokenizer(tok_file)
        code_train = np.load(cache / "code_train.npy")
        code_held = np.load(cache / "code_heldout.npy")
    else:
        train_texts = read_code(root, train_files)
        held_texts = read_code(root, held_files)
        if tokenizer_path is not None:
            tok = tokenizer_lib.load_tokenizer(tokenizer_path)
        else:
            rng = np.random.default_rng(0)
            task_texts = [
                "".join(task_line(a, b) for a, b in sample_task_pairs(rng, pool, 16))
                for _ in range(2000)
            ]
            tok = tokenizer_lib.train_tokenizer(train_texts + task_texts, vocab_size)
        tok.save(str(tok_file))
        code_train = _flatten(tokenizer_lib.encode_batch(tok, train_texts))
        code_held = _flatten(tokenizer_lib.encode_batch(tok, held_texts))
        np.save(cache / "code_train.npy", code_train)
        np.save(cache / "code_heldout.npy", code_held)
        meta_file.write_text(json.dumps(meta))
    lines = [task_line(int(a), int(b)) for a, b in pairs]
    task_tokens = [np.asarray(ids, np.int32) for ids in tokenizer_lib.encode_batch(tok, lines)]
    prompts = [task_prompt(int(a), int(b)) for a, b in pairs]
    prompt_lens = np.array([len(ids) for ids in tokenizer_lib.encode_batch(tok, prompts)])
    return Corpus(
        tokenizer=tok,
        code_train=code_train,
        code_heldout=code_held,
        heldout_files=held_files,
        task_pool=pool,
        task_heldout=held,
        task_tokens=task_tokens,
        task_prompt_lens=prompt_lens,
    )


# ----------------------------------------------------------------------------- batches


def _code_row(rng: np.random.Generator, stream: np.ndarray, length: int) -> np.ndarray:
    off = int(rng.integers(0, max(1, len(stream) - length)))
    body = stream[off : off + length]
    row = np.full((length + 1,), tokenizer_lib.PAD_ID, np.int32)
    row[0] = tokenizer_lib.BOS_ID
    row[1 : 1 + len(body)] = body
    return row


def _task_row(
    rng: np.random.Generator, corpus: Corpus, pool: np.ndarray, length: int
) -> tuple[np.ndarray, np.ndarray]:
    """Packed task lines and a mask of their answer tokens (`` 85\n``)."""
    row = np.empty((length + 1,), np.int32)
    answer = np.zeros((length + 1,), bool)
    row[0] = tokenizer_lib.BOS_ID
    n = 1
    # Lines are ~13 tokens; draw generously, use what fits, truncate the last.
    pairs = sample_task_pairs(rng, pool, length // 8 + 2)
    for a, b in pairs:
        ids = corpus.line_tokens(a, b)
        take = min(len(ids), length + 1 - n)
        row[n : n + take] = ids[:take]
        answer[n + corpus.prompt_len(a, b) : n + take] = True
        n += take
        if n == length + 1:
            break
    if n < length + 1:
        row[n:] = tokenizer_lib.PAD_ID
    return row, answer


def make_batch(
    corpus: Corpus,
    *,
    seed: int,
    step: int,
    batch_size: int,
    seq_len: int,
    task_fraction: float,
    split: str = "train",
    with_answer_mask: bool = False,
):
    """``[batch_size, seq_len + 1]`` int32 rows, each starting with ``<bos>``.

    A pure function of its arguments. The first ``round(batch_size *
    task_fraction)`` rows are packed task lines, the rest code windows.
    ``split="heldout"`` draws held-out code files and held-out task pairs.
    With ``with_answer_mask``, also returns a same-shaped bool mask of the
    task answers' tokens (what the task is scored on; the loss weights them).
    """
    rng = np.random.default_rng([seed, step, 0 if split == "train" else 1])
    stream = corpus.code_train if split == "train" else corpus.code_heldout
    pool = corpus.task_pool if split == "train" else corpus.task_heldout
    n_task = int(round(batch_size * task_fraction))
    rows, masks = [], []
    for _ in range(n_task):
        row, mask = _task_row(rng, corpus, pool, seq_len)
        rows.append(row)
        masks.append(mask)
    for _ in range(batch_size - n_task):
        rows.append(_code_row(rng, stream, seq_len))
        masks.append(np.zeros((seq_len + 1,), bool))
    tokens = np.stack(rows)
    return (tokens, np.stack(masks)) if with_answer_mask else tokens


def heldout_code_prompts(
    corpus: Corpus, n: int, prompt_tokens: int = 48, seed: int = 7
) -> list[str]:
    """Text prompts cut from held-out files at line starts (for the compare job)."""
    tok = corpus.tokenizer
    rng = np.random.default_rng(seed)
    root = stdlib_root()
    texts = read_code(root, corpus.heldout_files)
    out: list[str] = []
    tries = 0
    while len(out) < n and tries < 100 * n:
        tries += 1
        text = texts[int(rng.integers(0, len(texts)))]
        lines = text.splitlines(keepends=True)
        if len(lines) < 20:
            continue
        start = int(rng.integers(0, len(lines) - 10))
        chunk = "".join(lines[start : start + 40])
        ids = tokenizer_lib.encode_batch(tok, [chunk])[0][:prompt_tokens]
        snippet = tokenizer_lib.decode(tok, ids)
        if len(snippet.strip()) < 20:
            continue
        out.append(snippet)
    return out
