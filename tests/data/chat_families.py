"""Tokenizers of seven chat-template families, built locally (no download): each a small BPE trained here plus the
family's special tokens, its published chat template, its tokenizer_config.json settings (bos, eos) and its
generation_config.json eos ids, in the published formats of:

  qwen3     Qwen/Qwen3-8B (ChatML with <think> blocks, tool calls in <tool_call> tags; byte-level BPE)
  llama3    meta-llama/Llama-3.1-8B-Instruct (header ids, <|eot_id|>, JSON tool calls; byte-level BPE)
  gemma     google/gemma-2-2b-it (<start_of_turn>/<end_of_turn>, no system role; sentencepiece-style BPE)
  llama2    meta-llama/Llama-2-7b-chat-hf ([INST] ... [/INST], <<SYS>>, </s>; sentencepiece-style BPE)
  gpt-oss   openai/gpt-oss-20b (harmony: channels, <|return|>, <|call|>; the builtin browser/python tool text of
            its template is left out, the rest is the template transformers' converter writes)
  deepseek  deepseek-ai/DeepSeek-R1-Distill-Qwen-32B (its generation prompt opens <think>, which its rendering of a
            finished turn drops: the case specdistill/data/chat.py refuses, naming the row)
  glm       zai-org/GLM-4.5 (role headers <|user|>, <|assistant|>, <|observation|> and nothing after an assistant
            message: the target ends a turn by emitting the next header, a stop id of its generation_config.json;
            a turn's reasoning is dropped once a user message follows; XML-style tool calls)

`STOP[family]` is the family's published stop tokens (generation_config.json eos), written out here so tests compare
against them rather than against what specdistill derives. `tiny_target` adds a small Llama fitted to a set of
token sequences (so its greedy generation of a turn can be compared with the trained tokens).
"""

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

LLAMA3 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")

LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
          "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
          "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
          "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
          "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
          "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
          "{% endfor %}")

