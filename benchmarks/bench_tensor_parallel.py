"""What tensor parallelism costs a decode step on CPU: one rank against two (gloo), and the all-reduce time.

A random-weight Llama of ``--hidden`` features and ``--layers`` layers runs decode steps of each batch size on
runners in turn, round after round: one rank on the one-C-call decoder plan (how it serves) and on the modules
(the path every tensor-parallel rank takes, its collectives between the kernels), each with all the cores' threads
and with half of them, and two ranks (rank 1 a process of its own, each rank's threads a half of the cores). For
two ranks it reports the time rank 0 spent in all-reduces per step (2 a layer and one for the embedding; waits on the other rank included) and the time of
one all-reduce of a step's activations between two processes that do nothing else.

    python benchmarks/bench_tensor_parallel.py                        # hidden 1024, 8 layers, batches 1 and 16
    python benchmarks/bench_tensor_parallel.py --batches 1,4,16,64 --repeats 20
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_forward import _decode_step, _save_random, median_seconds

from engine.config import EngineConfig
from engine.distributed.communicator import Communicator, open_store
from engine.distributed.runner import ParallelRunner
from engine.worker.model_runner import ModelRunner


def _save_llama(args: argparse.Namespace, out: Path) -> Path:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128, vocab_size=args.vocab,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    return _save_random(config, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--context", type=int, default=256, help="context length of every decode sequence")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    block_size = 16
    num_blocks = max(batches) * -(-args.context // block_size) + 1
    cpus = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _save_llama(args, Path(tmp))
        config = EngineConfig(dtype="float32", device="cpu", block_size=block_size, num_blocks=num_blocks)
        parallel = ParallelRunner(dataclasses.replace(config, tensor_parallel_size=2), model_dir)
        # label -> (runner, torch threads of its process)
        plan = ModelRunner(config, model_dir)
        modules = ModelRunner(dataclasses.replace(config, enforce_eager=True), model_dir)
        half = max(1, cpus // 2)
        runners = {
            f"1 rank, decoder plan, {cpus} threads": (plan, cpus),
            f"1 rank, modules, {cpus} threads": (modules, cpus),
            f"1 rank, decoder plan, {half} threads": (plan, half),
            f"1 rank, modules, {half} threads": (modules, half),
            f"2 ranks (gloo), {half} threads each": (parallel, half),
        }
        comm = parallel.tp.comm
        times: dict[str, dict[int, list[float]]] = {label: {b: [] for b in batches} for label in runners}
        reduce_times: dict[int, list[float]] = {b: [] for b in batches}
        for b in batches:
            step = _decode_step(b, args.context, block_size, 0)
            for round_ in range(args.repeats + 1):  # round 0 warms up
                for label, (runner, threads) in runners.items():
                    torch.set_num_threads(threads)
                    before = comm.all_reduce_seconds
                    start = time.perf_counter()
                    runner.execute_model(step)
                    if round_:
                        times[label][b].append(time.perf_counter() - start)
                        if runner is parallel:
                            reduce_times[b].append(comm.all_reduce_seconds - before)
        parallel.workers.close()
        del runners, parallel, plan, modules
    torch.set_num_threads(cpus)
    alone = dict(zip(batches, _all_reduce_alone([(b, args.hidden) for b in batches], 50)))
    print(f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, context {args.context}, {cpus} CPUs; "
          f"threads: 1 rank {cpus}, each of 2 ranks {max(1, cpus // 2)}")
    print("| runner | " + " | ".join(f"batch {b}: step ms" for b in batches) + " |")
    print("| --- | " + " | ".join("---" for _ in batches) + " |")
    for label, by_batch in times.items():
        print(f"| {label} | " + " | ".join(f"{statistics.median(by_batch[b]) * 1e3:.2f}" for b in batches) + " |")
    print(f"| 2 ranks: rank 0 in all-reduces a step ({2 * args.layers + 1} of them, waits included), ms | "
          + " | ".join(f"{statistics.median(reduce_times[b]) * 1e3:.2f}" for b in batches) + " |")
    print("| one all-reduce of [batch, hidden] float32 between 2 idle processes, us | "
          + " | ".join(f"{alone[b] * 1e6:.0f}" for b in batches) + " |")


def _all_reduce_peer(port: int, shapes: list[tuple[int, int]], repeats: int) -> None:
    comm = Communicator(open_store(port, 2, is_master=False), 1, 2, torch.device("cpu"), 60.0)
    for shape in shapes:
        for _ in range(repeats + 1):
            comm.all_reduce(torch.ones(shape))


def _all_reduce_alone(shapes: list[tuple[int, int]], repeats: int) -> list[float]:
    """Median seconds of one gloo all-reduce of each shape between two processes that do nothing else."""
    store = open_store(0, 2, is_master=True)
    peer = multiprocessing.get_context("spawn").Process(target=_all_reduce_peer, args=(store.port, shapes, repeats))
    peer.start()
    comm = Communicator(store, 0, 2, torch.device("cpu"), 60.0)
    medians = []
    for shape in shapes:
        x = torch.ones(shape)
        medians.append(median_seconds(lambda: comm.all_reduce(x), repeats))
    peer.join()
    return medians


if __name__ == "__main__":
    main()
