"""The OpenAI backend against a real HTTP server on 127.0.0.1 that injects faults."""
import json
import logging
import os
import time

import pytest

from conftest import ROOT
from fake_openai import FakeOpenAIServer, varied_user
from plumbing.backends import Asker, EndpointError, OpenAIBackend, answer_schema, is_text
from simulator import Scenario, Simulator, parse_appraisal

S = Scenario(id="a", persona="Ann", background="Lost her job.", hidden_goal="advice",
             first_message="I lost my job.")
SECRET = "sk-test-DO-NOT-LEAK-1234567890"


def backend(server, **kw):
    # 5 s per request: far above a fake answer's milliseconds, so a request that CI's busy two
    # cores delay (the client's first request on a cold process took over 0.5 s once, a spurious
    # timeout and one request more than the test counted) is never a failed try; the tests of
    # timeouts give their own, shorter, timeout.
    kw.setdefault("timeout", 5)
    kw.setdefault("max_retries", 3)
    return OpenAIBackend(server.base_url, "fake-model", api_key_env="RLVER_TEST_KEY", **kw)


def simulator(b, budget=None, **kw):
    """A Simulator as the scripts build it (plumbing.backends.make_simulator): asking through an Asker."""
    return Simulator(b, ask=Asker(budget), **kw)


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
    with FakeOpenAIServer(faults=faults, hang=1.5) as srv:  # "timeout": 1.5 s past the client's 0.5 s
        st = play(simulator(backend(srv, timeout=0.5), initial_emotion=30, max_turns=3))
    assert st.outcome == "max_turns" and st.emotion == 39, st.trace
    assert [t["change"] for t in st.trace] == [3, 3, 3]
    # JSON mode is requested, and the key is sent to the server (it is how auth works) ...
    assert srv.requests[0]["body"]["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": answer_schema(parse_appraisal), "strict": True}}
    assert srv.requests[0]["auth"] == f"Bearer {SECRET}"


def test_persistent_faults_end_as_simulator_error_without_crashing(monkeypatch, caplog):
    monkeypatch.setenv("RLVER_TEST_KEY", SECRET)
    caplog.set_level(logging.DEBUG)
    with FakeOpenAIServer(faults=["500"] * 100) as srv:
        sim = simulator(backend(srv, max_retries=1), initial_emotion=30, parse_retries=2)
        st = play(sim)
    assert st.outcome == "simulator_error" and st.done and st.turn == 0
    assert len(srv.requests) == 4  # 2 parse attempts x (1 + 1 transport retry)
    # ... but never logged or shown.
    assert SECRET not in caplog.text and SECRET not in repr(sim.backend) and SECRET not in str(st.trace)


def test_persistent_garbage_ends_as_simulator_error():
    with FakeOpenAIServer(faults=["garbage"] * 100) as srv:
        st = play(simulator(backend(srv), initial_emotion=30, parse_retries=3))
    assert st.outcome == "simulator_error" and len(srv.requests) == 3


def test_step_many_runs_dialogues_concurrently():
    with FakeOpenAIServer(latency=1.0) as srv:  # 1 s: all 16 calls are sent within it even on busy cores
        sim = simulator(backend(srv, timeout=5), initial_emotion=30, max_turns=2, concurrency=16)
        states = sim.reset_many([S] * 16)
        states = sim.step_many(states, ["hello"] * 16)
    assert all(s.turn == 1 and s.emotion == 33 for s in states)
    assert srv.peak_in_flight > 8  # bounded concurrency, not one call at a time
    assert srv.peak_in_flight <= 16


def test_server_without_json_mode_falls_back():
    with FakeOpenAIServer(json_mode=False) as srv:
        b = backend(srv)
        st = play(simulator(b, initial_emotion=30, max_turns=1), turns=1)
    assert st.outcome == "max_turns" and b.json_mode is False
    assert "response_format" in srv.requests[0]["body"] and "response_format" not in srv.requests[-1]["body"]