GPT_OSS = """{#- the builtin browser/python tool descriptions (render_builtin_tools) are left out #}
{%- macro render_typescript_type(param_spec, required_params, is_nullable=false) -%}
    {%- if param_spec.type == "array" -%}
        {%- if param_spec['items'] -%}
            {%- if param_spec['items']['type'] == "string" -%}
                {{- "string[]" }}
            {%- elif param_spec['items']['type'] == "number" -%}
                {{- "number[]" }}
            {%- elif param_spec['items']['type'] == "integer" -%}
                {{- "number[]" }}
            {%- elif param_spec['items']['type'] == "boolean" -%}
                {{- "boolean[]" }}
            {%- else -%}
                {%- set inner_type = render_typescript_type(param_spec['items'], required_params) -%}
                {%- if inner_type == "object | object" or inner_type|length > 50 -%}
                    {{- "any[]" }}
                {%- else -%}
                    {{- inner_type + "[]" }}
                {%- endif -%}
            {%- endif -%}
            {%- if param_spec.nullable -%}
                {{- " | null" }}
            {%- endif -%}
        {%- else -%}
            {{- "any[]" }}
            {%- if param_spec.nullable -%}
                {{- " | null" }}
            {%- endif -%}
        {%- endif -%}
    {%- elif param_spec.type == "string" -%}
        {%- if param_spec.enum -%}
            {{- '"' + param_spec.enum|join('" | "') + '"' -}}
        {%- else -%}
            {{- "string" }}
            {%- if param_spec.nullable %}
                {{- " | null" }}
            {%- endif -%}
        {%- endif -%}
    {%- elif param_spec.type == "number" -%}
        {{- "number" }}
    {%- elif param_spec.type == "integer" -%}
        {{- "number" }}
    {%- elif param_spec.type == "boolean" -%}
        {{- "boolean" }}
    {%- else -%}
        {{- "any" }}
    {%- endif -%}
{%- endmacro -%}

{%- macro render_tool_namespace(namespace_name, tools) -%}
    {{- "## " + namespace_name + "\\n\\n" }}
    {{- "namespace " + namespace_name + " {\\n\\n" }}
    {%- for tool in tools %}
        {%- set tool = tool.function %}
        {{- "// " + tool.description + "\\n" }}
        {{- "type "+ tool.name + " = " }}
        {%- if tool.parameters and tool.parameters.properties %}
            {{- "(_: {\\n" }}
            {%- for param_name, param_spec in tool.parameters.properties.items() %}
                {%- if param_spec.description %}
                    {{- "// " + param_spec.description + "\\n" }}
                {%- endif %}
                {{- param_name }}
                {%- if param_name not in (tool.parameters.required or []) -%}
                    {{- "?" }}
                {%- endif -%}
                {{- ": " }}
                {{- render_typescript_type(param_spec, tool.parameters.required or []) }}
                {%- if not loop.last %}
                    {{- ",\\n" }}
                {%- else %}
                    {{- ",\\n" }}
                {%- endif -%}
            {%- endfor %}
            {{- "}) => any;\\n\\n" }}
        {%- else -%}
            {{- "() => any;\\n\\n" }}
        {%- endif -%}
    {%- endfor %}
    {{- "} // namespace " + namespace_name }}
{%- endmacro -%}

{%- macro build_system_message() -%}
    {%- if model_identity is not defined %}
        {%- set model_identity = "You are ChatGPT, a large language model trained by OpenAI." %}
    {%- endif %}
    {{- model_identity + "\\n" }}
    {{- "Knowledge cutoff: 2024-06\\n" }}
    {{- "Current date: " + strftime_now("%Y-%m-%d") + "\\n\\n" }}
    {%- if reasoning_effort is not defined %}
        {%- set reasoning_effort = "medium" %}
    {%- endif %}
    {{- "Reasoning: " + reasoning_effort + "\\n\\n" }}
    {{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
    {%- if tools -%}
        {{- "\\nCalls to these tools must go to the commentary channel: 'functions'." }}
    {%- endif -%}
{%- endmacro -%}

{{- "<|start|>system<|message|>" }}
{{- build_system_message() }}
{{- "<|end|>" }}

{%- if messages[0].role == "developer" or messages[0].role == "system" %}
    {%- set developer_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set developer_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}

{%- if developer_message or tools %}
    {{- "<|start|>developer<|message|>" }}
    {%- if developer_message %}
        {{- "# Instructions\\n\\n" }}
        {{- developer_message }}
    {%- endif %}
    {%- if tools -%}
        {{- "\\n\\n" }}
        {{- "# Tools\\n\\n" }}
        {{- render_tool_namespace("functions", tools) }}
    {%- endif -%}
    {{- "<|end|>" }}
{%- endif %}

{%- set last_tool_call = namespace(name=none) %}
{%- for message in loop_messages -%}
    {%- if message.role == 'assistant' -%}
        {%- if "content" in message %}
            {%- if "<|channel|>analysis<|message|>" in message.content or "<|channel|>final<|message|>" in message.content %}
                {{- raise_exception("You have passed a message containing <|channel|> tags in the content field.") }}
            {%- endif %}
        {%- endif %}
        {%- if "thinking" in message %}
            {%- if "<|channel|>analysis<|message|>" in message.thinking or "<|channel|>final<|message|>" in message.thinking %}
                {{- raise_exception("You have passed a message containing <|channel|> tags in the thinking field.") }}
            {%- endif %}
        {%- endif %}
        {%- if "tool_calls" in message %}
            {%- set future_final_message = namespace(found=false) %}
            {%- for future_message in loop_messages[loop.index:] %}
                {%- if future_message.role == 'assistant' and "tool_calls" not in future_message %}
                    {%- set future_final_message.found = true %}
                {%- endif %}
            {%- endfor %}
            {%- set tool_call = message.tool_calls[0] %}
            {%- if tool_call.function %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {%- if message.content and message.thinking %}
                {{- raise_exception("Cannot pass both content and thinking in an assistant message with tool calls!") }}
            {%- elif message.content and not future_final_message.found %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.content + "<|end|>" }}
            {%- elif message.thinking and not future_final_message.found %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant to=" }}
            {{- "functions." + tool_call.name + "<|channel|>commentary " }}
            {{- (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" }}
            {{- tool_call.arguments|tojson }}
            {{- "<|call|>" }}
            {%- set last_tool_call.name = tool_call.name %}
        {%- elif loop.last and not add_generation_prompt %}
            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
            {%- set last_tool_call.name = none %}
        {%- endif %}
    {%- elif message.role == 'tool' -%}
        {%- if last_tool_call.name is none %}
            {{- raise_exception("Message has tool role, but there was no previous assistant message with a tool call!") }}
        {%- endif %}
        {{- "<|start|>functions." + last_tool_call.name }}
        {{- " to=assistant<|channel|>commentary<|message|>" + message.content|tojson + "<|end|>" }}
    {%- elif message.role == 'user' -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}"""

