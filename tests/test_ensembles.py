"""Ensembles: ``fairseq-generate --path a.pt:b.pt`` on every mechanism (tests/mechanisms.py)
and on the multi-source Transformer with each combination strategy (text and image sources).

fairseq averages an ensemble's probabilities, not its log-probabilities: the score of a
token is log(mean_i p_i) (``SequenceScorer`` for ``--score-reference``, logsumexp - log n in
``EnsembleModel.forward_decoder`` for beam search). Each printed token score is compared with
that average computed here from each model's own teacher-forced forward pass over the
sentence alone, so that
* ``--score-reference`` checks the batched, padded full forward pass of each model;
* beam search checks incremental decoding of two models side by side, each with its own
  caches (MLMHA's projected layers, aggregation states, the multi-source memories), reordered
  as hypotheses move among the beams and, in the command-line test, as finished sentences
  leave the batch.

The two models of a case are trained briefly from seeds 1 and 2 (in this process, on the
training criterion) and saved as fairseq checkpoints. fairseq-generate runs in this process
(``fairseq_cli.generate.main`` on its own parser's arguments, as fairseq's own tests run it),
once per case and mode; one test runs the command itself.
"""
import itertools
import math
import re

import pytest
import torch
from fairseq import options, tasks
from fairseq.dataclass.utils import convert_namespace_to_omegaconf
from fairseq_cli import generate

from fairseq_helpers import TINY_MODEL_ARGS, USER_DIR, run_fairseq
from fixtures.tiny_fairseq import save_checkpoint
from mechanisms import MECHANISMS
from test_multi_source import n_way_bin  # noqa: F401  (the fixture: the N-way corpus with image features)

from mlmha_fairseq.modules.input_combination import STRATEGIES

MULTI_SOURCE_TASK = ["--task", "multi_source_translation", "--source-langs", "s1,s2,img",
                     "--target-lang", "tgt", "--image-sources", "img"]
# name -> (data fixture, task options, architecture and model options)
CASES = {
    **{name: ("data_bin", [], options) for name, options in MECHANISMS.items()},
    **{f"multi_source {strategy}": ("n_way_bin", MULTI_SOURCE_TASK,
                                    ["multi_source_transformer", "--combination-strategy", strategy])
       for strategy in STRATEGIES},
}
# In CI, one ensemble per mechanism and its most involved variant; the other variants (the
# rest of MLMHA's, layer aggregation's and MLRF's, two of the four strategies) and the plain slot
# model, which every mechanism's case builds on, with `make exhaustive`.
EXHAUSTIVE_CASES = {"slot_transformer", "mlmha M-00", "mlmha M-01", "mlmha M-10", "aggregation s-agg",
                    "aggregation iter-s-agg", "aggregation c-agg", "aggregation transparent", "mlrf Enc-FNN",
                    "multi_source parallel", "multi_source flat"}
assert EXHAUSTIVE_CASES < CASES.keys(), EXHAUSTIVE_CASES - CASES.keys()
SEEDS = (1, 2)
# Training long enough that the models emit no <s> (fairseq-generate's text leaves it out, so a
# hypothesis holding one cannot be scored here) and that the MLMHA models of the command-line
# test end sentences at different lengths; short enough to take about a second per model.
UPDATES, MAX_TOKENS, LR = 80, 100, 0.01
# All 16 test sentences in one batch.
GENERATION = ["--cpu", "--beam", "3", "--nbest", "3", "--max-len-a", "1", "--max-len-b", "5",
              "--required-batch-size-multiple", "1"]
# fairseq-generate prints token scores in base 2, rounded to four decimals.
ATOL = 1e-4


def build_ensemble(data, task_options, model_options, directory):
    """The task (with its test split) and two models built as fairseq-train builds them, with
    seeds 1 and 2, each saved as a checkpoint in ``directory``; (task, models, paths)."""
    arch, *model_options = model_options
    args = options.parse_args_and_arch(options.get_training_parser(), [
        str(data), "--user-dir", USER_DIR, *task_options, "--arch", arch, *TINY_MODEL_ARGS, *model_options])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    for split in ("train", "test"):
        task.load_dataset(split)
    models, paths = [], []
    for seed in SEEDS:
        torch.manual_seed(seed)
        models.append(trained(task, task.build_model(cfg.model), task.build_criterion(cfg.criterion), seed))
        paths.append(save_checkpoint(directory / f"seed{seed}.pt", cfg, models[-1]))
    return task, models, paths


def trained(task, model, criterion, seed):
    """``model`` after UPDATES updates of Adam on the training criterion, in eval mode."""
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    batches = task.get_batch_iterator(task.dataset("train"), max_tokens=MAX_TOKENS, seed=seed).next_epoch_itr(shuffle=True)
    model.train()
    for sample in itertools.islice(itertools.cycle(batches), UPDATES):
        optimizer.zero_grad()
        loss, _, _ = criterion(model, sample)
        loss.backward()
        optimizer.step()
    return model.eval()


def generate_in_process(data, paths, task_options, results, *extra):
    """fairseq-generate's output for the test split, with the checkpoints as one ensemble."""
    args = options.parse_args_and_arch(options.get_generation_parser(), [
        str(data), "--user-dir", USER_DIR, *task_options, "--path", ":".join(map(str, paths)),
        *GENERATION, "--results-path", str(results), *extra])
    generate.main(args)
    return (results / "generate-test.txt").read_text()


