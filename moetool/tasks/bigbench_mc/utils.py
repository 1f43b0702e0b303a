"""Datasets for moetool's offline BIG-bench multiple-choice tasks (read from moetool/data/mc/).

lm-eval calls `load(task=..., letters=...)` through each task YAML's `custom_dataset`, so the
tasks never touch the network or the Hugging Face cache. MMLU's layout: a 5-item `dev` split for
few-shot examples (the first 5 items, in file order) and a `test` split with the rest.

    load(task="general_knowledge", letters=True)["test"][0]["letters"]  # ['A', 'B', ...]
"""

from __future__ import annotations

import hashlib
import random

import datasets

from moetool.datasets import mc_task

DEV_ITEMS = 5  # MMLU's dev split holds 5 questions per subject
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _shuffled(question: str, choices: tuple[str, ...], answer: int) -> tuple[list[str], int]:
    """A per-item, run-independent permutation of the choices.

    BIG-bench lists the right answer first in emoji_movie and logical_sequence (every item) and in
    most general_knowledge items, so lettered choices in file order would reward a model that
    always answers 'A'.
    """
    order = list(range(len(choices)))
    # Seeded by the choices too: every logical_sequence item asks the same question.
    seed = hashlib.sha256("\n".join((question, *choices)).encode()).digest()
    random.Random(seed).shuffle(order)
    return [choices[i] for i in order], order.index(answer)


def load(task: str, letters: bool = False, **_: object) -> datasets.DatasetDict:
    """`dev` and `test` splits of one task; `letters` shuffles choices and adds their letters."""
    rows = []
    for q in mc_task(task):
        choices, answer = _shuffled(q.question, q.choices, q.answer) if letters else (list(q.choices), q.answer)
        rows.append({"question": q.question, "choices": choices, "answer": answer,
                     "letters": list(LETTERS[:len(choices)])})
    return datasets.DatasetDict({"dev": datasets.Dataset.from_list(rows[:DEV_ITEMS]),
                                 "test": datasets.Dataset.from_list(rows[DEV_ITEMS:])})