def test_json_mode_fallback_is_not_a_failed_try():
    """A server without JSON mode is asked again at once: with no retries at all (max_retries=0,
    as bench_rollout uses) the call still gets its answer. (It raised UnboundLocalError.) A call
    without a schema starts at JSON mode, so its refusal says nothing of the schema: the endpoint
    keeps it until a schema is refused (test_server_without_json_mode_falls_back)."""
    with FakeOpenAIServer(json_mode=False) as srv:
        b = backend(srv, max_retries=0)
        text = b.chat([{"role": "user", "content": "hi"}])
    assert isinstance(text, str) and text and b.format == "json_schema" and len(srv.requests) == 2
    assert "response_format" not in srv.requests[-1]["body"]


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
        st = play(simulator(backend(srv), initial_emotion=30, parse_retries=3))
    assert st.outcome == "simulator_error" and st.turn == 0 and len(srv.requests) == 3


def test_retries_are_counted_by_kind():
    """Item 9: transport retries (the backend re-sends) and parse retries (the simulator asks
    again) are counted, then reset by Asker.take_counts()."""
    with FakeOpenAIServer(faults=["500", "garbage", "429", "nan"]) as srv:
        sim = simulator(backend(srv), initial_emotion=30, max_turns=1)
        st = play(sim, turns=1)
        assert st.outcome == "max_turns" and st.emotion == 33
        assert sim.ask.take_counts(sim.backend) == {"parse_retries": 2, "transport_retries": 2}
        assert sim.ask.take_counts(sim.backend) == {"parse_retries": 0, "transport_retries": 0}
    assert len(srv.requests) == 5


def test_fault_rate_gives_the_fault_free_scores_exactly():
    """The fault-rate mode: 40% of requests get a fault of any kind; every dialogue still ends
    with exactly the trace of a fault-free run, and each fault is counted as one retry."""
    scen = [Scenario(id=f"s{i}", persona="P", background="B.", hidden_goal="g", first_message=f"hi {i}")
            for i in range(6)]

    def run(**kw):
        with FakeOpenAIServer(responder=varied_user, **kw) as srv:
            sim = simulator(backend(srv, timeout=5), initial_emotion=50, max_turns=3)
            states = sim.reset_many(scen)
            for t in range(3):
                live = [i for i, s in enumerate(states) if not s.done]
                for i, s in zip(live, sim.step_many([states[i] for i in live], [f"reply {t} to {i}" for i in live])):
                    states[i] = s
        return states, sim.ask.take_counts(sim.backend), srv

    clean, counts0, _ = run()
    faulty, counts, srv = run(fault_rate=0.4)
    def trace(sts):
        return [(s.outcome, [(t.get("emotion_after"), t.get("user")) for t in s.trace]) for s in sts]
    assert trace(faulty) == trace(clean)
    assert all(s.outcome != "simulator_error" for s in faulty) and \
        counts0 == {"parse_retries": 0, "transport_retries": 0}
    kinds = [r["fault"] for r in srv.requests]
    assert counts == {"transport_retries": sum(k in ("500", "429") for k in kinds),
                      "parse_retries": sum(k not in ("ok", "500", "429") for k in kinds)}
    assert counts["transport_retries"] > 0 and counts["parse_retries"] > 0


def test_a_hung_server_costs_one_call_budget_not_retries_times_timeout():
    """Item 11: the server accepts and never answers in time. Without a budget one call costs
    parse tries x (1 + retries) x timeout (here 3 x 4 x 2 s); with an Asker budget of 1 s it ends after
    about 1 s, as simulator_error, having sent one request."""
    with FakeOpenAIServer(faults=["timeout"] * 100, hang=10) as srv:
        sim = simulator(backend(srv, timeout=2, max_retries=3), initial_emotion=30, budget=1.0)
        t0 = time.monotonic()
        st = sim.step(sim.reset(S), "hello")
        took = time.monotonic() - t0
    assert st.outcome == "simulator_error" and "call budget" in st.trace[-1]["error"]
    assert len(srv.requests) == 1 and took < 3.0, (len(srv.requests), took)


