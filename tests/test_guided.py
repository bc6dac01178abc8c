"""Guided decoding on a tiny engine: every output matches its JSON schema, regex, choice or grammar, and each token is
the argmax of transformers' logits over the tokens the grammar allows (greedy); bad grammars are refused up front."""

from __future__ import annotations

import json
import re

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
import torch
import transformers

from camshaft.errors import RequestError
from camshaft.runtime.guided import COMPACT, GuidedDecodingParams
from camshaft.runtime.llm import LLM
from camshaft.runtime.sampling_params import SamplingParams
from camshaft.runtime.session import Session

from tiny_models import tiny_engine

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "color": {"enum": ["red", "green"]}},
          "required": ["ok", "n", "color"], "additionalProperties": False}
REGEX = r"[a-z]{2,6} [0-9]{1,3}\."
GRAMMAR = 'start: "(" num ("+" num)? ("+" num)? ")"\nnum: /[0-9]/'


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return tiny_engine(tmp_path_factory.mktemp("guided"), max_seq_len=128, max_num_tokens=64, max_batch_size=4)


@pytest.fixture(scope="module")
def llm(engine_dir):
    with LLM(engine_dir) as llm:
        yield llm


def matches(guided: GuidedDecodingParams, text: str) -> bool:
    if guided.json is not None:
        value = json.loads(text)
        return (list(value) == ["ok", "n", "color"] and isinstance(value["ok"], bool)
                and isinstance(value["n"], int) and 0 <= value["n"] <= 99 and value["color"] in ("red", "green"))
    if guided.json_object:
        return isinstance(json.loads(text), dict)
    if guided.regex is not None:
        return re.fullmatch(guided.regex, text) is not None
    if guided.choice is not None:
        return text in guided.choice
    return re.fullmatch(r"\([0-9](\+[0-9])*\)", text) is not None


CASES = [GuidedDecodingParams(json=SCHEMA), GuidedDecodingParams(json=json.dumps(SCHEMA)),
         GuidedDecodingParams(json_object=True), GuidedDecodingParams(regex=REGEX),
         GuidedDecodingParams(choice=["alpha", "beta", "gamma"]), GuidedDecodingParams(grammar=GRAMMAR)]


@pytest.mark.parametrize("guided", CASES, ids=["schema", "schema-text", "json-object", "regex", "choice", "grammar"])
def test_greedy_guided_tokens_are_the_allowed_argmax_of_transformers(llm, engine_dir, guided):
    prompt = [5, 9, 17, 33, 41]
    result = llm.generate(prompt, SamplingParams(max_tokens=100, guided_decoding=guided), use_tqdm=False)[0].outputs[0]
    assert result.finish_reason == "stop" and matches(guided, result.text), (result.text, result.finish_reason)
    tokenizer = llm.tokenizer
    vocab = llm.engine.manifest.model.vocab_size
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab,
                                                                eos_token=list(llm.engine.eos_token_ids)),
                                   guided.llguidance_grammar())
    bits = llguidance.numpy.allocate_token_bitmask(1, vocab)
    model = transformers.AutoModelForCausalLM.from_pretrained(engine_dir.parent / "hf").eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + result.token_ids])).logits[0, len(prompt) - 1:].double().numpy()
    for step, token in enumerate(result.token_ids):
        llguidance.numpy.fill_next_token_bitmask(matcher, bits, 0)
        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab].astype(bool)
        row = np.where(allowed, logits[step], -np.inf)
        assert token == int(np.argmax(row)) or row.max() - row[token] < 1e-4, (step, token, int(np.argmax(row)))
        assert matcher.consume_token(token)
    assert matcher.is_stopped()  # the output ended where the grammar did


def test_sampled_outputs_each_match(llm):
    guided = [GuidedDecodingParams(json=SCHEMA), GuidedDecodingParams(regex=REGEX)]
    outputs = llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(n=3, temperature=1.0, seed=s, max_tokens=100,
                                                                guided_decoding=g) for s, g in enumerate(guided)],
                           use_tqdm=False)
    for g, prompt_output in zip(guided, outputs, strict=True):
        texts = [o.text for o in prompt_output.outputs]
        assert all(matches(g, t) for t in texts), texts
        assert len(set(texts)) > 1  # sampled, each sequence with its own grammar state


