"""The docs' benchmark tables, rendered from the results file (``records.py``), so that none is edited by hand.

A page marks each table's place with ``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->`` on lines of their
own; ``render_page`` replaces what stands between them with ``FIGURES[NAME]``'s table of the records. A table
shows what the latest runs measured: where a row sums up several runs, it takes the runs of its latest date
(rounds and runs counted one by one) and gives their median and range; every row names its date and commit.
Rendering reads nothing but the records, so the same file always gives the same pages.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from engine.model_files.gguf import TYPE_IDS
from integrations.bench.report import ENGINE
from integrations.errors import CommandError

Record = dict[str, Any]

PAGES = ("README.md", "docs/benchmarks.md", "docs/performance.md")  # the pages that hold figures
BUNDLED_SHAPE = "SmolLM2-135M"
PROTOCOL = (64, 128)  # the bundled model's runs against vLLM: requests, new tokens each
# The names of the cores a family and model stand for, where /proc/cpuinfo's model name does not say.
CORES = {("AMD", 25, 17): "Zen 4", ("AMD", 26, 2): "Zen 5"}
WORKLOADS = {"shared-prefix": "shared prefix", "distinct": "distinct prompts", "rag": "RAG"}
# A figure block's opening (``<!-- figures:NAME -->``) or closing (``<!-- /figures:NAME -->``) line.
_MARKER = re.compile(r"^<!-- (?P<close>/?)figures:(?P<name>\S+) -->$", re.M)


class FiguresError(CommandError):
    """A page's markers are malformed or name no known figure; the message names the page and the marker."""


# ------------------------------------------------------------------------------------------------ a record


@dataclass(frozen=True)
class Sample:
    """One measurement of the engine against a peer: a round of a run, or a run."""

    paged: float | None  # tokens/s
    peer: float | None
    ratio: float  # paged / peer


def machine_key(record: Record) -> tuple[Any, ...]:
    m = record["machine"]
    return m["cpu"], m.get("cpu_family"), m.get("cpu_model"), tuple(m.get("cpu_flags") or ()), m.get("cpu_count")


def cpu_label(machine: dict[str, Any]) -> str:
    """``AMD EPYC Zen 4``; a core not named in ``CORES`` by its family and model, where known."""
    name, family, model = machine["cpu"], machine.get("cpu_family"), machine.get("cpu_model")
    vendor = next((v for v in ("AMD", "Intel") if v in name), "")
    core = CORES.get((vendor, family, model))
    if core:
        return f"{name} {core}"
    return name if family is None else f"{name} (family {family}, model {model})"


def flags_label(machine: dict[str, Any]) -> str:
    return " ".join(machine.get("cpu_flags") or ()) or "-"


def engine_result(record: Record) -> Record | None:
    if record.get("batch1"):
        return record["batch1"]["results"][0]
    return next((r for r in record["results"] if r["name"] == ENGINE), None)


def engine_setting(record: Record) -> str:
    """What the engine ran: the weights' dtype and the quantization its linears ran in (``bfloat16 + w8a8``,
    ``float32 + gguf (Q4_K_M)``), and the dense layout a small GGUF keeps for batches (``+ w8a8 from 4 rows``)."""
    engine = engine_result(record) or {}
    weights = engine.get("weights")
    quantization = weights.get("quantization") if weights else record["protocol"].get("engine", {}).get("quantization")
    file_type = record["model"].get("file_type")
    if quantization is None and file_type and weights and weights.get("modules", {}).keys() & TYPE_IDS.keys():
        quantization = "gguf"  # a .gguf runs its own blocks unless told otherwise
    setting = record["protocol"]["dtype"] + (f" + {quantization}" if quantization else "")
    setting += f" ({file_type})" if quantization == "gguf" and file_type else ""
    batched = (weights or {}).get("batched")
    setting += f" + w8a8 from {batched['min_rows']} rows" if batched else ""
    kv = (record["protocol"].get("engine") or {}).get("kv_cache_dtype")
    return setting + (f", {kv} KV cache" if kv not in (None, "auto") else "")


