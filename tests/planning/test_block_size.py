"""The block-size cost model: expected tau, the predicted speedup, the choice (or plain decoding),
`auto_block_size` on a tiny target with its timings measured once and then read from the cache, and bench's
auto runs of DFlash and DART drafters."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from typer.testing import CliRunner

import dflax
from dflax.cli import app
from dflax.decoding.sampling import SamplingParams
from dflax.drafters import (
    DraftSampling,
    load_dart,
    load_drafter,
    measured_acceptance,
    measured_rank_acceptance,
)
from dflax.drafters.dart import DartConfig
from dflax.planning import cost_curve, probe, projection
from dflax.planning.auto import AutoSettings
from dflax.planning.block_size import (
    choose_block_size,
    expected_square,
    expected_tau,
    mean_of_largest_normal,
    static_batch_tau,
)
from dflax.planning.tree_budget import tree_commit_moments

# A whole decode step per block size, relative to a plain step: flat-ish up to 4 tokens, then growing (the
# CPU's shape).
PLAIN_S = 1.0
CHAIN_S = {2: 1.2, 4: 1.3, 8: 1.85, 16: 2.7}


def test_expected_tau_is_one_plus_the_sum_of_cumulative_acceptance():
    accept = [0.5, 0.5, 0.5]
    assert expected_tau(accept, 2) == 1.5
    assert expected_tau(accept, 4) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tau([1.0] * 15, 16) == 16.0 and expected_tau([0.0] * 15, 16) == 1.0
    with pytest.raises(ValueError, match="needs acceptance for 4 positions, have 3"):
        expected_tau(accept, 5)


def test_commit_variance_and_the_largest_of_several_normals():
    accept = [0.5, 0.5, 0.5]
    # c = 1, 2, 3, 4 with probability 1/2, 1/4, 1/8, 1/8.
    assert expected_square(accept, 4) == pytest.approx(1 / 2 + 4 / 4 + 9 / 8 + 16 / 8)
    assert expected_square([1.0] * 7, 8) == 64.0
    assert mean_of_largest_normal(1) == 0.0
    assert mean_of_largest_normal(2) == pytest.approx(1 / np.sqrt(np.pi), abs=1e-6)
    assert mean_of_largest_normal(8) == pytest.approx(1.4236, abs=1e-3)  # tabulated


@pytest.mark.parametrize("accept, block", [([0.6, 0.53, 0.45], 4), ([0.6], 2), ([0.8] * 7, 8)])
def test_static_batch_tau_matches_simulated_batches_that_wait_for_their_slowest_row(accept, block):
    """Rows of 128 new tokens whose steps commit independent counts from the acceptance: the batch's
    tokens per row per step, simulated, against the normal approximation."""
    rng = np.random.default_rng(0)
    rows, new_tokens, batches = 8, 128, 4000
    survive = np.concatenate([[1.0], np.cumprod(accept[: block - 1])])  # P(c > k) for k = 0 .. B-1
    p = survive - np.concatenate([survive[1:], [0.0]])  # P(c = k + 1)
    counts = rng.choice(np.arange(1, block + 1), size=(batches, rows, new_tokens), p=p)
    steps = (np.cumsum(counts, axis=2) < new_tokens).sum(axis=2) + 1  # steps until a row has its tokens
    simulated = new_tokens / steps.max(axis=1).mean()
    tau, square = expected_tau(accept, block), expected_square(accept, block)
    predicted = static_batch_tau(tau, square, rows, new_tokens)
    assert predicted == pytest.approx(simulated, rel=0.02)
    assert predicted < tau * 0.99 or block == 8  # the batch waits (a strong drafter's spread is small)
    assert static_batch_tau(tau, square, 1, new_tokens) == tau


def test_choice_maximises_predicted_speedup():
    accept = [0.97] * 15
    choice = choose_block_size(accept, PLAIN_S, CHAIN_S)
    for b, (_, speedup) in choice.predicted.items():  # the formula, written out
        assert speedup == pytest.approx(expected_tau(accept, b) * PLAIN_S / CHAIN_S[b])
    assert choice.block_size == max(choice.predicted, key=lambda b: choice.predicted[b][1])
    assert choice.block_size == 16 and "B=16" in choice.describe()
    # A weak drafter: tokens per step rise slower than the step's cost, so a small block wins.
    weak = choose_block_size([0.6, 0.4, 0.2] + [0.05] * 12, PLAIN_S, CHAIN_S)
    assert weak.block_size == 4


def test_plain_decoding_when_no_block_size_pays():
    choice = choose_block_size([0.14, 0.11] + [0.0] * 13, PLAIN_S, CHAIN_S)  # the first shipped drafter
    assert choice.block_size is None
    assert all(speedup < 1.0 for _, speedup in choice.predicted.values())
    assert "plain decoding" in choice.describe()
    # Just above break-even is not enough: timings and acceptance move between runs.
    assert choose_block_size([0.15], 1.0, {2: 1.1}).block_size is None  # 1.15 / 1.1 = 1.05x
    assert choose_block_size([0.3], 1.0, {2: 1.1}).block_size == 2  # 1.3 / 1.1 = 1.18x


def test_static_batches_pay_for_waiting_on_their_slowest_row():
    """A drafter like stage 5's at batch 8 (HumanEval, 128 new tokens, steps as the bench timed them):
    without waiting B=2 would pay, eight rows that wait for their slowest do not."""
    accept = [0.604, 0.533, 0.448]
    plain, chains = 0.0722, {2: 0.1035, 3: 0.1255, 4: 0.1487}
    alone = choose_block_size(accept, plain, chains)
    batch = choose_block_size(accept, plain, chains, rows=8, new_tokens=128)
    assert alone.block_size == 2 and alone.predicted[2][1] > 1.1
    assert batch.block_size is None
    for b in chains:
        tau, speedup = batch.predicted[b]
        assert tau == alone.predicted[b][0] and speedup < alone.predicted[b][1]


@pytest.fixture(autouse=True)
def runs_are_timed(monkeypatch):
    """The runs here are short (a few prompts of a few tokens): time their steps all the same, as a long
    run's are (`test_a_short_run_is_not_timed` covers short runs)."""
    monkeypatch.setattr(cost_curve, "AUTO_MIN_STEPS", 0)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    target = dflax.load_target(str(tiny_checkpoint("llama")[0]))
    return target, load_drafter("untrained", target, block_size=4)