def test_session_and_streaming_follow_the_grammar(engine_dir, llm):
    guided = GuidedDecodingParams(regex=REGEX)
    with Session(engine_dir) as session:
        result = session.generate([5, 9, 17], SamplingParams(max_tokens=60, guided_decoding=guided))
        assert matches(guided, result.text) and result.finish_reason == "stop"
    streamed = "".join(llm.stream_sync([5, 9, 17], SamplingParams(max_tokens=60, guided_decoding=guided)))
    assert streamed == result.text


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of json, json_object, regex, choice, grammar; got none"),
    ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
    ({"json": "{not json"}, "the guided json schema is not JSON"),
    ({"json": "[1, 2]"}, "must be a JSON object"),
    ({"choice": "yes"}, "choice must be a list of non-empty strings"),
    ({"choice": ["yes", ""]}, "choice must be a list of non-empty strings"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"json_object": "yes"}, "json_object must be True or False"),
    ({"json": "[" * 100_000}, "the guided json schema is not JSON"),
    ({"json": {"enum": {1, 2}}}, "the guided json schema is not JSON"),
    ({"json": 0}, "the guided json schema must be a JSON object, got 0"),
    ({"json": "true"}, "the guided json schema must be a JSON object, got True; send an object schema"),
    ({"json": {"type": "number", "maximum": float("inf")}}, "the guided json schema is not JSON"),
    ({"choice": {"a": 1}}, "choice must be a list of non-empty strings"),
])
def test_bad_guided_params_are_refused(kwargs, message):
    with pytest.raises(RequestError, match=re.escape(message)):
        GuidedDecodingParams(**kwargs)


