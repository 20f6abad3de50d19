"""A tiny model per mlx-lm tool format, for the tool-format tests.

One small Llama weight set, and per format a tokenizer whose special tokens are that format's markers and a
ChatML-shaped template that renders tools, past calls (in the format) and results: mlx-lm infers each parser
from the template (or the vocabulary: kimi_k3), as it does for the real models (laguna is named in
tokenizer_config, as its converted checkpoints do).
"""

from __future__ import annotations

import json
from pathlib import Path

from .fixtures import GEMMA4_TOOL_SPECIALS, GEMMA4_TOOLS_TEMPLATE, _llama_config, _mkdir, _random_weights, _save, \
    build_tokenizer


def _calls(body: str) -> str:
    """A template fragment writing each of an assistant turn's calls (`name`, `args`: a mapping) with `body`."""
    return ("{% for c in m['tool_calls'] %}{% set name = c['function']['name'] %}"
            "{% set args = c['function']['arguments'] %}" + body + "{% endfor %}")


def _each_arg(body: str) -> str:
    return "{% for k, v in args.items() %}" + body + "{% endfor %}"


RAW = "{{ v if v is string else v | tojson }}"
TOOL_FORMATS: dict[str, tuple[tuple[str, ...], str]] = {  # format -> (its special tokens, how a call is written)
    "json_tools": (("<tool_call>", "</tool_call>"), _calls(
        '{# tool_call.name #}<tool_call>\n{"name": "{{ name }}", "arguments": {{ args | tojson }}}\n</tool_call>')),
    "qwen3_coder": (("<tool_call>", "</tool_call>"), _calls(
        "<tool_call>\n<function={{ name }}>\n" + _each_arg("<parameter={{ k }}>\n" + RAW + "\n</parameter>\n")
        + "</function>\n</tool_call>")),
    "pythonic": (("<|tool_call_start|>", "<|tool_call_end|>"), _calls(
        "<|tool_call_start|>[{{ name }}(" + _each_arg("{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}")
        + ")]<|tool_call_end|>")),
    "kimi_k2": (("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                 "<|tool_call_argument_begin|>", "<|tool_call_end|>"),
                "<|tool_calls_section_begin|>" + _calls(
                    "<|tool_call_begin|>functions.{{ name }}:{{ loop.index0 }}<|tool_call_argument_begin|>"
                    "{{ args | tojson }}<|tool_call_end|>") + "<|tool_calls_section_end|>"),
    "kimi_k3": (("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"),
                "<|open|>tools<|sep|>" + _calls(
                    '<|open|>call tool="{{ name }}" index="{{ loop.index }}"<|sep|><|open|>json type="object"<|sep|>'
                    "{{ args | tojson }}<|close|>json<|sep|><|close|>call<|sep|>") + "<|close|>tools<|sep|>"),
    "mistral": (("[TOOL_CALLS]", "[ARGS]"), _calls("[TOOL_CALLS]{{ name }}[ARGS]{{ args | tojson }}")),
    "minimax_m2": (("<minimax:tool_call>", "</minimax:tool_call>"), "<minimax:tool_call>\n" + _calls(
        '<invoke name="{{ name }}">\n' + _each_arg('<parameter name="{{ k }}">' + RAW + "</parameter>\n")
        + "</invoke>\n") + "</minimax:tool_call>"),
    "function_gemma": (("<start_function_call>", "<end_function_call>", "<escape>"), _calls(
        "<start_function_call>call:{{ name }}{{ '{' }}" + _each_arg(
            "{{ k }}:{% if v is string %}<escape>{{ v }}<escape>{% else %}{{ v | tojson }}{% endif %}"
            "{% if not loop.last %},{% endif %}") + "}<end_function_call>")),
    "glm47": (("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"), _calls(
        "<tool_call>{{ name }}" + _each_arg("<arg_key>{{ k }}</arg_key><arg_value>" + RAW + "</arg_value>")
        + "</tool_call>")),
    "longcat": (("<longcat_tool_call>", "</longcat_tool_call>", "<longcat_arg_key>", "</longcat_arg_key>",
                 "<longcat_arg_value>", "</longcat_arg_value>"), _calls(
        "<longcat_tool_call>{{ name }}" + _each_arg(
            "<longcat_arg_key>{{ k }}</longcat_arg_key><longcat_arg_value>" + RAW + "</longcat_arg_value>")
        + "</longcat_tool_call>")),
    "minicpm5": ((), _calls('<function name="{{ name }}">' + _each_arg('<param name="{{ k }}">' + RAW + "</param>")
                            + "</function>")),
    "muse_spark": (("<atem:function_calls>", "</atem:function_calls>"), "<atem:function_calls>" + _calls(
        '<atem:invoke name="{{ name }}">' + _each_arg('<atem:parameter name="{{ k }}">{{ v | tojson }}'
                                                      "</atem:parameter>") + "</atem:invoke>")
        + "</atem:function_calls>"),
}
TOOL_FORMATS["laguna"] = TOOL_FORMATS["glm47"]


def tool_format_template(calls: str) -> str:
    """ChatML with tools (listed in a system turn), past calls written by `calls`, and tool results."""
    return (
        "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m.get('tool_calls') %}" + calls + "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def make_tool_format(out: Path, fmt: str, weights: Path | None = None) -> None:
    """A tiny Llama whose tokenizer and template carry mlx-lm's tool format `fmt` (a key of TOOL_FORMATS, or
    gemma4). `weights`: a directory whose model.safetensors to share (the same for every format)."""
    if fmt == "gemma4":
        specials, template = GEMMA4_TOOL_SPECIALS, GEMMA4_TOOLS_TEMPLATE
    else:
        specials, calls = TOOL_FORMATS[fmt]
        template = tool_format_template(calls)
    ids = build_tokenizer(_mkdir(out), 512, template, "<|im_end|>", add_bos=False, extra_specials=specials)
    if fmt == "laguna":  # its template is GLM 4.7's: converted checkpoints name the parser
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps(cfg | {"tool_parser_type": "laguna"}, indent=2))
    config = _llama_config(ids, 512, 64, 2)
    if weights is not None and (weights / "model.safetensors").exists():
        (out / "config.json").write_text(json.dumps(config, indent=2))
        (out / "model.safetensors").write_bytes((weights / "model.safetensors").read_bytes())
    else:
        _save(out, config, _random_weights(config, seed=8))
