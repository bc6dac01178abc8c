"""Quantization inputs and policies on a tiny model: bad input refused with clear errors before any calibration,
calibration corpora, ModelOpt config assembly, excluded layers, the CLI."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import transformers

from camshaft import cli
from camshaft.builder.build import build_engine
from camshaft.builder.checkpoint import Checkpoint
from camshaft.builder.config import BuildConfig
from camshaft.errors import CheckpointError
from camshaft.model_config import ModelConfig
from camshaft.quantize import calibration, stdlib_corpus
from camshaft.quantize.calibration import default_corpus, load_texts
from camshaft.quantize.calibration_datasets import train_split
from camshaft.quantize.modelopt_adapter import quantize_checkpoint
from camshaft.quantize.spec import FORMATS, QuantizeError, QuantSpec, modelopt_config, resolve_group_size

from tiny_models import make_tiny_model

pytest.importorskip("modelopt.torch.quantization")

CALIB = dict(calib_size=4, calib_seq_len=64)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("quant-inputs") / "hf")


# --- bad input: clear errors, before any calibration ---


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if anything loads a model: the errors below must come first."""
    def refuse(*_a, **_k):
        raise AssertionError("the model was loaded before the input was checked")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def test_unknown_format_lists_the_formats():
    with pytest.raises(QuantizeError, match="unknown quantization format 'int3'") as info:
        QuantSpec("int3")
    for name in FORMATS:
        assert name in str(info.value)
    with pytest.raises(QuantizeError, match="unknown --kv-cache-dtype 'int4'"):
        QuantSpec("fp8", kv_cache_dtype="int4")
    with pytest.raises(QuantizeError, match="exclude is a pattern or a list of them"):  # not int's TypeError
        QuantSpec("int8_sq", exclude=5)


def test_the_format_may_be_named_as_the_cli_names_it(tiny, tmp_path, no_model_load):
    with pytest.raises(QuantizeError, match="unknown quantization format 'int3'"):  # read as QuantSpec("int3")
        quantize_checkpoint(tiny, tmp_path / "out", "int3", **CALIB)
    with pytest.raises(QuantizeError, match="spec is a QuantSpec .* or a format name, got None"):
        quantize_checkpoint(tiny, tmp_path / "out", None, **CALIB)


def test_group_size_rules(tiny, tmp_path, no_model_load):
    model = ModelConfig.from_hf_dir(tiny)
    assert resolve_group_size(QuantSpec("int4_wo"), model) == 32
    assert resolve_group_size(QuantSpec("int4_awq", group_size="32"), model) == 32
    assert resolve_group_size(QuantSpec("int8_wo"), model) is None
    with pytest.raises(QuantizeError, match="group size 64 does not divide down_proj.*=96; use --group-size 32"):
        quantize_checkpoint(tiny, tmp_path / "out", QuantSpec("int4_wo", group_size=64), **CALIB)
    with pytest.raises(QuantizeError, match="not supported"):
        QuantSpec("int4_wo", group_size=48)
    with pytest.raises(QuantizeError, match="applies only to blockwise"):
        QuantSpec("int8_wo", group_size=64)
    assert not (tmp_path / "out").exists()


def test_smollm2_dims_pick_group_64():
    smollm2 = dict(architectures=["LlamaForCausalLM"], hidden_size=576, intermediate_size=1536,
                   num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30, vocab_size=49152)
    assert resolve_group_size(QuantSpec("int4_awq"), ModelConfig.from_hf(smollm2)) == 64
    with pytest.raises(QuantizeError, match="group size 128 does not divide"):
        resolve_group_size(QuantSpec("int4_awq", group_size=128), ModelConfig.from_hf(smollm2))


def test_bad_calibration_data_is_refused_before_loading(tiny, tmp_path, no_model_load):
    spec = QuantSpec("int4_wo")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(QuantizeError, match="is empty"):
        quantize_checkpoint(tiny, tmp_path / "o", spec, calib_data=empty, **CALIB)
    with pytest.raises(QuantizeError, match="does not exist"):
        quantize_checkpoint(tiny, tmp_path / "o", spec, calib_data=tmp_path / "missing.jsonl", **CALIB)
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(QuantizeError, match="holds no"):
        quantize_checkpoint(tiny, tmp_path / "o", spec, calib_data=tmp_path / "emptydir", **CALIB)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"nope": 1}\n')
    with pytest.raises(QuantizeError, match=r"bad.jsonl:2"):
        quantize_checkpoint(tiny, tmp_path / "o", spec, calib_data=bad, **CALIB)
    for line in ("[" * 100_000, "9" * 5000):  # nested past the recursion limit; a number past Python's digits limit
        bad.write_text('{"text": "fine"}\n' + line + "\n")
        with pytest.raises(QuantizeError, match=r"bad.jsonl:2 is not valid JSON"):
            quantize_checkpoint(tiny, tmp_path / "o", spec, calib_data=bad, **CALIB)
    with pytest.raises(QuantizeError, match="--calib-size"):
        quantize_checkpoint(tiny, tmp_path / "o", spec, calib_size=0)
    for sizes in (dict(calib_size=4.5), dict(calib_size="4"), dict(calib_size=True), dict(calib_seq_len=32.0)):
        with pytest.raises(QuantizeError, match="must be an integer"):
            quantize_checkpoint(tiny, tmp_path / "o", spec, **{**CALIB, **sizes})
    with pytest.raises(QuantizeError, match="--calib-data is empty"):  # "$CALIB" unset: not every file under "."
        quantize_checkpoint(tiny, tmp_path / "o", spec, calib_data="", **CALIB)
    with pytest.raises(QuantizeError, match=f"calibration data {Path.home()}/no-such-calibration.txt does not"):
        quantize_checkpoint(tiny, tmp_path / "o", spec, calib_data="~/no-such-calibration.txt", **CALIB)
    (tmp_path / "notempty").mkdir()
    (tmp_path / "notempty" / "keep.txt").write_text("x")
    with pytest.raises(QuantizeError, match="refusing to overwrite"):
        quantize_checkpoint(tiny, tmp_path / "notempty", spec, **CALIB)