def hypotheses(output):
    """(sentence id, score, tokenized text, token scores), base e, one per H- line in order."""
    heads = re.findall(r"^H-(\d+)\t(\S+)\t(.*)$", output, flags=re.M)
    positional = re.findall(r"^P-(\d+)\t(.*)$", output, flags=re.M)
    assert heads and [i for i, _, _ in heads] == [i for i, _ in positional]
    return [(int(i), float(score) * math.log(2), text, torch.tensor([float(s) for s in scores.split()]) * math.log(2))
            for (i, score, text), (_, scores) in zip(heads, positional)]


def model_log_probs(task, models, sentence_id, tokens):
    """Each model's log-probability of every token of ``tokens`` (ending with EOS) for test
    sentence ``sentence_id``: a teacher-forced full forward pass over that sentence alone."""
    dataset = task.dataset("test")
    net_input = dataset.collater([dataset[sentence_id]])["net_input"]
    eos = task.target_dictionary.eos()
    net_input["prev_output_tokens"] = torch.cat([tokens.new_tensor([eos]), tokens[:-1]])[None]
    with torch.no_grad():
        logits = [model(**net_input)[0][0] for model in models]
    return torch.stack([torch.log_softmax(x.double(), -1).gather(-1, tokens[:, None]).squeeze(-1) for x in logits])


def ensemble_average(per_model):
    """log of the mean probability over the models."""
    return torch.logsumexp(per_model, 0) - math.log(per_model.size(0))


def check_against_hand_computed(output, task, models, score, tokens_of):
    """Every hypothesis's token scores equal the hand-computed ensemble average, its score
    equals ``score(token scores)``; and the average differs from each model's own scores, so
    that an ensemble of the first model alone would fail. Returns the number of hypotheses."""
    found = hypotheses(output)
    differences = torch.zeros(len(models))
    for sentence_id, printed_score, text, printed in found:
        tokens = tokens_of(sentence_id, text)
        # fairseq prints a hypothesis without its <s> symbols: the models must not emit any
        assert len(tokens) == len(printed), f"sentence {sentence_id}: {text} holds <s>"
        per_model = model_log_probs(task, models, sentence_id, tokens)
        expected = ensemble_average(per_model)
        context = f"sentence {sentence_id}: {text}"
        torch.testing.assert_close(printed.double(), expected, atol=ATOL * math.log(2), rtol=0, msg=lambda m: f"{context}: {m}")
        assert printed_score == pytest.approx(score(expected).item(), abs=ATOL), context
        differences = torch.maximum(differences, (per_model - expected).abs().max(-1).values)
    assert (differences > 0.01).all(), f"the ensemble's scores are one model's: {differences}"
    return len(found)


@pytest.fixture(scope="module", params=[
    pytest.param(case, id=name, marks=[pytest.mark.exhaustive] if name in EXHAUSTIVE_CASES else [])
    for name, case in CASES.items()])
def ensemble(request, tmp_path_factory):
    fixture, task_options, model_options = request.param
    data = request.getfixturevalue(fixture)
    task, models, paths = build_ensemble(data, task_options, model_options, tmp_path_factory.mktemp("ensemble"))
    return data, task_options, task, models, paths


def test_score_reference_is_the_average_of_the_models_probabilities(ensemble, tmp_path):
    """``--score-reference``: the token scores of the reference, and the sentence score (their
    mean: fairseq's scorer divides by the length)."""
    data, task_options, task, models, paths = ensemble
    output = generate_in_process(data, paths, task_options, tmp_path / "results", "--score-reference")
    dataset = task.dataset("test")

    def reference(sentence_id, text):
        tokens = dataset[sentence_id]["target"]
        assert text == task.target_dictionary.string(tokens)
        return tokens

    found = check_against_hand_computed(output, task, models, lambda s: s.mean(), reference)
    assert found == len(dataset)


def encoded(task):
    """The target tokens of a printed hypothesis, with the EOS that ends every hypothesis."""
    return lambda _, text: task.target_dictionary.encode_line(text, add_if_not_exist=False).long()


def check_beam_search(output, task, models):
    """Every hypothesis (three per sentence) scores the hand-computed ensemble average, and its
    sentence score is their mean (fairseq's default normalisation, length penalty 1). Returns
    each sentence's longest hypothesis length: the step at which it left the batch."""
    found = check_against_hand_computed(output, task, models, lambda s: s.mean(), encoded(task))
    assert found == 3 * len(task.dataset("test"))
    longest = {}
    for sentence_id, _, _, scores in hypotheses(output):
        longest[sentence_id] = max(longest.get(sentence_id, 0), len(scores))
    return longest


def test_beam_search_scores_are_the_average_of_the_models_probabilities(ensemble, tmp_path):
    """Beam search through both models' incremental states."""
    data, task_options, task, models, paths = ensemble
    longest = check_beam_search(generate_in_process(data, paths, task_options, tmp_path / "results"), task, models)
    # hypotheses moved among the beams at two steps or more
    assert max(longest.values()) >= 3, longest


def test_fairseq_generate_command_with_two_checkpoints(data_bin, tmp_path):
    """The command line itself, ``fairseq-generate --path a.pt:b.pt``, on MLMHA."""
    mlmha = ["slot_transformer", "--decoder-cross-attention", "multi-layer", "--mlmha-variant", "M-11"]
    task, models, paths = build_ensemble(data_bin, [], mlmha, tmp_path)
    output = run_fairseq("generate", data_bin, "--user-dir", USER_DIR, "--path", f"{paths[0]}:{paths[1]}",
                         *GENERATION).stdout
    longest = check_beam_search(output, task, models)
    # Some sentence left the batch before the others: these models have learned when to end a
    # sentence, and MLMHA's cache copies rows only when the batch shrinks.
    assert min(longest.values()) < max(longest.values()), f"every sentence ended at the same step: {longest}"
