"""Train the three bundled demo models from scratch, on CPU, on Python's own documentation.

    .venv/bin/python scripts/train_demo_models.py            # all three, ~5 minutes each on one core
    .venv/bin/python scripts/train_demo_models.py --only llama --steps 50 --out /tmp/demo   # a quick try
    .venv/bin/python scripts/train_demo_models.py --tokenizer stateserve/assets/models/llama-demo --out /tmp/r
        # the bundled models again, bit for bit (only the tokenizer's training is not reproducible)

The text is what every Python install carries offline: the language reference topics of `pydoc_data.topics`
and the docstrings of a fixed list of standard-library modules. A byte-level BPE tokenizer is trained on the
training split; then Mamba2ForCausalLM (attention-free), BambaForCausalLM (Mamba2 layers + one attention layer)
and LlamaForCausalLM are trained with transformers' own classes, a plain PyTorch loop, AdamW and a cosine
schedule. Everything is seeded and runs deterministically. Held-out loss goes to docs/demo_models.md, the
curves to docs/loss_curves.png (when matplotlib is installed).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import math
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "stateserve", "assets", "models")
DOCS = os.path.join(REPO, "docs")

EOS, USER, ASSISTANT, SYSTEM = "<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"
SPECIAL_TOKENS = [EOS, USER, ASSISTANT, SYSTEM]  # ids 0..3; EOS doubles as pad
# "<|user|>\n...\n<|assistant|>\n", with EOS closing each assistant turn (what the model learned to emit).
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
                 "{% if message['role'] == 'assistant' %}" + EOS + "{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

# Pure-Python modules whose docstrings read like documentation; a fixed, sorted list keeps the corpus stable.
DOC_MODULES = sorted([
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum",
    "fnmatch", "fractions", "functools", "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "html",
    "http.client", "http.server", "imaplib", "inspect", "io", "ipaddress", "json", "locale", "logging",
    "mailbox", "mimetypes", "numbers", "operator", "optparse", "os", "pathlib", "pickle", "pkgutil",
    "platform", "pprint", "queue", "random", "re", "sched", "secrets", "selectors", "shlex", "shutil",
    "smtplib", "socket", "socketserver", "statistics", "string", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "timeit", "tokenize", "traceback", "types", "typing", "unittest", "urllib.parse",
    "urllib.request", "uuid", "warnings", "weakref", "zipfile",
])
HELDOUT_EVERY = 20  # every 20th document (by position in the corpus) is held out


@dataclass
class Document:
    text: str
    question: str  # the user turn of the chat-formatted copy of this document's opening


def _topic_documents() -> list[Document]:
    from pydoc_data.topics import topics

    docs = []
    for key in sorted(topics):
        text = topics[key].strip()
        title = text.split("\n", 1)[0].strip()
        docs.append(Document(text, f"What does the Python documentation say about {title}?"))
    return docs


def _docstring_documents() -> list[Document]:
    with warnings.catch_warnings():  # deprecated aliases (typing.io, ...) warn when touched; the text is fine
        warnings.simplefilter("ignore", DeprecationWarning)
        return _collect_docstrings()


def _collect_docstrings() -> list[Document]:
    docs = []
    for name in DOC_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a trimmed Python build: the corpus just gets smaller
            continue
        if module.__doc__:
            docs.append(Document(inspect.cleandoc(module.__doc__), f"What is the {name} module for?"))
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if not (inspect.isclass(obj) or inspect.isfunction(obj)) or not obj.__doc__:
                continue
            doc = inspect.cleandoc(obj.__doc__)
            if len(doc) < 80:  # one-liners teach little and crowd the corpus
                continue
            try:
                # defaults like <object object at 0x7f..> would make the text differ from process to process
                signature = re.sub(r" at 0x[0-9a-fA-F]+", "", str(inspect.signature(obj)))
            except (TypeError, ValueError):
                signature = "(...)"
            docs.append(Document(f"{name}.{attr}{signature}\n\n{doc}", f"What does {name}.{attr} do?"))
    return docs


def corpus_splits() -> tuple[list[str], list[str]]:
    """(train texts, held-out texts). Each document gives its plain text and a chat-formatted opening."""
    train, heldout = [], []
    for i, doc in enumerate(_topic_documents() + _docstring_documents()):
        answer = doc.text[:600].rsplit("\n\n", 1)[0] if len(doc.text) > 600 else doc.text
        chat = f"{USER}\n{doc.question}\n{ASSISTANT}\n{answer}\n"
        (heldout if i % HELDOUT_EVERY == 0 else train).extend([doc.text, chat])
    return train, heldout


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   additional_special_tokens=[USER, ASSISTANT, SYSTEM],
                                   chat_template=CHAT_TEMPLATE, model_max_length=1024)


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Every text followed by EOS, concatenated: [N] int64."""
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def model_specs(vocab_size: int, eos_id: int) -> dict[str, tuple[type, type, dict]]:
    """name -> (config class, model class, config kwargs); a few million parameters each."""
    from transformers import (BambaConfig, BambaForCausalLM, LlamaConfig, LlamaForCausalLM, Mamba2Config,
                              Mamba2ForCausalLM)

    common = dict(vocab_size=vocab_size, hidden_size=192, bos_token_id=eos_id, eos_token_id=eos_id,
                  pad_token_id=eos_id, tie_word_embeddings=False, initializer_range=0.02)
    # Mamba2 gets fewer, wider layers: on CPU its reference scan costs per layer more than per width.
    return {
        "mamba2-demo": (Mamba2Config, Mamba2ForCausalLM, dict(
            common, hidden_size=224, num_hidden_layers=4, expand=2, head_dim=32, num_heads=14, n_groups=1,
            state_size=32, conv_kernel=4, chunk_size=64)),
        "hybrid-demo": (BambaConfig, BambaForCausalLM, dict(
            common, num_hidden_layers=4, attn_layer_indices=[2], intermediate_size=384, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, mamba_n_heads=12, mamba_n_groups=1,
            mamba_d_state=32, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64)),
        "llama-demo": (LlamaConfig, LlamaForCausalLM, dict(
            common, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024)),
    }


