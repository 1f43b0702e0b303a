"""A long run's host memory grows only by what its artifact keeps (bench_memory.py --lengths measures it).

Python allocations (tracemalloc) are read three times in one run of 4N tokens, at tokens 2N, 3N and
4N, after a first run has warmed every cache that fills once (router forms, transformers' own, free
lists): what grows in both halves is what the run keeps per token. The run keeps one
step's time for the TPOT percentiles (17 bytes a step in `StepLog`); the Run's token lists are
made at the end. Before `StepLog`, each step kept a `StepRecord` and its float: ~130 bytes a token.
Tensors (the KV cache, which a sequence must keep) are not Python allocations and are not counted.
"""

from __future__ import annotations

import gc
import tracemalloc
from dataclasses import dataclass

import pytest
import torch

from moetool.evaluate import EvalConfig, evaluate
from moetool.quant.quantize import QuantizeConfig, quantize
from moetool.run import RunConfig, run
from helpers import save_char_tokenizer
from tiny import save_tiny

N = 256  # the run is 4N tokens; Python allocations are read at tokens 2N, 3N and 4N
PER_TOKEN = 40  # bytes a token the run may keep: a step's record (17) and its arrays' spare room
# Bytes of allocations that differ between two readings at the same point of a step whatever the
# length: CPython's free lists and torch's small blocks fill up over a run (20-30 KiB over 2N tokens here).
NOISE = 32 << 10
VOCAB = 128  # tests/tiny.py's: no other floating tensor of the tiny model ends in 128


@pytest.fixture(scope="module")
def long_bundle(tmp_path_factory):
    """The tiny qwen2_moe with a character tokenizer and room for 4N tokens and more, at 16, 4 and 2 bits."""
    root = tmp_path_factory.mktemp("long")
    save_tiny("qwen2_moe", root / "ckpt", max_position_embeddings=2048)
    save_char_tokenizer(root / "ckpt")
    quantize(QuantizeConfig(model=str(root / "ckpt"), out=root / "bundle", bits=(16, 4, 2), group_size=16,
                            dtype="float32", hqq_optimize=False))
    return root / "bundle"


@dataclass(frozen=True)
class Kept:
    """Bytes of Python allocations kept over `tokens` tokens, by the line that made them."""

    by_line: dict[str, int]
    tokens: int

    @property
    def bytes(self) -> int:
        return sum(self.by_line.values())

    def per_token(self) -> float:
        return max(0, self.bytes - NOISE) / self.tokens

    def __str__(self) -> str:
        largest = sorted(self.by_line.items(), key=lambda kv: -kv[1])[:5]
        return f"{self.bytes} bytes kept over {self.tokens} tokens; the largest:\n" + "\n".join(
            f"  {size:+} B at {line}" for line, size in largest)


