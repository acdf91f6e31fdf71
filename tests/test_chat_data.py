"""Chat and prompt/completion data: `tpud prepare --format chat|prompt-completion`, its loss masks
and packed windows, and training and evaluation on them.

The tokenizer is trained here with ChatML's special tokens; its template is the tokenizer's
own (tokenizer_config.json), as a model directory from the hub ships it.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch

from engine.data import manifest as mf
from engine.prepare import tokenizer as tk
from engine.data.batch import IGNORE
from engine.data.dataset import open_data
from engine.data.loader import PackedLoader
from engine.prepare.packing import Packer
from engine.prepare.pipeline import prepare
from engine.prepare.command import Options, PrepareError
from engine.data.shards import TokenStream, document_index
from engine.errors import ConfigError
from engine.spec.loader import load_spec
from engine.train import Trainer
from testkit import corpus
from tests.conftest import PYTHON, REPO, TINY_JOB, python_env
from testkit.recorders import Recorder

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' + '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' "
          "+ m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def conversations(n: int = 60) -> list[list[dict]]:
    """Multi-turn conversations of varied lengths, from the standard library's docstrings."""
    texts = corpus.docstrings(3 * n)
    out = []
    for i in range(n):
        turns = [{"role": "user", "content": f"Explain item {i}."},
                 {"role": "assistant", "content": texts[3 * i][:60]}]
        if i % 3 == 0:
            turns = [{"role": "system", "content": "Be brief."}, *turns,
                     {"role": "user", "content": "And more?"}, {"role": "assistant", "content": texts[3 * i + 1][:30]}]
        out.append(turns)
    return out


def chat_tokenizer(directory, template: str = CHATML):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(corpus.docstrings(300)), trainers.BpeTrainer(
        vocab_size=700, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}))
    return directory


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return chat_tokenizer(tmp_path_factory.mktemp("tok") / "chatml")


def prepared(tmp_path, tokenizer_dir, records, name="out", **options):
    src = write_jsonl(tmp_path / f"{name}.jsonl", records)
    opts = dict(format="chat", seq_len=127, workers=1, progress=False) | options
    manifest = prepare(Options(inputs=(src,), tokenizer=str(tokenizer_dir), out=str(tmp_path / name), **opts))
    return tmp_path / name, manifest


