"""OpenAI function calling on a real server, driven by the official client: a named or required tool choice gives
calls that follow the tools' schemas and equal the Python API's guided output of the same prompt; "auto" reads the
model's own <tool_call> blocks; streams add up to the whole response; the tools reach the prompt through the chat
template (or camshaft's tool preamble where the template has none)."""

from __future__ import annotations

import json
import re

import httpx
import llguidance
import llguidance.hf
import openai
import pytest
from test_openai_server import MODEL, running_server, tiny_engine

from camshaft.errors import RequestError
from camshaft.openai_server.tool_call_json import Llama3JsonReader, MistralReader
from camshaft.openai_server.tool_calls import ArrayReader, HermesReader
from camshaft.openai_server.tools import tool_choice
from camshaft.runtime.chat_template import TOOLS_PREAMBLE, ChatOptions
from camshaft.runtime.guided import GuidedDecodingParams
from camshaft.runtime.session import Session

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    return tiny_engine(tmp_path_factory)


@pytest.fixture(scope="module")
def served(engine_dir):
    with running_server(engine_dir, tool_call_parser="hermes") as (url, llm):
        yield url, llm


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def session(engine_dir):
    with Session(engine_dir) as session:
        yield session


def valid(name: str, arguments: str) -> bool:
    value = json.loads(arguments)
    if name == "get_weather":
        return set(value) == {"city", "days"} and re.fullmatch("[a-z]{1,8}", value["city"]) is not None \
            and 1 <= value["days"] <= 7
    return value == {"zone": "utc"} or value == {"zone": "cet"}


def streamed(client, **body) -> tuple[dict[int, dict], str, str | None]:
    """Tool calls by index (id, name, joined arguments), the joined content and the finish reason of a stream."""
    calls: dict[int, dict] = {}
    content, reason = "", None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **body):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        reason = choice.finish_reason or reason
        for call in choice.delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
            assert call.id in (None, entry["id"]) and call.function.name in (None, entry["name"])
            entry["arguments"] += call.function.arguments or ""
    return calls, content, reason


def test_a_named_function_gives_its_arguments_as_the_python_api_does(client, session, served):
    body = dict(messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=80)
    response = client.chat.completions.create(model=MODEL, **body)
    choice = response.choices[0]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and re.fullmatch("[A-Za-z0-9]{9}", call.id)
    assert valid("get_weather", call.function.arguments) and choice.message.content is None
    assert choice.finish_reason == "stop"
    expected = session.chat(MESSAGES, tools=TOOLS, temperature=0, max_tokens=80,
                            guided_decoding=GuidedDecodingParams(json=WEATHER))
    assert call.function.arguments == expected.text
    assert response.usage.prompt_tokens == len(served[1].encode(messages=MESSAGES, tools=TOOLS))
    calls, content, reason = streamed(client, **body)
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == expected.text
    assert content == "" and reason == "stop" and list(calls) == [0]


def test_required_calls_follow_the_tools_schemas_streamed_or_not(client):
    for parallel in (False, True):
        body = dict(messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
                    temperature=1.0, seed=3, max_tokens=200, n=3)
        response = client.chat.completions.create(model=MODEL, **body)
        for choice in response.choices:
            calls = choice.message.tool_calls
            assert choice.finish_reason == "tool_calls" and calls and (parallel or len(calls) == 1)
            assert all(valid(c.function.name, c.function.arguments) for c in calls)
            assert len({c.id for c in calls}) == len(calls)
        one = dict(body, n=1)
        whole = client.chat.completions.create(model=MODEL, **one).choices[0]
        calls, content, reason = streamed(client, **one)
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert content == "" and reason == "tool_calls"
    cut = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         temperature=0, max_tokens=12).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None and cut.message.tool_calls is None


def test_required_calls_take_parameters_with_definitions(client, served):
    """pydantic writes nested models and enums as $defs and $refs: they move to the root of the calls' array schema,
    where the references now start; two functions defining one name differently are refused."""
    unit = {"$defs": {"Unit": {"enum": ["c", "f"]}}, "type": "object",
            "properties": {"unit": {"$ref": "#/$defs/Unit"}}, "required": ["unit"]}
    tools = [{"type": "function", "function": {"name": "get_unit", "parameters": unit}}]
    choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools, tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=60).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments)["unit"] in ("c", "f") for c in choice.message.tool_calls] == [True]
    other = {"type": "function", "function": {"name": "other", "parameters": {**unit, "$defs": {"Unit": {}}}}}
    body = {"model": MODEL, "messages": MESSAGES, "tools": [*tools, other], "tool_choice": "required"}
    refused = httpx.post(f"{served[0]}/v1/chat/completions", json=body)
    assert refused.status_code == 400 and "define $defs/Unit unlike another" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "tools"


