"""Preference losses (fsdp_recipes.methods.preference.objectives) against their formulas written out in plain Python on fixed
numbers: every DPO loss type of TRL's catalogue, SimPO and ORPO, weighted combinations, the values at the first step
(policy = reference), the figures logged, and the configuration checks. In-process, well under a second in all."""

from __future__ import annotations

import math

import pytest
import torch

from fsdp_recipes.methods.preference import objectives as pl

# Three pairs: summed completion log-probabilities of policy and reference, and each answer's completion tokens.
PC, PR = [-5.0, -3.0, -12.0], [-8.5, -2.0, -9.0]
RC, RR = [-6.0, -3.5, -11.0], [-8.0, -2.5, -10.0]
LC, LR = [4, 2, 6], [2, 3, 5]
BETA, EPS, TAU, GAMMA = 0.5, 0.1, 0.05, 0.5


def s(x):
    return 1 / (1 + math.exp(-x))


def ls(x):  # log sigmoid
    return -math.log1p(math.exp(-x))


def by_hand(name: str) -> list[float]:
    """The loss of each pair, from TRL 1.x's formulas (dpo_trainer.py, cpo_trainer.py, orpo_trainer.py)."""
    return [pair_by_hand(name, i) for i in range(len(PC))]


def pair_by_hand(name: str, i: int) -> float:
    pc, pr, rc, rr, lc, lr = PC[i], PR[i], RC[i], RR[i], LC[i], LR[i]
    c, r = pc - rc, pr - rr
    z = BETA * (c - r)
    # AOT pairs the i-th smallest margins of the batch
    aot = sorted(p - q for p, q in zip(PC, PR))[i] - sorted(p - q for p, q in zip(RC, RR))[i]
    aot_unpaired = sorted(p - q for p, q in zip(PC, RC))[i] - sorted(p - q for p, q in zip(PR, RR))[i]
    simpo = BETA * (pc / lc - pr / lr) - GAMMA
    log_odds = (pc / lc - pr / lr) - (math.log(1 - math.exp(pc / lc)) - math.log(1 - math.exp(pr / lr)))
    return {
        "sigmoid": lambda: -(1 - EPS) * ls(z) - EPS * ls(-z),
        "hinge": lambda: max(0.0, 1 - z),
        "ipo": lambda: (c / lc - r / lr - 1 / (2 * BETA)) ** 2,
        "exo_pair": lambda: s(z) * (ls(z) - math.log(1 - EPS)) + s(-z) * (ls(-z) - math.log(EPS)),
        "nca_pair": lambda: -ls(BETA * c) - 0.5 * ls(-BETA * c) - 0.5 * ls(-BETA * r),
        "robust": lambda: (-(1 - EPS) * ls(z) + EPS * ls(-z)) / (1 - 2 * EPS),
        "bco_pair": lambda: -ls(BETA * c) - ls(-BETA * r),
        "sppo_hard": lambda: (c - 1 / (2 * BETA)) ** 2 + (r + 1 / (2 * BETA)) ** 2,
        "aot": lambda: -(1 - EPS) * ls(BETA * aot) - EPS * ls(-BETA * aot),
        "aot_unpaired": lambda: -(1 - EPS) * ls(BETA * aot_unpaired) - EPS * ls(-BETA * aot_unpaired),
        "apo_zero": lambda: 1 - s(BETA * c) + s(BETA * r),
        "apo_down": lambda: s(BETA * c) + 1 - s(z),
        "discopop": lambda: (1 - s(z / TAU)) * -ls(z) + s(z / TAU) * math.exp(-z),
        "sigmoid_norm": lambda: -ls(BETA * (c / lc - r / lr)),
        "sft": lambda: -pc / lc,
        "simpo": lambda: -(1 - EPS) * ls(simpo) - EPS * ls(-simpo),
        "orpo": lambda: -pc / lc - BETA * ls(log_odds),
    }[name]()


def objective(names, weights=None, **options) -> pl.PreferenceLoss:
    options = {"label_smoothing": EPS, "discopop_tau": TAU, "simpo_gamma": GAMMA, **options}
    names = tuple(names)
    return pl.PreferenceLoss(names, tuple(weights or [1.0] * len(names)), BETA, **options)


