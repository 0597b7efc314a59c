"""ChatSession: the cache reused across turns equals a fresh prefill, Qwen3's rollback, context policy."""

import io

import pytest
import torch
from test_generation import (
    QWEN_EOS,
    run,
    run_script,
    snapshot_overrides,
    snapshot_settings,
    tiny_model,
    tiny_qwen_snapshot,
)

from octlm.chat import ChatSession, common_prefix, run_command
from octlm.generation import GenerationError, LoadedModel, SamplingConfig, SamplingDefaults, load_model
from octlm.tokenizer import Tokenizer

MESSAGES = ["Hi there!", "What is 2 + 2?", "And times three?", "Thanks. Say it in French."]


@pytest.fixture(scope="module")
def loaded(qwen_files) -> LoadedModel:
    """A tiny random decoder with the real Qwen3 tokenizer and chat template (float32, CPU)."""
    tokenizer = Tokenizer.from_dir(qwen_files)
    model = tiny_model(vocab=151936, context=512)
    return LoadedModel(model, tokenizer, QWEN_EOS, SamplingDefaults(), "tiny")


def session_of(loaded: LoadedModel, max_new_tokens: int = 8, **kwargs) -> ChatSession:
    sampling = SamplingConfig(temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens)
    return ChatSession(loaded, sampling, **kwargs)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert (
        common_prefix([1, 2], [1, 2, 3]) == 2 and common_prefix([], [1]) == 0 and common_prefix([9], [1]) == 0
    )


@pytest.mark.parametrize("thinking", [False, True])
def test_session_equals_fresh_prefill_turn_after_turn(loaded, thinking):
    session = session_of(loaded, thinking=thinking, system="You are terse.")
    model, think_id = loaded.model, loaded.tokenizer.token_id("<think>")
    last_prompt: list[int] = []
    for turn, text in enumerate(MESSAGES):
        session.messages.append({"role": "user", "content": text})
        full, previous = session.render(), list(session.cached)
        rest = session.prepare()
        assert session.cached + rest == full
        with torch.no_grad():  # every position of the chunk on top of the cache (bottom-right mask)
            chunk = model(torch.tensor([rest]), cache=session.cache)[0]
            fresh = model(torch.tensor([full]))[0, -len(rest) :]
        torch.testing.assert_close(chunk, fresh, atol=2e-5, rtol=0)
        if turn > 0 and thinking:  # the last prompt is all kept, its reply from the first re-encoded id
            assert len(rest) > 1 and session.reused >= len(last_prompt)
        if turn > 0 and not thinking:  # the template dropped the empty think block of the last reply
            assert len(rest) > 1 and session.reused < len(previous) and previous[session.reused] == think_id
            assert session.reused == last_prompt.index(think_id)
        last_prompt = full
        session.messages.pop()
        expected = run(model, [full], session.sampling, QWEN_EOS, decoder=loaded.tokenizer.stream)[0]
        assert "".join(session.say(text)) == expected.text
        assert session.messages[-1] == {"role": "assistant", "content": expected.text}
        assert session.cached == (full + expected.tokens)[: session.cache.length]


def test_long_conversation_drops_oldest_turns_and_keeps_the_system_message(loaded):
    session = session_of(loaded, max_context=90, system="Be brief.")
    for text in MESSAGES * 2:
        reply = "".join(session.say(text))  # every reply runs to its end
        assert session.messages[-1] == {"role": "assistant", "content": reply}
        assert session.messages[0]["role"] == "user" and session.cache.length <= 90
    assert session.dropped_turns > 0 and len(session.messages) < 2 * 2 * len(MESSAGES)
    assert loaded.tokenizer.decode(session.render()).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_a_message_too_long_fails_before_the_reply(loaded):
    session = session_of(loaded, max_context=64)
    "".join(session.say("Hi"))
    before = list(session.messages)
    with pytest.raises(GenerationError, match="exceeds the chat's 64 positions"):
        "".join(session.say("word " * 80))
    assert session.messages == before


def test_commands_change_the_session(loaded):
    session, err = session_of(loaded), io.StringIO()
    "".join(session.say("Hi"))
    assert (
        run_command(session, "/system Speak like a pirate.", err) and session.system == "Speak like a pirate."
    )
    assert run_command(session, "/think on", err) and session.thinking is True
    assert run_command(session, "/think off", err) and session.thinking is False
    assert run_command(session, "/reset", err) and session.messages == [] and session.cache.length == 0
    assert run_command(session, "/nonsense", err) and "unknown command" in err.getvalue()
    assert not run_command(session, "/exit", err)


def test_chat_script_reads_a_scripted_conversation(qwen_files, tmp_path):
    snapshot = tiny_qwen_snapshot(tmp_path / "qwen3", qwen_files)
    sampling = SamplingConfig(temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=8)
    session = ChatSession(load_model(snapshot_settings(snapshot)), sampling, thinking=False)
    expected = ["".join(session.say(text)) for text in MESSAGES[:2]]
    script = f"/think off\n{MESSAGES[0]}\n\n{MESSAGES[1]}\n/exit\nnever read\n"
    done = run_script(
        "chat.py", *snapshot_overrides(snapshot, tmp_path), "sampling.temperature=0",
        "sampling.max_new_tokens=8", stdin=script,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "".join(reply + "\n" for reply in expected)
    assert done.stderr.count("time to first token") == 2 and "never read" not in done.stderr
