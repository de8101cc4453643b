import pytest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_a_loop_is_stopped_at_the_fourth_identical_call(agent):
    run = agent.start()
    answers = [agent.check(run["run_id"], args={"query": "refund policy"}) for _ in range(4)]
    assert [a["decision"] for a in answers] == ["allow", "allow", "allow", "stop"]
    assert answers[-1]["reason"] == "loop_detected"