def evaluate(loss: pl.PreferenceLoss, requires_grad: bool = False) -> tuple[pl.PairLosses, list[torch.Tensor]]:
    values = [
        torch.tensor(v, dtype=torch.float64, requires_grad=requires_grad and i < 2)
        for i, v in enumerate((PC, PR, RC, RR))
    ]
    return loss(*values, torch.tensor(LC), torch.tensor(LR)), values


def test_the_catalogue_is_trls_plus_simpo_and_orpo():
    assert set(pl.LOSS_TYPES) == {
        *("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot"),
        *("aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm", "simpo", "orpo"),
    }
    assert set(pl.LOSS_HELP) == set(pl.LOSS_TYPES)


@pytest.mark.parametrize("name", pl.LOSS_TYPES)
def test_each_loss_type_equals_its_formula_written_out(name):
    result, values = evaluate(objective([name]), requires_grad=True)
    assert result.loss.tolist() == pytest.approx(by_hand(name), rel=1e-9, abs=1e-12)
    assert set(result.components) == {name}
    result.loss.sum().backward()
    trained = sum(value.grad.abs().sum() for value in values[:2] if value.grad is not None)
    assert trained > 0  # the loss trains the policy
    assert not result.chosen_rewards.requires_grad and not result.rejected_rewards.requires_grad


def test_rewards_are_reference_ratios_or_averaged_log_probs_without_a_reference():
    with_reference, _ = evaluate(objective(["sigmoid", "simpo"]))
    assert with_reference.chosen_rewards.tolist() == pytest.approx([BETA * (p - r) for p, r in zip(PC, RC)])
    assert with_reference.rejected_rewards.tolist() == pytest.approx([BETA * (p - r) for p, r in zip(PR, RR)])
    free = objective(["orpo"])
    result = free(torch.tensor(PC), torch.tensor(PR), None, None, torch.tensor(LC), torch.tensor(LR))
    assert result.chosen_rewards.tolist() == pytest.approx([BETA * p / n for p, n in zip(PC, LC)])
    assert result.rejected_rewards.tolist() == pytest.approx([BETA * p / n for p, n in zip(PR, LR)])
    assert not free.needs_reference and objective(["simpo", "sft"]).needs_reference is False
    with pytest.raises(ValueError, match="needs the reference"):
        objective(["sigmoid"])(torch.tensor(PC), torch.tensor(PR), None, None, torch.tensor(LC), torch.tensor(LR))


def test_a_weighted_combination_is_the_weighted_sum_and_keeps_each_component():
    result, _ = evaluate(objective(["sigmoid", "sft", "hinge"], [1.0, 0.25, 2.0]))
    expected = [a + 0.25 * b + 2.0 * c for a, b, c in zip(by_hand("sigmoid"), by_hand("sft"), by_hand("hinge"))]
    assert result.loss.tolist() == pytest.approx(expected, rel=1e-9)
    assert result.components["sft"].tolist() == pytest.approx(by_hand("sft"))
    figures = pl.pair_figures(result, torch.tensor(PC), torch.tensor(PR))
    assert figures["loss/hinge"].tolist() == pytest.approx(by_hand("hinge"))  # unweighted
    single = pl.pair_figures(evaluate(objective(["sigmoid"]))[0], torch.tensor(PC), torch.tensor(PR))
    assert not [name for name in single if name.startswith("loss/")]  # one loss: no components logged


def test_simpo_adds_cpo_alpha_times_the_chosen_nll():
    plain, _ = evaluate(objective(["simpo"]))
    with_nll, _ = evaluate(objective(["simpo"], cpo_alpha=0.7))
    torch.testing.assert_close(with_nll.loss, plain.loss + 0.7 * torch.tensor(by_hand("sft"), dtype=torch.float64))


