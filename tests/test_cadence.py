"""One cadence for logging, evaluation and checkpoints (fsdp_recipes.train.cadence), and the evaluator protocol the
run attaches to its log (fsdp_recipes.train.evaluation.Evaluation)."""

from fsdp_recipes.distributed.parallel_dims import ParallelDims
from fsdp_recipes.train.cadence import Cadence
from fsdp_recipes.train.evaluation import Evaluation
from fsdp_recipes.train.metrics import MetricsLog


def due_steps(cadence: Cadence) -> list[int]:
    return [step for step in range(1, cadence.total_steps + 1) if cadence.due(step)]


def test_every_n_steps_and_the_last():
    assert due_steps(Cadence(3, 10)) == [3, 6, 9, 10]
    assert due_steps(Cadence(5, 10)) == [5, 10]
    assert due_steps(Cadence(None, 4)) == [4]
    assert due_steps(Cadence(None, 4, at_last_step=False)) == []
    assert due_steps(Cadence(3, 10, at_last_step=False)) == [3, 6, 9]


class Counting(Evaluation):
    def __init__(self, every):
        super().__init__(every=every)
        self.measured_at: list[int] = []
        self.step = 0

    def measure(self):
        self.measured_at.append(self.step)
        return {"eval_score": float(self.step)}


def test_an_evaluator_measures_when_due_once_per_step_and_logs_there(tmp_path):
    log = MetricsLog(tmp_path, enabled=True, printer=lambda _: None)
    log.start(resumed_step=None)
    evaluator = Counting(every=2)
    evaluator.attach(log=log, total_steps=5, parallel=ParallelDims())
    for step in range(1, 6):
        evaluator.step = step
        evaluator.maybe_evaluate(step)
    evaluator.step = 5
    assert evaluator.final_results() == {"eval_score": 5.0}  # the last step was measured already: not again
    assert evaluator.measured_at == [2, 4, 5]
    assert [(r["step"], r["eval_score"]) for r in log.records if "eval_score" in r] == [(2, 2.0), (4, 4.0), (5, 5.0)]


def test_final_results_measure_the_last_step_when_the_loop_did_not(tmp_path):
    log = MetricsLog(tmp_path, enabled=True, printer=lambda _: None)
    log.start(resumed_step=None)
    evaluator = Counting(every=None)
    evaluator.attach(log=log, total_steps=3, parallel=ParallelDims())
    evaluator.step = 3
    assert evaluator.final_results() == {"eval_score": 3.0}
    assert evaluator.measured_at == [3]


def test_the_base_evaluator_measures_nothing(tmp_path):
    evaluator = Evaluation(every=1)
    evaluator.attach(
        log=MetricsLog(tmp_path, enabled=False, printer=lambda _: None), total_steps=2, parallel=ParallelDims()
    )
    assert evaluator.maybe_evaluate(1) is None and evaluator.final_results() == {}