def is_default_engine(record: Record) -> bool:
    """A run of ``Engine()`` as it loads with no options: dtype ``auto``, no quantization named."""
    engine = record["protocol"].get("engine") or {}
    return engine.get("dtype") == "auto" and engine.get("quantization") is None


def peer_label(record: Record, name: str) -> str:
    """A peer as the tables name it: ``vLLM, bfloat16``, ``llama-server, 16 slots``, ``llama-bench``."""
    if name.startswith("vLLM"):
        dtype = record["protocol"].get("vllm_dtype")
        return f"vLLM, {dtype}" if dtype else "vLLM"
    return name.removeprefix("llama.cpp ")


def peers(record: Record) -> list[str]:
    """The names of the contenders other than the engine."""
    rows = record["batch1"]["results"] if record.get("batch1") else record["results"]
    return [r["name"] for r in rows if r["name"] != ENGINE]


def samples(record: Record, peer: str, measure: str = "tokens_per_s") -> list[Sample]:
    """The engine against ``peer`` in every round of ``record`` (one sample without rounds); ``measure`` is
    ``decode_tok_s`` or ``prefill_tok_s`` for a batch-1 run."""
    if record.get("batch1"):
        rows = {r["name"]: r for r in record["batch1"]["results"]}
        ratio_key = measure.replace("_tok_s", "_ratio_to_engine")
        return [_sample(rows[ENGINE].get(measure), rows[peer].get(measure), rows[peer].get(ratio_key))]
    rounds = {r["name"]: r for r in record.get("rounds") or ()}
    if peer in rounds:
        pairs = zip(rounds[ENGINE]["tokens_per_s"], rounds[peer]["tokens_per_s"], rounds[peer]["ratio_to_engine"])
        return [_sample(e, p, r) for e, p, r in pairs]
    rows = {r["name"]: r for r in record["results"]}
    return [_sample(rows[ENGINE]["tokens_per_s"], rows[peer]["tokens_per_s"], rows[peer]["ratio_to_engine"])]


def _sample(paged: float | None, peer: float | None, ratio_to_engine: float | None) -> Sample:
    if paged and peer:
        return Sample(paged, peer, paged / peer)
    if not ratio_to_engine:
        raise FiguresError("a record has neither both rates nor the ratio of a peer to the engine")
    return Sample(paged, peer, 1 / ratio_to_engine)


def latest_run(runs: list[Record], records: list[Record]) -> Record:
    """The one of ``runs`` that came last in ``records``, the results file's order."""
    position = {id(r): i for i, r in enumerate(records)}
    return max(runs, key=lambda r: position[id(r)])


def latest_day(records: list[Record]) -> list[Record]:
    """The records of the latest date among ``records``."""
    last = max(r["date"] for r in records)
    return [r for r in records if r["date"] == last]


# ------------------------------------------------------------------------------------------------ cells


def rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def rates(values: Iterable[float | None]) -> str:
    return " / ".join(rate(v) for v in values)


def ratio(value: float) -> str:
    return f"{value:.2f}x"


def median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def summed_up(group: list[Sample]) -> str:
    """``**1.98x** (median of 7, 1.66-2.17x)``: the median ratio in bold, with the count and range of several."""
    values = [s.ratio for s in group]
    head = f"**{ratio(statistics.median(values))}**"
    if len(values) == 1:
        return head
    return f"{head} (median of {len(values)}, {min(values):.2f}-{ratio(max(values))})"


def commit_cell(record: Record) -> str:
    """The engine's commit (``+``: with changes not committed); ``≤ sha`` for a run copied in from the docs, whose
    engine was that commit's or an earlier one's."""
    if record.get("commit"):
        return f"`{record['commit'][:7]}`" + ("+" if record.get("dirty") else "")
    if record.get("recorded_in"):
        return f"≤ `{record['recorded_in'][:7]}`"
    return "-"


