"""Chat data through the real chat templates of Llama-3.1, Qwen2.5, Qwen3, Mistral v0.1/v0.3 and
Gemma 2/3 (tests/lora/chat_templates.py, each with its source), on tokenizers built here: which
tokens train, for templates that rewrite history (Qwen3's reasoning, Mistral's system prompt), the
message fields the templates read (tool_calls, reasoning_content, name, list content), ShareGPT's
records, and the one-line refusals (a template that raises, a record without messages)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

from dtrain.common.errors import UserError  # noqa: E402
from dtrain.lora import sft  # noqa: E402
from dtrain.lora.config import DataFormat  # noqa: E402
from dtrain.lora.data import read_rows  # noqa: E402
from lora.chat_templates import FAMILIES, family_tokenizer  # noqa: E402
from lora.sft_fixtures import write  # noqa: E402

SYSTEM = {"role": "system", "content": "be brief"}
Q1, A1 = {"role": "user", "content": "why is the cat red"}, {"role": "assistant", "content": "the cat sat on a mat"}
Q2, A2 = {"role": "user", "content": "how big is the dog"}, {"role": "assistant", "content": "a big dog"}

# What each template writes for an assistant turn: the trained text of A1 as a last turn.
TURN = {
    "llama3.1": "the cat sat on a mat<|eot_id|>",
    "qwen2.5": "the cat sat on a mat<|im_end|>\n",
    "qwen3": "the cat sat on a mat<|im_end|>\n",  # the empty <think></think> before it is not trained
    "mistral-v0.3": " the cat sat on a mat</s>",
    "mistral-v0.1": "the cat sat on a mat</s> ",
    "gemma2": "the cat sat on a mat<end_of_turn>\n",
    "gemma3": "the cat sat on a mat<end_of_turn>\n",
}


def cfg(**kw):
    base = dict(format=DataFormat.AUTO, text_field="text", prompt_field="", input_field="", completion_field="",
                messages_field="messages", train_on_all=False, seq_len=512, data="d", eval_data="")  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def encode(family: str, *records: dict, train_on_all: bool = False, seq_len: int = 512) -> list[sft.Example]:
    rows = [(f"c.jsonl:{n}", r) for n, r in enumerate(records, 1)]
    tok = family_tokenizer(family)
    return sft.encode(tok, rows, sft.resolve_fields(rows, cfg()), train_on_all, seq_len).examples


def text(family: str, ex: sft.Example) -> str:
    return family_tokenizer(family).tok.decode(ex.ids)


def trained(family: str, ex: sft.Example) -> list[str]:
    """The decoded runs of trained tokens."""
    tok, spans, cur = family_tokenizer(family).tok, [], []
    for i, lab in zip(ex.ids, ex.labels, strict=True):
        if lab != sft.IGNORE:
            cur.append(i)
        elif cur:
            spans, cur = [*spans, tok.decode(cur)], []
    return spans + ([tok.decode(cur)] if cur else [])


def refusal(family: str, *records: dict) -> str:
    with pytest.raises(UserError) as e:
        encode(family, *records)
    line = str(e.value)
    assert "\n" not in line
    return line


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_assistant_turn_trains_with_its_end_of_turn(family):
    """Two turns, no system message: every family trains both replies and nothing else. Templates
    that render history as a growing prefix give one example; Qwen3 (which drops the empty think
    block of earlier turns) gives one per reply."""
    examples = encode(family, {"messages": [Q1, A1, Q2, A2]})
    spans = [s for ex in examples for s in trained(family, ex)]
    second = TURN[family].replace(A1["content"], A2["content"])
    assert spans == [TURN[family], second]
    assert len(examples) == (2 if family == "qwen3" else 1)
    last = text(family, examples[-1])
    assert Q1["content"] in last and Q2["content"] in last  # the reply sees the conversation before it


def test_mistral_v03_trains_a_system_message_where_its_template_puts_it():
    """Mistral v0.3 writes the system prompt into the last user turn, so it is in the prompt of the
    turn being generated: each reply is an example with the system prompt before its own question,
    and --train-on-all keeps it too (it used to train the render that has no system prompt)."""
    (single,) = encode("mistral-v0.3", {"messages": [SYSTEM, Q1, A1]})
    assert text("mistral-v0.3", single) == "<s>[INST] be brief\n\nwhy is the cat red[/INST] the cat sat on a mat</s>"
    assert trained("mistral-v0.3", single) == [" the cat sat on a mat</s>"]
    first, second = encode("mistral-v0.3", {"messages": [SYSTEM, Q1, A1, Q2, A2]})
    assert text("mistral-v0.3", first) == text("mistral-v0.3", single)
    assert text("mistral-v0.3", second) == (
        "<s>[INST] why is the cat red[/INST] the cat sat on a mat</s>[INST] be brief\n\nhow big is the dog[/INST] "
        "a big dog</s>"
    )
    assert trained("mistral-v0.3", second) == [" a big dog</s>"]
    (whole,) = encode("mistral-v0.3", {"messages": [SYSTEM, Q1, A1]}, train_on_all=True)
    assert "be brief" in text("mistral-v0.3", whole)
    assert all(lab != sft.IGNORE for lab in whole.labels[1:])


def test_mistral_v01_refuses_a_system_message_in_one_line():
    line = refusal("mistral-v0.1", {"messages": [SYSTEM, Q1, A1]})
    assert line == (
        "c.jsonl:1: the model's chat template refuses this conversation: Conversation roles must alternate "
        "user/assistant/user/assistant/...; fix the record or drop it"
    )


@pytest.mark.parametrize(
    ("family", "messages", "message"),
    [
        ("gemma2", [SYSTEM, Q1, A1], "System role not supported"),
        ("gemma3", [Q1, Q2, A1], "Conversation roles must alternate user/assistant/user/assistant/..."),
        ("llama3.1", [Q1, {"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": {}}}] * 2}],
         "This model only supports single tool-calls at once!"),
    ],
)  # fmt: skip
def test_a_template_that_raises_is_one_line_naming_the_record(family, messages, message):
    line = refusal(family, {"messages": [Q1, A1]}, {"messages": messages})
    assert (
        line == f"c.jsonl:2: the model's chat template refuses this conversation: {message}; fix the record or drop it"
    )


def test_qwen3_trains_reasoning_by_its_template_rules():
    """Reasoning is a target where the template renders it (the turn after the last user query), in
    `reasoning_content` or inline `<think>`; earlier turns' reasoning is dropped from later prompts,
    as the template drops it; an empty think block is never a target."""
    r1 = {**A1, "reasoning_content": "why not"}
    (single,) = encode("qwen3", {"messages": [Q1, r1]})
    assert trained("qwen3", single) == ["<think>\nwhy not\n</think>\n\nthe cat sat on a mat<|im_end|>\n"]
    inline = {"role": "assistant", "content": "<think>\nwhy not\n</think>\n\nthe cat sat on a mat"}
    assert encode("qwen3", {"messages": [Q1, inline]})[0].ids == single.ids
    first, second = encode("qwen3", {"messages": [Q1, r1, Q2, A2]})
    assert first.ids == single.ids
    assert text("qwen3", second) == (
        "<|im_start|>user\nwhy is the cat red<|im_end|>\n<|im_start|>assistant\nthe cat sat on a mat<|im_end|>\n"
        "<|im_start|>user\nhow big is the dog<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\na big dog"
        "<|im_end|>\n"
    )
    assert trained("qwen3", second) == ["a big dog<|im_end|>\n"]


def test_tool_calls_and_tool_results_reach_the_template():
    weather = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    call = {"role": "assistant", "content": None, "tool_calls": [weather]}
    result = {"role": "tool", "content": "red"}
    msgs = [Q1, call, result, A1]
    (qwen,) = encode("qwen2.5", {"messages": msgs})
    assert trained("qwen2.5", qwen) == [
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n',
        TURN["qwen2.5"],
    ]
    assert "<tool_response>\nred\n</tool_response>" in text("qwen2.5", qwen)
    (llama,) = encode("llama3.1", {"messages": msgs})
    assert trained("llama3.1", llama)[0] == '{"name": "weather", "parameters": {"city": "Oslo"}}<|eot_id|>'
    # Llama-3.1's template writes a tool result through tojson (a string is iterable to Jinja).
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"red"<|eot_id|>' in text("llama3.1", llama)


def test_name_reaches_a_template_that_reads_it():
    from dtrain.lora.model import HFTokenizer
    from lora.sft_fixtures import make_tokenizer

    named = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m.name ~ ': ' if m.name }}{{ m['content'] }}<|end|>{% endfor %}"
    )
    tok = HFTokenizer(make_tokenizer(chat_template=named + "{% if add_generation_prompt %}<|assistant|>{% endif %}"))
    rows = [("c.jsonl:1", {"messages": [{**Q1, "name": "dog"}, A1]})]
    (ex,) = sft.encode(tok, rows, sft.resolve_fields(rows, cfg()), False, 128).examples
    assert tok.tok.decode(ex.ids).startswith("<|user|>dog: why is the cat red")


def test_list_content_reaches_a_template_that_reads_it_and_is_joined_for_one_that_does_not():
    parts = {"role": "user", "content": [{"type": "text", "text": "why is "}, {"type": "text", "text": "the cat red"}]}
    for family in ("gemma3", "qwen2.5"):  # Gemma 3 reads the parts; Qwen2.5 concatenates strings
        (ex,) = encode(family, {"messages": [parts, A1]})
        (plain,) = encode(family, {"messages": [{"role": "user", "content": "why is the cat red"}, A1]})
        if family == "qwen2.5":
            assert ex.ids == plain.ids
        else:  # Gemma 3 trims each part
            assert "<start_of_turn>user\nwhy isthe cat red<end_of_turn>" in text(family, ex)
    image = {"role": "user", "content": [{"type": "image", "url": "x.png"}]}
    assert refusal("gemma3", {"messages": [image, A1]}) == (
        "c.jsonl:1: messages[0] has a content part of type 'image': dtrain trains on text, so content is a string "
        "or a list of {type: text, text} parts"
    )


def test_sharegpt_records_are_read_as_messages():
    share = {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": Q1["content"]},
                               {"from": "gpt", "value": A1["content"]}]}  # fmt: skip
    for family in ("llama3.1", "mistral-v0.3"):
        assert [e.ids for e in encode(family, share)] == [e.ids for e in encode(family, {"messages": [SYSTEM, Q1, A1]})]
    odd = {"conversations": [{"from": "narrator", "value": "once"}]}
    assert refusal("llama3.1", odd) == (
        "c.jsonl:1: conversations[0]: ShareGPT speaker 'narrator' is not one of human, user, gpt, assistant, system, "
        "tool; rename it in the data"
    )


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"messages": [Q1, A1], "other": 1}, None),
        ({"messages": []}, "field 'messages' must be a list of messages ({role, content} or ShareGPT's {from, value}), "
                           "got an empty list; fix or drop the record"),
        ({"messages": None}, "field 'messages' must be a list of messages ({role, content} or ShareGPT's "
                             "{from, value}), got nothing; fix or drop the record"),
        ({"messages": [{"content": "hi"}]}, "messages[0] has no role (keys: content); a message is {role, content}"),
        ({"messages": [{"role": "user"}]}, "messages[0] (user) has no content and no tool_calls"),
        ({"text": "hi"}, "no field 'messages' for chat data (the record has: text); pass --messages-field"),
    ],
)  # fmt: skip
def test_a_record_without_messages_is_one_line(record, message):
    if message is None:
        assert encode("gemma2", record)
        return
    with pytest.raises(UserError) as e:
        encode("gemma2", {"messages": [Q1, A1]}, record)
    assert str(e.value) == f"c.jsonl:2: {message}"


def test_columnar_files_leave_out_the_keys_a_message_does_not_have(tmp_path):
    """Parquet gives every message every key (None where absent); Llama-3.1's template takes any
    message with a `tool_calls` key for a tool call, so the Nones must not reach it."""
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": "{}"}}]}  # fmt: skip
    records = [{"messages": [Q1, call, {"role": "tool", "content": "red"}, A1]}, {"messages": [Q2, A2]}]
    rows = read_rows(str(write(records, tmp_path / "c.parquet")), "text")
    tok = family_tokenizer("llama3.1")
    _, plain = sft.encode(tok, rows, sft.resolve_fields(rows, cfg()), False, 512).examples
    assert trained("llama3.1", plain) == ["a big dog<|eot_id|>"]


def test_cut_examples_are_counted_with_the_longest():
    rows = [(f"c.jsonl:{n}", {"messages": [Q1, {**A1, "content": " ".join([A1["content"]] * n)}]}) for n in (1, 8)]
    enc = sft.encode(family_tokenizer("gemma2"), rows, sft.resolve_fields(rows, cfg()), False, 40)
    assert (enc.total, enc.truncated) == (2, 1)
    notice = sft.dropped_notice(enc, 40)
    assert notice == (
        f"cut 1 of 2 example(s) (50%) longer than --seq-len 40 to 40 tokens (the longest has {enc.longest}); "
        "raise --seq-len to keep them whole"
    )
    assert enc.longest > 40
    assert json.dumps(notice)


def test_the_default_seq_len_fits_chat_data_and_keeps_plain_text_blocks(tmp_path):
    """--seq-len unset: 2048 tokens for instruction/chat data (256 cut most chat examples short), 256
    for plain text (a small corpus still makes two blocks); settled once the data's format is known."""
    from dtrain.lora.config import LoraConfig
    from dtrain.lora.train import read_data

    chat = write([{"messages": [Q1, A1]}] * 2, tmp_path / "c.jsonl")
    (tmp_path / "t.txt").write_text("the cat sat on a mat\n" * 20)
    for data, want in ((chat, 2048), (tmp_path / "t.txt", 256)):
        cfg = LoraConfig(model="tiny-llama", data=str(data))
        assert cfg.seq_len == 0
        read_data(cfg)
        assert cfg.seq_len == want
    given = LoraConfig(model="tiny-llama", data=str(chat), seq_len=96)
    read_data(given)
    assert given.seq_len == 96