def kept_between(work, first: int, last: int) -> Kept:
    """Python allocations held at progress `last` beyond those at `first` of `work(progress)`.

    Read at `first`, halfway and `last`, each allocating line counts what it kept in the lesser of
    the two halves, twice: a line that keeps something every token keeps it in both halves, while
    what something else alive in the process allocates once (a whole-suite worker once allocated
    181 KB mid-run) lands in one. Traced from before a first `work(None)` (the warm-up), so that
    what fills once is traced full."""
    marks = (first, (first + last) // 2, last)
    seen: dict[int, tracemalloc.Snapshot] = {}

    def progress(done: int, total: int) -> None:
        if done in marks and done not in seen:
            gc.collect()
            seen[done] = tracemalloc.take_snapshot()

    tracemalloc.start(1)  # the allocating line; each frame more slows every allocation of the run
    try:
        work(None)
        work(progress)
    finally:
        tracemalloc.stop()
    halves = [{str(d.traceback[0]): d.size_diff for d in seen[b].compare_to(seen[a], "lineno")}
              for a, b in zip(marks, marks[1:])]
    lines = halves[0].keys() & halves[1].keys()
    return Kept({line: 2 * min(halves[0][line], halves[1][line]) for line in lines
                 if min(halves[0][line], halves[1][line]) > 0}, last - first)


def test_the_reading_counts_what_is_kept_every_token_and_not_what_is_kept_once():
    kept_once: list[bytes] = []
    kept_each: list[bytes] = []

    def work(progress) -> None:
        for done in range(1, 4 * N + 1):
            if progress is not None:
                kept_each.append(bytes(100))  # ~133 bytes a token with its object header and list slot
                if done == 3 * N - 5:
                    kept_once.append(bytes(181_000))
                progress(done, 4 * N)

    kept = kept_between(work, 2 * N, 4 * N)
    assert 120 <= kept.bytes / (2 * N) <= 150, kept
    assert kept.per_token() > PER_TOKEN  # StepRecord's ~130 bytes a token would fail the tests below


def test_a_runs_python_memory_grows_only_by_its_step_log(long_bundle):
    cfg = dict(bundle=long_bundle, policy="lru", budget="50%", clock="sim", decode="host", prompts=("The king said",))
    kept = kept_between(lambda progress: run(RunConfig(**cfg, max_new_tokens=4 * N), progress), 2 * N, 4 * N)
    assert kept.per_token() <= PER_TOKEN, str(kept)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fate", "dymoe", "smoe", "dynaexq"])
def test_no_papers_policy_keeps_anything_per_token(long_bundle, policy):
    cfg = dict(bundle=long_bundle, policy=policy, budget="50%", clock="sim", decode="host", prompts=("The king said",))
    kept = kept_between(lambda progress: run(RunConfig(**cfg, max_new_tokens=4 * N), progress), 2 * N, 4 * N)
    assert kept.per_token() <= PER_TOKEN, f"{policy}: {kept}"


def test_stepwise_perplexity_keeps_its_tokens_nll_not_their_logits(long_bundle, tmp_path):
    """Two windows of 2N tokens, one token a forward: between 2N and 4N tokens in, what grows is the
    engine's step log and one record a window; and mid-window no step's logits are still alive
    (before, a window kept all of its [B, V] logits until its last token: 2N of them here)."""
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    cfg = EvalConfig(task="ppl", bundle=long_bundle, policy="lru", budget="50%", clock="sim", data=text,
                     stepwise=True, context=2 * N, limit=4 * N)
    logits: list[int] = []

    def vocab_rows() -> list[torch.Tensor]:
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dim() >= 2
                and o.shape[-1] == VOCAB and o.dtype.is_floating_point]

    # Tensors of this vocabulary other tests left alive in this process (a worker of the whole suite
    # runs many tiny models of it) are held, so that only the evaluation's own are counted.
    before = vocab_rows()
    held = {id(o) for o in before}  # unique while `before` keeps them alive

    def count_logits(done: int, total: int) -> None:
        if done == N:
            logits.append(sum(1 for o in vocab_rows() if id(o) not in held))

    evaluate(cfg, count_logits)
    assert len(before) == len(held)
    assert logits and logits[0] <= 2, f"{logits} logits tensors alive {N} tokens into a window"
    kept = kept_between(lambda progress: evaluate(cfg, progress), 2 * N, 4 * N - 2)  # 2 x (2N - 1) tokens scored
    assert kept.per_token() <= PER_TOKEN, str(kept)


def test_captured_runs_one_after_another_keep_no_compiled_step_of_the_last(tiny_ckpt):
    """Each captured run left its compiled step alive (the compiler's guards hold it, and it named it in
    engine.decode's globals): a sweep of captured cells in one process grew ~11 MiB a cell on a tiny model.
    Once a program is gone, what compiling it left is dropped."""
    import torch.fx

    import moetool.engine.decode as decode

    path = str(tiny_ckpt("qwen2_moe"))

    def live() -> tuple[int, int]:
        gc.collect()
        graphs = sum(isinstance(o, torch.fx.GraphModule) for o in gc.get_objects())
        return graphs, sum(k.startswith(decode._COMPILED) for k in vars(decode))

    counts = []
    for budget in ("50%", "60%", "70%"):
        got = run(RunConfig(model=path, policy="lru", budget=budget, clock="sim", decode="captured", prompts=("ab",),
                            max_new_tokens=3))
        assert got.summary["path"] == "captured"
        counts.append(live())
    assert counts[2] == counts[1] and counts[2][1] == 0, counts  # no more after the third than after the second
