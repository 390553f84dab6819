"""``paged make-model``: a random-weight model of a real shape, as a Hugging Face directory and optionally a GGUF.

``paged make-model --shape SmolLM2-1.7B --out DIR [--dtype bfloat16] [--gguf Q4_K_M]`` writes DIR
(config, seeded random weights in safetensors shards, tokenizer, chat template) and, with
``--gguf``, ``DIR-<FILE_TYPE>.gguf`` beside it, converted from it tensor by tensor. ``--list``
prints the shapes with their parameter counts.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from engine.model_files.gguf_file_types import FILE_TYPES
from engine.model_files.shapes import DTYPES, SHAPES
from integrations.engine_flags import FlagError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``paged make-model`` options."""
    parser.add_argument("--shape", choices=list(SHAPES), default=None, help="the published model whose shape to use")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR", help="the Hugging Face directory to write")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="the weights' dtype")
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed (the same seed, the same weights)")
    parser.add_argument(
        "--gguf", choices=list(FILE_TYPES), default=None, metavar="FILE_TYPE",
        help=f"also write DIR-FILE_TYPE.gguf, a GGUF of this llama.cpp file type ({', '.join(FILE_TYPES)})",
    )  # fmt: skip
    parser.add_argument("--list", action="store_true", help="print the shapes and their parameter counts")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Write the model (or print the shapes).

    Raises:
        FlagError: ``--shape`` or ``--out`` missing (without ``--list``).
    """
    if args.list:
        print(format_shapes())  # noqa: T201
        return 0
    if args.shape is None or args.out is None:
        raise FlagError("--shape and --out are required (or --list to see the shapes)")
    from tqdm.auto import tqdm

    from engine.model_files.gguf_writer import write_gguf
    from engine.model_files.shapes import make_random_model

    shape = SHAPES[args.shape]
    start = time.perf_counter()
    make_random_model(shape, args.out, dtype=args.dtype, seed=args.seed)
    print(f"{args.out}: random {shape.name} in {args.dtype} ({time.perf_counter() - start:.1f} s)")  # noqa: T201
    if args.gguf:
        # NOTE: beside the directory, not in it: transformers reads a GGUF's tokenizer from the directory's
        # tokenizer files when it finds them there, and loses the GGUF's chat template.
        path = args.out.with_name(f"{args.out.name}-{args.gguf}.gguf")
        start = time.perf_counter()
        with tqdm(total=shape.num_parameters, unit="param", unit_scale=True, desc=path.name,
                  disable=args.no_progress) as bar:  # fmt: skip
            write_gguf(args.out, path, args.gguf, progress=bar.update)
        size = path.stat().st_size / 2**30
        print(f"{path}: {args.gguf}, {size:.2f} GiB ({time.perf_counter() - start:.1f} s)")  # noqa: T201
    return 0


def format_shapes() -> str:
    """The shapes as a Markdown table: name, architecture, parameters, layers, width, heads, vocab."""
    lines = ["| shape | architecture | parameters | layers | hidden | heads / KV heads | vocab |", "|" + " --- |" * 7]
    for s in SHAPES.values():
        c = s.config
        lines.append(
            f"| {s.name} | {s.model_type} | {s.num_parameters / 1e9:.2f}B | {c['num_hidden_layers']} "
            f"| {c['hidden_size']} | {c['num_attention_heads']} / {c['num_key_value_heads']} | {c['vocab_size']} |"
        )
    return "\n".join(lines)
