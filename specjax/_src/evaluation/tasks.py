"""Evaluation sets and answer checking: prompts with their answers, and whether a reply holds one.

An evaluation directory holds a file of task prompts with answers (``{"prompt", "answer"}``
rows) and a file of open prompts (``{"prompt"}`` rows), one JSON object per line. Two kinds
ship with specjax: the embedded pair's (held-out arithmetic problems, answered on the
completion's first line, and snippets of held-out stdlib files) and the chat pairs' (short
questions whose answer must occur in the reply as a whole word, and open chat prompts).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np

from specjax._src.models.chat import encode_chat

TASK_FILE = "arith_heldout.jsonl"  # {prompt, answer}: held-out arithmetic problems
CODE_FILE = "code_prompts.jsonl"  # {prompt}: snippets of held-out stdlib files
CHAT_TASK_FILE = "task.jsonl"  # {prompt, answer}: short questions with one answer
CHAT_OPEN_FILE = "heldout_prompts.jsonl"  # {prompt}: chat prompts on subjects the draft never saw


@dataclasses.dataclass
class EvalSet:
    """Prompts as token lists; ``answers[i]`` is None for open (code / chat) prompts.

    ``scoring``: "first_line" (the completion's first line equals the answer)
    or "word" (the answer occurs as a whole word, case-insensitive).
    ``timed_open_only``: time the open prompts alone (the chat set's task
    questions have answers of a few tokens, where a prefill dominates); the
    task questions then run once per row, untimed, to be scored.
    """

    prompts: list[list[int]]
    answers: list[str | None]
    scoring: str = "first_line"
    timed_open_only: bool = False

    def correct(self, completion: str, answer: str) -> bool:
        if self.scoring == "word":
            return answer_in_reply(completion, answer)
        return task_correct(completion, answer)

    @property
    def task_mask(self) -> np.ndarray:
        return np.array([a is not None for a in self.answers], bool)

    @property
    def timed_mask(self) -> np.ndarray:
        """The prompts whose decoding is timed."""
        if self.timed_open_only and not self.task_mask.all():
            return ~self.task_mask
        return np.ones(len(self.prompts), bool)


def read_jsonl(path: Path) -> list[dict]:
    """The JSON object on each non-empty line; a bad line is named by file and number."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}, line {number}: not JSON ({e}).") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}, line {number}: want a JSON object, got {type(row).__name__}.")
            rows.append(row)
    return rows


def read_eval_rows(eval_dir: Path, task_file: str, open_file: str, num_task: int, num_open: int, kind: str):
    """The first ``num_task`` task rows and ``num_open`` open rows of an evaluation directory."""
    for name in (task_file, open_file):
        if not (eval_dir / name).is_file():
            raise ValueError(
                f"{eval_dir / name} does not exist: {kind} evaluation directory needs {task_file} "
                f'({{"prompt", "answer"}} rows) and {open_file} ({{"prompt"}} rows).'
            )
    task, open_ = read_jsonl(eval_dir / task_file)[:num_task], read_jsonl(eval_dir / open_file)[:num_open]
    for name, rows, keys in ((task_file, task, ("prompt", "answer")), (open_file, open_, ("prompt",))):
        for i, row in enumerate(rows):
            missing = [k for k in keys if k not in row]
            if missing:
                raise ValueError(
                    f"{eval_dir / name}: row {i + 1} lacks {', '.join(map(repr, missing))} "
                    f"(rows need {', '.join(map(repr, keys))})."
                )
    return task, open_


def load_eval_set(tokenizer, eval_dir: Path, num_task: int, num_code: int) -> EvalSet:
    """Held-out task prompts (with answers) then code prompts, tokenized."""
    task, code = read_eval_rows(eval_dir, TASK_FILE, CODE_FILE, num_task, num_code, "an")
    prompts = [tokenizer.encode(row["prompt"]).ids for row in task + code]
    answers = [str(row["answer"]) for row in task] + [None] * len(code)
    return EvalSet(prompts=prompts, answers=answers)


def load_chat_eval_set(target, eval_dir: Path, num_task: int, num_open: int) -> EvalSet:
    """Short-answer task prompts then held-out open chat prompts, each rendered
    with the target's chat template."""
    task, open_ = read_eval_rows(eval_dir, CHAT_TASK_FILE, CHAT_OPEN_FILE, num_task, num_open, "a chat")
    prompts = [encode_chat(target, row["prompt"]) for row in task + open_]
    answers = [str(row["answer"]) for row in task] + [None] * len(open_)
    return EvalSet(prompts=prompts, answers=answers, scoring="word", timed_open_only=True)


def answer_in_reply(completion: str, answer: str) -> bool:
    """The answer occurs in the reply as a whole word (case-insensitive)."""
    return re.search(rf"(?<![\w]){re.escape(answer.strip())}(?![\w])", completion, re.IGNORECASE) is not None


def task_correct(completion: str, answer: str) -> bool:
    """Exact match of the first line of the completion against the answer."""
    first_line = completion.split("\n", 1)[0]
    return first_line.strip() == answer.strip()


def completions(tokenizer, tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
    return [tokenizer.decode(row[:n].tolist()) for row, n in zip(tokens, lengths)]
