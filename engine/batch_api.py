"""``Engine.generate``: a batch of prompts run to completion under continuous batching (vLLM's ``LLM.generate``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from engine.errors import EngineError, ParameterError
from engine.outputs import Delta, RequestMetrics, RequestOutput
from engine.processor import ProcessedRequest, Prompt
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.output_processor import OutputProcessor, ParentRequest


class BatchAPI:
    """The batch half of ``Engine``, over its request lifecycle (process, enqueue, step, retire, abort)."""

    if TYPE_CHECKING:  # what Engine provides
        output_processor: OutputProcessor
        _aborted_deltas: list[Delta]

        def _process(self, request_id: str | None, prompt: Prompt, params: SamplingParams) -> ProcessedRequest: ...
        def enqueue(self, request: ProcessedRequest) -> str: ...
        def _step(self) -> list[ParentRequest]: ...
        def _retire(self, parent: ParentRequest, metrics: RequestMetrics) -> None: ...
        def pop_failures(self) -> dict[str, EngineError]: ...
        def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]: ...

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs a batch of prompts to completion, all at once under continuous batching.

        Args:
            prompts: One prompt or a list (str, token-id lists, or either with images: ``Prompt``).
            params: One SamplingParams for all, or one per prompt; None = defaults.
            use_tqdm: Show a progress bar (batches of more than one prompt).

        Returns:
            The final output of each prompt, in the prompts' order.

        Raises:
            RequestRejected: A prompt can never be served (nothing is run).
            ParameterError: ``params`` is not a SamplingParams (or a list of one per prompt).
            EngineError: The engine failed one of the requests (the others are aborted).
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ParameterError("params", f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        requests = [self._process(None, prompt, p) for prompt, p in zip(prompts, params)]
        ids = [self.enqueue(request) for request in requests]
        results: dict[str, RequestOutput] = {}
        pending = set(ids)
        from tqdm.auto import tqdm

        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm or len(ids) < 2)
        try:
            while pending:
                self._aborted_deltas.clear()
                for parent in self._step():
                    if not parent.finished:
                        continue
                    metrics = self.output_processor.metrics(parent)
                    if parent.request_id in pending:  # NOTE: its output is built once, when it finished
                        pending.discard(parent.request_id)
                        results[parent.request_id] = self.output_processor.make_output(parent, metrics)
                        bar.update(1)
                    self._retire(parent, metrics)
                failures = self.pop_failures()
                if failed := [i for i in ids if i in failures]:
                    raise failures[failed[0]]
        finally:
            bar.close()
            if pending:
                self.abort_request(pending)
        return [results[i] for i in ids]