# ---------------------------------------------------------------- issue 23: faults, round three
@pytest.mark.parametrize("kind", ["surrogate", "surrogate_raw", "length", "dup", "huge"])
def test_an_unusable_answer_is_one_failed_try(kind):
    """Items 1, 4, 5, 10: a lone surrogate in the answer (valid JSON, not text), an appraisal cut
    off at max_tokens (its prose says "change: -8"), the change twice, a 5 MB answer: each is
    one failed try, retried. Before: the surrogate reached the tokenizer, the cut appraisal
    scored -8, the last "change" won, the 5 MB answer went into the transcript. (A 400 that is
    not about the format: test_a_400_in_every_format_is_a_failed_try_and_no_step_down.)"""
    with FakeOpenAIServer(faults=[kind]) as srv:
        b = backend(srv)
        sim = simulator(b, initial_emotion=30, max_turns=3)
        st = play(sim)
        counts = sim.ask.take_counts(sim.backend)
    assert st.outcome == "max_turns" and [t["change"] for t in st.trace] == [3, 3, 3], st.trace
    assert all(is_text(m["content"]) and len(m["content"]) < 1000 for m in st.history)
    assert counts["parse_retries"] == 1 and b.json_mode
    assert all("response_format" in r["body"] for r in srv.requests)


def test_a_persistent_surrogate_is_a_simulator_error_never_an_exception():
    with FakeOpenAIServer(faults=["surrogate"] * 100) as srv:
        st = play(simulator(backend(srv), initial_emotion=30, parse_retries=3))
    assert st.outcome == "simulator_error" and len(srv.requests) == 3


def test_json_mode_is_off_only_when_the_400_is_about_it():
    """Item 5: a server without JSON mode answers 400 naming response_format: off from then on."""
    with FakeOpenAIServer(json_mode=False) as srv:
        b = backend(srv)
        play(simulator(b, initial_emotion=30, max_turns=1), turns=1)
    assert b.json_mode is False


def test_the_change_as_a_number_or_a_numeric_string_rounds_half_away_from_zero():
    """Item 10: "5.5" was refused while 5.5 was taken, and 2.5 became 2 (banker's rounding)."""
    for change, want in [("5.5", 6), (5.5, 6), (2.5, 3), (-2.5, -3), ("+3", 3), (" -4 ", -4), (7, 7), (1e3, 1000)]:
        assert parse_appraisal(json.dumps({"analysis": "a", "change": change}))[0] == want, change
    for bad in ['{"change": 3, "change": -8}', '{"change": "5.5.5"}', '{"change": "3x"}', '{"change": true}']:
        assert parse_appraisal(bad) is None, bad


def test_a_trickling_server_is_cut_at_the_call_budget():
    """Item 9: a server that sends its answer one byte every 0.2 s (a 200-byte answer takes 40 s)
    held one call for 58 s against an 8 s budget: the HTTP timeout applies per read. Now the
    call ends at the budget, as simulator_error."""
    with FakeOpenAIServer(faults=["trickle"] * 100, trickle=0.2) as srv:
        sim = simulator(backend(srv, timeout=30), initial_emotion=30, budget=2.0)
        t0 = time.monotonic()
        st = sim.step(sim.reset(S), "hello")
        took = time.monotonic() - t0
    assert st.outcome == "simulator_error" and "within" in st.trace[-1]["error"]
    assert took < 2.0 + 3.0, took  # the budget, plus slack for a loaded machine (the bug: 58 s)


def test_a_key_the_server_echoes_is_never_logged(monkeypatch, caplog):
    """Item 10: an error body that echoes the Authorization header printed the key 8 times."""
    monkeypatch.setenv("RLVER_TEST_KEY", SECRET)
    caplog.set_level(logging.DEBUG)
    with FakeOpenAIServer(faults=["echo_key"] * 100) as srv:
        st = play(simulator(backend(srv, max_retries=1), initial_emotion=30, parse_retries=2))
    assert st.outcome == "simulator_error" and "***" in st.trace[-1]["error"]
    assert SECRET not in caplog.text and SECRET not in str(st.trace)


