"""The offline API, following vLLM's `LLM` class."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Sequence as Seq

from .beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from .config import EngineArgs
from .cpu.threads import release_openmp_team
from .core.input_processor import is_token_ids
from .llm_engine import LLMEngine
from .request.outputs import RequestOutput
from .core.sampling_params import SamplingParams


class LLM:
    """`LLM(model=path).generate(prompts, SamplingParams(...))` -> one RequestOutput per prompt, in order."""

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self._generate_lock = threading.Lock()
        # One OpenMP team at a time (engine/cpu/threads.py release_openmp_team): the building thread's ends here and
        # each call's when it returns (its next region starts a new one, ~0.1 ms), so calls from several threads, or
        # a thread pool, leave no team behind that would make the next caller's workers sleep between regions.
        release_openmp_team()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Validates every prompt and parameter set first (raising before any work), then runs them all.

        Calls from several threads at once are serialized: each runs alone, in turn.
        """
        eng = self.engine
        if isinstance(prompts, (str, dict)) or is_token_ids(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
            if p.max_tokens == 0:
                raise ValueError(f"sampling_params[{i}].max_tokens must be >= 1")
        resolved = [eng.validate(p, sp, f"prompt {i}") for i, (p, sp) in enumerate(zip(prompts, params))]
        with self._generate_lock, self._own_team():
            return self._run(resolved, params, use_tqdm)

    @contextlib.contextmanager
    def _own_team(self) -> Iterator[None]:
        try:
            yield
        finally:
            release_openmp_team()

    def _run(self, resolved, params, use_tqdm: bool) -> list[RequestOutput]:
        eng = self.engine
        bar = None
        if use_tqdm:
            try:
                from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type information

                bar = tqdm(total=len(resolved), desc="generate", unit="req")
            except ImportError:
                bar = None
        reqs = []
        try:
            for p, r in zip(params, resolved):
                reqs.append(eng.add_request(None, p, _resolved=r))
            done = 0
            while any(not r.finished for r in reqs):
                eng.step()
                if bar is not None:
                    now = sum(r.finished for r in reqs)
                    bar.update(now - done)
                    done = now
        except BaseException:
            for r in reqs:
                eng.abort(r.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [eng.make_output(r) for r in reqs]

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search (engine/beam_search.py): per prompt, the `params.beam_width` best beams, best first.
        Every prompt is validated first; the prompts' searches run side by side, each round one engine batch."""
        eng = self.engine
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)) or is_token_ids(prompts):
            prompts = [prompts]
        check = SamplingParams(max_tokens=params.max_tokens, structured_outputs=params.structured_outputs)
        resolved = [eng.validate(p, check, f"prompt {i}") for i, p in enumerate(prompts)]
        with self._generate_lock, self._own_team():
            searches: list[BeamSearch] = []
            try:
                for _, ids in resolved:
                    searches.append(BeamSearch(eng, eng.open(ids), params))
                while active := [s for s in searches if not s.done]:
                    rounds = [(s, [eng.add_request(seq, s.step_params, _matcher=m) for seq, m in s.pending()])
                              for s in active]
                    while any(not r.finished for _, reqs in rounds for r in reqs):
                        eng.step()
                    for s, reqs in rounds:
                        s.advance([eng.make_output(r) for r in reqs])
                return [s.result() for s in searches]
            finally:
                for s in searches:
                    s.close()

    def stats(self) -> dict:
        return self.engine.stats()

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()