def measured(record: Record) -> str:
    return f"{record['date']}, {commit_cell(record)}"


def table(header: list[str], rows: list[list[str]], right: Iterable[int] = ()) -> str:
    """A Markdown table; the columns in ``right`` aligned right, columns with no figure in any row left out."""
    keep = [i for i in range(len(header)) if any(row[i] != "-" for row in rows)]
    align = ["---:" if i in set(right) else "---" for i in keep]
    lines = ["| " + " | ".join(header[i] for i in keep) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row[i] for i in keep) + " |" for row in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ selections


def is_bundled_protocol(record: Record) -> bool:
    """The bundled model at the protocol's size against vLLM, in one of the offline workloads."""
    w = record["workload"]
    return (
        record["model"].get("shape") == BUNDLED_SHAPE
        and w["name"] in WORKLOADS
        and (w["num_requests"], record["protocol"]["max_tokens"]) == PROTOCOL
        and any(p.startswith("vLLM") for p in peers(record))
    )


def by_machine(records: Iterable[Record]) -> list[list[Record]]:
    """``records`` grouped by machine, the machine measured last first."""
    groups: dict[tuple[Any, ...], list[Record]] = {}
    for r in records:
        groups.setdefault(machine_key(r), []).append(r)
    return sorted(groups.values(), key=lambda g: max(r["date"] for r in g), reverse=True)


def vllm_peer(record: Record) -> str:
    return next(p for p in peers(record) if p.startswith("vLLM"))


def latest_against_vllm(runs: list[Record], workload: str, setting: str) -> list[Record]:
    """The runs of ``workload`` with the engine in ``setting`` on their latest day (none: an empty list)."""
    group = [r for r in runs if r["workload"]["name"] == workload and engine_setting(r) == setting]
    return latest_day(group) if group else []


def vllm_samples(runs: list[Record]) -> list[Sample]:
    return [s for r in runs for s in samples(r, vllm_peer(r))]


# ------------------------------------------------------------------------------------------------ the tables


def summary(records: list[Record]) -> str:
    """Per machine, the bundled model against vLLM: vLLM in its fastest dtype measured there, the engine in its
    fastest setting measured against that, on both workloads."""
    rows = []
    for runs in by_machine(r for r in records if is_bundled_protocol(r)):
        shared = [r for r in runs if r["workload"]["name"] == "shared-prefix"]
        if not shared:
            continue
        vllm_dtype = max(shared, key=lambda r: _median_rate(r, "peer"))["protocol"].get("vllm_dtype")
        against = [r for r in runs if r["protocol"].get("vllm_dtype") == vllm_dtype]
        fastest = max(
            (r for r in shared if r["protocol"].get("vllm_dtype") == vllm_dtype), key=lambda r: _median_rate(r, "paged")
        )
        setting = engine_setting(fastest)
        cells, used = [], []
        for workload in ("shared-prefix", "distinct"):
            group = latest_against_vllm(against, workload, setting)
            used += group
            cells.append(summed_up(vllm_samples(group)) if group else "-")
        machine = runs[0]["machine"]
        last = latest_run(used, records)
        vllm = " ".join(filter(None, [vllm_peer(last).removeprefix("vLLM").strip(), vllm_dtype]))
        rows.append([cpu_label(machine), flags_label(machine), setting, vllm or "-", *cells, measured(last)])
    header = ["CPU", "flags", "engine", "vLLM", "shared prefix, paged / vLLM", "distinct prompts, paged / vLLM",
              "latest run"]  # fmt: skip
    return table(header, rows, right=(4, 5))


def _median_rate(record: Record, side: str) -> float:
    """The median round's tokens/s of the engine (``side="paged"``) or of vLLM (``"peer"``) in ``record``."""
    return median(getattr(s, side) for s in vllm_samples([record])) or 0.0