@pytest.mark.parametrize("case", ["no key", "wrong key", "wrong model"])
def test_an_endpoint_that_cannot_work_is_one_endpoint_error(case, monkeypatch):
    """Item 2: 401/403/404 were counted as parse retries on every call of every step. Now the
    check before the run (no key, a wrong key: GET /models answers 401) or the first call (a
    model the server does not have: 404) raises EndpointError, naming the flag or variable."""
    monkeypatch.delenv("RLVER_TEST_KEY", raising=False)
    if case == "wrong key":
        monkeypatch.setenv("RLVER_TEST_KEY", "sk-wrong")
    with FakeOpenAIServer(api_key="sk-right", models=["fake"]) as srv:
        monkeypatch.setenv("RLVER_SERVER_KEY", "sk-right")
        env = "RLVER_SERVER_KEY" if case == "wrong model" else "RLVER_TEST_KEY"
        b = OpenAIBackend(srv.base_url, "nope" if case == "wrong model" else "fake", api_key_env=env, timeout=2)
        if case == "wrong model":
            b.check()  # the key is right: the check passes, the first call fails
            with pytest.raises(EndpointError, match="404 for model 'nope': check --simulator-model"):
                simulator(b, initial_emotion=30).step(simulator(b).reset(S), "hi")
            assert len(srv.requests) == 1  # no retries
        else:
            with pytest.raises(EndpointError, match="RLVER_TEST_KEY"):
                b.check()
            assert srv.requests == []


def test_a_failed_cache_write_is_a_save_error(tmp_path):
    """A full disk while appending to simulator_cache.jsonl / judge_cache.jsonl was a bare
    OSError out of Simulator.step (a traceback); it is a SaveError, which train.py and
    evaluate.py end in one line."""
    from plumbing.backends import CachedBackend
    from plumbing.checkpoints import SaveError
    (tmp_path / "afile").write_text("x")
    cached = CachedBackend(object(), str(tmp_path / "afile" / "cache.jsonl"))  # a folder that is a file
    with pytest.raises(SaveError, match="could not write"):
        cached.keep([{"role": "user", "content": "hi"}], "answer")


def test_each_answer_asks_for_its_own_schema():
    """Issue 40: the simulated user's appraisal, reply and opening line each ask for the JSON
    schema their parser reads (structured outputs), the change bounded by the user's range; the
    challenging user's change by its own (100)."""
    from plumbing.backends import SimulatorArgs, make_simulator
    with FakeOpenAIServer() as srv:  # as the scripts build it (make_simulator: the user's bound)
        sim = make_simulator(SimulatorArgs(user="standard"), backend(srv), 30, 2)
        st = sim.step(sim.reset(Scenario(id="o", persona="Ann", background="Lost her job.", hidden_goal="advice")),
                      "That sounds hard.")
        hard = make_simulator(SimulatorArgs(user="challenging"), backend(srv), 30, 1)
        hard.step(hard.reset(S), "hm")
    assert st.turn == 1 and not st.done
    schemas = [r["body"]["response_format"]["json_schema"]["schema"] for r in srv.requests]
    opening, appraisal, reply, hard = schemas
    line = {"type": "string", "maxLength": 162}  # a bound inside max_tokens: the grammar closes the string
    assert reply == {"type": "object", "properties": {"thinking": line, "reply": line},
                     "required": ["thinking", "reply"], "additionalProperties": False}
    # the opening prompts ask for {"reply": ...} alone: its schema has no thinking to force
    assert opening == {"type": "object", "properties": {"reply": {**line, "maxLength": 330}}, "required": ["reply"],
                       "additionalProperties": False}
    assert appraisal["properties"]["change"] == {"type": "integer", "minimum": -10, "maximum": 10}
    assert appraisal["required"] == ["analysis", "change"]
    assert hard["properties"]["change"] == {"type": "integer", "minimum": -100, "maximum": 100}


def test_the_judges_answers_ask_for_their_schemas():
    """Issue 40: the LLM judge's scores (per dimension the evaluation its prompt asks for, then
    an integer 1-5) and labels (n lists of known names)."""
    import functools

    from judge import DIMENSIONS, STRATEGIES, parse_judgement, parse_labels
    scores = answer_schema(parse_judgement)
    assert scores["required"] == list(DIMENSIONS)
    assert all(p["required"] == ["evaluation", "score"] and p["properties"]["score"] == {
        "type": "integer", "minimum": 1, "maximum": 5} for p in scores["properties"].values())
    labels = answer_schema(functools.partial(parse_labels, n=3))["properties"]["turns"]
    assert (labels["minItems"], labels["maxItems"]) == (3, 3) and labels["items"]["items"]["enum"] == list(STRATEGIES)
    assert answer_schema(parse_labels) is None  # the turn count unknown: JSON mode
    assert answer_schema(lambda text: text) is None  # not one of ours: JSON mode