def test_auto_block_size_measures_once_then_reads_the_cache(tiny, monkeypatch):
    target, drafter = tiny
    with pytest.raises(ValueError, match="no measured per-position acceptance"):
        cost_curve.auto_block_size(target, drafter, rows=2, context=20)

    perfect = dataclasses.replace(drafter, accept=(1.0,) * 15)  # every draft accepted: tau = B
    chosen, choice = cost_curve.auto_block_size(target, perfect, rows=2, context=20)
    assert set(choice.predicted) == {2, 3, 4, 6, 8, 12, 16}  # the candidates up to the trained B=16
    # The tiny model's timings are mostly dispatch and follow the machine's load: check the choice is the
    # best predicted one (or plain decoding), not which one wins.
    best = max(choice.predicted, key=lambda b: choice.predicted[b][1])
    assert choice.block_size in (best, None)
    assert (chosen is None) == (choice.block_size is None)
    assert chosen is None or chosen.proposer.block_size == choice.block_size
    for b, (tau, _) in choice.predicted.items():
        assert tau == b

    def must_not_measure(*args, **kwargs):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(cost_curve, "step_times", must_not_measure)
    useless = dataclasses.replace(drafter, accept=(0.0,) * 15)  # the same shapes, nothing accepted
    chosen, choice = cost_curve.auto_block_size(target, useless, rows=2, context=20)
    assert chosen is None and choice.block_size is None


