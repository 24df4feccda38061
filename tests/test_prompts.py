"""The project's prompt sets: held-out prompts stay out of training, rounds do not repeat."""
from engine.datasets import prompts as P


def test_training_rounds_are_disjoint_from_each_other_and_the_heldout_set():
    held = {p for _, p in P.heldout()}
    r0 = P.training_prompts(60, seed=0)
    assert r0 == P.training_prompts(60, seed=0)  # deterministic
    texts = ["Rivers carry water from the hills to the sea. " * 6, "Markets are places where people trade. " * 6]
    r1 = P.training_prompts(60, 0, 1, texts, frozenset(p for _, p in r0))
    assert not {p for _, p in r1} & ({p for _, p in r0} | held)
    assert [sum(t == task for t, _ in r1) for task in P.TASKS] == [60, 60, 60, 2 * 9]  # 2 texts × 9 forms
    summaries = [p for t, p in r1 if t == "summarization"]
    assert summaries and all(any(x in p for x in texts) for p in summaries)  # round 1 summarizes the given texts
    wide = {f.split("{")[0] for forms, _ in P._CHAT_WIDE.values() for f in forms if not f.startswith("{")}
    assert any(p.startswith(tuple(wide)) for t, p in r1 if t == "chat")


def test_prose_paragraphs_keep_plain_prose_only():
    prose = "Owls hunt at night and can turn their heads a long way round to look for prey. " * 3
    answers = [f"{prose}\n\n```python\nprint(1)\n```", "# Heading\n\n" + "Use `x` here. " * 20,
               "Honeybees live in colonies with a queen and many workers that collect nectar. " * 3, "Too short."]
    assert P.prose_paragraphs(answers) == [" ".join(prose.split())]  # no code, markup or held-out subject


def test_heldout_grows_with_real_prompts_nothing_trains_on():
    """Past the file's 10 a task, held-out prompts are real: HumanEval's problems and ShareGPT
    turns from past the EAGLE head's sample, never a training prompt, the file's own first."""
    from engine.datasets.sharegpt import conversations

    small, big = P.heldout(), P.heldout(14)
    assert len(small) == 40 and big[: 4 * 10] != [] and len(big) == 56
    assert {t for t, _ in big} == set(P.TASKS) and all(sum(t == task for t, _ in big) == 14 for task in P.TASKS)
    file_ = {p for _, p in small}
    extra = [(t, p) for t, p in big if p not in file_]
    assert len(extra) == 16 and len({p for _, p in extra}) == 16
    trained = {p for _, p in P.training_prompts(50)}
    assert not trained & {p for _, p in extra}
    eagle_sample = {m[0]["content"].strip() for m, _ in zip(conversations(min_turns=2), range(P.SHAREGPT_TRAINED))}
    assert not eagle_sample & {p for t, p in extra if t != "code"}
    assert all(p.startswith("Complete this Python function.") for t, p in extra if t == "code")