def test_a_server_without_structured_outputs_falls_back_to_json_mode_once(caplog):
    """Issue 40: a 400 naming response_format to a json_schema request: JSON mode from then on,
    not a failed try, logged once however many dialogues met it."""
    caplog.set_level(logging.WARNING)
    with FakeOpenAIServer(schema=False) as srv:
        b = backend(srv)
        sim = simulator(b, initial_emotion=30, max_turns=2, concurrency=8)
        states = sim.step_many(sim.reset_many([S] * 8), ["reply"] * 8)
    assert all(s.turn == 1 and s.outcome is None for s in states)
    assert b.format == "json_object" and sim.ask.take_counts(b)["parse_retries"] == 0
    types = [r["body"].get("response_format", {}).get("type") for r in srv.requests]
    assert types[-1] == "json_object" and types.count("json_schema") <= 8  # those in flight when the 400 came
    assert caplog.text.count("refused structured outputs (a JSON schema) (Error code: 400") == 1
    assert caplog.text.count("continuing with JSON mode") == 1


# ---------------------------------------------------------------- issue 46: faults, round five
DEEPSEEK_422 = ("Failed to deserialize the JSON body into the target type: "
                "response_format.type json_schema is unavailable now")
XGRAMMAR_400 = "The provided JSON schema contains features not supported by xgrammar."


@pytest.mark.parametrize("status, message", [(422, DEEPSEEK_422), (400, XGRAMMAR_400)])
def test_any_refusal_of_the_schema_steps_down_to_json_mode(status, message, caplog):
    """Item 1: a server that refuses the JSON schema with a 422 (DeepSeek's API, TGI, FastAPI) or
    with a 400 that does not name response_format (vLLM with xgrammar) is asked again at once in
    JSON mode and keeps it: every dialogue scored, no failed try, one log line. (Before: only a
    400 naming response_format stepped down; these failed every call, 0 dialogues scored.)"""
    caplog.set_level(logging.WARNING)
    with FakeOpenAIServer(schema=False, schema_refusal=(status, message)) as srv:
        b = backend(srv)
        sim = simulator(b, initial_emotion=30, max_turns=2, concurrency=4)
        states = sim.step_many(sim.reset_many([S] * 4), ["reply"] * 4)
        states = sim.step_many(states, ["another reply"] * 4)
    assert all(s.outcome == "max_turns" for s in states), [s.outcome for s in states]
    assert b.format == "json_object" and sim.ask.take_counts(b) == {"parse_retries": 0, "transport_retries": 0}
    types = [r["body"].get("response_format", {}).get("type") for r in srv.requests]
    assert types[-1] == "json_object" and types.count("json_schema") <= 4  # those in flight when it was refused
    assert caplog.text.count("refused structured outputs (a JSON schema)") == 1
    assert f"Error code: {status}" in caplog.text


def test_a_call_without_a_schema_never_steps_the_endpoint_off_the_schema():
    """Item 1, from a review: a call without a schema starts at JSON mode; when the server
    refused that and answered plain text, the endpoint fell from the schema to plain text,
    though no schema was ever refused. It keeps the schema now."""
    with FakeOpenAIServer(json_object=False) as srv:
        b = backend(srv)
        assert b.chat([{"role": "user", "content": "hi"}])  # no schema: JSON mode, refused, then text
        assert b.format == "json_schema"
        sim = simulator(b, initial_emotion=30, max_turns=1)
        assert play(sim, turns=1).outcome == "max_turns" and sim.ask.take_counts(b)["parse_retries"] == 0
    assert srv.requests[-1]["body"]["response_format"]["type"] == "json_schema"