def test_another_models_tokenizer_is_refused_before_loading(tiny, tmp_path, no_model_load):
    """A vocabulary past the model's embedding: the build refuses it; calibrating would fail inside the embedding."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    copy = tmp_path / "hf"
    shutil.copytree(tiny, copy)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(500)}, unk_token="w0"))
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w1").save_pretrained(copy)
    with pytest.raises(CheckpointError, match="the tokenizer has 500 tokens but the model embeds 384"):
        quantize_checkpoint(copy, tmp_path / "o", QuantSpec("int8_wo"), **CALIB)


def test_a_full_disk_while_exporting_is_a_clear_error_and_keeps_the_previous_checkpoint(tiny, tmp_path, monkeypatch):
    from safetensors import SafetensorError

    from camshaft.quantize import modelopt_adapter

    previous = tmp_path / "q"
    quantize_checkpoint(tiny, previous, QuantSpec("int8_wo"), **CALIB)
    before = sorted(p.name for p in previous.iterdir())
    mtq, _ = modelopt_adapter.import_modelopt()

    def full(model, export_dir):
        (Path(export_dir) / "model.safetensors").write_bytes(b"\0" * 100)  # partly written
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(modelopt_adapter, "import_modelopt", lambda: (mtq, full))
    with pytest.raises(QuantizeError, match=r"writing the quantized checkpoint beside .*/q failed \(Error while "
                                            r"serializing.*No space left on device.*\); free some space there"):
        quantize_checkpoint(tiny, previous, QuantSpec("int8_wo"), **CALIB)
    assert sorted(p.name for p in previous.iterdir()) == before and not list(tmp_path.glob(".q.*"))


def test_too_little_calibration_text(tiny, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("just a few words")
    with pytest.raises(QuantizeError, match="fewer than --calib-size 4 x --calib-seq-len 64"):
        quantize_checkpoint(tiny, tmp_path / "o", QuantSpec("int4_wo"), calib_data=short, **CALIB)


def test_user_corpus_formats(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n"two"\n\n')
    (tmp_path / "README.md").write_text("---\nlicense: mit\n---\n# A dataset card\n")
    (tmp_path / "README.en.md").write_text("# The card in English\n")
    texts, source = load_texts(tmp_path)
    assert list(texts) == ["plain text", "one", "two"] and source == str(tmp_path)
    (tmp_path / "nul" / "zeros.txt").parent.mkdir()
    (tmp_path / "nul" / "zeros.txt").write_bytes(b"\x00" * 4096)  # valid UTF-8, yet no text
    with pytest.raises(QuantizeError, match="holds NUL bytes: it is binary, not text"):
        list(load_texts(tmp_path / "nul")[0])
    (tmp_path / "c.jsonl").write_text('{"body": "three"}\n')
    with pytest.raises(QuantizeError, match=r'c.jsonl:1: expected .* "text" string or "messages" list field, found '
                                            r".*c.jsonl:FIELD"):
        load_texts(tmp_path)
    texts, source = load_texts(f"{tmp_path / 'c.jsonl'}:body")
    assert list(texts) == ["three"] and source == f"{tmp_path / 'c.jsonl'}, field body"
    (tmp_path / "d.json").write_text('[{"text": "one"}, {"text": "two"}]\n')  # an array on one line: not JSONL
    with pytest.raises(QuantizeError, match="found list .a JSON array of records is not JSON Lines: write one record"):
        list(load_texts(tmp_path / "d.json")[0])
    with pytest.raises(QuantizeError, match="holds plain text, which has no column body"):
        load_texts(f"{tmp_path}:body")


def test_text_files_as_exported_read_and_a_huge_one_only_as_far_as_used(tmp_path):
    import gzip

    rows = ['{"text": "one"}', '{"text": "two \u2028 lines"}']  # ensure_ascii=False dumps hold raw U+2028
    (tmp_path / "a.JSONL").write_bytes(b"\xef\xbb\xbf" + "\r\n".join(rows).encode())  # a BOM, CRLF, upper case
    (tmp_path / "b.ndjson").write_text('{"text": "three"}\n')
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / "a-checkpoint.jsonl").write_text('{"text": "stale"}\n')
    (tmp_path / ".notes.txt").write_text("hidden")
    assert list(load_texts(tmp_path)[0]) == ["one", "two \u2028 lines", "three"]
    huge = tmp_path / "huge" / "corpus.txt"
    huge.parent.mkdir()
    huge.write_text("word " * 2_000_000)  # 10 MB
    assert [len(t) for t in load_texts(huge.parent, max_chars=5000)[0]] == [5000]
    (tmp_path / "z.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n'))
    with pytest.raises(QuantizeError, match="gzip-compressed; decompress it first"):
        load_texts(tmp_path / "z.jsonl.gz")
    (tmp_path / "keys.jsonl").write_text('{"conversation": [], "id": 1}\n')
    with pytest.raises(QuantizeError, match=r"found an object with the keys \['conversation', 'id'\]"):
        load_texts(tmp_path / "keys.jsonl")
    with pytest.raises(QuantizeError, match=r"does not exist \(nor .*nope.jsonl with the column text\)"):
        load_texts(f"{tmp_path / 'nope.jsonl'}:text")


def test_a_directory_of_splits_calibrates_on_train_and_nothing_is_read_past_what_is_used(tmp_path):
    import gzip

    pytest.importorskip("datasets")
    splits = tmp_path / "splits"
    splits.mkdir()
    for name in ("test", "train", "validation"):  # by name, test comes first
        (splits / f"{name}.jsonl").write_text(f'{{"text": "{name} row"}}\n')
    texts, source = load_texts(splits)
    assert list(texts) == ["train row"] and source == f"{splits}, split train (test, validation left out)"
    (splits / "train.jsonl").unlink()
    with pytest.raises(QuantizeError, match="holds the splits test, validation .by their file names. and no train"):
        load_texts(splits)
    for layout in (("data/train-00000-of-00001-5f3a2b1c.parquet", "data/test-00000-of-00001-0a1b.parquet"),
                   ("mydata.train.jsonl", "mydata.test.jsonl"), ("wikitext-train.arrow", "wikitext-test.arrow"),
                   ("train1.txt", "train2.txt", "val1.txt"), ("train/a.txt", "test/b.txt"),
                   ("test_corpus-train.arrow", "test_corpus-test.arrow"),  # the datasets cache: the last word
                   ("eval_prompts/train-0.parquet", "eval_prompts/test-0.parquet")):  # a dataset's splits
        kept, note = train_split(tmp_path, [tmp_path / name for name in layout])
        assert [p.name for p in kept] == [Path(n).name for n in layout if "train" in n] and "split train (" in note
    with pytest.raises(QuantizeError, match="holds a dataset's splits .test, train, by their file names. and "
                                            "LICENSE.md, which is in none of them; move it out"):
        train_split(tmp_path, [tmp_path / "train.jsonl", tmp_path / "test.jsonl", tmp_path / "LICENSE.md"])
    with pytest.raises(QuantizeError, match="LICENSE.txt, which is in none of them"):  # not read whole: test too
        train_split(tmp_path, [tmp_path / "test.jsonl", tmp_path / "validation.jsonl", tmp_path / "LICENSE.txt"])
    for names in (("intro.md", "testing.md", "api.md"), ("training-manual.md", "safety.md"),
                  ("dev-notes.md", "usage.md"), ("train", "notes.md")):  # documents, not a dataset's splits
        docs = tmp_path / "-".join(names)
        (docs / "train").mkdir(parents=True)
        for name in names:
            (docs / name).write_text(f"{name} text") if "." in name else (docs / name / "a.md").write_text("a text")
        assert len(list(load_texts(docs)[0])) == len(names) and load_texts(docs)[1] == str(docs)
    (docs / "figures.zip").write_bytes(b"PK")  # not calibration text, compressed or not
    assert len(list(load_texts(docs)[0])) == 2
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.txt").write_text("word " * 1000)
    (plain / "b.txt").write_bytes("caf\xe9".encode("latin-1"))  # never reached
    assert [len(t) for t in load_texts(plain, max_chars=100)[0]] == [100]
    (plain / "c.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n'))  # would be left out
    with pytest.raises(QuantizeError, match=r"holds compressed files \(c.jsonl.gz, ...\), which calibration does not"):
        load_texts(plain)
    (tmp_path / "typed.jsonl").write_text('{"text": 5}\n')
    with pytest.raises(QuantizeError, match=r"found an object with the keys \['text'\] \(its text field holds int\)"):
        list(load_texts(tmp_path / "typed.jsonl")[0])


def test_a_dataset_snapshot_of_splits_calibrates_on_its_train_split(datasets, tmp_path):
    snapshot = tmp_path / "wikitext"
    (snapshot / "wikitext-2-raw-v1").mkdir(parents=True)
    (snapshot / "README.md").write_text("---\nconfigs: []\n---\n# a dataset card\n")
    for name in ("test", "train", "validation"):
        datasets.Dataset.from_dict({"text": [f"{name} row"]}).to_parquet(
            snapshot / "wikitext-2-raw-v1" / f"{name}-00000-of-00001.parquet")
    texts, source = load_texts(snapshot)
    assert list(texts) == ["train row"]
    assert source == f"{snapshot}, 1 parquet file(s), split train (test, validation left out), column text"


def test_a_calibration_window_beyond_the_models_positions_is_refused_first(tiny, tmp_path):
    with pytest.raises(QuantizeError, match="--calib-seq-len 1024 exceeds the model's max_position_embeddings .512."):
        quantize_checkpoint(tiny, tmp_path / "o", QuantSpec("int8_wo"), calib_size=1, calib_seq_len=1024)


@pytest.fixture
def datasets():
    return pytest.importorskip("datasets")


ROWS = {"id": [3, 1, 2], "text": ["first row", "  ", "third row"], "lang": ["en", "en", "fr"]}


def test_save_to_disk_directory(datasets, tmp_path):
    datasets.Dataset.from_dict(ROWS).save_to_disk(tmp_path / "saved")
    texts, source = load_texts(tmp_path / "saved")
    assert list(texts) == ["first row", "third row"]  # in order, blank rows dropped
    assert source == f"{tmp_path / 'saved'}, column text"
    assert list(load_texts(f"{tmp_path / 'saved'}:lang")[0]) == ["en", "en", "fr"]
    with pytest.raises(QuantizeError, match="has no string or chat messages column id .its columns: id, text, lang"):
        load_texts(f"{tmp_path / 'saved'}:id")
    splits = datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": ["held out"]}),
                                   "train": datasets.Dataset.from_dict({"text": ["trained on"]})})
    splits.save_to_disk(tmp_path / "splits")
    texts, source = load_texts(tmp_path / "splits")
    assert list(texts) == ["trained on"] and source.endswith("split train, column text")
    del splits["train"]
    splits["validation"] = splits["test"]
    splits.save_to_disk(tmp_path / "no-train")
    with pytest.raises(QuantizeError, match="splits test, validation, none named train; pass one split's dir"):
        load_texts(tmp_path / "no-train")
    assert list(load_texts(tmp_path / "no-train" / "test")[0]) == ["held out"]


def test_dataset_snapshot_directory_reads_its_data_files_not_its_card(datasets, tmp_path):
    snapshot = tmp_path / "snapshot"
    (snapshot / "data").mkdir(parents=True)
    (snapshot / "README.md").write_text("---\nconfigs:\n- config_name: default\n---\n# Dataset card\n")
    datasets.Dataset.from_dict({"content": ["a", "b"], "n": [1, 2]}).to_parquet(snapshot / "data" / "train-0.parquet")
    datasets.Dataset.from_dict({"content": ["c"], "n": [3]}).to_parquet(snapshot / "data" / "train-1.parquet")
    texts, source = load_texts(snapshot)
    assert list(texts) == ["a", "b", "c"]  # the only string column, files in name order
    assert source == f"{snapshot}, 2 parquet file(s), column content"
    datasets.Dataset.from_dict({"q": ["x"], "a": ["y"]}).to_csv(tmp_path / "qa.csv")
    with pytest.raises(QuantizeError, match=r"several string columns, none named text .its columns: q, a.; choose "
                                            r"one with --calib-data .*qa.csv:COLUMN"):
        load_texts(tmp_path / "qa.csv")
    assert list(load_texts(f"{tmp_path / 'qa.csv'}:a")[0]) == ["y"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "none.parquet")  # pandas' too
    # datasets' stream failed on it: "BatchSize must be greater than 0, got 0"
    with pytest.raises(QuantizeError, match="calibration data .*none.parquet is empty .parquet with no rows."):
        load_texts(tmp_path / "none.parquet")
    datasets.Dataset.from_dict({"text": [" "]}).to_parquet(snapshot / "data" / "train-2.parquet")
    (snapshot / "data" / "train-3.csv").write_text("content\nd\n")
    with pytest.raises(QuantizeError, match="holds csv and parquet files; pass a directory .or file. of one kind"):
        load_texts(snapshot)
    (snapshot / "data" / "train-3.csv").unlink()
    (snapshot / "data" / "train-2.parquet").unlink()
    (snapshot / "dataset_infos.json").write_text("{}")  # a dataset's own metadata, like its card: not text
    (snapshot / "data" / "README.txt").write_text("about the files")
    assert list(load_texts(snapshot)[0]) == ["a", "b", "c"]
    for extra in ("notes.txt", "more.json"):
        (snapshot / extra).write_text("calibration prose")
        with pytest.raises(QuantizeError, match=f"holds parquet files and text files .{extra}"):
            load_texts(snapshot)
        (snapshot / extra).unlink()
    (tmp_path / "header.csv").write_text("text\n")
    with pytest.raises(QuantizeError, match=r"header.csv is empty \(a header, no rows\)"):
        load_texts(tmp_path / "header.csv")
    (tmp_path / "gaps.csv").write_text("id,text\n1,\n2,hello there\n3,more text\n")  # the first cell is empty
    assert list(load_texts(tmp_path / "gaps.csv")[0]) == ["hello there", "more text"]
    assert list(load_texts(f"{tmp_path / 'gaps.csv'}:text")[0]) == ["hello there", "more text"]
    (tmp_path / "card-only").mkdir()
    (tmp_path / "card-only" / "README.md").write_text("# just a card")
    with pytest.raises(QuantizeError, match="holds no .* files and is no saved dataset .README and hidden files "
                                            "are skipped"):
        load_texts(tmp_path / "card-only")


def test_quantize_calibrates_on_a_saved_dataset(datasets, tiny, tmp_path):
    corpus = default_corpus()[:200]
    datasets.Dataset.from_dict({"text": corpus}).save_to_disk(tmp_path / "saved")
    result = quantize_checkpoint(tiny, tmp_path / "q", QuantSpec("int8_wo"), calib_data=tmp_path / "saved", **CALIB)
    assert result.calib_source == f"{tmp_path / 'saved'}, column text"
    record = json.loads((tmp_path / "q" / "camshaft_quantize.json").read_text())
    assert record["calibration"]["source"] == result.calib_source
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny))
    expected = calibration.tokenize(corpus, "", tokenizer, CALIB["calib_size"], CALIB["calib_seq_len"])
    got = calibration.tokenize(*load_texts(tmp_path / "saved"), tokenizer, CALIB["calib_size"], CALIB["calib_seq_len"])
    assert (got.input_ids == expected.input_ids).all()  # the same samples as the texts themselves


CHAT = [{"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "The Loire."}]


def test_chat_messages_are_rendered_with_the_chat_template(tiny, tmp_path):
    rows = [{"messages": CHAT, "id": 1}, {"text": "plain prose"}, {"messages": [{"role": "user", "content": " "}]}]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts, source = load_texts(tmp_path / "chat.jsonl")
    assert list(texts) == [CHAT, "plain prose"]  # a conversation with no text is skipped as a blank line is
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny))
    rendered = tokenizer.encode(tokenizer.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)
    assert rendered[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    prose = tokenizer.encode("plain prose", add_special_tokens=False) + [tokenizer.eos_token_id]
    expected = (rendered + prose) * 4  # the template ends each turn itself: no EOS after a conversation
    said = []
    got = calibration.tokenize(texts * 4, source, tokenizer, 1, len(expected), progress=said.append)
    assert got.input_ids[0].tolist() == expected
    assert said[-1] == f"tokenizing calibration text: {len(expected)}/{len(expected)} tokens"  # where it ended
    assert said.count(said[-1]) == 1
    (tmp_path / "turns.jsonl").write_text(json.dumps({"turns": CHAT}) + "\n")
    assert list(load_texts(f"{tmp_path / 'turns.jsonl'}:turns")[0]) == [CHAT]
    with pytest.raises(QuantizeError, match=r'chat.jsonl:2: expected .* "messages" field .a string or chat messages'):
        list(load_texts(f"{tmp_path / 'chat.jsonl'}:messages")[0])
    (tmp_path / "bad.jsonl").write_text(json.dumps({"messages": [{"role": "user", "text": "hi"}]}) + "\n")
    with pytest.raises(QuantizeError, match=r'bad.jsonl:1: chat messages must be objects with "role" and "content" '
                                            r"strings, found an object with the keys \['role', 'text'\]"):
        load_texts(tmp_path / "bad.jsonl")
    (tmp_path / "tools.jsonl").write_text(json.dumps({"messages": [{"role": "assistant", "content": None}]}) + "\n")
    with pytest.raises(QuantizeError, match=r"tools.jsonl:1: message 0's content is None, not a string"):
        load_texts(tmp_path / "tools.jsonl")
    tokenizer.chat_template = None
    with pytest.raises(QuantizeError, match="holds chat messages, but the model's tokenizer has no chat template"):
        calibration.tokenize([CHAT], source, tokenizer, 1, 8)


def test_a_dataset_of_conversations_is_read_from_its_messages_column(datasets, tmp_path):
    rows = {"prompt": ["Name a river.", "x"], "messages": [CHAT, [{"role": "user", "content": "x"}]]}
    datasets.Dataset.from_dict(rows).to_parquet(tmp_path / "chat.parquet")
    texts, source = load_texts(tmp_path / "chat.parquet")
    assert list(texts) == [CHAT, [{"role": "user", "content": "x"}]] and source.endswith("column messages")
    assert list(load_texts(f"{tmp_path / 'chat.parquet'}:prompt")[0]) == ["Name a river.", "x"]
    datasets.Dataset.from_dict({"turns": [CHAT], "id": [1]}).to_parquet(tmp_path / "turns.parquet")
    with pytest.raises(QuantizeError, match=r"conversations are not named messages .*turns.parquet:turns"):
        load_texts(tmp_path / "turns.parquet")
    assert list(load_texts(f"{tmp_path / 'turns.parquet'}:turns")[0]) == [CHAT]
    datasets.Dataset.from_dict({"messages": [[{"role": "user", "content": "x", "name": "a"}]]}).save_to_disk(
        tmp_path / "saved")
    assert list(load_texts(tmp_path / "saved")[0]) == [[{"role": "user", "content": "x", "name": "a"}]]


def test_quantize_calibrates_on_conversations(tiny, tmp_path):
    rows = [{"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": text[::-1]}]}
            for text in default_corpus()[:100]]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = quantize_checkpoint(tiny, tmp_path / "q", QuantSpec("int8_wo"), calib_data=tmp_path / "chat.jsonl",
                                 **CALIB)
    assert result.calib_source == str(tmp_path / "chat.jsonl")
    assert (tmp_path / "q" / "hf_quant_config.json").is_file()


def test_default_corpus_is_deterministic_stdlib_docstrings():
    import inspect
    import logging

    import torch  # noqa: F401  (patches inspect.getfile)
    import transformers.utils.logging  # noqa: F401  (adds warning_once to logging.Logger)

    first, second = default_corpus(), default_corpus()
    assert first == second
    assert len(first) > 500 and sum(map(len, first)) > 200_000
    assert "Return" in " ".join(first[:50]) or "return" in " ".join(first[:50])
    assert stdlib_corpus.STDLIB_MODULES[0] == "abc"
    # what this process imported changes nothing: the standard library's own docstrings, only those
    assert inspect.getfile.__doc__ is None and "Work out which source or compiled file an object was defined in." \
        in first
    assert inspect.cleandoc(logging.Logger.warning_once.__doc__) not in first
    assert stdlib_corpus.gather(40) != list(first)  # gathered here, after those imports: not the same text


def test_an_interpreter_without_an_executable_is_told_to_give_its_own_text(monkeypatch):
    monkeypatch.setattr(sys, "executable", "")  # embedded interpreters may have none
    with pytest.raises(QuantizeError, match="built-in calibration corpus failed .* give your own text with "
                                            "--calib-data"):
        stdlib_corpus.stdlib_docstrings.__wrapped__(41)


def test_modelopt_config_applies_group_kv_and_exclude():
    cfg = modelopt_config(QuantSpec("int4_awq", kv_cache_dtype="fp8", exclude=("*.mlp.down_proj",)), 64)
    entries = cfg["quant_cfg"]
    blocks = [e["cfg"]["block_sizes"][-1] for e in entries if isinstance(e.get("cfg"), dict)
              and "block_sizes" in e["cfg"]]
    assert blocks == [64]
    assert [e["quantizer_name"] for e in entries[-3:]] == [f"*.mlp.down_proj*.{kind}_quantizer"
                                                          for kind in ("input", "weight", "output")]
    assert all(e["enable"] is False for e in entries[-3:])
    assert entries[-4]["quantizer_name"] == "*[kv]_bmm_quantizer"


def test_excluding_a_whole_layer_keeps_its_kv_cache_quantized(tiny, tmp_path):
    """'model.layers.0.*' keeps that layer's linear layers float; its attention's K/V quantizers stay on, so the
    checkpoint has the layer's KV scales and builds."""
    spec = QuantSpec("int8_wo", kv_cache_dtype="int8", exclude=("model.layers.0.*",))
    quantize_checkpoint(tiny, tmp_path / "ckpt", spec, **CALIB)
    with Checkpoint(tmp_path / "ckpt") as ckpt:
        assert ckpt.quantized_linear("model.layers.0.self_attn.q_proj", 64, 64) is None
        assert all(scale > 0 for layer in (0, 1) for scale in ckpt.kv_scales(layer))
    manifest = build_engine(BuildConfig(tmp_path / "ckpt", tmp_path / "engine", max_seq_len=64, kv_block_size=4))
    assert manifest.kv_cache.dtype == "int8"