DEEPSEEK_R1 = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = "
    "namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') %}{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}"
    "{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set "
    "ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and "
    "message['content'] is not none %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + "
    "'<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{% set content = message['content'] %}{% if "
    "'</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}{{'<｜Assistant｜>' + "
    "content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if add_generation_prompt and not "
    "ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}")

GLM = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
<arg_key>{arg-key-2}</arg_key>
<arg_value>{arg-value-2}</arg_value>
...
</tool_call>{%- endif -%}
{%- macro visible_text(content) -%}
    {%- if content is string -%}
        {{- content }}
    {%- elif content is iterable and content is not mapping -%}
        {%- for item in content -%}
            {%- if item is mapping and item.type == 'text' -%}
                {{- item.text }}
            {%- elif item is string -%}
                {{- item }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- content }}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user_index=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {% set ns.last_user_index = loop.index0 -%}
    {%- endif %}
{%- endfor %}
{% for m in messages %}
{%- if m.role == 'user' -%}<|user|>
{% set content = visible_text(m.content) %}{{ content }}
{{- '/nothink' if (enable_thinking is defined and not enable_thinking and not content.endswith("/nothink")) else '' -}}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set reasoning_content = '' %}
{%- set content = visible_text(m.content) %}
{%- if m.reasoning_content is string %}
    {%- set reasoning_content = m.reasoning_content %}
{%- else %}
    {%- if '</think>' in content %}
        {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
{%- endif %}
{%- if loop.index0 > ns.last_user_index and reasoning_content -%}
{{ '\\n<think>' + reasoning_content.strip() +  '</think>'}}
{%- else -%}
{{ '\\n<think></think>' }}
{%- endif -%}
{%- if content.strip() -%}
{{ '\\n' + content.strip() }}
{%- endif -%}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{ '\\n<tool_call>' + tc.name }}
{% set _args = tc.arguments %}
{% for k, v in _args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}
{% endif %}
{%- elif m.role == 'tool' -%}
{%- if m.content is string -%}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
    {{- '<|observation|>' }}
{%- endif %}
{{- '\\n<tool_response>\\n' }}
{{- m.content }}
{{- '\\n</tool_response>' }}
{%- else -%}
<|observation|>{% for tr in m.content %}