def template_model(family: str, untrained: tuple[str, ...] = (), scale: float = 0.0):
    """A tiny Llama with `family`'s tokenizer; the rows of `untrained` set to `scale` (never trained)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = family_tokenizer(family)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok.tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for t in untrained:
            model.get_input_embeddings().weight[tok.tok.convert_tokens_to_ids(t)] = scale
    return model, tok


@pytest.mark.parametrize("scale", [0.0, 1e-20])
def test_a_base_model_whose_template_tokens_were_never_trained_is_refused(scale):
    headers = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    model, tok = template_model("llama3.1", headers, scale)
    with pytest.raises(UserError) as e:
        sft.refuse_untrained_template_tokens(model, tok, "meta-llama/Llama-3.1-8B")
    assert str(e.value) == (
        "meta-llama/Llama-3.1-8B: the chat template's tokens <|start_header_id|>, <|end_header_id|>, <|eot_id|> have "
        "embedding rows that were never trained (a base model with an instruct template), and LoRA cannot train "
        "them: fine-tune the instruct model the template belongs to (e.g. ...-Instruct), or give the base model "
        "data without the template (--format text, each conversation written out as plain text)"
    )
    for family in ("llama3.1", "qwen3", "gemma3"):  # trained rows (random here, as a trained model's are) pass
        sft.refuse_untrained_template_tokens(*template_model(family), family)
    # A row that is not one of the template's tokens is not the template's business.
    sft.refuse_untrained_template_tokens(*template_model("llama3.1", ("<|eom_id|>",)), "m")


def test_a_template_error_in_a_run_is_one_line_exit_2_and_no_run(tmp_path):
    """Through the CLI: Gemma 2's template refuses the system message of record 2; one line, exit 2,
    nothing left under runs/."""
    from runs import cli

    from dtrain.common.errors import ExitCode
    from lora.sft_fixtures import make_model_dir

    model = make_model_dir(tmp_path / "m", family_tokenizer("gemma2").tok)
    data = write([{"messages": [Q1, A1]}, {"messages": [SYSTEM, Q1, A1]}], tmp_path / "c.jsonl")
    r = cli(tmp_path, "train", "lora", "--model", str(model), "--data", str(data), "--max-steps", "1",
            "--nproc", "1", "--output", "runs")  # fmt: skip
    assert r.code == ExitCode.USAGE, r.err[-2000:]
    assert r.error_line() == (
        f"error: {data}:2: the model's chat template refuses this conversation: System role not supported; fix the "
        "record or drop it"
    )
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())
