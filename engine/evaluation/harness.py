"""The lm-evaluation-harness's model interface over a checkpoint alone, registered as `nsconsole`.

Any harness task then runs on a checkpoint (`nsconsole eval`, or lm-eval's own
`simple_evaluate(model="nsconsole", model_args={"checkpoint": ...})` once this module is
imported). Text goes through the tokenizer the checkpoint carries, and a text starts a document as
in the training rows: after the document separator (see `GenerationModel.prompt_ids`).

- `loglikelihood`: a continuation's log-probability after its context (the sum over its tokens of
  the log-softmax of `model.logits`), and whether greedy decoding would write it. Requests are
  scored `batch_rows` at a time, longest first, right-padded: the models are causal, so padding
  after a row's last token changes none of its logits.
- `loglikelihood_rolling`: a whole text's log-probability, read in windows of the model's context
  (`longest_context`) that each predict their tokens once with as much context as fits (the
  harness's rolling windows, the first one after the separator).
- `generate_until`: the model's decoder from the context on, greedy or drawn with the task's
  `temperature` and `top_p`, until one of the task's `until` strings appears (the text is cut
  before it), the separator is drawn (the document ended) or `max_gen_toks` tokens.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from engine.errors import LineError, NonFiniteLogits
from engine.generation.loading import GenerationModel, open_for_generation
from engine.generation.session import generation_precision
from engine.generation.settings import SamplingSettings
from engine.training.trainer import resolve_device

HARNESS_NAME = "nsconsole"
"""The name the adapter is registered under in lm-eval's model registry."""
DEFAULT_BATCH_ROWS = 8
"""Requests scored in one forward: their logits (rows x tokens x vocabulary) are what bounds it."""
DEFAULT_GENERATED_TOKENS = 256
"""Tokens a `generate_until` request may write when its task names no `max_gen_toks`."""

TokenPair = tuple[list[int], list[int]]
"""(context ids, continuation ids): a context of at least one token, then the tokens to score."""


