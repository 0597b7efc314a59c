"""A chat session that keeps its KV cache from turn to turn, and the terminal loop around it.

Every turn the whole conversation is rendered again with the chat template. The cache already holds
the ids of the previous rendering plus the reply; the longest common prefix of those ids and the
new rendering stays, the cache is truncated there and only the rest is prefilled. Qwen3's template
drops the thinking block of earlier replies (and the empty `<think></think>` written when thinking
is off), so the previous reply's ids change; the prefix match covers that with no special case.

Context policy: before a reply, the rendered conversation plus max_new_tokens must fit in the
session's cache. If it does not, the oldest turns (a user message and every message up to the next
user message) are dropped, the system message always kept, until it fits. If even the newest user
message alone does not fit, the turn fails with GenerationError before anything is generated.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TextIO

from octlm.generation import (
    GenerationError,
    GenerationStats,
    LoadedModel,
    ModelSettings,
    SamplingConfig,
    generate,
    load_model,
)


@dataclass
class ChatSettings(ModelSettings):
    """scripts/chat.py: an interactive (or scripted, from stdin) conversation."""

    max_context: int | None = 4096  # positions of the session's KV cache; None: the model's context


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two id lists."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class ChatSession:
    """Messages and the KV cache of their rendered ids, reused across turns."""

    def __init__(
        self,
        loaded: LoadedModel,
        sampling: SamplingConfig,
        max_context: int | None = None,
        system: str | None = None,
        thinking: bool | None = None,
    ) -> None:
        self.loaded = loaded
        self.sampling = sampling.validate()
        context = loaded.model.config.context_length
        self.cache = loaded.model.new_cache(1, min(max_context or context, context))
        self.cached: list[int] = []  # the ids at the cache's first len(cached) positions
        self.messages: list[dict] = []  # user and assistant turns, without the system message
        self.system = system
        self.thinking = thinking
        self.dropped_turns = 0  # turns removed so far by the context policy
        self.reused = 0  # cached ids the latest turn kept
        self.stats = GenerationStats()  # of the latest reply

    def reset(self) -> None:
        """Forget the conversation (the system message stays) and empty the cache."""
        self.messages.clear()
        self.cache.reset()
        self.cached = []

    def render(self, messages: list[dict] | None = None) -> list[int]:
        """Ids of the conversation (default: the session's), ending with the assistant's generation prompt."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        thinking = {} if self.thinking is None else {"enable_thinking": self.thinking}
        turns = self.messages if messages is None else messages
        return self.loaded.tokenizer.encode_chat([*system, *turns], **thinking)

    def prepare(self) -> list[int]:
        """Fit the conversation to the cache, keep the cached prefix it shares; return the ids to prefill."""
        ids = self._fit()
        keep = min(
            common_prefix(self.cached, ids), len(ids) - 1
        )  # prefill >= 1 id: its logits start the reply
        self.cache.truncate(keep)
        self.cached, self.reused = ids[:keep], keep
        return ids[keep:]

    def say(self, text: str) -> Iterator[str]:
        """Add a user message and stream the reply's text; the reply joins the conversation."""
        self.messages.append({"role": "user", "content": text})
        try:
            rest = self.prepare()
        except GenerationError:
            self.messages.pop()
            raise
        base, reply, tokens = self.cached + rest, "", []
        self.stats = GenerationStats()
        loaded = self.loaded
        events = generate(
            loaded.model,
            [rest],
            self.sampling,
            loaded.eos_ids,
            loaded.tokenizer.stream,
            self.cache,
            self.stats,
        )
        try:
            for event in events:
                tokens.append(event.token)
                reply += event.text
                yield event.text
        finally:  # also when the reader stops early (Ctrl-C): keep what was said
            self.cached = (base + tokens)[: self.cache.length]
            self.messages.append({"role": "assistant", "content": reply})

    def _fit(self) -> list[int]:
        """The rendered ids, after dropping the oldest turns until they and the reply fit."""
        room = self.cache.max_len - self.sampling.max_new_tokens
        messages, dropped = list(self.messages), 0
        ids = self.render(messages)
        while len(ids) > room:
            later_users = [i for i, m in enumerate(messages) if m["role"] == "user" and i > 0]
            if not later_users:
                raise GenerationError(
                    f"the newest message renders to {len(ids)} tokens; with max_new_tokens="
                    f"{self.sampling.max_new_tokens} that exceeds the chat's {self.cache.max_len} positions "
                    "(raise max_context or lower sampling.max_new_tokens)"
                )
            del messages[: later_users[0]]
            dropped += 1
            ids = self.render(messages)
        self.messages, self.dropped_turns = messages, self.dropped_turns + dropped
        return ids


HELP = "commands: /reset, /system TEXT, /think on|off, /exit (or Ctrl-D)"


def run_command(session: ChatSession, line: str, err: TextIO) -> bool:
    """Apply one /command to the session; False when the chat should end."""
    name, _, argument = line.strip().partition(" ")
    argument = argument.strip()
    if name == "/exit":
        return False
    if name == "/reset":
        session.reset()
        print("(conversation cleared)", file=err)
    elif name == "/system":
        session.system = argument or None
        print(f"(system message {'set' if argument else 'removed'})", file=err)
    elif name == "/think" and argument in ("on", "off"):
        session.thinking = argument == "on"
        print(f"(thinking {argument})", file=err)
    else:
        print(f"unknown command {line.strip()!r}; {HELP}", file=err)
    return True


def user_lines(stdin: TextIO, interactive: bool) -> Iterator[str]:
    """Lines typed at a `> ` prompt (until Ctrl-D), or read from a pipe, one message per line."""
    if not interactive:
        yield from (line.rstrip("\r\n") for line in stdin)
        return
    while True:
        try:
            yield input("> ")
        except EOFError:
            print()
            return


def run_chat(
    settings: ChatSettings, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout, err: TextIO = sys.stderr
) -> None:
    """The chat loop: replies streamed to `out`, time to first token and notices to `err`."""
    settings.sampling.resolved(settings.fallback_sampling)  # a bad value fails before the model loads
    loaded = load_model(settings)
    sampling = settings.sampling.resolved(loaded.defaults)
    session = ChatSession(loaded, sampling, settings.max_context, settings.system, settings.thinking)
    interactive = stdin.isatty()
    print(f"{loaded.source} | {loaded.model.device} {loaded.model.dtype} | {sampling.describe()}", file=err)
    print(HELP, file=err)
    for line in user_lines(stdin, interactive):
        if line.strip().startswith("/"):
            if not run_command(session, line, err):
                break
        elif line.strip():
            if not interactive:
                print(f"> {line}", file=err)
            reply_turn(session, line, out, err)


def reply_turn(session: ChatSession, text: str, out: TextIO, err: TextIO) -> None:
    """Stream one reply; Ctrl-C stops it and an impossible turn prints its error, the chat goes on."""
    dropped = session.dropped_turns
    pieces = session.say(text)
    try:
        for piece in pieces:
            print(piece, end="", file=out, flush=True)
    except KeyboardInterrupt:
        print(" [interrupted]", end="", file=out)
    except GenerationError as error:
        print(f"error: {error}", file=err)
        return
    finally:
        pieces.close()
    print(file=out, flush=True)
    if session.dropped_turns > dropped:
        print(f"(dropped {session.dropped_turns - dropped} oldest turn(s) to fit the context)", file=err)
    print(f"[{session.stats.summary()} | {session.reused} cached ids reused]", file=err)
