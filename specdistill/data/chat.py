"""A target's chat format: which tokens a trained assistant turn is, as the target is served and generates it.

For assistant turn k of a conversation (messages m[0..n), the row's `tools`, `data.chat_template_kwargs`):
  prompt    the template's rendering of m[:k] with the generation prompt, tokenized: what a chat server
            (vLLM's /v1/chat/completions) feeds the target for that turn;
  full      its rendering of m[:k+1] (m[k] the last message, no generation prompt), tokenized;
  response  full[len(prompt):] up to and including the first stop token: what the target generates for the turn.
            Text a template adds after its stop token (ChatML's "\\n", Gemma's "\\n") is not trained; a
            generation prompt's own tokens (Qwen3's empty think block with enable_thinking=false) are prompt.
Each turn renders its own history, so templates that rewrite it (Qwen3 and gpt-oss drop earlier reasoning) train
exactly what is served.

Where the prompt is not a prefix of the full rendering:
  - as text: the template renders a finished turn differently from what it feeds for generating it (e.g.
    DeepSeek-R1's generation prompt ends in "<think>\\n", which its rendering of a finished turn drops). The
    turn cannot be trained as served: `ChatError` (data.bad_rows=skip counts and names the row).
  - as tokens only (a token straddles the boundary, so the tokenizer merges across it): the prompt stays what the
    server feeds, and the response is the rest of the full text tokenized as a continuation (what the target's own
    tokens decode to); counted as `retokenized` (meta.json of the token store).
A template that writes nothing after an assistant message (GLM) ends the turn by the next message's header: the
target stops by emitting it (<|user|>, <|observation|>: stop tokens in its generation_config.json). The response then
ends with that header: the one the template renders for the message after the turn or, after a conversation's last
turn, for the message that would come (a tool result after a turn that calls tools, else a user message). A header
that is not a stop token, or a rendering with neither, is a `ChatError` (the target could never end the turn).

Stop tokens, the one source for training, regeneration, the synthetic/corpus workloads and the benches
(`ChatFormat.stop_ids`): the tokenizer's eos, generation_config.json's eos_token_id(s), and the template's end of turn
(the first special token it renders after an assistant message's text: <|im_end|>, <|eot_id|>, <end_of_turn>,
</s>, <|return|>, ...).

Messages are normalised as vLLM's chat server normalises a request before rendering
(vllm/renderers/chat_utils.py): content None -> "" (or [] for templates that iterate over content parts),
list content -> its text parts joined by "\\n" for templates that take strings (`content_format`), tool-call
`arguments` given as a JSON string -> the object, empty or null `tool_calls` dropped, `reasoning` also given as
`reasoning_content`. Other message keys (reasoning_content, thinking, tool_call_id, name) pass to the template.
"""

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# apply_chat_template arguments this module sets itself; data.chat_template_kwargs may not.
RESERVED_KWARGS = ("conversation", "messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize",
                   "return_dict", "chat_template")
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_PROBE = "specdistill-end-of-turn-probe"


class ChatError(ValueError):
    """A conversation the template cannot render as trained turns. `field` names the message (messages[3]) or
    field (messages[3].tool_calls[0].function.arguments) at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def describe(value, n: int = 60) -> str:
    """`type repr` of a bad value, clipped, for error messages."""
    s = repr(value)
    return f"{type(value).__name__} {s if len(s) <= n else s[: n - 3] + '...'}"


@dataclass(frozen=True)
class Turn:
    """One trained assistant turn: prompt tokens (as served), response tokens (ending with a stop token)."""

    prompt: list[int]
    response: list[int]
    retokenized: bool = False  # the response was tokenized apart from the prompt (see the module docstring)


# ---- stop tokens --------------------------------------------------------------------------------------------
def generation_eos_ids(target_dir: str | Path) -> list[int]:
    """eos_token_id of generation_config.json (an int or a list) in `target_dir`; [] when the file is absent."""
    path = Path(target_dir) / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if not all(isinstance(i, int) for i in ids):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")
    return ids


def special_ids(tokenizer) -> set[int]:
    """Ids of the tokenizer's special tokens (eos, bos, pad, ... and added tokens marked special)."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    return ids


