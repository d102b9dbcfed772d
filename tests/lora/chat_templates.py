"""The real chat templates of the model families dtrain's chat data is tested with, and tokenizers
built here that carry them (a BPE on a small word list plus the family's special tokens).

Templates are model data, read as their projects publish them (files in tests/lora/templates/):
- llama3.1: meta-llama Llama-3.1-8B-Instruct's (the same text Llama-3.3-70B-Instruct ships), as
  vendored in llama.cpp's models/templates/meta-llama-Llama-3.3-70B-Instruct.jinja
  (github.com/ye-NX/llama.cpp, commit b354d7c9);
- qwen2.5: Qwen2.5-Instruct's, as vendored in axolotl's src/axolotl/utils/chat_templates/templates/
  qwen_25.jinja (github.com/axolotl-ai-cloud/axolotl, commit 63f31869);
- qwen3: Qwen3's (reasoning kept only after the last user query, `<think>` blocks), llama.cpp's
  models/templates/Qwen-Qwen3-0.6B.jinja (github.com/ye-NX/llama.cpp, commit b354d7c9);
- mistral-v0.3: Mistral-7B-Instruct-v0.3's (tools; the system prompt goes into the last user turn),
  as a public project vendors it for llama.cpp (code search, "Mistral Instruct v0.3 chat template
  with native tool calling support"); Mistral's cookbook (mistralai/cookbook, concept-deep-dive/
  tokenization/chat_templates.md) documents the same placement for tokenizers V2/V3;
- mistral-v0.1: Mistral-7B-Instruct-v0.1's, which refuses any role but user/assistant (and so a
  system message), as public projects' tables of known tokenizer configs carry it under
  "mistralai/Mistral-7B-Instruct-v0.1" (code search);
- gemma2: gemma-2-2b-it's ("System role not supported"), llama.cpp's models/templates/
  google-gemma-2-2b-it.jinja (github.com/ye-NX/llama.cpp, commit b354d7c9);
- gemma3: Gemma 3's (system prompt folded into the first user turn, list content), axolotl's
  templates/gemma3.jinja (commit 1377ccc3).
"""

from __future__ import annotations

import dataclasses
from functools import cache
from pathlib import Path
from typing import Any

from lora.sft_fixtures import make_tokenizer

HERE = Path(__file__).parent / "templates"


@dataclasses.dataclass(frozen=True)
class Family:
    template: str  # file under templates/
    specials: tuple[str, ...]
    bos: str | None
    eos: str


FAMILIES = {
    "llama3.1": Family(
        "llama3.1.jinja",
        ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"),
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "qwen2.5": Family("qwen2.5.jinja", ("<|im_start|>", "<|im_end|>"), None, "<|im_end|>"),
    "qwen3": Family("qwen3.jinja", ("<|im_start|>", "<|im_end|>", "<think>", "</think>"), None, "<|im_end|>"),
    "mistral-v0.3": Family("mistral-v0.3.jinja", ("[INST]", "[/INST]"), "<s>", "</s>"),
    "mistral-v0.1": Family("mistral-v0.1.jinja", ("[INST]", "[/INST]"), "<s>", "</s>"),
    "gemma2": Family("gemma2.jinja", ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<eos>"),
    "gemma3": Family("gemma3.jinja", ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<eos>"),
}


@cache
def family_tokenizer(name: str) -> Any:
    """dtrain's tokenizer wrapper around a tokenizer with `name`'s real template and special tokens."""
    from dtrain.lora.model import HFTokenizer

    f = FAMILIES[name]
    tok = make_tokenizer(chat_template=(HERE / f.template).read_text(), specials=list(f.specials), bos=f.bos, eos=f.eos)
    return HFTokenizer(tok)