def test_excludes_that_leave_nothing_or_fight_lm_head_are_refused(tiny):
    from camshaft.quantize.excludes import check_excludes_match, module_names

    names = module_names(tiny)
    with pytest.raises(QuantizeError, match="leaves no linear layer to quantize"):
        check_excludes_match(QuantSpec("fp8", kv_cache_dtype="fp8", exclude=("*_proj",)), names)
    with pytest.raises(QuantizeError, match="--exclude keeps lm_head float but --lm-head int8 quantizes it"):
        check_excludes_match(QuantSpec("int8_wo", exclude=("lm_head",), lm_head="int8"), names)
    for pattern in ("lm_head", "*head"):  # float already (--lm-head float): a pattern that changes nothing
        with pytest.raises(QuantizeError, match=f"--exclude '{re.escape(pattern)}' names lm_head alone, which stays "
                                                "float already"):
            check_excludes_match(QuantSpec("int8_wo", exclude=(pattern, "model.layers.1.*")), names)
    with pytest.raises(QuantizeError, match=r"keeps float every layer int8_sq_mixed makes weight-only "
                                            r"\(\*\.mlp\.down_proj\).*pass --quant int8_sq with the same --exclude"):
        check_excludes_match(QuantSpec("int8_sq_mixed", exclude=("*.down_proj",)), names)
    check_excludes_match(QuantSpec("int8_sq_mixed", exclude=("model.layers.0.mlp.down_proj",)), names)  # one left