def test_auto_weighs_trees_when_the_drafter_recorded_rank_acceptance(tiny, monkeypatch):
    target, drafter = tiny
    costs = cost_curve.step_costs(target, drafter, 2, 20, 0, [2, 4], tree_budgets=(4,))
    assert costs["plain_s"] > 0 and set(costs["chain_s"]) == {2, 4} and set(costs["tree_s"]) == {4}

    def flat_costs(target, drafter, rows, context, slots, candidates, reps=7, tree_budgets=(), sampling=None):
        return {
            "plain_s": 1.0,
            "chain_s": {b: 1.1 for b in candidates},
            "tree_s": {n: 1.1 for n in tree_budgets},
        }

    monkeypatch.setattr(cost_curve, "step_costs", flat_costs)
    # Right at rank 0 or rank 1 half the time each: a chain commits about 2 tokens, a tree far more.
    split = dataclasses.replace(drafter, accept=(0.5,) * 15, rank_accept=((0.5, 0.5) + (0.0,) * 6,) * 15)
    chosen, choice = cost_curve.auto_block_size(target, split, rows=2, context=20)
    assert set(choice.predicted_trees) == set(cost_curve.AUTO_TREE_BUDGETS)
    assert (choice.block_size, choice.tree_budget) == (16, 64)  # flat step costs: the largest tree
    assert chosen.proposer.tree_budget == 64 and chosen.proposer.block_size == 16
    chains, chain_choice = cost_curve.auto_block_size(target, split, rows=2, context=20, trees=False)
    assert chain_choice.predicted_trees == {} and chains.proposer.tree_budget == 0


def test_steps_are_timed_at_the_runs_temperature_and_draft_sampling(tiny, monkeypatch):
    """A sampling step (the target's draw, sampled drafts, block verification) costs more than a greedy
    one: each temperature and draft sampling is timed once, never read from another's cache entry."""
    target, drafter = tiny
    sampled = load_drafter("untrained", target, block_size=4, draft_sampling=DraftSampling("sample", 0.6))
    times = cost_curve.step_times(
        target,
        sampled.params,
        {"plain": None, "chain": sampled.proposer},
        2,
        20,
        64,
        1,
        SamplingParams.make(1.0),
    )
    assert times["plain"] > 0 and times["chain"] > 0  # sampled drafts and block verification run

    timed = []

    def record(target, params, proposers, rows, context, slots, reps, sampling=None):
        mode = proposers["chain", 2].draft_sampling.mode
        timed.append((mode, float(sampling.temperature), round(float(sampling.top_p), 6)))
        return {key: 1.0 for key in proposers}

    monkeypatch.setattr(cost_curve, "step_times", record)
    t0, t1, nucleus = SamplingParams.make(0.0), SamplingParams.make(1.0), SamplingParams.make(1.0, top_p=0.9)
    runs = [(drafter, t0), (sampled, t1), (drafter, t0), (sampled, t1), (drafter, t1), (sampled, nucleus)]
    for chosen, sampling in runs:
        cost_curve.step_costs(target, chosen, 3, 20, 0, [2, 4], sampling=sampling)
    # Each setting is timed once, then read from the cache.
    assert timed == [("greedy", 0.0, 1.0), ("sample", 1.0, 1.0), ("greedy", 1.0, 1.0), ("sample", 1.0, 0.9)]


def test_auto_predicts_trees_from_their_simulated_commits_when_recorded(tiny, monkeypatch):
    """The held-out trees' simulated commits (`tree_commits`) replace the rank acceptance's estimate."""
    target, drafter = tiny

    def costs(target, drafter, rows, context, slots, candidates, reps=7, tree_budgets=(), sampling=None):
        return {
            "plain_s": 1.0,
            "chain_s": {b: 1.0 + 0.05 * b for b in candidates},
            "tree_s": {n: 1.1 + 0.05 * n for n in tree_budgets},
        }

    monkeypatch.setattr(cost_curve, "step_costs", costs)
    # The rank acceptance says a tree adds nothing to the chain (rank 0 only); the simulated trees of 4
    # and 8 nodes commit 3 and 5 tokens a step, no more past 8 nodes.
    curve = tuple((1 + min(n, 8) / 2, (1 + min(n, 8) / 2) ** 2) for n in range(65))
    ranked = dataclasses.replace(drafter, accept=(0.5,) * 15, rank_accept=((0.5,) + (0.0,) * 7,) * 15)
    simulated = dataclasses.replace(ranked, tree_commits=curve)
    _, by_ranks = cost_curve.auto_block_size(target, ranked, rows=1, context=20)
    chosen, by_trees = cost_curve.auto_block_size(target, simulated, rows=1, context=20)
    assert by_ranks.tree_budget == 0
    assert by_trees.predicted_trees[8][0] == pytest.approx(5.0) and by_trees.tree_budget == 8
    assert chosen.proposer.tree_budget == 8


