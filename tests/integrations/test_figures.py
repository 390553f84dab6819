"""``paged figures`` and ``paged bench --record``: the docs' benchmark tables are what the committed results file
renders, a hand edit is caught, and a recorded run carries its provenance into the tables."""

from __future__ import annotations

import copy
import datetime
import json
import re
import shutil
from pathlib import Path

import pytest

from integrations.bench import figures
from integrations.bench.figures import FIGURES, PAGES, FiguresError, render_page
from integrations.bench.records import RESULTS_FILE, load_records, make_record
from integrations.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return load_records(ROOT / RESULTS_FILE)


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


def test_docs_are_what_the_results_file_renders(records: list[dict]) -> None:
    """Every page's tables equal the committed results file's rendering: a hand edit or a stale table fails here
    (`paged figures` rewrites them)."""
    used = set()
    for page in PAGES:
        text = (ROOT / page).read_text()
        assert render_page(text, records, page) == text, f"{page}: its tables are not rendered; run `paged figures`"
        used |= set(re.findall(r"^<!-- figures:(\S+) -->$", text, re.M))
    assert used == set(FIGURES)  # every table is on a page


def test_rendering_is_deterministic(records: list[dict]) -> None:
    text = (ROOT / "docs/benchmarks.md").read_text()
    again = load_records(ROOT / RESULTS_FILE)
    assert render_page(text, records) == render_page(text, again) == render_page(text, copy.deepcopy(records))
    for render in FIGURES.values():
        assert render(records) == render(again)


def test_check_names_a_hand_edited_page_and_rendering_restores_it(tmp_path: Path) -> None:
    for page in (*PAGES, str(RESULTS_FILE)):
        (tmp_path / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, tmp_path / page)
    page = tmp_path / "docs/benchmarks.md"
    original = page.read_text()
    edited = original.replace("| bfloat16 + w8a8 | 2074.9 |", "| bfloat16 + w8a8 | 2274.9 |", 1)
    assert edited != original
    page.write_text(edited)
    assert main(["figures", "--check", "--root", str(tmp_path)]) == 1
    assert page.read_text() == edited  # --check writes nothing
    assert main(["figures", "--root", str(tmp_path)]) == 0
    assert page.read_text() == original
    assert main(["figures", "--check", "--root", str(tmp_path)]) == 0


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("<!-- figures:nope -->\n<!-- /figures:nope -->\n", "no figure named nope"),
        ("<!-- figures:summary -->\nunclosed\n", "figures:summary --> is not followed by its own"),
        ("<!-- figures:summary -->\n<!-- figures:hf-baselines -->\n<!-- /figures:hf-baselines -->\n"
         "<!-- /figures:summary -->\n", "figures:summary --> is not followed by its own"),
        ("<!-- /figures:summary -->\n", "is not followed by its own"),
    ],
)
def test_malformed_markers_are_refused(records: list[dict], text: str, match: str) -> None:
    with pytest.raises(FiguresError, match=match):
        render_page(text, records, "page.md")


def test_a_later_run_on_another_cpu_leads_the_summary(records: list[dict]) -> None:
    """A run recorded on a CPU no section names shows at once, first in the summary, with its commit."""
    zen5 = next(r for r in records if r["machine"].get("cpu_family") == 26 and r["workload"]["name"] == "shared-prefix")
    new = copy.deepcopy(zen5)
    new.update(date="2027-01-05", commit="0123456789abcdef0123456789abcdef01234567", dirty=False, recorded_in=None)
    new["machine"] = {**new["machine"], "cpu": "Some CPU", "cpu_family": 7, "cpu_model": 1}
    summary = figures.summary([*records, new]).splitlines()
    assert summary[2].startswith("| Some CPU (family 7, model 1) |") and "2027-01-05, `0123456`" in summary[2]
    assert figures.vllm_runs(figures.ZEN5)([*records, new]) == figures.vllm_runs(figures.ZEN5)(records)


