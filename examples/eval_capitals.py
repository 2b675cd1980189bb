"""Evaluation: a small capitals dataset, 3 samples per item, scored, resumed and reported.

The fake model knows most capitals but guesses the famous city for the tricky ones (Sydney for
Australia...), and answers one request in ten with a 503 that the run retries. Everything runs
offline; point `base_url` at a real endpoint to evaluate a real model.
"""

import random
import tempfile
from pathlib import Path
from typing import Any

from treadle import Agent, Provider
from treadle.evals import contains, read_log, run_eval, summarize, write_report
from treadle.testing import FakeOpenAIServer, Reply

DATASET = Path(__file__).parent / "data" / "capitals.jsonl"
KNOWN = {"France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
         "Japan": "Tokyo", "India": "New Delhi", "Egypt": "Cairo", "Canada": "Ottawa"}  # fmt: skip
GUESSES = {"Australia": "Sydney", "Brazil": "Rio de Janeiro", "Turkey": "Istanbul"}
rng = random.Random(7)


def fake_model(request: dict[str, Any]) -> Reply:
    country = request["messages"][-1]["content"].rsplit(" ", 1)[-1].rstrip("?")
    if country == "Nigeria":  # a coin flip: pass@k rewards trying more than once
        return Reply.text(rng.choice(["Abuja.", "Lagos."]))
    return Reply.text(f"{KNOWN.get(country) or GUESSES.get(country, 'unknown')}.")


with FakeOpenAIServer(script=fake_model) as server, tempfile.TemporaryDirectory() as tmp:
    server.add_fault(Reply.server_error(503), probability=0.1)
    provider = Provider(model="fake", base_url=server.base_url, api_key="sk-test", max_retries=0)
    agent = Agent("geographer", "Answer with the city name only.", provider=provider)
    log = Path(tmp) / "capitals.jsonl"
    result = run_eval(agent, DATASET, contains(), log=log, samples=3, max_retries=5)
    summary = result.summary
    print(f"score {summary.score.estimate:.3f} [{summary.score.low:.3f}, {summary.score.high:.3f}]")
    print("pass@k", {k: round(v, 3) for k, v in summary.pass_at_k.items()})
    print("retries after 503s:", summary.retries, "| errors:", summary.errors)
    assert summary.samples == 36 and summary.errors == {}
    assert summary.by_tag["europe"].pass_rate == 1.0 and summary.by_tag["tricky"].pass_rate < 0.5

    # Running again with the same log resumes it: nothing is left to do, nothing is re-sent.
    sent = server.request_count
    again = run_eval(agent, DATASET, contains(), log=log, samples=3, max_retries=5)
    assert server.request_count == sent and again.summary.outcome() == summary.outcome()
    assert summarize(read_log(log)).pass_at_k == summary.pass_at_k

    report = write_report(log)
    print("report:", report.name, report.stat().st_size, "bytes")