@register_model(HARNESS_NAME)
class CheckpointLM(LM):
    """A loaded checkpoint as the harness's `LM` (see the module docstring)."""

    def __init__(self, loaded: GenerationModel, batch_rows: int = DEFAULT_BATCH_ROWS, seed: int = 0) -> None:
        super().__init__()
        if batch_rows < 1:
            raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
        self.loaded = loaded
        self.batch_rows = batch_rows
        self.seed = seed
        """Seeds the draws of generation tasks that sample (`do_sample`); greedy ones ignore it."""
        self.max_length = int(loaded.model.longest_context)
        """The most tokens one forward reads: longer inputs keep their last `max_length` tokens."""
        self._device = loaded.device

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> CheckpointLM:
        """lm-eval's `--model nsconsole --model_args checkpoint=PATH[,ema=True,seed=S]`."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> CheckpointLM:
        """`model_args` (checkpoint, ema, seed) plus the harness's `device` and `batch_size`."""
        extra = {key: value for key, value in (additional_config or {}).items()
                 if key in ("device", "batch_size") and value is not None}  # fmt: skip
        return open_checkpoint(**arg_dict, **extra)

    def get_model_info(self) -> dict[str, Any]:
        """What the harness records in its results' `config`: which checkpoint, which preset."""
        return {
            "checkpoint": str(self.loaded.directory),
            "weights": "ema" if self.loaded.average else "model",
            "preset": self.loaded.preset,
            "parameters": self.loaded.model.num_parameters(),
            "max_length": self.max_length,
        }

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*request.args) for request in requests]
        scores = self.score_tokens(pairs)
        for request, score in zip(requests, scores):
            self.cache_hook.add_partial("loglikelihood", request.args, score)
        return scores

    def loglikelihood_rolling(self, requests: list[Instance]) -> list[float]:
        separator = self._separator("loglikelihood_rolling")
        windows: list[TokenPair] = []
        owners: list[int] = []
        for index, request in enumerate(requests):
            (text,) = request.args
            for window in get_rolling_token_windows(self._encode(text), separator, self.max_length, 1):
                windows.append(make_disjoint_window(window))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (log_probability, _greedy) in zip(owners, self.score_tokens(windows)):
            totals[owner] += log_probability
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests: list[Instance]) -> list[str]:
        outputs = []
        for request in requests:
            context, generation_kwargs = request.args
            output = self._generate(context, dict(generation_kwargs))
            self.cache_hook.add_partial("generate_until", request.args, output)
            outputs.append(output)
        return outputs

    @torch.no_grad()
    def score_tokens(self, pairs: list[TokenPair]) -> list[tuple[float, bool]]:
        """Each continuation's log-probability after its context and whether every one of its
        tokens is the most likely one there, from the model's logits (summed in float64)."""
        results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
        rows = [self._window(context, continuation) for context, continuation in pairs]
        longest_first = sorted(range(len(rows)), key=lambda index: -len(rows[index][0]))
        model, device = self.loaded.model, self.loaded.device
        for start in range(0, len(longest_first), self.batch_rows):
            batch = longest_first[start : start + self.batch_rows]
            width = max(len(rows[index][0]) for index in batch)
            tokens = torch.zeros((len(batch), width), dtype=torch.long)
            for row, index in enumerate(batch):
                inputs = rows[index][0]
                tokens[row, : len(inputs)] = torch.tensor(inputs, dtype=torch.long)
            self.loaded.share_cpu()
            with generation_precision(device):
                logits = model.logits(tokens.to(device))
            for row, index in enumerate(batch):
                inputs, targets = rows[index]
                # On the device, in the logits' precision (at least float32): only the picked
                # log-probabilities come to the host, a window's full (tokens, vocabulary) never.
                scored = logits[row, len(inputs) - len(targets) : len(inputs)]
                scored = scored if scored.dtype == torch.float64 else scored.float()
                wanted = torch.tensor(targets, dtype=torch.long, device=device)
                picked = torch.log_softmax(scored, dim=-1).gather(1, wanted[:, None])
                total = float(picked.to("cpu", torch.float64).sum())
                if not math.isfinite(total):  # a diverged model: no score, not NaN in the results
                    raise self.loaded.overflowed(
                        "the log-probability of a continuation is not finite (the logits hold NaN or inf)",
                        "be evaluated",
                    )
                results[index] = (total, bool((scored.argmax(dim=-1) == wanted).all()))
        return results

    def _window(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """(inputs, targets): the model reads at most `max_length` tokens, the last ones, and the
        targets are the continuation, predicted at the inputs' last positions."""
        if len(continuation) > self.max_length:
            raise LineError(
                f"{self.loaded.directory}: a continuation of {len(continuation)} tokens does not fit "
                f"{self.loaded.preset}'s context of {self.max_length} tokens"
            )
        if not context:
            raise ValueError("a continuation is scored after a context of at least one token")
        whole = context + continuation
        inputs = whole[max(0, len(whole) - 1 - self.max_length) : len(whole) - 1]
        return inputs, continuation

    def _encode(self, text: str) -> list[int]:
        """A text's token ids as training encoded documents (plain text)."""
        return self.loaded.tokenizer.encode_documents([text])[0].tolist() if text else []

    def _encode_pair(self, context: str, continuation: str) -> TokenPair:
        """A request's context (as a document's start) and continuation; the context's trailing
        spaces move to the continuation, where a byte-level BPE puts them (` word` is one token)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        return self.loaded.prompt_ids(context), self._encode(continuation)

    def _separator(self, request_type: str) -> int:
        separator = self.loaded.separator
        if separator is None:
            raise LineError(
                f"{self.loaded.directory}: its tokenizer names no document separator, which "
                f"{request_type} needs as the token before a text's first one"
            )
        return separator

    def _generate(self, context: str, generation_kwargs: dict[str, Any]) -> str:
        """One `generate_until` request's text (see the module docstring)."""
        kwargs = normalize_gen_kwargs(generation_kwargs, default_max_gen_toks=DEFAULT_GENERATED_TOKENS)
        stops = [stop for stop in kwargs["until"] if stop]
        settings = SamplingSettings(
            temperature=float(kwargs.get("temperature") or 0.0),
            top_p=float(kwargs.get("top_p") or 1.0),
            seed=self.seed,
        )
        session = self.loaded.session(settings)
        separator = self.loaded.separator
        generated: list[int] = []
        text = ""
        with generation_precision(self.loaded.device):
            session.feed(self.loaded.prompt_ids(context))
            try:
                for token in session.generate(kwargs["max_gen_toks"], stop=separator):
                    if token == separator:
                        break
                    generated.append(token)
                    text = self.loaded.tokenizer.decode(generated)
                    if any(stop in text for stop in stops):
                        break
            except NonFiniteLogits as error:
                raise self.loaded.overflowed(f"{error} in a generate_until request", "be evaluated") from None
        return cut_at_first_stop(text, stops)


def cut_at_first_stop(text: str, stops: list[str]) -> str:
    """The text before the earliest of the stop strings (all of it when none appears)."""
    cut = min((position for stop in stops if (position := text.find(stop)) >= 0), default=len(text))
    return text[:cut]


def open_checkpoint(
    checkpoint: str, ema: bool = False, device: str = "auto", batch_size: int | str = DEFAULT_BATCH_ROWS, seed: int = 0
) -> CheckpointLM:
    """The adapter over CHECKPOINT|LINE (a line: its latest checkpoint), verified and loaded on
    `device` (auto: the GPU when there is one); `ema` loads the parameters' moving average."""
    loaded = open_for_generation(Path(checkpoint), resolve_device(device, "device"), average=bool(ema), command="eval")
    rows = DEFAULT_BATCH_ROWS if batch_size == "auto" else int(batch_size)
    return CheckpointLM(loaded, batch_rows=rows, seed=int(seed))
