"""The OpenAI backend against a real HTTP server on 127.0.0.1 that injects faults."""
import logging

import pytest

from fake_openai import FakeOpenAIServer
from simulator import OpenAIBackend, Scenario, Simulator

S = Scenario(id="a", persona="Ann", background="Lost her job.", hidden_goal="advice",
             first_message="I lost my job.")
SECRET = "sk-test-DO-NOT-LEAK-1234567890"


def backend(server, **kw):
    kw.setdefault("timeout", 0.5)
    kw.setdefault("max_retries", 3)
    return OpenAIBackend(server.base_url, "fake-model", api_key_env="RLVER_TEST_KEY", **kw)


def play(sim, turns=3):
    st = sim.reset(S)
    for i in range(turns):
        if st.done:
            break
        st = sim.step(st, f"reply {i}")
    return st


@pytest.mark.parametrize("faults", [[], ["500"], ["429", "429"], ["timeout"], ["garbage"], ["blank"],
                                    ["badbody"], ["500", "garbage", "429"]])
def test_dialogue_completes_despite_transient_faults(faults, monkeypatch):
    monkeypatch.setenv("RLVER_TEST_KEY", SECRET)
    with FakeOpenAIServer(faults=faults, hang=1.5) as srv:
        st = play(Simulator(backend(srv), initial_emotion=30, max_turns=3))
    assert st.outcome == "max_turns" and st.emotion == 39, st.trace
    assert [t["change"] for t in st.trace] == [3, 3, 3]
    # JSON mode is requested, and the key is sent to the server (it is how auth works) ...
    assert srv.requests[0]["body"]["response_format"] == {"type": "json_object"}
    assert srv.requests[0]["auth"] == f"Bearer {SECRET}"


def test_persistent_faults_end_as_simulator_error_without_crashing(monkeypatch, caplog):
    monkeypatch.setenv("RLVER_TEST_KEY", SECRET)
    caplog.set_level(logging.DEBUG)
    with FakeOpenAIServer(faults=["500"] * 100) as srv:
        sim = Simulator(backend(srv, max_retries=1), initial_emotion=30, parse_retries=2)
        st = play(sim)
    assert st.outcome == "simulator_error" and st.done and st.turn == 0
    assert len(srv.requests) == 4  # 2 parse attempts x (1 + 1 transport retry)
    # ... but never logged or shown.
    assert SECRET not in caplog.text and SECRET not in repr(sim.backend) and SECRET not in str(st.trace)


def test_persistent_garbage_ends_as_simulator_error():
    with FakeOpenAIServer(faults=["garbage"] * 100) as srv:
        st = play(Simulator(backend(srv), initial_emotion=30, parse_retries=3))
    assert st.outcome == "simulator_error" and len(srv.requests) == 3


def test_step_many_runs_dialogues_concurrently():
    with FakeOpenAIServer(latency=0.2) as srv:
        sim = Simulator(backend(srv, timeout=5), initial_emotion=30, max_turns=2, concurrency=16)
        states = sim.reset_many([S] * 16)
        states = sim.step_many(states, ["hello"] * 16)
    assert all(s.turn == 1 and s.emotion == 33 for s in states)
    assert srv.peak_in_flight > 8  # bounded concurrency, not one call at a time
    assert srv.peak_in_flight <= 16


def test_server_without_json_mode_falls_back():
    with FakeOpenAIServer(json_mode=False) as srv:
        b = backend(srv)
        st = play(Simulator(b, initial_emotion=30, max_turns=1), turns=1)
    assert st.outcome == "max_turns" and b.json_mode is False
    assert "response_format" in srv.requests[0]["body"] and "response_format" not in srv.requests[-1]["body"]


def test_check_reports_unreachable_endpoint():
    b = OpenAIBackend("http://127.0.0.1:9/v1", "m", timeout=0.5, max_retries=0)
    with pytest.raises(ConnectionError, match="unreachable"):
        b.check(timeout=0.5)
    with FakeOpenAIServer() as srv:
        backend(srv).check()
