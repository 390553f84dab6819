"""The vision encoder's share of a step: the image rows one step may encode (vLLM's encoder compute budget).

A prefill chunk that reaches into an image needs the image's whole encoder output, so an image missing from the
encoder cache is encoded in the step that first reaches it, however few of its tokens that chunk holds. Without a
bound, several requests reaching large images in one step would encode them all while the step's decodes wait.
Per step, the images to encode hold at most ``max_rows`` rows, but the first always goes (an image larger than the
budget is encoded alone); a chunk that would reach an image past the budget ends before it, and a later step takes
it. Pure Python: the scheduler asks, the runner encodes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.core.block_hash import MultiModalSpan


class EncoderBudget:
    """Cuts prefill chunks so the images a step encodes stay within ``max_rows`` rows (at least one image a step).

    Args:
        max_rows: image rows (tokens) encoded per step; the engine gives its ``max_num_batched_tokens``.
        is_cached: whether the encoder cache holds an image's output, by image hash (such an image costs nothing).
    """

    def __init__(self, max_rows: int, is_cached: Callable[[str], bool]) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.is_cached = is_cached
        self._rows = 0
        self._chosen: set[str] = set()

    def start_step(self) -> None:
        """Forgets the images of the previous step."""
        self._rows = 0
        self._chosen.clear()

    def cut(self, mm_spans: Sequence[MultiModalSpan], start: int, num_new: int) -> int:
        """How many of the tokens ``start .. start + num_new`` this step may compute: up to the first image to encode
        that does not fit what is left of the step's rows. The images it reaches are counted as encoded this step.

        ``mm_spans``: the request's images (first position, tokens, hash), in position order.
        """
        end = start + num_new
        for offset, length, image_hash in mm_spans:
            if offset >= end:
                break
            if offset + length <= start or image_hash in self._chosen or self.is_cached(image_hash):
                continue
            # NOTE: an image the chunk starts inside (its output evicted since) is encoded whatever the budget
            if offset >= start and self._rows and self._rows + length > self.max_rows:
                return offset - start
            self._chosen.add(image_hash)
            self._rows += length
        return num_new
