"""The OpenAI backend against a real HTTP server on 127.0.0.1 that injects faults."""
import logging
import time

import pytest

from fake_openai import FakeOpenAIServer, varied_user
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
                                    ["badbody"], ["500", "garbage", "429"],
                                    # issue 14 item 2: these raised out of Simulator.step
                                    ["nan"], ["inf"], ["list"], ["number"], ["deep"]])
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


# ---------------------------------------------------------------- issue 14: faults and retries
@pytest.mark.parametrize("kind", ["nan", "inf", "list", "number", "deep"])
def test_unusual_answers_are_failed_tries_never_exceptions(kind):
    """Item 2: NaN/Infinity changes, non-string content, absurd nesting: each is a failed try;
    when every try gets one, the dialogue ends as simulator_error (step() does not raise)."""
    with FakeOpenAIServer(faults=[kind] * 100) as srv:
        st = play(Simulator(backend(srv), initial_emotion=30, parse_retries=3))
    assert st.outcome == "simulator_error" and st.turn == 0 and len(srv.requests) == 3


def test_retries_are_counted_by_kind():
    """Item 9: transport retries (the backend re-sends) and parse retries (the simulator asks
    again) are counted, then reset by take_counts()."""
    with FakeOpenAIServer(faults=["500", "garbage", "429", "nan"]) as srv:
        sim = Simulator(backend(srv), initial_emotion=30, max_turns=1)
        st = play(sim, turns=1)
        assert st.outcome == "max_turns" and st.emotion == 33
        assert sim.take_counts() == {"parse_retries": 2, "transport_retries": 2}
        assert sim.take_counts() == {"parse_retries": 0, "transport_retries": 0}
    assert len(srv.requests) == 5


def test_fault_rate_gives_the_fault_free_scores_exactly():
    """The fault-rate mode: 40% of requests get a fault of any kind; every dialogue still ends
    with exactly the trace of a fault-free run, and each fault is counted as one retry."""
    scen = [Scenario(id=f"s{i}", persona="P", background="B.", hidden_goal="g", first_message=f"hi {i}")
            for i in range(6)]

    def run(**kw):
        with FakeOpenAIServer(responder=varied_user, **kw) as srv:
            sim = Simulator(backend(srv, timeout=5), initial_emotion=50, max_turns=3)
            states = sim.reset_many(scen)
            for t in range(3):
                live = [i for i, s in enumerate(states) if not s.done]
                for i, s in zip(live, sim.step_many([states[i] for i in live], [f"reply {t} to {i}" for i in live])):
                    states[i] = s
        return states, sim.take_counts(), srv

    clean, counts0, _ = run()
    faulty, counts, srv = run(fault_rate=0.4)
    trace = lambda sts: [(s.outcome, [(t.get("emotion_after"), t.get("user")) for t in s.trace]) for s in sts]  # noqa: E731
    assert trace(faulty) == trace(clean)
    assert all(s.outcome != "simulator_error" for s in faulty) and counts0 == {"parse_retries": 0, "transport_retries": 0}
    kinds = [r["fault"] for r in srv.requests]
    assert counts == {"transport_retries": sum(k in ("500", "429") for k in kinds),
                      "parse_retries": sum(k not in ("ok", "500", "429") for k in kinds)}
    assert counts["transport_retries"] > 0 and counts["parse_retries"] > 0


def test_a_hung_server_costs_one_call_budget_not_retries_times_timeout():
    """Item 11: the server accepts and never answers in time. Without a budget one call costs
    parse tries x (1 + retries) x timeout (here 3 x 4 x 2 s); with call_budget=1 it ends after
    about 1 s, as simulator_error, having sent one request."""
    with FakeOpenAIServer(faults=["timeout"] * 100, hang=10) as srv:
        sim = Simulator(backend(srv, timeout=2, max_retries=3), initial_emotion=30, call_budget=1.0)
        t0 = time.monotonic()
        st = sim.step(sim.reset(S), "hello")
        took = time.monotonic() - t0
    assert st.outcome == "simulator_error" and "call budget" in st.trace[-1]["error"]
    assert len(srv.requests) == 1 and took < 3.0, (len(srv.requests), took)
