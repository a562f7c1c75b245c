"""A modelled link for the link probe's unit tests: what ``measure_kind`` drives, without a process group."""

from torchrec_het.planner.link_probe import Pattern


class ModelledRounds:
    """Rounds on a link of ``bytes_per_ms`` with ``latency_ms`` a round. Noise: rounds, by index, in
    ``slow_rounds`` take ``slowdown`` times as long, and each round's time is scaled by
    ``noise(nbytes, nth)`` (``nth``: rounds of that size before it)."""

    def __init__(self, bytes_per_ms, latency_ms=0.3, deadline_s=2.0, slow_rounds=(), slowdown=3.0, peers=1, noise=None):
        self.pattern = Pattern(tuple(range(peers)), tuple(range(peers)), peers)
        self.bytes_per_ms, self.latency_ms, self.deadline_s = bytes_per_ms, latency_ms, deadline_s
        self.slow_rounds, self.slowdown = set(slow_rounds), slowdown
        self.noise = noise or (lambda nbytes, nth: 1.0)
        self.rounds = self.bytes_sent = 0
        self.spent_s = 0.0
        self.sizes: list[int] = []

    def run(self, nbytes: int) -> float:
        sent = self.pattern.sender_bytes(nbytes)
        seconds = (self.latency_ms + sent / self.bytes_per_ms) / 1e3 * self.noise(sent, self.sizes.count(sent))
        if self.rounds in self.slow_rounds:
            seconds *= self.slowdown
        self.rounds += 1
        self.bytes_sent += sent
        self.spent_s += seconds
        self.sizes.append(sent)
        return seconds

    def time_left(self) -> float:
        return self.deadline_s - self.spent_s

    def restart_clock(self) -> None:
        self.spent_s = 0.0
