"""LocalAgreement-2: examples and the invariants (stable only grows, never retracted)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from captiond.lang.text import join_units
from captiond.streaming.stabilize import LocalAgreement, Split, keep_stable


def test_first_hypothesis_is_all_unstable() -> None:
    la = LocalAgreement()
    assert la.update("the cat sat") == Split(stable=(), unstable=("the", "cat", "sat"))
    assert la.committed == ()


def test_two_agreeing_hypotheses_commit_all_but_the_held_back_word() -> None:
    la = LocalAgreement()
    la.update("the cat sat")
    split = la.update("the cat sat on")
    # "sat" was the last word of the older hypothesis: held back although both agree on it.
    assert split == Split(stable=("the", "cat"), unstable=("sat", "on"))
    assert la.committed == ("the", "cat")
    split = la.update("the cat sat on the mat")
    assert split == Split(stable=("the", "cat", "sat"), unstable=("on", "the", "mat"))


def test_identical_hypotheses_still_hold_back_the_last_word() -> None:
    la = LocalAgreement()
    la.update("one two three")
    assert la.update("one two three") == Split(stable=("one", "two"), unstable=("three",))


def test_hold_back_keeps_the_edge_guess_unstable() -> None:
    # Two partials that make the same guess at the cut-off edge ("a little bit") commit it with
    # one word held back; with three held back the guess stays revisable.
    one, three = LocalAgreement(), LocalAgreement(hold_back=3)
    for la in (one, three):
        la.update("to look at a little bit")
        la.update("to look at a little bit which")
    assert one.committed == ("to", "look", "at", "a", "little")
    assert three.committed == ("to", "look", "at")


def test_unsure_words_never_become_stable() -> None:
    # Both partials agree on "my fellow", but the newest was sure of its first two words only:
    # the final, with more audio and a beam, may still hear "am I fellow".
    la = LocalAgreement()
    la.update("and so my fellow Americans")
    assert la.update("and so my fellow Americans ask", sure=2).stable == ("and", "so")
    # Sure of all of them: agreement alone decides (the edge word still held back).
    assert la.update("and so my fellow Americans ask not", sure=7).stable == (
        "and",
        "so",
        "my",
        "fellow",
        "Americans",
    )


def test_disagreement_commits_nothing() -> None:
    la = LocalAgreement()
    la.update("the cat sat")
    assert la.update("a dog ran off") == Split(stable=(), unstable=("a", "dog", "ran", "off"))
    assert la.committed == ()


def test_agreement_stops_at_the_first_difference() -> None:
    la = LocalAgreement()
    la.update("we will go home now")
    split = la.update("we will stay home now please")
    assert split.stable == ("we", "will")
    assert split.unstable == ("stay", "home", "now", "please")


def test_agreement_ignores_case_and_punctuation() -> None:
    la = LocalAgreement()
    la.update("Hello, world. How are")
    split = la.update("hello World how are you")
    assert [w.lower().strip(",.") for w in split.stable] == ["hello", "world", "how"]
    assert len(split.stable) + len(split.unstable) == 5


@pytest.mark.parametrize(
    ("older", "newer", "stable"),
    [
        # Chinese and Japanese units carry full-width punctuation (text.units).
        (
            "我们今天\uff0c去公园玩",  # a full-width comma
            "我们今天。去公园玩吧",
            ("我", "们", "今", "天。", "去", "公", "园"),
        ),
        ("¿Qué hora es? Son", "qué hora es son las", ("qué", "hora", "es")),
        ("il a dit «bonjour» à", "il a dit bonjour à tous", ("il", "a", "dit", "bonjour")),
    ],
)
def test_agreement_ignores_the_punctuation_of_every_script(
    older: str, newer: str, stable: tuple[str, ...]
) -> None:
    la = LocalAgreement()
    la.update(older)
    assert la.update(newer).stable == stable


def test_committed_words_are_never_retracted() -> None:
    la = LocalAgreement()
    la.update("one two three")
    la.update("one two three four")
    assert la.committed == ("one", "two")
    # A later hypothesis that revises committed words does not take them back ...
    split = la.update("won too three four five")
    assert split.stable == ("one", "two")
    assert la.committed == ("one", "two")
    # ... and does not commit beyond them while it disagrees with them.
    split = la.update("won too three four five six")
    assert la.committed == ("one", "two")
    assert split.stable == ("one", "two")


def test_empty_hypotheses() -> None:
    la = LocalAgreement()
    assert la.update("") == Split(stable=(), unstable=())
    assert la.update("") == Split(stable=(), unstable=())
    la.update("a b c")
    la.update("a b c d")
    assert la.update("").stable == ("a", "b")


# -- property ---------------------------------------------------------------------------------

_word = st.sampled_from(["a", "b", "c", "A", "b.", "c,", "d"])


@st.composite
def _hypotheses(draw: st.DrawFn) -> list[list[str]]:
    """Hypotheses of one utterance: sometimes extending, sometimes revising the previous one."""
    out: list[list[str]] = []
    previous: list[str] = []
    for _ in range(draw(st.integers(min_value=0, max_value=12))):
        how = draw(st.sampled_from(["extend", "revise", "same", "fresh"]))
        if how == "extend":
            words = previous + draw(st.lists(_word, min_size=1, max_size=3))
        elif how == "revise":
            keep = draw(st.integers(min_value=0, max_value=len(previous)))
            words = previous[:keep] + draw(st.lists(_word, max_size=4))
        elif how == "same":
            words = list(previous)
        else:
            words = draw(st.lists(_word, max_size=8))
        out.append(words)
        previous = words
    return out


def _norm(word: str) -> str:
    return word.strip(".,").lower()


@settings(max_examples=400, deadline=None)
@given(hypotheses=_hypotheses())
def test_committed_only_grows_and_stable_is_committed(hypotheses: list[list[str]]) -> None:
    la = LocalAgreement()
    committed: tuple[str, ...] = ()
    previous: list[str] = []
    for words in hypotheses:
        split = la.update(" ".join(words))
        now = la.committed
        # Only grows: the earlier commitment is a prefix of the new one, but for punctuation
        # its last word may gain ("so" + ",", decoded with words after it).
        if committed:
            assert now[: len(committed) - 1] == committed[:-1]
            grown = now[len(committed) - 1]
            assert grown.startswith(committed[-1]) and not grown[len(committed[-1]) :].strip(",.")
        assert " ".join(now).startswith(" ".join(committed))
        # Stable is exactly what is committed so far.
        assert split.stable == now
        # Newly committed words agree with both of the two newest hypotheses, and the older
        # one's last word is held back.
        for i in range(len(committed), len(now)):
            assert i < len(previous) - 1
            assert _norm(now[i]) == _norm(previous[i]) == _norm(words[i])
        # The unstable part is the rest of the newest hypothesis, when it keeps the commitment.
        if [_norm(w) for w in words[: len(now)]] == [_norm(w) for w in now]:
            assert split.unstable == tuple(words[len(now) :])
        committed = now
        previous = words


def test_the_last_stable_word_takes_the_punctuation_decoded_after_it() -> None:
    """A comma the decoder wrote after the last stable word, with words after it, joins it
    (stable text grows by it); one at the edge of the audio, a guess, does not."""
    la = LocalAgreement()
    la.update("And so my")
    la.update("And so my fellow")
    assert la.committed == ("And", "so")
    la.update("And so.")  # the audio's edge: the stop may be a guess
    assert la.committed == ("And", "so")
    split = la.update("And so, my fellow Americans")
    assert split.stable == ("And", "so,")
    assert join_units(split.stable).startswith("And so")


def test_the_last_stable_word_takes_the_rest_of_a_word_joined_to_it_by_a_hyphen() -> None:
    """A partial that continues the last stable word with a hyphen ("time" + "-wise,"), with
    words after it, grows it: the partial shows the whole word, and later words can agree."""
    la = LocalAgreement()
    la.update("Yes, time is")
    la.update("Yes, time is up")
    assert la.committed == ("Yes,", "time")
    la.update("Yes, time-wise")  # the audio's edge: the rest of the word may be a guess
    assert la.committed == ("Yes,", "time")
    split = la.update("Yes, time-wise, it should")
    assert split == Split(stable=("Yes,", "time-wise,"), unstable=("it", "should"))
    split = la.update("Yes, time-wise, it should be")
    assert split.stable == ("Yes,", "time-wise,", "it")


@pytest.mark.parametrize(
    ("stable", "decoded", "final"),
    [
        ("And so my fellow", "And so am I fellow Americans.", "And so my fellow Americans."),
        ("And so my fellow", "And so my fellows Americans", "And so my fellow Americans"),
        ("What you are", "What your country can do for you!", "What you are can do for you!"),
        # The decode's punctuation after the last stable word is kept (the final still starts
        # with the stable text): a sentence whose every word was stable keeps its stop.
        ("the cat", "The cat, sat on the mat.", "the cat, sat on the mat."),
        ("ask not what you", "Ask not what you.", "ask not what you."),
        ("And so my", "And so, my fellow", "And so my fellow"),  # inside: the promise holds
        # The decode joined more to the last stable word with a hyphen: it grows by it, where
        # one for one wrote "time time-wise," (the English corpus's dialogue).
        ("Yes, time", "Yes, a time-wise, it should be", "Yes, time-wise, it should be"),
        ("the well", "The well-known cat.", "the well-known cat."),
        # A partial went on past the stable "time" with "-wise,", kept as a unit of its own
        # (the stable text is shown as it was): the decode's "time-wise," stands for both.
        ("Yes, time -wise,", "Yes, a time-wise, it should", "Yes, time -wise, it should"),
        ("Yes, time -wise", "Yes, a time-wise, it", "Yes, time -wise, it"),
        ("one two three", "one two", "one two three"),
        ("a b", "", "a b"),
        ("", "Thank you.", "Thank you."),
    ],
)
def test_keep_stable(stable: str, decoded: str, final: str) -> None:
    assert keep_stable(stable.split(), decoded) == final


@pytest.mark.parametrize(
    ("stable", "decoded", "following", "final"),
    [
        # The decode wrote the last stable words in fewer words: one for one, "thirty eight"
        # stood for "38 apples." and "apples." was lost.
        ("I have thirty eight", "I have 38 apples.", "apples", "I have thirty eight apples."),
        # In more words: one for one, "38" stood for "thirty" and "eight" was repeated.
        ("I have 38", "I have thirty eight apples.", "apples", "I have 38 apples."),
        # The partial wrote the next word shorter: it still finds it (the corpus's Italian,
        # where one for one lost "nacquero").
        (
            "Sempre la radio",
            "Sempre all'aradio nacquero anche alcuni",
            "nacque i",
            "Sempre la radio nacquero anche alcuni",
        ),
        # The word the partial showed next is not in the decode near there: one for one.
        ("I have thirty eight", "I have 38 apples.", "pears", "I have thirty eight"),
        (
            "What you are",
            "What your country can do for you!",
            "can",
            "What you are can do for you!",
        ),
        # Where the stable text's last word anchors, the partial's next words change nothing.
        (
            "And so my fellow",
            "And so am I fellow Americans.",
            "citizens",
            "And so my fellow Americans.",
        ),
    ],
)
def test_keep_stable_goes_on_where_the_partial_went_on_after_a_rewritten_end(
    stable: str, decoded: str, following: str, final: str
) -> None:
    assert keep_stable(stable.split(), decoded, following.split()) == final


@settings(max_examples=200)
@given(
    st.lists(st.sampled_from(["a", "b", "c", "the", "-d"]), max_size=6),
    st.lists(st.sampled_from(["a", "b", "c", "the", "d.", "C.", "c-d"]), max_size=8),
    st.lists(st.sampled_from(["a", "b", "d", "the"]), max_size=3),
)
def test_keep_stable_always_starts_with_the_stable_words(
    stable: list[str], decoded: list[str], following: list[str]
) -> None:
    final = keep_stable(stable, " ".join(decoded), following).split()
    if stable:
        assert final[: len(stable) - 1] == stable[:-1]
        # The last one may have grown by the decode's punctuation or hyphenated rest.
        last = final[len(stable) - 1]
        assert last == stable[-1] or last[len(stable[-1]) :] in {".", "-d"}