def test_required_calls_keep_a_schemas_references_to_itself(served):
    """A function's parameters sit inside the calls' array schema: "#" (a recursive schema) and "#/properties/..."
    still mean the parameters, as with a named tool_choice (they meant the array of calls, or nothing)."""
    llm = served[1]
    vocab = llm.engine.manifest.model.vocab_size
    tokenizer = llguidance.hf.from_tokenizer(llm.tokenizer, n_vocab=vocab, eos_token=list(llm.engine.eos_token_ids))

    def allows(tools: list[dict], text: str) -> bool:
        grammar = tool_choice(tools, "required", True, None).guided().llguidance_grammar()
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher.consume_tokens(llm.tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.is_accepting()

    tree = {"type": "object", "properties": {"name": {"type": "string"},
                                             "children": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["name", "children"]}
    same = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}},
            "required": ["a", "b"]}
    tools = [{"type": "function", "function": {"name": "tree", "parameters": tree}},
             {"type": "function", "function": {"name": "same", "parameters": same}}]
    leaf = '{"name": "b", "children": []}'
    assert allows(tools, '[{"name": "tree", "parameters": {"name": "a", "children": [' + leaf + ']}}]')
    assert not allows(tools, '[{"name": "tree", "parameters": {"name": "a", "children": [[{"name": "tree", '
                             '"parameters": ' + leaf + '}]]}}]')
    assert allows(tools, '[{"name": "same", "parameters": {"a": 1, "b": 2}}]')
    assert not allows(tools, '[{"name": "same", "parameters": {"a": 1, "b": "x"}}]')


def test_auto_reads_the_models_tool_call_blocks(client, session):
    arguments = r'\{"city": "[a-z]{2,5}", "days": [1-7]\}'
    regex = r'Sure\.<tool_call>\{"name": "get_weather", "arguments": ' + arguments + r'\}</tool_call>'
    body = dict(messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=120, extra_body={"guided_regex": regex})
    choice = client.chat.completions.create(model=MODEL, **body).choices[0]
    raw = session.chat(MESSAGES, tools=TOOLS, temperature=0, max_tokens=120,
                       guided_decoding=GuidedDecodingParams(regex=regex)).text
    (call,) = choice.message.tool_calls
    assert choice.message.content == "Sure." and choice.finish_reason == "tool_calls"
    block = json.loads(raw[raw.index("<tool_call>") + len("<tool_call>"):raw.index("</tool_call>")])
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == block["arguments"]
    calls, content, reason = streamed(client, **body)
    assert content == "Sure." and reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=0,
                                           max_tokens=12).choices[0]
    expected = session.chat(MESSAGES, tools=TOOLS, temperature=0, max_tokens=12)
    assert plain.message.tool_calls is None and plain.message.content == (expected.text.strip() or None)
    special = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=3, logit_bias={"1": 100})  # <|im_start|>
    assert client.chat.completions.create(**special).choices[0].message.content == "<|im_start|>" * 3  # tags kept
    assert client.chat.completions.create(**special, tool_choice="none").choices[0].message.content == ""


def test_none_leaves_the_tools_out_and_auto_needs_a_parser(client, served, engine_dir, session):
    none = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=8)
    assert none.usage.prompt_tokens == len(session.encode(messages=MESSAGES))
    counted = httpx.post(f"{served[0]}/tokenize", json={"messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"})
    assert counted.json()["count"] == none.usage.prompt_tokens  # the tools were counted in
    assert none.choices[0].message.content == session.chat(MESSAGES, temperature=0, max_tokens=8).text
    with running_server(engine_dir, max_batch_size=2) as (url, _):
        response = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES,
                                                                  "tools": TOOLS, "max_tokens": 4})
        assert response.status_code == 400 and "needs the server started with --tool-call-parser (hermes | " \
            "llama3_json | mistral)" in response.json()["error"]["message"]
        required = httpx.post(f"{url}/v1/chat/completions", json={
            "model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
            "parallel_tool_calls": False,
            "temperature": 0}).json()
        assert required["choices"][0]["finish_reason"] == "tool_calls"


