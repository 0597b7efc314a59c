"""Generation: sampling, stops, streaming text, batching with left padding, context limits."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from qwen_snapshots import random_qwen, save_snapshot

from octlm import generation
from octlm.config import DecoderConfig, ModelSpec
from octlm.generation import (
    GenerateSettings,
    GenerationError,
    GenerationStats,
    SamplingConfig,
    SamplingDefaults,
    TextStream,
    candidates,
    complete,
    encode_prompt,
    generate,
    load_model,
    pick_dtype,
    read_generation_defaults,
    sample,
)
from octlm.model import Decoder

ROOT = Path(__file__).resolve().parents[1]
QWEN_EOS = [151645, 151643]
GREEDY = SamplingConfig(temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=12)
NO_EOS: list[int] = []


def tiny_model(seed: int = 0, vocab: int = 256, context: int = 64) -> Decoder:
    """A random Qwen3-shaped decoder whose greedy continuations vary from token to token."""
    torch.manual_seed(seed)
    config = DecoderConfig(
        vocab_size=vocab, context_length=context, d_model=32, n_heads=4, kv_heads=2, n_layers=2,
        head_dim=16, rope_split=True, qk_norm=True, rope_base=1e6, norm_eps=1e-6,
    )  # fmt: skip
    model = Decoder(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.3)
    return model


def greedy_without_cache(model: Decoder, prompt: list[int], steps: int) -> list[int]:
    """Reference: re-run the whole sequence for every token, argmax of the last position."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def run(model, prompts, sampling=GREEDY, eos=NO_EOS, **kwargs):
    return complete(generate(model, prompts, sampling, eos, **kwargs), len(prompts))


# sampling ---------------------------------------------------------------------------------------


def warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The candidates spread back over the vocabulary (B, V), -inf for every token left out."""
    values, ids = candidates(logits, temperature, top_k, top_p)
    if ids is None:
        return values
    return torch.full_like(logits, float("-inf")).scatter(-1, ids, values)


def test_temperature_zero_is_argmax():
    logits = torch.randn(3, 50)
    assert torch.equal(sample(logits, 0.0, top_k=5, top_p=0.5), logits.argmax(-1))


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.7), (10, 0.9), (0, 0.999), (3, 0.5)])
def test_warp_matches_transformers_warpers(top_k, top_p):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(3)) * 3
    reference = logits / 0.7
    if top_k:
        reference = TopKLogitsWarper(top_k)(None, reference)
    reference = TopPLogitsWarper(top_p)(None, reference)
    assert torch.equal(warp(logits, 0.7, top_k, top_p), reference)


def test_top_p_stops_as_soon_as_the_mass_is_reached():
    logits = torch.tensor([[1.0, 0.5, 0.25, 0.25]]).log()  # exact binary fractions: ties are real
    from transformers.generation.logits_process import TopPLogitsWarper

    for top_p, kept in ((0.3, 1), (0.5, 1), (0.7, 2), (0.75, 2)):
        warped = warp(logits, 1.0, 0, top_p)
        assert torch.isfinite(warped).sum() == kept and torch.equal(
            warped, TopPLogitsWarper(top_p)(None, logits)
        )


def test_draws_stay_inside_top_k_and_top_p():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(3)) * 3
    allowed = torch.isfinite(warp(logits, 0.7, 10, 0.9))
    generator = torch.Generator().manual_seed(0)
    drawn = torch.stack([sample(logits, 0.7, 10, 0.9, generator) for _ in range(200)])
    assert allowed.gather(1, drawn.T).all()


def test_draws_follow_the_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    generator = torch.Generator().manual_seed(1)
    draws = torch.cat([sample(probs.log(), 1.0, generator=generator) for _ in range(20000)])
    frequencies = torch.bincount(draws, minlength=4).float() / len(draws)
    torch.testing.assert_close(frequencies, probs[0], atol=0.01, rtol=0)


def test_seeded_sampling_is_reproducible():
    model = tiny_model()
    sampling = SamplingConfig(temperature=1.0, top_k=50, top_p=0.95, seed=7, max_new_tokens=20)
    first = run(model, [[1, 2, 3]], sampling)[0].tokens
    assert run(model, [[1, 2, 3]], sampling)[0].tokens == first
    other = SamplingConfig(temperature=1.0, top_k=50, top_p=0.95, seed=8, max_new_tokens=20)
    assert run(model, [[1, 2, 3]], other)[0].tokens != first


# the decode loop --------------------------------------------------------------------------------


def test_greedy_with_cache_equals_recomputing_everything():
    model = tiny_model()
    prompt = [5, 17, 99, 3, 42]
    out = run(model, [prompt])[0]
    assert out.tokens == greedy_without_cache(model, prompt, GREEDY.max_new_tokens)
    assert out.finish == "length" and len(set(out.tokens)) > 3  # a continuation that varies


def test_stops_on_every_eos_id():
    model = tiny_model()
    expected = run(model, [[1, 2, 3]])[0].tokens
    first_at = {token: expected.index(token) for token in expected}
    a, b = [t for t in expected if first_at[t] >= 2][:2]
    for eos in ([a, 255], [255, b]):
        out = run(model, [[1, 2, 3]], eos=eos)[0]
        stop = next(t for t in expected if t in eos)
        assert out.finish == "eos" and out.tokens == expected[: first_at[stop] + 1]


def test_batched_left_padded_rows_equal_their_unbatched_runs_and_stop_alone():
    model = tiny_model()
    prompts = [[7], [1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7, 6]]
    alone = [run(model, [p])[0].tokens for p in prompts]
    eos = [alone[1][3]]  # row 1 ends after four tokens; the others must not notice
    expected = [tokens[: tokens.index(eos[0]) + 1] if eos[0] in tokens else tokens for tokens in alone]
    batched = run(model, prompts, eos=eos)
    assert [out.tokens for out in batched] == expected
    assert batched[1].finish == "eos" and len(batched[1].tokens) <= 4
    assert any(out.finish == "length" for out in batched)


@pytest.fixture(params=[False, True], ids=["in_order", "run_ahead"])
def run_ahead(request, monkeypatch) -> bool:
    """Both decode-loop orders on the CPU: token t read before step t + 1 is launched, or after."""
    monkeypatch.setattr(generation, "RUN_AHEAD_DEVICES", ("cuda", "mps", "cpu") if request.param else ())
    return request.param


def test_both_loop_orders_give_the_same_tokens_and_stops(run_ahead):
    model = tiny_model()
    prompts = [[7], [1, 2, 3, 4, 5, 6, 7, 8]]
    expected = [greedy_without_cache(model, p, 12) for p in prompts]
    eos = [expected[1][4]]
    outs = run(model, prompts, eos=eos)
    cut = expected[1].index(eos[0]) + 1
    assert outs[1].tokens == expected[1][:cut] and outs[1].finish == "eos"
    assert outs[0].tokens == (
        expected[0][: expected[0].index(eos[0]) + 1] if eos[0] in expected[0] else expected[0]
    )


def test_cache_holds_the_prompt_and_the_fed_tokens(run_ahead):
    model = tiny_model()
    cache = model.new_cache(1, 40)
    out = run(model, [[1, 2, 3]], cache=cache)[0]
    assert cache.length == 3 + len(out.tokens) - 1  # the last token is never fed back
    stop = out.tokens[4]
    cache.reset()
    out = run(model, [[1, 2, 3]], eos=[stop], cache=cache)[0]
    assert cache.length == 3 + len(out.tokens) - (0 if run_ahead else 1)  # run ahead feeds the stop id too


def test_stats_count_tokens_and_time():
    model = tiny_model()
    stats = GenerationStats()
    run(model, [[1, 2], [3, 4, 5]], stats=stats)
    figures = stats.as_dict()
    assert (stats.rows, stats.prompt_tokens, stats.new_tokens) == (2, 5, 24)
    assert figures["prefill_tokens_per_second"] > 0 and figures["decode_tokens_per_second"] > 0
    assert "24 tokens" in stats.summary() and json.dumps(figures)


def test_non_finite_logits_fail_clearly():
    model = tiny_model()
    with torch.no_grad():
        model.final_norm.weight[0] = float("inf")
    with pytest.raises(GenerationError, match="non-finite logits.*dtype=bfloat16"):
        run(model, [[1, 2, 3]])


# context limits ---------------------------------------------------------------------------------


def test_overflow_is_a_clear_error_before_any_compute(monkeypatch):
    model = tiny_model(context=16)
    monkeypatch.setattr(model, "forward", lambda *a, **k: pytest.fail("ran the model"))
    with pytest.raises(GenerationError, match="10 tokens plus max_new_tokens=12 needs 22 positions"):
        run(model, [list(range(10))])
    with pytest.raises(GenerationError, match="no room"):
        run(model, [[1]], SamplingConfig(temperature=0, top_k=0, top_p=1, max_new_tokens=16))


def test_overflow_can_drop_the_prompts_left_side():
    model = tiny_model(context=16)
    truncate = SamplingConfig(
        temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=12, overflow="truncate_left"
    )
    prompt = list(range(10, 20))
    assert run(model, [prompt], truncate)[0].tokens == run(model, [prompt[-4:]])[0].tokens


def test_cache_too_small_is_a_clear_error():
    model = tiny_model()
    with pytest.raises(GenerationError, match="needs 15 positions but only 14 are available"):
        run(model, [[1, 2, 3]], cache=model.new_cache(1, 14))


# text streaming ---------------------------------------------------------------------------------


def chars(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


class CharDecoder:
    """A TextDecoder where id i is the character chr(i)."""

    def step(self, token_id: int) -> str:
        return chr(token_id)

    def flush(self) -> str:
        return ""


def push_all(stream: TextStream, text: str) -> list[str]:
    return [stream.push(ord(c)) for c in text]


def test_stop_string_is_held_back_then_cut():
    stream = TextStream(CharDecoder(), stop=["END"])
    pieces = push_all(stream, "abENxEND!")
    assert pieces == ["a", "b", "", "", "ENx", "", "", "", ""]
    assert stream.stopped and stream.flush() == ""


def test_held_text_is_released_at_the_end():
    stream = TextStream(CharDecoder(), stop=["<stop>", "zz"])
    assert "".join(push_all(stream, "1 <st")) == "1 "
    assert stream.flush() == "<st" and not stream.stopped


def test_stop_string_ends_a_generated_row():
    model = tiny_model()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    expected = run(model, [prompt])[0].tokens
    stop = chars(expected[3:5])
    cut = chars(expected).index(stop)  # the first place the stop string completes
    stopped = SamplingConfig(temperature=0, top_k=0, top_p=1.0, max_new_tokens=12, stop=[stop])
    out = run(model, [prompt], stopped, decoder=CharDecoder)[0]
    assert out.finish == "stop" and out.tokens == expected[: cut + 2] and out.text == chars(expected[:cut])


def test_streamed_text_of_a_row_is_its_decoded_tokens(qwen_files):
    from octlm.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(qwen_files)
    model = tiny_model(vocab=151936)
    out = run(model, [tokenizer.encode("Tschüß 🙂 世界")], decoder=tokenizer.stream)[0]
    assert out.text == tokenizer.decode(out.tokens) and len(out.text) > 0


# defaults ---------------------------------------------------------------------------------------


def test_qwen_defaults_come_from_generation_config(qwen_files, tmp_path):
    fallback = SamplingDefaults(temperature=0.8, top_k=40, top_p=1.0)
    qwen = read_generation_defaults(qwen_files / "generation_config.json", fallback)
    assert (qwen.temperature, qwen.top_k, qwen.top_p) == (0.6, 20, 0.95)
    assert read_generation_defaults(tmp_path / "missing.json", fallback) == fallback
    override = SamplingConfig(temperature=0.0).resolved(qwen)
    assert (override.temperature, override.top_k, override.top_p) == (0.0, 20, 0.95)


def test_bad_sampling_values_name_the_field():
    with pytest.raises(GenerationError, match="sampling.top_p"):
        SamplingConfig(temperature=1.0, top_k=0, top_p=0.0).validate()
    with pytest.raises(GenerationError, match="sampling.overflow"):
        SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, overflow="wrap").validate()


def test_auto_dtype_on_cpu_is_float32_and_names_are_checked():
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(GenerationError, match="dtype='int8'"):
        pick_dtype("int8", torch.device("cpu"))


# a random-weight Qwen3 snapshot written by transformers, with the real tokenizer --------------------


def tiny_qwen_snapshot(directory: Path, qwen_files: Path, seed: int = 3) -> Path:
    """A Qwen3 of hidden size 64 and the real 151,936-row vocabulary, saved by transformers."""
    save_snapshot(random_qwen(seed=seed, vocab_size=151936), directory, qwen_files)
    shutil.copy(qwen_files / "generation_config.json", directory / "generation_config.json")
    return directory


def snapshot_settings(snapshot: Path, **overrides) -> GenerateSettings:
    spec = ModelSpec(name="tiny-qwen3", path=str(snapshot))  # no repo: the architecture is config.json's
    return GenerateSettings(model=spec, device="cpu", dtype="float32", **overrides)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory, qwen_files) -> Path:
    return tiny_qwen_snapshot(tmp_path_factory.mktemp("tiny") / "qwen3", qwen_files)


def transformers_greedy(snapshot: Path, prompt: list[int], new_tokens: int, eos: list[int]) -> list[int]:
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(snapshot, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_equals_transformers_on_a_snapshot(snapshot):
    settings = snapshot_settings(snapshot)
    loaded = load_model(settings)
    assert loaded.eos_ids == QWEN_EOS and (loaded.defaults.temperature, loaded.defaults.top_k) == (0.6, 20)
    prompts = [encode_prompt(loaded.tokenizer, text, True, settings) for text in ("What is 2 + 2?", "Hi")]
    sampling = SamplingConfig(temperature=0.0, top_k=0, top_p=1.0, max_new_tokens=24)
    batched = run(loaded.model, prompts, sampling, loaded.eos_ids, decoder=loaded.tokenizer.stream)
    for prompt, out in zip(prompts, batched, strict=True):
        assert out.tokens == transformers_greedy(snapshot, prompt, 24, QWEN_EOS)
        assert out.text == loaded.tokenizer.decode(out.tokens)


def test_generation_config_eos_ids_stop_a_loaded_model(snapshot, tmp_path, qwen_files):
    settings = snapshot_settings(snapshot)
    loaded = load_model(settings)
    prompt = encode_prompt(loaded.tokenizer, "Hi", True, settings)
    expected = run(loaded.model, [prompt], eos=loaded.eos_ids)[0].tokens
    stop = expected[5]
    other = tmp_path / "qwen3"
    shutil.copytree(snapshot, other, ignore=shutil.ignore_patterns("*manifest*"))
    config = json.loads((other / "generation_config.json").read_text())
    (other / "generation_config.json").write_text(json.dumps(config | {"eos_token_id": [151645, stop]}))
    reloaded = load_model(snapshot_settings(other))
    out = run(reloaded.model, [prompt], eos=reloaded.eos_ids)[0]
    assert out.finish == "eos" and out.tokens == expected[: expected.index(stop) + 1]


# scripts/generate.py ------------------------------------------------------------------------------


def run_script(name: str, *overrides: str, stdin: str = "", env: dict | None = None, cwd: Path = ROOT):
    """Run scripts/NAME.py in a fresh process; returns the CompletedProcess (text mode)."""
    command = [sys.executable, str(ROOT / "scripts" / name), *overrides]
    return subprocess.run(
        command,
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def snapshot_overrides(snapshot: Path, tmp_path: Path) -> list[str]:
    return [f"model.path={snapshot}", "model.repo=null", "device=cpu", f"hydra.run.dir={tmp_path / 'hydra'}"]


def test_generate_script_streams_the_greedy_reply_of_transformers(snapshot, tmp_path):
    loaded = load_model(snapshot_settings(snapshot))
    prompt = encode_prompt(loaded.tokenizer, "What is 2 + 2?", True, snapshot_settings(snapshot))
    expected = loaded.tokenizer.decode(transformers_greedy(snapshot, prompt, 16, QWEN_EOS))
    done = run_script(
        "generate.py", *snapshot_overrides(snapshot, tmp_path), "prompt=What is 2 + 2?",
        "sampling.temperature=0", "sampling.max_new_tokens=16",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected + "\n"
    assert "16 tokens | prefill" in done.stderr and "time to first token" in done.stderr


def test_generate_script_json_is_seeded_and_batched(snapshot, tmp_path):
    settings = snapshot_settings(snapshot)
    loaded = load_model(settings)
    prompts = [encode_prompt(loaded.tokenizer, text, True, settings) for text in ("Hi", "Tell me a story")]
    sampling = SamplingConfig(seed=11, max_new_tokens=10).resolved(loaded.defaults)
    expected = run(loaded.model, prompts, sampling, loaded.eos_ids, decoder=loaded.tokenizer.stream)
    done = run_script(
        "generate.py", *snapshot_overrides(snapshot, tmp_path), "prompts=[Hi,Tell me a story]",
        "sampling.seed=11", "sampling.max_new_tokens=10", "output=json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["Hi", "Tell me a story"]
    assert [r["text"] for r in records] == [out.text for out in expected]
    assert records[0]["stats"]["rows"] == 2 and records[0]["stats"]["new_tokens"] == 20


def test_generate_script_offline_without_snapshot_says_what_to_do(tmp_path):
    done = run_script(
        "generate.py", "model=qwen3", f"cache_dir={tmp_path}", "prompt=hi", f"hydra.run.dir={tmp_path / 'h'}",
        env={"HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert "Traceback" not in done.stderr and done.stderr.startswith("error: ")
    assert "model.path" in done.stderr  # how to provide a snapshot


# an octlm-trained TinyStories checkpoint ------------------------------------------------------------

STORY_ARCH = dict(vocab_size=300, context_length=64, d_model=32, n_heads=8, kv_heads=2, n_layers=2)
STORY_OVERRIDES = [f"model.arch.{key}={value}" for key, value in STORY_ARCH.items()]


def story_checkpoint(root: Path) -> Path:
    """A checkpoint laid out as octlm.train writes it: weights, state.json with the config, tokenizer."""
    from octlm.checkpoint import save_checkpoint
    from octlm.data import TokenizerSpec, train_tokenizer

    stories = ["Once upon a time, a little cat found a red ball.", "The dog ran to the park. He was happy!"]
    tokenizer = train_tokenizer(
        stories * 20, TokenizerSpec(vocab_size=300, sample_stories=40, min_frequency=1)
    )
    assert tokenizer.get_vocab_size() == 300
    tokenizer.save(str(root / "tokenizer.json"))
    config = DecoderConfig(**STORY_ARCH)
    torch.manual_seed(0)
    model = Decoder(config)
    return save_checkpoint(
        root / "checkpoints",
        7,
        tensors={"model.safetensors": model.state_dict()},
        json_files={"state.json": {"config": asdict(config)}},
        copies={"tokenizer.json": root / "tokenizer.json"},
    )


def story_settings(root: Path, **arch_overrides) -> GenerateSettings:
    spec = ModelSpec(name="tinystories", arch=DecoderConfig(**(STORY_ARCH | arch_overrides)))
    return GenerateSettings(model=spec, checkpoint=str(root / "checkpoints"), device="cpu")


def test_tinystories_checkpoint_loads_with_its_tokenizer_and_stops_at_eot(tmp_path):
    from octlm.checkpoint import CheckpointError

    story_checkpoint(tmp_path)
    loaded = load_model(story_settings(tmp_path))
    assert loaded.eos_ids == [loaded.tokenizer.token_id("<|endoftext|>")] == [0]
    assert (loaded.defaults.temperature, loaded.defaults.top_k) == (0.8, 40)  # no generation_config.json
    prompt = loaded.tokenizer.encode("Once upon a time")
    out = run(loaded.model, [prompt], decoder=loaded.tokenizer.stream)[0]
    assert out.tokens == greedy_without_cache(loaded.model, prompt, 12)
    with pytest.raises(CheckpointError, match="unlike model=tinystories"):
        load_model(story_settings(tmp_path, n_layers=3))


def test_generate_script_continues_a_story_from_a_checkpoint(tmp_path):
    story_checkpoint(tmp_path)
    loaded = load_model(story_settings(tmp_path))
    prompt = loaded.tokenizer.encode("Once upon a time")
    expected = run(loaded.model, [prompt], GREEDY, loaded.eos_ids, decoder=loaded.tokenizer.stream)[0]
    done = run_script(
        "generate.py", "model=tinystories", f"checkpoint={tmp_path / 'checkpoints'}", *STORY_OVERRIDES,
        "prompt=Once upon a time", "sampling.temperature=0", "sampling.max_new_tokens=12",
        "device=cpu", f"hydra.run.dir={tmp_path / 'hydra'}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == "Once upon a time" + expected.text + "\n"
