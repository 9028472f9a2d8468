"""plumbing/backends.py - how the simulated user's words travel (a reader of the method may skip it).

The Simulator (simulator.py) asks its backend `chat(messages) -> str`. The backends here:

  OpenAIBackend  any OpenAI-compatible chat-completions server (DeepSeek-V3, `vllm serve`):
                 transport retries with backoff, a deadline per call, each answer asked for
                 with its JSON schema (structured outputs; then JSON mode, then plain text)
  HFBackend      a local transformers chat model
  CachedBackend  a wrapper that stores each parsed answer on disk and replays it on a rerun
  make_backend   the --simulator* flags (SimulatorArgs) -> a backend; `rule` is the offline
                 rule_user.RuleBackend (the float flags' ranges: plumbing.checks.check_floats)
  make_simulator those flags -> the simulator.Simulator that plays them (train.py, evaluate.py, demo)
  Asker          the `ask` the scripts give Simulator and judge.LLMJudge (ask_until_parsed: a call
                 budget, backend errors as failed tries, non-text answers refused, retry counts)
  EndpointError  a key, model or URL that cannot work: the run stops (one line, exit 2)

`describe(backend)` is the one line train.py and evaluate.py print about the simulated user.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

import openai
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from plumbing.files import append_line
from rule_user import RuleBackend
from simulator import USERS, Simulator

log = logging.getLogger("simulator")


@dataclass
class SimulatorArgs:
    """The --simulator* flags, shared by train.py, evaluate.py and plumbing.demo (and --user, --rules)."""
    simulator: Literal["rule", "openai", "hf"] = field(default="rule", metadata={
        "help": "simulated user backend: rule (offline) | openai (any OpenAI-compatible server) | hf (a local "
                "transformers model)"})
    simulator_base_url: str = field(default="", metadata={
        "help": "openai: the server's URL, e.g. https://api.deepseek.com/v1"})
    simulator_model: str = field(default="", metadata={
        "help": "openai: the model name, e.g. deepseek-chat; hf: a model path"})
    simulator_api_key_env: str = field(default="OPENAI_API_KEY", metadata={
        "help": "env var holding the key (never logged)"})
    simulator_temperature: float = field(default=0.7, metadata={"help": "the simulated user's sampling temperature"})
    simulator_timeout: float = field(default=120.0, metadata={"help": "seconds per HTTP request"})
    simulator_call_budget: float = field(default=300.0, metadata={
        "help": "seconds one simulator call may take with all its retries; then the dialogue ends as "
                "simulator_error"})
    user_reader: str = field(default="none", metadata={
        "help": "the rule user's reader: a frozen language model whose log-prob of a reply gates what care it "
                "pays (rule_user.RuleBackend.fluent): none | smollm2 | a path (never the policy being trained)"})
    simulator_concurrency: int = field(default=64, metadata={
        "help": "simulator calls in flight at once, per process: under accelerate launch the server sees up to "
                "this x the process count (train.py logs the total at the start)"})
    user: Literal["standard", "challenging"] = field(default="standard", metadata={
        "help": "simulated user: standard (SAGE; change clamped to [-10, 10]) | challenging (paper Table 3: never "
                "reveals its goal, change clamped to [-100, 100])"})
    rules: Literal["sage", "rlver"] = field(default="sage", metadata={
        "help": "how a dialogue ends (simulator.RULES): sage (at emotion >= 100 or < 10, a goodbye or the turn "
                "limit; emotion in [0, 100]) | rlver (the official RLVER code: at a goodbye, emotion <= 0 or the "
                "turn limit; no end at 100; capped at 100, no floor)"})


def make_backend(args: SimulatorArgs, seed: int = 0, max_retries: int = 4, reader=None):
    """Flag values -> backend (`reader`: the rule user's, plumbing.reader.load_reader(args.user_reader),
    loaded by the caller). Raises ValueError (one line naming the flag) on missing settings,
    before anything is loaded. (The float flags' ranges: plumbing.checks.check_floats, which
    every script calls first.)"""
    if args.simulator_concurrency < 1:
        raise ValueError(f"--simulator-concurrency {args.simulator_concurrency}: must be >= 1")
    if args.user_reader not in ("", "none") and args.simulator != "rule":
        raise ValueError(f"--user-reader {args.user_reader}: only the rule user reads with it (--simulator rule); "
                         f"an LLM user reads the reply itself")
    if args.simulator == "rule":
        return RuleBackend(seed=seed, reader=reader)
    if args.simulator == "openai":
        if not args.simulator_base_url or not args.simulator_model:
            raise ValueError("--simulator openai needs --simulator-base-url and --simulator-model")
        return OpenAIBackend(args.simulator_base_url, args.simulator_model, args.simulator_api_key_env,
                             args.simulator_temperature, args.simulator_timeout, max_retries)
    if args.simulator == "hf":
        if not args.simulator_model:
            raise ValueError("--simulator hf needs --simulator-model (a local path or hub id)")
        return HFBackend(args.simulator_model, args.simulator_temperature)
    raise ValueError(f"unknown simulator backend {args.simulator!r} (rule | openai | hf)")


def make_simulator(args: SimulatorArgs, backend, initial_emotion: int, max_turns: int) -> Simulator:
    """The Simulator for these flags (--user, --rules, --simulator-concurrency, --simulator-call-budget),
    asking its LLM user through an Asker (`sim.ask.take_counts(sim.backend)`: its retries)."""
    return Simulator(backend, initial_emotion=initial_emotion, max_turns=max_turns, user=args.user, rules=args.rules,
                     concurrency=args.simulator_concurrency,
                     ask=Asker(args.simulator_call_budget, max_change=USERS[args.user]["max_change"]))


# ---- asking an LLM until its answer parses (what Simulator(ask=...) and judge.LLMJudge use)
class EndpointError(RuntimeError):
    """The simulated user's endpoint cannot work at all (the key, the model or the URL is wrong):
    retrying will not help, so it is not a failed try but stops the run (one line, exit 2)."""



def ask_until_parsed(backend, messages, parser, tries: int, budget: float | None = None,
                     on_retry=None, logger=log, who: str = "simulator", schema: dict | None = None):
    """Ask `backend.chat(messages)` until `parser` accepts the answer, at most `tries` times (the
    backend retries transport faults itself) -> (parsed, None), or (None, why the last try
    failed). The `ask` the scripts give simulator.Simulator (through Asker) and judge.LLMJudge.

    Anything the network sends back is either parsed or counted as a failed try: the backend's
    errors and the parser's (which should not raise, but a server can send anything) are caught
    alike, and so is an answer that is not valid Unicode text (is_text). Only an EndpointError
    (a wrong key, model or URL) passes through: no try can work. `on_retry()` is called before
    every try after the first. A parsed answer is handed to the backend's `keep`
    (CachedBackend stores parsed answers only, so a bad answer is never
    replayed into its own retry). With `budget` (seconds for all tries together), no try starts
    after it is spent, and a backend that takes a deadline (OpenAIBackend) cuts its requests
    and backoffs to what is left; such a backend also takes the `schema` of the answer the
    parser reads (structured outputs). The parser still checks every answer."""
    last = None
    deadline = time.monotonic() + budget if budget else None
    kw = {}
    if getattr(backend, "takes_deadline", False):
        kw = {"deadline": deadline, **({"schema": schema} if schema is not None else {})}
    for attempt in range(tries):
        if deadline is not None and time.monotonic() >= deadline:
            last = f"no answer within the call budget of {budget:g} s ({last})"
            break
        if attempt and on_retry is not None:
            on_retry()
        try:
            text = backend.chat(messages, **kw)
            out = parser(text) if isinstance(text, str) else None
            if out is not None and not is_text((text, out)):
                raise ValueError("the answer is not valid Unicode text (a lone surrogate?)")
        except EndpointError:  # a wrong key, model or URL: no try will work
            raise
        except Exception as e:  # the backend already retried 429/5xx/timeouts
            last = f"{type(e).__name__}: {e}"
            logger.warning("%s backend error (try %d/%d): %.300s", who, attempt + 1, tries, last)
            continue
        if out is not None:
            keep = getattr(backend, "keep", None)
            if keep is not None:
                keep(messages, text)
            return out, None
        last = f"unparseable output: {text!r:.200}"
        logger.warning("%s output unparseable (try %d/%d): %.200r", who, attempt + 1, tries, text)
    return None, last or "no attempts"


def is_text(value) -> bool:
    """Every string in `value` (and in its tuples, lists and dicts) is valid Unicode text, i.e.
    encodable as UTF-8. A JSON answer can hold a lone surrogate ("\\ud83d"), which no tokenizer
    and no file accepts: such an answer is a failed try, never scored or cached."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, dict):
        value = list(value.keys()) + list(value.values())
    if isinstance(value, (tuple, list)):
        return all(is_text(v) for v in value)
    return True


