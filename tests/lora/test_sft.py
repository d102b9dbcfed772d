"""Supervised fine-tuning data (dtrain.lora.sft), in this process: the loss falls only on assistant
turns and completions; packed documents do not see each other (Llama, Qwen2 and Mistral shapes built
from configs here); every file format loads the same records; bad data is refused in one line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("peft", reason="needs the lora extra: pip install -e .[lora]")

from dtrain.common.errors import UserError  # noqa: E402
from dtrain.lora import sft  # noqa: E402
from dtrain.lora.config import DataFormat  # noqa: E402
from dtrain.lora.data import read_rows  # noqa: E402
from dtrain.lora.model import ByteTokenizer, HFTokenizer  # noqa: E402
from lora.sft_fixtures import alpaca_records, chat_records, make_tokenizer, write  # noqa: E402


def cfg(**kw):
    base = dict(format=DataFormat.AUTO, text_field="text", prompt_field="", input_field="", completion_field="",
                messages_field="messages", train_on_all=False, seq_len=256, data="d", eval_data="")  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture(scope="module")
def tok():
    return HFTokenizer(make_tokenizer())


def trained_spans(tokenizer, ex) -> list[str]:
    """The decoded runs of trained tokens."""
    spans, cur = [], []
    for i, lab in zip(ex.ids, ex.labels, strict=True):
        if lab != sft.IGNORE:
            cur.append(i)
        elif cur:
            spans.append(tokenizer.tok.decode(cur))
            cur = []
    if cur:
        spans.append(tokenizer.tok.decode(cur))
    return spans


# ---------------------------------------------------------------------------------------------
# masking


def test_loss_only_on_assistant_turns(tok):
    rows = [("r", rec) for rec in chat_records(20)]
    enc = sft.encode(tok, rows, sft.resolve_fields(rows, cfg()), train_on_all=False, seq_len=256)
    assert len(enc.examples) == 20 and not enc.dropped
    for (_, rec), ex in zip(rows, enc.examples, strict=True):
        want = [m["content"] + "<|end|>" for m in rec["messages"] if m["role"] == "assistant"]
        assert trained_spans(tok, ex) == want
        # BOS comes from the template, once.
        assert ex.ids[0] == tok.tok.bos_token_id and ex.ids.count(tok.tok.bos_token_id) == 1

    # The loss the trainer takes is over exactly those tokens: forward_rows equals a hand-written
    # cross-entropy restricted to them.
    rows_t = sft.pack_rows(enc.examples[:4], 256, tok.pad_token_id, packing=True)
    torch.manual_seed(0)
    model = tiny("llama", len(tok.tok))
    loss, count = sft.forward_rows(model, rows_t)
    ex = enc.examples[0]
    logits = model(input_ids=torch.tensor([ex.ids])).logits[0]
    mask = torch.tensor(ex.labels[1:]) != sft.IGNORE
    assert count == sum(int((torch.tensor(e.labels[1:]) != sft.IGNORE).sum()) for e in enc.examples[:4])
    one = torch.nn.functional.cross_entropy(logits[:-1][mask], torch.tensor(ex.ids[1:])[mask], reduction="sum")
    alone, _ = sft.forward_rows(model, sft.pack_rows([ex], 256, tok.pad_token_id, packing=True))
    assert alone.item() == pytest.approx(one.item(), rel=1e-5)

    every = sft.encode(tok, rows, sft.resolve_fields(rows, cfg()), train_on_all=True, seq_len=256).examples[0]
    assert every.labels[0] == sft.IGNORE and every.labels[1:] == every.ids[1:]  # all but the first token


def test_instruction_data_with_and_without_a_chat_template(tok):
    rows = [("r", r) for r in alpaca_records(4)]
    f = sft.resolve_fields(rows, cfg())
    assert (f.format, f.prompt, f.input, f.completion) == (DataFormat.INSTRUCTION, "instruction", "input", "output")
    with_template = sft.encode(tok, rows, f, False, 256).examples
    assert [trained_spans(tok, e) for e in with_template] == [[r["output"] + "<|end|>"] for _, r in rows]
    # Byte tokenizer (no template): Alpaca's layout, completion and end-of-text trained.
    byte = ByteTokenizer()
    ex = sft.encode(byte, rows[1:2], f, False, 256).examples[0]
    text = bytes(i for i in ex.ids if i < 256).decode()
    r = rows[1][1]
    assert text == f"### Instruction:\n{r['instruction']}\n\n### Input:\n{r['input']}\n\n### Response:\n{r['output']}"
    trained = [i for i, lab in zip(ex.ids, ex.labels, strict=True) if lab != sft.IGNORE]
    assert trained == [*r["output"].encode(), byte.eos_token_id]


def test_bos_added_where_the_tokenizer_expects_it_and_never_doubled():
    rows = [("r", {"prompt": "the cat", "completion": " sat"})]
    f = sft.resolve_fields(rows, cfg())
    bos_tok = HFTokenizer(make_tokenizer(chat_template=None, add_bos=True))  # Llama-3-like: BOS on encode
    ex = sft.encode(bos_tok, rows, f, False, 64).examples[0]
    assert ex.ids[0] == bos_tok.tok.bos_token_id and ex.ids.count(bos_tok.tok.bos_token_id) == 1
    assert ex.ids[-1] == bos_tok.eos_token_id
    # Its template writes BOS itself: still one.
    both = make_tokenizer(add_bos=True)
    ex = sft.encode(HFTokenizer(both), rows, f, False, 64).examples[0]
    assert ex.ids.count(both.bos_token_id) == 1 and ex.ids[0] == both.bos_token_id
    # No BOS where the tokenizer adds none.
    plain = HFTokenizer(make_tokenizer(chat_template=None))
    ex = sft.encode(plain, rows, f, False, 64).examples[0]
    assert plain.tok.bos_token_id not in ex.ids


# ---------------------------------------------------------------------------------------------
# packing


def tiny(family: str, vocab: int, attn: str = "sdpa"):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    if family == "mistral":
        kw["sliding_window"] = 64
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kw), attn_implementation=attn)
    return model.eval()


@pytest.mark.parametrize(
    "family, attn", [("llama", "sdpa"), ("qwen2", "sdpa"), ("mistral", "sdpa"), ("llama", "eager")]
)
def test_packed_documents_do_not_see_each_other(tok, family, attn):
    torch.manual_seed(0)
    model = tiny(family, len(tok.tok), attn)
    rows = [("r", rec) for rec in chat_records(6, seed=1)]
    examples = sft.encode(tok, rows, sft.resolve_fields(rows, cfg()), False, 256).examples
    packed = sft.pack_rows(examples, 128, tok.pad_token_id, packing=True)
    assert packed.shape[0] < len(examples)  # several documents share a row
    with torch.no_grad():
        ids, pos = packed[:, 0], packed[:, 2].clamp(min=0)
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        at = {}
        for r in range(packed.shape[0]):  # where each example sits: restarts of the position ids
            starts = (packed[r, 2] == 0).nonzero().flatten().tolist()
            for s in starts:  # packing orders by length, so each start is matched to its example by its tokens
                k = next(k for k, ex in enumerate(examples) if packed[r, 0, s : s + len(ex.ids)].tolist() == ex.ids)
                at[k] = (r, s)
        assert len(at) == len(examples)
        for k, ex in enumerate(examples):
            r, s = at[k]
            alone = model(input_ids=torch.tensor([ex.ids]), use_cache=False).logits[0]
            got = logits[r, s : s + len(ex.ids)]
            assert (got - alone).abs().max().item() < 1e-5, (k, (got - alone).abs().max().item())
        # The same rows without restarting positions let documents attend across: the check has teeth.
        leaky = model(input_ids=ids, use_cache=False).logits
        r, s = next(v for v in at.values() if v[1] > 0)
        assert (leaky[r, s:] - logits[r, s:]).abs().max().item() > 1e-3
    assert sft.packing_isolates(model, len(tok.tok), torch.device("cpu"))[0]


def test_packing_probe_fails_for_a_kernel_that_mixes_documents(tok, monkeypatch):
    """A model that ignores position ids' restarts (as a kernel without packed-sequence support would)
    is caught, and the run turns packing off."""
    torch.manual_seed(0)
    model = tiny("llama", len(tok.tok))
    stock = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, position_ids=None, **k: stock(*a, **k))
    ok, diff = sft.packing_isolates(model, len(tok.tok), torch.device("cpu"))
    assert not ok and diff > 1e-3


def test_packing_off_gives_one_example_a_row_and_cuts_shared_padding(tok):
    rows = [("r", rec) for rec in chat_records(5)]
    examples = sft.encode(tok, rows, sft.resolve_fields(rows, cfg()), False, 256).examples
    one_each = sft.pack_rows(examples, 128, tok.pad_token_id, packing=False)
    assert one_each.shape[0] == 5
    for r, ex in enumerate(examples):
        assert one_each[r, 0, : len(ex.ids)].tolist() == ex.ids
        assert (one_each[r, 1, len(ex.ids) :] == sft.IGNORE).all() and (one_each[r, 2, len(ex.ids) :] == -1).all()


# ---------------------------------------------------------------------------------------------
# formats


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet", ".csv"])
def test_instruction_records_load_from_every_format(tmp_path, suffix):
    recs = alpaca_records(7)
    rows = read_rows(str(write(recs, tmp_path / f"data{suffix}")), "text")
    assert [r for _, r in rows] == recs
    assert sft.resolve_fields(rows, cfg()).format == DataFormat.INSTRUCTION


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_chat_records_load_as_lists_of_messages(tmp_path, suffix):
    recs = chat_records(5)
    rows = read_rows(str(write(recs, tmp_path / f"chat{suffix}")), "text")
    got = [r["messages"] for _, r in rows]
    assert [[dict(m) for m in msgs] for msgs in got] == [r["messages"] for r in recs]
    assert sft.resolve_fields(rows, cfg()).format == DataFormat.CHAT


def test_a_directory_of_mixed_files_loads_in_name_order(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    recs = alpaca_records(9)
    write(recs[:3], d / "a.json")
    write(recs[3:6], d / "b.parquet")
    write(recs[6:], d / "c.csv")
    rows = read_rows(str(d), "text")
    assert [r for _, r in rows] == recs
    assert rows[0][0] == f"{d}/a.json[0]" and rows[3][0] == f"{d}/b.parquet row 0" and rows[6][0] == f"{d}/c.csv:2"


# ---------------------------------------------------------------------------------------------
# bad data, one line each


def refusal(fn, *a) -> str:
    with pytest.raises(UserError) as e:
        fn(*a)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_a_field_that_is_not_in_the_data_names_the_fields_that_are(tmp_path):
    path = write(alpaca_records(3), tmp_path / "a.jsonl")
    rows = read_rows(str(path), "text")
    msg = refusal(sft.resolve_fields, rows, cfg(format=DataFormat.INSTRUCTION, completion_field="answer_text"))
    assert msg == (
        f"{path}:1: no field 'answer_text' for instruction data (the record has: instruction, input, output); "
        "pass --completion-field"
    )


def test_chat_data_for_a_tokenizer_without_a_chat_template(tmp_path):
    rows = [("c.jsonl:1", chat_records(1)[0])]
    msg = refusal(sft.encode, ByteTokenizer(), rows, sft.resolve_fields(rows, cfg()), False, 64)
    assert msg.startswith("c.jsonl:1: chat data (field 'messages'), but the model's tokenizer has no chat template")


def test_messages_never_become_text(tmp_path):
    """A messages column read as plain text is refused, not trained on as its Python repr."""
    from dtrain.lora.data import texts_of

    path = write(chat_records(2), tmp_path / "c.jsonl")
    msg = refusal(texts_of, read_rows(str(path), "text"), "messages")
    assert msg.startswith(f"{path}:1: field 'messages' holds a list, not text: for chat data")
    # A CSV cannot hold a list: its messages column is a string, refused as chat data.
    csv_path = tmp_path / "c.csv"
    csv_path.write_text("messages\n\"[{'role': 'user', 'content': 'hi'}]\"\n")
    rows = read_rows(str(csv_path), "text")
    msg = refusal(sft.encode, tok_for_chat(), rows, sft.resolve_fields(rows, cfg()), False, 64)
    assert msg == (
        f"{csv_path}:2: field 'messages' must be a list of messages ({{role, content}} or ShareGPT's {{from, value}}), "
        "got a str; fix or drop the record"
    )


def tok_for_chat():
    return HFTokenizer(make_tokenizer())


def test_examples_with_nothing_to_train_are_dropped_and_counted(tok):
    recs = alpaca_records(4)
    recs[1]["output"] = recs[3]["output"] = ""
    rows = [(f"a.json[{i}]", r) for i, r in enumerate(recs)]
    byte = ByteTokenizer()
    # Without a template the end-of-text still trains; an empty assistant turn has its end of turn.
    # Emptiness is judged after masking: cut the prompt past --seq-len and nothing is left.
    enc = sft.encode(byte, rows, sft.resolve_fields(rows, cfg()), False, seq_len=20)
    assert enc.dropped == ["a.json[0]", "a.json[1]", "a.json[2]", "a.json[3]"]
    c = cfg(data="a.json", seq_len=20)
    msg = refusal(sft.read_sft, c, rows, None, byte, sft.resolve_fields(rows, c))
    assert msg == (
        "--data a.json: no example has a token to train on after masking (all 4 have an empty completion or "
        "assistant turn, or lose it to --seq-len 20); first: a.json[0]"
    )
    enc = sft.encode(byte, rows, sft.resolve_fields(rows, cfg()), False, seq_len=256)
    assert not enc.dropped  # end-of-text is trained even after an empty completion
    chat = [("c[0]", {"messages": [{"role": "user", "content": "hi"}]})]  # no assistant turn at all
    enc = sft.encode(tok, chat, sft.resolve_fields(chat, cfg()), False, 256)
    assert enc.dropped == ["c[0]"]
    assert sft.dropped_notice(enc, 256).startswith("dropped 1 example(s) with no token to train on after masking")


def test_unreadable_files(tmp_path):
    bad = tmp_path / "x.parquet"
    bad.write_bytes(b"PAR1 not really")
    assert refusal(read_rows, str(bad), "text").startswith(f"{bad}: not a readable Parquet file (")
    arr = tmp_path / "x.json"
    arr.write_text('[{"a": 1}, 3]')
    assert refusal(read_rows, str(arr), "text") == f"{arr}[1]: a JSON int, not a record ({{field: value, ...}})"
    broken = tmp_path / "y.json"
    broken.write_text('[{"a": 1},')
    assert refusal(read_rows, str(broken), "text").startswith(f"{broken}: not a JSON array of records (")


def test_show_example_marks_the_trained_tokens(tok):
    rows = [("r", chat_records(1)[0])]
    ex = sft.encode(tok, rows, sft.resolve_fields(rows, cfg()), False, 256).examples[0]
    shown = sft.describe_example(tok, ex)
    msgs = rows[0][1]["messages"]
    for m in msgs:
        mark = f"⟦{m['content']}<|end|>⟧" if m["role"] == "assistant" else f"<|{m['role']}|>{m['content']}<|end|>"
        assert mark in shown
    assert json.dumps(shown)  # printable


def test_a_template_that_rewrites_earlier_turns_trains_each_turn_in_its_own_context():
    """Like Qwen3's, which drops earlier turns' reasoning: the prefix before a turn is not a prefix
    of the whole conversation. Each assistant turn becomes an example of its own, in the context the
    template renders when that turn is generated; --train-on-all trains the render for the last turn."""
    rewriting = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|assistant|>[old]<|end|>"
        "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tok = HFTokenizer(make_tokenizer(chat_template=rewriting))
    msgs = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "the cat"},
            {"role": "user", "content": "how"}, {"role": "assistant", "content": "a dog"}]  # fmt: skip
    rows = [("c.jsonl:1", {"messages": msgs})]
    f = sft.resolve_fields(rows, cfg())
    first, second = sft.encode(tok, rows, f, False, 64).examples
    assert tok.tok.decode(first.ids) == "<|user|>why<|end|><|assistant|>the cat<|end|>"
    assert trained_spans(tok, first) == ["the cat<|end|>"]
    assert (
        tok.tok.decode(second.ids)
        == "<|user|>why<|end|><|assistant|>[old]<|end|><|user|>how<|end|><|assistant|>a dog<|end|>"
    )
    assert trained_spans(tok, second) == ["a dog<|end|>"]
    assert (first.where, second.where) == ("c.jsonl:1 (assistant turn 1 of 2)", "c.jsonl:1 (assistant turn 2 of 2)")
    (whole,) = sft.encode(tok, rows, f, True, 64).examples
    assert whole.ids == second.ids


def test_a_named_field_missing_in_auto_format_is_named(tmp_path):
    path = write(alpaca_records(2), tmp_path / "a.json")
    rows = read_rows(str(path), "text")
    msg = refusal(sft.resolve_fields, rows, cfg(prompt_field="query"))
    assert msg == (
        f"{path}[0]: no field 'query' for instruction data (the record has: instruction, input, output); "
        "pass --prompt-field"
    )
