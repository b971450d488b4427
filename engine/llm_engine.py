"""The synchronous engine core: requests in, one scheduled model step at a time, outputs out.

Thread safety: `lock` guards all bookkeeping. `step` holds it while scheduling and while processing
results, but not during the model forward, so callers on other threads (the async engine's event
loop) can add, abort, fork and close at any time with short waits.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
from typing import Callable, Iterable

import numpy as np
import torch

from . import detokenizer
from .block_pool import BlockPool
from .config import EngineArgs
from .kv_cache_manager import KVCacheManager
from .model_loader import load_model
from .model_runner import ModelRunner, make_backend
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampler import sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Request, Sequence, SeqStatus

logger = logging.getLogger("flowrt.engine")

_DTYPE_SIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


DEFAULT_KV_CAP = 2 << 30


def zeros_lazy(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose pages the OS maps only when first written (calloc through numpy), so a large
    KV pool costs resident memory only for the blocks actually used. Zeros matter: masked attention
    multiplies unused slots by 0, and garbage there could be NaN."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    size = _DTYPE_SIZE[dtype]
    arr = np.zeros(shape, dtype={4: np.float32, 2: np.int16}[size])
    t = torch.from_numpy(arr)
    return t if dtype == torch.float32 else t.view(dtype)


def _available_memory() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs):
        args = args if args is not None else EngineArgs(**kwargs)
        self.args = args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.device = args.resolved_device()
        self.dtype = args.resolved_dtype(self.device)
        path = args.resolved_model()
        loaded = load_model(path, self.dtype, self.device, args.max_model_len, args.tokenizer)
        self.model_path = path
        self.model_config = cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        max_len = args.max_model_len or cfg.max_position_embeddings
        if cfg.sliding_window and cfg.sliding_window < max_len:
            logger.info("capping max_model_len at the model's sliding window (%d)", cfg.sliding_window)
            max_len = cfg.sliding_window
        self.max_model_len = max_len
        self.eos_ids = cfg.eos_token_ids
        self.block_size = bs = args.block_size

        # "auto": the model's dtype. On CPU the decode attention runs in the cache's dtype (SDPA accumulates
        # in float32), so a bfloat16 cache halves both the memory and the bytes each step gathers.
        kv_dtype = self.dtype if args.kv_cache_dtype == "auto" else getattr(torch, args.kv_cache_dtype)
        block_bytes = cfg.kv_bytes_per_token * _DTYPE_SIZE[kv_dtype] * bs
        if args.num_kv_blocks is not None:
            num_blocks = args.num_kv_blocks
        elif args.kv_cache_memory is not None:
            num_blocks = args.kv_cache_memory // block_bytes
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory={args.kv_cache_memory} bytes is less than one KV block ({block_bytes})")
        else:
            # A quarter of free memory up to 2 GiB, and no more than every sequence slot at full length needs.
            want = args.max_num_seqs * -(-max_len // bs)
            budget = min(int(_available_memory() * 0.25), DEFAULT_KV_CAP)
            num_blocks = max(1, min(budget // block_bytes, want))
        self.kv = zeros_lazy(
            (cfg.num_layers, 2, num_blocks, bs, cfg.num_kv_heads, cfg.head_dim), kv_dtype, self.device
        )
        logger.info(
            "flowrt engine: %s, %s on %s, %d KV blocks x %d tokens (%.1f MiB), max_model_len %d, loaded in %.2fs",
            os.path.basename(path.rstrip("/")), str(self.dtype).removeprefix("torch."), self.device, num_blocks, bs,
            num_blocks * block_bytes / 2**20, max_len, loaded.load_seconds,
        )
        self.pool = BlockPool(num_blocks, args.enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.pool, bs)
        self.scheduler = Scheduler(self.kv_manager, args.max_num_seqs, args.max_num_batched_tokens)
        self.backend_name = args.resolved_backend(self.device)
        self.runner = ModelRunner(loaded.model, self.kv, bs, make_backend(self.backend_name), self.device)
        self.generator = torch.Generator().manual_seed(args.seed)
        self.lock = threading.RLock()
        self.requests: dict[str, Request] = {}
        self.open_seqs: dict[int, Sequence] = {}
        self._pending_closes: collections.deque[Sequence] = collections.deque()
        self._req_ids = itertools.count()
        self.counters = dict(prompt_tokens=0, prefill_tokens_computed=0, decode_tokens_computed=0, generated_tokens=0, steps=0)

    # ---- input validation ---------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt).input_ids)

    def check_tokens(self, token_ids: list[int], what: str) -> None:
        """Raises ValueError naming `what` when the tokens cannot be run."""
        if not token_ids:
            raise ValueError(f"{what} is empty")
        V = self.model_config.vocab_size
        bad = next((t for t in token_ids if not isinstance(t, int) or t < 0 or t >= V), None)
        if bad is not None:
            raise ValueError(f"{what} contains token id {bad!r}, outside the vocabulary (0..{V - 1})")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"{what} has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}")
        need = len(token_ids) // self.block_size + 1
        if need > self.pool.num_blocks:
            raise ValueError(
                f"{what} has {len(token_ids)} tokens, more than the KV cache holds "
                f"({self.pool.num_blocks} blocks of {self.block_size})"
            )

    def resolve_prompt(self, prompt, what: str = "prompt") -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{what} is empty")
            ids = self.tokenize(prompt)
            text = prompt
        elif isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids, text = list(prompt["prompt_token_ids"]), prompt.get("prompt")
            elif "prompt" in prompt:
                return self.resolve_prompt(prompt["prompt"], what)
            else:
                raise ValueError(f"{what} must have 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, (list, tuple)):
            ids, text = list(prompt), None
        else:
            raise ValueError(f"{what} must be a str, a list of token ids or a dict, got {type(prompt).__name__}")
        self.check_tokens(ids, what)
        return text, ids

    # ---- requests -----------------------------------------------------------------------------------
    def _new_request_id(self) -> str:
        return f"req-{next(self._req_ids)}"

    def _attach(self, req: Request, seq: Sequence, index: int) -> None:
        p = req.params
        seq.request = req
        seq.sample_index = index
        seq.prompt_len = seq.num_tokens
        seq.generator = torch.Generator().manual_seed(p.seed + index) if p.seed is not None else None
        seq.output_logprobs = [] if p.logprobs is not None else None
        seq.cumulative_logprob = 0.0
        seq.finish_reason = seq.stop_reason = None
        detokenizer.start(seq)

    def add_request(
        self,
        prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        on_output: Callable[[Request], None] | None = None,
        stream: bool = False,
        _resolved: tuple[str | None, list[int]] | None = None,
    ) -> Request:
        """Queues a request. `prompt` may be an open Sequence: it generates onto it (its KV is kept)."""
        params = params if params is not None else SamplingParams()
        if isinstance(params, dict):
            params = SamplingParams(**params)
        if not isinstance(prompt, Sequence) and _resolved is None:
            _resolved = self.resolve_prompt(prompt)  # tokenize outside the lock
        with self.lock:
            self._drain_closes()
            rid = request_id or self._new_request_id()
            if rid in self.requests:
                raise ValueError(f"request_id {rid!r} is already in use")
            if isinstance(prompt, Sequence):
                seq = prompt
                if seq.status is SeqStatus.CLOSED:
                    raise ValueError("the sequence is closed")
                if seq.request is not None and not seq.request.finished:
                    raise RuntimeError("the sequence is already generating (one request at a time)")
                if params.n != 1:
                    raise ValueError("n must be 1 when generating onto a sequence (fork it for several samples)")
                self.check_tokens(seq.token_ids, "sequence")
                text, ids = None, list(seq.token_ids)
            else:
                text, ids = _resolved
                seq = Sequence(list(ids))
            if params.max_tokens == 0 and not seq.persistent:
                raise ValueError("max_tokens must be >= 1 (0 is only allowed when generating onto a sequence)")
            req = Request(rid, params, text, ids, [seq], on_output=on_output,
                          needs_text_each_step=stream or bool(params.stop))
            self._attach(req, seq, 0)
            if params.prompt_logprobs is not None:
                # Score every token that is not yet computed (all of a fresh prompt); recompute the token
                # before them so its logits exist.
                start = max(1, min(seq.num_computed_tokens, seq.num_tokens - 1)) if seq.persistent else 1
                req.prompt_logprob_start = start
                req.prompt_logprobs = [None] * (seq.num_tokens - start)
                self.kv_manager.truncate_computed(seq, start - 1)
            if seq.persistent and seq.num_computed_tokens >= seq.num_tokens:
                self.kv_manager.truncate_computed(seq, seq.num_tokens - 1)  # its logits are needed again
            self.counters["prompt_tokens"] += len(ids) - (seq.num_computed_tokens if seq.persistent else 0)
            self.requests[rid] = req
            self.scheduler.add(seq)
            return req

    def abort(self, request_id: str) -> bool:
        with self.lock:
            req = self.requests.get(request_id)
            if req is None or req.finished:
                return False
            for seq in req.seqs:
                if seq.finish_reason is None:
                    seq.finish_reason = "abort"
                    self._retire(seq)
            self._finish_request(req)
            return True

    # ---- open sequences (KV that outlives a call) -------------------------------------------------
    def open(self, token_ids: list[int]) -> Sequence:
        ids = list(token_ids)
        if ids:
            self.check_tokens(ids, "sequence")
        seq = Sequence(ids, persistent=True)
        with self.lock:
            self.open_seqs[seq.seq_id] = seq
        return seq

    def _check_idle(self, seq: Sequence, op: str) -> None:
        if seq.status is SeqStatus.CLOSED:
            raise RuntimeError(f"cannot {op} a closed sequence")
        if seq.status in (SeqStatus.WAITING, SeqStatus.RUNNING):
            raise RuntimeError(f"cannot {op} a sequence while it is generating")

    def append(self, seq: Sequence, token_ids: Iterable[int]) -> None:
        ids = list(token_ids)
        with self.lock:
            self._check_idle(seq, "append to")
            V = self.model_config.vocab_size
            bad = next((t for t in ids if not isinstance(t, int) or t < 0 or t >= V), None)
            if bad is not None:
                raise ValueError(f"token id {bad!r} is outside the vocabulary (0..{V - 1})")
            if seq.num_tokens + len(ids) > self.max_model_len:
                raise ValueError(f"sequence would have {seq.num_tokens + len(ids)} tokens, more than max_model_len={self.max_model_len}")
            seq.token_ids.extend(ids)

    def fork(self, seq: Sequence, n: int = 1) -> list[Sequence]:
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        with self.lock:
            self._check_idle(seq, "fork")
            children = []
            for _ in range(n):
                child = Sequence(list(seq.token_ids), persistent=True)
                self.kv_manager.fork(seq, child)
                self.open_seqs[child.seq_id] = child
                self.scheduler.park(child)
                children.append(child)
            return children

    def close_later(self, seq: Sequence) -> None:
        """Close from a finalizer: safe in any thread and at any point (applied before the next step)."""
        self._pending_closes.append(seq)

    def _drain_closes(self) -> None:
        while self._pending_closes:
            self.close(self._pending_closes.popleft())

    def close(self, seq: Sequence) -> None:
        with self.lock:
            if seq.status is SeqStatus.CLOSED:
                return
            if seq.request is not None and not seq.request.finished:
                self.abort(seq.request.request_id)
            self.scheduler.remove(seq)
            self.kv_manager.free(seq)
            seq.status = SeqStatus.CLOSED
            seq.request = None
            self.open_seqs.pop(seq.seq_id, None)

    # ---- the step -------------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def _needs_sample(self, seq: Sequence, n: int) -> bool:
        req = seq.request
        return (
            seq.num_computed_tokens + n == seq.num_tokens
            and req.params.max_tokens > seq.num_output_tokens
        )

    def step(self) -> list[Request]:
        """Runs one scheduled model step; returns the requests that made progress."""
        with self.lock:
            self._drain_closes()
            batch = self.scheduler.schedule()
            for seq in self.scheduler.unfit:
                self._fail_unfit(seq)
            self.scheduler.unfit.clear()
            if not batch.seqs:
                return []
            rows: list[int] = []
            plp_rows: list[tuple[Sequence, int, int]] = []  # (seq, first flat row, first position)
            sample_seqs: list[tuple[Sequence, int]] = []  # (seq, its row in the logits)
            flat = 0
            for seq, n in zip(batch.seqs, batch.num_new_tokens):
                req = seq.request
                c0 = seq.num_computed_tokens
                if not req.scheduled:
                    req.scheduled = True
                    req.num_cached_tokens = c0  # KV found in the prefix cache (or kept by an open sequence)
                if req.prompt_logprobs is not None and seq.sample_index == 0 and not req.forked:
                    lo = max(c0, req.prompt_logprob_start - 1)
                    hi = min(c0 + n, seq.prompt_len - 1)
                    if hi > lo:
                        plp_rows.append((seq, len(rows), lo))
                        rows.extend(range(flat + lo - c0, flat + hi - c0))
                if self._needs_sample(seq, n):
                    sample_seqs.append((seq, len(rows)))
                    rows.append(flat + n - 1)
                flat += n
            inputs = self.runner.prepare(batch, rows)
        logits = self.runner.execute(inputs)
        with self.lock:
            return self._process(batch, logits, rows, plp_rows, sample_seqs)

    def _process(self, batch, logits, rows, plp_rows, sample_seqs) -> list[Request]:
        self.counters["steps"] += 1
        touched: dict[str, Request] = {}
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.status is not SeqStatus.RUNNING:
                continue  # aborted or closed while the model ran
            # A decode computes one just-sampled token; everything else (prompts, appended text,
            # recomputation after preemption) is prefill.
            kind = "decode_tokens_computed" if n == 1 and seq.num_computed_tokens >= seq.prompt_len else "prefill_tokens_computed"
            self.counters[kind] += n
            seq.num_computed_tokens += n
            self.kv_manager.register_full_blocks(seq)
            touched[seq.request.request_id] = seq.request
        for seq, first_row, pos in plp_rows:
            if seq.status is SeqStatus.RUNNING:
                self._record_prompt_logprobs(seq, logits, first_row, pos)
        live, live_rows = [], []
        for seq, r in sample_seqs:
            if seq.status is not SeqStatus.RUNNING:
                continue
            req = seq.request
            if req.params.n > 1 and not req.forked:
                req.forked = True
                for child in self._fork_samples(req, seq):
                    live.append(child)
                    live_rows.append(r)
            live.append(seq)
            live_rows.append(r)
        if live:
            lg = logits[torch.tensor(live_rows)] if live_rows != list(range(len(logits))) else logits
            result = sample(lg, live, self.eos_ids, self.generator)
            now = time.monotonic()
            for i, (seq, tok) in enumerate(zip(live, result.token_ids)):
                req = seq.request
                if req.first_token_time is None:
                    req.first_token_time = now
                seq.token_ids.append(tok)
                self.counters["generated_tokens"] += 1
                if seq.output_logprobs is not None:
                    seq.output_logprobs.append(self._logprob_entry(result.logprobs[i], tok, req.params.logprobs))
                    seq.cumulative_logprob += float(result.logprobs[i, tok])
                self._check_stop(seq, tok)
        for req in touched.values():
            for seq in req.seqs:
                if seq.status is SeqStatus.RUNNING and seq.finish_reason is None and self._done_without_sampling(seq):
                    seq.finish_reason = "length"
                    self._retire(seq)
            if all(s.finish_reason is not None for s in req.seqs) and req.forked == (req.params.n > 1):
                self._finish_request(req)
            elif req.on_output is not None:
                req.on_output(req)
        return list(touched.values())

    def _done_without_sampling(self, seq: Sequence) -> bool:
        """max_tokens=0 requests end once their tokens are computed."""
        return seq.request.params.max_tokens == 0 and seq.num_computed_tokens == seq.num_tokens

    def _fork_samples(self, req: Request, parent: Sequence) -> list[Sequence]:
        children = []
        for i in range(1, req.params.n):
            child = Sequence(list(parent.token_ids))
            self.kv_manager.fork(parent, child)
            self._attach(req, child, i)
            req.seqs.append(child)
            self.scheduler.add_running(child, after=children[-1] if children else parent)
            children.append(child)
        return children

    def _logprob_entry(self, row: torch.Tensor, tok: int, k: int) -> dict[int, Logprob]:
        entry: dict[int, Logprob] = {}
        if k:
            vals, idx = torch.topk(row, k)
            for rank, (t, v) in enumerate(zip(idx.tolist(), vals.tolist()), start=1):
                entry[t] = Logprob(v, rank, self.tokenizer.decode([t]))
        if tok not in entry:
            lp = float(row[tok])
            rank = int((row > lp).sum()) + 1
            entry[tok] = Logprob(lp, rank, self.tokenizer.decode([tok]))
        return entry

    def _record_prompt_logprobs(self, seq: Sequence, logits, first_row: int, pos: int) -> None:
        req = seq.request
        k = req.params.prompt_logprobs
        hi = min(seq.num_computed_tokens, seq.prompt_len - 1)
        lps = torch.log_softmax(logits[first_row : first_row + (hi - pos)], dim=-1)
        for j, p in enumerate(range(pos, hi)):
            tok = seq.token_ids[p + 1]
            req.prompt_logprobs[p + 1 - req.prompt_logprob_start] = self._logprob_entry(lps[j], tok, k)

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        req = seq.request
        p = req.params
        n_out = seq.num_output_tokens
        if req.needs_text_each_step:
            delta = detokenizer.update(self.tokenizer, seq, p.skip_special_tokens)
            if p.stop and delta:
                text = seq.text
                window = max(map(len, p.stop)) + len(delta)
                lo = max(0, len(text) - window)
                hits = [(text.find(s, lo), s) for s in p.stop]
                hits = [(i, s) for i, s in hits if i >= 0]
                if hits:
                    i, s = min(hits)
                    seq.text = text[: i + len(s) if p.include_stop_str_in_output else i]
                    seq.finish_reason, seq.stop_reason = "stop", s
        if seq.finish_reason is None and n_out >= p.min_tokens:
            if tok in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", tok
            elif not p.ignore_eos and tok in self.eos_ids:
                seq.finish_reason = "stop"
        if seq.finish_reason is None and (n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self._retire(seq)

    def _retire(self, seq: Sequence) -> None:
        """A sample is done: it leaves the batch; an open sequence keeps its KV, others release it."""
        req = seq.request
        if not req.needs_text_each_step and seq.finish_reason != "abort":
            detokenizer.update(self.tokenizer, seq, req.params.skip_special_tokens)
        self.scheduler.remove(seq)
        if seq.persistent:
            self.scheduler.park(seq)
        else:
            self.kv_manager.free(seq)
            seq.status = SeqStatus.FINISHED

    def _finish_request(self, req: Request) -> None:
        req.finished = True
        self.requests.pop(req.request_id, None)
        if req.on_output is not None:
            req.on_output(req)

    def _fail_unfit(self, seq: Sequence) -> None:
        """A sequence that outgrew the whole KV pool ends like one that reached max_model_len."""
        logger.warning("sequence %d (%d tokens) no longer fits in the KV cache; ending it", seq.seq_id, seq.num_tokens)
        seq.finish_reason = "length"
        req = seq.request
        self._retire(seq)
        if req is not None and all(s.finish_reason is not None for s in req.seqs):
            self._finish_request(req)

    # ---- outputs and stats --------------------------------------------------------------------------
    def make_output(self, req: Request) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            outs.append(
                CompletionOutput(
                    index=seq.sample_index,
                    text=seq.text,
                    token_ids=seq.token_ids[seq.prompt_len :],
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=list(seq.output_logprobs) if seq.output_logprobs is not None else None,
                    cumulative_logprob=seq.cumulative_logprob if seq.output_logprobs is not None else None,
                )
            )
        metrics = {"arrival_time": req.arrival_time}
        if req.first_token_time is not None:
            metrics["first_token_time"] = req.first_token_time
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outs,
            finished=req.finished,
            num_cached_tokens=req.num_cached_tokens,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            metrics=metrics,
        )

    def stats(self) -> dict:
        with self.lock:
            self._drain_closes()
            pool, kvs = self.pool, self.kv_manager.stats
            return {
                "num_kv_blocks": pool.num_blocks,
                "kv_blocks_used": pool.num_used,
                "kv_blocks_peak": pool.peak_used,
                "kv_blocks_shared": pool.num_shared,
                "kv_blocks_cached": len(pool.cached),
                "block_size": self.block_size,
                **self.counters,
                "preemptions": self.scheduler.preemptions,
                "prefix_cache_hit_tokens": kvs.prefix_cache_hit_tokens,
                "prefix_cache_queries": kvs.prefix_cache_queries,
                "prefix_cache_query_tokens": kvs.prefix_cache_query_tokens,
                "cow_copies": kvs.cow_copies,
                "evictions": pool.evictions,
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting),
                "open_sequences": len(self.open_seqs),
            }

    def reset_prefix_cache(self) -> int:
        with self.lock:
            return self.pool.evict_all_cached()