def test_awq_excludes_a_layers_q_k_v_together_or_not_at_all(tiny, tmp_path, no_model_load):
    """AWQ's export folds the input scale that two or more quantized q/k/v share into the layer norm before them: an
    excluded one would read that scaled input with float weights made for the unscaled one."""
    from camshaft.quantize.excludes import check_excludes_match, module_names

    names = module_names(tiny)
    for fmt in ("int4_awq", "w4a8_awq"):
        with pytest.raises(QuantizeError, match=r"keeps model\.layers\.1\.self_attn\.q_proj float but not the other "
                                                r"projections.*e\.g\. 'model\.layers\.1\.self_attn\.\[qkv\]_proj'"):
            check_excludes_match(QuantSpec(fmt, exclude=("model.layers.1.self_attn.q_proj",)), names)
        with pytest.raises(QuantizeError, match="keeps model.layers.0.self_attn.v_proj float"):
            quantize_checkpoint(tiny, tmp_path / "ckpt", QuantSpec(fmt, exclude=("*.v_proj",)), **CALIB)
        for fine in ("*.self_attn.[qkv]_proj", "*.[qk]_proj", "*.gate_proj", "*.o_proj"):  # none or one of q/k/v left
            check_excludes_match(QuantSpec(fmt, exclude=(fine,)), names)
    check_excludes_match(QuantSpec("int4_wo", exclude=("*.q_proj",)), names)  # no scale to fold without AWQ
    assert not (tmp_path / "ckpt").exists()


