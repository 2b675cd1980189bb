"""`Isolated(...)` options travel with the session: a plain spec (`to_spec`/`from_spec`), saved
session files (env names only, never values) and distributed workers (the whole spec).

Hostile: a tightened limit or an extra mount given on the caller's side must hold in a
`backend="process"` worker's box and in a reloaded session's box; a tampered spec in a saved file
is a clear `PersistenceError`, never a crash and never a silently default (weaker) box.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandbox_support import needs_bwrap
from treadle import ConfigurationError, Isolated, PersistenceError, ResourceLimits, Session
from treadle.distributed import AgentSpec, PassItem, amap
from treadle.distributed.worker import PassWorker
from treadle.loop import run_session_loop
from treadle.persist import load_session
from treadle.testing import FakeOpenAIServer, Reply
from treadle.testing.fake_replies import ToolCallSpec
from treadle.testing.sample_tools import shouter
from treadle.testing.scripted import ScriptedExecutor

AGENT = Session.from_agent_prompt("system prompt")
TIGHT = ResourceLimits(cpu_seconds=5, file_size_bytes=64 * 1024, max_processes=40)


@pytest.fixture
def shared() -> Iterator[Path]:
    """A host directory the box's uid can write (pytest's temporary directories are root's)."""
    root = Path(tempfile.mkdtemp(prefix="treadle-iso-opts-"))
    root.chmod(0o777)
    yield root
    shutil.rmtree(root)


def _options(shared: Path, **env: str) -> Isolated:
    return Isolated(
        network=True,
        read_only=("/opt",),
        writable=(str(shared),),
        limits=TIGHT,
        env=env,
    )


# -- the spec ------------------------------------------------------------------------------------


def test_spec_is_plain_json_and_round_trips(shared: Path) -> None:
    options = _options(shared, MODE="test")
    spec = options.to_spec()
    assert json.loads(json.dumps(spec)) == spec
    assert spec["limits"]["file_size_bytes"] == 64 * 1024 and spec["env"] == {"MODE": "test"}
    assert Isolated.from_spec(json.loads(json.dumps(spec))) == options
    assert Isolated.from_spec(Isolated().to_spec()) == Isolated()
    lifted = Isolated(limits=ResourceLimits(cpu_seconds=None))
    assert Isolated.from_spec(lifted.to_spec()).limits.cpu_seconds is None


