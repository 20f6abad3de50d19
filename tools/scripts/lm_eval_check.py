"""lm-evaluation-harness against the node, and its loglikelihoods against mlx-lm's own scoring (issue 22).

Serves a model with `provider start --local` (the bundled demo target unless --model names a checkpoint), then
runs, from a venv of lm-eval's own (created on first use in --venv; pip is the only network it needs):

- `lm_eval --model local-completions` on a multiple-choice task from a local JSON file, with lm-eval's
  `remote` tokenizer backend (the node's /tokenizer_info, /tokenize, /detokenize: nothing is downloaded);
  it sends token-id prompts with echo, logprobs 1 and max_tokens 1, and sums each continuation's logprobs;
- `lm_eval --model local-completions` on a generation task (generate_until, stop strings);
- `lm_eval --model local-chat-completions` on the same generation task (--apply_chat_template).

Then it scores every (context, choice) pair directly with mlx-lm (one forward over context + continuation,
float32 log-softmax, the continuation encoded as lm-eval encodes it) and prints each task's metrics, the
largest |node - mlx-lm| over all choices, and a verdict: PASS when that is below 2e-3 per continuation token
and lm-eval's greedy flags agree. The exit code is 0 on PASS.

    python tools/scripts/lm_eval_check.py [--model PATH] [--venv DIR] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.harness.daemon import LocalServer  # noqa: E402

LM_EVAL = "lm_eval[api]==0.4.13"  # with transformers, which lm-eval's tokenizer code imports
TOL_PER_TOKEN = 2e-3
MC = [
    {"question": "What does a cache keep?", "choices": ["recent results", "a river", "the sky"], "label": 0},
    {"question": "A batch groups many", "choices": ["requests", "mountains", "colours"], "label": 0},
    {"question": "The node serves a", "choices": ["model", "sandwich", "tide"], "label": 0},
    {"question": "Tokens are read by the", "choices": ["tokenizer", "ocean", "violin"], "label": 0},
    {"question": "Memory is measured in", "choices": ["bytes", "apples", "metres of rope"], "label": 0},
    {"question": "A prompt is sent to the", "choices": ["server", "garden", "moon"], "label": 0},
]
GEN = [{"question": q, "answer": a} for q, a in [("Name one thing a cache holds.", "data"),
                                                  ("What does a node serve?", "models"),
                                                  ("What splits text into tokens?", "tokenizer")]]
TASKS = {
    "node_mc": """task: node_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {dir}/mc.jsonl}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
""",
    "node_gen": """task: node_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {dir}/gen.jsonl}}}}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