# ---- the chat format ----------------------------------------------------------------------------------------
class ChatFormat:
    """A tokenizer's chat template with the run's template kwargs, its content format and its stop tokens."""

    def __init__(self, tokenizer, template_kwargs: dict | None = None, eos_ids=()):
        self.tokenizer = tokenizer
        self.kwargs = check_template_kwargs(template_kwargs)
        # the default of a dict of named templates; apply_chat_template picks its tool_use one for rows with tools
        self.template = tokenizer.get_chat_template() if tokenizer.chat_template else None
        self.content_format = content_format(self.template) if self.template else "string"
        self.special = special_ids(tokenizer)
        self.end_of_turn = self._probe_end_of_turn() if self.template else None
        stops = set(eos_ids)
        if tokenizer.eos_token_id is not None:
            stops.add(tokenizer.eos_token_id)
        if self.end_of_turn is not None:
            stops.add(self.end_of_turn)
        self.stop_ids = frozenset(stops)

    @classmethod
    def load(cls, target_dir: str | Path, template_kwargs: dict | None = None) -> "ChatFormat":
        """The chat format of a target (or tokenizer) directory: its tokenizer, generation_config.json's eos."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(target_dir), local_files_only=True)
        return cls(tokenizer, template_kwargs, generation_eos_ids(target_dir))

    # -- rendering ---------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        # A chat server tokenizes the rendered text without adding special tokens (the template writes its bos).
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def render(self, messages: list[dict], tools: list | None, generation_prompt: bool) -> str:
        if self.template is None:
            raise ChatError("messages", "the tokenizer has no chat template (tokenizer_config.json chat_template, or "
                            "chat_template.jinja); chat rows need one, pre-tokenized rows do not")
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=generation_prompt, **self.kwargs)
        except Exception as e:  # jinja errors, raise_exception(...) in templates, type errors in them
            raise self._locate(messages, tools, e) from None

    def _locate(self, messages: list[dict], tools, error: Exception) -> ChatError:
        """The first message whose addition makes the template fail (re-rendering shorter prefixes), else the last."""
        bad = len(messages) - 1
        for j in range(1, len(messages)):
            try:
                self.tokenizer.apply_chat_template(messages[:j], tools=tools or None, tokenize=False, **self.kwargs)
            except Exception:
                bad = j - 1
                break
        return ChatError(f"messages[{bad}]", f"chat template error: {type(error).__name__}: {error}")

    def prompt_text(self, messages: list[dict], tools: list | None = None) -> str:
        """What a chat server feeds the target to answer after `messages` (normalised here), as text."""
        return self.render(self.normalise(messages), tools, generation_prompt=True)

    def prompt_ids(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """What a chat server feeds the target to answer after `messages`: the one rendering of a prompt for
        regeneration, the synthetic workload and the serving benches."""
        return self.encode(self.prompt_text(messages, tools))

    def turn(self, messages: list[dict], k: int, tools: list | None = None) -> Turn:
        """Assistant turn k of normalised `messages` (see the module docstring)."""
        prompt_text = self.render(messages[:k], tools, generation_prompt=True)
        full_text = self.render(messages[:k + 1], tools, generation_prompt=False)
        if not full_text.startswith(prompt_text):
            raise ChatError(f"messages[{k}]", "the chat template's prompt for this turn (generation prompt included) "
                            "is not a prefix of its rendering of the finished turn, so the turn cannot be trained as "
                            f"served: {_divergence(prompt_text, full_text)}")
        turn = self._through_stop(prompt_text, full_text)
        if turn is None:  # no end of turn written: the target ends the turn by emitting the next role's header
            turn = self._through_stop(prompt_text, full_text + self._next_header(messages, k, tools, full_text))
        return turn

    def _through_stop(self, prompt_text: str, full_text: str) -> Turn | None:
        """The turn's prompt and its response up to and including the first stop token; None when it has none."""
        prompt, full = self.encode(prompt_text), self.encode(full_text)
        retokenized = full[:len(prompt)] != prompt
        rest = self._continuation(full_text[len(prompt_text):]) if retokenized else full[len(prompt):]
        stop = next((i for i, t in enumerate(rest) if t in self.stop_ids), None)
        return None if stop is None else Turn(prompt, rest[:stop + 1], retokenized)

    def _next_header(self, messages: list[dict], k: int, tools: list | None, full_text: str) -> str:
        """The text the template renders after assistant turn k through the next message's header (its first
        special token), for a template that writes no end of turn (GLM): after the message that follows the turn,
        or after the conversation's last turn, the message that would (a tool result after a turn that calls tools,
        else a user message). ChatError where that header is not a stop token."""
        last = k + 1 == len(messages)
        following = self._reply_to(messages[k]) if last else messages[k + 1]
        tail = self._rendered_after(messages[:k], messages[k], full_text, following, tools)
        header = next((t for t in self.encode(tail) if t in self.special), None)
        if header is None or header not in self.stop_ids:
            found = ("renders no special token" if header is None else
                     f"opens with {self.tokenizer.convert_ids_to_tokens(header)!r}, which is not a stop token either")
            raise ChatError(f"messages[{k}]", "the chat template renders no stop token after this assistant turn, "
                            f"and the {following['role']} message {'that would follow' if last else 'after'} it "
                            f"{found} (stop tokens: {self.stop_names()}), so the target could never end the turn; "
                            "if the target stops on that header, add its id to generation_config.json's eos_token_id")
        name = self.tokenizer.convert_ids_to_tokens(header)
        return tail[:tail.index(name) + len(name)]

    def _reply_to(self, turn: dict) -> dict:
        """The message that comes after an assistant turn: its tool's result where it calls one, else the user's."""
        return self.normalise([{"role": "tool" if turn.get("tool_calls") else "user", "content": _PROBE}])[0]

    def _rendered_after(self, history: list[dict], turn: dict, turn_text: str, following: dict,
                        tools: list | None) -> str:
        """What the template renders between `turn` (the last message of `turn_text`) and the end of `following`.
        A template that renders a turn otherwise once a message follows it (GLM-4.5 drops the reasoning of a turn
        before the last user message) is asked after a plain turn with the same tool calls instead: what it renders
        after a turn is the next message's, not the turn's own."""
        after = self.render([*history, turn, following], tools, generation_prompt=False)
        if after.startswith(turn_text):
            return after[len(turn_text):]
        plain = self.normalise([{"role": "assistant", "content": _PROBE,
                                 **({"tool_calls": turn["tool_calls"]} if turn.get("tool_calls") else {})}])[0]
        plain_text = self.render([*history, plain], tools, generation_prompt=False)
        after = self.render([*history, plain, following], tools, generation_prompt=False)
        if after.startswith(plain_text):
            return after[len(plain_text):]
        raise ChatError(f"messages[{len(history)}]", "the chat template renders no stop token after this assistant "
                        "turn, and renders the turn otherwise once a message follows it, so the header that ends "
                        "it cannot be found")

    def _continuation(self, text: str) -> list[int]:
        """`text` tokenized as a continuation: after a special token, so that a sentencepiece-style tokenizer adds
        no prefix space as it does at the start of an input."""
        anchor = self.tokenizer.eos_token
        if anchor is None:
            return self.encode(text)
        ids = self.encode(anchor + text)
        return ids[1:] if ids and ids[0] == self.tokenizer.eos_token_id else self.encode(text)

    def stop_names(self) -> str:
        return ", ".join(f"{self.tokenizer.convert_ids_to_tokens(i)}={i}" for i in sorted(self.stop_ids))

    def _probe_end_of_turn(self) -> int | None:
        """The first special token the template renders after an assistant message's text; None when it renders
        none (or cannot render a plain user/assistant exchange)."""
        for head in ([], [{"role": "system", "content": "s"}]):
            msgs = self.normalise([*head, {"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}])
            try:
                text = self.tokenizer.apply_chat_template(msgs, tokenize=False, **self.kwargs)
            except Exception:
                continue
            if _PROBE not in text:
                return None
            tail = self.encode(text[text.index(_PROBE) + len(_PROBE):])
            return next((t for t in tail if t in self.special), None)
        log.warning("chat template: cannot render a user/assistant exchange to find its end-of-turn token; stop "
                    "tokens are the eos ids only")
        return None

    # -- normalisation (vLLM's, see the module docstring) ------------------------------------------------------------
    def normalise(self, messages) -> list[dict]:
        if not isinstance(messages, list) or not messages:
            raise ChatError("messages", f"expected a non-empty list of messages, got {describe(messages)}")
        return [self._message(m, i) for i, m in enumerate(messages)]

    def _message(self, m, i: int) -> dict:
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatError(at, f'expected an object {{"role": ..., "content": ...}}, got {describe(m)}')
        if not isinstance(m.get("role"), str):
            raise ChatError(f"{at}.role", f"expected a string, got {describe(m.get('role'))}")
        out = dict(m)
        text_only = self.content_format == "string" or m["role"] == "tool"
        out["content"] = _content(m.get("content"), f"{at}.content", text_only)
        if "tool_calls" in m:
            calls = _tool_calls(m["tool_calls"], f"{at}.tool_calls")
            if calls:
                out["tool_calls"] = calls
            else:
                out.pop("tool_calls")
        if isinstance(m.get("reasoning"), str):
            out.setdefault("reasoning_content", m["reasoning"])
        return out

    def is_empty(self, message: dict) -> bool:
        """An assistant message with nothing in it (no text, tool call or reasoning): nothing to learn."""
        content = message.get("content")
        text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
        return not text.strip() and not message.get("tool_calls") and \
            not any(isinstance(message.get(k), str) and message[k].strip() for k in REASONING_KEYS)


def _content(content, at: str, text_only: bool):
    if content is None:
        return "" if text_only else []
    if isinstance(content, str):
        return content if text_only else [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ChatError(at, f"expected a string, a list of content parts or null, got {describe(content)}")
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise ChatError(f"{at}[{j}]", 'expected a text part {"type": "text", "text": str} (the only content '
                            f"parts a text target takes), got {describe(part)}")
    return "\n".join(p["text"] for p in content) if text_only else [dict(p) for p in content]


def _tool_calls(calls, at: str) -> list[dict]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ChatError(at, f"expected a list of tool calls or null, got {describe(calls)}")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)) or call.get("type", "function") != "function":
            raise ChatError(f"{at}[{j}]", 'expected {"type": "function", "function": {"name": str, "arguments": '
                            f"object or JSON string}}}}, got {describe(call)}")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ChatError(f"{at}[{j}].function.arguments", f"not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(args, dict):
            raise ChatError(f"{at}[{j}].function.arguments", f"expected an object, got {describe(args)}")
        out.append({**call, "type": "function", "function": {**fn, "arguments": args}})
    return out


def _divergence(prompt: str, full: str) -> str:
    i = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
    return f"they differ at character {i}: prompt {prompt[i:i + 30]!r}, finished turn {full[i:i + 30]!r}"


def check_template_kwargs(kwargs) -> dict:
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ValueError(f"data.chat_template_kwargs={kwargs!r}: expected a mapping of template variables, e.g. "
                         "{enable_thinking: false}")
    kwargs = dict(kwargs or {})
    glued = [k for k, v in kwargs.items() if v is None and ":" in str(k)]
    if glued:  # YAML reads {enable_thinking:false} (no space) as a key 'enable_thinking:false' with no value
        raise ValueError(f"data.chat_template_kwargs has the key {glued[0]!r} and no value: write "
                         "'{enable_thinking: false}' (a space after the colon)")
    reserved = sorted(set(kwargs) & set(RESERVED_KWARGS))
    if reserved:
        raise ValueError(f"data.chat_template_kwargs sets {reserved}, which specdistill sets itself per turn; "
                         "remove them (template variables such as enable_thinking are what it is for)")
    return kwargs


def content_format(template: str) -> str:
    """"openai" when the template loops over a message's content (list of parts), else "string" - the test vLLM
    applies to the template's syntax tree (vllm/renderers/hf.py `_detect_content_format`), simplified: any
    `for x in <...>.content` or `for x in content` loop."""
    from jinja2 import nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:  # transformers' environment: its extensions ({% generation %}, loop controls) parse
        tree = _compile_jinja_template(template).environment.parse(template)
    except Exception:
        return "string"
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        if isinstance(it, nodes.Name) and it.name == "content":
            return "openai"
        if isinstance(it, nodes.Getattr) and it.attr == "content":
            return "openai"
        if isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content":
            return "openai"
    return "string"