def vllm_runs(machine: Callable[[dict[str, Any]], bool]) -> Callable[[list[Record]], str]:
    """Every run of the bundled model in a chosen engine setting against vLLM on the latest day one ran on
    ``machine``, in their order."""

    def render(records: list[Record]) -> str:
        runs = [r for r in records if is_bundled_protocol(r) and machine(r["machine"]) and not is_default_engine(r)]
        if not runs:
            return "No run recorded."
        runs = latest_day(runs)
        return f"The runs of {runs[0]['date']}, in the order they ran:\n\n" + vllm_table(runs)

    return render


def default_engine(records: list[Record]) -> str:
    """Per machine, the runs of the bundled model as ``Engine()`` loads it against vLLM on their latest day."""
    groups = by_machine(r for r in records if is_bundled_protocol(r) and is_default_engine(r))
    if not groups:
        return "No run recorded."
    return vllm_table([r for runs in groups for r in latest_day(runs)], with_machine=True)


def vllm_table(runs: list[Record], with_machine: bool = False) -> str:
    """A table of ``runs`` against vLLM, a row each (its rounds' rates and ratios), the CPU and day first if asked."""
    rows = []
    for r in runs:
        peer = vllm_peer(r)
        group = samples(r, peer)
        result = {x["name"]: x for x in r["results"]}[peer]
        workload = WORKLOADS[r["workload"]["name"]]
        if len(group) > 1:
            workload += f", `--rounds {len(group)}`"
            ratios = " / ".join(ratio(s.ratio) for s in group) + f" (row {ratio(_row(r, peer))})"
        else:
            ratios = ratio(group[0].ratio)
        same = result.get("matches_engine")
        prefix = result.get("mean_common_prefix")
        agreement = "-" if same is None else f"{same:.0%}" + (
            "" if prefix is None else f" (common prefix {prefix:.1f} of {r['protocol']['max_tokens']})"
        )
        startup = result.get("startup_s")
        rows.append([
            *([cpu_label(r["machine"]), r["date"]] if with_machine else []),
            workload, engine_setting(r), rates(s.paged for s in group), peer_label(r, peer),
            rates(s.peer for s in group), ratios, agreement, "-" if startup is None else f"{startup:.0f} s",
            commit_cell(r),
        ])  # fmt: skip
    header = ["workload", "engine", "paged tok/s", "vLLM", "vLLM tok/s", "paged / vLLM",
              "same tokens as the engine", "vLLM start-up", "commit"]  # fmt: skip
    shift = 2 if with_machine else 0
    header = (["CPU", "day"] if with_machine else []) + header
    return table(header, rows, right=tuple(i + shift for i in (2, 4, 5, 6, 7)))


def _row(record: Record, peer: str) -> float:
    """The ratio of a ``--rounds`` run's row: its contenders' median rounds."""
    rows = {x["name"]: x for x in record["results"]}
    return rows[ENGINE]["tokens_per_s"] / rows[peer]["tokens_per_s"]


@dataclass(frozen=True)
class Group:
    """The runs of one comparison: a workload on a model, the engine in one setting, against one peer."""

    label: str
    measure: str
    peer: str
    records: list[Record]

    def latest(self) -> list[Record]:
        """The runs of the latest day made at the commit of its last run: a row sums up the code as it stands."""
        day = latest_day(self.records)
        return [r for r in day if r["commit"] == day[-1]["commit"]]

    def samples(self) -> list[Sample]:
        return [s for r in self.latest() for s in samples(r, self.peer, self.measure)]

    @property
    def last(self) -> Record:
        return self.latest()[-1]


def groups(records: Iterable[Record]) -> list[Group]:
    """The comparisons among ``records``, in the order each first ran; a batch-1 run makes two (decode, prefill)."""
    found: dict[tuple[Any, ...], Group] = {}
    for r in records:
        for peer in peers(r):
            for label, measure in _comparisons(r):
                key = (machine_key(r), label, engine_setting(r), peer)
                found.setdefault(key, Group(label, measure, peer, [])).records.append(r)
    return list(found.values())