def _bad(**change: Any) -> dict[str, Any]:
    spec = Isolated().to_spec()
    spec.update(change)
    return spec


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("isolated", "must be a JSON object"),
        (_bad(netwrok=True), "unknown key.*netwrok"),
        ({k: v for k, v in Isolated().to_spec().items() if k != "limits"}, "missing.*limits"),
        (_bad(network="yes"), "network must be true or false"),
        (_bad(read_only="/srv"), "read_only must be a list"),
        (_bad(writable=["relative"]), "absolute"),
        (_bad(writable=["/"]), "replace part of the box"),
        (_bad(limits={"cpu_seconds": 5}), "limits.*missing"),
        (_bad(limits={**Isolated().to_spec()["limits"], "cpu_seconds": "5"}), "positive integer"),
        (_bad(limits={**Isolated().to_spec()["limits"], "cpu_seconds": True}), "positive integer"),
        (_bad(limits={**Isolated().to_spec()["limits"], "cpu_seconds": -1}), "positive integer"),
        (_bad(limits={**Isolated().to_spec()["limits"], "gpu": 1}), "unknown key.*gpu"),
        (_bad(limits=[1, 2]), "limits must be a JSON object"),
        (_bad(env={"A": 1}), "env values must be strings"),
        (_bad(env={"A=B": "x"}), "env names"),
        (_bad(env=["A"]), "env must be a JSON object"),
    ],
)
def test_a_bad_spec_is_refused_clearly(spec: Any, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Isolated.from_spec(spec)


def test_env_is_checked_at_construction_too() -> None:
    with pytest.raises(ConfigurationError, match="env"):
        Isolated(env={"": "x"})
    with pytest.raises(ConfigurationError, match="env"):
        Isolated(env={"A": None})  # type: ignore[dict-item]


@needs_bwrap
def test_the_session_layer_exposes_the_spec(shared: Path) -> None:
    options = _options(shared, MODE="test")
    session = Session.from_user_message("x").to(options)
    try:
        assert session.placement == "isolated"
        assert session.placement_spec == options.to_spec()
        assert session.add_user_message("more").placement_spec == options.to_spec()
    finally:
        session.close_sandbox()
    assert Session.from_user_message("x").placement_spec is None
    local = Session.from_user_message("x").to("local")
    assert local.placement_spec is None
    local.close_sandbox()


# -- saved sessions ------------------------------------------------------------------------------


async def _saved(tmp_path: Path, options: Isolated) -> Path:
    file = tmp_path / "s.jsonl"
    user = Session.from_user_message("x").to(options)
    out = await run_session_loop(
        user, AGENT, executor=ScriptedExecutor(["done"]), persist_path=file
    )
    assert out.final_text == "done"
    out.close_sandbox()
    user.close_sandbox()
    return file


def _header(file: Path) -> dict[str, Any]:
    return dict(json.loads(file.read_text().splitlines()[0]))


def _rewrite_header(file: Path, **change: Any) -> None:
    lines = file.read_text().splitlines()
    header = {**json.loads(lines[0]), **change}
    file.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")


@needs_bwrap
async def test_a_saved_session_reopens_with_its_limits_and_mounts(
    tmp_path: Path, shared: Path
) -> None:
    options = _options(shared)
    file = await _saved(tmp_path, options)
    assert _header(file)["placement"] == "isolated"  # older readers still see the name
    # The file asks for host mounts and the network: only the caller may grant those.
    with pytest.raises(PersistenceError, match=rf"network access.*{shared}.*placement="):
        load_session(file)
    loaded = load_session(file, placement=options)
    assert loaded.session.placement_spec == options.to_spec()
    box = loaded.session.require_sandbox()
    try:
        result = await box.run_command(f"echo hi > {shared}/seen; head -c 1000000 /dev/zero > big")
        assert result.exit_code == 128 + 25, result  # SIGXFSZ: the saved 64 KiB limit holds
        assert (box.workspace / "big").stat().st_size == 64 * 1024
        assert (shared / "seen").read_text() == "hi\n"  # the saved writable mount is there
    finally:
        loaded.session.close_sandbox()


@needs_bwrap
async def test_env_values_are_never_saved_and_must_be_given_back(
    tmp_path: Path, shared: Path
) -> None:
    options = _options(shared, API_TOKEN="tok-very-secret", MODE="test")
    file = await _saved(tmp_path, options)
    assert "tok-very-secret" not in file.read_text()
    assert _header(file)["placement_options"]["env_names"] == ["API_TOKEN", "MODE"]
    with pytest.raises(PersistenceError, match=r"API_TOKEN, MODE.*env=") as raised:
        load_session(file)
    assert "not saved" in str(raised.value)
    with pytest.raises(PersistenceError, match="API_TOKEN"):
        Session.load(file)
    with pytest.raises(PersistenceError, match="API_TOKEN"):
        load_session(file, env={"MODE": "test"})
    with pytest.raises(PersistenceError, match="TYPO"):
        load_session(file, env={"API_TOKEN": "t", "MODE": "m", "TYPO": "x"})
    # Every value given back: the box's mounts and network still need the caller's word.
    with pytest.raises(PersistenceError, match="may not choose"):
        load_session(file, env={"API_TOKEN": "tok-new", "MODE": "prod"})
    again = _options(shared, API_TOKEN="tok-new", MODE="prod")
    loaded = load_session(file, placement=again)
    try:
        expected = again.to_spec()
        assert loaded.session.placement_spec == expected
        result = await loaded.session.require_sandbox().run_command("echo $API_TOKEN $MODE")
        assert result.stdout == "tok-new prod\n"
    finally:
        loaded.session.close_sandbox()


@needs_bwrap
async def test_a_transcript_reads_without_env_values(tmp_path: Path, shared: Path) -> None:
    file = await _saved(tmp_path, _options(shared, API_TOKEN="tok-very-secret"))
    loaded = load_session(file, sandbox=False)  # reading only: no box, no values needed
    assert loaded.session.placement is None and loaded.session.final_text == "done"
    shown = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "treadle.cli", "show", str(file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    assert (
        '"env_names": ["API_TOKEN"]' in shown.stdout and '"file_size_bytes": 65536' in shown.stdout
    )


@needs_bwrap
async def test_old_files_without_options_still_load(tmp_path: Path) -> None:
    file = await _saved(tmp_path, Isolated())
    lines = file.read_text().splitlines()
    header = json.loads(lines[0])
    del header["placement_options"]  # a file written before options were saved
    file.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    loaded = load_session(file)
    assert loaded.session.placement == "isolated"
    assert loaded.session.placement_spec is None  # the name alone: default options
    loaded.session.close_sandbox()


def _saved_spec(**change: Any) -> dict[str, Any]:
    spec = Isolated().to_spec()
    del spec["env"]
    spec["env_names"] = []
    spec.update(change)
    return spec


@needs_bwrap
@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"placement_options": "tight"}, "placement_options.*JSON object"),
        ({"placement_options": _saved_spec(netwrok=True)}, "unknown key.*netwrok"),
        (
            {"placement_options": _saved_spec(limits={"cpu_seconds": "lots"})},
            "limits.*missing",
        ),
        ({"placement_options": _saved_spec(env_names="A")}, "env_names must be a list"),
        ({"placement_options": _saved_spec(env={"A": "leaked"})}, "env values are never saved"),
        ({"placement": "local"}, "only the isolated placement"),
    ],
)
async def test_a_tampered_spec_in_a_saved_file_is_a_clear_error(
    tmp_path: Path, header: dict[str, Any], message: str
) -> None:
    file = await _saved(tmp_path, Isolated(limits=TIGHT))
    _rewrite_header(file, **header)
    with pytest.raises(PersistenceError, match=message) as raised:
        load_session(file)
    assert str(file) in str(raised.value)


