"""Perplexity over non-overlapping token windows, by prefill or one token at a time (`moetool eval ppl`).

    records = perplexity_windows(model, tokenize(lm, text), context=512, batch_size=4, stepwise=False,
                                 device=torch.device("cpu"))

Every token of a window but its first is predicted from the tokens before it in that window (no
BOS is added). `stepwise` feeds the same windows one token at a time through a KV cache, so a
window is a 1-token prefill followed by decode steps, and predicts the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from moetool.inference import vocab_size, with_cache
from moetool.tokenizer import encode

ProgressFn = Callable[[int, int], None]


def tokenize(lm: Any, text: str) -> torch.Tensor:
    """All of `text` as one id sequence [N], without special tokens (windows start anywhere in it)."""
    return encode(lm.tokenizer, text, vocab_size(lm.model), special_tokens=False)


def perplexity_windows(model: torch.nn.Module, ids: torch.Tensor, context: int, batch_size: int, stepwise: bool,
                       device: torch.device, progress: ProgressFn | None = None) -> list[dict[str, Any]]:
    """Summed NLL of every non-overlapping `context`-token window of `ids` [N] (see module docstring)."""
    starts = [s for s in range(0, ids.numel(), context) if min(context, ids.numel() - s) >= 2]
    # Equal-length windows batch together; only the last window can be shorter.
    batches = [starts[i:i + batch_size] for i in range(0, len(starts), batch_size)]
    batches = [b for batch in batches for b in split_by_length(batch, ids.numel(), context)]
    records: list[dict[str, Any]] = []
    done, total = 0, sum(min(context, ids.numel() - s) - 1 for s in starts)
    with torch.no_grad():
        for batch in batches:
            rows = torch.stack([ids[s:s + context] for s in batch]).to(device)  # [B, C]
            if stepwise:
                tick = (lambda t, d=done, b=rows.shape[0]: progress(d + t * b, total)) if progress else None
                # Each step's logits scored as they come: a window's [B, C-1, V] logits (hundreds of MB
                # at a 150k vocabulary) are never held, only its tokens' NLLs.
                nll = torch.empty(rows.shape[0], rows.shape[1] - 1, device=rows.device)  # [B, C-1]
                for t, logits in enumerate(stepwise_steps(model, rows, tick)):
                    nll[:, t] = F.cross_entropy(logits.float(), rows[:, t + 1], reduction="none")  # [B]
                nll = nll.sum(1)  # [B]
            else:
                logits = model(input_ids=rows, use_cache=False).logits[:, :-1]  # [B, C-1, V]
                nll = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten(),
                                      reduction="none").view(rows.shape[0], -1).sum(1)  # [B]
            for s, v in zip(batch, nll.tolist()):
                records.append({"start": s, "tokens": rows.shape[1] - 1, "nll": v})
            done += rows.numel() - rows.shape[0]
            if progress:
                progress(done, total)
    return records


def split_by_length(batch: list[int], n: int, context: int) -> list[list[int]]:
    full = [s for s in batch if n - s >= context]
    short = [s for s in batch if n - s < context]
    return [b for b in (full, short) if b]


def stepwise_steps(model: torch.nn.Module, rows: torch.Tensor,
                   tick: Callable[[int], None] | None = None) -> Iterator[torch.Tensor]:
    """Logits [B, V] for tokens 1..C-1 of `rows` [B, C], one a step, fed one token at a time through a KV cache."""
    past = None
    for t in range(rows.shape[1] - 1):  # the last token predicts nothing that is scored
        out = model(input_ids=rows[:, t:t + 1], use_cache=True, **with_cache(model, past))
        past = out.past_key_values
        yield out.logits[:, -1]  # [B, V]
        if tick:
            tick(t + 1)


def stepwise_logits(model: torch.nn.Module, rows: torch.Tensor,
                    tick: Callable[[int], None] | None = None) -> torch.Tensor:
    """Logits [B, C-1, V] for tokens 1..C-1 of `rows` [B, C], fed one token at a time through a KV cache."""
    return torch.stack(list(stepwise_steps(model, rows, tick)), dim=1)
