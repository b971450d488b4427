"""The synchronous engine core: requests in, one scheduled model step at a time, outputs out.

It orchestrates: InputProcessor validates at submission; each step the Scheduler returns a SchedulerOutput
(sequences, token counts, block copies, the logit-row plan), the ModelRunner returns a ModelRunnerOutput
(logits of the planned rows), the sampler draws, and the OutputProcessor applies the results.

Thread safety: `lock` guards all bookkeeping. `step` holds it while scheduling and while processing
results, but not during the model forward, so callers on other threads (the async engine's event
loop) can add, abort, fork and close at any time with short waits. Steps themselves never overlap.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from dataclasses import replace
from typing import Callable, Iterable

import torch

from .kv import transfer as kv_transfer
from .decoding import structured_output
from .kv.block_pool import BlockPool
from .cpu.threads import StepClock, ThreadGovernor
from .config import EngineArgs
from .cpu.memory import tune_malloc
from .model.cuda_graphs import GraphConfig
from .core.input_processor import InputProcessor
from .kv.cache import allocate_kv_cache
from .kv.cache_manager import KVCacheManager
from .model.loader import load_model
from .model.runner import ModelRunner, make_backend
from .core.open_sequences import OpenSequences
from .request.program import ProgramContext, as_program_context
from .core.output_processor import OutputProcessor
from .request.outputs import RequestOutput
from .decoding.sampler import sample
from .core.sampling_params import SamplingParams
from .core.scheduler import Scheduler
from .core.sampling_rows import sampling_rows
from .engine_stats import engine_stats
from .decoding.spec_decode import NgramSpeculator, SpeculativeConfig
from .request.sequence import Matcher, Request, Sequence
from .decoding.structured_output import StructuredOutputManager

logger = logging.getLogger("flowrt.engine")


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs):
        args = args if args is not None else EngineArgs(**kwargs)
        self.args = args
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        self.device = args.resolved_device()
        if self.device.type == "cpu":
            tune_malloc()  # activations reuse heap memory instead of faulting in fresh pages every step
        self.dtype = args.resolved_dtype(self.device)
        n = torch.get_num_threads()
        self.threads = ThreadGovernor(n) if self.device.type == "cpu" and args.adaptive_threads and n > 1 else None
        path = args.resolved_model()
        loaded = load_model(path, self.dtype, self.device, args.max_model_len, args.tokenizer, args.quantization)
        self.weights = loaded.weights
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
        self.kv = allocate_kv_cache(args, cfg, kv_dtype, max_len, self.device)
        num_blocks = self.kv.shape[2]
        logger.info(
            "flowrt engine: %s, %s on %s, weights %s, %d KV blocks x %d tokens (%.1f MiB), max_model_len %d, "
            "loaded in %.2fs",
            os.path.basename(path.rstrip("/")), str(self.dtype).removeprefix("torch."), self.device,
            self.weights.describe(), num_blocks, bs, self.kv.nbytes / 2**20, max_len, loaded.load_seconds,
        )
        self.pool = BlockPool(num_blocks, args.enable_prefix_caching)
        self.kv_manager = KVCacheManager(self.pool, bs)
        self.scheduler = Scheduler(self.kv_manager, args.max_num_seqs, args.max_num_batched_tokens,
                                   enable_prefix_caching=args.enable_prefix_caching,
                                   policy=args.scheduling_policy, max_wait_steps=args.max_wait_steps)
        self.backend_name = args.resolved_backend(self.device)
        graphs = GraphConfig.from_env()
        graphs = replace(graphs, enabled=graphs.enabled and not args.enforce_eager, max_batch=args.max_num_seqs,
                         max_model_len=max_len)
        self.runner = ModelRunner(loaded.model, self.kv, bs, make_backend(self.backend_name), self.device, graphs)
        self.structured = StructuredOutputManager(self.tokenizer, cfg.vocab_size, self.eos_ids)
        self.inputs = InputProcessor(self.tokenizer, cfg.vocab_size, max_len, num_blocks, bs, self.structured)
        self.spec = None
        if args.speculative_config is not None:
            self.spec = NgramSpeculator(SpeculativeConfig(**args.speculative_config), self.kv_manager, max_len)
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler, self.eos_ids, max_len, self.structured,
                                       args.enable_forced_tokens)
        self.generator = torch.Generator().manual_seed(args.seed)
        self.lock = threading.RLock()
        self._step_lock = threading.Lock()  # one step at a time, whoever calls it
        self.open_seqs = OpenSequences(self.lock, self.kv_manager, self.scheduler, self.inputs, self.outputs)
        self._req_ids = itertools.count()
        self._kv_fingerprint: str | None = None
        self.beam_peak_blocks = 0  # the most KV blocks one beam search has held at once (engine/beam_search.py)

    @property
    def requests(self) -> dict[str, Request]:
        return self.outputs.requests

    @property
    def counters(self) -> dict[str, int]:
        return self.outputs.counters

    # ---- input validation (engine.inputs) -----------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.inputs.tokenize(prompt)

    def resolve_prompt(self, prompt, what: str = "prompt") -> tuple[str | None, list[int]]:
        return self.inputs.resolve_prompt(prompt, what)

    def validate(self, prompt, params: SamplingParams, what: str = "prompt") -> tuple[str | None, list[int]]:
        """Every submission check for a fresh prompt; returns (text, token ids) for add_request(_resolved=)."""
        resolved = self.inputs.resolve_prompt(prompt, what)
        if params.max_tokens == 0:
            raise ValueError("max_tokens must be >= 1 (0 is only allowed when generating onto a sequence)")
        self.inputs.check_request(len(resolved[1]), params, what)
        return resolved

    # ---- requests -----------------------------------------------------------------------------------
    def add_request(
        self,
        prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        on_output: Callable[[Request], None] | None = None,
        stream: bool = False,
        _resolved: tuple[str | None, list[int]] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        program: ProgramContext | dict | str | None = None,
        _matcher: Matcher | None = None,
    ) -> Request:
        """Queues a request. `prompt` may be an open Sequence: it generates onto it (its KV is kept).
        `program`: the workflow run / step / thread it belongs to (engine/request/program.py); a sequence keeps it.
        `_matcher`: the grammar state to continue from (beam search), instead of a fresh matcher."""
        program = as_program_context(program)
        params = params if params is not None else SamplingParams()
        if isinstance(params, dict):
            params = SamplingParams(**params)
        if not isinstance(prompt, Sequence) and _resolved is None:
            _resolved = self.validate(prompt, params)  # tokenize outside the lock
        matcher = _matcher if _matcher is not None else self.inputs.constraint_matcher(params)  # outside the lock
        with self.lock:
            self.open_seqs.drain()
            rid = request_id or f"req-{next(self._req_ids)}"
            if rid in self.requests:
                raise ValueError(f"request_id {rid!r} is already in use")
            if isinstance(prompt, Sequence):
                self.open_seqs.check_can_generate(prompt, params)
                seq, text, ids = prompt, None, list(prompt.token_ids)
            else:
                assert _resolved is not None  # validated above
                text, ids = _resolved
                seq = Sequence(list(ids))
            req = Request(rid, params, text, ids, [seq], on_output=on_output, on_error=on_error,
                          needs_text_each_step=stream or bool(params.stop))
            self.kv_manager.truncate_computed(seq, self.outputs.add(req))
            structured_output.constrain(seq, matcher)
            ctx = program if program is not None else seq.sched.program
            if ctx is not None:
                self.scheduler.set_program(seq, ctx.with_state("generating"))
            self.scheduler.add(seq)
            return req

    def abort(self, request_id: str) -> bool:
        with self.lock:
            req = self.requests.get(request_id)
            if req is None or req.finished:
                return False
            self.outputs.abort(req)
            return True

    def fail_all(self, exc: BaseException) -> None:
        """Ends every request in flight with `exc` delivered to its on_error (a broken step, shutdown)."""
        with self.lock:
            for req in list(self.requests.values()):
                self.outputs.fail(req, exc)

    # ---- open sequences (KV that outlives a call; see core/open_sequences.py) ----------------------------------
    def open(self, token_ids, program: ProgramContext | dict | str | None = None) -> Sequence:
        seq = self.open_seqs.open(token_ids)
        self.scheduler.set_program(seq, as_program_context(program))
        return seq

    def set_program(self, seq: Sequence, program: ProgramContext | dict | str | None = None,
                    state: str | None = None) -> None:
        """Update what an open sequence belongs to and/or its state ("generating" / "waiting" /
        "finished"): a scheduling hint, never an error for a closed or foreign sequence's sake."""
        ctx = as_program_context(program)
        with self.lock:
            ctx = ctx or seq.sched.program or ProgramContext()
            self.scheduler.set_program(seq, ctx.with_state(state) if state is not None else ctx)

    def run_stats(self, run_id: str | None = None) -> dict | None:
        """What a workflow run got (service_tokens, queue_time_s, requests, prefill_tokens_recomputed,
        preemptions); None if unknown. Without run_id: {run_id: that dict} for the newest runs (1024)."""
        with self.lock:
            return self.scheduler.tracker.stats(run_id)

    def append(self, seq: Sequence, token_ids: Iterable[int]) -> None:
        self.open_seqs.append(seq, token_ids)

    def fork(self, seq: Sequence, n: int = 1) -> list[Sequence]:
        return self.open_seqs.fork(seq, n)

    def close(self, seq: Sequence) -> None:
        self.open_seqs.close(seq)

    def close_later(self, seq: Sequence) -> None:
        """Close from a finalizer: safe in any thread and at any point (applied before the next step)."""
        self.open_seqs.close_later(seq)

    # ---- the step -------------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Request]:
        """Runs one scheduled model step; returns the requests that made progress."""
        with self._step_lock:
            t0 = time.perf_counter()
            with self.lock:
                self.open_seqs.drain()
                if self.spec is not None:
                    self.spec.propose(self.scheduler.running)
                so = self.scheduler.schedule()
                for seq in self.scheduler.take_unfit():
                    self.outputs.fail_unfit(seq)
                if not so.seqs:
                    return []
                inputs = self.runner.prepare(so, so.logit_rows)
            with StepClock(self.threads):
                mo = self.runner.execute(inputs)
            with self.lock:
                computed = self.scheduler.update_from_output(so)
                live, rows = sampling_rows(so, self.kv_manager, self.outputs, self.scheduler)
                if so.spec_rows:
                    self.structured.apply_drafts(mo.logits, so.spec_rows)  # constrained drafts' rows
                result = None
                if live:
                    lg = mo.logits[torch.tensor(rows)] if rows != list(range(len(mo.logits))) else mo.logits
                    if any(s.grammar is not None for s in live):
                        self.structured.apply(lg, live)  # grammar masks, before penalties and sampling
                    result = sample(lg, live, self.eos_ids, self.generator)
                verified = (self.spec.verify_step(so, mo.logits, live, result, self.generator)
                            if self.spec is not None and so.spec_rows else None)
                done = self.outputs.process(so, computed, mo, live, result, verified)
                if self.spec is not None:
                    self.spec.observe_schedule(so, time.perf_counter() - t0)
                return done

    def note_beam_peak(self, blocks: int) -> None:
        self.beam_peak_blocks = max(self.beam_peak_blocks, blocks)

    # ---- outputs and stats --------------------------------------------------------------------------
    def make_output(self, req: Request) -> RequestOutput:
        return self.outputs.make_output(req)

    def stats(self) -> dict:
        """The engine's counters (engine/engine_stats.py names each)."""
        with self.lock:
            self.open_seqs.drain()
            return engine_stats(self)

    def reset_prefix_cache(self) -> int:
        with self.lock:
            return self.pool.evict_all_cached()

    # ---- KV blocks in and out (kv/transfer.py) ---------------------------------------------------------
    def kv_fingerprint(self) -> str:
        """What exported KV bytes depend on (weights, dtypes, block size, backend, version), hashed."""
        if self._kv_fingerprint is None:
            self._kv_fingerprint = kv_transfer.fingerprint(self)
        return self._kv_fingerprint

    def kv_block_bytes(self) -> int:
        return kv_transfer.block_bytes(self)

    def kv_export(self, token_ids, skip=None) -> list[tuple[bytes, bytes | None]]:
        return kv_transfer.export_blocks(self, list(token_ids), skip)

    def kv_import(self, blocks) -> int:
        return kv_transfer.import_blocks(self, blocks)
