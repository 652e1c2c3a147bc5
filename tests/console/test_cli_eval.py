"""`nsconsole eval` end to end: lm-eval tasks defined here, on local files, run on a tiny trained line.

Three task YAMLs, one per request type (a multiple-choice task: loglikelihood; a perplexity task:
loglikelihood_rolling; a generation task: generate_until), read JSONL files through the harness's
`json` dataset builder with the hub and `datasets` offline. The command runs as a user runs it, in
a fresh process; its scores are checked against the checkpoint's logits read here by hand.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.checkpoints import overflowing, rewritten_checkpoint
from helpers.harness_index import harness_index_once  # noqa: F401 (a fixture)
from helpers.lines import data_template_fixture, trained_line_fixture

from engine.checkpoints.format import code_version
from engine.errors import NonFiniteLogits
from engine.evaluation import harness
from engine.evaluation.harness import HARNESS_NAME, CheckpointLM, open_checkpoint
from engine.generation.loading import GenerationModel
from engine.models.base import LanguageModel
from engine.models.transformer.model import TransformerLM
from nsconsole.cli import main

pytestmark = pytest.mark.usefixtures("one_thread", "harness_index_once")

data_template = data_template_fixture(prepare=1)
line = trained_line_fixture()

CHOICE_DOCUMENTS = [
    {"question": "the model trains on", "choices": ["tokens", "spikes", "memory"], "answer": 0},
    {"question": "spikes flow through", "choices": ["layers", "a cycle"], "answer": 0},
    {"question": "each update reads", "choices": ["checkpoint", "windows"], "answer": 1},
    {"question": "never scored: --limit 3", "choices": ["a", "b"], "answer": 0},
]
PERPLEXITY_DOCUMENTS = [
    {"text": "the model trains on tokens"},
    {"text": "while spikes flow through layers of state"},
    {"text": "then writes a checkpoint"},
]
PROMPTS = ["the model trains", "a cycle then"]
LIMIT = 3


@pytest.fixture(scope="module")
def adapter(line: Path) -> CheckpointLM:
    return open_checkpoint(str(line), device="cpu")


def write_jsonl(path: Path, documents: list[dict]) -> Path:
    path.write_text("".join(json.dumps(document) + "\n" for document in documents))
    return path


def task_yaml(name: str, data: Path, output_type: str, fields: str) -> str:
    return (f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\noutput_type: {output_type}\n{fields}")  # fmt: skip


def greedy_text(adapter: CheckpointLM, prompt: str) -> str:
    """What the generation task's model writes after `prompt`, by the adapter itself."""
    from lm_eval.api.instance import Instance

    request = Instance("generate_until", {}, (prompt, {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}), 0)
    return adapter.generate_until([request])[0]


