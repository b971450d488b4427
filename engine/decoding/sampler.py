"""Turns float32 logits of the sampling rows into next tokens (and log-probabilities).

Work is vectorized over rows; only what some row asks for is done (penalties, top-k/p, min-p, logprobs).
Random rows sample by inverse CDF: one uniform draw per row (a seeded sequence draws from its own generator,
so it gives the same tokens whatever else is in the batch), then the first token whose cumulative
probability exceeds it. One draw per token instead of one per vocabulary entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..request.sequence import Sequence

if TYPE_CHECKING:
    from ..core.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: torch.Tensor | None  # [R, V] log-softmax of the processed logits (rows that asked), else None


def _params(seq: Sequence) -> SamplingParams:
    """The sampling parameters of a sequence that samples (it always has its request)."""
    req = seq.sample.request
    assert req is not None
    return req.params


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    V = logits.shape[1]
    for r, seq in enumerate(seqs):
        p = _params(seq)
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
            ids = ids[ids < V]
            vals = logits[r, ids]
            logits[r, ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            out = seq.output_token_ids
            if out:
                counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=V)[:V].float()
                logits[r] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


def mask_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]) -> None:
    for r, seq in enumerate(seqs):
        p = _params(seq)
        if seq.num_output_tokens < p.min_tokens:
            banned = [*(() if p.ignore_eos else eos_ids), *p.stop_token_ids]
            if banned:
                logits[r, banned] = float("-inf")


def filter_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p for random rows (in place where possible)."""
    params = [_params(s) for s in seqs]
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    logits = logits / temps[:, None]
    top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
    if any(top_k):
        V = logits.shape[1]
        k = torch.tensor([k if k else V for k in top_k]).clamp(max=V)
        kth = torch.topk(logits, int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        logits.masked_fill_(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        logits = _top_p(logits, torch.tensor([p.top_p for p in params], dtype=torch.float32))
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        probs = torch.softmax(logits, dim=-1)
        thresh = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits.masked_fill_(probs < thresh, float("-inf"))
    return logits


# Top-p looks for the nucleus among each row's TOP_P_CANDIDATES largest logits first (a partial selection): a full
# sort of 32 rows of a 49,152-token vocabulary took ~70 ms a step on a 2-core Zen3, the selection a few ms. Rows whose
# nucleus is larger than the candidates are sorted whole, as before.
TOP_P_CANDIDATES = 512


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keeps each row's smallest set of most likely tokens whose probability reaches top_p (others -inf)."""
    k = min(TOP_P_CANDIDATES, logits.shape[1])
    srt, idx = torch.topk(logits, k, dim=-1)  # descending
    probs = torch.exp(srt - torch.logsumexp(logits, dim=-1, keepdim=True))
    inside = probs.cumsum(-1)[:, -1] >= top_p  # the nucleus lies among the candidates (same sum as _nucleus)
    out = torch.full_like(logits, float("-inf"))
    if bool(inside.all()):
        return _nucleus(out, srt, idx, probs, top_p)
    rows, rest = inside.nonzero().squeeze(1), (~inside).nonzero().squeeze(1)
    if len(rows):
        out[rows] = _nucleus(out[rows], srt[rows], idx[rows], probs[rows], top_p[rows])
    full, full_idx = torch.sort(logits[rest], dim=-1, descending=True)  # nucleus beyond the candidates
    out[rest] = _nucleus(out[rest], full, full_idx, torch.softmax(full, dim=-1), top_p[rest])
    return out


def _nucleus(out, srt, idx, probs, top_p) -> torch.Tensor:
    """out (all -inf) with the logits srt (descending, at columns idx, probabilities probs) of each row's smallest
    leading set whose probability reaches top_p."""
    drop = (probs.cumsum(-1) - probs) >= top_p[:, None]
    drop[:, 0] = False
    return out.scatter_(1, idx, srt.masked_fill(drop, float("-inf")))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1) of [B, V] logits, the same indices (the first maximum, NaN counting as the maximum): the
    maximum of each chunk of 256 (128, 64) entries, the first chunk holding the row's maximum, argmax within it. torch's
    CPU argmax does not vectorize; amax does: 32 x 49,152 float32, 2 threads, ~0.65 -> ~0.09 ms a step."""
    B, V = logits.shape
    C = next((c for c in (256, 128, 64) if V % c == 0), 0)
    if not C or logits.device.type != "cpu" or not logits.is_contiguous():
        return logits.argmax(dim=-1)
    chunks = logits.view(B, V // C, C)
    first = chunks.amax(dim=-1).argmax(dim=-1)
    return first * C + chunks[torch.arange(B), first].argmax(dim=-1)


@torch.inference_mode()
def sample(
    logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...], generator: torch.Generator
) -> SampleResult:
    params = [_params(s) for s in seqs]
    if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params):
        apply_penalties(logits, seqs)
    mask_min_tokens(logits, seqs, eos_ids)
    logprobs = None
    if any(p.logprobs is not None for p in params):
        logprobs = torch.log_softmax(logits, dim=-1)
    rand = [r for r, p in enumerate(params) if not p.greedy]
    tokens = greedy_tokens(logits) if len(rand) < len(seqs) else torch.zeros(len(seqs), dtype=torch.long)
    if rand:
        # every row random: filter_logits makes its own tensor, no gathered copy needed
        rand_logits = logits if len(rand) == len(seqs) else logits.index_select(0, torch.tensor(rand))
        probs = torch.softmax(filter_logits(rand_logits, [seqs[r] for r in rand]), dim=-1)
        # Inverse-CDF sampling: one uniform per row; the first token whose cumulative mass exceeds it.
        cdf = probs.cumsum(dim=-1)
        u = torch.empty(len(rand), 1)
        shared = [i for i, r in enumerate(rand) if seqs[r].sample.generator is None]
        if shared:
            u[shared] = torch.rand(len(shared), 1, generator=generator)
        own = [i for i, r in enumerate(rand) if seqs[r].sample.generator is not None]
        if own:  # each seeded row from its own generator, in row order; written with one assignment
            u[own] = torch.cat([torch.rand(1, generator=seqs[rand[i]].sample.generator) for i in own])[:, None]
        picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.shape[1] - 1)
        tokens[rand] = picked.squeeze(1)
    return SampleResult(tokens.tolist(), logprobs)
