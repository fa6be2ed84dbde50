"""Rondo's chat rendering against transformers' apply_chat_template with the real public Jinja templates
of Qwen2.5, Qwen3, Llama 3, Llama 3.1 (= 3.3), Llama 3.2 and Mistral 7B Instruct (v0.1, v0.3): the
rendered text, the token ids,
and the loss mask, which must equal transformers' assistant mask for the same template with
{% generation %} around the assistant output (the tagged copy is checked to render the same text)."""
import json
import os
import random
import sys

import pytest
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, os.path.dirname(__file__))
import rondo_oracle  # noqa: E402
import tokenizer_builders as tb  # noqa: E402

# Qwen2.5-Instruct's chat_template.
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Meta-Llama-3-8B-Instruct's chat_template.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
          "<|end_header_id|>\n\n' }}{% endif %}")

# Mistral-7B-Instruct-v0.1's chat_template.
MISTRAL_V1 = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
              "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
              "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
              "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
              "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
              "roles are supported!') }}{% endif %}{% endfor %}")

# Mistral-7B-Instruct-v0.3's chat_template.
MISTRAL_V3 = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
"""

# Qwen3's chat_template.
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


# Llama 3.1-8B-Instruct's chat_template (3.3-70B-Instruct's is the same text) and Llama
# 3.2-3B-Instruct's, as published by Meta; here from the copies llama.cpp keeps in
# models/templates/ (vendored in the llama-cpp-python 0.3.36 sdist on PyPI).
LLAMA31 = r"""{{- bos_token }}
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
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
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
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
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
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""
LLAMA32 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
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

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
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
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""


def tagged(template, replacements):
    """The template with {% generation %} around the assistant output."""
    for old, new in replacements:
        assert old in template, old
        template = template.replace(old, new)
    return template


GEN, END = "{% generation %}", "{% endgeneration %}"
QWEN25_TAGGED = tagged(QWEN25, [(
    """    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}""",
    """    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' }}""" + GEN + "{{- message.content + '<|im_end|>' }}" +
    END + "{{- '\\n' }}")])
LLAMA3_TAGGED = (
    "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}" + GEN + "{{ message['content'] | trim + '<|eot_id|>' }}" +
    END + "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA31_LOOP = (r"""        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ """
                r"""message['content'] | trim + '<|eot_id|>' }}""")
LLAMA31_LOOP_TAGGED = (
    r"""        {%- if message['role'] == 'assistant' %}{{- '<|start_header_id|>assistant"""
    r"""<|end_header_id|>\n\n' }}""" + GEN + r"""{{- message['content'] | trim + '<|eot_id|>' }}""" +
    END + "{%- else %}" + LLAMA31_LOOP + "{%- endif %}")
LLAMA31_TAGGED = tagged(LLAMA31, [(LLAMA31_LOOP, LLAMA31_LOOP_TAGGED)])
LLAMA32_TAGGED = tagged(LLAMA32, [(LLAMA31_LOOP, LLAMA31_LOOP_TAGGED)])
MISTRAL_V1_TAGGED = tagged(MISTRAL_V1, [("{{ message['content'] + eos_token}}",
                                         GEN + "{{ message['content'] + eos_token}}" + END)])
MISTRAL_V3_TAGGED = tagged(MISTRAL_V3, [('{{- " " + message["content"]|trim + eos_token}}',
                                         GEN + '{{- " " + message["content"]|trim + eos_token}}' + END)])
# Qwen3: each assistant branch renders header, then the reply and <|im_end|> inside one generation
# block (the test conversations have no tool calls, which would come between them).
QWEN3_TAGGED = tagged(QWEN3, [
    ("{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
     "'\\n</think>\\n\\n' + content.lstrip('\\n') }}",
     "{{- '<|im_start|>' + message.role + '\\n' }}" + GEN + "{{- '<think>\\n' + "
     "reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') + '<|im_end|>' }}" + END),
    ("""            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}""",
     """            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' }}""" + GEN + """{{- content + '<|im_end|>' }}""" + END + """
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' }}""" + GEN + """{{- content + '<|im_end|>' }}""" + END + """
        {%- endif %}"""),
    ("""        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}""",
     """        {{- '\\n' }}
    {%- elif message.role == "tool" %}"""),
])

# name: (tokenizer builder, template, tagged template, bos, eos, supports a system message)
FAMILIES = {
    "qwen2.5": (tb.qwen2, QWEN25, QWEN25_TAGGED, None, "<|im_end|>", True),
    "qwen3": (tb.qwen2, QWEN3, QWEN3_TAGGED, None, "<|im_end|>", True),
    "llama3": (tb.llama3, LLAMA3, LLAMA3_TAGGED, "<|begin_of_text|>", "<|eot_id|>", True),
    "llama3.1": (tb.llama3, LLAMA31, LLAMA31_TAGGED, "<|begin_of_text|>", "<|eot_id|>", True),
    "llama3.2": (tb.llama3, LLAMA32, LLAMA32_TAGGED, "<|begin_of_text|>", "<|eot_id|>", True),
    "mistral-v0.3": (tb.mistral, MISTRAL_V3, MISTRAL_V3_TAGGED, "<s>", "</s>", True),
    "mistral-v0.1": (tb.llama2, MISTRAL_V1, MISTRAL_V1_TAGGED, "<s>", "</s>", False),
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi there, how can I help?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
     {"role": "assistant", "content": "6."}],
    [{"role": "user", "content": "  Résumé, café, 😀 and 你好?\n"},
     {"role": "assistant", "content": "\n\nSure:\n```py\nprint('hi')  # 1234567\n```\n  "}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Think first."},
     {"role": "assistant", "content": "<think>\nLet me see.\n</think>\n\nThe answer is 42."},
     {"role": "user", "content": "Again?"},
     {"role": "assistant", "content": "<think>\nStill 42.\n</think>\n\n42 again."}],
    [{"role": "user", "content": "Empty reply next."}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "ok"}],
    [{"role": "user", "content": "tabs\tand <s> specials <|im_end|> inside"},
     {"role": "assistant", "content": " leading space and <|eot_id|> marker"}],
]

