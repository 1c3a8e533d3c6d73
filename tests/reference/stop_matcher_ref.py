"""The slow, obviously-correct stop matching that llamax.sequence.StopMatcher must equal: the whole
text is kept and searched again from its start at every piece (quadratic over a generation)."""


class RefStopMatcher:
    """After each piece: if any stop string occurs in the text, the text ends at the earliest
    occurrence and the rest of it before that point is handed out; otherwise everything but the
    longest tail that a stop string starts with (among what is not handed out yet) is handed out."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0
        self.hit = False

    def push(self, piece):
        if self.hit:
            return "", True
        self.text += piece
        hits = [i for i in (self.text.find(s) for s in self.stops) if i >= 0]
        if hits:
            cut = max(min(hits), self.sent)
            out, self.text, self.sent, self.hit = self.text[self.sent:cut], self.text[:cut], cut, True
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(1, len(s)):
                if k <= len(self.text) - self.sent and self.text.endswith(s[:k]):
                    hold = max(hold, k)
        end = len(self.text) - hold
        out, self.sent = self.text[self.sent:end], end
        return out, False

    def flush(self):
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
