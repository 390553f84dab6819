"""Engine: requests in, outputs out. One step = schedule -> run -> sample -> process -> update.

The engine owns the step loop and the request lifecycle (queueing, abort, failure, pins);
its ``Processor`` (``engine.processor``) checks and prepares each request once before it is
queued, ``OutputProcessor`` turns the sampled tokens into text, ``Delta``s and outputs, and
the scheduler appends them and decides which requests finish. ``step_deltas()`` streams
(each step's new output only); ``step()`` and ``generate()`` give cumulative
``RequestOutput``s built from what the processor recorded.

Its ``runner``, ``scheduler``, ``sampler`` and ``kv`` attributes are public: benchmarks
read them, and tests swap ``runner``/``sampler``/``scheduler`` methods to inject faults.

Single owner, not thread-safe: ``AsyncEngine`` drives one from a thread of its own.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from typing import Any

from engine import debug_log
from engine.batch_api import BatchAPI
from engine.config import EngineConfig, make_config, step_token_budget
from engine.core.encoder_budget import EncoderBudget
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput
from engine.core.step_cost import StepCost
from engine.engine_stats import engine_stats
from engine.errors import EngineError, ParameterError, WorkerGroupFailed
from engine.metrics import RequestStats, SpecDecodeStats
from engine.model_info import eos_token_ids, model_name
from engine.multimodal.inputs import image_prompts
from engine.output_processor import OutputProcessor, ParentRequest
from engine.outputs import Delta, Received, RequestMetrics, RequestOutput
from engine.persisted_kv import PersistedKVCache
from engine.pooling.api import PoolingAPI, pooling_parts
from engine.pooling.model_config import model_pooling
from engine.processor import ProcessedRequest, Processor, Prompt
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.spec_decode.drafter import Drafter
from engine.spec_decode.verify import verify_drafts
from engine.step_pipeline import PipelinedSteps, StepsInFlight
from engine.structured_output.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


class Engine(BatchAPI, PoolingAPI, PipelinedSteps):
    """The inference engine for one model: continuous batching over a paged KV cache; or, for a pooling
    model (an embedder, a cross-encoder: ``task``), ``embed`` and ``score`` in token-budget batches.

    Args:
        model: A Hugging Face model directory or a ``.gguf`` file; None = the bundled SmolLM2.
        config: All settings at once; keyword arguments (``EngineConfig`` fields) override it.
        **overrides: ``EngineConfig`` fields.

    Raises:
        ModelLoadError: The model cannot be loaded.
        ValueError: A setting is invalid.
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **overrides: Any) -> None:
        from transformers import AutoTokenizer

        from engine.layers.sampler import Sampler
        from engine.loader import resolve_model
        from engine.structured_output.matchers import StructuredOutputManager
        from engine.distributed.runner import ParallelRunner
        from engine.pooling.runner import PoolingRunner
        from engine.worker.model_runner import ModelRunner

        self.config = make_config(model, config, overrides)
        self.model_dir = resolve_model(self.config.model)
        self.model_name = model_name(self.config.model)
        # "generate", "embed" or "classify", from the model's files unless runner / convert say
        self.task, pooling = model_pooling(self.model_dir, self.config.runner, self.config.convert)
        parallel = self.config.tensor_parallel_size * self.config.pipeline_parallel_size > 1
        runner_class = ParallelRunner if parallel else ModelRunner
        self.runner = runner_class(self.config, self.model_dir) if pooling is None else PoolingRunner(
            self.config, self.model_dir, pooling
        )  # fmt: skip
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        self.vocab_size: int = self.runner.vocab_size
        self.max_model_len: int = self.runner.max_model_len
        # a multimodal model's image inputs (placeholder, tokens per image, image processor); None: text only
        self.image_prompts = image_prompts(self.runner, self.tokenizer, self.model_dir)
        # whether the model takes images (the dict prompt forms' ``multi_modal_data.image``), and the text that
        # stands for one in a prompt (LLaVA: ``<image>``; None for a text-only model)
        self.accepts_images = self.image_prompts is not None
        self.image_placeholder = None if self.image_prompts is None else self.image_prompts.placeholder
        self.kv = KVCacheManager(
            self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching,
            self.runner.kv_cache_windows,
        )
        budget = step_token_budget(self.config.max_num_batched_tokens, self.runner.device.type)
        spec = self.config.speculative_config
        step_cost = StepCost()  # measured step times: prompt chunks and drafts are weighed with them
        self.drafter = Drafter(spec, step_cost) if spec is not None else None
        self.spec_stats = SpecDecodeStats(spec.num_speculative_tokens if spec is not None else 0)
        propose = self.drafter.propose if self.drafter is not None else None
        encoder_cache = getattr(self.runner, "encoder_cache", None)
        encoder_budget = None if encoder_cache is None else EncoderBudget(budget, encoder_cache.__contains__)
        self.scheduler = Scheduler(
            self.kv, self.config.max_num_seqs, budget, propose, encoder_budget, self.config.itl_target_s, step_cost
        )
        self.sampler = Sampler(self.vocab_size, self.runner.device, seed=self.config.seed)
        # NOTE: pipeline stages overlap with a step per stage in flight (engine.step_pipeline); drafts need each
        # step's verdict before the next, so speculative decoding runs one step at a time
        pp_size = self.config.pipeline_parallel_size
        pipelined = isinstance(self.runner, ParallelRunner) and pp_size > 1 and spec is None
        self.steps_in_flight = StepsInFlight(pp_size) if pipelined else None
        self.eos_token_ids = eos_token_ids(self.model_dir, self.runner.hf_config, self.tokenizer)
        # NOTE: thread-safe; xgrammar loads on the first constrained request.
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.structured_output = StructuredOutputManager(self.vocab_size)
        # NOTE: a sequence never outgrows max_model_len nor what the whole KV cache holds of one request
        # (sliding-window layers hold their windows only: with no full-attention layer, any length; the
        # scheduler cuts a prefill chunk to what they hold, down to one token a step).
        self.max_num_tokens = self.kv.max_num_tokens(self.max_model_len, max_chunk=1)
        self.processor = Processor(
            self.tokenizer, self.vocab_size, self.max_model_len, self.max_num_tokens, self.image_prompts,
            self.grammars, self.model_name, self.task,
        )  # fmt: skip
        self.pooling, self.pooling_tokens = pooling_parts(pooling, self.runner, self.tokenizer, budget)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.request_stats = RequestStats()
        debug_log.configure_from_env()
        self.step_log = debug_log.StepLog(self.kv.block_pool)
        self._parents: dict[str, ParentRequest] = {}  # unfinished user requests (pins computing included)
        self._failures: dict[str, EngineError] = {}
        self._aborted_deltas: list[Delta] = []  # the last deltas of requests aborted since the latest step
        self._pins: set[str] = set()  # pinned prefixes, computing or held
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._busy_seconds = 0.0
        self._debug = False  # the step log's state, as checked at the latest step
        self._closed = False
        self.persisted_kv: PersistedKVCache | None = None  # kv_cache_dir's blocks, loaded before any request
        if self.config.kv_cache_dir is not None and self.runner.kv_cache_windows != (None,):
            logger.warning(
                "kv_cache_dir %s not used: persisted blocks hold full-attention layers only, and this model has "
                "sliding-window layers", self.config.kv_cache_dir,
            )  # fmt: skip
        elif self.config.kv_cache_dir is not None:
            self.persisted_kv = PersistedKVCache(
                self.config.kv_cache_dir, self.kv, self.runner, self.config.kv_cache_save_hot_blocks,
                self.config.kv_cache_save_interval_s,
            )
            self.persisted_kv.load()

    # ---------------------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Aborts the unfinished requests and saves the KV cache to ``kv_cache_dir`` (when set); idempotent.

        The engine takes no request after.

        Raises:
            OSError: ``kv_cache_dir`` cannot be written (the engine is closed all the same).
            KVTransferFailed: a tensor- or pipeline-parallel rank did not give its part of the blocks (nothing is
                written; the engine is closed all the same).
        """
        if self._closed:
            return
        self._closed = True
        self.abort_request(list(self._parents))
        try:
            if self.steps_in_flight is not None:
                self._drain_steps()
            if self.persisted_kv is not None:
                self.persisted_kv.save(self.pinned_prefix_ids())
        finally:
            self.runner.close()

    def save_kv_cache(self) -> int:
        """Saves the pinned prefixes' and the hottest cached blocks to ``kv_cache_dir`` now, between steps.

        Returns:
            The block files written (blocks saved before are kept as they are).

        Raises:
            EngineError: no ``kv_cache_dir`` is set; ``KVTransferFailed`` where a tensor- or pipeline-parallel
                rank did not give its part of the blocks (nothing is written).
            OSError: the directory cannot be written.
        """
        if self.persisted_kv is None:
            raise EngineError("save_kv_cache needs kv_cache_dir")
        return self.persisted_kv.save(self.pinned_prefix_ids())

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------- requests in

    def tokenize(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids: a str is encoded (with the tokenizer's special tokens), ids pass through, a
        prompt with images gets each placeholder expanded to the image's tokens (``Processor.process_prompt``)."""
        return self.processor.process_prompt(prompt).prompt_token_ids

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        params: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        *,
        tenant: str | None = None,
        weight: float = 1.0,
    ) -> str:
        """Queues a request; it joins the running batch at the next step that has room.

        Args:
            request_id: Unique among unfinished requests; None = one is made up.
            prompt: Text, token ids, or either with images (``TextPrompt``, ``TokensPrompt``).
            params: How to sample; None = ``SamplingParams()``.
            priority: Smaller runs first; FIFO within one priority.
            cache_salt: Requests with different salts never share KV blocks.
            tenant: Who the request is for; within a priority level tenants share the token
                budget by ``weight`` (``engine.core.fair_share``). None = one shared tenant.
            weight: The tenant's share, relative to the other tenants' (> 0).

        Returns:
            The request id.

        Raises:
            RequestRejected: The prompt can never be served, or its images cannot (``Processor.process``).
            ParameterError: The id is in use, ``params`` is not a SamplingParams, or
                ``request_id``, ``priority``, ``cache_salt``, ``tenant`` or ``weight`` is out
                of bounds, or the structured-output constraint does not compile.
            Either is counted in ``stats()["requests_rejected"]``.
        """
        request = self._process(request_id, prompt, params, priority, cache_salt, tenant=tenant, weight=weight)
        return self.enqueue(request)

    def enqueue(self, request: ProcessedRequest, received: Received | None = None) -> str:
        """Queues a request a ``Processor`` made (this engine's, or a caller-side one: ``AsyncEngine``) as it is.

        With ``received`` (``n == 1`` only) it continues a run whose caller already got those tokens:
        they are its output so far, and its deltas carry only what follows.

        Returns:
            The request id (a pin's: its pin id).

        Raises:
            ParameterError: The id is in use (counted in ``stats()["requests_rejected"]``).
            EngineError: The engine is closed.
        """
        if request.pin:
            request_id = f"pin-{next(self._ids)}"
        elif request.request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif request.request_id in self._parents or request.request_id in self._pins:
            self.request_stats.num_rejected += 1
            raise ParameterError("request_id", f"request id {request.request_id!r} is already in use")
        else:
            request_id = request.request_id
        if self._closed:
            raise EngineError("the engine is closed")
        params = request.params
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        children = [
            Request(
                request_id if params.n == 1 else f"{index}_{request_id}",
                request.prompt_token_ids,
                params if params.n == 1 else params.for_completion(index),
                priority=request.priority, arrival_seq=next(self._arrivals), cache_salt=request.cache_salt,
                images=request.images, tenant=request.tenant, weight=request.weight,
                stop_token_ids=stop_ids, max_num_tokens=self.max_num_tokens, keep_blocks=request.pin,
                parent_id=request_id, index=index,
            )
            for index in range(params.n)
        ]
        resumed = received.token_ids if received is not None else []
        for child in children:
            child.all_token_ids.extend(resumed)
            if request.grammar is not None:  # NOTE: first: it raises on output the grammar refuses
                self.structured_output.add_request(child.req_id, request.grammar, resumed)
            self.output_processor.add_request(child, received)
            self.scheduler.add_request(child)
        self._parents[request_id] = ParentRequest(request_id, request.prompt_token_ids, children, bool(resumed))
        if request.pin:
            self._pins.add(request_id)
        else:  # NOTE: pins are the engine's own requests, not counted as taken
            self.request_stats.num_received += 1
        if debug_log.is_enabled():
            for child in children:
                self.step_log.added(child)
        return request_id

    def _process(
        self, request_id: str | None, prompt: Prompt, params: SamplingParams | None, priority: int = 0,
        cache_salt: str | None = None, *, tenant: str | None = None, weight: float = 1.0,
    ) -> ProcessedRequest:  # fmt: skip
        """``self.processor.process``; a refusal is counted in ``stats()["requests_rejected"]``."""
        try:
            return self.processor.process(request_id, prompt, params, priority, cache_salt, tenant=tenant, weight=weight)
        except ParameterError:
            self.request_stats.num_rejected += 1
            raise

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Finishes requests now (finish_reason "abort") and frees their blocks; unknown ids are skipped.

        Their last deltas wait for ``pop_deltas()`` or the next ``step_deltas()`` (``step()`` drops them).

        Returns:
            The final output of each request aborted.
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for request_id in ids:
            if request_id in self._pins:  # a pin, computing or held: its blocks go too
                self.unpin_prefix(request_id)
                continue
            parent = self._parents.get(request_id)
            if parent is None:
                continue
            self.scheduler.finish_requests([c.req_id for c in parent.children], RequestStatus.FINISHED_ABORTED)
            # NOTE: its final output is this one: no later step emits it.
            metrics = self.output_processor.metrics(parent)
            self._aborted_deltas += self.output_processor.deltas(parent, metrics)
            outputs.append(self.output_processor.make_output(parent, metrics))
            self._retire(parent, metrics)
        return outputs

    def pin_prefix(self, prompt: Prompt, cache_salt: str | None = None) -> str:
        """Computes the prompt's KV once and keeps its blocks referenced until ``unpin_prefix``.

        The pin request runs like any other (one greedy token); its blocks are held once
        it finishes.

        Returns:
            The pin id, also the id of the request that computes it.

        Raises:
            RequestRejected: The prompt can never be served.
            ParameterError: ``cache_salt`` is of the wrong type or too long.
        """
        return self.enqueue(self.processor.process(None, prompt, cache_salt=cache_salt, pin=True))

    def unpin_prefix(self, pin_id: str) -> None:
        """Releases a pinned prefix's blocks (they stay cached until evicted); unknown ids are a no-op.

        A pin still computing is aborted (its request emits no output).
        """
        if pin_id not in self._pins:
            return
        self._pins.discard(pin_id)
        parent = self._parents.pop(pin_id, None)
        if parent is not None:
            self.scheduler.finish_requests([pin_id], RequestStatus.FINISHED_ABORTED)
            self.output_processor.free(parent)
        self.kv.free(pin_id)

    # ---------------------------------------------------------------------------- stepping

    def has_unfinished_requests(self) -> bool:
        return self._has_steps() or (self.pooling is not None and self.pooling.has_unfinished())

    def _has_steps(self) -> bool:
        """Whether a step has work: requests to schedule, or steps in the pipe to sample."""
        return self.scheduler.has_unfinished_requests() or bool(self.steps_in_flight)

    def unfinished_request_ids(self) -> list[str]:
        """The user requests whose final output is still to come (computing pins included)."""
        return list(self._parents)

    def pinned_prefix_ids(self) -> list[str]:
        """The pinned prefixes, computing or held."""
        return list(self._pins)

    def step(self) -> list[RequestOutput]:
        """Runs one step.

        Returns:
            The cumulative output of every request that progressed or finished in it;
            failed requests finish with reason "abort" and their errors are in ``pop_failures()``.
            Each output copies its request's output so far: to stream, use ``step_deltas()``.
        """
        self._aborted_deltas.clear()
        if self.pooling is not None:
            self.pooling.step()
        outputs = []
        for parent in self._step() if self._has_steps() else []:
            metrics = self.output_processor.metrics(parent)
            outputs.append(self.output_processor.make_output(parent, metrics))
            if parent.finished:
                self._retire(parent, metrics)
        return outputs

    def step_deltas(self) -> list[Delta]:
        """Runs one step (none when no request is unfinished).

        Returns:
            What each request gained in it, one ``Delta`` per completion that progressed or
            finished, after those ``pop_deltas()`` would return; a request's deltas are
            consecutive, and its last one has ``usage``. Failed requests finish with reason
            "abort" and their errors are in ``pop_failures()``.
        """
        deltas = self.pop_deltas()
        if self.pooling is not None:
            self.pooling.step()
        if not self._has_steps():
            return deltas
        for parent in self._step():
            metrics = self.output_processor.metrics(parent) if parent.finished else None
            deltas += self.output_processor.deltas(parent, metrics)
            if metrics is not None:
                self._retire(parent, metrics)
        return deltas

    def pop_deltas(self) -> list[Delta]:
        """The last deltas of the requests ``abort_request`` finished since the latest step or call."""
        deltas, self._aborted_deltas = self._aborted_deltas, []
        return deltas

    def pop_failures(self) -> dict[str, EngineError]:
        """The errors of requests failed since the last call, by request id."""
        failures, self._failures = self._failures, {}
        return failures

    def _step(self) -> list[ParentRequest]:
        """Schedules, runs, samples and records one step; returns the user requests it changed (finished ones too)."""
        if self.steps_in_flight is not None:
            return self._pipelined_step()
        if self.persisted_kv is not None:  # NOTE: before scheduling: every block registered so far is computed
            self.persisted_kv.save_if_due(self.pinned_prefix_ids())
        start = time.perf_counter()
        # NOTE: the one check of the step log per step; off, nothing below formats or times for it.
        debug = debug_log.is_enabled()
        if debug and not self._debug:
            self.step_log.start()
        self._debug = debug
        self.scheduler.events = [] if debug else None
        scheduler_output = self.scheduler.schedule()
        if debug:
            scheduled_at = time.perf_counter()
            requests_after_schedule = dict(self.scheduler.requests)
        touched: dict[str, None] = {}  # parent ids, in order
        self._after_schedule(scheduler_output, touched)
        if scheduler_output.scheduled:
            try:
                logits = self.runner.execute_model(scheduler_output)
            except Exception as exc:
                logger.exception("step failed; failing its %d requests", len(scheduler_output.scheduled))
                self._fail_step(exc, [s.req_id for s in scheduler_output.scheduled], touched)
                if isinstance(exc, WorkerGroupFailed):  # whoever owns the engine starts a fresh one
                    raise
            else:
                if any(s.num_draft_tokens for s in scheduler_output.scheduled):
                    self._verify(logits, scheduler_output, touched)
                else:
                    requests = self.scheduler.requests
                    rows = [requests[s.req_id] for s in scheduler_output.scheduled if s.needs_logits]
                    self._sample_and_process(logits, rows, touched)
                # NOTE: schedule, forward pass and sampling (drafts verified): the time the step's decodes waited
                self.scheduler.record_step(scheduler_output, time.perf_counter() - start)
        computed_at = time.perf_counter()
        self._busy_seconds += computed_at - start
        parents = [parent for parent_id in touched if (parent := self._parents.get(parent_id)) is not None]
        if debug:
            times = (start, scheduled_at, computed_at, time.perf_counter())
            self.step_log.step(scheduler_output, requests_after_schedule, self.scheduler.events or [], times)
        return parents

    def _after_schedule(self, scheduler_output: SchedulerOutput, touched: dict[str, None]) -> None:
        """Drops the per-request state of the requests finished since the last schedule; the requests it capped
        changed."""
        self.sampler.free(scheduler_output.finished_req_ids)
        self.structured_output.free(scheduler_output.finished_req_ids)
        if self.drafter is not None:
            self.drafter.free(scheduler_output.finished_req_ids)
        for request in self.scheduler.capped:
            touched[request.parent_id] = None
        self.scheduler.capped.clear()

    def _fail_step(self, exc: Exception, req_ids: list[str], touched: dict[str, None]) -> None:
        """A step's forward pass failed: its requests fail; with the worker group dead, every request and pin."""
        error = EngineError(f"the engine failed a step: {exc!r}")
        for req_id in req_ids:
            request = self.scheduler.requests.get(req_id)
            if request is not None:  # None: a sibling failed it already
                self._fail(request.parent_id, error, touched)
        if isinstance(exc, WorkerGroupFailed):  # no later step can run: every request and pin ends now
            for parent_id in list(self._parents):
                self._fail(parent_id, exc, touched)
            for pin_id in list(self._pins):
                self.unpin_prefix(pin_id)
        # NOTE: blocks hashed this step may hold unwritten K/V: forget every unreferenced hash.
        self.kv.reset_prefix_cache()

    def _verify(self, logits: Any, scheduler_output: SchedulerOutput, touched: dict[str, None]) -> None:
        """Samples a step with drafts position by position (``verify_drafts``); frees the rejected drafts' slots."""
        assert self.drafter is not None
        scheduled = scheduler_output.scheduled

        def sample(rows_logits: Any, rows: list[Request]) -> dict[str, int]:
            return self._sample_and_process(rows_logits, rows, touched)

        verified = verify_drafts(logits, scheduled, self.scheduler.requests, sample)
        for req_id, num_drafts, num_accepted in verified:
            self.drafter.observe(req_id, num_drafts, num_accepted)
            self.spec_stats.observe(num_drafts, num_accepted)
        self.scheduler.rollback_drafts(scheduled)

    def _sample_and_process(self, logits: Any, rows: list[Request], touched: dict[str, None]) -> dict[str, int]:
        """Samples one token per row, records it and appends it; returns the tokens of the rows sampled, by id."""
        def fail(parent_id: str, error: EngineError) -> None:
            self._fail(parent_id, error, touched)

        try:
            sampled = self.sampler(logits, rows, self.structured_output.token_mask(rows))
            token_ids, logprobs = sampled.token_ids, sampled.logprobs
        except Exception:
            logger.exception("batch sampling failed; sampling row by row")
            token_ids, logprobs, ok_rows = [], [], []
            for i, request in enumerate(rows):
                try:
                    one = self.sampler(logits[i : i + 1], [request], self.structured_output.token_mask([request]))
                except Exception as exc:
                    fail(request.parent_id, EngineError(f"sampling failed: {exc!r}"))
                    continue
                ok_rows.append(request)
                token_ids.append(one.token_ids[0])
                logprobs.append(one.logprobs[0])
            rows = ok_rows
        stopped = self.output_processor.process(rows, token_ids, logprobs, touched, fail)
        complete, refused = self.structured_output.accept(rows, token_ids)
        for request in rows:
            if request.req_id in refused:
                fail(request.parent_id, EngineError(refused[request.req_id]))
        self.scheduler.update_from_output(rows, token_ids, stopped | complete)
        return {request.req_id: token_id for request, token_id in zip(rows, token_ids)}

    def _fail(self, parent_id: str, error: EngineError, touched: dict[str, None]) -> None:
        parent = self._parents.get(parent_id)
        if parent is None:
            return
        # NOTE: a failed pin holds nothing: the scheduler frees the blocks of failed requests.
        self.scheduler.finish_requests([c.req_id for c in parent.children], RequestStatus.FINISHED_ERROR)
        self._failures[parent_id] = error
        self._pins.discard(parent_id)
        touched[parent_id] = None

    def _retire(self, parent: ParentRequest, metrics: RequestMetrics) -> None:
        """A finished request's last output was made: count it, and forget it (its id is free again)."""
        del self._parents[parent.request_id]
        self.output_processor.free(parent)
        reasons = [c.status.finish_reason for c in parent.children]
        reason = "abort" if "abort" in reasons else reasons[0]
        assert reason is not None  # every completion of a finished request has its reason
        if not parent.children[0].keep_blocks:
            self.request_stats.finished(reason, metrics)
        if self._debug:
            self.step_log.finished(parent.request_id, sum(c.num_output_tokens for c in parent.children), reason, metrics)

    # ---------------------------------------------------------------------------- figures

    def stats(self) -> dict[str, Any]:
        """The engine's figures (names shared with ``/metrics`` and ``paged bench``; ``engine.engine_stats``)."""
        return engine_stats(
            self.scheduler, self.kv, self.output_processor, self.runner, self.request_stats, self.spec_stats,
            self._busy_seconds, None if self.pooling is None else self.pooling.stats,
        )  # fmt: skip
