"""Train the bundled demo pair: a small Gemma 4 target and its MTP assistant, on text available offline.

    pip install -e '.[parity]'            # torch CPU; transformers comes with mlx-lm
    python tools/scripts/train_demo_pair.py --out provider/models/demo

1. Corpus: docstrings and .md/.rst/.txt files of the installed Python packages (sorted, capped).
2. Tokenizer: byte-level BPE, 2048 tokens, the fixtures' special tokens and Gemma chat template.
3. Target: Gemma 4 text model (sliding + full layers, KV-shared tail, per-layer inputs), trained on the corpus.
4. Assistant: `gemma4_assistant`, distilled on the target's own greedy continuations. For every query
   position t at once (under 4-D masks), it gets the target's scaled embedding of token t and the target's
   final-norm hidden state of row t-1, attends to the target's committed K/V (rows < t; sliding layers the
   last `window` rows, as the node's MLX drafter reads them), and learns the target's next tokens over
   `--unroll` steps, feeding its own post_projection output back as the reference generator does.
Both are saved as Hugging Face checkpoints in fp16; serving uses only MLX.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
# The context the pair declares (issue 58): room for a coding agent's 20-25k-token prompt (Claude Code's is 25,018
# tokens on this 2048-token vocabulary). Trained on --seq tokens; RoPE needs no table, so positions past that are
# computed as any others, with a tiny model's quality. KV at 32768 tokens: 8 MiB (one full-attention layer holds it).
CONTEXT = 32768
ROPE = {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}


def corpus(max_bytes: int) -> str:
    """Docstrings and documentation files of installed packages, in a stable order."""
    import site

    roots = sorted({Path(p) for p in site.getsitepackages() if Path(p).exists()})
    parts, total = [], 0
    for root in roots:
        for path in sorted(root.rglob("*")):
            if total >= max_bytes or not path.is_file() or path.stat().st_size > 2_000_000:
                continue
            try:
                if path.suffix == ".py":
                    tree = ast.parse(path.read_text(encoding="utf-8"))
                    for node in ast.walk(tree):
                        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                            doc = ast.get_docstring(node)
                            if doc and len(doc) > 40:
                                parts.append(doc)
                                total += len(doc)
                elif path.suffix in (".md", ".rst", ".txt") and "LICENSE" not in path.name.upper():
                    text = path.read_text(encoding="utf-8")
                    parts.append(text)
                    total += len(text)
            except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                continue
    return "\n\n".join(parts)


def target_config(vocab: int, ids: dict) -> dict:
    return dict(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=1, head_dim=64, global_head_dim=64, num_kv_shared_layers=2,
                hidden_size_per_layer_input=16, vocab_size_per_layer_input=vocab, sliding_window=128,
                layer_types=LAYER_TYPES, max_position_embeddings=CONTEXT, final_logit_softcapping=30.0,
                use_double_wide_mlp=False, tie_word_embeddings=True, rope_parameters=ROPE, rms_norm_eps=1e-6,
                attention_k_eq_v=False, enable_moe_block=False, pad_token_id=ids["<pad>"],
                bos_token_id=ids["<bos>"], eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]])


def assistant_text_config(vocab: int) -> dict:
    return dict(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=64, global_head_dim=64, num_kv_shared_layers=2,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, sliding_window=128,
                layer_types=["sliding_attention", "full_attention"], max_position_embeddings=CONTEXT,
                final_logit_softcapping=None, use_double_wide_mlp=False, tie_word_embeddings=True,
                rope_parameters=ROPE, rms_norm_eps=1e-6, attention_k_eq_v=False, enable_moe_block=False)


def lr_at(progress: float, peak: float) -> float:
    warm = 0.03
    if progress < warm:
        return peak * progress / warm
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warm) / (1 - warm))))


def train_target(model, stream, args, torch):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    split = int(len(stream) * 0.98)
    train, val = stream[:split], stream[split:]
    rng = random.Random(0)
    start, step, seen = time.time(), 0, 0
    model.train()
    while (elapsed := time.time() - start) < args.target_seconds:
        for g in opt.param_groups:
            g["lr"] = lr_at(elapsed / args.target_seconds, args.lr)
        starts = [rng.randrange(0, len(train) - args.seq - 1) for _ in range(args.batch)]
        x = torch.stack([train[s:s + args.seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step, seen = step + 1, seen + x.numel()
        if step % 50 == 0:
            print(f"target step {step} loss {loss.item():.3f} {seen / (time.time() - start):.0f} tok/s", flush=True)
    model.eval()
    with torch.no_grad():
        xs = torch.stack([val[i:i + args.seq] for i in range(0, len(val) - args.seq - 1, len(val) // 16)][:16])
        val_loss = model(input_ids=xs, labels=xs).loss.item()
    print(f"target: {step} steps, {seen} tokens, validation loss {val_loss:.3f}", flush=True)
    return val_loss


def greedy_continuations(model, stream, args, torch):
    rng = random.Random(1)
    prompts = [stream[s:s + args.prompt_len] for s in
               (rng.randrange(0, len(stream) - args.prompt_len) for _ in range(args.sequences))]
    out = []
    with torch.no_grad():
        for i in range(0, len(prompts), 64):
            batch = torch.stack(prompts[i:i + 64])
            gen = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=args.continuation,
                                 min_new_tokens=args.continuation, do_sample=False)
            out.append(gen)
    return torch.cat(out)


def masks(L: int, window: int, torch):
    """Additive masks: query t sees K/V rows < t (full) and the last `window` of them (sliding)."""
    q = torch.arange(L)[:, None]
    k = torch.arange(L)[None, :]
    full = k < q
    sliding = full & (k >= q - window)
    neg = torch.finfo(torch.float32).min

    def additive(m):
        return torch.where(m, 0.0, neg)[None, None]

    return {"full_attention": additive(full), "sliding_attention": additive(sliding)}


def distill(target, assistant, seqs, args, torch):
    """Teach the assistant the target's next tokens from the target's own K/V and hidden states."""
    F = torch.nn.functional
    embed = target.get_input_embeddings()  # scaled by sqrt(hidden), as the drafter is fed at inference
    opt = torch.optim.AdamW(assistant.parameters(), lr=args.assistant_lr, weight_decay=0.0)
    L = seqs.shape[1]
    mask = masks(L, args.window, torch)
    rng = random.Random(2)
    start, step = time.time(), 0
    while (elapsed := time.time() - start) < args.assistant_seconds:
        for g in opt.param_groups:
            g["lr"] = lr_at(elapsed / args.assistant_seconds, args.assistant_lr)
        x = seqs[[rng.randrange(len(seqs)) for _ in range(args.assistant_batch)]]
        with torch.no_grad():
            out = target(input_ids=x, return_shared_kv_states=True, output_hidden_states=True)
            hidden = out.hidden_states[-1]  # final-norm hidden, [B, L, Hb]
            labels = out.logits.argmax(-1)  # the target's greedy next token after each row
            kv = {t: (k.detach(), v.detach()) for t, (k, v) in out.shared_kv_states.items()}
            tok_embed = embed(x)
        # Query t (t >= 1): draft step s reads the target's token after row t+s-1 (step 0: token t itself)
        # and predicts the target's token after row t+s. Step 0's hidden is the target's row t-1.
        h = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], dim=1)
        positions = torch.arange(L)[None].expand(x.shape[0], L)
        loss, steps = 0.0, 0
        for s in range(args.unroll):
            if s > 0:
                fed = torch.cat([labels[:, s - 1:], labels[:, -1:].expand(-1, s - 1)], dim=1)
                tok_embed = embed(fed)
            inputs = assistant.pre_projection(torch.cat([tok_embed, h], dim=-1))
            body = assistant.model(inputs_embeds=inputs, attention_mask=mask, position_ids=positions,
                                   shared_kv_states=kv, use_cache=False,
                                   output_hidden_states=True)  # keeps every query row (no logits_to_keep slicing)
            last = body.last_hidden_state
            logits = assistant.lm_head(last)
            h = assistant.post_projection(last)  # fed back, as at inference
            loss = loss + F.cross_entropy(logits[:, 1:L - s].reshape(-1, logits.shape[-1]),
                                          labels[:, 1 + s:L].reshape(-1))
            steps += 1
        loss = loss / steps
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(assistant.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 20 == 0:
            print(f"assistant step {step} loss {loss.item():.3f}", flush=True)
    print(f"assistant: {step} steps", flush=True)


def save(model, path: Path, tokenizer_dir: Path, torch):
    model.to(torch.float16).save_pretrained(path, safe_serialization=True)
    cfg = json.loads((path / "config.json").read_text())
    for c in (cfg, cfg.get("text_config") or {}):  # the published, flat form mlx-lm reads
        per_layer = c.pop("per_layer_config", None) or {}
        dims = {v["head_dim"] for v in per_layer.values() if "head_dim" in v}
        if "head_dim" in c:  # written even when equal to head_dim: mlx-lm's default is E2B's 512
            c["global_head_dim"] = dims.pop() if dims else c["head_dim"]
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "model.safetensors").chmod(0o644)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tokenizer_dir / name).read_bytes())
    (path / "generation_config.json").unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "provider" / "models" / "demo")
    ap.add_argument("--corpus-bytes", type=int, default=12_000_000)
    ap.add_argument("--target-seconds", type=float, default=480)
    ap.add_argument("--assistant-seconds", type=float, default=240)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--sequences", type=int, default=1536)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--assistant-batch", type=int, default=32)
    ap.add_argument("--assistant-lr", type=float, default=2e-3)
    ap.add_argument("--unroll", type=int, default=4)
    ap.add_argument("--window", type=int, default=128)
    args = ap.parse_args()

    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM, Gemma4TextConfig

    from tools.fixtures.factory import GEMMA_TEMPLATE, build_tokenizer

    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    t0 = time.time()
    text = corpus(args.corpus_bytes)
    print(f"corpus: {len(text) / 1e6:.1f} MB in {time.time() - t0:.0f} s", flush=True)
    tok_dir = args.out / "_tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(tok_dir, 2048, GEMMA_TEMPLATE, "<eos>", add_bos=True, corpus=[text])
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    stream = torch.tensor(tokenizer.encode(text, add_special_tokens=False).ids, dtype=torch.long)
    print(f"tokens: {len(stream)} ({len(text) / len(stream):.2f} chars/token)", flush=True)

    target = Gemma4ForCausalLM(Gemma4TextConfig(**target_config(2048, ids)))
    print(f"target params: {sum(p.numel() for p in target.parameters()) / 1e6:.2f}M", flush=True)
    train_target(target, stream, args, torch)
    seqs = greedy_continuations(target, stream, args, torch)
    print(f"continuations: {tuple(seqs.shape)} in {time.time() - t0:.0f} s total", flush=True)

    # transformers refuses a config whose every layer is KV-shared (the assistant's); it means "all reuse".
    original = Gemma4TextConfig.kv_sharing_modes
    Gemma4TextConfig.kv_sharing_modes = property(
        lambda self: ["reuse"] * self.num_hidden_layers if self.num_kv_shared_layers == self.num_hidden_layers
        else original.fget(self))
    acfg = Gemma4AssistantConfig(backbone_hidden_size=256, use_ordered_embeddings=False, tie_word_embeddings=True,
                                 text_config=Gemma4TextConfig(**assistant_text_config(2048)).to_dict(),
                                 eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]])
    assistant = Gemma4AssistantForCausalLM(acfg)
    print(f"assistant params: {sum(p.numel() for p in assistant.parameters()) / 1e6:.2f}M", flush=True)
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    distill(target, assistant, seqs, args, torch)

    save(target, args.out / "gemma4-demo", tok_dir, torch)
    save(assistant, args.out / "gemma4-demo-assistant", tok_dir, torch)
    for f in tok_dir.iterdir():
        f.unlink()
    tok_dir.rmdir()
    print(f"done in {time.time() - t0:.0f} s: {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