# Free text in an answer is bounded in characters (JSON schema's maxLength), and every character
# may cost up to TOKENS_PER_CHAR tokens: a byte-level BPE tokenizer writes a character it has no
# merge for as its UTF-8 bytes, 3 for a Chinese one (SAGE's and RLVER's profiles are Chinese).
# Measured with SmolLM2's tokenizer on simulator.py's Chinese prompts: 1.74 tokens a character,
# 3 at most. Each field also costs its key, quotes and punctuation (TOKENS_PER_FIELD).
TOKENS_PER_CHAR, TOKENS_PER_FIELD = 3, 16


def text_bound(max_tokens: int, texts: int, fields: int) -> int:
    """Characters each of `texts` free-text fields may hold so that the whole answer (`fields`
    keys and values in all) fits in `max_tokens`, whatever the language."""
    return max(1, (max_tokens - TOKENS_PER_FIELD * (fields + 1)) // (TOKENS_PER_CHAR * texts))


def answer_schema(parser, max_change: int = 10, max_tokens: int = 1024) -> dict | None:
    """The JSON schema of the answer `parser` reads: the fields and types it takes, for servers
    with structured outputs (None: a parser of ours it does not know). The simulated user's
    appraisal (its change an integer within the user's bound: [-10, 10] for the standard user),
    its reply or opening line, and the LLM judge's scores and strategy labels. Every field is
    required and nothing else allowed, as OpenAI's strict mode wants. Free text has a length
    bound (`maxLength`, characters: text_bound) that fits the answer's `max_tokens` even in
    Chinese: a model that rambles inside a string would otherwise run into the token limit and
    the whole answer be lost (SmolLM2 as the judge did, at 1,024 tokens); the bound makes the
    grammar close the string."""
    from judge import DIMENSIONS, STRATEGIES, parse_judgement, parse_labels
    from simulator import parse_appraisal, parse_opening, parse_reply

    def obj(**props):
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    def text(texts: int, fields: int):
        return {"type": "string", "maxLength": text_bound(max_tokens, texts, fields)}
    fn = getattr(parser, "func", parser)  # a functools.partial of a parser (parse_labels with n)
    if fn is parse_appraisal:
        return obj(analysis=text(1, 2), change={"type": "integer", "minimum": -max_change, "maximum": max_change})
    if fn is parse_reply:
        return obj(thinking=text(2, 2), reply=text(2, 2))
    if fn is parse_opening:  # the opening prompts ask for the line alone
        return obj(reply=text(1, 1))
    if fn is parse_judgement:
        score = {"type": "integer", "minimum": 1, "maximum": 5}  # the form judge_messages asks for
        n = len(DIMENSIONS)  # n objects of two fields each
        return obj(**{d: obj(evaluation=text(n, 3 * n), score=score) for d in DIMENSIONS})
    if fn is parse_labels:
        n = getattr(parser, "keywords", {}).get("n")
        if n is None:  # the count of turns is unknown: no schema
            return None
        # A turn's labels: at most one of each strategy's worth (parse_labels reads them as a set;
        # "uniqueItems" would say it exactly, but vLLM's xgrammar refuses the schema for it).
        turn = {"type": "array", "items": {"type": "string", "enum": list(STRATEGIES)}, "maxItems": len(STRATEGIES)}
        return obj(turns={"type": "array", "items": turn, "minItems": n, "maxItems": n})
    return None


class Asker:
    """The `ask` of a Simulator the scripts build (make_simulator) and of the LLM judge:
    ask_until_parsed with a time budget per call (--simulator-call-budget: every try and every
    transport retry together; None = no limit) and the JSON schema of the answer the parser
    reads (structured outputs; `max_change` bounds the appraisal's change), counting the retries
    train.py and evaluate.py log (take_counts)."""

    def __init__(self, budget: float | None = None, who: str = "simulator", max_change: int = 10):
        self.budget, self.who, self.max_change = budget, who, max_change
        self.parse_retries, self._lock = 0, threading.Lock()

    def __call__(self, backend, messages, parser, tries: int):
        return ask_until_parsed(backend, messages, parser, tries, self.budget, self._count, log, self.who,
                                answer_schema(parser, self.max_change, getattr(backend, "max_tokens", None) or 1024))

    def _count(self):
        with self._lock:
            self.parse_retries += 1

    def take_counts(self, backend) -> dict:
        """Parse retries (here) and transport retries (the backend's) since the last call, then
        reset to 0: train.py reads them once per step, evaluate.py once per model."""
        with self._lock:
            parse, self.parse_retries = self.parse_retries, 0
        take = getattr(backend, "take_retries", None)
        return {"parse_retries": parse, "transport_retries": take() if take else 0}


def identity(backend) -> dict:
    """What decides a backend's answers besides the messages: its kind, endpoint or model, and
    sampling settings (never the key). CachedBackend keys its answers with it; evaluate.py
    records it with the transcripts."""
    if isinstance(backend, CachedBackend):
        return identity(backend.backend)
    if isinstance(backend, OpenAIBackend):
        return {"kind": "openai", "base_url": backend.base_url, "model": backend.model,
                "temperature": backend.temperature, "max_tokens": backend.max_tokens}
    if isinstance(backend, HFBackend):
        return {"kind": "hf", "model": backend.path, "temperature": backend.temperature,
                "max_new_tokens": backend.max_new_tokens}
    if isinstance(backend, RuleBackend):  # the reader only when there is one: older records stay equal
        return {"kind": "rule", "seed": backend.seed, **({"reader": backend.reader.name} if backend.reader else {})}
    return {"kind": type(backend).__name__}


def describe(backend) -> str:
    """Which simulated user is behind a run, in words (never the key)."""
    if isinstance(backend, CachedBackend):
        return f"{describe(backend.backend)}, answers cached in {backend.path}"
    if isinstance(backend, OpenAIBackend):
        return f"OpenAI-compatible server {backend.base_url}, model {backend.model}"
    if isinstance(backend, HFBackend):
        return f"local transformers model {backend.path}"
    if isinstance(backend, RuleBackend):
        return "offline rule user (rule_user.RuleBackend" + (f", reading with {backend.reader.name})" if backend.reader
                                                             else ")")
    return type(backend).__name__


class OpenAIBackend:
    """Any OpenAI-compatible chat-completions server (DeepSeek-V3, `vllm serve`, ...).

    Transport faults (429, 408/409, 5xx, timeouts, connection errors) are retried here with
    exponential backoff (or the server's retry-after), at most `max_retries` times. The
    official client can retry by itself, but its per-request timeout applies afresh to each of
    its retries, so a dead server could hold one call for (1 + max_retries) x timeout plus
    backoff, and its retries are invisible to us. Retrying in this small loop (the client set
    to max_retries=0) lets each request and each backoff be cut to the caller's deadline, and
    lets us count the retries (`take_retries`).

    What a server can send and what happens (docs/RELIABILITY.md): 401/403/404 mean the key,
    the model or the URL is wrong, an EndpointError that stops the run; an answer cut at
    max_tokens (finish_reason "length"), one over MAX_ANSWER_BYTES, or a body that is not a
    chat completion is an error here: a failed try through ask_until_parsed (Asker). The API key is read from
    an environment variable, never printed, and cut out of every error message (servers echo it)."""

    parallel = True
    takes_deadline = True  # chat(messages, deadline=..., schema=...): see Asker
    MAX_ANSWER_BYTES = 256 * 1024  # a simulated user's line is ~1 KB; a bigger answer is a fault
    # How the answer is constrained, best first: structured outputs (the exact JSON schema the
    # parser reads: vLLM, SGLang, llama.cpp's server, OpenAI), JSON mode, plain text. A format
    # refused (refuses_format: an error that names it) and the next one answered with a chat
    # completion moves the endpoint down for the rest of the run, logged once.
    FORMATS = {"json_schema": "structured outputs (a JSON schema)", "json_object": "JSON mode", "text": "plain text"}

    def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY",
                 temperature: float = 0.7, timeout: float = 60.0, max_retries: int = 4,
                 json_mode: bool = True, max_tokens: int = 1024, flag: str = "--simulator"):
        self.base_url, self.model, self.temperature = base_url, model, temperature
        self.format, self.max_tokens = "json_schema" if json_mode else "text", max_tokens
        self.timeout, self.max_retries = timeout, max_retries
        self.api_key_env, self.flag = api_key_env, flag  # flag: which flags name this endpoint in errors
        self.retries, self._lock = 0, threading.Lock()
        self._key = os.environ.get(api_key_env) or ""
        # Local servers (vllm) accept any key; hosted ones answer 401 (an EndpointError).
        self.client = openai.OpenAI(base_url=base_url, api_key=self._key or "EMPTY", timeout=timeout, max_retries=0)

    def __repr__(self):  # never show the key
        return f"OpenAIBackend(base_url={self.base_url!r}, model={self.model!r})"

    def take_retries(self) -> int:
        """Transport retries since the last call (then reset to 0)."""
        with self._lock:
            n, self.retries = self.retries, 0
        return n

    @property
    def json_mode(self) -> bool:
        """Is the answer asked for as JSON (a schema or JSON mode)?"""
        return self.format != "text"

    def chat(self, messages: list[dict], deadline: float | None = None, schema: dict | None = None) -> str:
        """One answer's text. `deadline` (time.monotonic()): no request or backoff runs past it.
        `schema`: the JSON schema the answer must follow, where the server has structured
        outputs (else JSON mode)."""
        kw = dict(model=self.model, messages=messages, temperature=self.temperature, max_tokens=self.max_tokens)
        k = 0  # failed tries so far
        asked = fmt = "json_object" if self.format == "json_schema" and schema is None else self.format
        refusal = ""  # why the server refused the format this call began with
        while True:
            kw.pop("response_format", None)
            if fmt == "json_schema":
                kw["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                                "strict": True}}
            elif fmt == "json_object":
                kw["response_format"] = {"type": "json_object"}
            left = self.timeout if deadline is None else min(self.timeout, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError("call budget spent")
            try:
                body = self._request(kw, left)
                break
            except openai.APIStatusError as e:
                if e.status_code in (401, 403, 404):
                    raise EndpointError(self._endpoint_problem(e.status_code)) from None
                if fmt != "text" and refuses_format(e.status_code, e.message):
                    # The server lacks this format, and says so in many ways: a 400 naming
                    # response_format (OpenAI), the JSON schema and its grammar backend (vLLM's
                    # xgrammar), a 422 naming json_schema (DeepSeek's "json_schema is unavailable
                    # now", FastAPI's validation of response_format). So ask again at once with
                    # the next format, which is not a failed try; the endpoint keeps the
                    # step-down only if that request is answered with a chat completion (below).
                    # Any other 4xx (the context is too long) is a failed try in this format.
                    refusal = refusal or self._redact(e.message)[:200]  # "Error code: 422 - {...}"
                    fmt = list(self.FORMATS)[list(self.FORMATS).index(fmt) + 1]
                    continue
                error = e
            except (openai.APIConnectionError, TimeoutError) as e:  # also the client's timeouts
                error = e
            wait = self._retry_wait(error, k)
            if wait is None or k == self.max_retries or (deadline is not None and time.monotonic() + wait >= deadline):
                raise RuntimeError(self._redact(f"{type(error).__name__}: {error}")) from None
            k += 1
            with self._lock:
                self.retries += 1
            time.sleep(wait)
        content = self._content(body)  # a body that is not a chat completion: a failed try, no step-down
        if fmt != asked:  # a lower format was answered: the endpoint keeps it, logged once
            formats = list(self.FORMATS)
            with self._lock:  # once, whichever call met it first; a call that began below the
                # endpoint's format (JSON mode for an answer without a schema) says nothing of it
                if formats.index(asked) <= formats.index(self.format) < formats.index(fmt):
                    log.warning("%s endpoint refused %s (%s); continuing with %s", self.flag,
                                self.FORMATS[asked], refusal, self.FORMATS[fmt])
                    self.format = fmt
        return content

    def _request(self, kw: dict, left: float) -> bytes:
        """One request -> the response body, within `left` seconds whatever the server does.

        The HTTP client's timeout applies to each read, not to the whole answer: a server that
        sends one byte per second holds a call as long as it likes. So the request runs in a
        daemon thread that we wait for at most `left` seconds; the thread itself stops reading
        at that point (or at MAX_ANSWER_BYTES) and ends."""
        end = time.monotonic() + left
        result = {}

        def read():
            try:
                with self.client.chat.completions.with_streaming_response.create(**kw, timeout=left) as response:
                    body = bytearray()
                    for chunk in response.iter_bytes():
                        body += chunk
                        if len(body) > self.MAX_ANSWER_BYTES:
                            raise ValueError(f"answer over {self.MAX_ANSWER_BYTES} bytes")
                        if time.monotonic() > end:
                            raise TimeoutError(f"no complete answer within {left:.1f} s")
                result["body"] = bytes(body)
            except BaseException as e:  # handed to the caller's thread
                result["error"] = e

        worker = threading.Thread(target=read, daemon=True)
        worker.start()
        worker.join(left)
        if worker.is_alive():
            raise TimeoutError(f"no complete answer within {left:.1f} s")
        if "error" in result:
            raise result["error"]
        return result["body"]

    def _content(self, body: bytes) -> str:
        """A chat-completions body -> the message text; ValueError when it is not one."""
        try:
            choice = json.loads(body)["choices"][0]
            content = choice["message"]["content"]
        except (ValueError, RecursionError, TypeError, KeyError, IndexError):
            # Redact, then cut: a key that crossed the cut would leave its first bytes in the message.
            text = self._redact(body.decode("utf-8", errors="replace"))
            raise ValueError(f"malformed chat-completions response: {text[:200]!r}") from None
        if content is not None and not isinstance(content, str):  # a list, a number, ...
            raise ValueError(f"chat-completions content is a {type(content).__name__}, not text")
        if choice.get("finish_reason") == "length":  # cut at max_tokens: half an answer is no answer
            raise ValueError(f"answer cut at max_tokens={self.max_tokens} (finish_reason length)")
        # DeepSeek's JSON mode can return blank content: that is a parse failure -> retried. The
        # key cut out: what a server says is logged, parsed into errors and transcripts.
        return self._redact(content or "")

    def _retry_wait(self, err, k: int) -> float | None:
        """Seconds to wait before retry k (0-based) after `err`, or None if `err` is final."""
        hint = None
        if isinstance(err, openai.APIStatusError):
            if not (err.status_code in (408, 409, 429) or err.status_code >= 500):
                return None
            h = err.response.headers
            try:  # the server's own hint, as the official client reads it
                if "retry-after-ms" in h:
                    hint = float(h["retry-after-ms"]) / 1000
                elif "retry-after" in h:
                    hint = float(h["retry-after"])
            except ValueError:
                hint = None
        if hint is not None and 0 <= hint <= 60:
            return hint
        return min(0.5 * 2 ** k, 8.0) * (1 - 0.25 * random.random())

    def _endpoint_problem(self, status: int) -> str:
        """What a 401/403/404 means, naming the flag or variable to fix (one line)."""
        where = f"the {self.flag.lstrip('-')} endpoint {self.base_url}"
        if status == 404:
            return (f"{where} answered 404 for model {self.model!r}: check {self.flag}-model "
                    f"(and {self.flag}-base-url)")
        if not self._key:
            return (f"{where} refused the request (HTTP {status}): the environment variable {self.api_key_env} "
                    f"is not set ({self.flag}-api-key-env names the variable that holds the key)")
        return (f"{where} refused the key in ${self.api_key_env} (HTTP {status}); "
                f"{self.flag}-api-key-env names the variable that holds the key")

    def _redact(self, text: str) -> str:
        """`text` with the API key cut out (an error body or an answer may echo it). A key of a
        few characters ("1", "EMPTY": a local server takes any) is no secret, and cutting it out
        would change answers ("change: 10" -> "change: ***0")."""
        if len(self._key) >= 8:
            text = text.replace(self._key, "***")
        return text

    def check(self, timeout: float = 10.0) -> None:
        """Before any work: an unreachable endpoint is a ConnectionError, a refused key an
        EndpointError (both one line). Asks GET /models, which costs nothing; a wrong model
        name shows at the first call (404), since some servers do not implement /models."""
        try:
            self.client.with_options(timeout=timeout, max_retries=0).models.list()
        except openai.APIConnectionError as e:
            raise ConnectionError(self._redact(f"{self.flag.lstrip('-')} endpoint {self.base_url} is unreachable: "
                                               f"{e}")) from None
        except openai.APIStatusError as e:
            if e.status_code in (401, 403):
                raise EndpointError(self._endpoint_problem(e.status_code)) from None


# What an error about the answer's format names: the request field, the formats, the
# constrained-decoding backends that serve them (vLLM's xgrammar / guidance / outlines, TGI's
# grammar). An error about the length is never one, though OpenAI's names the format too ("your
# messages resulted in 137655 tokens (including 348 in the response_format schemas.)").
FORMAT_WORDS = re.compile(r"response_format|json_schema|json_object|json schema|json mode|structured output|"
                          r"guided|guidance|grammar|outlines|lm-format-enforcer", re.I)
LENGTH_WORDS = re.compile(r"context.length|maximum context|context window|reduce the length|too many tokens|"
                          r"max_tokens|max_new_tokens|prompt is too long", re.I)


def refuses_format(status: int, message: str = "") -> bool:
    """Is this error a server's refusal of the response_format asked for? A 4xx but those that
    mean something else (401/403/404: the key, the model, the URL, an EndpointError; 408/409/429:
    transport faults, retried with backoff) whose message names the format (FORMAT_WORDS) and
    not the length (LENGTH_WORDS)."""
    message = message or ""
    return (400 <= status < 500 and status not in (401, 403, 404, 408, 409, 429)
            and bool(FORMAT_WORDS.search(message)) and not LENGTH_WORDS.search(message))


class HFBackend:
    """A local transformers chat model as the simulated user (one call at a time)."""

    parallel = False

    def __init__(self, model_path: str, temperature: float = 0.7, max_new_tokens: int = 384,
                 device: str | None = None):
        self.path = model_path
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto")
        self.model.to(device or ("cuda" if torch.cuda.is_available() else "cpu")).eval()
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.lock = threading.Lock()

    def chat(self, messages: list[dict]) -> str:
        with self.lock, torch.no_grad():
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)
            ids = {k: v.to(self.model.device) for k, v in ids.items()}
            out = self.model.generate(**ids, max_new_tokens=self.max_new_tokens,
                                      do_sample=self.temperature > 0,
                                      temperature=self.temperature or None)
            return self.tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


class CachedBackend:
    """Wraps an LLM backend: each answer the simulator could parse is appended to a JSONL file
    keyed by a hash of the endpoint (URL, model, sampling settings: `identity`) and the request,
    so a rerun after an interruption replays paid calls from disk, and a run against another
    server or model never replays this one's answers. (With greedy decoding the agent says the
    same things again, so the same requests come back.) Only parsed answers are stored
    (`ask_until_parsed` calls `keep`): a retry sends the same messages, and replaying
    the unparseable answer into its own retry would defeat it."""

    def __init__(self, backend, path: str):
        self.backend, self.path, self.lock = backend, path, threading.Lock()
        self.parallel = getattr(backend, "parallel", False)
        self.takes_deadline = getattr(backend, "takes_deadline", False)
        self.max_tokens = getattr(backend, "max_tokens", None)  # what answer_schema's bounds fit
        self.identity = identity(backend)
        self.cache, self.hits, self.misses = {}, 0, 0
        if os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    try:
                        row = json.loads(line)
                        self.cache[row["key"]] = row["response"]
                    except (ValueError, RecursionError, KeyError, TypeError):
                        continue  # a line cut by a crash: that call is simply made again

    def key(self, messages) -> str:
        request = json.dumps([self.identity, messages], ensure_ascii=False, sort_keys=True)
        return hashlib.sha256(request.encode()).hexdigest()

    def chat(self, messages, **kw):
        key = self.key(messages)
        with self.lock:
            if key in self.cache:
                self.hits += 1
                return self.cache[key]
        response = self.backend.chat(messages, **kw)
        with self.lock:
            self.misses += 1
        return response

    def keep(self, messages, response: str):
        key = self.key(messages)
        with self.lock:
            if key in self.cache:
                return
            self.cache[key] = response
            # A failed write (a full disk) is a SaveError: the scripts end in one line, not a traceback.
            append_line(self.path, json.dumps({"key": key, "response": response}, ensure_ascii=False))

    def take_retries(self) -> int:
        take = getattr(self.backend, "take_retries", None)
        return take() if take else 0
