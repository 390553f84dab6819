"""`paged serve`: flags map to the engine config, and the process drains and exits cleanly on SIGTERM."""

from __future__ import annotations

import argparse
import json
import signal
import urllib.request

import pytest

from integrations.engine_flags import FlagError, engine_config
from integrations.openai_server.command import add_arguments, api_keys, is_loopback
from integrations.openai_server.state import key_id
from tests.support.serve_process import serve_process


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_map_to_engine_config_and_keys(monkeypatch):
    """Engine and admission flags become EngineConfig fields; keys become {tenant: key} with hashed ids for bare keys."""
    args = _parse("--kv-cache-memory", "512MiB", "--max-num-seqs", "8", "--no-enable-prefix-caching",
                  "--max-queued-requests", "3", "--api-key", "alice=sk-a", "--api-key", "c2stYg==")  # fmt: skip
    config = engine_config(args)
    assert config.kv_cache_memory == 512 << 20 and config.max_num_seqs == 8
    assert config.enable_prefix_caching is False and config.max_queued_requests == 3
    assert config.num_blocks is None and config.max_model_len is None
    assert api_keys(args) == {"alice": "sk-a", key_id("c2stYg=="): "c2stYg=="}
    monkeypatch.setenv("PAGED_API_KEY", "sk-env")
    assert api_keys(_parse()) == {key_id("sk-env"): "sk-env"}
    assert is_loopback("127.0.0.1") and is_loopback("::1") and not is_loopback("0.0.0.0")


