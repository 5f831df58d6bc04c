"""Who said what: a stream's speakers told apart online, from the speaker embeddings of its
finals' audio.

A diarized stream's final decode asks the engine for embeddings of `speaker_windows` over its
utterance: windows of WINDOW_MS every HOP_MS (one window for a shorter utterance), embedded with
CAM++ after the batch's decodes (engines/speakers.py). `SpeakerTracker.label` then decides each
window's speaker once, when the final is sent, and never revises it:

1. An utterance whose windows fall into several voices is split where they change (the split
   whose two sides' means are least alike, while less alike than `change_similarity`, then each
   side again): people who spoke without a pause between them are separate captions. Each
   word is the speaker of the window nearest it, and a change between two words then moves to
   the nearest sentence end within SENTENCE_SNAP_MS (`by_speaker`).
2. Each part goes to the known speaker whose centroid (the mean of the windows given to it) it
   is most like, if at least `join_similarity`; else it is a new speaker, while fewer than
   `max_speakers` are known and the part is long enough to tell (a short "yes" is too little
   to found a speaker on: it goes to the nearest known one unless it is unlike every one of
   them, below `SHORT_NEW_SIMILARITY`). A run of windows inside a part that is nearer another
   known speaker (`known_voice_windows`, `known_voice_margin`) goes to that speaker: a few
   windows of one voice in a long part of another hardly move the part's mean.

With `[stream] cut_at_speaker_change`, `live_change` finds the first split while the utterance
still goes on, once LIVE_CHANGE_WINDOWS of the new voice are in, and the session cuts it there
if `SpeakerTracker.tells_apart` the two sides.

The thresholds were measured on the public dialogues and meetings
(docs/measurements/diarization.md) and chosen where DER is flat around them.

`offline_labels` is the same models' whole-recording reference: every window of the file
clustered at once (average-linkage agglomerative clustering on cosine distance), small clusters
merged into their nearest. `captiond bench diarize` compares the two.

Pure numpy (Sans-I/O), on the thread that feeds the session (the event loop's).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from scipy.cluster.hierarchy import fcluster, linkage

from captiond.lang.text import ends_sentence, join_units
from captiond.samples import ms_to_samples, samples_to_ms
from captiond.streaming.events import Final, Speech, Word

WINDOW_MS = 1_500
HOP_MS = 750
# The shortest utterance worth a window: CAM++ on less than this says little about the voice.
MIN_WINDOW_MS = 400
# A part of an utterance may be one window long: in the meetings, a turn of under two seconds
# between two others in one breath is common.
MIN_TURN_WINDOWS = 1
# Measured on the public dialogues and meetings (docs/measurements/diarization.md): pooled DER
# is within 0.1 point from 0.40 to 0.47 for the join and moves by 0.6-1.1 points at 0.55 and
# 0.65 for the change.
JOIN_SIMILARITY = 0.45
CHANGE_SIMILARITY = 0.6
# A change inside an utterance still going on cuts it once this many windows of the new voice
# are in (`live_change`): 2 windows are 2.25 s of the new speaker's speech.
LIVE_CHANGE_WINDOWS = 2
# A part of fewer than this many windows founds a new speaker only when it is unlike every
# known one below SHORT_NEW_SIMILARITY: with 2, one meeting grew two phantom speakers.
SURE_NEW_WINDOWS = 3
SHORT_NEW_SIMILARITY = 0.25
# A run of this many windows inside one part, each nearer another known speaker's centroid
# than the part's own by KNOWN_VOICE_MARGIN, is that speaker's: `_split` compares the means of
# two sides, and a few windows of one known voice inside a long part of another (one
# speaker's turn run on into the next's) hardly move the mean. On the public clips the labels
# are the same for runs of 1 to 3 windows and margins of 0 to 0.2, and only one dialogue
# changes (docs/measurements/diarization.md).
KNOWN_VOICE_WINDOWS = 2
KNOWN_VOICE_MARGIN = 0.1
# The whole-recording reference's threshold and smallest cluster (offline_labels), tuned on
# the same clips: pooled DER 2.1 % there, 5.6 % at 0.45 and 10 % at 0.35 (a knife edge the
# live tracker does not have; docs/measurements/diarization.md).
OFFLINE_SIMILARITY = 0.4
OFFLINE_MIN_CLUSTER = 5
# A change of speaker between two words moves to the nearest sentence end within this many
# ms of it (`by_speaker`): the windows place a change only to within a hop, while people
# mostly hand over at the end of a sentence, which Whisper's punctuation marks.
SENTENCE_SNAP_MS = HOP_MS

Embeddings = npt.NDArray[np.float32]


def speaker_windows(
    voiced: Sequence[tuple[int, int]], *, growing: bool = False
) -> tuple[tuple[int, int], ...]:
    """The windows (start, end samples) to embed over an utterance's voiced stretches: in each,
    WINDOW_MS long every HOP_MS, the last one ending at the stretch's end; a shorter stretch is
    one window; stretches under MIN_WINDOW_MS none, unless the utterance has no other speech
    (then its longest is the window). `growing` (the utterance is still going on): only the
    whole windows on each stretch's HOP_MS grid, which stay where they are as the stretch
    grows, so that each is embedded once (`live_change`) and the final reuses it."""
    window = ms_to_samples(WINDOW_MS)
    hop = ms_to_samples(HOP_MS)
    shortest = ms_to_samples(MIN_WINDOW_MS)
    out: list[tuple[int, int]] = []
    for start, end in voiced:
        if end - start < (window if growing else shortest):
            continue
        if end - start <= window:
            out.append((start, end))
            continue
        starts = list(range(start, end - window + 1, hop))
        if starts[-1] + window < end and not growing:
            starts.append(end - window)
        out += [(s, s + window) for s in starts]
    if not out and voiced and not growing:
        out.append(max(voiced, key=lambda span: span[1] - span[0]))
    return tuple(out)


def live_change(
    embeddings: Sequence[Sequence[float]], change_similarity: float = CHANGE_SIMILARITY
) -> int | None:
    """The first window of a new voice in an utterance still going on (its windows so far, in
    order), once LIVE_CHANGE_WINDOWS of it are in: where the session cuts the utterance, so
    that the first speaker's final need not wait for the second to stop. None: one voice so
    far, or too little of the new one to be sure. The parts are `_split`'s, as at the final."""
    if len(embeddings) < MIN_TURN_WINDOWS + LIVE_CHANGE_WINDOWS:
        return None
    parts = _split(np.asarray(embeddings, dtype=np.float32), change_similarity)
    at = 0
    for part in parts[:-1]:
        at += len(part)
        if len(embeddings) - at >= LIVE_CHANGE_WINDOWS:
            return at
    return None