def test_a_conversation_with_calls_and_results_renders_through_the_template(client, served, tmp_path, engine_dir):
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    response = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="required",
                                              temperature=0, max_tokens=200)
    llm = served[1]
    templated = [*history[:1], {**history[1], "content": "", "tool_calls": [
        {**history[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"city": "paris", "days": 1}}}
    ]}, history[2]]
    ids = llm.encode(messages=templated, tools=TOOLS)
    assert response.usage.prompt_tokens == len(ids)
    text = llm.tokenizer.decode(ids)
    assert TOOLS_PREAMBLE.split("{")[0] in text and '"name": "get_time"' in text  # SmolLM2-like: no tools in template
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "paris", "days": 1}}</tool_call>' in text
    assert "<|im_start|>tool\nsunny" in text
    quoted = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [  # arguments that are a JSON string
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '"paris"'}}]}]
    decoded_once = client.chat.completions.create(model=MODEL, messages=quoted, max_tokens=1)
    assert decoded_once.usage.prompt_tokens == len(llm.encode(messages=quoted))
    refused = httpx.post(f"{served[0]}/tokenize", json={"prompt": "hi", "tools": TOOLS})
    assert refused.status_code == 400 and "tools go with messages" in refused.json()["error"]["message"]


def test_an_assistants_earlier_reasoning_reaches_the_template():
    """Qwen3's template renders the reasoning of the turns since the last user message (a tool loop): it was
    dropped. vLLM passes reasoning (and reasoning_content) under both names."""
    from camshaft.openai_server.chat_protocol import ChatMessage

    for key in ("reasoning_content", "reasoning"):
        message = ChatMessage(role="assistant", content=None, tool_calls=[{"id": "c", "type": "function"}],
                              **{key: "I should call the tool"}).template_dict()
        assert message["reasoning_content"] == message["reasoning"] == "I should call the tool"
    assert "reasoning_content" not in ChatMessage(role="user", content="hi").template_dict()