def test_large_choices_unlisted_keys_and_an_end_id_the_grammar_ends_on(llm):
    words = [f"w{i}" for i in range(5000)]
    out = llm.generate([5, 6], SamplingParams(max_tokens=10, guided_decoding=GuidedDecodingParams(
        choice=(w for w in words))), use_tqdm=False)[0].outputs[0]
    assert out.text in words and out.finish_reason == "stop"
    open_schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    out = llm.generate([5, 6], SamplingParams(max_tokens=40, guided_decoding=GuidedDecodingParams(json=open_schema)),
                       use_tqdm=False)[0].outputs[0]
    assert list(json.loads(out.text)) == ["a"]  # no additionalProperties: none allowed (vLLM's, TensorRT-LLM's)
    kept = GuidedDecodingParams(json={**open_schema, "additionalProperties": True})
    assert json.loads(kept.json)["additionalProperties"] is True
    eos = llm.engine.eos_token_ids[0]
    out = llm.generate([5, 6], SamplingParams(max_tokens=10, ignore_eos=True, logit_bias={eos: 100},
                                              guided_decoding=GuidedDecodingParams(choice=["ab", "abcd"])),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == eos and out.stop_token_id == eos and out.finish_reason == "stop"
    shown = llm.generate([5, 6], SamplingParams(max_tokens=10, ignore_eos=True, logit_bias={eos: 100},
                                                skip_special_tokens=False,
                                                guided_decoding=GuidedDecodingParams(choice=["ab", "abcd"])),
                         use_tqdm=False)[0].outputs[0]
    assert shown.text == out.text and shown.stop_token_id == eos  # the end id's text stays out, as a stop token's


def test_closing_object_schemas_touches_subschemas_only_and_keeps_all_of_satisfiable(llm):
    """Values (const, enum, default) are never rewritten: the output still equals the user's const; the branches of
    an allOf stay open, their parent closed over all their properties (each closed alone refused the schema)."""
    const = {"type": "object", "properties": {"x": {"const": {"properties": 1}}}, "required": ["x"]}
    closed = json.loads(GuidedDecodingParams(json=const).json)
    assert closed["properties"]["x"] == {"const": {"properties": 1}} and closed["additionalProperties"] is False
    both = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}, "required": ["a"]},
                      {"type": "object", "properties": {"b": {"type": "integer", "maximum": 9}}, "required": ["b"]}]}
    for schema, check in ((const, lambda v: v == {"x": {"properties": 1}}),
                          (both, lambda v: sorted(v) == ["a", "b"])):
        out = llm.generate([5, 6], SamplingParams(max_tokens=40, guided_decoding=GuidedDecodingParams(json=schema)),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and check(json.loads(out.text)), out.text
    nested = json.loads(GuidedDecodingParams(json={"type": "array", "items": {"properties": {"k": {}}},
                                                   "default": [{"properties": {}}]}).json)
    assert nested["items"]["additionalProperties"] is False and nested["default"] == [{"properties": {}}]
    assert GuidedDecodingParams(regex="[0-9]+", json_object=None).json_object is False  # vLLM's default


def test_objects_that_may_have_more_properties_are_left_open(llm):
    """Closed, these would refuse what their schema allows (llguidance: "unsatisfiable"): a union beside a parent's
    properties (and that union's branches), a required name the parent does not list. An allOf branch that names a
    definition is that definition, merged as the others are (the parent closed over all their properties)."""
    ref = {"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
           "type": "object", "allOf": [{"$ref": "#/$defs/Base"}], "properties": {"ok": {"type": "boolean"}},
           "required": ["ok", "id"]}
    union = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}]}
    unlisted = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok", "id"]}
    beside = {**{k: v for k, v in ref.items() if k != "allOf"}, "$ref": "#/$defs/Base"}  # a $ref beside properties
    refs = {**union, "$defs": ref["$defs"], "anyOf": [{"$ref": "#/$defs/Base"}]}  # a union of definitions beside
    for schema in (ref, union, unlisted, beside, refs):
        guided = GuidedDecodingParams(json=schema)
        rewritten = json.loads(guided.json)
        assert rewritten.get("additionalProperties") is (False if schema in (ref, beside) else None)
        assert all("additionalProperties" not in branch for branch in rewritten.get("anyOf", []))
        out = llm.generate([5, 6], SamplingParams(max_tokens=3, guided_decoding=guided), use_tqdm=False)[0]
        assert out.outputs[0].text.startswith("{")  # the grammar compiled: the schema is satisfiable
    merged = json.loads(GuidedDecodingParams(json=ref).json)
    assert list(merged["properties"]) == ["id", "ok"] and merged["$defs"]["Base"]["additionalProperties"] is False
    looped = {"$defs": {"Self": {"allOf": [{"$ref": "#/$defs/Self"}], "properties": {"a": {}}}},
              "allOf": [{"$ref": "#/$defs/Self"}], "properties": {"b": {}}}
    assert json.loads(GuidedDecodingParams(json=looped).json)["allOf"][0]["allOf"] == [{"$ref": "#/$defs/Self"}]