@dataclass
class TrainArgs:
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int
    eval_every: int
    seed: int


@dataclass
class TrainResult:
    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)  # mean over each eval interval
    eval_steps: list[int] = field(default_factory=list)
    eval_loss: list[float] = field(default_factory=list)
    heldout_loss: float = float("nan")
    num_params: int = 0
    seconds: float = 0.0


def lm_loss(model, windows: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of windows [B, L+1]; the model sees [B, L]."""
    logits = model(input_ids=windows[:, :-1]).logits  # [B, L, V]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), windows[:, 1:].reshape(-1))


def heldout_windows(stream: torch.Tensor, seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [N, seq_len + 1] of a held-out stream (its tail is dropped)."""
    n = (len(stream) - 1) // seq_len
    if limit is not None:
        n = min(n, limit)
    return torch.stack([stream[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch_size: int = 32) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        batch = windows[i: i + batch_size]
        total += float(lm_loss(model, batch)) * len(batch)
        count += len(batch)
    model.train()
    return total / count


def train_model(model, train_stream: torch.Tensor, eval_windows: torch.Tensor, args: TrainArgs,
                name: str) -> TrainResult:
    gen = torch.Generator().manual_seed(args.seed)
    # weight decay on matrices only: norms, biases, A_log, D and dt_bias keep their scale
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to 10%
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    result = TrainResult(num_params=sum(p.numel() for p in model.parameters()))
    probe = eval_windows[:32]  # a fixed slice for the curve; the final number uses every window
    start, running = time.perf_counter(), []
    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        offsets = torch.randint(0, len(train_stream) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([train_stream[o: o + args.seq_len + 1] for o in offsets.tolist()])
        loss = lm_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running.append(loss.item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            result.steps.append(step + 1)
            result.train_loss.append(sum(running) / len(running))
            result.eval_steps.append(step + 1)
            result.eval_loss.append(evaluate(model, probe))
            running = []
            print(f"  [{name}] step {step + 1}/{args.steps} train {result.train_loss[-1]:.3f} "
                  f"held-out {result.eval_loss[-1]:.3f} ({time.perf_counter() - start:.0f}s)", flush=True)
    result.seconds = time.perf_counter() - start
    result.heldout_loss = evaluate(model, eval_windows)
    return result


def save_folder(model, tokenizer, out_dir: str, eos_id: int) -> None:
    from transformers import GenerationConfig

    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=eos_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    # the template goes inside tokenizer_config.json, where every loader looks for it
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)


def write_report(results: dict[str, TrainResult], vocab_size: int, train_tokens: int, heldout_tokens: int,
                 args: TrainArgs, path: str) -> None:
    log_v = math.log(vocab_size)
    rows = "\n".join(f"| {name} | {r.num_params / 1e6:.2f} M | {r.heldout_loss:.3f} | {log_v:.3f} | "
                     f"{math.exp(r.heldout_loss):.1f} | {r.seconds / 60:.1f} min |" for name, r in results.items())
    text = f"""# Bundled demo models

Three tiny models trained from scratch by `scripts/train_demo_models.py` so that `make run` shows real text
without downloading anything. They live in `stateserve/assets/models/` as ordinary Hugging Face folders
(config.json, model.safetensors in float32, tokenizer.json, tokenizer_config.json with a chat template,
generation_config.json).

| model | parameters | held-out loss (nats/token) | log(vocab) = uniform guess | perplexity | training time |
|---|---|---|---|---|---|
{rows}

- **Text**: Python's own documentation, present in every install: the reference topics of `pydoc_data.topics`
  and docstrings of {len(DOC_MODULES)} standard-library modules (Python {sys.version.split()[0]}). Every
  {HELDOUT_EVERY}th document is held out; each document also appears once as a short chat
  (`<|user|>` question, `<|assistant|>` the document's opening). {train_tokens:,} training tokens,
  {heldout_tokens:,} held-out tokens.
- **Tokenizer**: byte-level BPE (`tokenizers`), vocabulary {vocab_size}; `<|endoftext|>` (id 0) is EOS and pad.
- **Models** (transformers' own classes): `mamba2-demo` Mamba2ForCausalLM (4 Mamba2 layers, attention-free);
  `hybrid-demo` BambaForCausalLM (4 layers, layer 2 is attention, the rest Mamba2); `llama-demo`
  LlamaForCausalLM (4 layers). Hidden size 224 (Mamba2) or 192, untied embeddings.
- **Training**: {args.steps} steps of {args.batch_size} x {args.seq_len} tokens, AdamW (lr {args.lr}, betas
  0.9/0.95, weight decay 0.1 on matrices), {args.warmup} warmup steps then cosine decay to 10%, gradient
  clipping 1.0, seed {args.seed}, one CPU thread, `torch.use_deterministic_algorithms(True)`. Training
  times are wall clock on a 2-core machine shared with other jobs.

The loss curves are in `docs/loss_curves.png` (their held-out line is the first 32 held-out windows; the table
uses all of them). Same data and steps for the three: in the committed run the two models with Mamba2 layers,
whose short causal convolution sees local context from the first step, learned faster than the Llama model,
which sat near the unigram plateau (~6.3) longer. These models know a little about Python's documentation and
nothing else; they exist to exercise the engine, not to answer questions.

Reproduce with `.venv/bin/python scripts/train_demo_models.py` (the plot needs `pip install matplotlib`;
without it the script still trains). Model training is deterministic, but tokenizers' BPE trainer breaks ties
between equally frequent merges in an order that changes from process to process, so a fresh run gets a
slightly different tokenizer and models; add `--tokenizer stateserve/assets/models/llama-demo --out DIR` to
get the bundled models bit for bit. `make run` (`python -m stateserve.demo`) generates with each model and
shows prefix-cache hits; `tests/test_demo_models.py` checks stateserve's greedy output against transformers'
on these folders and that the held-out loss stays well below both log(vocab) and a unigram baseline.
"""
    with open(path, "w") as f:
        f.write(text)


def plot_curves(results: dict[str, TrainResult], vocab_size: int, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed, so no loss-curve plot: `pip install matplotlib` and rerun to get "
              f"{os.path.relpath(path, REPO)}")
        return
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for (name, r), color in zip(results.items(), ["tab:blue", "tab:orange", "tab:green"]):
        ax.plot(r.steps, r.train_loss, color=color, alpha=0.45, label=f"{name} train")
        ax.plot(r.eval_steps, r.eval_loss, color=color, label=f"{name} held-out")
    ax.axhline(math.log(vocab_size), color="gray", linestyle="--", label="log(vocab)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("Demo models trained on Python's documentation")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {os.path.relpath(path, REPO)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help="folder that receives <name>-demo/ model folders")
    p.add_argument("--only", action="append", help="train only models whose name contains this (repeatable)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--tokenizer", help="reuse this folder's tokenizer instead of training one; "
                                       "stateserve/assets/models/llama-demo reproduces the bundled models exactly")
    p.add_argument("--threads", type=int, default=1, help="torch threads (results are deterministic anyway)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-docs", action="store_true", help="do not write docs/demo_models.md and the plot")
    a = p.parse_args()

    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True)
    args = TrainArgs(steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr,
                     warmup=max(1, min(50, a.steps // 10)), eval_every=max(1, a.steps // 30), seed=a.seed)

    train_texts, heldout_texts = corpus_splits()
    if a.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.tokenizer)
    else:
        # tokenizers' BPE trainer breaks ties between equally frequent merges in hash order, which changes from
        # process to process: a fresh tokenizer (and so the models) differs slightly from run to run
        tokenizer = train_tokenizer(train_texts, a.vocab_size)
    vocab_size = len(tokenizer)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    train_stream, heldout_stream = token_stream(tokenizer, train_texts), token_stream(tokenizer, heldout_texts)
    eval_windows = heldout_windows(heldout_stream, args.seq_len)
    print(f"corpus: {len(train_texts)} train texts = {len(train_stream):,} tokens, {len(heldout_texts)} held-out "
          f"= {len(heldout_stream):,} tokens; vocab {vocab_size}, log(vocab) = {math.log(vocab_size):.3f}")

    results: dict[str, TrainResult] = {}
    for name, (config_cls, model_cls, cfg) in model_specs(vocab_size, eos_id).items():
        if a.only and not any(o in name for o in a.only):
            continue
        torch.manual_seed(args.seed)
        model = model_cls(config_cls(**cfg))
        print(f"training {name} ({model_cls.__name__}, {sum(p.numel() for p in model.parameters()):,} params)")
        results[name] = train_model(model, train_stream, eval_windows, args, name)
        save_folder(model.eval(), tokenizer, os.path.join(a.out, name), eos_id)
        print(f"{name}: held-out loss {results[name].heldout_loss:.3f} vs log(vocab) {math.log(vocab_size):.3f}, "
              f"{results[name].seconds / 60:.1f} min -> {os.path.join(a.out, name)}")

    print("\n| model | held-out loss | log(vocab) |")
    for name, r in results.items():
        print(f"| {name} | {r.heldout_loss:.3f} | {math.log(vocab_size):.3f} |")
    if not a.no_docs and results:
        os.makedirs(DOCS, exist_ok=True)
        write_report(results, vocab_size, len(train_stream), len(heldout_stream), args,
                     os.path.join(DOCS, "demo_models.md"))
        plot_curves(results, vocab_size, os.path.join(DOCS, "loss_curves.png"))


if __name__ == "__main__":
    main()
