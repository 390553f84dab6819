"""GrammarCompiler: constraints -> xgrammar compiled grammars for one tokenizer, cached, off the step loop.

xgrammar (the ``paged[structured]`` extra) is imported when the first constrained request
arrives, and its tokenizer
description (a quarter of a second for a 49k vocabulary) is built then, once. Compiled
grammars are kept in xgrammar's own cache, bounded in bytes, keyed by the constraint, so a
repeated schema costs a lookup. Compiles run on a small thread pool of their own and are
bounded in time: a request whose constraint does not compile within ``MAX_COMPILE_SECONDS``
is rejected (its compile finishes in the background and is cached).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import threading
from collections.abc import Iterable
from typing import Any

from engine.errors import ParameterError
from engine.structured_output.params import StructuredOutput

MAX_COMPILE_SECONDS = 10.0
CACHE_BYTES = 256 << 20  # compiled grammars kept for reuse


class GrammarCompiler:
    """Compiles ``StructuredOutput`` constraints for one tokenizer; thread-safe.

    Args:
        tokenizer: The model's Hugging Face tokenizer.
        vocab_size: Columns of the model's logits (may exceed the tokenizer's vocabulary).
        stop_token_ids: The tokens that end a completion (EOS); a finished structure allows only them.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._stop_token_ids = sorted(stop_token_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="paged-grammar")

    def submit(self, constraint: StructuredOutput) -> concurrent.futures.Future[Any]:
        """Starts compiling ``constraint``; the future's result is the compiled grammar or a ``ParameterError``."""
        return self._pool.submit(self._compile, constraint)

    def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled grammar of ``constraint``, waiting at most ``MAX_COMPILE_SECONDS``.

        Raises:
            ParameterError: the constraint is invalid (a bad schema, regex or grammar, or a JSON
                schema keyword xgrammar does not support), or took too long to compile.
        """
        future = self.submit(constraint)
        try:
            return future.result(timeout=MAX_COMPILE_SECONDS)
        except concurrent.futures.TimeoutError:
            raise too_slow(constraint) from None

    def _compile(self, constraint: StructuredOutput) -> Any:
        compiler = self._get_compiler()
        try:
            if constraint.json_schema is not None:
                return compiler.compile_json_schema(constraint.json_schema, any_whitespace=False)
            if constraint.json_object:
                return compiler.compile_json_schema('{"type":"object"}', any_whitespace=False)
            if constraint.regex is not None:
                return compiler.compile_regex(constraint.regex)
            if constraint.choice is not None:
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in constraint.choice)
                return compiler.compile_grammar(f"root ::= {alternatives}")
            if constraint.structural_tag is not None:
                return compiler.compile_structural_tag(constraint.structural_tag)
            return compiler.compile_grammar(constraint.grammar)
        except (RuntimeError, ValueError) as exc:  # xgrammar reports every parse or conversion error so
            raise ParameterError.about(constraint.param, f"is invalid: {_first_line(exc)}") from None

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise ParameterError(
                        "structured_output", "structured output needs xgrammar: pip install 'paged[structured]'"
                    ) from None

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=CACHE_BYTES)
            return self._compiler

    def shutdown(self) -> None:
        """Stops the compile threads (compiles in progress finish)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


@functools.lru_cache(maxsize=256)
def json_grammar(schema: str) -> str:
    """The EBNF of JSON valid against ``schema`` (its JSON text), written without optional
    whitespace (``{"a": 1, "b": [2, 3]}``, as ``json.dumps`` writes it): the content of a
    structural tag's region that must read back exactly as it was generated.

    Raises:
        ParameterError: xgrammar is missing, or the schema does not convert; ``param`` is
            ``structured_output.structural_tag``.
    """
    param = "structured_output.structural_tag"
    try:
        import xgrammar as xgr
    except ImportError:
        raise ParameterError(param, "structured output needs xgrammar: pip install 'paged[structured]'") from None
    try:
        return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    except (RuntimeError, ValueError) as exc:
        raise ParameterError.about(param, f"holds a schema that is invalid: {_first_line(exc)}") from None


def too_slow(constraint: StructuredOutput) -> ParameterError:
    """The error of a constraint that did not compile within ``MAX_COMPILE_SECONDS``."""
    return ParameterError.about(constraint.param, f"did not compile within {MAX_COMPILE_SECONDS:g} s; simplify it")


def _first_line(exc: BaseException) -> str:
    """xgrammar's message without its source location prefix (``[time] file.cc:line: ``)."""
    line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if line.startswith("[") and ": " in line:
        line = line.split(": ", 1)[1]
    return line