def test_probe_acceptance_scales_the_held_out_acceptance(tiny):
    _, drafter = tiny
    held_out = dataclasses.replace(
        drafter, accept=(0.8, 0.5, 0.5) + (0.1,) * 12, rank_accept=((0.8, 0.1),) + ((0.5, 0.3),) * 14
    )
    # A B=4 chain: 10 steps committed 1 token, 6 two, 4 four. Drafts accepted: 6 + 4 * 3 = 18; the held-out
    # acceptance predicts 20 * 0.8 + 10 * 0.5 + 4 * 0.5 = 23 for the same steps reaching each draft.
    measured, scale = probe.scaled_to_probe(held_out, [0, 10, 6, 0, 4], 4)
    assert scale == pytest.approx(18 / 23)
    np.testing.assert_allclose(measured.accept, np.asarray(held_out.accept) * 18 / 23)
    assert measured.rank_accept[0] == pytest.approx((0.8 * 18 / 23, 0.1 * 18 / 23))
    better, scale = probe.scaled_to_probe(held_out, [0, 0, 0, 0, 30], 4)  # every draft accepted
    assert scale == pytest.approx(90 / 54) and max(better.accept) == 1.0
    assert all(sum(row) <= 1 + 1e-9 for row in better.rank_accept)
    assert probe.scaled_to_probe(held_out, [0, 0, 0, 0, 0], 4) == (held_out, None)
    # A 4-node tree over B=4 blocks that committed 1.5 tokens a step: the scale whose rank acceptance
    # predicts that tau for the same tree.
    tree, scale = probe.scaled_to_probe(held_out, [0, 5, 5, 0, 0, 0], 4, tree_budget=4)
    assert 0 < scale < 1 and tree.rank_accept[0] == pytest.approx((0.8 * scale, 0.1 * scale))
    assert tree_commit_moments(np.asarray(tree.rank_accept)[:3], 4)[4, 0] == pytest.approx(1.5, abs=1e-6)
    # The same tree with simulated commits: they scale to the probe's 1.5 tokens, the chain alike.
    curve = tuple((1 + 0.5 * min(n, 4), (1 + 0.5 * min(n, 4)) ** 2) for n in range(9))  # 3 tokens at 4
    simulated = dataclasses.replace(held_out, tree_commits=curve)
    tree, scale = probe.scaled_to_probe(simulated, [0, 5, 5, 0, 0, 0], 4, tree_budget=4)
    assert tree.tree_commits[4][0] == pytest.approx(1.5, abs=1e-6)  # drafts 2 -> 0.5: a quarter
    assert tree.tree_commits[2][0] == pytest.approx(1 + 1.0 / 4, abs=1e-6)
    assert expected_tau(tree.accept, 4) - 1 == pytest.approx((expected_tau(held_out.accept, 4) - 1) / 4)
    assert [probe.probe_size(r, n) for r, n in ((1, 40), (8, 40), (8, 8), (3, 10), (1, 4))] == [
        4,
        8,
        0,
        6,
        0,
    ]


def drafter_claiming(tmp_path, drafter, accept: float):
    """`drafter` saved with a TRAINING.json whose validation claims acceptance `accept` at 15 positions."""
    directory = tmp_path / "drafter"
    drafter.save(directory)
    (directory / "TRAINING.json").write_text(json.dumps({"final_validation": {"val_accept": [accept] * 15}}))
    return directory