def test_a_template_that_reads_tools_renders_them_itself(engine_dir, tmp_path):
    import shutil

    import transformers

    copy = tmp_path / "engine"
    shutil.copytree(engine_dir, copy)
    template = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
                "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
                "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    next(copy.rglob("chat_template.jinja")).write_text(template)
    history = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_time", "arguments": {"zone": "utc"}}}]}]
    reference = transformers.AutoTokenizer.from_pretrained(next(copy.rglob("chat_template.jinja")).parent)
    with Session(copy) as session:
        ids = session.encode(messages=history, tools=TOOLS)
        wire = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [  # OpenAI's form: JSON text
            {"type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]}]
        assert session.encode(messages=wire, tools=TOOLS) == ids  # not the text quoted again, as the server does
        bare = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [  # no "function" wrapper
            {"name": "get_time", "arguments": '{"zone": "utc"}'}]}]
        assert session.encode(messages=bare, tools=TOOLS) == ids
        with pytest.raises(RequestError, match="None only beside 'tool_calls'"):
            session.encode(messages=[*MESSAGES, {"role": "assistant", "content": None}])
        with pytest.raises(RequestError, match="tools go with chat messages"):
            session.encode("hi", tools=TOOLS)
        no_content = session.encode(messages=[*MESSAGES, {"role": "assistant", "tool_calls": history[1]["tool_calls"]}])
        assert "<tool_call>" in reference.decode(no_content)
    calls_template = template.split("{% endif %}", 1)[1]
    next(copy.rglob("chat_template.jinja")).write_text(calls_template)  # renders tool_calls, reads no tools
    with Session(copy) as session:
        text = reference.decode(session.encode(messages=history, tools=TOOLS))
    assert text.count("get_time") == 2 and "You may call" in text  # the function described once, the call once
    assert '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>' in text
    assert ids == reference.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    assert "Tools: get_weather get_time" in reference.decode(ids) and "You may call" not in reference.decode(ids)


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "names no function in tools (get_weather, get_time)"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice 'sometimes' is not one of"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "must be 1-64 letters"),
    ({"tools": TOOLS * 2}, "two tools are named 'get_weather'"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "leave out response_format"),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_time", "arguments": "{zone"}}]}]},
     "tool call 0's arguments are not JSON"),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [  # deeper than json.loads goes
        {"type": "function", "function": {"name": "get_time", "arguments": "[" * 5000 + "]" * 5000}}]}]},
     "tool call 0's arguments are not JSON"),
])
def test_bad_tool_requests_are_refused_saying_why(served, body, message):
    response = httpx.post(f"{served[0]}/v1/chat/completions",
                          json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body})
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def test_the_hermes_reader_gives_the_same_message_however_the_text_is_split():
    text = ('  Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "rome", "days": 2}}\n'
            '</tool_call>\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}')  # unclosed: the end id came first
    whole = _read(HermesReader({"get_weather", "get_time"}), [text])
    assert whole[0] == 'Checking.\n<tool_call>{"name": "unknown", "arguments": {}}</tool_call>'  # the call's gap once
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole[1]] == \
        [("get_weather", {"city": "rome", "days": 2}), ("get_time", {"zone": "utc"})]
    for size in (1, 2, 3, 5, 11):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        content, calls = _read(HermesReader({"get_weather", "get_time"}), pieces)
        assert content == whole[0] and [c["function"] for c in calls] == [c["function"] for c in whole[1]]
    first_only = _read(HermesReader({"get_weather", "get_time"}, parallel=False), [text])[1]
    assert [c["function"]["name"] for c in first_only] == ["get_weather"]
    assert _read(HermesReader({"f"}), ["a <tool_", "call x"]) == ("a <tool_call x", [])
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    for text, content in ((f"A {call} B", "A B"), (f"A\n\n{call}B", "A\n\nB"), (f"A {call}B", "A B"),
                          (f"A {call}\nB", "A\nB")):  # one separator left, never none
        for size in (1, 3, len(text)):
            assert _read(HermesReader({"f"}), [text[i:i + size] for i in range(0, len(text), size)])[0] == content
    array = ('<tool_call>[{"name": "get_time", "arguments": {"zone": "utc"}}, {"name": "get_weather", "arguments": '
             '{"city": "oslo"}}]</tool_call>')  # SmolLM2's trained form: a list of calls in one block
    for size in (1, 7, len(array)):
        content, calls = _read(HermesReader({"get_weather", "get_time"}),
                               [array[i:i + size] for i in range(0, len(array), size)])
        assert content == "" and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
        assert len({c["id"] for c in calls}) == 2
    assert [c["function"]["name"] for c in _read(HermesReader({"get_weather", "get_time"}, parallel=False),
                                                 [array])[1]] == ["get_time"]
    unknown = '<tool_call>[{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}]</tool_call>'
    assert _read(HermesReader({"get_time"}), [unknown]) == (unknown, [])  # a list with a stranger stays content


