"""Chat clients for the LLM CSG builder: an OpenAI-compatible endpoint and a local causal LM.

Both implement `ChatClient.complete(messages) -> str`: the messages are OpenAI-style
{"role", "content"} dicts (system, then alternating user/assistant turns, ending with a user
turn) and the reply is the assistant's text. Decoding is greedy (temperature 0) so one prompt
gives one answer; the builder in `cast_core.csg.llm` owns validation and retries.

- `ChatEndpointClient` POSTs to `{base_url}/chat/completions` (vLLM, SGLang, Ollama, any OpenAI
  protocol server; `base_url` includes the version prefix, e.g. "http://host:8000/v1"). It uses
  httpx when installed (prefect depends on it) and the standard library's urllib otherwise.
  Failures raise `LlmClientError` naming the URL and the HTTP status with an excerpt of the body,
  or the timeout; they are not retried here (a dead server does not get better by re-asking).
- `LocalCausalLMClient` runs any transformers causal LM from a local path. With a chat template
  the tokenizer renders the conversation (and adds its own special tokens); without one the turns
  are joined as "role: content" paragraphs ending in "assistant: ", tokenised with the
  tokenizer's special tokens. transformers is imported only when this client is built.
"""

from __future__ import annotations

import importlib.util
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypedDict

EXCERPT_CHARS = 300


class ChatMessage(TypedDict):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatClient(Protocol):
    def complete(self, messages: Sequence[ChatMessage]) -> str:
        """The assistant's reply to the conversation `messages`."""


class LlmClientError(RuntimeError):
    """The model could not be asked (HTTP error, timeout, unreachable, malformed reply)."""


@dataclass(frozen=True)
class HttpReply:
    status: int
    text: str


def _excerpt(text: str) -> str:
    return repr(text[:EXCERPT_CHARS] + ("..." if len(text) > EXCERPT_CHARS else ""))


@dataclass(frozen=True)
class ChatEndpointClient:
    """OpenAI-protocol chat completions at `base_url` (which ends in the API version, e.g. /v1).

    `json_mode` asks the server for `response_format={"type": "json_object"}` (vLLM, SGLang and
    Ollama support it); `transport` picks the HTTP library ("auto": httpx if installed)."""

    base_url: str
    model: str
    api_key: str | None = field(default=None, repr=False)
    timeout_s: float = 120.0
    temperature: float = 0.0
    max_tokens: int = 1024
    json_mode: bool = False
    transport: Literal["auto", "httpx", "urllib"] = "auto"

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got "
                             f"{self.base_url!r}; e.g. 'http://127.0.0.1:8000/v1'")
        if not self.model:
            raise ValueError("model must name the served model (the server's model id)")
        if self.timeout_s <= 0 or self.max_tokens < 1 or self.temperature < 0:
            raise ValueError(f"need timeout_s > 0, max_tokens >= 1, temperature >= 0; got "
                             f"{self.timeout_s}, {self.max_tokens}, {self.temperature}")
        if self.transport not in ("auto", "httpx", "urllib"):
            raise ValueError(f"transport must be 'auto', 'httpx' or 'urllib', got "
                             f"{self.transport!r}")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + "/chat/completions"

    def complete(self, messages: Sequence[ChatMessage]) -> str:
        payload = {"model": self.model, "messages": list(messages),
                   "temperature": self.temperature, "max_tokens": self.max_tokens}
        if self.json_mode:
            payload["response_format"] = {"type": "json_object"}
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        body = json.dumps(payload).encode("utf-8")
        post = _post_httpx if self._use_httpx() else _post_urllib
        reply = post(self.url, body, headers, self.timeout_s)
        if reply.status != 200:
            raise LlmClientError(f"chat endpoint {self.url} answered HTTP {reply.status}: "
                                 f"{_excerpt(reply.text)}")
        return _reply_content(reply.text, self.url)

    def _use_httpx(self) -> bool:
        installed = importlib.util.find_spec("httpx") is not None
        if self.transport == "httpx" and not installed:
            raise LlmClientError("transport 'httpx' needs the httpx package; install it or use "
                                 "transport='urllib'")
        return self.transport == "httpx" or (self.transport == "auto" and installed)


def _reply_content(text: str, url: str) -> str:
    """choices[0].message.content of a chat-completions reply body."""
    try:
        content = json.loads(text)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise LlmClientError(f"chat endpoint {url} sent a reply without "
                             f"choices[0].message.content: {_excerpt(text)}") from err
    if not isinstance(content, str):
        raise LlmClientError(f"chat endpoint {url} sent content {content!r}, not text")
    return content


def _post_httpx(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> HttpReply:
    import httpx

    try:
        response = httpx.post(url, content=body, headers=headers, timeout=timeout_s)
    except httpx.TimeoutException as err:
        raise LlmClientError(f"chat endpoint {url} timed out after {timeout_s} s") from err
    except httpx.HTTPError as err:
        raise LlmClientError(f"cannot reach chat endpoint {url}: {err!r}") from err
    return HttpReply(response.status_code, response.text)


def _post_urllib(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> HttpReply:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return HttpReply(response.status, response.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as err:
        return HttpReply(err.code, err.read().decode("utf-8", "replace"))
    except TimeoutError as err:
        raise LlmClientError(f"chat endpoint {url} timed out after {timeout_s} s") from err
    except urllib.error.URLError as err:
        if isinstance(err.reason, TimeoutError):
            raise LlmClientError(f"chat endpoint {url} timed out after {timeout_s} s") from err
        raise LlmClientError(f"cannot reach chat endpoint {url}: {err.reason!r}") from err


class LocalCausalLMClient:
    """A transformers causal LM loaded from a local folder, decoding greedily."""

    def __init__(self, path: str, max_new_tokens: int = 1024, device: str = "cpu") -> None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.path, self.max_new_tokens, self.device = path, max_new_tokens, device
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def render(self, messages: Sequence[ChatMessage]) -> str:
        """The text the model continues: its chat template, or "role: content" paragraphs."""
        if self.has_chat_template:
            return self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                      add_generation_prompt=True)
        return "".join(f"{m['role']}: {m['content']}\n\n" for m in messages) + "assistant: "

    def complete(self, messages: Sequence[ChatMessage]) -> str:
        import torch

        inputs = self.tokenizer(self.render(messages), return_tensors="pt",
                                add_special_tokens=not self.has_chat_template).to(self.device)
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = self.tokenizer.eos_token_id
        with torch.inference_mode():
            output = self.model.generate(**inputs, max_new_tokens=self.max_new_tokens,
                                         do_sample=False, pad_token_id=pad_id)
        new_tokens = output[0, inputs["input_ids"].shape[1]:]  # [T_new]
        return self.tokenizer.decode(new_tokens, skip_special_tokens=True)