def test_a_400_about_something_else_is_a_failed_try_and_no_step_down(caplog):
    """Faults round six, item 2: a 400 that does not name the format ("maximum context length
    exceeded") stepped a schema endpoint down to JSON mode for the rest of the run (two of them:
    plain text), the warning saying the server "refused structured outputs". It is a failed try in
    the format asked; the endpoint keeps the schema and the next try is answered in it."""
    caplog.set_level(logging.WARNING)
    with FakeOpenAIServer(faults=["400"]) as srv:
        b = backend(srv)
        sim = simulator(b, initial_emotion=30, max_turns=3)
        st = play(sim)
        counts = sim.ask.take_counts(sim.backend)
    assert st.outcome == "max_turns" and [t["change"] for t in st.trace] == [3, 3, 3], st.trace
    assert counts["parse_retries"] == 1 and b.format == "json_schema"
    types = [r["body"].get("response_format", {}).get("type") for r in srv.requests]
    assert types[:2] == ["json_schema", "json_schema"] and set(types) == {"json_schema"}, types
    assert "refused" not in caplog.text and "context length" in caplog.text


@pytest.mark.parametrize("status, message, steps", [
    (400, "maximum context length exceeded", False), (400, "max_tokens is too large: 9000", False),
    (400, "This model's maximum context length is 128000 tokens. However, your messages resulted in 137655 "
          "tokens (including 348 in the response_format schemas.). Please reduce the length of the messages.",
     False),
    (422, "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096", False),
    (400, "response_format json_schema unsupported", True), (422, DEEPSEEK_422, True), (400, XGRAMMAR_400, True),
    (422, "body -> response_format -> type: value is not a valid enumeration member", True),
    (429, "response_format rate limit", False), (401, "json_schema", False)])
def test_only_an_error_that_names_the_format_is_a_refusal_of_it(status, message, steps):
    """Item 2: the rule itself, per message (plumbing.backends.refuses_format)."""
    from plumbing.backends import refuses_format
    assert refuses_format(status, message) is steps


def test_a_step_down_answered_by_no_chat_completion_is_not_kept(caplog):
    """Item 2: the schema refused (a 400 naming it), then the JSON-mode request answered with a
    body that is not a chat completion: the endpoint stepped down all the same. That call is a
    failed try and the endpoint keeps the schema; the next call, answered in JSON mode, steps
    it down, logged once."""
    caplog.set_level(logging.WARNING)
    with FakeOpenAIServer(schema=False, faults=["ok", "badbody"]) as srv:
        b = backend(srv)
        msgs, schema = [{"role": "user", "content": "hi"}], {"type": "object"}
        with pytest.raises(ValueError, match="malformed chat-completions response"):
            b.chat(msgs, schema=schema)
        assert b.format == "json_schema" and "refused" not in caplog.text
        assert b.chat(msgs, schema=schema) and b.format == "json_object"
    assert caplog.text.count("refused structured outputs (a JSON schema)") == 1


@pytest.mark.parametrize("fault, requests", [("400format", 6), ("400", 2)])
def test_a_server_that_refuses_every_format_fails_each_call_in_one_try_each(fault, requests):
    """Item 1: a 4xx to every request is a failed try per call (a refusal naming the format:
    three requests at once, one per format; another 400: one request), never a step-down
    (nothing was answered) and never an exception out of the simulator."""
    with FakeOpenAIServer(faults=[fault] * 100) as srv:
        b = backend(srv)
        st = play(simulator(b, initial_emotion=30, parse_retries=2))
    assert st.outcome == "simulator_error" and len(srv.requests) == requests and b.format == "json_schema"


def longest_answers(max_tokens: int, char: str) -> dict:
    """Per answer our schemas describe: the longest answer they allow, every free-text field
    filled to its maxLength with `char`, numbers at their longest, label lists full."""
    import functools

    from judge import STRATEGIES, parse_judgement, parse_labels
    from simulator import parse_appraisal, parse_opening, parse_reply

    def fill(schema):
        if schema["type"] == "object":
            return {k: fill(v) for k, v in schema["properties"].items()}
        if schema["type"] == "string":
            return char * schema["maxLength"]
        if schema["type"] == "integer":
            return schema["minimum"]  # -100 / 1: the longest to write
        return [fill(schema["items"]) if "enum" not in schema["items"] else None for _ in range(schema["maxItems"])]
    out = {}
    for name, parser, change in [("appraisal", parse_appraisal, 100), ("reply", parse_reply, 10),
                                 ("opening", parse_opening, 10), ("judgement", parse_judgement, 10),
                                 ("labels", functools.partial(parse_labels, n=12), 10)]:
        schema = answer_schema(parser, change, max_tokens)
        answer = fill(schema)
        if name == "labels":
            answer = {"turns": [list(STRATEGIES)] * 12}
        out[name] = json.dumps(answer, ensure_ascii=False)
    return out