def test_the_json_readers_read_llama_and_mistral_calls_however_the_text_is_split():
    names = {"get_weather", "get_time"}
    cases = [
        (Llama3JsonReader, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "rome", "days": 2}}; '
                           '{"name": "get_time", "parameters": {"zone": "utc"}}', "", ["get_weather", "get_time"]),
        (Llama3JsonReader, ' {"name": "get_time", "parameters": {"zone": "cet"}}', "", ["get_time"]),
        (Llama3JsonReader, "It is sunny. {\"name\": \"get_time\"}", "It is sunny. {\"name\": \"get_time\"}", []),
        (Llama3JsonReader, '{"name": "unknown", "parameters": {}}', '{"name": "unknown", "parameters": {}}', []),
        (Llama3JsonReader, '<|python_tag|>print(1)', "<|python_tag|>print(1)", []),  # as written
        (MistralReader, 'Hi. [TOOL_CALLS][{"name": "nope", "arguments": {}}]', 'Hi. [TOOL_CALLS][{"name": "nope", '
                        '"arguments": {}}]', []),
        (MistralReader, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "utc"}}, {"name": "nope", '
                        '"arguments": {}}]', '{"name": "nope", "arguments": {}}]', ["get_time"]),
        (Llama3JsonReader, '<|python_ta', "<|python_ta", []),
        (MistralReader, 'Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "oslo", "days": 1}},'
                        ' {"name": "get_time", "arguments": {"zone": "utc"}}]', "Let me look. ",
         ["get_weather", "get_time"]),
        (MistralReader, "No calls [TOOL", "No calls [TOOL", []),
        (MistralReader, '[TOOL_CALLS]get_weather[ARGS]{"city": "oslo", "days": 1}[TOOL_CALLS]get_time{"zone": "utc"}',
         "", ["get_weather", "get_time"]),  # the newer tokenizers' form
        (Llama3JsonReader, '{"name": "get_time", "parameters": {"zone": "utc"}}\n[1] see the docs', "[1] see the docs",
         ["get_time"]),
        (Llama3JsonReader, '{"name": "get_time", "arguments": "{\\"zone\\": \\"utc\\"}"}', "", ["get_time"]),
        (Llama3JsonReader, '{"name": ["get_time"], "parameters": {}}', '{"name": ["get_time"], "parameters": {}}', []),
        (MistralReader, '[TOOL_CALLS][{"name": {"x": 1}, "arguments": {}}]', '[TOOL_CALLS][{"name": {"x": 1}, '
                        '"arguments": {}}]', []),
    ]
    for reader, text, content, called in cases:
        for size in (len(text), 1, 2, 5):
            got, calls = _read(reader(names), [text[i:i + size] for i in range(0, len(text), size)])
            assert got == content and [c["function"]["name"] for c in calls] == called, (text, size)
            assert [c["index"] for c in calls] == list(range(len(called)))
    assert len(_read(Llama3JsonReader(names, parallel=False), [cases[0][1]])[1]) == 1
    deep = '{"name": "get_time", "parameters": {"zone": ' + "[" * 5000  # a model looping on brackets
    for reader in (Llama3JsonReader(names), HermesReader(names)):
        text = deep if isinstance(reader, Llama3JsonReader) else "<tool_call>" + deep + "]" * 5000 + "}}</tool_call>"
        content, calls = _read(reader, [text[i:i + 700] for i in range(0, len(text), 700)])
        assert calls == [] and content.startswith(text[:20].strip())  # content, not an exception


def test_auto_with_the_llama3_json_parser(engine_dir, session):
    regex = r'\{"name": "get_weather", "parameters": \{"city": "[a-z]{2,5}", "days": [1-7]\}\}'
    with running_server(engine_dir, tool_call_parser="llama3_json", max_batch_size=2) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        body = dict(messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=120, extra_body={"guided_regex": regex})
        choice = client.chat.completions.create(model=MODEL, **body).choices[0]
        calls, content, reason = streamed(client, **body)
    raw = session.chat(MESSAGES, tools=TOOLS, temperature=0, max_tokens=120,
                       guided_decoding=GuidedDecodingParams(regex=regex)).text
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == reason == "tool_calls" and choice.message.content is None and content == ""
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == json.loads(raw)["parameters"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]