def _comparisons(record: Record) -> list[tuple[str, str]]:
    model = record["model"]
    file = f", {model['file_type']} file" if model.get("file_type") else ""
    if record.get("batch1"):
        b = record["batch1"]
        at_depth = f" at depth {b['depth']}" if b.get("depth") else ""
        return [
            (f"batch-1 decode (tg{b['gen_tokens']}{at_depth}){file}", "decode_tok_s"),
            (f"batch-1 prefill (pp{b['prompt_tokens']}){file}", "prefill_tok_s"),
        ]
    w = record["workload"]
    what = WORKLOADS.get(w["name"], w["name"])
    return [(f"{w['num_requests']} requests x {record['protocol']['max_tokens']} tokens, {what}", "tokens_per_s")]


def real_sizes(machine: Callable[[dict[str, Any]], bool]) -> Callable[[list[Record]], str]:
    """The models other than the bundled one on ``machine``: each comparison's latest day of runs."""

    def render(records: list[Record]) -> str:
        found = groups(r for r in records if r["model"].get("shape") != BUNDLED_SHAPE and machine(r["machine"]))
        rows = []
        for g in found:
            group = g.samples()
            rows.append([
                f"{g.last['model'].get('shape') or g.last['model']['name']}, {g.label}", engine_setting(g.last),
                rate(median(s.paged for s in group)), peer_label(g.last, g.peer), rate(median(s.peer for s in group)),
                summed_up(group), measured(g.last),
            ])  # fmt: skip
        header = ["comparison", "engine", "paged tok/s", "peer", "peer tok/s", "paged / peer", "latest run"]
        return table(header, rows, right=(2, 4, 5)) if rows else "No run recorded."

    return render


def shape_headline(shape: str) -> Callable[[list[Record]], str]:
    """The comparisons on models of ``shape`` on the machine that measured them last (the README's lines)."""

    def render(records: list[Record]) -> str:
        machines = by_machine(r for r in records if r["model"].get("shape") == shape)
        if not machines:
            return "No run recorded."
        rows = [
            [g.label, engine_setting(g.last), peer_label(g.last, g.peer), summed_up(g.samples()), measured(g.last)]
            for g in groups(machines[0])
        ]
        machine = machines[0][0]["machine"]
        header = [f"{shape}'s shape, {cpu_label(machine)} ({flags_label(machine)})", "engine", "against",
                  "paged / peer", "latest run"]  # fmt: skip
        return table(header, rows, right=(3,))

    return render


def engine_settings(records: list[Record]) -> str:
    """The bundled model's throughput in each engine setting measured on each machine, fastest first."""
    rows = []
    for runs in by_machine(r for r in records if is_bundled_protocol(r)):
        machine, found = runs[0]["machine"], []
        for setting in dict.fromkeys(engine_setting(r) for r in runs):
            cells, used = [], []
            for workload in ("shared-prefix", "distinct"):
                group = latest_against_vllm(runs, workload, setting)
                used += group
                paged = median(s.paged for s in vllm_samples(group))
                cells.append(f"{rate(paged)} ({len(group)} run{'s' * (len(group) > 1)})" if group else "-")
            speed = median(s.paged for s in vllm_samples([r for r in used if r["workload"]["name"] == "shared-prefix"]))
            found.append((-(speed or 0.0), [cpu_label(machine), flags_label(machine), setting, *cells,
                                            measured(latest_run(used, records))]))
        rows += [row for _, row in sorted(found, key=lambda f: f[0])]
    header = ["CPU", "flags", "engine", "shared prefix, tok/s", "distinct prompts, tok/s", "latest run"]
    return table(header, rows, right=(3, 4))