generation_kwargs: {{until: ["\\n", "Question:"], max_gen_toks: 16, do_sample: false, temperature: 0.0}}
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true, ignore_case: true}}
""",
}


def lm_eval_venv(venv: Path) -> Path:
    exe = venv / "bin" / "lm_eval"
    if not exe.exists():
        print(f"creating {venv} with {LM_EVAL} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", LM_EVAL, "transformers"], check=True)
    return exe


def run_lm_eval(exe: Path, srv: LocalServer, model_id: str, work: Path, kind: str, task: str, out: Path,
                chat: bool = False) -> dict:
    endpoint = "chat/completions" if chat else "completions"
    args = f"model={model_id},base_url={srv.url}/v1/{endpoint},num_concurrent=1,max_retries=1"
    if not chat:  # lm-eval's remote tokenizer sends the bearer token only when given it as auth_token
        args += f",tokenizer_backend=remote,auth_token={srv.token}"
    cmd = [str(exe), "--model", kind, "--model_args", args, "--include_path", str(work / "tasks"), "--tasks", task,
           "--batch_size", "1", "--log_samples", "--output_path", str(out)] + (["--apply_chat_template"] if chat else [])
    env = os.environ | {"OPENAI_API_KEY": srv.token or "", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                        "HF_HOME": str(work / "hf")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"lm_eval failed ({kind}, {task}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][task]
    samples = [json.loads(line) for f in out.rglob(f"samples_{task}_*.jsonl") for line in f.read_text().splitlines()]
    return {"metrics": {k: v for k, v in results.items() if isinstance(v, (int, float))}, "samples": samples}


def direct_scores(model_path: Path, samples: list[dict]) -> list[tuple[float, float, bool, bool, int]]:
    """(node's loglikelihood, mlx-lm's, node's greedy flag, mlx-lm's, continuation tokens) per choice."""
    import mlx.core as mx
    from mlx_lm import load

    model, tok = load(str(model_path))
    out = []
    for s in samples:
        for (args, resp) in zip(s["arguments"].values(), s["filtered_resps"]):
            context, continuation = args["arg_0"], args["arg_1"]
            ctx = tok.encode(context, add_special_tokens=False)  # as lm-eval's remote tokenizer asks
            whole = tok.encode(context + continuation, add_special_tokens=False)
            cont = whole[len(ctx):]
            logits = model(mx.array(whole)[None])[0].astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            rows = lp[len(ctx) - 1:len(whole) - 1]
            picked = mx.take_along_axis(rows, mx.array(cont)[:, None], axis=-1)[:, 0]
            greedy = bool(mx.all(mx.argmax(rows, axis=-1) == mx.array(cont)).item())
            out.append((float(resp[0]), mx.sum(picked).item(), resp[1] in (True, "True"), greedy, len(cont)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a checkpoint directory (default: the bundled demo)")
    ap.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "provider-lm-eval-venv")
    ap.add_argument("--keep", type=Path, default=None, help="keep the tasks and lm-eval's outputs here")
    a = ap.parse_args()
    from provider.models.default import DEMO_TARGET

    model_path = a.model or DEMO_TARGET
    exe = lm_eval_venv(a.venv)
    with tempfile.TemporaryDirectory() as tmp:
        work = a.keep or Path(tmp)
        (work / "tasks").mkdir(parents=True, exist_ok=True)
        (work / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC))
        (work / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in GEN))
        for name, text in TASKS.items():
            (work / "tasks" / f"{name}.yaml").write_text(text.format(dir=work))
        (home := work / "home").mkdir(exist_ok=True)
        srv = LocalServer(model_path, home, env={"PROVIDER_SPECULATION": "off"})
        try:
            model_id = _model_id(srv)
            mc = run_lm_eval(exe, srv, model_id, work, "local-completions", "node_mc", work / "out_mc")
            gen = run_lm_eval(exe, srv, model_id, work, "local-completions", "node_gen", work / "out_gen")
            chat = run_lm_eval(exe, srv, model_id, work, "local-chat-completions", "node_gen", work / "out_chat",
                               chat=True)
        finally:
            srv.stop()
    scores = direct_scores(model_path, mc["samples"])
    worst = max(abs(n - d) / max(k, 1) for n, d, _, _, k in scores)
    greedy_agree = all(gn == gd for _, _, gn, gd, _ in scores)
    print(f"model {model_path.name}; lm-eval {LM_EVAL.split('==')[1]}")
    print(f"  node_mc   (local-completions, remote tokenizer): {mc['metrics']}, {len(scores)} choices scored")
    print(f"  node_gen  (local-completions): {gen['metrics']}; answers "
          f"{[s['filtered_resps'][0] for s in gen['samples']]}")
    print(f"  node_gen  (local-chat-completions): {chat['metrics']}; answers "
          f"{[s['filtered_resps'][0] for s in chat['samples']]}")
    print(f"  loglikelihood vs mlx-lm: max |delta| per continuation token {worst:.2e} (bound {TOL_PER_TOKEN}); "
          f"greedy flags agree: {greedy_agree}")
    ok = worst < TOL_PER_TOKEN and greedy_agree and len(gen["samples"]) == len(chat["samples"]) == len(GEN)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def _model_id(srv: LocalServer) -> str:
    import httpx

    r = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": f"Bearer {srv.token}"}, timeout=30)
    return r.json()["data"][0]["id"]


if __name__ == "__main__":
    sys.exit(main())