def test_required_calls_give_the_models_own_text_of_their_parameters():
    """tool_choice "required" decoded each call and wrote its parameters again: 1e999, which the number grammar
    allows, came out as Infinity (not JSON), and 1.10 as 1.1."""
    text = ('[ {"name": "f", "parameters": {"x": 1e999, "big": 12345678901234567890.5, "y": 1.10, "s": "a,}\\"b"}},'
            '{"parameters" :{} , "name":"g"}]')
    for size in (1, 3, len(text)):
        calls = _read(ArrayReader(), [text[i:i + size] for i in range(0, len(text), size)])[1]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            ("f", '{"x": 1e999, "big": 12345678901234567890.5, "y": 1.10, "s": "a,}\\"b"}'), ("g", "{}")]
        json.loads(calls[0]["function"]["arguments"], parse_constant=lambda name: pytest.fail(name))
    arguments = '{"x": 1e999, "y": 1.10}'  # the "auto" readers too
    for reader, text in ((HermesReader({"f"}), f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'),
                         (HermesReader({"f"}), f'<tool_call>[ {{"arguments" : {arguments}, "name": "f"}}]</tool_call>'),
                         (Llama3JsonReader({"f"}), f'{{"name": "f", "parameters": {arguments}}}'),
                         (MistralReader({"f"}), f'[TOOL_CALLS][{{"name": "f", "arguments": {arguments}}}]'),
                         (MistralReader({"f"}), f'[TOOL_CALLS]f[ARGS]{arguments}')):
        assert [c["function"]["arguments"] for c in _read(reader, [text])[1]] == [arguments], text


def _read(reader, pieces: list[str]) -> tuple[str, list[dict]]:
    content, calls = "", []
    for piece in pieces:
        text, more = reader.feed(piece)
        content, calls = content + text, calls + more
    text, more = reader.finish()
    return content + text, calls + more


def test_several_named_templates_and_none_for_the_chat_is_a_clear_error(engine_dir):
    """transformers' ValueError (several templates, no "default") was a traceback (a 500 on the server)."""
    from camshaft.runtime.chat_template import render_chat

    with Session(engine_dir) as session:
        tokenizer = session.tokenizer
        tokenizer.chat_template = {"rag": "{{ messages[0].content }}", "tool_use": "{{ tools }}"}
        with pytest.raises(RequestError, match=r"several chat templates \(rag, tool_use\) and none for this chat"):
            render_chat(tokenizer, MESSAGES)
        assert render_chat(tokenizer, MESSAGES, ChatOptions(tools=TOOLS))  # tools: the tool_use template


def test_tools_reach_a_template_that_refuses_a_system_turn(engine_dir):
    """Mistral v0.1's template raises on any system message: the one camshaft added to describe the tools made every
    request with tools fail. The description then goes in front of the first message."""
    from camshaft.runtime.chat_template import render_chat

    no_system = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('Conversation roles must "
                 "alternate user/assistant/user/assistant/...') }}{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n"
                 "{% endfor %}")
    with Session(engine_dir) as session:
        tokenizer = session.tokenizer
        tokenizer.chat_template = no_system
        text = render_chat(tokenizer, MESSAGES, ChatOptions(tools=TOOLS))
        assert text.startswith("[user] " + TOOLS_PREAMBLE.split("{")[0]) and text.endswith(
            MESSAGES[0]["content"] + "\n") and '"name": "get_weather"' in text
        with pytest.raises(RequestError, match="chat template refused the messages: Conversation roles must"):
            render_chat(tokenizer, [{"role": "system", "content": "be brief"}, *MESSAGES], ChatOptions(tools=TOOLS))


def test_chat_echo_keeps_the_continuations_leading_space_when_tools_are_read(served):
    """The auto reader strips what begins the content: behind the echo, a continuation's space went with it
    ("The answer is42 apples")."""
    from types import SimpleNamespace

    from camshaft.openai_server.responses import ChatShape
    from camshaft.openai_server.tools import tool_choice

    for parser in ("hermes", "llama3_json", "mistral"):
        tools = tool_choice(TOOLS, None, True, parser)
        shape = ChatShape(MODEL, served[1].tokenizer, tools, echo="The answer is")
        result = SimpleNamespace(text=" 42 apples", finish_reason="stop", stop_reason=None, logprobs=None)
        assert shape.choice(0, result, False)["message"]["content"] == "The answer is 42 apples", parser
        streamed = [shape.opening(1)[0]["delta"].get("content") or ""]
        for delta, finished in ((" 42", False), (" apples", True)):
            output = SimpleNamespace(delta=delta, finished=finished, result=result if finished else None, logprobs=())
            chunk = shape.chunk_choice(0, output, False)
            streamed.append(chunk["delta"].get("content", "") if chunk else "")
        assert "".join(streamed) == "The answer is 42 apples", parser
    # the echo is not read as the answer's start: a call written after it is still a call (llama3_json decides
    # calls or content by the answer's first characters), and the echo stays as written
    shape = ChatShape(MODEL, served[1].tokenizer, tool_choice(TOOLS, None, True, "llama3_json"), echo="  Let me\n")
    call = '{"name": "get_weather", "parameters": {"city": "paris", "days": 1}}'
    message = shape.choice(0, SimpleNamespace(text=call, finish_reason="stop", stop_reason=None, logprobs=None),
                           False)["message"]
    assert message["content"] == "  Let me\n" and message["tool_calls"][0]["function"]["name"] == "get_weather"


def test_required_calls_schema_reads_each_tool_once(monkeypatch):
    """guided() looked each function up by name in a fresh list of all of them: quadratic, 23 s on the event loop
    for 28k tools (every other request, /health included, waited)."""
    from camshaft.openai_server import tools as tools_module

    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}} for i in range(50)]
    choice = tools_module.tool_choice(tools, "required", True, "hermes")
    listed = []
    functions = tools_module.ToolChoice._functions
    monkeypatch.setattr(tools_module.ToolChoice, "_functions", lambda self: listed.append(1) or functions(self))
    schema = json.loads(choice.guided().json)
    assert len(listed) == 1 and [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == \
        [f"f{i}" for i in range(50)]
