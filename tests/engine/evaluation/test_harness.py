"""The lm-eval adapter's three request types against hand computations on the model's own logits.

The models are tiny presets in float64 on the CPU, untrained, with a byte-level BPE whose id 0 is
the document separator; every score is checked against `model.logits` read directly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.lines import SENTENCE
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

from datalines.tokenizer import EMBEDDED_EOS_TOKEN, PlainTextTokenizer, train_byte_level_bpe
from engine.evaluation.harness import HARNESS_NAME, CheckpointLM, cut_at_first_stop
from engine.generation.loading import GenerationModel, document_separator
from engine.generation.session import DecodeSession
from engine.generation.settings import SamplingSettings
from engine.models.build import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENIZER_JSON = train_byte_level_bpe([SENTENCE] * 20, 300, [EMBEDDED_EOS_TOKEN])
PRESETS = ("transformer-tiny", "pssa-tiny")


def _adapter(
    preset: str, batch_rows: int = 8, device: str = "cpu", dtype: torch.dtype = torch.float64
) -> CheckpointLM:
    torch.manual_seed(0)
    model = build_model(preset, {"vocab_size": 300}).to(device, dtype).eval()
    tokenizer = PlainTextTokenizer(TOKENIZER_JSON, "tokenizer.json")
    loaded = GenerationModel(model, tokenizer, Path("u00000006"), preset, torch.device(device),
                             document_separator(model, tokenizer))  # fmt: skip
    return CheckpointLM(loaded, batch_rows=batch_rows)


def _requests(request_type: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(request_type, {}, argument, index) for index, argument in enumerate(arguments)]


def _encode(adapter: CheckpointLM, text: str) -> list[int]:
    return adapter.loaded.tokenizer.encode_documents([text])[0].tolist()


def _hand_log_probability(adapter: CheckpointLM, inputs: list[int], targets: list[int]) -> tuple[float, bool]:
    """The targets' log-probability at the inputs' last positions, read from one `model.logits` call."""
    with torch.no_grad():
        logits = adapter.loaded.model.logits(torch.tensor([inputs]))[0, len(inputs) - len(targets) :]
    log_softmax = torch.log_softmax(logits, dim=-1)
    total = sum(float(log_softmax[position, token]) for position, token in enumerate(targets))
    return total, logits.argmax(dim=-1).tolist() == targets


QUESTIONS = [
    ("the model", " trains"),
    ("spikes flow", " through layers"),
    ("", "each update"),  # an empty context: the continuation starts the document
    ("a model ", "moves on"),  # the context's trailing space belongs to the continuation
]
"""Requests short enough for every preset's context (PSSA-tiny's chunk is 16 tokens)."""


@pytest.mark.parametrize("preset", PRESETS)
def test_loglikelihood_is_the_continuations_log_softmax_after_its_context(preset: str) -> None:
    adapter = _adapter(preset)
    scores = adapter.loglikelihood(_requests("loglikelihood", QUESTIONS))
    for (context, continuation), (log_probability, greedy) in zip(QUESTIONS, scores):
        stripped = context.rstrip()
        context_ids = [0] + _encode(adapter, stripped)  # the separator starts the document
        continuation_ids = _encode(adapter, context[len(stripped) :] + continuation)
        assert len(context_ids) + len(continuation_ids) - 1 <= adapter.max_length
        expected, expected_greedy = _hand_log_probability(adapter, context_ids + continuation_ids[:-1], continuation_ids)
        assert log_probability == pytest.approx(expected, abs=1e-9)
        assert greedy == expected_greedy
        assert log_probability < 0


def test_a_greedy_continuation_reads_greedy_and_one_other_token_does_not() -> None:
    adapter = _adapter("transformer-tiny")
    context = [0, *_encode(adapter, "the model")]
    with torch.no_grad():
        ranked = adapter.loaded.model.logits(torch.tensor([context]))[0, -1].argsort(descending=True).tolist()
    (best, best_greedy), (other, other_greedy) = adapter.score_tokens([(context, ranked[:1]), (context, ranked[1:2])])
    assert best_greedy and not other_greedy and best > other


@pytest.mark.parametrize("preset", PRESETS)
def test_padding_a_batch_changes_no_score(preset: str) -> None:
    one_at_a_time = _adapter(preset, batch_rows=1).loglikelihood(_requests("loglikelihood", QUESTIONS))
    batched = _adapter(preset, batch_rows=len(QUESTIONS)).loglikelihood(_requests("loglikelihood", QUESTIONS))
    for (alone, alone_greedy), (together, together_greedy) in zip(one_at_a_time, batched):
        assert together == pytest.approx(alone, abs=1e-9) and together_greedy == alone_greedy


def test_a_context_longer_than_the_model_reads_keeps_its_last_tokens() -> None:
    adapter = _adapter("transformer-tiny")
    context = [0, *_encode(adapter, " ".join([SENTENCE] * 2))]
    continuation = _encode(adapter, " the model trains")
    assert len(context) > adapter.max_length  # transformer-tiny reads windows of 32 tokens
    whole = context + continuation
    kept = whole[len(whole) - 1 - adapter.max_length : -1]
    [(log_probability, _greedy)] = adapter.score_tokens([(context, continuation)])
    assert log_probability == pytest.approx(_hand_log_probability(adapter, kept, continuation)[0], abs=1e-9)


@pytest.mark.parametrize("preset", PRESETS)
def test_loglikelihood_rolling_predicts_every_token_once_with_the_context_that_fits(preset: str) -> None:
    adapter = _adapter(preset)
    adapter.max_length = 8  # the long text's 37 tokens then take five windows, the last one of 5
    short, long = "the model", " ".join(SENTENCE.split(" ")[:13])
    short_ids, long_ids = _encode(adapter, short), _encode(adapter, long)
    assert len(short_ids) <= 8 < len(long_ids) and len(long_ids) % 8
    rolled = adapter.loglikelihood_rolling(_requests("loglikelihood_rolling", [(short,), (long,)]))
    assert rolled[0] == pytest.approx(_hand_log_probability(adapter, [0, *short_ids[:-1]], short_ids)[0], abs=1e-9)
    # By hand: the first window reads the separator and the first 7 tokens and predicts the first 8;
    # each later one predicts the next 8 (fewer at the end) after the 8 tokens before its last target.
    expected = _hand_log_probability(adapter, [0, *long_ids[:7]], long_ids[:8])[0]
    for start in range(8, len(long_ids), 8):
        end = min(start + 8, len(long_ids))
        expected += _hand_log_probability(adapter, long_ids[end - 9 : end - 1], long_ids[start:end])[0]
    assert rolled[1] == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("preset", PRESETS)
def test_generate_until_writes_the_greedy_text_and_cuts_it_before_a_stop_string(preset: str) -> None:
    adapter = _adapter(preset)
    session = DecodeSession(adapter.loaded.model, adapter.loaded.device, SamplingSettings(temperature=0.0))
    session.feed([0, *_encode(adapter, "the model")])
    greedy_ids = [token for token in session.generate(12) if token != 0]
    greedy_text = adapter.loaded.tokenizer.decode(greedy_ids)
    stop = greedy_text[len(greedy_text) // 2 : len(greedy_text) // 2 + 2]
    assert stop and greedy_text
    free, stopped = adapter.generate_until(_requests("generate_until", [
        ("the model", {"until": [], "max_gen_toks": 12, "do_sample": False}),
        ("the model", {"until": [stop], "max_gen_toks": 12, "do_sample": False}),
    ]))  # fmt: skip
    if 0 not in session.tokens:  # the model did not end the document within 12 tokens
        assert free == greedy_text
    assert stopped == greedy_text[: greedy_text.find(stop)]


def test_cut_at_first_stop_cuts_before_the_earliest_stop() -> None:
    assert cut_at_first_stop("a, b. c", [".", ","]) == "a"
    assert cut_at_first_stop("a b", ["\n"]) == "a b"


def test_the_adapter_is_registered_with_the_harness() -> None:
    assert get_model(HARNESS_NAME) is CheckpointLM


@pytest.mark.cuda
@pytest.mark.parametrize("preset", PRESETS)
def test_on_cuda_the_scores_are_the_cpus_to_bf16_rounding(preset: str) -> None:
    cpu = _adapter(preset, dtype=torch.float32).loglikelihood(_requests("loglikelihood", QUESTIONS))
    cuda = _adapter(preset, device="cuda", dtype=torch.float32).loglikelihood(_requests("loglikelihood", QUESTIONS))
    for (on_cpu, _), (on_cuda, _) in zip(cpu, cuda):
        assert on_cuda == pytest.approx(on_cpu, rel=0.02, abs=0.05)  # bf16 autocast, as training computes