def test_record_keeps_the_provenance_and_only_the_speed_variables(tmp_path: Path) -> None:
    report = {
        "schema": 1, "workload": {"name": "shared-prefix"}, "machine": {"cpu": "x"},
        "model": {"name": "m.gguf", "shape": None, "file_type": "Q4_0"},
        "protocol": {"model": str(Path.home() / "models/m.gguf"), "dtype": "float32"},
        "results": [], "profile": {"phases_s": {"forward": 1.0}, "trace": "bench-out/trace.json"},
    }  # fmt: skip
    environ = {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "PAGED_API_KEY": "secret",
               "PAGED_INT8_LINEAR": "generic", "PATH": "/bin", "KMP_DUPLICATE_LIB_OK": "True"}  # fmt: skip
    command = ["paged", "bench", "--model", str(Path.home() / "models/m.gguf"), "--json", "/tmp/run.json",
               "--plot=/tmp/run.png", "--record"]  # fmt: skip
    record = make_record(report, command, environ, today=datetime.date(2027, 1, 5))
    assert record["environment"] == {"OMP_NUM_THREADS": "2", "PAGED_INT8_LINEAR": "generic",
                                     "VLLM_CPU_OMP_THREADS_BIND": "0-1"}  # fmt: skip
    assert record["command"] == (
        "OMP_NUM_THREADS=2 PAGED_INT8_LINEAR=generic VLLM_CPU_OMP_THREADS_BIND=0-1 paged bench --model "
        "~/models/m.gguf --record"
    )
    assert record["date"] == "2027-01-05" and record["source"] == "paged bench --record"
    assert record["commit"] is None or re.fullmatch(r"[0-9a-f]{40}", record["commit"])
    assert record["protocol"]["model"] == "m.gguf" and record["profile"] == {"phases_s": {"forward": 1.0}}
    assert "secret" not in json.dumps(record) and str(Path.home()) + "/" not in json.dumps(record)


def test_bench_record_appends_the_run(tiny_dir: Path, tmp_path: Path, records: list[dict]) -> None:
    results = tmp_path / "results.jsonl"
    argv = ["bench", "--model", str(tiny_dir), "--num-blocks", "64", "--num-requests", "2", "--max-tokens", "2",
            "--no-ceiling", "--no-progress", "--record", str(results)]  # fmt: skip
    assert main(argv) == 0 and main(argv) == 0
    first, second = load_records(results)
    assert first["command"] == "paged " + " ".join(argv) and first["date"] == second["date"]
    assert set(first["machine"]) >= {"cpu", "cpu_family", "cpu_model", "cpu_flags", "cpu_count", "torch_threads"}
    assert first["model"]["name"] == tiny_dir.name and first["model"]["model_type"] == "llama"
    assert first["workload"]["num_requests"] == 2 and first["results"][0]["weights"]["quantization"] is None
    for render in FIGURES.values():  # a run with no peer, of no known shape, leaves every table as it was
        assert render([*records, first, second]) == render(records)


def test_record_refuses_a_server_run() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--base-url", "http://127.0.0.1:9", "--record"])
    assert exc.value.code == 2


def test_engine_as_it_loads_has_a_table_of_its_own(records: list[dict]) -> None:
    """A run of Engine() with no options (a GGUF's blocks and its batch layout) goes to vllm-default, named by what
    ran; a run with a chosen setting stays in its machine's table."""
    default = next(r for r in records if figures.is_default_engine(r) and figures.is_bundled_protocol(r))
    chosen = copy.deepcopy(default)
    chosen["protocol"]["engine"]["dtype"] = "bfloat16"
    assert figures.engine_setting(default) == "float32 + gguf (Q4_1) + w8a8 from 4 rows"
    assert "float32 + gguf (Q4_1) + w8a8 from 4 rows" in FIGURES["vllm-default"]([default])
    assert FIGURES["vllm-zen5"]([default]) == "No run recorded."
    assert FIGURES["vllm-default"]([chosen]) == "No run recorded."
    assert "float32 + gguf (Q4_1) + w8a8 from 4 rows" in FIGURES["vllm-zen5"]([chosen])