def hf_baselines(records: list[Record]) -> str:
    """The latest run against Hugging Face's generation: every contender of that run."""
    runs = [r for r in records if any(p.startswith(("HF generate", "transformers")) for p in peers(r))]
    if not runs:
        return "No run recorded."
    r = runs[-1]
    rows = []
    for x in r["results"]:
        ttft, itl = x["ttft_s"], x["itl_s"]
        computed = x.get("prompt_tokens_computed")
        same = x.get("matches_engine")
        rows.append([
            x["name"], rate(x["tokens_per_s"]), f"{x['ratio_to_engine']:.2f}",
            _pair(ttft, "{:.2f}", 1), _pair(itl, "{:.0f}", 1e3),
            f"{'-' if computed is None else computed} / {x['num_prompt_tokens']}",
            "-" if same is None else f"{same:.0%}",
        ])  # fmt: skip
    header = ["contender", "tok/s", "x engine", "TTFT p50 / p99 (s)", "ITL p50 / p99 (ms)",
              "prompt tokens computed / total", "same tokens as the engine"]  # fmt: skip
    caption = f"{measured(r)}, {cpu_label(r['machine'])} ({flags_label(r['machine'])}), {engine_setting(r)}:"
    return f"{caption}\n\n" + table(header, rows, right=(1, 2))


def _pair(summary: dict[str, float | None], spec: str, scale: float) -> str:
    values = [summary.get("p50"), summary.get("p99")]
    return " / ".join("-" if v is None else spec.format(v * scale) for v in values)


def _machine(
    family: int | None = None, model: int | None = None, flag: str | None = None, without: str | None = None
) -> Callable[[dict[str, Any]], bool]:
    """A machine of this family and model (any, for None), with ``flag`` and without ``without``."""

    def matches(m: dict[str, Any]) -> bool:
        flags = m.get("cpu_flags") or ()
        return (
            (family is None or (m.get("cpu_family"), m.get("cpu_model")) == (family, model))
            and (flag is None or flag in flags)
            and (without is None or without not in flags)
        )

    return matches


ZEN5, ZEN4 = _machine(26, 2), _machine(25, 17)
XEON_AMX, XEON_AVX512 = _machine(flag="amx"), _machine(6, 207, without="amx")
AVX2_ONLY = _machine(flag="avx2", without="avx512f")

FIGURES: dict[str, Callable[[list[Record]], str]] = {
    "readme-real-size": shape_headline("SmolLM2-1.7B"),
    "summary": summary,
    "vllm-default": default_engine,
    "vllm-zen5": vllm_runs(ZEN5),
    "vllm-zen4": vllm_runs(ZEN4),
    "vllm-xeon-amx": vllm_runs(XEON_AMX),
    "vllm-xeon-avx512": vllm_runs(XEON_AVX512),
    "vllm-avx2": vllm_runs(AVX2_ONLY),
    "real-sizes-zen5": real_sizes(ZEN5),
    "real-sizes-zen4": real_sizes(ZEN4),
    "real-sizes-avx2": real_sizes(AVX2_ONLY),
    "hf-baselines": hf_baselines,
    "engine-settings": engine_settings,
}


# ------------------------------------------------------------------------------------------------ pages


def render_page(text: str, records: list[Record], page: str = "page") -> str:
    """``text`` with every figure block's content rendered from ``records``.

    Raises:
        FiguresError: a marker not followed by its own closing marker (unclosed, nested, a stray closing one), or a
            name not in ``FIGURES``.
    """
    markers = list(_MARKER.finditer(text))
    out, pos = [], 0
    for i in range(0, len(markers), 2):
        start, end = markers[i], markers[i + 1] if i + 1 < len(markers) else None
        name = start["name"]
        if start["close"] or end is None or not end["close"] or end["name"] != name:
            raise FiguresError(f"{page}: {start.group(0)} is not followed by its own <!-- /figures:{name} -->")
        if name not in FIGURES:
            raise FiguresError(f"{page}: no figure named {name}; known: {', '.join(FIGURES)}")
        out += [text[pos : start.end()], "\n", FIGURES[name](records), "\n"]
        pos = end.start()
    return "".join(out) + text[pos:]