WORDS = ["hello", "world", "Привет", "世界", "😀", "42", "3.14", "def f(x):", "\n", "  ", "naïve", "ok!",
         "\t", "'s", "don't", "→", "  spaced  "]


def random_conversation(rng, system):
    msgs = []
    if system and rng.random() < 0.5:
        msgs.append({"role": "system", "content": " ".join(rng.choice(WORDS) for _ in range(4))})
    turns = rng.randint(1, 3)
    for turn in range(turns):
        msgs.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))})
        if turn + 1 < turns or rng.random() < 0.8:  # user and assistant alternate
            words = [rng.choice(WORDS) for _ in range(rng.randint(0, 8))]
            msgs.append({"role": "assistant", "content": rng.choice([" ", "", "\n"]).join(words)})
    return msgs


def setup_family(name, folder):
    builder, template, tagged_template, bos, eos, _ = FAMILIES[name]
    path = tb.save(builder(), folder)
    config = {"chat_template": template, "bos_token": bos, "eos_token": eos}
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    hf = PreTrainedTokenizerFast(tokenizer_file=path, bos_token=bos, eos_token=eos)
    return path, hf, template, tagged_template


# Llama 3.2's template writes today's date (transformers gives it strftime_now); Rondo writes the
# templates' own fallback date so that training data does not change with the day: the reference
# is rendered with that date passed in (the template's `date_string`).
TEMPLATE_KWARGS = {"llama3.2": {"date_string": "26 Jul 2024"}}


def expected(hf, template, tagged_template, messages, gen, **kwargs):
    text = hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                  add_generation_prompt=gen, **kwargs)
    out = hf.apply_chat_template(messages, chat_template=template, tokenize=True,
                                 add_generation_prompt=gen, return_dict=True, **kwargs)
    tagged_text = hf.apply_chat_template(messages, chat_template=tagged_template, tokenize=False,
                                         add_generation_prompt=gen, **kwargs)
    assert tagged_text == text, "the tagged template must render what the real one renders"
    masked = hf.apply_chat_template(messages, chat_template=tagged_template, tokenize=True,
                                    add_generation_prompt=gen, return_dict=True,
                                    return_assistant_tokens_mask=True, **kwargs)
    assert list(masked["input_ids"]) == list(out["input_ids"])
    return text, list(out["input_ids"]), list(masked["assistant_masks"])


