"""Structured output: constraints on a completion's text, guaranteed by masking the tokens they forbid.

``StructuredOutput`` (on ``SamplingParams.structured_output``) says what the text must be;
``GrammarCompiler`` compiles it with xgrammar, off the step loop; ``StructuredOutputManager``
keeps one matcher per constrained sequence and gives the sampler each step's token masks.
"""

from engine.structured_output.compiler import json_grammar
from engine.structured_output.params import StructuredOutput

__all__ = ["StructuredOutput", "json_grammar"]