def test_serve_process_drains_on_sigterm(tiny_model_factory):
    """A stream in flight at SIGTERM gets a terminal error event and [DONE] after the drain timeout; the process exits 0."""
    flags = ["--model", str(tiny_model_factory("llama")), "--num-blocks", "64", "--drain-timeout", "0.5",
             "--log-level", "WARNING"]  # fmt: skip
    with serve_process(*flags) as (proc, base):
        models = json.load(urllib.request.urlopen(base + "/v1/models", timeout=5))
        body = {"model": models["data"][0]["id"], "prompt": "hi", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        request = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as resp:
            assert resp.readline().startswith(b"data: ")
            proc.send_signal(signal.SIGTERM)
            lines = [line.strip() for line in resp if line.strip()]
        assert lines[-1] == b"data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == "shutdown"
        assert proc.wait(30) == 0


def test_serve_process_journals_on_sigterm_and_the_next_process_finishes_it(tiny_model_factory, tmp_path):
    """With --drain-journal, a stream cut by SIGTERM ends with request_journalled naming its id; `paged serve` started
    again on the same --kv-cache-dir answers the whole completion at GET /v1/completions/{id}."""
    flags = ["--model", str(tiny_model_factory("llama")), "--num-blocks", "256", "--drain-timeout", "0.5",
             "--log-level", "WARNING", "--drain-journal", "--kv-cache-dir", str(tmp_path)]  # fmt: skip
    with serve_process(*flags) as (proc, base):
        models = json.load(urllib.request.urlopen(base + "/v1/models", timeout=5))
        body = {"model": models["data"][0]["id"], "prompt": "hi", "max_tokens": 2000, "ignore_eos": True, "stream": True,
                "temperature": 0, "return_token_ids": True}  # fmt: skip
        request = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as resp:
            first = resp.readline().strip()
            assert first.startswith(b"data: ")
            proc.send_signal(signal.SIGTERM)
            lines = [first, *(line.strip() for line in resp if line.strip())]
        assert lines[-1] == b"data: [DONE]" and proc.wait(30) == 0
        error = json.loads(lines[-2][6:])["error"]
        assert error["code"] == "request_journalled"
    sent = [t for line in lines[:-2] for c in json.loads(line[6:])["choices"] for t in c["token_ids"]]
    with serve_process(*flags) as (proc, base):
        url = f"{base}/v1/completions/{error['request_id']}"
        result = json.load(urllib.request.urlopen(url, timeout=120))
        again = urllib.request.Request(
            base + "/v1/completions", json.dumps({**body, "stream": False}).encode(), {"Content-Type": "application/json"}
        )  # fmt: skip
        uninterrupted = json.load(urllib.request.urlopen(again, timeout=120))["choices"][0]
    choice = result["choices"][0]
    assert result["id"] == error["request_id"] and choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 2000 and choice["token_ids"][: len(sent)] == sent
    assert choice["token_ids"] == uninterrupted["token_ids"] and choice["text"] == uninterrupted["text"]


def test_serve_rejects_bad_settings_before_binding(tmp_path):
    """Invalid engine flags (a usage error) or a missing model path stop serve instead of serving a dead engine."""
    from integrations.serve_command import run

    with pytest.raises(FlagError, match="--max-num-seqs"):
        run(_parse("--max-num-seqs", "0"))
    with pytest.raises(FlagError, match="--kv-cache-memory or --num-blocks"):
        run(_parse("--kv-cache-memory", "1G", "--num-blocks", "4"))
    assert run(_parse("--model", str(tmp_path / "missing"))) == 2


def test_serve_warns_when_exposed_without_key(monkeypatch, caplog):
    """Binding beyond loopback without a key logs a warning; the runner gets handler cancellation and the drain budget."""
    from aiohttp import web

    from integrations import serve_command
    from integrations.openai_server import command

    calls = []
    monkeypatch.setattr(serve_command.web, "run_app", lambda app, **kwargs: calls.append((app, kwargs)))
    monkeypatch.delenv("PAGED_API_KEY", raising=False)
    with caplog.at_level("WARNING", logger=command.__name__):
        assert serve_command.run(_parse("--host", "0.0.0.0", "--drain-timeout", "3")) == 0
    assert any("without --api-key" in r.message for r in caplog.records)
    app, kwargs = calls[0]
    assert isinstance(app, web.Application) and kwargs["host"] == "0.0.0.0"
    assert kwargs["handler_cancellation"] is True and kwargs["shutdown_timeout"] > 3
    caplog.clear()
    assert serve_command.run(_parse("--api-key", "k")) == 0
    assert not any("without --api-key" in r.message for r in caplog.records)
    assert calls[1][1]["host"] == "127.0.0.1"


def test_audit_replay_flag_reaches_the_audit_log(monkeypatch, tmp_path):
    """--audit-replay digest gives the server's AuditLog a token store beside the log; without --audit-log it is refused."""
    from integrations import serve_command
    from integrations.openai_server import command

    made = []
    monkeypatch.setattr(command, "create_app", lambda model, **kwargs: made.append(kwargs["hooks"]))
    monkeypatch.setattr(command.web, "run_app", lambda app, **kwargs: None)
    assert serve_command.run(_parse("--audit-replay", "inline")) == 2
    log = tmp_path / "audit.jsonl"
    assert serve_command.run(_parse("--audit-log", str(log), "--audit-replay", "digest")) == 0
    (audit,) = made[0]
    assert audit.path == log and audit.replay == "digest" and audit.store is not None


def test_self_healing_flags_reach_the_engine(monkeypatch):
    """--max-restarts and --restart-*-s build the engine's RestartPolicy; a value out of bounds names its flag."""
    from engine.supervisor import RestartPolicy
    from integrations import serve_command
    from integrations.openai_server import command

    made = []
    monkeypatch.setattr(command, "create_app", lambda model, **kwargs: made.append(kwargs["restart"]))
    monkeypatch.setattr(command.web, "run_app", lambda app, **kwargs: None)
    assert serve_command.run(_parse()) == 0
    assert serve_command.run(_parse("--max-restarts", "0", "--restart-backoff-s", "2", "--restart-window-s", "30")) == 0
    assert made == [RestartPolicy(), RestartPolicy(max_restarts=0, backoff_s=2.0, window_s=30.0)]
    with pytest.raises(FlagError, match=r"--restart-max-backoff-s must be in \[0"):
        serve_command.run(_parse("--restart-max-backoff-s", "-1"))


def test_drain_journal_flag_needs_kv_cache_dir_and_reaches_the_app(monkeypatch, tmp_path):
    """--drain-journal without --kv-cache-dir, or with --replicas, is refused; with it, create_app gets drain_journal."""
    from integrations import serve_command
    from integrations.openai_server import command

    made = []
    monkeypatch.setattr(command, "create_app", lambda model, **kwargs: made.append(kwargs))
    monkeypatch.setattr(command.web, "run_app", lambda app, **kwargs: None)
    assert serve_command.run(_parse("--drain-journal")) == 2
    with pytest.raises(ValueError, match="--drain-journal serves one process"):
        command.make_app(_parse("--drain-journal", "--kv-cache-dir", str(tmp_path), "--replicas", "2"))
    assert serve_command.run(_parse("--drain-journal", "--kv-cache-dir", str(tmp_path))) == 0
    assert made[0]["drain_journal"] is True and made[0]["kv_cache_dir"] == str(tmp_path)