def test_at_the_first_step_reference_losses_take_their_known_values():
    """Policy = reference: every log-ratio is 0."""
    pc, pr, lc, lr = torch.tensor(PC), torch.tensor(PR), torch.tensor(LC), torch.tensor(LR)

    def first_step(name, **options):
        return objective([name], **{"label_smoothing": 0.0, **options})(pc, pr, pc, pr, lc, lr).loss

    known = {
        "sigmoid": math.log(2),
        "hinge": 1.0,
        "ipo": (1 / (2 * BETA)) ** 2,
        "nca_pair": 2 * math.log(2),
        "robust": math.log(2),
        "bco_pair": 2 * math.log(2),
        "sppo_hard": 2 * (1 / (2 * BETA)) ** 2,
        "aot": math.log(2),
        "aot_unpaired": math.log(2),
        "apo_zero": 1.0,
        "apo_down": 1.0,
        "discopop": 0.5 * math.log(2) + 0.5,
        "sigmoid_norm": math.log(2),
    }
    for name, value in known.items():
        torch.testing.assert_close(first_step(name), torch.full((3,), value), msg=name)
    # exo_pair: KL((1/2, 1/2) || (1 - e, e))
    e = 0.01
    torch.testing.assert_close(
        first_step("exo_pair", label_smoothing=e), torch.full((3,), math.log(0.5) - 0.5 * math.log((1 - e) * e))
    )
    assert set(known) | {"exo_pair"} == set(pl.NEEDS_REFERENCE)


def test_aot_sorts_within_the_micro_batch():
    """AOT compares the batch's sorted margins: the value of a pair depends on the others in its micro-batch."""
    whole, _ = evaluate(objective(["aot"]))
    alone = objective(["aot"])(
        *(torch.tensor(v[:1]) for v in (PC, PR, RC, RR)), torch.tensor(LC[:1]), torch.tensor(LR[:1])
    )
    assert alone.loss.item() != pytest.approx(whole.loss[0].item())


def test_figures_are_per_pair_and_sum_across_shards():
    result, _ = evaluate(objective(["sigmoid"]))
    figures = pl.pair_figures(result, torch.tensor(PC), torch.tensor(PR))
    chosen = [BETA * (p - r) for p, r in zip(PC, RC)]
    rejected = [BETA * (p - r) for p, r in zip(PR, RR)]
    assert figures["rewards/accuracies"].tolist() == [float(c > r) for c, r in zip(chosen, rejected)]
    assert figures["rewards/margins"].tolist() == pytest.approx([c - r for c, r in zip(chosen, rejected)])
    assert figures["logps/chosen"].tolist() == PC and figures["logps/rejected"].tolist() == PR


def problems(loss_type, loss_weights=None, **options):
    values = dict(beta=0.1, label_smoothing=0.0, discopop_tau=0.05, simpo_gamma=0.5, cpo_alpha=0.0)
    values.update(options)
    return pl.configuration_problems(loss_type, loss_weights, **values)


def test_configuration_problems_name_the_fix():
    assert problems("sigmoid") == [] and problems(["sigmoid", "sft"], [1.0, 0.5]) == []
    assert problems(["simpo", "sigmoid"]) == []  # mixed: allowed, the reference is loaded for sigmoid
    assert "loss_weights has 1 weights for the 2 losses" in problems(["sigmoid", "sft"], [1.0])[0]
    assert "loss_weights must be numbers >= 0" in problems(["sigmoid", "sft"], [1.0, -0.5])[0]
    assert "all 0" in problems(["sigmoid"], [0.0])[0]
    unknown = problems(["sigmoid", "kto"])[0]
    assert "'kto' is not one of" in unknown and "sigmoid_norm" in unknown and "orpo" in unknown
    assert "names a loss twice" in problems(["sft", "sft"])[0]
    assert "exo_pair needs label_smoothing > 0" in problems("exo_pair")[0]
    assert "applies to loss_type" in problems("hinge", label_smoothing=0.1)[0]
    assert "discopop_tau must be" in problems("discopop", discopop_tau=0.0)[0]
    assert "cpo_alpha weighs the NLL term of loss_type simpo only" in problems("orpo", cpo_alpha=1.0)[0]
    assert "beta must be a number > 0" in problems("sigmoid", beta=0.0)[0]


def test_which_losses_need_a_reference():
    assert pl.needs_reference(["simpo", "sigmoid", "sft", "ipo"]) == ["sigmoid", "ipo"]
    assert pl.needs_reference("orpo") == [] and pl.needs_reference(["simpo", "sft"]) == []
    assert objective(["sigmoid", "sft"], [1.0, 0.5]).description == "sigmoid + 0.5 x sft, beta 0.5"
    assert objective(["orpo"]).description == "orpo, beta 0.5 (no reference model)"