def rondo_chat(folder, messages, gen, fmt=""):
    conv, out = os.path.join(folder, "conv.json"), os.path.join(folder, "chat_out.json")
    with open(conv, "w", encoding="utf-8") as f:
        json.dump({"messages": messages, "add_generation_prompt": gen, "format": fmt}, f)
    rondo_oracle.driver("chat", os.path.join(folder, "tokenizer.json"),
                        os.path.join(folder, "tokenizer_config.json"), conv, out)
    with open(out, encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_rendering_ids_and_mask_equal_transformers(name, tmp_path):
    folder = str(tmp_path)
    _, hf, template, tagged_template = setup_family(name, folder)
    system_ok = FAMILIES[name][5]
    seed = random.randrange(2**32)
    print(f"{name}: seed={seed}")
    rng = random.Random(seed)
    conversations = [c for c in CONVERSATIONS if system_ok or c[0]["role"] != "system"]
    conversations += [random_conversation(rng, system_ok) for _ in range(25)]
    masked_tokens = 0
    for i, messages in enumerate(conversations):
        for gen in (False, True):
            if name.startswith("mistral") and gen:
                continue  # Mistral's templates have no generation prompt: the prompt ends in [/INST]
            text, ids, mask = expected(hf, template, tagged_template, messages, gen,
                                       **TEMPLATE_KWARGS.get(name, {}))
            got = rondo_chat(folder, messages, gen)
            where = f"conversation {i} {messages!r} (generation prompt {gen})"
            assert got["text"] == text, where
            assert got["ids"] == ids, where
            assert got["mask"] == mask, (
                f"{where}\n  tokens: {hf.convert_ids_to_tokens(ids)}\n  rondo: {got['mask']}\n"
                f"  want:  {mask}")
            masked_tokens += sum(mask)
    assert masked_tokens > 0  # the masks above are not all zero


def test_formats_are_recognised_and_can_be_chosen(tmp_path):
    folder = str(tmp_path)
    setup_family("llama3", folder)
    msgs = CONVERSATIONS[0]
    assert rondo_chat(folder, msgs, False)["format"] == "llama3"
    # Llama 3.1/3.2: recognised, and "llama3.1" chosen by name renders the same dated header.
    folder = str(tmp_path / "llama31")
    setup_family("llama3.1", folder)
    got = rondo_chat(folder, msgs, False)
    assert got["format"] == "llama3" and "Today Date: 26 Jul 2024\n\n<|eot_id|>" in got["text"]
    assert rondo_chat(folder, msgs, False, "llama3.1")["text"] == got["text"]
    folder = str(tmp_path / "qwen")
    setup_family("qwen2.5", folder)
    got = rondo_chat(folder, msgs, False)
    assert got["format"] == "chatml" and "You are Qwen" in got["text"]
    # An explicit format overrides the file's template: plain ChatML has no default system prompt.
    assert rondo_chat(folder, msgs, False, "chatml")["text"] == (
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\nHi there, how can I help?<|im_end|>\n")


@pytest.mark.parametrize("family,fmt,marker", [("llama3", "chatml", "<|im_start|>"),
                                                ("qwen2.5", "llama3", "<|start_header_id|>"),
                                                ("mistral-v0.1", "mistral", "[INST]")])
def test_a_format_whose_markers_the_tokenizer_lacks_is_an_error(tmp_path, family, fmt, marker):
    """The markers would be tokenized as plain text, which `transformers` does too; but that is not
    how the model was trained: Rondo refuses, naming the tokenizer and the marker."""
    folder = str(tmp_path)
    path, hf, _, _ = setup_family(family, folder)
    assert hf.convert_tokens_to_ids(marker) in (None, hf.unk_token_id)  # not a token of its own
    with pytest.raises(rondo_oracle.DriverError) as e:
        rondo_chat(folder, CONVERSATIONS[0], False, fmt)
    assert path in e.value.message and f"needs {marker} as a token" in e.value.message
    assert "use its own" in e.value.message


def test_unrecognised_template_names_file_and_how_to_choose(tmp_path):
    folder = str(tmp_path)
    setup_family("qwen2.5", folder)
    cfg_path = os.path.join(folder, "tokenizer_config.json")
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump({"chat_template": "{% for m in messages %}### {{ m.role }}: {{ m.content }}\n{% endfor %}"},
                  f)
    with pytest.raises(rondo_oracle.DriverError) as e:
        rondo_chat(folder, CONVERSATIONS[0], False)
    assert "tokenizer_config.json" in e.value.message
    assert "--chat-format chatml" in e.value.message and "llama3" in e.value.message