def test_quantized_weights_without_their_config_are_refused(tiny, tmp_path):
    """Codes must never be read as float weights: a checkpoint whose config.json says it is quantized but has no
    hf_quant_config.json, and a layer whose weight_scale is gone, are refused by the builder and by quantize."""
    import shutil

    from safetensors.numpy import load_file, save_file

    quantize_checkpoint(tiny, tmp_path / "q", QuantSpec("int8_wo"), **CALIB)
    assert all(f.stat().st_mode & 0o044 == 0o044 for f in (tmp_path / "q").iterdir())  # others may read it (servers)
    bare = tmp_path / "bare"
    shutil.copytree(tmp_path / "q", bare)
    (bare / "hf_quant_config.json").unlink()
    config = json.loads((bare / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"  # what ModelOpt writes there is enough
    assert Checkpoint(bare).quantization["quant_algo"] == Checkpoint(tmp_path / "q").quantization["quant_algo"]
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "W4A16_AWQ"}  # no group size there
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json has no integer group_size for W4A16_AWQ \(ModelOpt "
                                              r"writes it to hf_quant_config.json only\): copy that file"):
        Checkpoint(bare)
    config["quantization_config"]["config_groups"] = {"group_0": {"weights": {"group_size": [32]}}}  # malformed
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no integer group_size for W4A16_AWQ"):  # a TypeError before
        Checkpoint(bare)
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="no quantized_layers .* write them to hf_quant_config.json only"):
        Checkpoint(bare)
    float_copy = tmp_path / "float-with-config"  # says FP8 in config.json alone, holds float weights
    shutil.copytree(tiny, float_copy)
    float_config = json.loads((float_copy / "config.json").read_text())
    float_config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8"}
    (float_copy / "config.json").write_text(json.dumps(float_config))
    with pytest.raises(CheckpointError, match="config.json's quantization_config says the layers are FP8, but no "
                                              "layer has a weight_scale.*Remove quantization_config from config.json"):
        Checkpoint(float_copy)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="says the weights are quantized .quant_method gptq."):
        Checkpoint(bare)
    with pytest.raises(QuantizeError, match="already quantized .config.json's quantization_config"):
        quantize_checkpoint(bare, tmp_path / "again", QuantSpec("int8_wo"), **CALIB)
    from camshaft.errors import RequestError
    from camshaft.runtime.perplexity import check_reference_model

    with pytest.raises(RequestError, match="is quantized .config.json's quantization_config, quant_method gptq."):
        check_reference_model(bare)  # not "has no hf_quant_config.json", as if nothing said how
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "q", damaged)
    [weights] = damaged.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, weights)
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj.weight' holds int8 codes"):
        build_engine(BuildConfig(damaged, tmp_path / "engine", max_seq_len=64, kv_block_size=4))
    # the codes beside the original config.json, nothing saying they are quantized: transformers reads them as floats
    stripped = tmp_path / "stripped"
    shutil.copytree(tiny, stripped)
    [float_weights] = stripped.glob("*.safetensors")
    float_weights.unlink()
    shutil.copyfile(weights, stripped / weights.name)
    with pytest.raises(QuantizeError, match=r"tensor 'model.layers.\d+\..*weight' holds int8 codes, but .* does not "
                                            r"say how to dequantize them .*; quantize the original float checkpoint"):
        quantize_checkpoint(stripped, tmp_path / "again", QuantSpec("fp8"), **CALIB)
    with pytest.raises(RequestError, match="holds int8 codes, .*; pass the float checkpoint to --model"):
        check_reference_model(stripped)


def test_unsupported_quantized_checkpoint_is_refused_by_the_builder(tiny, tmp_path):
    quantize_checkpoint(tiny, tmp_path / "fp8", QuantSpec("fp8"), **CALIB)
    config = tmp_path / "fp8" / "hf_quant_config.json"
    raw = json.loads(config.read_text())
    config.write_text(json.dumps({**raw, "quantization": {**raw["quantization"], "quant_algo": "NVFP4"}}))
    with pytest.raises(CheckpointError, match="quantized as NVFP4; camshaft builds W4A16_AWQ, W8A16, FP8"):
        Checkpoint(tmp_path / "fp8")
    layers = {"model.layers.0.mlp.down_proj": {"quant_algo": "NVFP4"},
              "model.layers.0.mlp.up_proj": {"quant_algo": "FP8"}}
    mixed = {"quant_algo": "MIXED_PRECISION", "quantized_layers": layers}
    config.write_text(json.dumps({**raw, "quantization": mixed}))
    with pytest.raises(CheckpointError, match="quantizes model.layers.0.mlp.down_proj as NVFP4; camshaft builds"):
        Checkpoint(tmp_path / "fp8")
    config.write_text(json.dumps({**raw, "quantization": {"quant_algo": "MIXED_PRECISION"}}))
    with pytest.raises(CheckpointError, match="MIXED_PRECISION but has no quantized_layers"):
        Checkpoint(tmp_path / "fp8")
    zero_points = {"quant_algo": "W4A16_AWQ", "group_size": 32, "has_zero_point": True}  # TensorRT-LLM allows it
    config.write_text(json.dumps({**raw, "quantization": zero_points}))
    with pytest.raises(CheckpointError, match=r"stores W4A16_AWQ with zero points \(has_zero_point true"):
        Checkpoint(tmp_path / "fp8")


@pytest.mark.parametrize("group", [0, 48])
def test_an_int4_group_size_that_cannot_be_right_is_a_clear_error(tiny, tmp_path, group):
    quantize_checkpoint(tiny, tmp_path / "q", QuantSpec("int4_wo", group_size=32), **CALIB)
    config = tmp_path / "q" / "hf_quant_config.json"
    raw = json.loads(config.read_text())
    config.write_text(json.dumps({**raw, "quantization": {**raw["quantization"], "group_size": group}}))
    with pytest.raises(CheckpointError, match=f"group_size for .* is {group!r}: int4 weights need a positive"):
        build_engine(BuildConfig(tmp_path / "q", tmp_path / "engine", max_seq_len=64, kv_block_size=4))


def test_a_modelopt_checkpoint_with_config_json_alone_builds_as_with_hf_quant_config(tiny, tmp_path):
    """ModelOpt writes its quantization to config.json too (as vLLM reads it); a copy without hf_quant_config.json
    builds the same engine: layers, the KV cache's format (written there as a scheme), excluded modules."""
    import shutil

    from camshaft.manifest import read_manifest
    from camshaft.runtime.sampling_params import SamplingParams
    from camshaft.runtime.session import Session

    spec = QuantSpec("fp8", kv_cache_dtype="fp8", exclude=("*.mlp.down_proj",))
    quantize_checkpoint(tiny, tmp_path / "q", spec, **CALIB)
    shutil.copytree(tmp_path / "q", tmp_path / "bare")
    (tmp_path / "bare" / "hf_quant_config.json").unlink()
    outputs, manifests = [], []
    for name in ("q", "bare"):
        engine = tmp_path / f"{name}-engine"
        build_engine(BuildConfig(tmp_path / name, engine, max_seq_len=64, kv_block_size=4))
        manifests.append(read_manifest(engine).quantization)
        with Session(engine) as session:
            out = session.generate([5, 9, 17, 33], SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True))
        outputs.append((out.token_ids, out.logprobs))
    assert manifests[0] == manifests[1] and manifests[0]["kv_cache_dtype"] == "fp8"  # the flag's word
    assert manifests[0]["float_modules"] == ["lm_head", "model.embed_tokens", "model.layers.*.mlp.down_proj"]
    assert outputs[0] == outputs[1]


