"""``embed`` and ``score`` of the engine, in vLLM's shapes (``LLM.embed``, ``LLM.score``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.errors import EngineError, RequestRejected, UnsupportedTask
from engine.pooling.outputs import EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput
from engine.pooling.params import PoolingParams
from engine.pooling.model_config import PoolingConfig
from engine.pooling.pooling_queue import POOLING_TOKEN_BUDGET, PoolingQueue, PoolingRequest, PoolingResult
from engine.pooling.tokens import EmbedInput, PoolingInput, PoolingTokenizer


class PoolingAPI:
    """The pooling half of ``Engine``: what it needs is ``task``, ``model_name``, ``pooling`` and ``pooling_tokens``."""

    task: str
    model_name: str
    pooling: PoolingQueue | None
    pooling_tokens: PoolingTokenizer | None

    def embed(
        self, prompts: EmbedInput | Sequence[EmbedInput], pooling_params: PoolingParams | None = None
    ) -> list[EmbeddingRequestOutput]:
        """Embeddings of ``prompts`` (texts, or token-id lists read as they are), batched under the token budget.

        Args:
            prompts: one text or token-id list, or several.
            pooling_params: dimensions, normalization, truncation, prompt prefix; None = the model's.

        Returns:
            One output per prompt, in order: ``.outputs.embedding``.

        Raises:
            UnsupportedTask: the model does not embed (a generative model, a cross-encoder).
            ParameterError: bad params; RequestRejected: an empty prompt, or one too long with truncation off.
        """
        queue, tokens = self._pooling_parts("embed")
        params = tokens.check(pooling_params)
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise RequestRejected("prompts is empty", param="prompts")
        return self._run(queue, "embed", tokens.embed_inputs(batch, params), params)

    def score(
        self, query: str, documents: str | Sequence[str], pooling_params: PoolingParams | None = None
    ) -> list[ScoringRequestOutput]:
        """The relevance of each document to ``query``: a cross-encoder's score of the pair (sigmoid of its
        logit unless ``use_activation=False``), or for an embedding model the cosine of the two embeddings.

        Raises:
            UnsupportedTask: a generative model.
            ParameterError: bad params; RequestRejected: an empty query or document, or a pair too long.
        """
        docs = [documents] if isinstance(documents, str) else list(documents)
        if self.task == "embed":
            embedded = self.embed([query, *docs], pooling_params)
            q = embedded[0].outputs.embedding
            return [
                ScoringRequestOutput(e.request_id, e.prompt_token_ids, ScoringOutput(cosine(q, e.outputs.embedding)))
                for e in embedded[1:]
            ]
        queue, tokens = self._pooling_parts("score")
        params = tokens.check(pooling_params)
        return self._run(queue, "score", tokens.pair_inputs(query, docs, params), params)

    def _pooling_parts(self, task: str) -> tuple[PoolingQueue, PoolingTokenizer]:
        if self.pooling is None or self.pooling_tokens is None or (task == "embed" and self.task != "embed"):
            raise UnsupportedTask(self.model_name, task, self.task)
        return self.pooling, self.pooling_tokens

    @staticmethod
    def _run(queue: PoolingQueue, kind: str, inputs: list[PoolingInput], params: PoolingParams) -> list:
        results: dict[int, PoolingResult | EngineError] = {}
        ids = [queue.next_id() for _ in inputs]
        # longest first, as sentence-transformers orders a batch: inputs of a length run together
        for i in sorted(range(len(inputs)), key=lambda i: -len(inputs[i].token_ids)):
            queue.add(PoolingRequest(ids[i], kind, inputs[i], params, lambda out, i=i: results.__setitem__(i, out)))
        while len(results) < len(inputs) and queue.has_unfinished():
            queue.step()
        outputs = [results[i] for i in range(len(inputs))]
        for out in outputs:
            if isinstance(out, EngineError):
                raise out
        return outputs


def pooling_parts(
    pooling: PoolingConfig | None, runner: Any, tokenizer: Any, step_budget: int
) -> tuple[PoolingQueue | None, PoolingTokenizer | None]:
    """The queue and the intake of a pooling model's requests (None, None for a generative model)."""
    if pooling is None:
        return None, None
    budget = max(step_budget, POOLING_TOKEN_BUDGET[runner.device.type])
    return PoolingQueue(runner, budget), PoolingTokenizer(tokenizer, pooling)


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two vectors (0 where one is zero)."""
    dot = sum(x * y for x, y in zip(a, b))
    norm = (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5
    return dot / norm if norm else 0.0