def prompt_file(tmp_path, count: int):
    """A JSONL file of `count` short prompts for the tiny target."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"w{5 + i} w6"}) + "\n" for i in range(count)))
    return prompts


@pytest.fixture
def priced_steps(monkeypatch):
    """Decode steps priced by a fixed model (plain 1 ms, 0.1 ms more per drafted token or tree node)
    instead of timed: a tiny model's steps are mostly per-op overhead, under which no block size pays."""

    def step_costs(target, drafter, rows, context, slots, candidates, reps=7, tree_budgets=(), sampling=None):
        return {
            "plain_s": 1e-3,
            "chain_s": {b: 1e-3 + 1e-4 * b for b in candidates},
            "tree_s": {n: 1e-3 + 1e-4 * n for n in tree_budgets},
        }

    monkeypatch.setattr(cost_curve, "step_costs", step_costs)


def test_bench_auto_chooses_again_after_the_first_prompts(tmp_path, tiny, priced_steps):
    """A drafter whose TRAINING.json promises every draft accepted, but untrained: auto speculates on the
    first four prompts, sees what they accepted and decodes the rest plainly; the output stays lossless."""
    target, drafter = tiny
    directory, prompts = drafter_claiming(tmp_path, drafter, 1.0), prompt_file(tmp_path, 6)
    report = tmp_path / "bench.json"
    args = ["bench", "--target", target.name, "--prompts", str(prompts), "--method", "ar,dflash"]
    args += ["--drafter", str(directory), "--max-new-tokens", "8", "--json", str(report)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    auto = {r["method"]: r for r in json.loads(report.read_text())["results"]}["dflash-auto"]
    probe = auto["auto_probe"]
    assert probe["prompts"] == 4 and probe["block_size"] is not None and probe["acceptance_scale"] < 0.5
    assert auto["block_size"] is None and auto["lossless_match"] == 1.0


def test_generate_auto_chooses_again_after_the_first_prompts(tmp_path, tiny, priced_steps):
    """`dflax generate` does as bench: four prompts with the promised acceptance's choice, then the rest
    with the acceptance they showed; every prompt's output lands once, equal to plain decoding's."""
    target, drafter = tiny
    directory, prompts = drafter_claiming(tmp_path, drafter, 1.0), prompt_file(tmp_path, 6)
    args = ["generate", "--target", target.name, "--prompts", str(prompts), "--max-new-tokens", "8"]
    args += ["--batch-size", "1"]
    spec, plain = tmp_path / "spec.jsonl", tmp_path / "plain.jsonl"
    result = CliRunner().invoke(
        app, [*args, "--method", "dflash", "--drafter", str(directory), "--out", str(spec)]
    )
    assert result.exit_code == 0, result.output
    choices = [line for line in result.output.splitlines() if line.startswith("block size auto:")]
    assert len(choices) == 2 and choices[0].startswith("block size auto: B=")
    assert choices[1].startswith("block size auto: plain decoding")
    assert CliRunner().invoke(app, [*args, "--method", "ar", "--out", str(plain)]).exit_code == 0
    read = lambda path: {r["id"]: r["tokens"] for r in map(json.loads, path.read_text().splitlines())}  # noqa: E731
    assert read(spec) == read(plain) and sorted(read(spec)) == list(range(6))


def test_the_api_chooses_as_the_cli_does(tmp_path, tiny, priced_steps):
    """`dflax.generate(target, prompts, drafter=d)` runs auto by default for a drafter that recorded its
    acceptance, and makes the CLI's choices (the same lines, in the same order) with the same outputs;
    block_size=B keeps B."""
    target, drafter = tiny
    directory, prompts = drafter_claiming(tmp_path, drafter, 1.0), prompt_file(tmp_path, 6)
    args = ["generate", "--target", target.name, "--prompts", str(prompts), "--max-new-tokens", "8"]
    args += ["--batch-size", "1", "--method", "dflash", "--drafter", str(directory)]
    out = tmp_path / "cli.jsonl"
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    cli_choices = [line for line in result.output.splitlines() if line.startswith("block size auto:")]
    api_choices, events = [], []

    def on_plan(event, choice):
        events.append(event)
        if choice is not None:
            api_choices.append(choice.describe())

    claimed = load_drafter(directory, target)
    texts = [f"w{5 + i} w6" for i in range(6)]
    results = dflax.generate(target, texts, drafter=claimed, max_new_tokens=8, batch_size=1, on_plan=on_plan)
    assert api_choices == cli_choices and len(api_choices) == 2
    assert events == ["timing", "chosen", "timing", "chosen"]
    cli_tokens = {r["id"]: r["tokens"] for r in map(json.loads, out.read_text().splitlines())}
    assert [r.tokens for r in results] == [cli_tokens[i] for i in range(6)]
    events.clear()
    fixed = dflax.generate(
        target, texts, drafter=claimed, max_new_tokens=8, batch_size=1, block_size=4, on_plan=on_plan
    )
    assert events == [] and all(len(r.stats["accept_hist"]) == 4 + 1 for r in fixed)  # B + 1 counts
    with pytest.raises(ValueError, match="chooses a DFlash or DART chain"):
        dflax.generate(target, texts, drafter=dflax.prompt_lookup(4), block_size="auto")
    with pytest.raises(ValueError, match="need a drafter"):
        dflax.generate(target, texts, block_size=4)
    with pytest.raises(ValueError, match="give 'auto' or an integer"):
        dflax.generate(target, texts, drafter=claimed, block_size="8")


def test_a_short_run_is_not_timed(tiny, monkeypatch):
    """Under AUTO_MIN_STEPS plain steps a run reads cached timings, or else takes the CPU prior: a chain
    at one row, plain decoding at more; it never times a step."""
    target, drafter = tiny
    good = dataclasses.replace(drafter, accept=(0.9,) * 15)
    monkeypatch.setattr(cost_curve, "AUTO_MIN_STEPS", 1024)
    settings = AutoSettings.for_run([3] * 4, 1, 16, trees=True, static=True, sampling=SamplingParams.make())
    assert settings.plain_steps == 64
    measured = cost_curve.auto_block_size(target, good, rows=1, context=20, slots=settings.slots)[1]

    def must_not_measure(*args, **kwargs):
        raise AssertionError("a short run timed its steps")

    monkeypatch.setattr(cost_curve, "step_times", must_not_measure)
    cached = cost_curve.auto_block_size(target, good, rows=1, context=20, slots=settings.slots, measure=False)
    assert cached[1] == measured and not cached[1].untimed  # read from the cache
    chosen, prior = cost_curve.auto_block_size(target, good, rows=1, context=40, measure=False)
    assert prior.untimed and prior.block_size == max(prior.predicted, key=lambda b: prior.predicted[b][1])
    assert chosen.proposer.block_size == prior.block_size and "a CPU prior" in prior.describe()
    chosen, prior = cost_curve.auto_block_size(target, good, rows=8, context=40, measure=False)
    assert chosen is None and prior.untimed and prior.describe().startswith("block size auto: plain")


def test_acceptance_is_read_from_training_json(tmp_path):
    assert measured_acceptance(tmp_path) is None
    (tmp_path / "TRAINING.json").write_text(json.dumps({"final_validation": {"val_accept": [0.5, 0.25]}}))
    assert measured_acceptance(tmp_path) == (0.5, 0.25) and measured_rank_acceptance(tmp_path) is None
    ranks = [[0.5, 0.1], [0.25, 0.2]]
    (tmp_path / "TRAINING.json").write_text(json.dumps({"final_validation": {"val_rank_accept": ranks}}))
    assert measured_rank_acceptance(tmp_path) == ((0.5, 0.1), (0.25, 0.2))
    shipped = measured_acceptance(dflax.drafters.shipped_drafter_path("smollm2-135m"))
    assert shipped is not None and len(shipped) == 7 and np.all(np.asarray(shipped) <= 1)


@pytest.mark.parametrize("value", ["1", "x", "4,auto,0"])
def test_cli_rejects_bad_block_sizes(value, tiny_checkpoint):
    args = ["bench", "--target", str(tiny_checkpoint("llama")[0]), "--method", "dflash"]
    result = CliRunner().invoke(app, [*args, "--block-size", value])
    assert result.exit_code == 2
    assert "give auto or an integer >= 2" in " ".join(result.output.split())


def test_cli_auto_with_a_drafter_without_measured_acceptance(tiny_checkpoint):
    args = ["generate", "--target", str(tiny_checkpoint("llama")[0]), "--method", "dflash"]
    result = CliRunner().invoke(app, [*args, "--drafter", "untrained", "--block-size", "auto", "w5"])
    assert result.exit_code == 2
    output = " ".join(result.output.split())
    assert "--block-size auto cannot predict its speed; give --block-size B" in output


def test_projection_is_the_roofline_formula():
    chip = projection.Accelerator("toy", memory_bytes_per_s=1e9, bf16_flop_per_s=1e12)
    assert projection.forward_s(chip, 1000, 1) == 2000 / 1e9  # memory bound: 2 bytes per weight
    assert projection.forward_s(chip, 1000, 10_000) == 2 * 1000 * 10_000 / 1e12  # compute bound
    # Memory bound everywhere: tau 3 at B=4 with a drafter a tenth of the target -> 3 / 1.1.
    assert projection.projected_speedup(chip, 10_000, 1_000, 3.0, 4, 1) == pytest.approx(3 / 1.1)


def test_bench_auto_block_size_and_projection(tmp_path, tiny):
    target, drafter = tiny
    directory, prompts = drafter_claiming(tmp_path, drafter, 0.0), prompt_file(tmp_path, 2)
    report = tmp_path / "bench.json"
    args = ["bench", "--target", target.name, "--prompts", str(prompts), "--method", "ar,dflash"]
    args += ["--drafter", str(directory), "--block-size", "auto,4", "--max-new-tokens", "5"]
    result = CliRunner().invoke(app, [*args, "--json", str(report)])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    by_method = {r["method"]: r for r in data["results"]}
    assert set(by_method) == {"ar", "dflash-auto", "dflash-b4"}
    auto = by_method["dflash-auto"]
    assert auto["block_size"] is None and auto["lossless_match"] == 1.0  # nothing pays: plain decoding
    assert set(auto["auto_predicted"]) == {"2", "3", "4", "6", "8", "12", "16"}
    assert "projection" in data["projection"] and "projected_speedup" not in by_method["ar"]
    assert set(by_method["dflash-b4"]["projected_speedup"]) == set(projection.ACCELERATORS)


def test_bench_chooses_a_dart_drafters_chain_or_tree_by_default(tmp_path, tiny):
    target, _ = tiny
    directory = tmp_path / "dart"
    load_dart("untrained", target).save(directory)
    depths = DartConfig.for_target(target.config).num_draft
    useless = {"val_accept": [0.0] * depths, "val_rank_accept": [[0.0] * 8] * depths}
    (directory / "TRAINING.json").write_text(json.dumps({"final_validation": useless}))
    prompts, report = prompt_file(tmp_path, 1), tmp_path / "bench.json"
    args = ["bench", "--target", target.name, "--prompts", str(prompts), "--method", "ar,dart"]
    args += ["--drafter", str(directory), "--max-new-tokens", "5", "--json", str(report)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    by_method = {r["method"]: r for r in json.loads(report.read_text())["results"]}
    assert set(by_method) == {"ar", "dart-auto"}
    auto = by_method["dart-auto"]
    assert auto["block_size"] is None and auto["lossless_match"] == 1.0  # nothing pays: plain decoding
    assert set(auto["auto_predicted"]) == {str(b) for b in cost_curve.AUTO_BLOCK_SIZES if b <= depths + 1}
    assert set(auto["auto_predicted_trees"]) == {str(n) for n in cost_curve.AUTO_TREE_BUDGETS}


def test_a_noisy_plain_timing_cannot_make_a_useless_drafter_pay():
    noisy = 3.0  # the plain step timed during a load spike: no speculative step counts as cheaper
    choice = choose_block_size([0.0] * 15, noisy, CHAIN_S)
    assert choice.block_size is None and all(x <= 1.0 for _, x in choice.predicted.values())