def documents(out, manifest, split="train"):
    """Each stored document's (ids, mask), padding included."""
    entry = manifest.splits[split]
    tokens, masks = TokenStream(out, entry).read(0, entry.tokens), TokenStream(out, entry, masks=True).read(0, entry.tokens)
    bounds = document_index(out, entry)
    return [(tokens[a:b], masks[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def test_targets_are_the_assistant_turns_with_their_end_of_turn_token_and_one_bos(tmp_path, tokenizer_dir):
    convs = conversations()
    out, manifest = prepared(tmp_path, tokenizer_dir, [{"messages": c} for c in convs])
    tok = tk.load(str(tokenizer_dir))
    decode = lambda ids: tok._backend().decode([int(i) for i in ids], skip_special_tokens=False)  # noqa: E731
    real = [(ids, mask) for ids, mask in documents(out, manifest) if ids[0] == tok.bos_id]
    assert len(real) == len(convs) == manifest.chat.conversations  # nothing dropped: all fit 128 tokens
    kept = {}
    for ids, mask in real:
        assert (ids == tok.bos_id).sum() == 1 and mask[0] == 0
        text = decode(ids)
        conv = next(c for c in convs if decode(ids[:12]) in text and c[-1]["content"] in text)
        kept[id(conv)] = conv
        trained = "".join(decode([t]) for t, m in zip(ids, mask) if m)
        assert trained == "".join(m["content"] + "<|im_end|>" for m in conv if m["role"] == "assistant")
    assert len(kept) == len(convs)
    entry = manifest.splits["train"]
    masks = TokenStream(out, entry, masks=True).read(0, entry.tokens)
    assert entry.targets == int(masks.sum()) > 0
    assert [f.tokens for f in entry.masks] == [f.tokens for f in entry.shards]


def test_a_template_that_renders_bos_keeps_exactly_one(tmp_path):
    directory = chat_tokenizer(tmp_path / "llama3", LLAMA3)
    out, manifest = prepared(tmp_path, directory, [{"messages": c} for c in conversations(20)])
    tok = tk.load(str(directory))
    eot = tok._backend().token_to_id("<|eot_id|>")
    for ids, mask in documents(out, manifest):
        if mask.any():
            assert ids[0] == tok.bos_id and (ids == tok.bos_id).sum() == 1
            assert ids[np.flatnonzero(mask)[-1]] == eot  # the turn ends trained on its end-of-turn token


def test_every_conversation_lies_in_one_window_and_padding_is_never_trained(tmp_path, tokenizer_dir):
    out, manifest = prepared(tmp_path, tokenizer_dir, [{"messages": c} for c in conversations()], shard_tokens=500)
    window = manifest.chat.window
    assert window == 128 and manifest.splits["train"].tokens % window == 0
    bounds = document_index(out, manifest.splits["train"]).astype(np.int64)
    assert all(a // window == (b - 1) // window for a, b in zip(bounds[:-1], bounds[1:]))
    padding = [(ids, mask) for ids, mask in documents(out, manifest) if ids[0] != tk.load(str(tokenizer_dir)).bos_id]
    assert sum(len(ids) for ids, _ in padding) == manifest.chat.padding_tokens > 0
    assert all(not mask.any() for _, mask in padding)
    # first fit packs tighter than a window per conversation
    assert manifest.splits["train"].tokens // window < manifest.chat.conversations


def test_the_three_formats_give_the_same_tokens_and_masks(tmp_path, tokenizer_dir):
    pairs = [(f"Question {i}: what is {i} + {i}?", f"It is {2 * i}.") for i in range(40)]
    records = {
        "messages": [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]}
                     for p, c in pairs],
        "sharegpt": [{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": c}]} for p, c in pairs],
        "completion": [{"prompt": p, "completion": c} for p, c in pairs],
    }
    results = {}
    for name, recs in records.items():
        out, manifest = prepared(tmp_path, tokenizer_dir, recs, name=name,
                                 format="prompt-completion" if name == "completion" else "chat")
        results[name] = documents(out, manifest)
    for name in ("sharegpt", "completion"):
        assert len(results[name]) == len(results["messages"])
        for (a, ma), (b, mb) in zip(results[name], results["messages"]):
            assert np.array_equal(a, b) and np.array_equal(ma, mb)


def test_parquet_conversations_give_what_jsonl_gives(tmp_path, tokenizer_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    convs = conversations(12)
    pq.write_table(pa.table({"id": list(range(len(convs))), "messages": convs}), tmp_path / "chat.parquet")
    out, manifest = prepared(tmp_path, tokenizer_dir, [{"messages": c} for c in convs], name="lines")
    from_parquet = prepare(Options(inputs=(str(tmp_path / "chat.parquet"),), tokenizer=str(tokenizer_dir),
                                   out=str(tmp_path / "pq"), format="chat", seq_len=127, workers=1, progress=False))
    assert from_parquet.chat.conversations == manifest.chat.conversations == 12
    for (a, ma), (b, mb) in zip(documents(tmp_path / "pq", from_parquet), documents(out, manifest), strict=True):
        assert np.array_equal(a, b) and np.array_equal(ma, mb)


def test_train_on_last_and_all(tmp_path, tokenizer_dir):
    convs = [c for c in conversations() if len(c) > 3]
    records = [{"messages": c} for c in convs]
    _, every = prepared(tmp_path, tokenizer_dir, records, name="every")
    _, last = prepared(tmp_path, tokenizer_dir, records, name="last", train_on="last")
    out, everything = prepared(tmp_path, tokenizer_dir, records, name="all", train_on="all")
    assert last.splits["train"].targets < every.splits["train"].targets < everything.splits["train"].targets
    padding = everything.chat.padding_tokens
    # all: every token but each conversation's first (its BOS) and the padding
    assert everything.splits["train"].targets == everything.splits["train"].tokens - padding - len(convs)


def test_overlong_conversations_are_dropped_or_truncated_and_counted(tmp_path, tokenizer_dir):
    long = [{"role": "user", "content": "Tell me everything."},
            {"role": "assistant", "content": " ".join(corpus.docstrings(40))[:3000]}]
    records = [{"messages": c} for c in conversations(10)] + [{"messages": long}]
    _, dropped = prepared(tmp_path, tokenizer_dir, records, name="drop")
    assert (dropped.chat.dropped, dropped.chat.truncated, dropped.chat.conversations) == (1, 0, 10)
    out, truncated = prepared(tmp_path, tokenizer_dir, records, name="trunc", overlong="truncate")
    assert (truncated.chat.dropped, truncated.chat.truncated, truncated.chat.conversations) == (0, 1, 11)
    assert max(len(ids) for ids, _ in documents(out, truncated)) == 128


def test_a_conversation_of_thousands_of_turns_renders_only_the_turns_a_window_can_keep(tmp_path, tokenizer_dir,
                                                                                       monkeypatch):
    from engine.prepare import chat

    renders = []
    real = chat.Template.render
    monkeypatch.setattr(chat.Template, "render", lambda self, *a, **k: renders.append(1) or real(self, *a, **k))
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(4000)]
    records = [{"messages": c} for c in conversations(3)] + [{"messages": turns}]
    _, manifest = prepared(tmp_path, tokenizer_dir, records, overlong="truncate")
    assert manifest.chat.truncated == 1 and manifest.chat.conversations == 4
    assert len(renders) < 600  # the turns within 64 characters a token of a 128-token window, not all 2000


def test_a_bad_conversation_is_named_or_skipped_and_counted(tmp_path, tokenizer_dir):
    records = [{"messages": c} for c in conversations(5)]
    records.insert(2, {"messages": [{"role": "user", "content": "no answer"}]})
    records.insert(4, {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]})
    with pytest.raises(PrepareError, match=r"bad\.jsonl:3: .*assistant"):
        prepared(tmp_path, tokenizer_dir, records, name="bad")
    _, manifest = prepared(tmp_path, tokenizer_dir, records, name="bad", on_error="skip")
    assert manifest.skipped.count == 2 and manifest.chat.conversations == 5
    assert any("bad.jsonl:5" in e for e in manifest.skipped.examples)


def test_a_conversation_the_template_refuses_is_named_or_skipped(tmp_path):
    strict = CHATML.replace("{% for m in messages %}", "{% for m in messages %}{% if m['role'] == 'tool' %}"
                            "{{ raise_exception('no tool turns here') }}{% endif %}")
    directory = chat_tokenizer(tmp_path / "strict", strict)
    records = [{"messages": c} for c in conversations(4)]
    records.insert(1, {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"},
                                    {"role": "assistant", "content": "ok"}]})
    with pytest.raises(PrepareError, match=r"refused\.jsonl:2: .*no tool turns here"):
        prepared(tmp_path, directory, records, name="refused", workers=2)
    _, manifest = prepared(tmp_path, directory, records, name="refused", on_error="skip")
    assert manifest.skipped.by_reason == {"bad conversation": 1} and manifest.chat.conversations == 4
    assert [(s.documents, s.skipped) for s in manifest.sources] == [(4, 1)]


def test_a_template_that_never_ends_fails_its_record_instead_of_stalling_prepare(tmp_path, monkeypatch):
    from engine.prepare import chat

    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.5)
    endless = CHATML.replace("{% for m in messages %}", "{% for m in messages %}{% if m['role'] == 'tool' %}"
                             "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                             "{% endif %}")
    directory = chat_tokenizer(tmp_path / "tok-endless", endless)
    records = [{"messages": c} for c in conversations(3)]
    records.insert(1, {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"},
                                    {"role": "assistant", "content": "ok"}]})
    _, manifest = prepared(tmp_path, directory, records, name="endless", on_error="skip")
    assert manifest.chat.conversations == 3 and manifest.skipped.count == 1
    assert "took more than 0.5 s" in manifest.skipped.examples[0] and "endless.jsonl:2" in manifest.skipped.examples[0]


def test_chat_options_are_checked_before_any_work(tmp_path, tokenizer_dir):
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": conversations(1)[0]}])
    with pytest.raises(PrepareError, match="--seq-len"):
        Options(inputs=(src,), tokenizer=str(tokenizer_dir), out=str(tmp_path / "o"), format="chat")
    with pytest.raises(PrepareError, match="train:"):
        prepare(Options(inputs=(src,), tokenizer="train:300", out=str(tmp_path / "o"), format="chat", seq_len=63))
    text = tmp_path / "t.txt"
    text.write_text("plain text")
    with pytest.raises(PrepareError, match=r"t\.txt: chat data is read from \.jsonl"):
        prepare(Options(inputs=(str(text),), tokenizer=str(tokenizer_dir), out=str(tmp_path / "o"), format="chat",
                        seq_len=63))


def test_the_bytes_tokenizer_takes_a_template_file(tmp_path):
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    out, manifest = prepared(tmp_path, "bytes", [{"messages": c} for c in conversations(6)], chat_template=str(template),
                             seq_len=511)
    for ids, mask in documents(out, manifest):
        if mask.any():
            trained = bytes(int(t) for t, m in zip(ids, mask) if m).decode()
            assert "<|im_start|>" not in trained and trained.endswith("<|im_end|>\n")


# --- training on it ---


@pytest.fixture(scope="module")
def chat_dataset(tmp_path_factory, tokenizer_dir):
    tmp = tmp_path_factory.mktemp("chat")
    out, _ = prepared(tmp, tokenizer_dir, [{"messages": c} for c in conversations(120)], seq_len=63,
                      val_fraction=0.2)
    return out


def job(dataset, *overrides):
    return load_spec(TINY_JOB, [f"data.dataset={dataset}", "model.vocab_size=704", "data.seq_len=63",
                                "train.mixed_precision=fp32", "model.n_layers=2", "train.max_steps=4",
                                "train.log_interval=1", "scheduler.warmup_steps=1", "checkpoint.interval_steps=100",
                                *overrides])


def test_batches_leave_the_prompts_out_of_the_loss(chat_dataset, tmp_path):
    data = open_data(job(chat_dataset, "data.document_mask=true").data, seed=0, cache_root=tmp_path, vocab_size=704)
    assert data.train.masked
    loader = PackedLoader(data.train, 4, 1, document_mask=True)
    batch = loader.batch(0, 0)
    masks = data.train.read("masks", np.arange(4))
    assert torch.equal(batch.targets == IGNORE, torch.from_numpy(masks[:, 1:] == 0))
    assert loader.step_targets(0) == int(masks[:, 1:].sum()) == int((batch.targets != IGNORE).sum())


def test_a_restarted_loader_reads_the_same_tokens_segments_and_masks(chat_dataset, tmp_path):
    spec = job(chat_dataset, "data.document_mask=true")
    picks = np.array([10**9, 5, 0, 77])
    first, again = (open_data(spec.data, seed=3, cache_root=tmp_path, vocab_size=704) for _ in range(2))
    for what in ("rows", "segments", "masks"):
        assert np.array_equal(first.train.read(what, picks), again.train.read(what, picks[::-1])[::-1])
    loaders = [PackedLoader(data.train, 2, 3, seed=3, document_mask=True) for data in (first, again)]
    for step in (0, 7, 10**6):
        for micro in range(3):
            assert loaders[0].batch(step, micro) == loaders[1].batch(step, micro)
            assert loaders[0].loss_weight(step, micro) == loaders[1].loss_weight(step, micro)


def test_a_job_whose_seq_len_is_not_the_packing_is_refused(chat_dataset, tmp_path):
    with pytest.raises(ConfigError, match=r"data\.seq_len.*set data\.seq_len to 63"):
        open_data(job(chat_dataset, "data.seq_len=64").data, seed=0, cache_root=tmp_path, vocab_size=704)


def test_tpud_validate_names_a_seq_len_that_is_not_the_packing(chat_dataset, tmp_path, capsys):
    from tpud.cli import main

    job_file = tmp_path / "sft.yaml"
    job_file.write_text(f"name: sft\ninclude: {TINY_JOB}\nmodel: {{vocab_size: 704}}\n"
                        f"data: {{dataset: {chat_dataset}, seq_len: 64}}\n")
    assert main(["validate", str(job_file)]) == 1
    assert "set data.seq_len to 63" in capsys.readouterr().err
    assert main(["validate", str(job_file), "--set", "data.seq_len=63"]) == 0


def test_gradient_accumulation_over_masked_targets_is_one_large_batch(chat_dataset, tmp_path):
    grads = {}
    for accum, size in ((4, 2), (1, 8)):
        trainer = Trainer(job(chat_dataset, f"train.grad_accum_steps={accum}", f"data.micro_batch_size={size}",
                              "data.document_mask=true"), tmp_path / str(accum), Recorder())
        for _ in range(accum):
            trainer.micro_batch()
        grads[accum] = [p.grad.clone() for p in trainer.model.parameters()]
        if accum == 4:
            counts = trainer.loader._target_counts(0)[:, 0]
            assert len(set(counts.tolist())) > 1, counts
        trainer.batches.close()
        trainer.checkpointer.close()
    for split, whole in zip(grads[4], grads[1]):
        assert (split - whole).abs().max() <= 1e-6 * whole.abs().max()


def test_eval_is_the_mean_over_the_masked_targets(chat_dataset, tmp_path):
    trainer = Trainer(job(chat_dataset, "eval.interval_steps=2", "eval.batches=3", "data.micro_batch_size=2"),
                      tmp_path, Recorder())
    result = trainer.evaluator.run(0)
    total = count = 0.0
    means = []
    with torch.no_grad():
        for index in range(3):
            batch = trainer.evaluator.batches.rows(index)
            loss = trainer.module(batch.inputs, batch.targets, batch.segments, batch.positions)[0].item()
            n = int((batch.targets != IGNORE).sum())
            total, count = total + loss * n, count + n
            means.append(loss)
    assert result.loss == pytest.approx(total / count, rel=1e-5)
    # The batches hold different numbers of targets, so a mean of their means would differ.
    assert abs(sum(means) / 3 - total / count) > 1e-4
    trainer.batches.close()
    trainer.checkpointer.close()


def test_tpud_prepare_help_explains_chat_options():
    result = subprocess.run([PYTHON, "-m", "tpud", "prepare", "--help"], capture_output=True, text=True, cwd=REPO,
                            env=python_env())
    assert result.returncode == 0
    for option in ("--format", "--chat-template", "--train-on", "--seq-len", "--overlong"):
        assert option in result.stdout


def test_packer_first_fit_fills_earlier_windows():
    packer = Packer(10, pad_id=0)
    ids = lambda n: np.arange(1, n + 1, dtype=np.uint32)  # noqa: E731
    ones = lambda n: np.ones(n, dtype=np.uint8)  # noqa: E731
    assert packer.add(ids(6), ones(6)) == []
    assert packer.add(ids(7), ones(7)) == []  # does not fit the first: a second window
    full = packer.add(ids(4), ones(4))  # fits the first exactly: written at once
    assert len(full) == 1 and full[0][2].tolist() == [6, 4]
    rest = packer.finish()
    assert len(rest) == 1 and rest[0][2].tolist() == [7, 3] and rest[0][1][7:].sum() == 0
    assert packer.padding == 3


# --- the README's worked example, small: fine-tune a published model on chat data, export it ---


@pytest.mark.in_process
def test_fine_tuning_a_hub_model_on_chat_data_exports_a_model_transformers_chats_with(tmp_path):
    import transformers

    from engine.hf.export import export

    model_dir = tmp_path / "model"
    bpe = chat_tokenizer(tmp_path / "tok")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bpe / "tokenizer.json"), bos_token="<s>",
                                                     eos_token="<|im_end|>", pad_token="</s>")
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(model_dir)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=160,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    convs = conversations(80)
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in convs])
    prepare(Options(inputs=(src,), tokenizer=str(model_dir), out=str(tmp_path / "data"), format="chat", seq_len=127,
                    workers=1, progress=False))
    spec = load_spec(TINY_JOB, [f"model={json.dumps({'init_from': str(model_dir)})}", f"data.dataset={tmp_path / 'data'}",
                                "data.seq_len=127", "data.micro_batch_size=4", "data.document_mask=true",
                                "train.max_steps=3", "train.mixed_precision=fp32", "scheduler.warmup_steps=1",
                                "checkpoint.interval_steps=3"])
    trainer = Trainer(spec, tmp_path / "state", Recorder())
    assert trainer.run() == 0
    step = tmp_path / "state" / "checkpoints" / spec.name / "step_000000003"
    export(spec, step, tmp_path / "out", dtype="fp32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    prompt = loaded.apply_chat_template(convs[1][:1], add_generation_prompt=True, tokenize=False)
    assert prompt == f"<|im_start|>user\n{convs[1][0]['content']}<|im_end|>\n<|im_start|>assistant\n"
    ids = torch.tensor([loaded(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        ours = trainer.model.logits(trainer.model(ids))
        assert (ours - theirs(ids).logits).abs().max().item() < 1e-4