# -- distributed workers -------------------------------------------------------------------------


@needs_bwrap
def test_items_carry_the_whole_spec_env_included(shared: Path) -> None:
    options = _options(shared, API_TOKEN="tok")
    session = Session.from_user_message("x").to(options)
    try:
        item = PassItem.from_input(0, session)
    finally:
        session.close_sandbox()
    assert item.placement == "isolated" and item.placement_options == options.to_spec()
    again = PassItem.from_json(json.loads(json.dumps(item.to_json())))
    assert again == item


def _box_probe(shared: Path) -> Any:
    command = (
        "head -c 1000000 /dev/zero > big; echo status=$?; wc -c < big; "
        f"echo from-worker > {shared}/seen; echo mark=$MARK"
    )

    def script(request: dict[str, Any]) -> Reply:
        messages = request.get("messages") or []
        if messages and messages[-1].get("role") == "tool":
            return Reply.text(str(messages[-1].get("content")))
        arguments = json.dumps({"cmd": command})
        return Reply(tool_calls=(ToolCallSpec("run_shell_command", arguments, id="call_1"),))

    return script


@needs_bwrap
async def test_a_process_worker_box_keeps_the_callers_limits_mounts_and_env(
    shared: Path, tmp_path: Path
) -> None:
    options = _options(shared, MARK="from-caller")
    with FakeOpenAIServer(script=_box_probe(shared)) as server:
        agent = shouter(server.base_url)
        session = Session.from_user_message("probe").to(options)
        try:
            [out] = await amap(
                agent, [session], backend="process", workers=1, sandbox_base=str(tmp_path)
            )
        finally:
            session.close_sandbox()
    result = json.loads(out.final_text or "")
    assert result["exit_code"] == 0, result
    lines = result["stdout"].split()
    assert lines[0] == f"status={128 + 25}", result  # SIGXFSZ in the worker's box
    assert lines[1] == str(64 * 1024)  # the caller's 64 KiB, not the default 1 GiB
    assert lines[2] == "mark=from-caller"
    assert (shared / "seen").read_text() == "from-worker\n"  # the extra mount is there


async def test_a_garbage_spec_on_a_worker_item_fails_that_pass_not_into_a_default_box(
    tmp_path: Path,
) -> None:
    with FakeOpenAIServer(script="echo") as server:
        worker = PassWorker(AgentSpec.from_agent(shouter(server.base_url)), sandbox_base=tmp_path)
        try:
            item = PassItem(0, "s1", [{"role": "user", "content": "x"}], placement="isolated")
            bad = {**item.to_json(), "placement_options": {"network": False, "netwrok": True}}
            outcome = await worker.run(bad)
        finally:
            worker.close()
    assert outcome.status == "error" and len(server.requests) == 0, outcome
    assert outcome.error is not None and "unknown key(s) netwrok" in outcome.error
