"""Fine-tune the bundled demo target into `gemma4-demo-chat`: the same model, taught to answer in its chat template
and to end its turn, so a coding agent's turn completes against it (issue 58).

    pip install -e '.[parity]'            # torch CPU; transformers comes with mlx-lm
    python tools/scripts/train_demo_chat.py --out provider/models/demo/gemma4-demo-chat

The data is made here, offline, from the same corpus as the target's (train_demo_pair.corpus): conversations of a
system message (often long: agents send 10-25k tokens of one), one to three user turns of corpus text and model
turns of one short corpus sentence, each ended with <end_of_turn>. The loss is on the model's turns only. Some
steps read a long system message (up to --long tokens) so the full-attention layers meet far keys; RoPE is
relative, so where a window starts does not matter, only how far back its keys are.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools.scripts.train_demo_pair import corpus, lr_at, save  # noqa: E402

DEMO = ROOT / "provider" / "models" / "demo" / "gemma4-demo"


def sentences(text: str) -> list[str]:
    """Short plain sentences of the corpus: the model's answers."""
    out = []
    for s in re.split(r"(?<=[.!?])\s+", text):
        s = " ".join(s.split())
        if 20 <= len(s) <= 160 and s[0].isupper() and not any(c in s for c in "`|#*<>{}[]_=\\"):
            out.append(s)
    return out


def conversation(rng: random.Random, words: list[str], answers: list[str], long_words: int) -> list[dict]:
    def chunk(lo: int, hi: int) -> str:
        start = rng.randrange(len(words) - hi)
        return " ".join(words[start:start + rng.randint(lo, hi)])

    msgs = []
    if long_words or rng.random() < 0.5:
        msgs.append({"role": "system", "content": chunk(long_words or 20, long_words or 300)})
    for _ in range(rng.randint(1, 3)):
        msgs.append({"role": "user", "content": chunk(2, 60)})
        msgs.append({"role": "assistant", "content": " ".join(rng.choice(answers) for _ in range(rng.randint(1, 2)))})
    return msgs


def encode(msgs: list[dict], tok, ids: dict) -> tuple[list[int], list[int]]:
    """The template's tokens (as the chat template writes them) and labels: the model turns' tokens and their
    <end_of_turn>, -100 elsewhere."""
    x, y = [ids["<bos>"]], [-100]
    for m in msgs:
        role = "model" if m["role"] == "assistant" else m["role"]
        head = [ids["<start_of_turn>"]] + tok.encode(f"{role}\n", add_special_tokens=False).ids
        body = tok.encode(m["content"], add_special_tokens=False).ids + [ids["<end_of_turn>"]]
        tail = tok.encode("\n", add_special_tokens=False).ids
        x += head + body + tail
        y += [-100] * len(head) + (body if role == "model" else [-100] * len(body)) + [-100] * len(tail)
    return x, y


def batch(rng, words, answers, tok, ids, n: int, seq: int, long_words: int, torch):
    xs, ys = [], []
    for _ in range(n):
        x, y = encode(conversation(rng, words, answers, long_words), tok, ids)
        # keep the end (the turns), cut the system message's start if it is over
        x, y = x[-seq:], y[-seq:]
        pad = seq - len(x)
        xs.append(x + [ids["<pad>"]] * pad)
        ys.append(y + [-100] * pad)
    return torch.tensor(xs), torch.tensor(ys)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEMO.parent / "gemma4-demo-chat")
    ap.add_argument("--corpus-bytes", type=int, default=4_000_000)
    ap.add_argument("--seconds", type=float, default=480)
    ap.add_argument("--seq", type=int, default=384)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--long", type=int, default=3072, help="tokens of a long step's sequence (one row)")
    ap.add_argument("--long-every", type=int, default=8, help="every n-th step reads one long system message")
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()

    import torch
    from tokenizers import Tokenizer
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(0)
    rng = random.Random(0)
    t0 = time.time()
    text = corpus(args.corpus_bytes)
    words, answers = text.split(), sentences(text)
    print(f"corpus: {len(text) / 1e6:.1f} MB, {len(answers)} answers, in {time.time() - t0:.0f} s", flush=True)
    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in ("<bos>", "<pad>", "<start_of_turn>", "<end_of_turn>")}
    model = Gemma4ForCausalLM.from_pretrained(DEMO, torch_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    model.train()
    start, step = time.time(), 0
    while (elapsed := time.time() - start) < args.seconds:
        for g in opt.param_groups:
            g["lr"] = lr_at(elapsed / args.seconds, args.lr)
        long = step % args.long_every == args.long_every - 1
        x, y = batch(rng, words, answers, tok, ids, 1 if long else args.batch, args.long if long else args.seq,
                     args.long if long else 0, torch)
        loss = model(input_ids=x, attention_mask=(x != ids["<pad>"]).long(), labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 20 == 0:
            print(f"step {step} loss {loss.item():.3f} ({'long' if long else 'short'}) {elapsed:.0f} s", flush=True)
    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    save(model, args.out, DEMO, torch)
    cfg = json.loads((args.out / "config.json").read_text())
    print(f"done in {time.time() - t0:.0f} s: {args.out} ({cfg.get('model_type')})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