def speech_in(
    stretches_ms: Iterable[tuple[int, int]], start_ms: int, end_ms: int
) -> tuple[Speech, ...]:
    """The stretches (start, end ms) inside [start_ms, end_ms], cropped to it, as `speech`."""
    out: list[Speech] = []
    for a, b in stretches_ms:
        start, end = max(a, start_ms), min(b, end_ms)
        if end > start:
            out.append(Speech(start_ms=start, end_ms=end))
    return tuple(out)


def by_speaker(
    final: Final,
    spans: Sequence[tuple[int, int]],
    labels: Sequence[int],
    snap_ms: int = SENTENCE_SNAP_MS,
) -> list[Final]:
    """`final` with its speakers: each word gets the speaker of the window whose middle is
    nearest the word's, a change between two words moves to the nearest sentence end within
    `snap_ms` (`_at_sentence_ends`), and each run of one speaker's words is a final of its own
    (all but the first keep `final.segment`, for the session to number). Without words, the
    final is the speaker of most of its windows; without windows, nobody's. The parts tile the
    final's span, meeting halfway between one's last word and the next's first, and each keeps
    the `speech` inside its own span."""
    if not labels:
        return [final]
    middles_ms = np.array([samples_to_ms((a + b) // 2) for a, b in spans])
    if not final.words:
        counts = np.bincount(np.asarray(labels))
        return [dataclasses.replace(final, speaker=int(counts.argmax()))]
    words = _at_sentence_ends(
        [
            dataclasses.replace(
                w, speaker=labels[int(np.abs(middles_ms - (w.start_ms + w.end_ms) / 2).argmin())]
            )
            for w in final.words
        ],
        snap_ms,
    )
    runs: list[list[Word]] = []
    for word in words:
        if runs and runs[-1][-1].speaker == word.speaker:
            runs[-1].append(word)
        else:
            runs.append([word])
    # Where one run's speaker hands over to the next's: the middle of the pause between them,
    # so that the speech there with no word written (a breath, an "uh") is split, not dropped.
    # Words whose times overlap across the change keep their parts' spans overlapping.
    meets_ms = [(a[-1].end_ms + b[0].start_ms) // 2 for a, b in itertools.pairwise(runs)]
    starts_ms = [
        final.start_ms,
        *(min(m, b[0].start_ms) for m, b in zip(meets_ms, runs[1:], strict=True)),
    ]
    ends_ms = [
        *(max(m, a[-1].end_ms) for m, a in zip(meets_ms, runs[:-1], strict=True)),
        final.end_ms,
    ]
    heard = [(s.start_ms, s.end_ms) for s in final.speech]
    return [
        dataclasses.replace(
            final,
            start_ms=start_ms,
            end_ms=end_ms,
            text=join_units([w.word for w in run]).strip(),
            words=tuple(run),
            speaker=run[0].speaker,
            speech=speech_in(heard, start_ms, end_ms),
        )
        for run, start_ms, end_ms in zip(runs, starts_ms, ends_ms, strict=True)
    ]


def _at_sentence_ends(words: list[Word], snap_ms: int) -> list[Word]:
    """`words` (with their windows' speakers) with each change of speaker moved to the nearest
    sentence end within `snap_ms` of it, if there is one, and short of the changes before and
    after it, so that every run of one voice keeps a word. The utterance's start and end are
    not sentence ends to move to: a run of a few words could then vanish into its neighbour's
    sentence ("... a lot of games | to play."); their words were more often right, but the
    speech they were heard in was the other voice's, and a "so | okay." lost its second
    speaker (docs/measurements/diarization.md)."""
    if snap_ms <= 0 or len(words) < 2:
        return words

    def at_ms(k: int) -> int:  # the middle of the pause before words[k]
        return (words[k - 1].end_ms + words[k].start_ms) // 2

    ends = [k for k in range(1, len(words)) if ends_sentence(words[k - 1].word)]
    who = [w.speaker for w in words]
    changes = [k for k in range(1, len(words)) if who[k - 1] != who[k]]
    bounds = [0, *changes, len(words)]
    for n, k in enumerate(changes):
        near = [e for e in ends if bounds[n] < e < bounds[n + 2]]
        if not near:
            continue
        to = min(near, key=lambda e: abs(at_ms(e) - at_ms(k)))
        if abs(at_ms(to) - at_ms(k)) > snap_ms:
            continue
        before, after = who[k - 1], who[k]
        for j in range(min(k, to), max(k, to)):
            who[j] = after if to < k else before
    return [dataclasses.replace(w, speaker=s) for w, s in zip(words, who, strict=True)]


def _unit(vector: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm > 0 else vector


@dataclass(slots=True)
class _Speaker:
    total: npt.NDArray[np.float32]
    windows: int

    @property
    def centroid(self) -> npt.NDArray[np.float32]:
        return _unit(self.total)


@dataclass(slots=True)
class SpeakerTracker:
    """One stream's speakers, numbered from 0 in the order they first spoke."""

    max_speakers: int = 8
    join_similarity: float = JOIN_SIMILARITY
    change_similarity: float = CHANGE_SIMILARITY
    known_voice_windows: int = KNOWN_VOICE_WINDOWS
    known_voice_margin: float = KNOWN_VOICE_MARGIN
    _speakers: list[_Speaker] = field(default_factory=list)

    @property
    def speakers(self) -> int:
        return len(self._speakers)

    def label(self, embeddings: Sequence[Sequence[float]] | Embeddings) -> list[int]:
        """The speaker of each window of one utterance, in order (empty: no windows)."""
        if not len(embeddings):
            return []
        vectors = np.asarray(embeddings, dtype=np.float32)
        labels: list[int] = []
        for part in _split(vectors, self.change_similarity):
            for piece in self._known_voices(part):
                labels += [self._place(piece)] * len(piece)
        return labels

    def _known_voices(self, part: Embeddings) -> list[Embeddings]:
        """`part` in pieces where a run of at least `known_voice_windows` windows is nearer
        another known speaker than the speaker the part goes to (by `known_voice_margin`); the
        rest stays one piece between them. With fewer than two speakers known, whole."""
        shortest = self.known_voice_windows
        if len(self._speakers) < 2 or len(part) <= shortest:
            return [part]
        whole = self._nearest(part)
        if whole is None:
            return [part]
        centroids = np.array([s.centroid for s in self._speakers])
        norms = np.linalg.norm(part, axis=1, keepdims=True)
        similarity = (part / np.where(norms > 0, norms, 1)) @ centroids.T
        nearest = similarity.argmax(axis=1)
        elsewhere = (nearest != whole) & (
            similarity.max(axis=1) - similarity[:, whole] >= self.known_voice_margin
        )
        voice = np.where(elsewhere, nearest, -1)  # -1: the part's own
        pieces: list[tuple[int, int, bool]] = []  # start, end, another known voice
        start = 0
        for end in range(1, len(part) + 1):
            if end < len(part) and voice[end] == voice[start]:
                continue
            other = voice[start] >= 0 and end - start >= shortest
            if not other and pieces and not pieces[-1][2]:
                pieces[-1] = (pieces[-1][0], end, False)
            else:
                pieces.append((start, end, other))
            start = end
        return [part[a:b] for a, b, _ in pieces]

    def tells_apart(
        self, before: Sequence[Sequence[float]], after: Sequence[Sequence[float]]
    ) -> bool:
        """Whether two runs of windows would go to different speakers (a new one counts as
        different): a cut at a change `live_change` found is for good, so it is made only
        where the labels would differ too, not at a wobble within one known voice."""
        first = self._nearest(np.asarray(before, dtype=np.float32))
        second = self._nearest(np.asarray(after, dtype=np.float32))
        return first is None or second is None or first != second

    def _nearest(self, part: Embeddings) -> int | None:
        """The known speaker `part` goes to; None: a new one."""
        mean = _unit(part.mean(axis=0))
        if self._speakers:
            similarity = np.array([float(mean @ s.centroid) for s in self._speakers])
            best = int(similarity.argmax())
            best_similarity = float(similarity[best])
        else:
            return None
        sure = len(part) >= SURE_NEW_WINDOWS
        new = (
            best_similarity < self.join_similarity
            and (sure or best_similarity < SHORT_NEW_SIMILARITY)
            and len(self._speakers) < self.max_speakers
        )
        return None if new else best

    def _place(self, part: Embeddings) -> int:
        best = self._nearest(part)
        if best is None:
            self._speakers.append(_Speaker(part.sum(axis=0), len(part)))
            return len(self._speakers) - 1
        speaker = self._speakers[best]
        speaker.total = speaker.total + part.sum(axis=0)
        speaker.windows += len(part)
        return best


def _split(vectors: Embeddings, change_similarity: float) -> list[Embeddings]:
    """The utterance's windows in parts of one voice each: split at the point whose two sides'
    means are least alike, while they are less alike than `change_similarity` and each side has
    at least MIN_TURN_WINDOWS, and each side again (three people in one breath)."""
    n = len(vectors)
    if n < 2 * MIN_TURN_WINDOWS:
        return [vectors]
    best_at, best_similarity = 0, 1.0
    for at in range(MIN_TURN_WINDOWS, n - MIN_TURN_WINDOWS + 1):
        similarity = float(_unit(vectors[:at].mean(axis=0)) @ _unit(vectors[at:].mean(axis=0)))
        if similarity < best_similarity:
            best_at, best_similarity = at, similarity
    if best_similarity >= change_similarity:
        return [vectors]
    return _split(vectors[:best_at], change_similarity) + _split(
        vectors[best_at:], change_similarity
    )


def offline_labels(
    embeddings: Embeddings,
    threshold: float = OFFLINE_SIMILARITY,
    *,
    min_cluster: int = OFFLINE_MIN_CLUSTER,
) -> npt.NDArray[np.int64]:
    """A whole recording's windows clustered at once: average-linkage agglomerative clustering
    on cosine distance (scipy), cut where clusters are less alike than `threshold` on average;
    clusters of fewer than `min_cluster` windows then join their most similar big cluster.
    Labels are numbered in order of first appearance."""
    n = len(embeddings)
    if n < 2:
        return np.zeros(n, dtype=np.int64)
    tree = linkage(embeddings.astype(np.float64), method="average", metric="cosine")
    raw = fcluster(tree, t=1.0 - threshold, criterion="distance")
    clusters = [np.flatnonzero(raw == c) for c in np.unique(raw)]
    big = [c for c in clusters if len(c) >= min_cluster] or clusters
    centroids = np.stack([_unit(embeddings[c].mean(axis=0)) for c in big])
    labels = np.zeros(n, dtype=np.int64)
    for cluster in clusters:
        labels[cluster] = int((centroids @ _unit(embeddings[cluster].mean(axis=0))).argmax())
    _, first = np.unique(labels, return_index=True)
    order = {int(labels[i]): rank for rank, i in enumerate(sorted(first))}
    return np.array([order[int(x)] for x in labels], dtype=np.int64)