def test_int4_weights_stored_as_int8_read_as_the_same_nibbles(tiny, tmp_path):
    """ModelOpt before its uint8 view wrote packed int4 weights as int8 (the same bytes); int8's sign must not leak
    into the high nibble."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    quantize_checkpoint(tiny, tmp_path / "q", QuantSpec("int4_wo", group_size=32), **CALIB)
    (weights,) = (tmp_path / "q").glob("*.safetensors")
    tensors = load_file(weights)
    packed = [name for name, t in tensors.items() if t.dtype == np.uint8]
    assert packed and any((tensors[name] >= 128).any() for name in packed)  # high nibbles of negative values
    save_file({name: t.view(np.int8) if name in packed else t for name, t in tensors.items()}, weights)
    model = ModelConfig.from_hf_dir(tiny)
    prefix, out_dim, in_dim = "model.layers.0.mlp.up_proj", model.intermediate_size, model.hidden_size
    signed = Checkpoint(tmp_path / "q").quantized_linear(prefix, out_dim, in_dim)
    save_file(tensors, weights)
    unsigned = Checkpoint(tmp_path / "q").quantized_linear(prefix, out_dim, in_dim)
    assert np.array_equal(signed.values, unsigned.values) and (signed.values[1::2] < 0).any()  # high nibbles


def test_int8_weight_scales_of_one_column_are_read_as_fp8s_are(tiny, tmp_path):
    import numpy as np
    from safetensors.numpy import load_file, save_file

    quantize_checkpoint(tiny, tmp_path / "q", QuantSpec("int8_wo"), **CALIB)
    (weights,) = (tmp_path / "q").glob("*.safetensors")
    tensors = load_file(weights)
    model = ModelConfig.from_hf_dir(tiny)
    prefix, out_dim, in_dim = "model.layers.0.mlp.up_proj", model.intermediate_size, model.hidden_size
    flat = Checkpoint(tmp_path / "q").quantized_linear(prefix, out_dim, in_dim)
    save_file({name: t.reshape(-1, 1) if name.endswith(".weight_scale") else t for name, t in tensors.items()},
              weights)
    column = Checkpoint(tmp_path / "q").quantized_linear(prefix, out_dim, in_dim)
    assert np.array_equal(column.scales, flat.scales) and np.array_equal(column.values, flat.values)


def test_excluded_layers_stay_float(tiny, tmp_path):
    spec = QuantSpec("int4_wo", exclude=("*.mlp.down_proj", "model.layers.1.self_attn.k_proj"))
    quantize_checkpoint(tiny, tmp_path / "ckpt", spec, **CALIB)
    with Checkpoint(tmp_path / "ckpt") as ckpt:
        assert ckpt.quantized_linear("model.layers.0.mlp.down_proj", 64, 96) is None
        assert ckpt.quantized_linear("model.layers.1.self_attn.k_proj", 32, 64) is None
        assert ckpt.quantized_linear("model.layers.1.self_attn.q_proj", 64, 64) is not None
    manifest = build_engine(BuildConfig(tmp_path / "ckpt", tmp_path / "engine", max_seq_len=64, kv_block_size=4))
    # layer 0: q k v (fused), o, gate up (fused) = 6; layer 1: q, v, o, gate up = 5; no down_proj
    assert manifest.quantization["quantized_linear_layers"] == 6 + 5
    (tmp_path / "ckpt" / "README.md").write_text("model card")  # quantizing again would delete it
    with pytest.raises(QuantizeError, match="also holds README.md, which camshaft did not write"):
        quantize_checkpoint(tiny, tmp_path / "ckpt", spec, **CALIB)
    assert (tmp_path / "ckpt" / "README.md").read_text() == "model card"
    (tmp_path / "ckpt" / "README.md").unlink()
    (tmp_path / "ckpt" / "camshaft_quantize.json").write_text('{"files": [["a"]]}')  # damaged: none of it ours
    with pytest.raises(QuantizeError, match="also holds camshaft_quantize.json, chat_template.jinja, config.json"):
        quantize_checkpoint(tiny, tmp_path / "ckpt", spec, **CALIB)  # (it was a TypeError traceback)
    (tmp_path / "ckpt" / "camshaft_quantize.json").unlink()  # another tool's quantized checkpoint: none of it ours
    with pytest.raises(QuantizeError, match="also holds chat_template.jinja, config.json"):
        quantize_checkpoint(tiny, tmp_path / "ckpt", spec, **CALIB)


def test_an_exclude_pattern_that_matches_no_layer_is_refused_before_calibration(tiny, tmp_path, monkeypatch):
    import transformers

    import camshaft.quantize.modelopt_adapter as adapter

    monkeypatch.setattr(adapter, "calibration_loop", lambda *a: pytest.fail("calibrated despite the bad pattern"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("loaded the model despite the bad pattern"))
    spec = QuantSpec("int8_wo", exclude=("*.mlp.down_proj", "model.layers.2.mlp.*"))  # the tiny model has 2 layers
    with pytest.raises(QuantizeError, match=r"--exclude 'model.layers.2.mlp.\*' matches no linear layer") as err:
        quantize_checkpoint(tiny, tmp_path / "ckpt", spec, **CALIB)
    assert "'model.layers.0.mlp.down_proj'" in str(err.value) and "model.layers.1." in str(err.value)
    assert not (tmp_path / "ckpt").exists()


def test_exclude_patterns_see_module_names(tiny):
    from camshaft.quantize.excludes import check_excludes_match, module_names

    names = module_names(tiny)
    assert "lm_head" in names and "model.layers.1.mlp.down_proj" in names and not any("embed" in n for n in names)
    check_excludes_match(QuantSpec("int8_wo", exclude=("model.layers.1.*",)), names)  # no error


def test_pickle_weights_are_never_loaded_for_calibration(tiny, tmp_path):
    import shutil

    from camshaft.errors import CheckpointError

    pickled = tmp_path / "pickled"
    shutil.copytree(tiny, pickled)
    for file in pickled.glob("*.safetensors"):
        file.unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"not really")
    with pytest.raises(CheckpointError, match="never unpickles"):
        quantize_checkpoint(pickled, tmp_path / "ckpt", QuantSpec("int8_wo"), **CALIB)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("damage", ["missing head", "missing layer tensor", "wrong shape", "nan"])
def test_weights_transformers_would_make_up_are_refused_before_calibration(tmp_path, damage):
    """transformers fills a missing tensor with random values and only logs it: quantizing that would export random
    weights that then build. A tensor of another shape is refused too, as an error and not a traceback, and one that
    is not finite as build refuses it (ModelOpt's calibration failed on it with an AssertionError)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    model = make_tiny_model("llama", tmp_path / "hf", tie_word_embeddings=False)
    (shard,) = model.glob("*.safetensors")
    tensors = load_file(shard)
    name = {"missing head": "lm_head.weight", "missing layer tensor": "model.layers.1.mlp.up_proj.weight",
            "wrong shape": "model.layers.0.mlp.down_proj.weight", "nan": "model.layers.0.self_attn.q_proj.weight"
            }[damage]
    if damage == "wrong shape":
        tensors[name] = tensors[name][:, :-8].copy()
    elif damage == "nan":
        tensors[name][3, 5] = np.nan
    else:
        del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    message = {"wrong shape": "transformers cannot load it", "nan": f"tensor '{name}' holds NaN or infinite values"
               }.get(damage, f"lacks {name}; transformers would")
    with pytest.raises(CheckpointError, match=message):
        quantize_checkpoint(model, tmp_path / "ckpt", QuantSpec("int8_wo"), **CALIB)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("damage", ["tokenizer.json cut", "unknown dtype", "integer rms_norm_eps"])
def test_files_transformers_cannot_read_are_a_clear_error_not_a_traceback(tiny, tmp_path, damage):
    model = tmp_path / "hf"
    shutil.copytree(tiny, model)
    if damage == "tokenizer.json cut":
        text = (model / "tokenizer.json").read_text()
        (model / "tokenizer.json").write_text(text[: len(text) // 2])
    else:
        config = json.loads((model / "config.json").read_text())
        config.update({"dtype": "float13"} if damage == "unknown dtype" else {"rms_norm_eps": 0})
        (model / "config.json").write_text(json.dumps(config))
    with pytest.raises((CheckpointError, QuantizeError), match="transformers cannot (load|read)"):
        quantize_checkpoint(model, tmp_path / "ckpt", QuantSpec("int8_wo"), **CALIB)
    assert not (tmp_path / "ckpt").exists()


def test_cli_quantize(tiny, tmp_path, capsys, monkeypatch):
    import camshaft.quantize.modelopt_adapter as adapter

    def camshaft(*args):
        argv, sys.argv = sys.argv, ["camshaft", *map(str, args)]
        try:
            cli.main()
            return 0
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 1
        finally:
            sys.argv = argv

    real_import = adapter.import_modelopt
    monkeypatch.setattr(adapter, "import_modelopt", lambda: pytest.fail("refused only after loading ModelOpt"))
    code = camshaft("quantize", "--model", tiny, "--quant", "int4_wo", "--group-size", "64", "--output", tmp_path / "o")
    assert code == 1 and "group size 64 does not divide" in capsys.readouterr().err
    code = camshaft("build", "--model", tiny, "--quant", "fp8", "--weight-only-compute", "int8", "--output",
                    tmp_path / "e")
    err = " ".join(capsys.readouterr().err.split())
    assert code == 1 and "--weight-only-compute applies to weight-only checkpoints" in err and "--quant fp8" in err
    assert not (tmp_path / "e.ckpt").exists()
    monkeypatch.setattr(adapter, "import_modelopt", real_import)
    code = camshaft("quantize", "--model", tiny, "--quant", "int8_wo", "--calib-data", "", "--output", tmp_path / "o")
    assert code == 1 and "--calib-data is empty" in capsys.readouterr().err
    named = tmp_path / "named"  # transformers' named chat templates: the quantized checkpoint keeps them
    shutil.copytree(tiny, named)
    (named / "additional_chat_templates").mkdir()
    (named / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    code = camshaft("quantize", "--model", named, "--quant", "int8_wo", "--calib-size", "2", "--calib-seq-len", "32",
                    "--output", tmp_path / "o")
    assert code == 0
    assert json.loads((tmp_path / "o" / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "W8A16"
    assert (tmp_path / "o" / "tokenizer.json").is_file()
    assert (tmp_path / "o" / "additional_chat_templates" / "tool_use.jinja").read_text() == "{{ tools }}"


@pytest.mark.parametrize("group, kernel_block", [(256, 128), (8, None)])
def test_an_int4_group_matmulnbits_lacks_is_built_exactly(tmp_path, group, kernel_block):
    """ModelOpt (and TensorRT-LLM) take int4 groups MatMulNBits has no block for: 256 runs in blocks of 128 with
    each scale repeated; 8 has no kernel and is built from its dequantized weights, said at build time and in the
    manifest (it was built float silently). Either way the logits are ModelOpt's fake-quant model's."""
    import copy

    import modelopt.torch.quantization as mtq
    import numpy as np
    import onnx
    import torch
    from modelopt.torch.export import export_hf_checkpoint

    from camshaft.runtime.session import Session

    src = make_tiny_model("llama", tmp_path / "hf", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2)
    ids = torch.randint(3, 384, (1, 24), generator=torch.Generator().manual_seed(0))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    cfg = copy.deepcopy(mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
    for entry in cfg["quant_cfg"]:
        if isinstance(entry.get("cfg"), dict) and isinstance(entry["cfg"].get("block_sizes"), dict):
            entry["cfg"]["block_sizes"][-1] = group
    with torch.no_grad():
        mtq.quantize(model, cfg, forward_loop=lambda m: m(ids))
        fake = model(ids).logits[0, -1].numpy()
        export_hf_checkpoint(model, export_dir=str(tmp_path / "q"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "q" / name).write_bytes((src / name).read_bytes())
    said = []
    manifest = build_engine(BuildConfig(tmp_path / "q", tmp_path / "engine", max_seq_len=64,
                                        weight_only_compute="float"), progress=said.append)
    quant = manifest.quantization
    nbits = [n for n in onnx.load(tmp_path / "engine" / manifest.artifact, load_external_data=False).graph.node
             if n.op_type == "MatMulNBits"]
    if kernel_block is None:
        assert quant["quantized_linear_layers"] == 0 and len(quant["dequantized_linear_layers"]) == 14 and not nbits
        assert any("14 quantized layer(s) no kernel of this target takes" in line for line in said)
        from camshaft.runtime.engine_info import engine_info, info_lines

        precision = next(line for line in info_lines(engine_info(tmp_path / "engine")) if line.startswith("precision"))
        assert "dequantized_linear_layers 14" in precision  # a count on the line; the names in --json
    else:
        assert quant["quantized_linear_layers"] == 14 and quant["dequantized_linear_layers"] == []
        assert nbits and {a.i for n in nbits for a in n.attribute if a.name == "block_size"} == {kernel_block}
    with Session(tmp_path / "engine", graph="batch") as session:
        ours = session.generate(ids[0].tolist(), max_tokens=1, logprobs=5).logprobs[0]
    reference = torch.log_softmax(torch.tensor(fake), -1).numpy()
    assert ours.token_id == int(np.argmax(fake))
    for token, logprob in ours.top_logprobs:
        assert logprob == pytest.approx(reference[token], abs=2e-3)


@pytest.mark.parametrize(("fmt", "tensor"), [("int4_awq", "weight_scale"), ("fp8", "weight_scale"), ("fp8", "weight")])
def test_a_quantized_layer_that_is_not_finite_is_refused_at_build(tiny, tmp_path, fmt, tensor):
    """Its scales (or an fp8 weight's NaN code) made an engine whose every request failed on non-finite logits."""
    import torch
    from safetensors.torch import load_file, save_file

    from camshaft.builder.build import build_engine
    from camshaft.builder.config import BuildConfig
    from camshaft.errors import CheckpointError
    from camshaft.quantize.modelopt_adapter import quantize_checkpoint
    from camshaft.quantize.spec import QuantSpec

    pytest.importorskip("modelopt.torch.quantization")
    quantize_checkpoint(tiny, tmp_path / "q", QuantSpec(fmt), calib_size=4, calib_seq_len=64)
    name = f"model.layers.1.mlp.down_proj.{tensor}"
    file = next(f for f in (tmp_path / "q").glob("*.safetensors") if name in load_file(f))
    weights = load_file(file)
    values = weights[name].clone()
    if values.dtype == torch.float8_e4m3fn:
        values.view(torch.uint8).view(-1)[7] = 0x7F  # e4m3fn's NaN
    else:
        values.view(-1)[0] = float("nan")
    save_file(weights | {name: values}, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor '{name}' holds NaN or infinite values"):
        build_engine(BuildConfig(tmp_path / "q", tmp_path / "engine", max_seq_len=64))


def test_the_manifest_lists_the_modules_the_engine_computes_in_float(tmp_path):
    """float_modules says what was built float: module names (not ModelOpt's globs), the embedding whatever the
    architecture's exclude list holds (Gemma's leaves it out), every layer's module as model.layers.*.NAME."""
    from camshaft.manifest import read_manifest

    model = make_tiny_model("gemma2", tmp_path / "gemma2")
    quantize_checkpoint(model, tmp_path / "q", QuantSpec("int8_wo", exclude=("model.layers.1.mlp.*",)), **CALIB)
    build_engine(BuildConfig(tmp_path / "q", tmp_path / "engine", max_seq_len=64, kv_block_size=4))
    assert read_manifest(tmp_path / "engine").quantization["float_modules"] == [
        "lm_head", "model.embed_tokens", "model.layers.1.mlp.down_proj", "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj"]


@pytest.fixture(scope="module")
def int8_fp8_kv(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("int8-fp8kv") / "q"
    quantize_checkpoint(tiny, out, QuantSpec("int8_wo", kv_cache_dtype="fp8"), **CALIB)
    return out


def _edited_copy(source, target, file: str, edit) -> None:
    import shutil

    shutil.copytree(source, target)
    path = target / file
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def test_quantization_files_that_disagree_on_the_kv_cache_are_refused(int8_fp8_kv, tmp_path):
    """An int8 cache read with fp8's scales (amax / 448) clips almost every value: a checkpoint whose
    hf_quant_config.json, config.json and camshaft_quantize.json disagree is refused, not built one way."""
    _edited_copy(int8_fp8_kv, tmp_path / "algo", "hf_quant_config.json",
                 lambda raw: {**raw, "quantization": {**raw["quantization"], "kv_cache_quant_algo": "INT8"}})
    with pytest.raises(CheckpointError, match="camshaft_quantize.json says the KV cache was calibrated as fp8, "
                                              "hf_quant_config.json quantizes it as INT8; one was edited"):
        Checkpoint(tmp_path / "algo")
    record = tmp_path / "algo" / "camshaft_quantize.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "kv_cache_dtype": "int8"}))
    with pytest.raises(CheckpointError, match="hf_quant_config.json quantizes the KV cache as INT8, config.json's "
                                              "quantization_config as FP8; the files were edited"):
        Checkpoint(tmp_path / "algo")
    _edited_copy(int8_fp8_kv, tmp_path / "record", "camshaft_quantize.json",
                 lambda record: {**record, "kv_cache_dtype": None})
    with pytest.raises(CheckpointError, match="camshaft_quantize.json says the KV cache was calibrated as None, "
                                              "hf_quant_config.json quantizes it as FP8"):
        Checkpoint(tmp_path / "record")
    _edited_copy(int8_fp8_kv, tmp_path / "layers", "hf_quant_config.json",
                 lambda raw: {**raw, "quantization": {**raw["quantization"], "quant_algo": "FP8"}})
    with pytest.raises(CheckpointError, match="quantizes the layers as FP8, config.json's quantization_config as "
                                              "W8A16"):
        Checkpoint(tmp_path / "layers")
    assert Checkpoint(int8_fp8_kv).kv_cache_dtype == "float8"  # the files as written agree


def test_a_quantized_checkpoint_missing_a_file_its_record_lists_is_refused(int8_fp8_kv, tmp_path):
    """Without kv_cache_scales.safetensors (the KV biases) the fp8 scales, calibrated for K and V less their bias,
    would clip the raw values; the build said nothing."""
    import shutil

    shutil.copytree(int8_fp8_kv, tmp_path / "q")
    (tmp_path / "q" / "kv_cache_scales.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"q lacks kv_cache_scales\.safetensors, which camshaft quantize wrote "
                                              r"\(camshaft_quantize\.json lists it\)"):
        Checkpoint(tmp_path / "q")


def test_damaged_weight_scales_are_refused(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    quantize_checkpoint(tiny, tmp_path / "q", QuantSpec("w4a8_awq", group_size=32), **CALIB)
    (weights,) = (tmp_path / "q").glob("model*.safetensors")
    tensors = load_file(weights)
    layer = "model.layers.0.mlp.down_proj"
    assert f"{layer}.weight_scale_2" in tensors
    for name, edit in (("no-scale-2", lambda t: t.pop(f"{layer}.weight_scale_2")),
                       ("negative", lambda t: t.update({f"{layer}.weight_scale": -t[f"{layer}.weight_scale"]}))):
        import shutil

        shutil.copytree(tmp_path / "q", tmp_path / name)
        damaged = dict(tensors)
        edit(damaged)
        save_file(damaged, tmp_path / name / weights.name, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor '{layer}.weight_scale_2' is missing"):
        build_engine(BuildConfig(tmp_path / "no-scale-2", tmp_path / "e1", max_seq_len=64, kv_block_size=4))
    with pytest.raises(CheckpointError, match=f"{layer}.weight_scale holds negative scales"):
        build_engine(BuildConfig(tmp_path / "negative", tmp_path / "e2", max_seq_len=64, kv_block_size=4))


@pytest.mark.parametrize("tied", [False, True])
def test_a_modelopt_checkpoint_with_its_head_quantized(tmp_path, tied):
    """ModelOpt leaves lm_head float by default; a checkpoint whose head it quantized (fp8) is built as its fake-quant
    model runs it: the head's input rounded with its scale too (a review found the scale dropped: 0.27 of the
    quantization's effect off). A tied model's quantized head beside its float embedding is refused saying so (it
    was refused as 'a different lm_head.weight')."""
    import copy

    import modelopt.torch.quantization as mtq
    import numpy as np
    import torch
    from modelopt.torch.export import export_hf_checkpoint

    from camshaft.errors import CheckpointError
    from camshaft.runtime.batch import Chunk
    from camshaft.runtime.engine import Engine

    src = make_tiny_model("llama", tmp_path / "hf", tie_word_embeddings=tied)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    with torch.no_grad():
        plain = model(torch.arange(5, 45)[None]).logits[0].numpy()
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    cfg["quant_cfg"] = [e for e in cfg["quant_cfg"] if e.get("quantizer_name") != "*lm_head*"]
    batches = [torch.randint(3, 384, (1, 64), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with torch.no_grad():
        mtq.quantize(model, cfg, forward_loop=lambda m: [m(b) for b in batches])
        fake = model(torch.arange(5, 45)[None]).logits[0].numpy()
        export_hf_checkpoint(model, export_dir=str(tmp_path / "q"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "q" / name).write_bytes((src / name).read_bytes())
    config = BuildConfig(tmp_path / "q", tmp_path / "engine", max_seq_len=64)
    if tied:
        with pytest.raises(CheckpointError, match="stores lm_head quantized .* Set tie_word_embeddings to false"):
            build_engine(config)
        return
    manifest = build_engine(config)
    assert manifest.quantization["lm_head"]["dtype"] == "as the checkpoint quantized it"
    engine = Engine(tmp_path / "engine", max_sequences=1)
    logits = engine.step([Chunk(list(range(5, 45)), 0, engine.pool.allocate(2), 40)])
    engine.close()
    assert np.abs(logits[-1] - fake[-1]).max() <= 0.1 * np.abs(fake[-1] - plain[-1]).max()


def test_a_csv_or_parquet_file_is_read_without_the_network_or_the_hubs_cache(tmp_path):
    """datasets pinged the hub's servers (its download counts) on each load: seconds on a machine without a
    network, and a lock file left in ~/.cache/huggingface each run."""
    import subprocess

    (tmp_path / "calib.csv").write_text("text\nhello there\nmore text\n")
    (tmp_path / "home").mkdir()
    script = ("import sys; calls = []\n"
              "sys.addaudithook(lambda event, args: calls.append(event) if event.startswith('socket.') else None)\n"
              "from camshaft.quantize.calibration import load_texts\n"
              "texts = list(load_texts(sys.argv[1])[0])\n"
              "print(texts, sorted(set(calls)))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "XDG_"))}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "calib.csv")], capture_output=True, text=True,
                          env=env | {"HOME": str(tmp_path / "home")}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['hello there', 'more text'] []"
    assert [p for p in (tmp_path / "home").rglob("*") if p.is_file()] == []


def test_quantize_into_a_log_shows_calibration_steps_as_lines(tiny, tmp_path):
    """Under a supervisor (stderr a file or pipe): calibration showed no progress at all (a transient bar) and
    transformers' loading and saving bars were lines of carriage returns."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", "from camshaft.cli import main; main()", "quantize", "--model",
                           str(tiny), "--quant", "int8_wo", "--output", str(tmp_path / "q"), "--calib-size", "8",
                           "--calib-seq-len", "32"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    steps = [line for line in done.stderr.splitlines() if ": sample " in line]
    assert [line.rsplit(" ", 1)[1] for line in steps] == ["2/8", "4/8", "6/8", "8/8"], done.stderr
    assert "\r" not in done.stderr and "\x1b" not in done.stderr


def test_the_calibration_samples_hash_tells_their_shape_apart():
    import numpy as np

    from camshaft.quantize.modelopt_adapter import samples_sha256

    ids = np.arange(32, dtype=np.int64)
    hashes = {samples_sha256(ids.reshape(shape)) for shape in ((4, 8), (2, 16), (1, 32))}
    assert len(hashes) == 3 and samples_sha256(ids.reshape(4, 8)) == samples_sha256(ids.copy().reshape(4, 8))