<tool_response>
{{ tr.output if tr.output is defined else tr }}
</tool_response>{% endfor -%}
{% endif -%}
{%- elif m.role == 'system' -%}
<|system|>
{{ visible_text(m.content) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|assistant|>{{- '\\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}}
{%- endif -%}"""

# family -> (template, special tokens (the first ones in this order get ids 0, 1, ...), bos, eos, pad,
#            sentencepiece-style, non-special added tokens, generation_config eos)
FAMILIES = {
    "qwen3": (QWEN3, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|endoftext|>", False,
              ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
              ["<|im_end|>", "<|endoftext|>"]),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"], "<|begin_of_text|>", "<|eot_id|>", None, False,
               [], ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    "gemma": (GEMMA, ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>",
              "<pad>", True, [], ["<eos>", "<end_of_turn>"]),
    "llama2": (LLAMA2, ["<unk>", "<s>", "</s>"], "<s>", "</s>", None, True, [], ["</s>"]),
    "gpt-oss": (GPT_OSS, ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                          "<|start|>", "<|end|>", "<|message|>", "<|call|>"], "<|startoftext|>", "<|return|>",
                "<|endoftext|>", False, [], ["<|return|>", "<|endoftext|>", "<|call|>"]),
    "deepseek": (DEEPSEEK_R1, ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                               "<｜tool▁outputs▁end｜>"], "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                 "<｜end▁of▁sentence｜>", False, ["<think>", "</think>"], ["<｜end▁of▁sentence｜>"]),
    "glm": (GLM, ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|observation|>"], None, "<|endoftext|>", "<|endoftext|>", False,
            ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
             "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "/nothink"],
            ["<|endoftext|>", "<|user|>", "<|observation|>"]),
}
# The token that ends an assistant turn of plain text, per family (what the target emits last).
# GLM writes none: its target stops by emitting the next message's header, a user's after a plain text turn.
END_OF_TURN = {"qwen3": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>", "llama2": "</s>",
               "gpt-oss": "<|return|>", "deepseek": "<｜end▁of▁sentence｜>", "glm": "<|user|>"}
ENDS_BY_NEXT_HEADER = {"glm"}  # families whose rendering of a finished turn has no end-of-turn token
STOP = {name: set(spec[7]) | {END_OF_TURN[name]} for name, spec in FAMILIES.items()}
CORPUS = ("The quick brown fox jumps over the lazy dog. Find red trail shoes under $120, sorted by price; "
          'JSON: {"name": "search", "arguments": {"query": "tents", "max": 3}} [INST] <<SYS>> 0123456789 '
          "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ \n\t")


def build_tokenizer(family: str, out_dir: Path, texts: list[str] = (), vocab_size: int = 600) -> Path:
    """tokenizer.json, tokenizer_config.json and generation_config.json of `family` in `out_dir`."""
    template, specials, bos, eos, pad, spm, added, gen_eos = FAMILIES[family]
    out_dir.mkdir(parents=True, exist_ok=True)
    if spm:  # sentencepiece-style: spaces as ▁, pieces within words, a prefix space on the first word (Llama 2)
        tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first" if family == "llama2" else "never",
                                                     split=True)
        tok.decoder = decoders.Metaspace(prepend_scheme="first" if family == "llama2" else "never", split=True)
        alphabet = sorted(set("".join([CORPUS, *texts]).replace(" ", "▁")))
    else:  # byte-level BPE (Qwen, Llama 3, gpt-oss, DeepSeek)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator([CORPUS, *texts] * 3, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    tok.save(str(out_dir / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": pad,
              "unk_token": "<unk>" if "<unk>" in specials else None, "clean_up_tokenization_spaces": False,
              "model_max_length": 4096, "chat_template": template}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    ids = [tok.token_to_id(t) for t in gen_eos]
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": ids if len(ids) > 1 else ids[0]}))
    return out_dir


def tiny_target(tok_dir: Path, sequences: list[tuple[list[int], int]], steps: int = 400, seed: int = 0) -> Path:
    """A 2-layer Llama (config.json + model.safetensors) in `tok_dir`, fitted on (tokens, first trained position)
    pairs until it reproduces each sequence's trained part greedily."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    torch.manual_seed(seed)
    longest = max(len(s) for s, _ in sequences)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=max(512, longest + 64), tie_word_embeddings=True,
                         pad_token_id=0, bos_token_id=None, eos_token_id=None)
    model = LlamaForCausalLM(config)
    batch = torch.zeros(len(sequences), longest, dtype=torch.long)
    labels = torch.full_like(batch, -100)
    mask = torch.zeros_like(batch)
    for i, (s, first) in enumerate(sequences):
        batch[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
        labels[i, first:len(s)] = torch.tensor(s[first:])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ops this small only lose to thread hand-offs on a busy machine
    try:
        for _ in range(steps):
            out = model(input_ids=batch, attention_mask=mask, labels=labels)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            if _margin(out.logits[:, :-1], labels[:, 1:]) > 2.0:
                break  # every trained token wins by a margin: greedy generation reproduces it, padded or not
        else:
            raise AssertionError(f"tiny target not fitted in {steps} steps (loss {out.loss.item():.3f})")
    finally:
        torch.set_num_threads(threads)
    generation_config = (tok_dir / "generation_config.json").read_text()
    model.save_pretrained(str(tok_dir))
    (tok_dir / "generation_config.json").write_text(generation_config)  # save_pretrained writes its own
    return tok_dir


def _margin(logits, labels):
    """The smallest lead of a trained token's logit over the best other one."""
    import torch

    trained = labels != -100
    picked = logits.detach()[trained]
    target = labels[trained]
    true = picked.gather(1, target[:, None])[:, 0]
    other = picked.scatter(1, target[:, None], float("-inf")).max(1).values
    return float(torch.min(true - other))