def test_the_longest_answer_in_chinese_fits_max_tokens():
    """Item 7: the schema's bounds were characters sized for English (800 for the analysis,
    1,200 for thinking + reply, 5 x 300 for the judge), past max_tokens in Chinese: 800
    characters of SAGE's Chinese are 1,400 SmolLM2 tokens. Now each bound is derived from
    max_tokens (3 tokens a character, the byte-level worst case): the longest answer allowed, in
    the Chinese characters that cost SmolLM2 the most tokens, fits; a label list has at most
    seven labels."""
    import re

    from plumbing.models import load_tokenizer, smollm2_dir, smollm2_missing
    if smollm2_missing():
        pytest.skip(smollm2_missing())
    tok = load_tokenizer(smollm2_dir())
    text = open(os.path.join(ROOT, "simulator.py"), encoding="utf-8").read()
    chinese = sorted(set(re.findall(r"[\u4e00-\u9fff]", text)))
    worst = max(chinese, key=lambda c: len(tok(c, add_special_tokens=False)["input_ids"]))
    assert len(tok(worst, add_special_tokens=False)["input_ids"]) == 3
    for max_tokens in (512, 1024, 2048):  # the simulated user's (1024) and the judge's (2048)
        for name, answer in longest_answers(max_tokens, worst).items():
            n = len(tok(answer, add_special_tokens=False)["input_ids"])
            assert n <= max_tokens, (max_tokens, name, n)
    prose = "".join(re.findall(r"[\u4e00-\u9fff，。：；！？、]+", text))[:800]  # the old bound, in SAGE's words
    assert len(tok(prose, add_special_tokens=False)["input_ids"]) > 1024
    labels = answer_schema(__import__("functools").partial(__import__("judge").parse_labels, n=2))
    assert labels["properties"]["turns"]["items"]["maxItems"] == 7


def test_our_schemas_are_ones_vllm_accepts():
    """Every schema answer_schema writes is one vLLM's xgrammar backend takes (the documented
    server setting): a schema it refuses is a 400, which steps the endpoint down to JSON mode.
    ("uniqueItems" on the label lists was refused.)"""
    import functools

    xgrammar = pytest.importorskip("vllm.v1.structured_output.backend_xgrammar")
    from judge import parse_judgement, parse_labels
    from simulator import parse_appraisal, parse_opening, parse_reply
    for parser in (parse_appraisal, parse_reply, parse_opening, parse_judgement, functools.partial(parse_labels, n=4)):
        schema = answer_schema(parser, 100, 2048)
        assert not xgrammar.has_xgrammar_unsupported_json_features(schema), schema


def test_a_malformed_body_never_shows_part_of_the_key(monkeypatch):
    """Item 9: a malformed body was cut at 200 bytes and then redacted, so a key crossing the cut
    left its first characters in the error message."""
    monkeypatch.setenv("RLVER_TEST_KEY", SECRET)
    b = OpenAIBackend("http://127.0.0.1:9/v1", "m", api_key_env="RLVER_TEST_KEY")
    for at in (180, 190, 195, 199):
        body = b"x" * at + SECRET.encode() + b" is not a chat completion"
        with pytest.raises(ValueError) as e:
            b._content(body)
        assert SECRET[:4] not in str(e.value) and "malformed chat-completions response" in str(e.value), str(e.value)


def test_a_key_of_a_few_characters_is_not_cut_out_of_answers(monkeypatch):
    """Item 4, from a review: every answer has the key cut out; a placeholder key ("1", which a
    local server takes) turned '"change": 10' into '"change": ***0' and every "1" of a reply
    into "***". Only a key of 8 characters or more is a secret to cut."""
    monkeypatch.setenv("RLVER_TEST_KEY", "1")
    with FakeOpenAIServer(responder=lambda m: '{"analysis": "I feel 1 bit better", "change": 10}') as srv:
        b = backend(srv)
        assert b.chat([{"role": "user", "content": "hi"}]) == '{"analysis": "I feel 1 bit better", "change": 10}'
