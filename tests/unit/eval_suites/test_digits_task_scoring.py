"""The digits tasks' scoring (eval_suites/tasks/cmoe_digits/utils.py) honours their stop strings on the reply, so a
model that does not apply ``until`` (lmms-eval's ``openai`` model behind a server) is scored as the plugin is; and
``cmoe_digits_mc_gen`` scores a generated choice."""
from __future__ import annotations

import yaml

from eval_suites.common import TASKS_DIR

TASK_DIR = TASKS_DIR / "cmoe_digits"


def _utils():
    from eval_suites.tasks.cmoe_digits import utils

    return utils


class _TagLoader(yaml.SafeLoader):
    """Reads the task YAMLs as data: lmms-eval's ``!function`` tags become their text."""


_TagLoader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))


def _task(name: str) -> dict:
    return yaml.load((TASK_DIR / f"{name}.yaml").read_text(), Loader=_TagLoader)


def test_stop_strings_are_the_generation_tasks_until():
    utils = _utils()
    for name in ("cmoe_digits_vqa", "cmoe_digits_mc_gen"):
        task = _task(name)
        assert task["output_type"] == "generate_until"
        assert tuple(task["generation_kwargs"]["until"]) == utils.STOP_STRINGS, name


def test_a_reply_not_cut_at_until_scores_as_the_cut_one():
    utils = _utils()
    doc = {"answer": "7"}
    for reply in ("7", "7\nWhat digit", "7<|end|>8", " 7.\n\n"):
        assert utils.vqa_process_results(doc, [reply]) == {"exact_match": 1.0}, reply
    for reply in ("\n7", "17", "", "8\n7"):
        assert utils.vqa_process_results(doc, [reply]) == {"exact_match": 0.0}, reply


def test_mc_gen_scores_the_labelled_choice():
    utils = _utils()
    doc = {"choices": [str(d) for d in range(10)], "label": 4}
    task = _task("cmoe_digits_mc_gen")
    assert task["doc_to_target"].endswith("mc_gen_doc_to_target") and utils.mc_gen_doc_to_target(doc) == "4"
    assert task["metric_list"] == [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]
    assert task["dataset_kwargs"] == _task("cmoe_digits_mc")["dataset_kwargs"]  # the MC task's images and question
    assert utils.mc_gen_process_results(doc, ["4"]) == {"acc": 1.0}
    assert utils.mc_gen_process_results(doc, ["4\nfoo"]) == {"acc": 1.0}
    assert utils.mc_gen_process_results(doc, ["5"]) == {"acc": 0.0}
    assert utils.mc_gen_process_results(doc, ["four"]) == {"acc": 0.0}