def test_all_of_branches_that_extend_the_object_leave_it_open(llm):
    """An allOf branch requiring a name no branch lists, or holding a union of its own: closed, the parent (or the
    union's branches) would refuse what the schema allows (llguidance: "unsatisfiable")."""
    small = {"type": "integer", "minimum": 0, "maximum": 9}
    required = {"allOf": [{"type": "object", "properties": {"a": small}, "required": ["a"]}, {"required": ["c"]}]}
    union = {"type": "object", "allOf": [{"properties": {"a": {"type": "boolean"}}, "required": ["a"]},
                                         {"anyOf": [{"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]}]}
    for schema in (required, union):
        guided = GuidedDecodingParams(json=schema)
        rewritten = json.loads(guided.json)
        assert "additionalProperties" not in rewritten
        assert all("additionalProperties" not in b for branch in rewritten["allOf"] for b in branch.get("anyOf", []))
        out = llm.generate([5, 6], SamplingParams(max_tokens=4, guided_decoding=guided), use_tqdm=False)[0]
        assert out.outputs[0].text.startswith("{")  # the grammar compiled: the schema is satisfiable
    assert json.loads(GuidedDecodingParams(json=union).json)["allOf"][0] == union["allOf"][0]
    nested = {"allOf": [{"allOf": [{"required": ["a"]}]}, {"properties": {"b": {}}, "required": ["b"]}]}
    assert "additionalProperties" not in json.loads(GuidedDecodingParams(json=nested).json)  # a's from the inner allOf


def test_a_union_in_an_all_of_branch_alone_stays_closed():
    """Nothing else adds properties to the object: the union's branches stay closed, as before allOf branches
    could extend each other."""
    a = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    b = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}
    rewritten = json.loads(GuidedDecodingParams(json={"type": "object", "allOf": [{"anyOf": [a, b]}]}).json)
    assert [branch["additionalProperties"] for branch in rewritten["allOf"][0]["anyOf"]] == [False, False]
    union = {"$defs": {"U": {"oneOf": [a, b]}}, "allOf": [{"$ref": "#/$defs/U"}]}
    rewritten = json.loads(GuidedDecodingParams(json=union).json)
    assert [branch["additionalProperties"] for branch in rewritten["allOf"][0]["oneOf"]] == [False, False]


def test_a_schemas_own_guidance_settings_keep_the_compact_layout(llm):
    """x-guidance options (here llguidance's coerce_one_of, for a oneOf it cannot prove disjoint) change what they
    name only: the JSON keeps the compact layout."""
    schema = {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 5},
                                                               {"type": "integer", "minimum": 3, "maximum": 9}]}},
              "required": ["v"]}
    with pytest.raises(RequestError, match="coerce_one_of"):
        llm.generate([5, 6], SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(json=schema)),
                     use_tqdm=False)
    guided = GuidedDecodingParams(json={**schema, "x-guidance": {"coerce_one_of": True}})
    for seed in range(3):
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, guided_decoding=guided)
        text = llm.generate([5, 6], params, use_tqdm=False)[0].outputs[0].text
        assert re.fullmatch(r'\{"v": [0-9]\}', text), text
    for given, wanted in (({"coerce_one_of": True, "whitespace_flexible": True}, None),
                          ({"whitespace_pattern": "[ ]*"}, None),
                          ({"item_separator": ","}, {**COMPACT, "item_separator": ","}),
                          ({"whitespace_flexible": False}, COMPACT)):
        # free whitespace replaces the compact layout (whose separators would still bind); a separator alone does not
        grammar = GuidedDecodingParams(json={**schema, "x-guidance": given}).llguidance_grammar()
        assert json.loads(grammar)["grammars"][0]["json_schema"]["x-guidance"] == (wanted or given)


def test_guide_text_that_is_not_unicode_is_refused():
    for kwargs in ({"regex": "a\ud800"}, {"choice": ["ok", "\ud800"]}, {"grammar": 'start: "\ud800"'}):
        with pytest.raises(RequestError, match="is not valid Unicode"):
            GuidedDecodingParams(**kwargs)


def test_bad_grammars_are_refused_before_anything_runs(llm):
    for guided, message in ((GuidedDecodingParams(regex="a(b"), "unclosed group"),
                            (GuidedDecodingParams(regex="[^\x00-\U0010FFFF]"), "guided decoding"),
                            (GuidedDecodingParams(grammar="start: nothing_defined"), "guided decoding"),
                            (GuidedDecodingParams(grammar="root ::= ("), "the grammar does not compile"),  # GBNF
                            (GuidedDecodingParams(grammar="root ::= foo"), "Rule 'foo' not found"),
                            (GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "strin"}}}),
                             "guided decoding")):
        with pytest.raises(RequestError, match=message):
            llm.submit([5, 6], SamplingParams(max_tokens=4, guided_decoding=guided), lambda output: None)
    with pytest.raises(RequestError, match="guided_decoding must be a GuidedDecodingParams"):
        SamplingParams(guided_decoding={"json": SCHEMA})
    assert llm.load().running == 0 and llm.load().waiting == 0
