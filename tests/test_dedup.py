"""Deduplication and decontamination (data/dedup.py, data/decontaminate.py): a planted pool with exact counts
and indices, template siblings kept apart by their references and by the instance check, short arithmetic
prompts, the earliest-kept rule, 13-gram decontamination with its short-text rule, determinism and invariants."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rlvr.data.decontaminate import ContaminationHit, Decontaminator
from rlvr.data.dedup import (
    Duplicate,
    NearDuplicateConfig,
    band_count,
    find_duplicates,
    jaccard,
    normalise_text,
    word_shingles,
)

# Ten templates with distinct wording; each is filled five times (name, a, b all change) -> 50 base problems.
TEMPLATES = [
    (
        "{name} runs a small bakery on the corner of the market square and sells {a} loaves of bread every "
        "morning before the stalls open. In the afternoon {name} bakes another {b} loaves for the neighbours "
        "who come by after work. How many loaves are sold in one day?",
        lambda a, b: a + b,
    ),
    (
        "A farmer called {name} plants {a} neat rows of tomatoes in the spring, and after the seedlings are "
        "thinned every row holds exactly {b} healthy plants. A few plants are given to friends later in the "
        "summer, but how many plants were growing right after the thinning?",
        lambda a, b: a * b,
    ),
    (
        "During a school trip {a} students travel to the science museum by bus, and each bus can carry at most "
        "{b} students when every seat is taken. The teachers want to book as few buses as possible. What is the "
        "smallest number of buses {name} has to order for the whole group?",
        lambda a, b: -(-a // b),
    ),
    (
        "{name} is saving pocket money for a new bicycle that costs {a} dollars in the shop near the station. "
        "Every week {name} puts exactly {b} dollars into a glass jar on the kitchen shelf. After how many whole "
        "weeks will there be enough money in the jar to buy the bicycle?",
        lambda a, b: -(-a // b),
    ),
    (
        "A rectangular garden behind the house of {name} is {a} metres long and {b} metres wide, and a low "
        "wooden fence is going to be built along all four of its sides. How many metres of fencing are needed "
        "to enclose the whole garden exactly once?",
        lambda a, b: 2 * (a + b),
    ),
    (
        "The library in the home town of {name} received {a} boxes of donated novels last winter, and the "
        "volunteers counted {b} books in every single box before placing them on the shelves. How many donated "
        "novels did the volunteers count in total across all of the boxes?",
        lambda a, b: a * b,
    ),
    (
        "A train leaves the central station at noon and travels at a steady speed of {a} kilometres per hour "
        "across the plains toward the coast. {name} stays on board for {b} hours without any stops along the "
        "way. How far in kilometres does the train carry {name} in that time?",
        lambda a, b: a * b,
    ),
    (
        "At the harvest festival {name} fills wicker baskets with apples from the orchard, putting {b} apples "
        "into each basket until none are left over. There were {a} apples picked from the trees that morning. "
        "How many baskets does {name} fill by the end of the festival?",
        lambda a, b: a // b,
    ),
    (
        "A swimming pool holds {a} litres of water when it is completely full, and a pump removes {b} litres "
        "every minute while the caretaker {name} scrubs the tiles along the edge. How many minutes does the pump "
        "need to empty the full pool completely?",
        lambda a, b: a // b,
    ),
    (
        "{name} reads a fantasy novel with {a} pages during the summer holidays and manages to finish {b} pages "
        "on each rainy afternoon spent indoors. If every afternoon of the holiday is rainy, how many pages remain "
        "unread after the first week of seven afternoons?",
        lambda a, b: a - 7 * b,
    ),
]
NAMES = [
    "Amara", "Bruno", "Chiara", "Dmitri", "Elif", "Farid", "Greta", "Hiroshi", "Ines", "Jonas",
    "Kavya", "Luca", "Mei", "Nikolai", "Olga", "Pablo", "Quinn", "Rosa", "Sven", "Tariq",
    "Uma", "Viktor", "Wanda", "Xavier", "Yara", "Zoltan", "Anouk", "Bilal", "Celine", "Darius",
    "Esme", "Felix", "Gaia", "Hamid", "Ingrid", "Jasper", "Kenji", "Leila", "Matteo", "Nadia",
    "Oskar", "Priya", "Rafael", "Sofia", "Tomas", "Ulla", "Vera", "Wilhelm", "Ximena", "Yusuf",
]  # fmt: skip
# (a, b) for each template's five problems, chosen so that all 50 answers differ.
FILLS = [
    [(12, 5), (36, 9), (128, 16), (75, 4), (210, 14)],
    [(19, 6), (43, 10), (27, 12), (82, 5), (31, 3)],
    [(50, 11), (142, 18), (260, 40), (301, 25), (95, 9)],
    [(96, 7), (330, 16), (480, 25), (180, 10), (505, 20)],
    [(40, 25), (18, 12), (75, 33), (9, 6), (120, 88)],
    [(24, 35), (12, 48), (30, 15), (17, 20), (45, 22)],
    [(80, 3), (95, 4), (60, 7), (110, 2), (72, 5)],
    [(96, 8), (150, 6), (190, 10), (99, 11), (264, 12)],
    [(1200, 50), (3000, 60), (2800, 70), (4600, 100), (6300, 90)],
    [(400, 30), (350, 25), (512, 40), (275, 20), (610, 50)],
]


def base_fill(index: int) -> tuple[str, int, int]:
    """Name, a and b of base problem `index` (template index // 5)."""
    a, b = FILLS[index // 5][index % 5]
    return NAMES[index], a, b


def base_problems() -> tuple[list[str], list[str]]:
    prompts, refs = [], []
    for index in range(50):
        (template, answer), (name, a, b) = TEMPLATES[index // 5], base_fill(index)
        prompts.append(template.format(name=name, a=a, b=b))
        refs.append(str(answer(a, b)))
    return prompts, refs


def sibling(index: int) -> tuple[str, str]:
    """Base problem `index` with b one larger: same wording, one number and the answer changed."""
    (template, answer), (name, a, b) = TEMPLATES[index // 5], base_fill(index)
    return template.format(name=name, a=a, b=b + 1), str(answer(a, b + 1))


def fullwidth(text: str) -> str:
    return text.translate({ord(d): 0xFF10 + int(d) for d in "0123456789"})


def replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, (old, text)
    return text.replace(old, new)


def words(text: str) -> int:
    return len(text.split())


def one_word_changed(base: str) -> float:
    """Jaccard of a text and itself with one word changed: 3 of its len+2 padded trigrams differ."""
    n = words(base)
    return (n - 1) / (n + 5)


def planted_pool() -> tuple[list[str], list[str], list[Duplicate], list[Duplicate]]:
    """50 bases, then 7 exact copies, 5 near copies (same reference) and 3 siblings (other number and answer).

    Returns the pool, the duplicates expected with same_reference and the siblings' matches without it.
    """
    prompts, refs = base_problems()
    assert len(set(refs)) == 50  # every base has its own answer
    exact = {
        3: (prompts[3].upper(), refs[3]),
        8: ("  " + prompts[8].replace(" ", " \n\t ") + "\n", refs[8]),
        15: (prompts[15].replace("glass", "GLAß"), refs[15]),  # casefold: ß -> ss
        22: (fullwidth(prompts[22]), fullwidth(refs[22])),  # NFKC: fullwidth digits
        31: (prompts[31].replace(" ", "\u00a0"), " " + refs[31] + " "),  # no-break spaces
        40: (prompts[40] + "\r\n", refs[40]),
        47: (prompts[47].swapcase(), refs[47]),
    }
    near = {
        0: replace_once(prompts[0], "every morning", "each morning"),
        11: replace_once(prompts[11], "by bus", "by coach"),
        23: replace_once(prompts[23], "exactly once?", "exactly once."),  # punctuation only
        34: replace_once(prompts[34], "steady", "constant"),
        45: replace_once(prompts[45], "fantasy", "detective"),
    }
    siblings = [5, 18, 27]
    expected = [Duplicate(50 + k, base, 1.0, "exact") for k, base in enumerate(exact)]
    expected += [Duplicate(57 + k, base, one_word_changed(prompts[base]), "near") for k, base in enumerate(near)]
    merged = [Duplicate(62 + k, base, one_word_changed(prompts[base]), "near") for k, base in enumerate(siblings)]
    prompts += [p for p, _ in exact.values()] + list(near.values())
    refs += [r for _, r in exact.values()] + [refs[base] for base in near]
    for base in siblings:
        prompt, ref = sibling(base)
        assert ref != refs[base] and words(prompt) == words(prompts[base])
        prompts.append(prompt)
        refs.append(ref)
    return prompts, refs, expected, merged


def test_planted_pool_exact_and_near_counts_and_targets() -> None:
    prompts, refs, expected, _ = planted_pool()
    assert len(prompts) == 65
    found = find_duplicates(prompts, refs, NearDuplicateConfig())
    assert [d.kind for d in found].count("exact") == 7
    assert [d.kind for d in found].count("near") == 5
    assert found == expected  # the siblings (62-64) are kept: their answers differ


def test_without_same_reference_the_siblings_merge() -> None:
    prompts, refs, expected, merged = planted_pool()
    found = find_duplicates(prompts, refs, NearDuplicateConfig(same_reference=False))
    assert found == expected + merged


def test_near_detection_can_be_switched_off() -> None:
    prompts, refs, expected, _ = planted_pool()
    found = find_duplicates(prompts, refs, NearDuplicateConfig(enabled=False))
    assert found == [d for d in expected if d.kind == "exact"]


# A generator template: long fixed wording around a two-word instance, answered True or False.
TWINS = (
    "Two words count as twins when each letter in the first can be swapped for some letter of the second, always "
    "using one fixed swap per letter, and no two different letters from word one ever turn into a single letter in "
    "word two. Keep the order of all letters unchanged. Look at the pair written below and answer True when they are "
    "twins under this rule, or False if they are not:"
)


def twins_pool(size: int) -> tuple[list[str], list[str]]:
    return [f"{TWINS} x{k}a y{k}b" for k in range(size)], ["True" if k % 2 == 0 else "False" for k in range(size)]


def test_template_siblings_with_short_instances_are_not_merged() -> None:
    prompts, refs = twins_pool(60)
    shingles = len(word_shingles(normalise_text(prompts[0]), 3))
    assert shingles == words(TWINS) + 4 == len(set(word_shingles(normalise_text(prompts[0]), 3)))
    # The template's shingles are seen 60 times (>= 50): template wording. The instances share nothing.
    assert find_duplicates(prompts, refs, NearDuplicateConfig()) == []
    # On whole texts alone every sibling (4 of its shingles differ) repeats the first row with its answer.
    naive = [Duplicate(i, i % 2, (shingles - 4) / (shingles + 4), "near") for i in range(2, 60)]
    assert find_duplicates(prompts, refs, NearDuplicateConfig(common_shingle_count=None)) == naive


def test_the_instance_check_leaves_text_without_a_template_alone() -> None:
    prompts, refs = twins_pool(60)
    bases, answers = base_problems()
    prompts += [bases[0], replace_once(bases[0], "every morning", "each morning")]
    refs += [answers[0], answers[0]]
    assert find_duplicates(prompts, refs, NearDuplicateConfig()) == [
        Duplicate(61, 60, one_word_changed(bases[0]), "near")
    ]


def test_short_arithmetic_prompts_are_only_exact_duplicates() -> None:
    prompts = ["12+34=", "12+35=", "12 + 34 =", "12+34=", "34+12="]
    refs = ["46", "47", "46", "46", "46"]
    # Even at a low threshold and without the reference check, one-word prompts share no shingle.
    loose = NearDuplicateConfig(threshold=0.1, same_reference=False)
    # "12 + 34 =" is kept: normalisation collapses whitespace runs but does not remove spacing.
    assert find_duplicates(prompts, refs, loose) == [Duplicate(3, 0, 1.0, "exact")]
    assert jaccard(set(word_shingles("12+34=", 3)), set(word_shingles("12+35=", 3))) == 0.0
    assert word_shingles("12+34=", 3) == ["  12+34=", " 12+34= ", "12+34=  "]


def test_changing_the_last_number_is_not_a_near_duplicate() -> None:
    # Unpadded trigrams would score this pair 8/10 = 0.8 and merge two problems that share an answer.
    a = "Find the Least Common Multiple (LCM) of these numbers: 10, 38"
    b = "Find the Least Common Multiple (LCM) of these numbers: 10, 95"
    assert jaccard(set(word_shingles(normalise_text(a), 3)), set(word_shingles(normalise_text(b), 3))) == 10 / 16
    assert find_duplicates([a, b], ["190", "190"], NearDuplicateConfig()) == []


def test_a_near_duplicate_points_at_the_earliest_kept_match_not_the_most_similar() -> None:
    base = [f"word{k}" for k in range(80)]
    p = " ".join(base)
    q = " ".join(w if k not in (10, 30, 50, 70) else "other" + w for k, w in enumerate(base))
    r = " ".join(w if k not in (10, 30, 50) else "other" + w for k, w in enumerate(base))  # 1 change from q
    found = find_duplicates([p, q, r], ["x", "x", "x"], NearDuplicateConfig())
    # p-q: 70/94 < 0.8, both kept. r-q: 79/85, but p is the earlier kept row and r-p = 73/91 >= 0.8.
    assert found == [Duplicate(2, 0, 73 / 91, "near")]


def test_exact_copy_of_a_dropped_row_points_at_the_kept_row() -> None:
    prompts, refs = base_problems()
    near = replace_once(prompts[0], "every morning", "each morning")
    found = find_duplicates([prompts[0], near, near.upper()], [refs[0]] * 3, NearDuplicateConfig())
    similarity = one_word_changed(prompts[0])
    assert found == [Duplicate(1, 0, similarity, "near"), Duplicate(2, 0, similarity, "near")]


def test_same_prompt_other_reference() -> None:
    found = find_duplicates(["What is 2+2?", "what is  2+2?"], ["4", "5"], NearDuplicateConfig())
    assert found == []
    loose = find_duplicates(["What is 2+2?", "what is  2+2?"], ["4", "5"], NearDuplicateConfig(same_reference=False))
    assert loose == [Duplicate(1, 0, 1.0, "near")]


def test_deterministic() -> None:
    prompts, refs, _, _ = planted_pool()
    config = NearDuplicateConfig(same_reference=False, threshold=0.6)
    assert find_duplicates(prompts, refs, config) == find_duplicates(list(prompts), list(refs), config)


def test_same_duplicates_under_another_hash_seed() -> None:
    """Python's salted str hash names template shingles; the result must not depend on the salt."""
    script = (
        "from tests.test_dedup import planted_pool, twins_pool\n"
        "from rlvr.data.dedup import NearDuplicateConfig, find_duplicates\n"
        "p, r, _, _ = planted_pool(); q, s = twins_pool(60)\n"
        "print(find_duplicates(p + q, r + s, NearDuplicateConfig(same_reference=False)))\n"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed},
            cwd=Path(__file__).parent.parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    _, _, expected, merged = planted_pool()
    assert runs == {repr(expected + merged) + "\n"}  # the twins add nothing


def test_normalisation() -> None:
    assert normalise_text("  Straße\t\u00a0ＡＢＣ \n １２ ") == "strasse abc 12"
    assert normalise_text("12 +  34 =") == "12 + 34 ="


def test_banding_and_config_errors() -> None:
    assert band_count(128, 0.8) == 16  # 8 rows per band: candidate probability 0.947 at J = 0.8
    assert band_count(128, 1.0) == 1
    for bad in ({"threshold": 0.0}, {"threshold": 1.5}, {"ngram": 0}, {"thresold": 0.5}):
        with pytest.raises(ValidationError):
            NearDuplicateConfig(**bad)
    with pytest.raises(ValueError, match="2 prompts but 1 references"):
        find_duplicates(["a", "b"], ["1"], NearDuplicateConfig())


@settings(deadline=None, max_examples=60)
@given(
    st.lists(
        st.tuples(st.lists(st.sampled_from(["a", "b", "c", "A", "7"]), min_size=0, max_size=6), st.sampled_from("xy")),
        max_size=25,
    )
)
def test_every_duplicate_points_back_at_a_kept_row(rows: list[tuple[list[str], str]]) -> None:
    prompts = [" ".join(w) for w, _ in rows]
    refs = [r for _, r in rows]
    found = find_duplicates(prompts, refs, NearDuplicateConfig(threshold=0.5, same_reference=False))
    dropped = [d.index for d in found]
    assert dropped == sorted(set(dropped))
    for d in found:
        assert d.duplicate_of < d.index and d.duplicate_of not in dropped
        assert 0.5 <= d.similarity <= 1.0 and d.kind in ("exact", "near")
    keys = [(normalise_text(p), r) for p, r in zip(prompts, refs)]
    assert len(prompts) - len(found) <= len(set(keys))  # no exact copy survives


# --- decontamination -------------------------------------------------------------------------------------------

EVAL = [
    "A baker shares out trays of buns among the children of a village school every Friday before the bell rings.",
    "A ferry crosses the wide grey river every forty minutes, carrying cars, trucks and bicycles from the old harbour "
    "to the new town on the far bank. How many crossings does it make in a ten hour day?",
    "12+34=",
    "What is 7 times 8?",
]


def test_thirteen_gram_hit_names_the_eval_text_and_the_ngram() -> None:
    decon = Decontaminator(EVAL)
    text = "Quick question about boats: the wide, GREY river every forty minutes carrying cars trucks and bicycles from the old..."
    assert decon.match(text) == ContaminationHit(
        1, "the wide grey river every forty minutes carrying cars trucks and bicycles from"
    )


def test_a_twelve_gram_is_not_contamination() -> None:
    decon = Decontaminator(EVAL)
    text = "Quick question about boats: the wide, GREY river every forty minutes carrying cars trucks and bicycles; said nobody."
    assert decon.match(text) is None
    assert Decontaminator(EVAL, n=12).match(text) == ContaminationHit(
        1, "the wide grey river every forty minutes carrying cars trucks and bicycles"
    )


def test_short_texts_match_whole_token_sequences_only() -> None:
    decon = Decontaminator(EVAL)
    assert decon.match("12 + 34 =") == ContaminationHit(2, "12 + 34 =")
    assert decon.match(" what is 7 TIMES 8 ?") == ContaminationHit(3, "what is 7 times 8 ?")
    assert decon.match("12*34=") is None  # symbols are tokens: another operator is another problem
    assert decon.match("What is 7 times 8") is None  # whole sequence, so the missing "?" counts
    assert decon.match("forty minutes carrying cars") is None  # inside a long eval text: not flagged
    assert decon.match("") is None and decon.match("+ =") is None


def test_decontaminator_rejects_bad_n_and_is_deterministic() -> None:
    with pytest.raises(ValueError, match="n must be at least 1"):
        Decontaminator(EVAL, n=0)
    text = EVAL[1].upper() + " " + EVAL[0]
    assert (
        Decontaminator(EVAL).match(text)
        == Decontaminator(list(EVAL)).match(text)
        == ContaminationHit(1, "a ferry crosses the wide grey river every forty minutes carrying cars trucks")
    )