@pytest.fixture(scope="module")
def tasks(adapter: CheckpointLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of the three task YAMLs and their data: the generation task's first answer is
    the model's own greedy text (an exact match), its second one a text it cannot write."""
    root = tmp_path_factory.mktemp("tasks")
    choice = write_jsonl(root / "choice.jsonl", CHOICE_DOCUMENTS)
    perplexity = write_jsonl(root / "perplexity.jsonl", PERPLEXITY_DOCUMENTS)
    answers = [greedy_text(adapter, PROMPTS[0]), "\u2603 not a text of this model"]
    generation = write_jsonl(root / "generate.jsonl",
                             [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, answers)])  # fmt: skip
    (root / "nsc_choice.yaml").write_text(task_yaml("nsc_choice", choice, "multiple_choice", (
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: acc\n")))  # fmt: skip
    (root / "nsc_perplexity.yaml").write_text(task_yaml("nsc_perplexity", perplexity, "loglikelihood_rolling", (
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")))  # fmt: skip
    (root / "nsc_generate.yaml").write_text(task_yaml("nsc_generate", generation, "generate_until", (
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n")))  # fmt: skip
    return root


def log_probability(loaded: GenerationModel, context: list[int], continuation: list[int]) -> float:
    """log p(continuation | context) from one call of the model's logits (both fit its context)."""
    tokens = context + continuation
    with torch.no_grad():
        logits = loaded.model.logits(torch.tensor([tokens[:-1]], device=loaded.device))[0]
    scored = torch.log_softmax(logits[len(context) - 1 :].double(), dim=-1)
    return float(sum(scored[position, token] for position, token in enumerate(continuation)))


def encode(loaded: GenerationModel, text: str) -> list[int]:
    return loaded.tokenizer.encode_documents([text])[0].tolist()


@pytest.mark.slow  # indexing the harness's own tasks takes seconds
def test_eval_runs_local_tasks_of_every_request_type(
    line: Path, adapter: CheckpointLM, tasks: Path, tmp_path: Path
) -> None:
    output = tmp_path / "results" / "eval.json"
    environment = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                   "PYTHONPATH": os.pathsep.join(sys.path)}  # fmt: skip
    completed = subprocess.run(
        [sys.executable, "-m", "nsconsole", "eval", str(line), "--tasks", "nsc_choice,nsc_perplexity,nsc_generate",
         "--include-path", str(tasks), "--limit", str(LIMIT), "--device", "cpu", "--output", str(output)],
        env=environment, capture_output=True, text=True, timeout=300, cwd=tmp_path,  # outside a git checkout
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    latest = line / "checkpoints" / "u00000002"
    assert f"{latest} (transformer-tiny, " in completed.stderr
    # The harness ran `git describe` where the user stood: `fatal: not a git repository` on the
    # terminal, or another repository's hash in the results. This code's version is recorded.
    assert "fatal:" not in completed.stderr
    for task in ("nsc_choice", "nsc_perplexity", "nsc_generate"):
        assert f"|{task}" in completed.stdout.replace(" ", "")  # a row of the results table
    results = json.loads(output.read_text())
    assert results["config"]["checkpoint"] == str(latest)
    assert results["git_hash"] == code_version()
    # What was run: the weights (not --ema's average), the device, the requests per forward.
    assert {key: results["config"][key] for key in ("weights", "device", "batch_size")} == {
        "weights": "model", "device": "cpu", "batch_size": 8}  # fmt: skip
    loaded = adapter.loaded
    separator = [loaded.separator]

    # Multiple choice: each choice after the question and the harness's " ", the likeliest one picked.
    hits = 0
    for document in CHOICE_DOCUMENTS[:LIMIT]:
        context = separator + encode(loaded, document["question"])
        scores = [log_probability(loaded, context, encode(loaded, " " + choice)) for choice in document["choices"]]
        hits += scores.index(max(scores)) == document["answer"]
    assert results["results"]["nsc_choice"]["acc,none"] == pytest.approx(hits / LIMIT)

    # Perplexity: every text after the separator, in bits per UTF-8 byte.
    texts = [document["text"] for document in PERPLEXITY_DOCUMENTS]
    nats = -sum(log_probability(loaded, separator, encode(loaded, text)) for text in texts)
    bits_per_byte = nats / math.log(2) / sum(len(text.encode("utf-8")) for text in texts)
    assert results["results"]["nsc_perplexity"]["bits_per_byte,none"] == pytest.approx(bits_per_byte, rel=1e-6)
    assert results["results"]["nsc_perplexity"]["word_perplexity,none"] > 1

    # Generation: the first answer is what the model writes, the second is not.
    assert results["results"]["nsc_generate"]["exact_match,none"] == pytest.approx(0.5)


def test_the_harness_builds_the_adapter_from_its_model_args(line: Path) -> None:
    from lm_eval.api.registry import get_model

    built = get_model(HARNESS_NAME).create_from_arg_string(f"checkpoint={line}", {"device": "cpu", "batch_size": 3})
    assert built.loaded.directory == line / "checkpoints" / "u00000002"
    assert built.batch_rows == 3 and built.loaded.device == torch.device("cpu")


@pytest.mark.slow  # the task index is read before the names are checked against it
def test_an_unknown_task_is_refused_in_one_line(line: Path, tasks: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["eval", str(line), "--tasks", "nsc_choice,no_such_task", "--include-path", str(tasks),
                   "--device", "cpu"])  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    assert status == 2
    assert err[-1] == (f"nsconsole: no task named no_such_task (neither the harness's nor a YAML file; task YAMLs "
                       f"searched under {tasks}); `lm-eval ls tasks` lists the harness's tasks")  # fmt: skip


@pytest.mark.slow  # the task index is read before the task is built
def test_a_task_whose_local_data_is_missing_is_refused_in_one_line(
    line: Path, tasks: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "gone.jsonl"
    (tmp_path / "nsc_missing.yaml").write_text(task_yaml("nsc_missing", missing, "multiple_choice", (
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n')))  # fmt: skip
    status = main(["eval", str(line), "--tasks", "nsc_choice,nsc_missing", "--include-path", str(tasks),
                   "--include-path", str(tmp_path), "--device", "cpu"])  # fmt: skip
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    last = captured.err.splitlines()[-1]
    assert last.startswith(f"nsconsole: task nsc_missing: its data could not be read: Unable to find '{missing}'; ")
    assert "Traceback" not in captured.err


@pytest.mark.slow  # a fresh process: torch, the task index and the checkpoint load first
def test_a_hub_task_that_cannot_reach_the_hub_is_refused_in_one_line(line: Path, tmp_path: Path) -> None:
    """hellaswag with no network: the hub offline, as the harness's download meets an unreachable
    hub (`Couldn't reach 'Rowan/hellaswag' on the Hub (...)`), without waiting for its retries."""
    environment = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                   "PYTHONPATH": os.pathsep.join(sys.path)}  # fmt: skip
    completed = subprocess.run(
        [sys.executable, "-m", "nsconsole", "eval", str(line), "--tasks", "hellaswag", "--limit", "10",
         "--device", "cpu"], env=environment, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert completed.returncode == 2 and completed.stdout == "", completed.stderr
    last = completed.stderr.splitlines()[-1]
    assert last.startswith("nsconsole: task hellaswag: its data could not be read: Couldn't reach "
                           "'Rowan/hellaswag' on the Hub (")  # fmt: skip
    assert "Traceback" not in completed.stderr


def test_a_family_without_a_decoder_is_refused_in_one_line(
    line: Path, tasks: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TransformerLM, "decode", LanguageModel.decode)
    status = main(["eval", str(line), "--tasks", "nsc_choice", "--include-path", str(tasks), "--device", "cpu"])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    assert captured.err.startswith(f"nsconsole: {line / 'checkpoints' / 'u00000002'}: transformer-tiny has no "
                                   "stepwise decoder yet")  # fmt: skip
    assert captured.err.count("\n") == 1


def unloadable(*arguments: object, **options: object) -> None:
    raise AssertionError("the checkpoint was loaded before the tasks were checked")


@pytest.mark.slow  # the task index is read before the names are checked against it
@pytest.mark.parametrize(
    ("names", "include", "refusal"),
    [
        ("", "{tasks}", "--tasks names no task"),
        ("nsc_choice", "{tasks}/nsc_choice.yaml", "{tasks}/nsc_choice.yaml: --include-path must be a directory of "
                                                  "task YAML files"),
        ("no_such_task", "{tasks}", "no task named no_such_task (neither the harness's nor a YAML file; task YAMLs "
                                    "searched under {tasks}); `lm-eval ls tasks` lists the harness's tasks"),
    ],
)  # fmt: skip
def test_tasks_that_cannot_run_are_refused_before_the_checkpoint_loads(
    line: Path, tasks: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    names: str, include: str, refusal: str,
) -> None:  # fmt: skip
    # The checkpoint loaded first (minutes for a large one), its header printed as if it would run.
    monkeypatch.setattr(harness, "open_checkpoint", unloadable)
    status = main(["eval", str(line), "--tasks", names, "--include-path", include.format(tasks=tasks),
                   "--device", "cpu"])  # fmt: skip
    captured = capsys.readouterr()
    assert (status, captured.out) == (2, "")
    assert captured.err == f"nsconsole: {refusal.format(tasks=tasks)}\n"


@pytest.mark.parametrize(
    ("source", "refusal"),
    [("{line}/nowhere", "{line}/nowhere: no such checkpoint or training line"),
     ("{line}", "--device is 'cuda' but no CUDA device is available")],
)  # fmt: skip
def test_a_path_or_device_that_cannot_serve_is_refused_before_the_tasks_are_read(
    line: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, source: str, refusal: str
) -> None:
    from engine.evaluation import run

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    monkeypatch.setattr(run, "task_manager", unloadable)
    monkeypatch.setattr(harness, "open_checkpoint", unloadable)
    status = main(["eval", source.format(line=line), "--tasks", "nsc_choice", "--device", "cuda"])
    captured = capsys.readouterr()
    assert (status, captured.out, captured.err) == (2, "", f"nsconsole: {refusal.format(line=line)}\n")


def test_a_model_whose_logits_overflow_is_refused_naming_the_checkpoint(line: Path, tmp_path: Path) -> None:
    # A diverged checkpoint (finite weights, logits of NaN or inf) was scored NaN and its accuracy
    # reported as if it were a measurement; its generate_until requests ended in torch's traceback.
    from lm_eval.api.instance import Instance

    checkpoint = rewritten_checkpoint(line / "checkpoints" / "u00000002", tmp_path, overflowing)
    adapter = open_checkpoint(str(checkpoint), device="cpu")
    refusal = (" (the weights are finite, so the activations overflow): this checkpoint cannot be evaluated; "
               "an earlier one may")  # fmt: skip
    with pytest.raises(NonFiniteLogits) as scoring:
        adapter.loglikelihood([Instance("loglikelihood", {}, ("the model trains on", " tokens"), 0)])
    assert str(scoring.value) == (f"{checkpoint}: the log-probability of a continuation is not finite (the logits "
                                  f"hold NaN or inf){refusal}")  # fmt: skip
    with pytest.raises(NonFiniteLogits) as generating:
        greedy_text(adapter, PROMPTS[0])
    assert str(generating.value).startswith(f"{checkpoint}: the model's next-token logits hold ")
    assert str(generating.value).endswith(f" in a generate_until request{refusal}")


# Found walking `nsconsole eval` with task YAMLs of one's own, as a user writes them: each failed before its fix.

CHOICE_FIELDS = 'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'


@pytest.mark.slow  # the task index is read for each case
@pytest.mark.parametrize(
    ("mistake", "refusal"),
    [
        ("output_type", "task nsc_mistake: cannot be built from {yaml}: ValueError: Got invalid output_type 'choice', "
                        "must be in "),
        ("template", "task nsc_mistake: cannot be built from {yaml}: UndefinedError: 'query' is undefined"),
        ("data", "task nsc_mistake: cannot be built from {yaml}: DatasetGenerationError: An error occurred while "
                 "generating the dataset (from "),
        ("yaml", "no task named nsc_mistake (neither the harness's nor a YAML file; task YAMLs searched under {root}); "
                 "the harness skipped {yaml} (ScannerError: mapping values are not allowed"),
    ],
)  # fmt: skip
def test_a_task_yaml_with_a_mistake_is_refused_in_one_line_naming_it(
    line: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    mistake: str, refusal: str,
) -> None:  # fmt: skip
    # A task YAML of one's own with a wrong field, a template naming no field of its documents or
    # a JSONL line that is not JSON ended in the harness's traceback (exit status 1); one that does
    # not parse was only `no task named ...`, as if --include-path were wrong.
    monkeypatch.setattr(harness, "open_checkpoint", unloadable)
    root = tmp_path / "tasks"
    root.mkdir()
    data = write_jsonl(tmp_path / "choice.jsonl", CHOICE_DOCUMENTS)
    fields = {
        "output_type": ("choice", CHOICE_FIELDS),
        "template": ("multiple_choice", CHOICE_FIELDS.replace("{{question}}", "{{query}}")),
    }.get(mistake, ("multiple_choice", CHOICE_FIELDS))
    if mistake == "data":
        data.write_text(data.read_text() + "not json\n")
    text = task_yaml("nsc_mistake", data, *fields)
    if mistake == "yaml":
        text = text.replace("test_split: test", "test_split: test: [")
    yaml = root / "nsc_mistake.yaml"
    yaml.write_text(text)
    status = main(["eval", str(line), "--tasks", "nsc_mistake", "--include-path", str(root), "--device", "cpu"])
    captured = capsys.readouterr()
    assert (status, captured.out) == (2, "")  # a traceback would be status 1
    assert captured.err.splitlines()[-1].startswith("nsconsole: " + refusal.format(yaml=yaml, root=root))


def test_ema_of_a_checkpoint_without_an_average_is_refused_before_the_tasks_are_read(
    line: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # `--ema` on a line that keeps no average was refused only once the tasks were read: after their
    # datasets downloaded (minutes for the harness's own) and the checkpoint loaded.
    from engine.evaluation import run

    monkeypatch.setattr(run, "task_manager", unloadable)
    monkeypatch.setattr(harness, "open_checkpoint", unloadable)
    status = main(["eval", str(line), "--tasks", "hellaswag", "--ema", "--device", "cpu"])
    captured = capsys.readouterr()
    assert (status, captured.out) == (2, "")
    assert captured.err == (f"nsconsole: {line / 'checkpoints' / 'u00000002' / 'optimizer.safetensors'}: no parameter "
                            "average at update 2 (run.json sets no `ema`, or the average had not started yet); eval "
                            "without --ema\n")  # fmt: skip


def test_ctrl_c_during_the_evaluation_ends_on_a_line_of_its_own_saying_nothing_was_written(
    adapter: CheckpointLM, line: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # Ctrl-C ended the command silently: the shell's prompt followed `^C` on the progress bar's
    # line, and nothing said whether --output had been written.
    from engine.evaluation import run

    def interrupted(*arguments: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "prepare_tasks", lambda settings: None)  # the harness's tasks are not what is tested
    monkeypatch.setattr(harness, "open_checkpoint", lambda *arguments, **options: adapter)
    monkeypatch.setattr(run, "evaluate", interrupted)
    output = tmp_path / "eval.json"
    status = main(["eval", str(line), "--tasks", "nsc_choice", "--device", "cpu", "--output", str(output)])
    captured = capsys.readouterr()
    assert (status, captured.out, output.exists()) == (130, "", False)
    assert captured.err.endswith(f"\ninterrupted (Ctrl-C) before the results; nothing written to {output}\n")
